"""rope.py: M-RoPE vs 1D RoPE, FlatRoPE, relative positions, get_rope_index by hand and vs transformers.

run: python -m pytest -q tests/test_rope.py
"""
import types

import pytest
import torch

from rope import (
    apply_rope,
    check_mrope_section,
    flat_position_ids,
    get_rope_index,
    mrope_axis,
    mrope_cos_sin,
    rope_cos_sin,
    rope_inv_freq
)

IMG, VID, VS, VE, TXT = 90, 91, 88, 89, 7  # token ids used by the hand-worked cases
KW = dict(spatial_merge_size=2, image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS)


def ids(*parts):
    out = []
    for p in parts:
        out += p if isinstance(p, list) else [p]
    return torch.tensor([out])


# ---- rotary algebra ----


@pytest.mark.parametrize("section,interleaved", [((16, 24, 24), False), ((24, 20, 20), True), ((4, 2, 2), True)])
def test_mrope_equals_1d_rope_on_text(section, interleaved):
    D = 2 * sum(section)
    inv = rope_inv_freq(D, 1e6)
    pos = torch.randint(0, 5000, (2, 11))
    cos3, sin3 = mrope_cos_sin(pos.expand(3, -1, -1), inv, section, interleaved)
    cos1, sin1 = rope_cos_sin(pos, inv)
    assert torch.equal(cos3, cos1) and torch.equal(sin3, sin1)


def test_mrope_axis_layouts():
    assert mrope_axis((2, 1, 1), False).tolist() == [0, 0, 1, 2]
    # Qwen3-VL [24, 20, 20]: h on j%3==1, w on j%3==2 below 60, the tail 60..63 reads t
    ax = mrope_axis((24, 20, 20), True)
    assert [(ax == a).sum().item() for a in range(3)] == [24, 20, 20]
    assert ax[:6].tolist() == [0, 1, 2, 0, 1, 2] and ax[60:].tolist() == [0, 0, 0, 0]
    # chunked, hand-checked: pair j of a 3D position rotates by its own axis' id
    inv = rope_inv_freq(8, 100.0)
    pos = torch.tensor([5, 7, 11]).view(3, 1, 1)
    cos, _ = mrope_cos_sin(pos, inv, (2, 1, 1), False)
    expect = torch.cos(torch.tensor([5., 5., 7., 11.]) * inv)
    assert torch.allclose(cos[0, 0, :4], expect) and torch.allclose(cos[0, 0, 4:], expect)


def test_bad_mrope_section_error():
    with pytest.raises(ValueError, match=r"bad mrope_section \[16, 24, 20\].*head_dim // 2 = 64, got sum 60"):
        check_mrope_section([16, 24, 20], 128)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    D = 32
    inv = rope_inv_freq(D, 10000.0)
    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D)

    def score(m, n, section=None):
        pm, pn = torch.tensor([[m]]), torch.tensor([[n]])
        if section is None:
            (cm, sm), (cn, sn) = rope_cos_sin(pm, inv), rope_cos_sin(pn, inv)
        else:  # 3D: shift every axis by the same amount
            (cm, sm), (cn, sn) = (mrope_cos_sin(torch.stack([p, p + 3, p + 5]), inv, section, True) for p in (pm, pn))
        return (apply_rope(q, cm, sm) * apply_rope(k, cn, sn)).sum()

    for c in (1, 17, 1000):
        assert torch.allclose(score(9, 4), score(9 + c, 4 + c), atol=1e-4)
        assert torch.allclose(score(9, 4, (8, 4, 4)), score(9 + c, 4 + c, (8, 4, 4)), atol=1e-4)
    assert not torch.allclose(score(9, 4), score(9, 5), atol=1e-3)


# ---- FlatRoPE ----


def test_flat_position_ids_is_the_1d_index():
    x = ids(TXT, VS, [IMG] * 4, VE, TXT, TXT)
    pos, delta = flat_position_ids(x)
    assert torch.equal(pos, torch.arange(9).expand(3, 1, 9)) and delta.tolist() == [[0]]
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    pos, delta = flat_position_ids(torch.zeros(2, 5, dtype=torch.long), mask)
    assert pos[0].tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]] and delta.tolist() == [[-2], [0]]
    # text-only M-RoPE index == flat index
    text = torch.randint(0, 50, (2, 7))
    p3, d3 = get_rope_index(text, **KW)
    assert torch.equal(p3, torch.arange(7).expand(3, 2, 7)) and d3.abs().sum() == 0


# ---- get_rope_index, hand-worked ----


def test_image_between_text():
    # grid (1, 4, 4) with m = 2 -> 2 x 2 merged tokens, starting at id 3
    x = ids(TXT, TXT, VS, [IMG] * 4, VE, TXT)
    pos, delta = get_rope_index(x, torch.tensor([[1, 4, 4]]), **KW)
    assert pos[:, 0].tolist() == [[0, 1, 2, 3, 3, 3, 3, 5, 6],
                                  [0, 1, 2, 3, 3, 4, 4, 5, 6],
                                  [0, 1, 2, 3, 4, 3, 4, 5, 6]]
    assert delta.tolist() == [[7 - 9]]
    assert (torch.arange(9, 11) + delta).tolist() == [[7, 8]]  # decoded: cache index + rope_delta (VLA.step)


def test_two_images_of_different_grids():
    # image A grid (1, 4, 4): 2x2 tokens at id 1; image B grid (1, 2, 6): 1x3 tokens
    x = ids(VS, [IMG] * 4, VE, VS, [IMG] * 3, VE, TXT)
    pos, delta = get_rope_index(x, torch.tensor([[1, 4, 4], [1, 2, 6]]), **KW)
    assert pos[:, 0].tolist() == [[0, 1, 1, 1, 1, 3, 4, 5, 5, 5, 8, 9],
                                  [0, 1, 1, 2, 2, 3, 4, 5, 5, 5, 8, 9],
                                  [0, 1, 2, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert delta.tolist() == [[10 - 12]]


def test_video_time_axis_scaled():
    # grid (2, 4, 4), tokens_per_second 2, 1 s per grid -> t ids s, s + 2; text resumes at max + 1
    x = ids(TXT, VS, [VID] * 8, VE)
    pos, delta = get_rope_index(x, video_grid_thw=torch.tensor([[2, 4, 4]]), second_per_grid_ts=torch.tensor([1.0]),
                                tokens_per_second=2, **KW)
    assert pos[:, 0].tolist() == [[0, 1, 2, 2, 2, 2, 4, 4, 4, 4, 5],
                                  [0, 1, 2, 2, 3, 3, 2, 2, 3, 3, 5],
                                  [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 5]]
    assert delta.tolist() == [[6 - 11]]


def test_left_padding():
    row = [TXT, VS, IMG, IMG, IMG, IMG, VE]
    x = torch.tensor([[0, 0] + row, [TXT, TXT] + row])
    mask = torch.tensor([[0, 0] + [1] * 7, [1] * 9])
    pos, delta = get_rope_index(x, torch.tensor([[1, 4, 4], [1, 4, 4]]), attention_mask=mask, **KW)
    assert pos[0, 0].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 4]
    assert pos[1, 0].tolist() == [0, 0, 0, 1, 2, 2, 3, 3, 4]
    assert pos[0, 1].tolist() == [0, 1, 2, 3, 4, 4, 4, 4, 6]
    # the next token of both rows sits at padded cache index 9: row 0 -> id 5, row 1 -> id 7
    assert delta.tolist() == [[5 - 9], [7 - 9]]
    assert (9 + delta).tolist() == [[5], [7]]


def test_get_rope_index_errors():
    x = ids(VS, [IMG] * 3, VE)
    with pytest.raises(ValueError, match="has 3 placeholder tokens but its grid"):
        get_rope_index(x, torch.tensor([[1, 4, 4]]), **KW)
    with pytest.raises(ValueError, match="no matching entry in image_grid_thw"):
        get_rope_index(x, None, **KW)
    with pytest.raises(ValueError, match="more entries than there are image blocks"):
        get_rope_index(ids(TXT), torch.tensor([[1, 4, 4]]), **KW)
    with pytest.raises(ValueError, match="not preceded by the vision_start"):
        get_rope_index(ids(TXT, [IMG] * 4), torch.tensor([[1, 4, 4]]), **KW)


# ---- get_rope_index vs transformers ----


def hf_rope_index(input_ids, mask, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None, tps=1):
    modeling = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
    Model = modeling.Qwen2_5_VLModel
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=tps)),
        get_vision_position_ids=lambda *a, **k: Model.get_vision_position_ids(None, *a, **k))
    mm = (input_ids == IMG).int() + 2 * (input_ids == VID).int()
    return Model.get_rope_index(fake, input_ids, mm_token_type_ids=mm, image_grid_thw=image_grid_thw,
                                video_grid_thw=video_grid_thw, second_per_grid_ts=second_per_grid_ts,
                                attention_mask=mask)


def test_matches_transformers_images_and_padding():
    r0 = [TXT, VS] + [IMG] * 4 + [VE, TXT, VS] + [IMG] * 6 + [VE, TXT, TXT]
    r1 = [0, 0, 0, TXT, TXT, VS] + [IMG] * 9 + [VE, TXT, TXT]
    x = torch.tensor([r0, r1])
    mask = (x != 0).long()
    grids = torch.tensor([[1, 4, 4], [1, 4, 6], [1, 6, 6]])
    ours, d_ours = get_rope_index(x, grids, attention_mask=mask, **KW)
    ref, d_ref = hf_rope_index(x, mask, image_grid_thw=grids)
    assert torch.equal(ours, ref)
    # transformers 5 measures rope_delta against the unpadded length; we against the padded one
    assert torch.equal(d_ours, d_ref - (1 - mask).sum(-1, keepdim=True))


@pytest.mark.parametrize("tps,secs", [(1, [1.0, 1.0]), (2, [0.5, 0.25])])
def test_matches_transformers_videos(tps, secs):
    # two videos (t ids stay within the spatial extent, where the "resume" rules agree) plus an image
    x = ids(TXT, VS, [VID] * 8, VE, TXT, VS, [IMG] * 4, VE, VS, [VID] * 18, VE, TXT)
    vgrids, igrids = torch.tensor([[2, 4, 4], [2, 6, 6]]), torch.tensor([[1, 4, 4]])
    secs = torch.tensor(secs)
    ours, d_ours = get_rope_index(x, igrids, vgrids, secs, tokens_per_second=tps, **KW)
    ref, d_ref = hf_rope_index(x, None, igrids, vgrids, secs, tps=tps)
    assert torch.equal(ours, ref) and torch.equal(d_ours, d_ref)
