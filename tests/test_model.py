"""model.py: KV cache equivalences, padding, FlatRoPE draft, sharing, patchify, errors.

All exactness checks run in fp32 with atol 1e-5 on logits of O(1) scale (O(1)-scale weights).
run: python -m pytest -q tests/test_model.py
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from model import PRESETS, KVCache, ModelConfig, VisionConfig, causal_mask, make_draft
from ops import compiled
from rope import flat_position_ids, rope_inv_freq
from speculate import feed
from tiny_models import IMG, VE, VS, image_prompt, o1_init, tiny_model
from vision import patchify

TOL = 1e-5


def close(a, b, tol=TOL):
    return (a - b).abs().max().item() <= tol


def decode_one_by_one(model, prompt, tokens, max_len=96):
    """Prefill the prompt, then feed tokens one at a time; logits of every position (1, L, V)."""
    cache = model.new_cache(max_len=max_len)
    out = [model(**prompt, cache=cache)]
    out += [model(tokens[:, i:i + 1], cache=cache) for i in range(tokens.shape[1])]
    return torch.cat(out, 1), cache


@pytest.fixture(scope="module")
def target():
    return tiny_model()


@pytest.fixture(scope="module")
def prompt():
    return image_prompt()


# ---- KV cache ----


@torch.no_grad()
@pytest.mark.parametrize("rope_mode", ["mrope", "flat"])
def test_prefill_then_decode_equals_full_forward(rope_mode):
    model = tiny_model(rope_mode=rope_mode)
    p = image_prompt()
    new = torch.tensor([[12, 13, 14, 15, 16]])
    full = model(**dict(p, input_ids=torch.cat([p["input_ids"], new], 1)))
    step, cache = decode_one_by_one(model, p, new)
    assert full.abs().mean() > 0.3 and close(step, full)
    assert cache.length == full.shape[1]


@torch.no_grad()
def test_multi_token_step_equals_one_by_one(target, prompt):
    new = torch.tensor([[12, 13, 14, 15]])
    step, c1 = decode_one_by_one(target, prompt, new)
    c2 = target.new_cache(max_len=96)
    target(**prompt, cache=c2)
    verify = target(new, cache=c2)  # the speculative verify step: T = 4 tokens over the cached prefix
    L = prompt["input_ids"].shape[1]
    assert close(verify, step[:, L:]) and c2.length == c1.length
    assert close(torch.stack(c2.k)[..., :c2.length, :], torch.stack(c1.k)[..., :c1.length, :])


@torch.no_grad()
@pytest.mark.parametrize("kind", ["target", "history-only draft"])
def test_the_prefill_is_one_step_and_leaves_the_cache_a_step_would(kind, monkeypatch):
    """A prefill is one VLA.step over the prompt (its embeddings, 3D positions and DeepStack), and the cache it leaves
    is the cache of a prefill of the prompt up to its text and a step over that text (1D positions after the prompt's,
    the rule of rope_delta); the history-only draft's too, which leaves the image and video tokens out of both."""
    target = tiny_model()
    model = target if kind == "target" else make_draft(target, n_layers=1, kind="history").eval()
    p = image_prompt(text_after=(7, 8, 9, 10, 11))
    L, k = p["input_ids"].shape[1], p["input_ids"].shape[1] - 4  # the last 4 text tokens are the step's
    grids = {g: p[g] for g in ("image_grid_thw", "video_grid_thw")}
    embeds = target.embed(**{n: v for n, v in p.items()})  # (1, L, D): the target's, as a decode's prefill has them

    steps, step = [], type(model).step
    monkeypatch.setattr(type(model), "step", lambda self, *a, **kw: steps.append((a, kw)) or step(self, *a, **kw))
    whole = model.new_cache(max_len=64)
    model(p["input_ids"], inputs_embeds=embeds, cache=whole, **grids)
    (args, kw), = steps  # one step: no token ids, the prompt's embeddings at (3, B, T) positions
    assert args[0] is None and args[4].shape[0] == 3 and args[6] is not None
    part = model.new_cache(max_len=64)
    model(p["input_ids"][:, :k], inputs_embeds=embeds[:, :k], cache=part, **grids)
    feed(model, part, p["input_ids"][:, k:])
    assert part.length == whole.length == model.prompt_slots(p["input_ids"])
    assert whole.length == (L if kind == "target" else L - 16)  # 4 image and 12 video tokens left out
    assert torch.equal(part.rope_delta, whole.rope_delta)
    for a, b in zip(part.k + part.v, whole.k + whole.v):
        assert close(a[..., :whole.length, :], b[..., :whole.length, :])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's SDPA kernels for the cached step")
@torch.no_grad()
def test_verify_step_on_cuda_equals_one_by_one(prompt):
    model = tiny_model().cuda()
    p = {k: v.cuda() for k, v in prompt.items()}
    new = torch.tensor([[12, 13, 14, 15]], device="cuda")
    step, _ = decode_one_by_one(model, p, new)
    cache = model.new_cache(max_len=96)
    model(**p, cache=cache)
    assert close(model(new, cache=cache), step[:, p["input_ids"].shape[1]:], 1e-4)


@torch.no_grad()
def test_crop_and_redecode_equals_fresh_prefill(target, prompt):
    L = prompt["input_ids"].shape[1]
    cache = target.new_cache(max_len=96)
    target(**prompt, cache=cache)
    target(torch.tensor([[12, 13, 14, 15, 16]]), cache=cache)  # 5 drafted tokens, 3 get rejected
    cache.crop(L + 2)
    redo = target(torch.tensor([[20, 21, 22]]), cache=cache)
    fresh = target(**dict(prompt, input_ids=torch.cat([prompt["input_ids"], torch.tensor([[12, 13, 20, 21, 22]])], 1)))
    assert close(redo, fresh[:, L + 2:]) and cache.length == L + 5
    with pytest.raises(ValueError, match="cannot crop KV cache of length"):
        cache.crop(L + 6)


@torch.no_grad()
def test_cache_overflow_error(target):
    cache = target.new_cache(max_len=8)
    target(torch.arange(10, 16)[None], cache=cache)
    with pytest.raises(ValueError, match=r"KV cache overflow: 6 \+ 3 tokens > max_len 8"):
        target(torch.tensor([[1, 2, 3]]), cache=cache)
    assert cache.length == 6  # the failed step wrote nothing
    with pytest.raises(ValueError, match="KV cache overflow"):
        KVCache(1, 1, 1, 2, 4).slots(3)


@torch.no_grad()
def test_left_padded_batch_equals_single_rows(target):
    a = image_prompt(seed=1, text_after=(7, 8, 9, 10, 11))
    b = image_prompt(seed=2, text_after=(7,))
    La, Lb = a["input_ids"].shape[1], b["input_ids"].shape[1]
    pad = La - Lb
    batch = dict(input_ids=torch.cat([a["input_ids"], F.pad(b["input_ids"], (pad, 0))]),
                 attention_mask=torch.cat([torch.ones(1, La, dtype=torch.long),
                                           F.pad(torch.ones(1, Lb, dtype=torch.long), (pad, 0))]),
                 pixel_values=torch.cat([a["pixel_values"], b["pixel_values"]]),
                 image_grid_thw=torch.cat([a["image_grid_thw"], b["image_grid_thw"]]),
                 pixel_values_videos=torch.cat([a["pixel_values_videos"], b["pixel_values_videos"]]),
                 video_grid_thw=torch.cat([a["video_grid_thw"], b["video_grid_thw"]]))
    new = torch.tensor([[12, 13], [14, 15]])
    ra, _ = decode_one_by_one(target, a, new[:1])
    rb, _ = decode_one_by_one(target, b, new[1:])
    full = target(**batch)
    assert close(full[0], ra[0, :La]) and close(full[1, pad:], rb[0, :Lb])
    cache = target.new_cache(batch=2, max_len=96)
    target(**batch, cache=cache)
    step = target(new, cache=cache)  # two tokens at once, per-row rope_delta, padded keys masked
    assert close(step[0], ra[0, La:]) and close(step[1], rb[0, Lb:])


# ---- FlatRoPE and the draft ----


@torch.no_grad()
def test_flat_mode_is_the_same_decoder_fed_flat_ids(prompt):
    mrope, flat = tiny_model(), tiny_model(rope_mode="flat")
    assert close(flat(**prompt), mrope(**prompt, position_ids=flat_position_ids(prompt["input_ids"])[0]))
    assert not close(flat(**prompt), mrope(**prompt), 1e-2)  # images really move under M-RoPE
    text = torch.randint(10, 80, (1, 12))
    assert close(flat(text), mrope(text))  # M-RoPE == 1D RoPE on text


@torch.no_grad()
def test_draft_shares_embedding_and_head(target, prompt):
    draft = make_draft(target, n_layers=1, hidden_size=32)
    assert draft.embed_tokens is target.embed_tokens and draft.lm_head is target.lm_head
    own = {id(p) for p in draft.parameters()}
    assert not own & {id(p) for p in target.parameters()}
    assert not any(k.startswith(("embed_tokens", "lm_head", "visual", "traj")) for k in draft.state_dict())
    assert draft.proj_in.weight.shape == (32, 64) and draft.cfg.n_heads == 2 and draft.cfg.head_dim == 16
    twin = copy.deepcopy(draft)  # e.g. AARL's frozen reference draft
    assert twin.embed_tokens is target.embed_tokens and twin.layers[0] is not draft.layers[0]
    # the draft reads the target's image embeddings; its cache gives the same logits as a full pass
    o1_init(draft, seed=3)
    embeds = target.embed(prompt["input_ids"], prompt["pixel_values"], prompt["image_grid_thw"],
                          prompt["pixel_values_videos"], prompt["video_grid_thw"])
    grids = dict(image_grid_thw=prompt["image_grid_thw"], video_grid_thw=prompt["video_grid_thw"])
    ids = prompt["input_ids"]
    full = draft(ids, inputs_embeds=embeds, **grids)
    cache = draft.new_cache(max_len=64)
    head = draft(ids[:, :-3], inputs_embeds=embeds[:, :-3], **grids, cache=cache)
    tail = draft(ids[:, -3:], cache=cache)
    assert close(torch.cat([head, tail], 1), full)
    assert not close(full, draft(ids, **grids), 1e-2)  # image features, not placeholder embeddings
    replica = make_draft(target, kind="mrope")  # the baseline: same width, M-RoPE positions
    assert replica.proj_in is None and replica.cfg.n_heads == 4
    o1_init(replica, seed=3)
    r_full = replica(ids, inputs_embeds=embeds, **grids)
    flat_twin = make_draft(target, kind="flat")
    flat_twin.load_state_dict(replica.state_dict())
    assert not close(r_full, flat_twin(ids, inputs_embeds=embeds, **grids), 1e-2)
    with pytest.raises(ValueError, match="no vision tower"):
        draft(**prompt)


# ---- vision input ----


def test_patchify_matches_qwen_conv3d_patch_embedding(target):
    torch.manual_seed(0)
    frames = torch.randn(3, 3, 8, 12)  # T = 3 with temporal patch 2: the last frame is repeated
    pv, grid = patchify(frames, patch_size=2, temporal_patch_size=2, merge_size=2)
    assert grid.tolist() == [2, 4, 6] and pv.shape == (48, 3 * 2 * 2 * 2)
    w = torch.randn(5, 3, 2, 2, 2)  # Qwen's Conv3d kernel (out, C, tp, p, p)
    video = torch.cat([frames, frames[-1:]]).permute(1, 0, 2, 3)[None]  # (1, C, T, H, W)
    conv = F.conv3d(video, w, stride=(2, 2, 2))[0]  # (5, gt, gh, gw) in raster order
    # raster -> merge-block order: (gt, gh/m, m, gw/m, m) -> (gt, gh/m, gw/m, m, m)
    conv = conv.permute(1, 2, 3, 0).reshape(2, 2, 2, 3, 2, 5).permute(0, 1, 3, 2, 4, 5).reshape(48, 5)
    assert torch.allclose(pv @ w.reshape(5, -1).T, conv, atol=1e-5)
    with pytest.raises(ValueError, match="divisible by patch_size \\* merge_size = 4"):
        patchify(torch.randn(1, 3, 6, 8), 2, 1, 2)


def test_image_token_count_mismatch_error(target, prompt):
    bad = dict(prompt, input_ids=torch.tensor([[5, VS, IMG, IMG, IMG, VE]]))
    bad.pop("pixel_values_videos"), bad.pop("video_grid_thw")
    with pytest.raises(ValueError, match=r"3 image tokens \(id 90\) in input_ids but image_grid_thw \[\[1, 4, 4\]\] "
                                         r"gives 4 merged tokens"):
        target(**bad)


def test_window_attention_is_local(target):
    """Windowed blocks mix patches only inside a window of 2x2 merged tokens: perturbing one
    patch changes the 4 merged tokens of its window when every block is windowed, and all 16
    once a full-attention block follows."""
    vis = target.visual
    pv, grid = patchify(torch.randn(1, 3, 16, 16), 2, 1, 2)  # 8x8 patches -> 4x4 merged tokens
    order, lens = vis.windows(grid[None].tolist())
    assert lens.tolist() == [16] * 4 and order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
    poked = torch.cat([pv[:-1], pv[-1:] + 1])  # last patch: bottom-right window

    def changed():
        with torch.no_grad():
            return (vis(pv, grid[None]) - vis(poked, grid[None])).abs().amax(-1).gt(1e-6).nonzero().flatten().tolist()

    assert changed() == list(range(16))
    full, vis.vc.fullatt_block_indexes = vis.vc.fullatt_block_indexes, ()
    try:
        assert changed() == [10, 11, 14, 15]
    finally:
        vis.vc.fullatt_block_indexes = full


# ---- config ----


def test_config_validation_errors():
    with pytest.raises(ValueError, match="hidden_size 66 is not divisible by n_heads 4"):
        ModelConfig(hidden_size=66, n_heads=4, vision=None)
    with pytest.raises(ValueError, match=r"bad mrope_section \[8, 12, 10\]"):
        ModelConfig(mrope_section=(8, 12, 10))
    with pytest.raises(ValueError, match="n_heads 6 is not divisible by n_kv_heads 4"):
        ModelConfig(n_kv_heads=4)
    with pytest.raises(ValueError, match="window_size 10 must be a multiple"):
        VisionConfig(window_size=10)
    assert PRESETS["qwen3-vl-8b"].head_dim == 128 and PRESETS["qwen2.5-vl-7b"].head_dim == 128


@torch.no_grad()
def test_traj_head_and_bf16_decode(target, prompt):
    logits, h = target(**prompt, return_hidden=True)
    assert target.traj(h[:, -1]).shape == (1, 4, 2)
    m16 = tiny_model().to(torch.bfloat16)
    p16 = dict(prompt, pixel_values=prompt["pixel_values"].bfloat16(),
               pixel_values_videos=prompt["pixel_values_videos"].bfloat16())
    step, cache = decode_one_by_one(m16, p16, torch.tensor([[12, 13]]))
    assert cache.k[0].dtype == torch.bfloat16
    ref, _ = decode_one_by_one(target, prompt, torch.tensor([[12, 13]]))
    assert (step.float() - ref).abs().max() < 0.25 * ref.abs().max()  # bf16 rounding only


def test_rope_frequencies_stay_fp32_after_a_dtype_change():
    """model.to(bf16) converts weights, never the rotary frequencies (bf16 would round every angle)."""
    m = tiny_model().to(torch.bfloat16)
    assert m.inv_freq.dtype == torch.float32 and m.visual.inv_freq.dtype == torch.float32
    assert torch.equal(m.inv_freq, rope_inv_freq(m.cfg.head_dim, m.cfg.rope_theta))
    draft = make_draft(m, n_layers=1).to(torch.float16)
    assert draft.inv_freq.dtype == torch.float32


def test_padded_steps_equal_the_plain_step():
    """CompiledSteps (eager here: its padding to step lengths and its persistent cache, what --compile compiles)
    against the model's own cached steps: the same logits and the same cache contents, for a 1-token step, a 3-token
    verify padded to 4, and after a rollback whose stale slots the mask must hide."""
    model = tiny_model()
    draft = make_draft(model, n_layers=1, hidden_size=32)  # FlatRoPE, width bridge
    prompt = image_prompt()
    embeds = model.embed(**prompt)
    for m in (model, draft):
        fast = compiled.CompiledSteps(m, 48, step_lengths=(1, 4), compile=False)
        plain, fc = m.new_cache(max_len=48), fast.new_cache(max_len=40)
        for c in (plain, fc):
            m(prompt["input_ids"], inputs_embeds=embeds, cache=c, image_grid_thw=prompt["image_grid_thw"],
              video_grid_thw=prompt["video_grid_thw"])
        for x in ([[3]], [[4, 5, 6]], "crop", [[7]], [[8, 9]]):
            if x == "crop":  # reject the last 2 tokens of the verify step: their slots stay behind in the buffer
                plain.crop(plain.length - 2)
                fc.crop(fc.length - 2)
                continue
            x = torch.tensor(x)
            want, got = feed(m, plain, x), feed(fast, fc, x)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert fc.length == plain.length
            n = plain.length
            torch.testing.assert_close(torch.stack(fc.k)[..., :n, :], torch.stack(plain.k)[..., :n, :])
            torch.testing.assert_close(torch.stack(fc.v)[..., :n, :], torch.stack(plain.v)[..., :n, :])
    with pytest.raises(ValueError, match="a step of 5 tokens is longer than the longest step length"):
        feed(fast, fc, torch.tensor([[1, 2, 3, 4, 5]]))
    with pytest.raises(ValueError, match=r"a decode needs a cache of 46 positions \(\+ 3 of step padding\)"):
        fast.new_cache(max_len=46)
    with pytest.raises(ValueError, match="a cached continuation goes through .step"):
        fast(torch.tensor([[1]]), cache=fc)


@torch.no_grad()
def test_rows_with_their_own_lengths_equal_their_own_decodes():
    """The step and the cache with per-row lengths: two prompts of different lengths (left-padded into one prefill),
    then steps at each row's own slots, one row advancing 3 tokens while the other advances 1 and one rolled back;
    each row's logits equal its own batch-1 decode of the same tokens (fp32)."""
    model = tiny_model()
    a, b = torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), torch.tensor([[5, 9, 12]])
    pad = a.shape[1] - b.shape[1]
    ids = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], 1)])  # (2, 7) left-padded
    mask = torch.cat([torch.ones_like(a), torch.cat([torch.zeros(1, pad), torch.ones(1, b.shape[1])], 1).long()])
    cache = model.new_cache(batch=2, max_len=24)
    model(ids, attention_mask=mask, cache=cache, logits_to_keep=1)
    ca, cb = model.new_cache(max_len=24), model.new_cache(max_len=24)
    model(a, cache=ca), model(b, cache=cb)
    for xa, xb, keep in (([20, 21, 22], [30], None), ([23], [31], (0, 1)), ([24], [32], None)):
        T = max(len(xa), len(xb))
        x = torch.tensor([xa + [xa[-1]] * (T - len(xa)), xb + [xb[-1]] * (T - len(xb))])  # (2, T), the short row padded
        slots = cache.slots(T)  # (2, T)
        logits = model.step(x, slots, cache, causal_mask(slots, cache, max(cache.lengths) + T))  # (2, T, V)
        want_a, want_b = feed(model, ca, torch.tensor([xa])), feed(model, cb, torch.tensor([xb]))
        torch.testing.assert_close(logits[0, :len(xa)], want_a[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[1, :len(xb)], want_b[0], atol=1e-5, rtol=1e-5)
        cache.commit([len(xa), len(xb)])
        if keep:  # row 1 rejects its last token: the rollback is its length alone
            cache.crop([cache.lengths[0], cache.lengths[1] - keep[1]])
            cb.crop(cb.length - keep[1])
        with pytest.raises(ValueError, match="rows have different lengths"):
            cache.length
