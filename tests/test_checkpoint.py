"""Checkpoints: parity with transformers' Qwen2.5-VL / Qwen3-VL (vision tower, DeepStack, video,
prefill and cached decode, both key layouts), Alpamayo prefix, shards, every load error on a broken
checkpoint, save/load round trips (target and draft), atomicity.

Parity: tiny random models built offline from config objects, O(1)-scale weights, fp32,
logits max |diff| <= 1e-4.
run: python -m pytest -q tests/test_checkpoint.py
"""
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file
import torch

from model import make_draft
from ops import checkpoint, files
from ops.checkpoint import load, save
from real.hf import load_pretrained
from rope import mrope_cos_sin, rope_inv_freq
from speculate import EMBED_KEYS
from tiny_models import IMG, VE, VID, VS, hf_qwen3, image_prompt, mm_token_type_ids, o1_init, qwen3_prompt, tiny_model

PARITY_TOL = 1e-4
MEASURED = {}  # max |diff| per parity check, printed at the end of the module (pytest -s)


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if MEASURED:
        print("\nparity max|diff|:", {k: f"{v:.2e}" for k, v in MEASURED.items()})


# ---- tiny Hugging Face models ----


def hf_qwen25(tmp):
    tf = pytest.importorskip("transformers")
    cfg = tf.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=1, tokens_per_second=1, window_size=8,
                           out_hidden_size=64, fullatt_block_indexes=[1]),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
        tie_word_embeddings=False)
    cfg._attn_implementation = "eager"  # the slow, obvious reference path
    torch.manual_seed(0)
    hf = o1_init(tf.Qwen2_5_VLForConditionalGeneration(cfg).eval(), seed=1)
    hf.save_pretrained(tmp)
    return hf


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen25")
    return hf_qwen25(d), d


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("qwen3")
    hf = hf_qwen3()
    hf.save_pretrained(d)
    return hf, d


def hf_logits(hf, prompt):
    with torch.no_grad():
        return hf(**prompt, mm_token_type_ids=mm_token_type_ids(prompt["input_ids"])).logits


def rewrite(src, dst, rename, extra=None, config=None):
    """Copy an HF folder with renamed keys (and extra tensors / another config.json)."""
    os.makedirs(dst, exist_ok=True)
    sd = load_file(os.path.join(src, "model.safetensors"))
    out = {rename(k): v for k, v in sd.items()}
    out.update(extra or {})
    save_file(out, os.path.join(dst, "model.safetensors"))
    cfg = config or json.load(open(os.path.join(src, "config.json")))
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def new_layout(k):
    """transformers 5's in-memory names: model.language_model.* and model.visual.*"""
    if k.startswith("model."):
        return "model.language_model." + k[len("model."):]
    return "model." + k if k.startswith("visual.") else k


def old_layout(k):
    """The older files' names: model.layers.* and visual.*"""
    for new, old in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if k.startswith(new):
            return old + k[len(new):]
    return k


def cached_decode(model, prompt, n=3):
    """Prefill all but the last n tokens (pixels included), then n single-token steps -> (1, L, V)."""
    cache = model.new_cache(max_len=64)
    L = prompt["input_ids"].shape[1] - n
    steps = [model(**dict(prompt, input_ids=prompt["input_ids"][:, :L]), cache=cache)]
    return torch.cat(steps + [model(prompt["input_ids"][:, i:i + 1], cache=cache) for i in range(L, L + n)], 1)


# ---- parity with transformers ----


@torch.no_grad()
def test_qwen25_vl_parity_both_layouts(qwen25, tmp_path):
    hf, d = qwen25
    assert any(k.startswith("model.layers.") for k in load_file(os.path.join(d, "model.safetensors")))
    prompt = image_prompt(seed=4)
    ref = hf_logits(hf, prompt)
    layouts = (("qwen2.5-vl old layout", d), ("qwen2.5-vl new layout", rewrite(d, tmp_path / "new", new_layout)))
    for name, path in layouts:
        ours = load_pretrained(path)
        assert ours.cfg.qkv_bias and not ours.cfg.mrope_interleaved and ours.cfg.vision.window_size == 8
        MEASURED[name] = diff = max_diff(ours(**prompt), ref)
        assert ref.abs().mean() > 0.3 and diff <= PARITY_TOL, diff
    # the KV-cache path agrees too (prefill then 3 single-token steps)
    MEASURED["qwen2.5-vl cached decode"] = diff = max_diff(cached_decode(ours, prompt), ref)
    assert diff <= PARITY_TOL


@torch.no_grad()
def test_qwen3_vl_parity_vision_deepstack_video_both_layouts(qwen3, tmp_path):
    """text + image + text + image of another grid + text + video (two temporal patches, each its own
    block), full prefill and the cached decode path, from either on-disk layout."""
    hf, d = qwen3
    assert any(k.startswith("model.language_model.") for k in load_file(os.path.join(d, "model.safetensors")))
    prompt = qwen3_prompt(seed=4)
    assert prompt["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    assert prompt["video_grid_thw"].tolist() == [[2, 4, 4]]
    ref = hf_logits(hf, prompt)
    for name, path in (("qwen3-vl new layout", d), ("qwen3-vl old layout", rewrite(d, tmp_path / "old", old_layout))):
        ours = load_pretrained(path)
        v = ours.cfg.vision
        assert v.family == "qwen3_vl" and v.deepstack_visual_indexes == (0, 1) and ours.cfg.video_frame_blocks
        MEASURED[name] = diff = max_diff(ours(**prompt), ref)
        assert ref.abs().mean() > 0.3 and diff <= PARITY_TOL, diff
        MEASURED[name + ", cached decode"] = diff = max_diff(cached_decode(ours, prompt), ref)
        assert diff <= PARITY_TOL, diff
    # DeepStack matters: the merged features as input embeddings alone are far from transformers
    inputs = [prompt[k] for k in EMBED_KEYS]  # embed's positional arguments
    embeds = ours.embed(*inputs)
    no_deepstack = ours(prompt["input_ids"], inputs_embeds=embeds, image_grid_thw=prompt["image_grid_thw"],
                        video_grid_thw=prompt["video_grid_thw"])
    assert max_diff(no_deepstack, ref) > 0.1
    # ... and the DeepStack features handed over with the embeddings restore it (speculate's prefill path)
    embeds, deepstack = ours.embed(*inputs, return_deepstack=True)
    assert [len(levels) for _, levels in deepstack] == [2, 2]  # image and video, two levels each
    again = ours(prompt["input_ids"], inputs_embeds=embeds, image_grid_thw=prompt["image_grid_thw"],
                 video_grid_thw=prompt["video_grid_thw"], deepstack=deepstack)
    assert max_diff(again, ref) <= PARITY_TOL


@torch.no_grad()
def test_qwen3_vl_text_and_3d_positions_parity(qwen3):
    hf, d = qwen3
    ours = load_pretrained(d)
    assert ours.cfg.qk_norm and ours.cfg.mrope_interleaved and ours.cfg.head_dim == 16
    ids = torch.randint(0, 97, (2, 14), generator=torch.Generator().manual_seed(0))
    ref = hf(input_ids=ids).logits
    MEASURED["qwen3-vl text"] = diff = max_diff(ours(ids), ref)
    assert ref.abs().mean() > 0.3 and diff <= PARITY_TOL
    # interleaved M-RoPE inside the model: distinct 3D ids through both implementations
    pos = torch.randint(0, 30, (3, 2, 14), generator=torch.Generator().manual_seed(1))
    ref3 = hf.lm_head(hf.model.language_model(input_ids=ids, position_ids=pos).last_hidden_state)
    MEASURED["qwen3-vl 3D positions"] = diff = max_diff(ours(ids, position_ids=pos), ref3)
    assert diff <= PARITY_TOL and max_diff(ref3, ref) > 1e-2


def test_qwen3_vl_missing_vision_field_is_named(qwen3, tmp_path):
    _, d = qwen3

    def drop(cfg):
        del cfg["vision_config"]["num_position_embeddings"]
    with pytest.raises(ValueError, match=r"\(vision_config\): missing config field 'num_position_embeddings'"):
        load_pretrained(broken(d, tmp_path / "novision", edit_cfg=drop))


def test_mrope_tables_match_transformers_rotary(qwen25, qwen3):
    pos = torch.randint(0, 500, (3, 2, 9), generator=torch.Generator().manual_seed(0))
    for (hf, _), section, interleaved in ((qwen25, (2, 3, 3), False), (qwen3, (4, 2, 2), True)):
        rot = hf.model.language_model.rotary_emb
        cos_ref, sin_ref = rot(torch.zeros(1, dtype=torch.float32), pos)
        cos, sin = mrope_cos_sin(pos, rope_inv_freq(16, rot.config.rope_parameters["rope_theta"]), section, interleaved)
        assert max_diff(cos, cos_ref) < 1e-6 and max_diff(sin, sin_ref) < 1e-6


@torch.no_grad()
def test_alpamayo_vlm_prefix(qwen3, tmp_path):
    """An Alpamayo folder whose VLM is nested under 'vlm.' (no action expert here: tests/test_alpamayo.py)."""
    hf, d = qwen3
    config = {"model_type": "alpamayo_r1", "vlm_name_or_path": "Qwen/Qwen3-VL-8B-Instruct", "vocab_size": 97,
              "vlm_config": json.load(open(os.path.join(d, "config.json")))}
    path = rewrite(d, tmp_path / "alpamayo", lambda k: "vlm." + k, config=config)
    ours = load_pretrained(path)
    prompt = qwen3_prompt(seed=5)
    MEASURED["alpamayo (qwen3-vl) vlm. prefix"] = diff = max_diff(ours(**prompt), hf_logits(hf, prompt))
    assert diff <= PARITY_TOL
    # expert keys without the expert_cfg that describes them are unknown keys, named
    extra = {"expert.layers.0.mlp.weight": torch.zeros(4, 4)}
    with pytest.raises(ValueError, match=r"unexpected 1 \['expert.layers.0.mlp.weight'\]"):
        load_pretrained(rewrite(d, tmp_path / "stray", lambda k: "vlm." + k, extra, config))


@torch.no_grad()
def test_sharded_checkpoint(qwen25, tmp_path):
    hf, d = qwen25
    sd = load_file(os.path.join(d, "model.safetensors"))
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: sd[k] for k in ks}, tmp_path / name)
    index = {"weight_map": {k: n for n, ks in shards.items() for k in ks}}
    json.dump(index, open(tmp_path / "model.safetensors.index.json", "w"))
    shutil.copy(os.path.join(d, "config.json"), tmp_path / "config.json")
    prompt = image_prompt(seed=5)
    assert max_diff(load_pretrained(tmp_path)(**prompt), hf_logits(hf, prompt)) <= PARITY_TOL


# ---- load errors on broken checkpoints ----


def broken(src, dst, edit_sd=None, edit_cfg=None):
    """A copy of an HF folder with its tensors and / or config.json edited in place."""
    sd = load_file(os.path.join(src, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    if edit_sd:
        edit_sd(sd)
    if edit_cfg:
        edit_cfg(cfg)
    os.makedirs(dst, exist_ok=True)
    save_file(sd, os.path.join(dst, "model.safetensors"))
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_load_pretrained_errors(qwen25, tmp_path):
    _, d = qwen25
    with pytest.raises(FileNotFoundError, match="nowhere: checkpoint folder not found"):
        load_pretrained(tmp_path / "nowhere")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"empty/config.json: file not found"):
        load_pretrained(tmp_path / "empty")
    shutil.copy(os.path.join(d, "config.json"), tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_pretrained(tmp_path / "empty")

    raw = open(os.path.join(d, "model.safetensors"), "rb").read()
    for name, data in (("truncated", raw[:len(raw) // 2]), ("corrupt", b"\xff" * 64 + raw[64:])):
        p = broken(d, tmp_path / name)
        open(os.path.join(p, "model.safetensors"), "wb").write(data)
        with pytest.raises(ValueError, match=f"{name}/model.safetensors: cannot read safetensors file "
                                             r"\(truncated or corrupt\?\)"):
            load_pretrained(p)

    def drop(sd):
        del sd["model.layers.1.self_attn.q_proj.weight"]
    with pytest.raises(ValueError, match=r"key mismatch: missing 1 \['layers.1.self_attn.q_proj.weight'\]"):
        load_pretrained(broken(d, tmp_path / "missing", drop))

    def add(sd):
        sd["model.layers.0.self_attn.rotary.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"missing 0 \[\]; unexpected 1 \['layers.0.self_attn.rotary.weight'\]"):
        load_pretrained(broken(d, tmp_path / "unexpected", add))

    def shrink(sd):
        sd["model.layers.0.mlp.down_proj.weight"] = sd["model.layers.0.mlp.down_proj.weight"][:, :95].clone()
    with pytest.raises(ValueError, match=r"shape/model.safetensors: shape mismatch for "
                                         r"'model.layers.0.mlp.down_proj.weight': expected \(64, 96\), got \(64, 95\)"):
        load_pretrained(broken(d, tmp_path / "shape", shrink))

    def llama(cfg):
        cfg["model_type"] = "llama"
    with pytest.raises(ValueError, match="unsupported architecture model_type='llama'"):
        load_pretrained(broken(d, tmp_path / "arch", edit_cfg=llama))

    def section(cfg):
        cfg["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 4]
    with pytest.raises(ValueError, match=r"config.json: bad mrope_section \[2, 3, 4\]: need 3 non-negative"):
        load_pretrained(broken(d, tmp_path / "section", edit_cfg=section))


# ---- our own checkpoints ----


@torch.no_grad()
def test_save_load_round_trip_target_and_draft(tmp_path):
    target = tiny_model(tie_word_embeddings=True)
    assert target.lm_head.weight is target.embed_tokens.weight
    prompt = image_prompt(seed=6)
    save(target, tmp_path / "target")
    t2 = load(tmp_path / "target")
    assert t2.lm_head.weight is t2.embed_tokens.weight and t2.cfg == target.cfg
    assert torch.equal(t2(**prompt), target(**prompt))
    x = torch.randn(2, 64)
    assert torch.equal(t2.traj(x), target.traj(x))

    draft = o1_init(make_draft(target, n_layers=1, hidden_size=32), seed=7)
    save(draft, tmp_path / "draft", target=target)
    stored = load_file(tmp_path / "draft" / "model.safetensors")
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in stored)
    d2 = load(tmp_path / "draft", target=t2)
    assert d2.embed_tokens is t2.embed_tokens and d2.lm_head is t2.lm_head
    ids = prompt["input_ids"]
    assert torch.equal(d2(ids), draft(ids))
    with pytest.raises(ValueError, match="holds a draft: pass target="):
        load(tmp_path / "draft")
    with pytest.raises(ValueError, match="draft expects a target of width 64"):
        load(tmp_path / "draft", target=tiny_model(hidden_size=128, n_heads=8))
    assert os.listdir(tmp_path / "draft") == ["model.safetensors"]


def resave(dir, sd=None, meta=None):
    """Rewrite dir/model.safetensors with other tensors and / or another "rsd-vla" header (by default its own)."""
    path = os.path.join(dir, "model.safetensors")
    with safe_open(path, framework="pt") as f:
        raw = f.metadata()
    save_file(load_file(path) if sd is None else sd, path,
              metadata=raw if meta is None else {"rsd-vla": json.dumps(meta)})
    return dir


def test_own_checkpoint_errors_and_atomic_write(tmp_path, monkeypatch):
    model = tiny_model()
    save(model, tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="checkpoint folder not found"):
        load(tmp_path / "nope")
    sd = load_file(tmp_path / "m" / "model.safetensors")
    sd["layers.0.mlp.gate_up.weight"] = sd["layers.0.mlp.gate_up.weight"][:10].clone()
    resave(tmp_path / "m", sd)
    with pytest.raises(ValueError, match=r"shape mismatch for 'layers.0.mlp.gate_up.weight': expected \(192, 64\), "
                                         r"got \(10, 64\)"):
        load(tmp_path / "m")
    del sd["norm.weight"]
    resave(tmp_path / "m", sd)
    with pytest.raises(ValueError, match=r"missing 1 \['norm.weight'\]"):
        load(tmp_path / "m")

    # a crash in the middle of writing leaves the previous checkpoint intact and no temp files
    save(model, tmp_path / "m")
    before = open(tmp_path / "m" / "model.safetensors", "rb").read()

    def crash(sd, path, **_):
        open(path, "wb").write(b"partial")
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        save(tiny_model(seed=1), tmp_path / "m")
    assert open(tmp_path / "m" / "model.safetensors", "rb").read() == before
    assert os.listdir(tmp_path / "m") == ["model.safetensors"]
    assert checkpoint.load(tmp_path / "m").cfg == model.cfg


def test_a_non_finite_weight_is_never_saved_and_named_at_load(tmp_path):
    """A diverged run's draft: save refuses it, a file holding one anyway (an older save) is one error naming the
    file and the tensor, and an empty folder is named as not a checkpoint (issue #33)."""
    target = tiny_model()
    draft = make_draft(target, n_layers=1)
    save(draft, tmp_path / "d", target=target)
    with torch.no_grad():
        draft.norm.weight[0] = float("nan")
    with pytest.raises(FloatingPointError, match="'norm.weight' holds NaN / inf"):
        save(draft, tmp_path / "d", target=target)
    with pytest.raises(FloatingPointError):  # a refused save leaves no folder behind (issue #43)
        save(draft, tmp_path / "new" / "d", target=target)
    assert not (tmp_path / "new").exists()
    sd = load_file(tmp_path / "d" / "model.safetensors")
    sd["norm.weight"][0] = float("inf")
    resave(tmp_path / "d", sd)
    with pytest.raises(ValueError, match=r"d/model.safetensors: tensor 'norm.weight' holds NaN / inf"):
        load(tmp_path / "d", target=target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/model.safetensors: no such file \(is .* a checkpoint folder"):
        load(tmp_path / "empty")


def test_a_full_disk_during_a_save_is_an_oserror_naming_the_file(full_disk, tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError: one OSError naming the file, nothing left."""
    from safetensors import SafetensorError
    out = full_disk or tmp_path
    if full_disk is None:  # no tmpfs to fill: the library's own error, as a full disk raises it
        monkeypatch.setattr(checkpoint, "save_file", lambda *a, **k: (_ for _ in ()).throw(SafetensorError("IoError")))
    with pytest.raises(OSError, match=r"d/model.safetensors: write failed .* MiB free"):
        save(tiny_model(), out / "d")
    assert not os.path.exists(out / "d")  # the folder the save made is gone too (#43: nothing left behind)


def test_own_config_requires_every_field(tmp_path):
    """Our format: the file's header holds the config, and a missing field is an error naming it (a default could
    change the logits); a file without our header (a Hugging Face one) is named as such."""
    save(tiny_model(), tmp_path / "m")
    good = checkpoint.header(tmp_path / "m")[0]

    def drop(*keys):
        def edit(meta):
            for k in keys[:-1]:
                meta = meta[k]
            del meta[keys[-1]]
        return edit

    no_header = "model.safetensors: not a checkpoint written by checkpoint.save \\(no 'rsd-vla' header"
    cases = ((drop("config", "rope_theta"), r"model.safetensors: missing config field\(s\) \['rope_theta'\]"),
             (drop("config", "vision", "window_size"), r"\['vision.window_size'\]"),
             (drop("config"), no_header), (drop("draft"), no_header), (lambda meta: [meta], no_header),
             (lambda meta: meta["config"].update(colour="red"), r"bad config: unknown ModelConfig fields"))
    for edit, msg in cases:
        meta = json.loads(json.dumps(good))
        with pytest.raises(ValueError, match=msg):
            load(resave(tmp_path / "m", meta=edit(meta) or meta))
    save_file(load_file(tmp_path / "m" / "model.safetensors"), tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match=no_header + ".*use hf.load_pretrained"):
        load(tmp_path / "m")
    resave(tmp_path / "m", sd={}, meta=good)
    with pytest.raises(ValueError, match="model.safetensors: holds no tensors"):
        load(tmp_path / "m")


def test_hf_config_and_index_errors(qwen25, tmp_path):
    """Hugging Face folders: a RoPE scaling this code does not implement, a config that is not an object or lacks a
    field, an index without weight_map or pointing a key at the wrong shard, a file with no tensors: each named."""
    _, d = qwen25

    def yarn(cfg):
        cfg["text_config"]["rope_parameters"].update(rope_type="yarn", factor=4.0)
    with pytest.raises(ValueError, match=r"unsupported RoPE scaling rope_parameters.rope_type='yarn'"):
        load_pretrained(broken(d, tmp_path / "yarn", edit_cfg=yarn))

    def no_width(cfg):
        del cfg["text_config"]["hidden_size"]
    with pytest.raises(ValueError, match="config.json: missing config field 'hidden_size'"):
        load_pretrained(broken(d, tmp_path / "nowidth", edit_cfg=no_width))
    p = broken(d, tmp_path / "list")
    json.dump([1], open(os.path.join(p, "config.json"), "w"))
    with pytest.raises(ValueError, match="config.json: expected a JSON object, got list"):
        load_pretrained(p)
    p = broken(d, tmp_path / "empty")
    save_file({}, os.path.join(p, "model.safetensors"))
    with pytest.raises(ValueError, match="empty: the safetensors file"):
        load_pretrained(p)

    sd = load_file(os.path.join(d, "model.safetensors"))
    keys = sorted(sd)
    os.makedirs(tmp_path / "shards")
    shutil.copy(os.path.join(d, "config.json"), tmp_path / "shards")
    save_file({k: sd[k] for k in keys[::2]}, tmp_path / "shards" / "a.safetensors")
    save_file({k: sd[k] for k in keys[1::2]}, tmp_path / "shards" / "b.safetensors")
    index = tmp_path / "shards" / "model.safetensors.index.json"
    json.dump({"metadata": {}}, open(index, "w"))
    with pytest.raises(ValueError, match="index.json: no 'weight_map' object"):
        load_pretrained(tmp_path / "shards")
    weight_map = {k: "a.safetensors" if i % 2 == 0 else "b.safetensors" for i, k in enumerate(keys)}
    weight_map[keys[0]] = "b.safetensors"
    json.dump({"weight_map": weight_map}, open(index, "w"))
    with pytest.raises(ValueError, match=rf"maps 1 key\(s\) to .*b.safetensors, which does not hold them: .*{keys[0]}"):
        load_pretrained(tmp_path / "shards")


# ---- drafts bound to their target ----


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_draft_is_bound_to_its_target(tmp_path):
    target = tiny_model()
    save(target, tmp_path / "target")
    draft = o1_init(make_draft(target, n_layers=1), seed=7)
    save(draft, tmp_path / "draft", target=target)
    meta = checkpoint.header(tmp_path / "draft")[0]
    assert meta["target"] == checkpoint.fingerprint(target)
    assert meta["target"] == checkpoint.fingerprint(load(tmp_path / "target"))
    assert same_weights(load(tmp_path / "draft", target=load(tmp_path / "target")), draft)
    # the target read in another dtype keeps its file's fingerprint
    assert load(tmp_path / "draft", target=load(tmp_path / "target", dtype=torch.bfloat16)).cfg == draft.cfg
    # another target's weights (a retrained one) or config: the draft is stale, and the error says what changed
    with pytest.raises(ValueError, match=r"draft: stale draft: .*\(its weights [0-9a-f]{16} there, [0-9a-f]{16} in"):
        load(tmp_path / "draft", target=tiny_model(seed=1))
    with pytest.raises(ValueError, match=r"stale draft: .*\(its config [0-9a-f]{16} there"):
        load(tmp_path / "draft", target=tiny_model(rope_theta=500.0))
    # saving a draft needs the target whose embedding it shares
    with pytest.raises(ValueError, match="saving a draft needs target="):
        save(draft, tmp_path / "d2")
    with pytest.raises(ValueError, match="not the model whose embedding"):
        save(draft, tmp_path / "d2", target=tiny_model(seed=1))


# ---- atomic saves, kill -9, the writer lock ----


def killed(write):
    """Run write() in a forked child that SIGKILLs itself at the point write() patches in (a real kill -9)."""
    pid = os.fork()
    if pid == 0:
        try:
            write()
        finally:
            os._exit(1)  # reached only if the kill did not happen
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return pid


def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kill -9 is simulated with os.fork")
def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """kill -9 while the new weights are written: the previous checkpoint still loads (the killed writer leaves at
    most its hidden .tmp file), and the next save replaces it."""
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    save(old, tmp_path / "m")

    def partial(sd, path, **_):
        open(path, "wb").write(b"partial")
        die()

    def mid_weights():
        checkpoint.save_file = partial
        save(new, tmp_path / "m")
    killed(mid_weights)
    left = sorted(os.listdir(tmp_path / "m"))
    assert left[1:] == ["model.safetensors"] and left[0].startswith(".model.safetensors.") and left[0].endswith(".tmp")
    assert same_weights(load(tmp_path / "m"), old)
    save(new, tmp_path / "m")
    assert same_weights(load(tmp_path / "m"), new) and os.listdir(tmp_path / "m") == ["model.safetensors"]

    # a killed first save leaves only its .tmp: the folder counts as empty, and the retry writes the checkpoint
    killed(lambda: (setattr(checkpoint, "save_file", partial), save(new, tmp_path / "first")))
    assert checkpoint.existing_kind(tmp_path / "first") is None
    save(new, tmp_path / "first")
    assert os.listdir(tmp_path / "first") == ["model.safetensors"]

    # a single file (a training state): the previous one stays
    files.torch_save({"step": 1}, tmp_path / "s.pt")

    def mid_state():
        torch.save = lambda obj, path: (open(path, "wb").write(b"partial"), die())
        files.torch_save({"step": 2}, tmp_path / "s.pt")
    killed(mid_state)
    assert torch.load(tmp_path / "s.pt")["step"] == 1 and len(os.listdir(tmp_path)) == 4
    files.torch_save({"step": 2}, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt")["step"] == 2


SAVE_LOOP = """
import sys
from ops.checkpoint import save
from tiny_models import tiny_model
models = [tiny_model(seed=0), tiny_model(seed=1)]
for i in range(10**6):
    save(models[i % 2], sys.argv[1])
    print(i, flush=True)
"""


def test_kill_9_of_a_save_loop_leaves_a_loadable_checkpoint(tmp_path):
    """A real kill -9 of another process that saves in a loop, at whatever point it is: the folder loads, and holds
    one of the two models the loop writes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]), OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-c", SAVE_LOOP, str(tmp_path / "m")], stdout=subprocess.PIPE, env=env)
    for _ in range(3):  # a few saves done: it is in the middle of the next one
        assert child.stdout.readline(), "the save loop stopped"
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    back = load(tmp_path / "m")
    assert same_weights(back, tiny_model(seed=0)) or same_weights(back, tiny_model(seed=1))


def test_saved_files_are_group_readable(tmp_path):
    umask = os.umask(0o022)
    try:
        save(tiny_model(), tmp_path / "m")
        files.torch_save({"step": 1}, tmp_path / "s.pt")
    finally:
        os.umask(umask)
    for p in (tmp_path / "m" / "model.safetensors", tmp_path / "s.pt"):
        assert os.stat(p).st_mode & 0o777 == 0o644, p
    assert os.stat(tmp_path / "m").st_mode & 0o777 == 0o755


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_writer_lock_names_the_holder_and_outlives_no_kill_9(tmp_path, caplog):
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()

    def hold_then_die():
        with files.writer_lock(tmp_path):
            os.write(ready_w, b"1")
            os.read(go_r, 1)  # hold the lock until the parent has tried
            die()  # ... and die holding it
    pid = os.fork()
    if pid == 0:
        try:
            hold_then_die()
        finally:
            os._exit(1)
    os.read(ready_r, 1)
    with pytest.raises(files.FolderLocked, match=rf"is being written by pid {pid} on .*: wait for it"):
        with files.writer_lock(tmp_path):
            pass
    os.write(go_w, b"1")
    os.waitpid(pid, 0)
    assert os.path.exists(tmp_path / files.LOCK)  # the killed holder's file stays, but locks nothing
    with caplog.at_level(logging.WARNING, logger="files"):
        with files.writer_lock(tmp_path):
            with files.writer_lock(tmp_path):  # re-entrant within a process
                pass
    assert f"stale lock of pid {pid}" in caplog.text
    assert not os.path.exists(tmp_path / files.LOCK)  # released: nothing left behind
    (tmp_path / "file").write_text("")
    with pytest.raises(PermissionError, match="file/run: output folder is not writable"):
        with files.writer_lock(tmp_path / "file" / "run"):
            pass
