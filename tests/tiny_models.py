"""Tiny configs, O(1)-scale weights and prompts shared by the model / checkpoint / Alpamayo tests.

run: imported by tests/test_model.py, tests/test_checkpoint.py and tests/test_alpamayo.py
"""
import torch

from model import VLA, ModelConfig, VisionConfig
from vision import patchify

IMG, VID, VS, VE = 90, 91, 88, 89


def tiny_config(**kw):
    vision = VisionConfig(patch_size=2, temporal_patch_size=1, spatial_merge_size=2, depth=2, hidden=32, heads=2,
                          intermediate=48, window_size=8, fullatt_block_indexes=(1,))
    base = dict(vocab_size=97, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                rope_theta=10000.0, mrope_section=(2, 3, 3), image_token_id=IMG, video_token_id=VID,
                vision_start_token_id=VS, tokens_per_second=1.0, vision=vision, traj_len=4, max_seq_len=96)
    base.update(kw)
    return ModelConfig(**base)


@torch.no_grad()
def o1_init(model, seed=0):
    """Weights of O(1) effect so that every parameter moves the logits: norms ~1 +- 0.2, biases
    ~0.3, matrices ~1/sqrt(fan_in), embeddings ~1. Works on our models and on transformers'."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g)
        if p.dim() == 1:
            p.copy_(1 + 0.2 * r if ("norm" in name or "ln_q" in name) else 0.3 * r)
        elif "embed_tokens" in name:
            p.copy_(r)
        else:
            p.copy_(r / p[0].numel() ** 0.5)
    return model


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    return o1_init(VLA(tiny_config(**kw)).eval(), seed)


def image_prompt(seed=0, text_after=(7, 8, 9)):
    """text + image (8x8 px -> grid (1, 4, 4) -> 4 tokens) + text + video (2 frames 8x12 -> 12 tokens) + text."""
    g = torch.Generator().manual_seed(seed)
    pv, ig = patchify(torch.randn(1, 3, 8, 8, generator=g), 2, 1, 2)
    vv, vg = patchify(torch.randn(2, 3, 8, 12, generator=g), 2, 1, 2)
    ids = [5, 6, VS] + [IMG] * 4 + [VE, 10, 11, VS] + [VID] * 12 + [VE] + list(text_after)
    return dict(input_ids=torch.tensor([ids]), pixel_values=pv, image_grid_thw=ig[None],
                pixel_values_videos=vv, video_grid_thw=vg[None])


def hf_qwen3(seed=2):
    """A tiny random transformers 5 Qwen3-VL, O(1)-scale weights: 3 decoder layers (interleaved
    M-RoPE, q/k norms), a 2-block vision tower (patch 2, temporal patch 2, 4 x 4 learned position
    grid) with DeepStack after both blocks, so layers 0 and 1 get features and layer 2 none."""
    import transformers as tf  # optional extra: callers pytest.importorskip it first
    cfg = tf.Qwen3VLConfig(
        text_config=dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=2,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=[0, 1]),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE,
        tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return o1_init(tf.Qwen3VLForConditionalGeneration(cfg).eval(), seed=seed)


def qwen3_prompt(seed=0, text_after=(7, 8, 9)):
    """Qwen3-VL layout (patch 2, temporal patch 2): text + image (8x8 px, grid (1, 4, 4), 4 tokens) +
    text + image (8x12 px, grid (1, 4, 6), 6 tokens) + text + video (4 frames 8x8 px, grid (2, 4, 4)):
    each temporal patch its own vision block after a timestamp token, as Qwen3-VL's processor writes
    it + text."""
    g = torch.Generator().manual_seed(seed)
    pa, ga = patchify(torch.randn(1, 3, 8, 8, generator=g), 2, 2, 2)
    pb, gb = patchify(torch.randn(1, 3, 8, 12, generator=g), 2, 2, 2)
    pv, gv = patchify(torch.randn(4, 3, 8, 8, generator=g), 2, 2, 2)
    ids = ([5, 6, VS] + [IMG] * 4 + [VE, 10, VS] + [IMG] * 6 + [VE, 11, 30, VS] + [VID] * 4 + [VE, 31, VS] + [VID] * 4
           + [VE] + list(text_after))
    return dict(input_ids=torch.tensor([ids]), pixel_values=torch.cat([pa, pb]), image_grid_thw=torch.stack([ga, gb]),
                pixel_values_videos=pv, video_grid_thw=gv[None])


def mm_token_type_ids(ids):
    """transformers 5 builds 3D positions only from these (1 image, 2 video)."""
    return (ids == IMG).int() + 2 * (ids == VID).int()
