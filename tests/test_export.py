"""experiments/hf_export.py: our model as a Hugging Face Qwen2.5-VL folder. A round trip through load_pretrained
gives back every weight (the TrajHead excepted: not exported) and the same logits; transformers 5.24 loads the folder
and its logits match ours on a prompt with an image and a video; a draft becomes a standalone Qwen2.5-VL with the
target's embedding, LM head and vision tower, whose logits equal the draft's reading the target's embeddings; what
has no Qwen2.5-VL counterpart is refused, named.

Tiny random models, O(1)-scale weights, fp32, transformers logits max |diff| <= 1e-4 (as in test_checkpoint.py).
run: python -m pytest -q tests/test_export.py
"""
import dataclasses
import json
import os

import pytest
from safetensors.torch import load_file
import torch

from model import make_draft
from experiments.hf_export import export_pretrained
from real.hf import load_pretrained
from tiny_models import IMG, VID, image_prompt, mm_token_type_ids, o1_init, tiny_model
from vision import VisionConfig

pytestmark = pytest.mark.usefixtures("one_thread")
PARITY_TOL = 1e-4


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def same_weights_but_traj_head(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    keys = {k for k in sa if not k.startswith("traj_head.")}
    assert keys == {k for k in sb if not k.startswith("traj_head.")}
    return all(torch.equal(sa[k], sb[k]) for k in keys)


def hf_load(path):
    tf = pytest.importorskip("transformers")
    return tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()


def hf_logits(hf, prompt):
    with torch.no_grad():
        return hf(**prompt, mm_token_type_ids=mm_token_type_ids(prompt["input_ids"])).logits


def replica(target, seed=7):
    """The M-RoPE replica draft of the target's width, O(1) weights (the target's embedding and head are shared)."""
    return o1_init(make_draft(target, n_layers=1, kind="mrope"), seed=seed).eval()


def draft_logits(target, draft, prompt):
    """What the draft computes when it drafts: the target's prompt embeddings (image features included)."""
    embeds = target.embed(prompt["input_ids"], prompt["pixel_values"], prompt["image_grid_thw"],
                          prompt["pixel_values_videos"], prompt["video_grid_thw"])  # (1, L, D)
    return draft(prompt["input_ids"], inputs_embeds=embeds, image_grid_thw=prompt["image_grid_thw"],
                 video_grid_thw=prompt["video_grid_thw"])


@torch.no_grad()
@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_through_load_pretrained(tmp_path, tie):
    target, prompt = tiny_model(tie_word_embeddings=tie), image_prompt(seed=3)
    export_pretrained(target, tmp_path / "t")
    assert sorted(os.listdir(tmp_path / "t")) == ["config.json", "model.safetensors"]
    stored = load_file(tmp_path / "t" / "model.safetensors")
    assert ("lm_head.weight" in stored) != tie and not any(k.startswith("traj_head") for k in stored)
    assert stored["visual.patch_embed.proj.weight"].shape == (32, 3, 1, 2, 2)  # the Conv3d kernel (C, tp, p, p)
    back = load_pretrained(tmp_path / "t")
    assert same_weights_but_traj_head(back, target)
    assert (back.lm_head.weight is back.embed_tokens.weight) == tie
    assert back.cfg == dataclasses.replace(target.cfg, traj_len=back.cfg.traj_len)  # a fresh head: load_pretrained's
    assert torch.equal(back(**prompt), target(**prompt))


@torch.no_grad()
def test_exported_folder_runs_in_transformers(tmp_path):
    """transformers reads the folder (config and every key, in the hub's layout), and its logits on text + image +
    text + video + text equal ours."""
    target, prompt = tiny_model(), image_prompt(seed=4)
    assert prompt["image_grid_thw"] is not None and prompt["video_grid_thw"] is not None
    export_pretrained(target, tmp_path / "t", eos_token_id=11, pad_token_id=0, vision_end_token_id=89)
    hf = hf_load(tmp_path / "t")
    assert hf.config.vision_config.window_size == 8 and hf.config.vision_config.tokens_per_second == 1
    assert (hf.config.image_token_id, hf.config.video_token_id) == (IMG, VID)
    assert hf.config.text_config.eos_token_id == 11 and hf.config.vision_end_token_id == 89
    ref = target(**prompt)
    diff = max_diff(hf_logits(hf, prompt), ref)
    assert ref.abs().mean() > 0.3 and diff <= PARITY_TOL, diff
    # the layout transformers itself writes for Qwen2.5-VL
    hf.save_pretrained(tmp_path / "hf")
    assert sorted(load_file(tmp_path / "hf" / "model.safetensors")) == \
        sorted(load_file(tmp_path / "t" / "model.safetensors"))


@torch.no_grad()
def test_replica_draft_becomes_a_standalone_qwen25_vl(tmp_path):
    target, prompt = tiny_model(), image_prompt(seed=5)
    draft = replica(target)
    export_pretrained(draft, tmp_path / "d", target=target)
    stored = load_file(tmp_path / "d" / "model.safetensors")
    assert torch.equal(stored["model.embed_tokens.weight"], target.embed_tokens.weight)
    assert torch.equal(stored["visual.merger.mlp.2.weight"], target.visual.merger.mlp[2].weight)
    assert json.load(open(tmp_path / "d" / "config.json"))["text_config"]["num_hidden_layers"] == 1
    ref = draft_logits(target, draft, prompt)
    back = load_pretrained(tmp_path / "d")  # its own embedding, head and vision tower: the same features
    assert max_diff(back(**prompt), ref) <= 1e-5
    diff = max_diff(hf_logits(hf_load(tmp_path / "d"), prompt), ref)
    assert ref.abs().mean() > 0.3 and diff <= PARITY_TOL, diff


def test_what_has_no_counterpart_is_refused(tmp_path):
    target = tiny_model()
    cases = (
        (make_draft(target, n_layers=1), dict(target=target), "FlatRoPE has no Hugging Face counterpart"),
        (make_draft(target, n_layers=1, kind="mrope", hidden_size=32), dict(target=target),
         "proj_in / proj_out have no Qwen2.5-VL counterpart"),
        (replica(target), {}, "pass target="),
        (replica(target), dict(target=tiny_model(seed=1)), "not the model whose embedding"),
        (tiny_model(qk_norm=True, qkv_bias=False, mrope_interleaved=True, video_frame_blocks=True,
                    vision=VisionConfig(family="qwen3_vl", patch_size=2, temporal_patch_size=2, depth=2, hidden=32,
                                        heads=2, intermediate=48, num_position_embeddings=16,
                                        deepstack_visual_indexes=(0, 1))), {},
         "Qwen3-VL export is not implemented"),
        (tiny_model(qkv_bias=False), {}, "q/k/v projections always have biases"),
        (tiny_model(vision=None), {}, "no vision tower"),
        (tiny_model(tokens_per_second=0.5), {}, "tokens_per_second 0.5 is not an integer"),
        (tiny_model(head_dim=32, mrope_section=(4, 6, 6)), {}, "head_dim 32 != hidden_size 64 / n_heads 4"),
    )
    for model, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            export_pretrained(model, tmp_path / "x", **kw)
    with pytest.raises(TypeError, match=r"unknown token id fields \['eos'\]"):
        export_pretrained(target, tmp_path / "x", eos=3)
    assert os.listdir(tmp_path) == []  # refused before anything was written
