"""Tiny configs, O(1)-scale weights and prompts shared by the model / checkpoint tests.

run: imported by tests/test_model.py and tests/test_checkpoint.py
"""
import torch

from model import VLA, ModelConfig, VisionConfig, patchify

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
