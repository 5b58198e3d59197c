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

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoint
from checkpoint import load, load_pretrained, save
from model import make_draft
from rope import mrope_cos_sin, rope_inv_freq
from speculate import EMBED_KEYS
from tiny_models import (IMG, VE, VID, VS, hf_qwen3, image_prompt, mm_token_type_ids, o1_init, qwen3_prompt,
                         tiny_model)

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
    save(draft, tmp_path / "draft")
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
    assert sorted(os.listdir(tmp_path / "draft")) == ["config.json", "model.safetensors"]


def test_own_checkpoint_errors_and_atomic_write(tmp_path, monkeypatch):
    model = tiny_model()
    save(model, tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="checkpoint folder not found"):
        load(tmp_path / "nope")
    sd = load_file(tmp_path / "m" / "model.safetensors")
    sd["layers.0.mlp.gate_up.weight"] = sd["layers.0.mlp.gate_up.weight"][:10].clone()
    save_file(sd, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match=r"shape mismatch for 'layers.0.mlp.gate_up.weight': expected \(192, 64\), "
                                         r"got \(10, 64\)"):
        load(tmp_path / "m")
    del sd["norm.weight"]
    save_file(sd, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 \['norm.weight'\]"):
        load(tmp_path / "m")

    # a crash in the middle of writing leaves the previous checkpoint intact and no temp files
    save(model, tmp_path / "m")
    before = open(tmp_path / "m" / "model.safetensors", "rb").read()

    def crash(sd, path):
        open(path, "wb").write(b"partial")
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        save(tiny_model(seed=1), tmp_path / "m")
    assert open(tmp_path / "m" / "model.safetensors", "rb").read() == before
    assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "model.safetensors"]
    assert checkpoint.load(tmp_path / "m").cfg == model.cfg
