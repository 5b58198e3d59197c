"""Our model as a Hugging Face Qwen2.5-VL folder (export_pretrained), for the comparisons with transformers: the toy
target or its M-RoPE replica draft written through real/hf.py's name / shape map, so that transformers (and
hf.load_pretrained) read it. experiments/peer_hf.py times transformers' generate and assisted generation on the
exported folders; experiments/toy_roundtrip.py and data_stage_ab.py take the exported toy target through the
own-target path. Nothing in the library imports this.

run: python -m pytest -q tests/test_export.py
"""
import contextlib
import dataclasses
import os
import sys

from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import VLA, ModelConfig  # noqa: E402
from ops.checkpoint import WEIGHTS, check_output, empty_model  # noqa: E402
from ops.files import atomic_write, read_json, write_json  # noqa: E402
from real.hf import CONFIG, hf_layout  # noqa: E402

TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "vision_end_token_id")


def export_pretrained(model: VLA, dir, target: VLA | None = None, **token_ids):
    """A Qwen2.5-VL folder that transformers 5.24 and load_pretrained read, no TrajHead; a draft (target=) becomes a
    standalone one (transformers' assistant). token_ids (TOKEN_ID_FIELDS) only document the prompt format."""
    if unknown := sorted(set(token_ids) - set(TOKEN_ID_FIELDS)):
        raise TypeError(f"export_pretrained: unknown token id fields {unknown}; known: {list(TOKEN_ID_FIELDS)}")
    cfg, draft = model.cfg, model.cfg.shared_width is not None
    vision = (target.cfg if draft and target is not None else cfg).vision
    same = target is not None and target.embed_tokens is model.embed_tokens
    qwen3 = cfg.qk_norm or cfg.mrope_interleaved or cfg.video_frame_blocks or (vision and vision.family != "qwen2_5_vl")
    for refused, why in (
            (getattr(model, "expert", None) is not None,
             "an Alpamayo action expert has no Qwen2.5-VL counterpart (keep the model's Alpamayo folder)"),
            (qwen3, "Qwen3-VL export is not implemented: this writes Qwen2.5-VL folders only (chunked M-RoPE, no "
             "q/k norms, the windowed ViT)"),
            (cfg.rope_mode != "mrope", f"rope_mode {cfg.rope_mode!r}: FlatRoPE has no Hugging Face counterpart "
             "(transformers' Qwen2.5-VL always gives image tokens 3D M-RoPE positions); only the M-RoPE replica draft "
             "can be exported"),
            (not cfg.qkv_bias, "qkv_bias is False, but Qwen2.5-VL's q/k/v projections always have biases"),
            (cfg.head_dim * cfg.n_heads != cfg.hidden_size, f"head_dim {cfg.head_dim} != hidden_size {cfg.hidden_size} "
             f"/ n_heads {cfg.n_heads}: transformers' Qwen2.5-VL derives head_dim from them"),
            (vision is not None and cfg.tokens_per_second != int(cfg.tokens_per_second), f"tokens_per_second "
             f"{cfg.tokens_per_second} is not an integer (an int in transformers' vision_config)"),
            (not draft and model.visual is None, "the model has no vision tower, and a Qwen2.5-VL always has one"),
            (draft and target is None, "a draft shares its target's embedding and LM head: pass target= (the model it "
             "was distilled from)"),
            (draft and target is not None and not same,
             "target= is not the model whose embedding and LM head this draft shares"),
            (draft and cfg.shared_width != cfg.hidden_size, f"the draft's width {cfg.hidden_size} differs from its "
             f"target's {cfg.shared_width}: its bridges proj_in / proj_out have no Qwen2.5-VL counterpart"),
            (draft and same and target.visual is None, "the target has no vision tower, and a Qwen2.5-VL has one")):
        if refused:
            raise ValueError(f"export_pretrained({dir}): {why}")
    m = model
    if draft:  # the draft's layers with copies of the target's embedding, LM head and tower (for its image features)
        own = dataclasses.replace(cfg, shared_width=None, vision=target.cfg.vision,
                                  tie_word_embeddings=target.cfg.tie_word_embeddings)
        m = empty_model(own, None, model.embed_tokens.weight.dtype, model.embed_tokens.weight.device)
        m.load_state_dict({**model.state_dict(), "embed_tokens.weight": target.embed_tokens.weight,
                           "lm_head.weight": target.lm_head.weight,
                           **{"visual." + k: v for k, v in target.visual.state_dict().items()}})
    exported = False  # a folder exported before is replaced, never anything else (check_output names what is there)
    with contextlib.suppress(OSError, ValueError, AttributeError):
        exported = read_json(os.path.join(dir, CONFIG)).get("model_type") == "qwen2_5_vl"
    if not exported:
        check_output(dir, "qwen2_5_vl folder")
    shapes, parts = hf_layout(m)
    sd, tensors = m.state_dict(), {}
    for name, hf_names in parts.items():
        # (H*hd + 2*Hk*hd, D) -> q (H*hd, D), k, v (Hk*hd, D); (2*I, D) -> gate, up (I, D), copies: no shared storage;
        # the rest as is, but the patch embedding: (C_vit, C*tp*p*p) -> the Conv3d kernel (C_vit, C, tp, p, p)
        for h, p in zip(hf_names, sd[name].detach().split([shapes[h][0] for h in hf_names])):
            p = p.clone() if len(hf_names) > 1 else p.reshape(shapes[h]).contiguous()
            tensors[h if h.startswith("visual.") or h == "lm_head.weight" else "model." + h] = p  # the hub's names
    os.makedirs(dir, exist_ok=True)  # weights first: a folder whose config.json is there is complete
    atomic_write(os.path.join(dir, WEIGHTS), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    write_json(os.path.join(dir, CONFIG), _hf_json(m.cfg, next(iter(tensors.values())).dtype, token_ids))


def _hf_json(cfg: ModelConfig, dtype, token_ids):
    """config.json in the form transformers 5.24's Qwen2_5_VLConfig reads (and read_config reads back)."""
    v = cfg.vision
    text = dict(model_type="qwen2_5_vl_text", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.n_layers,
                num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, hidden_act="silu",
                max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps, use_sliding_window=False,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                 "mrope_section": list(cfg.mrope_section)},
                **{k: token_ids.get(k) for k in TOKEN_ID_FIELDS[:3]})
    vision = dict(model_type="qwen2_5_vl_vision", depth=v.depth, hidden_size=v.hidden, hidden_act="silu",
                  intermediate_size=v.intermediate, num_heads=v.heads, in_channels=v.in_channels,
                  patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                  spatial_merge_size=v.spatial_merge_size, tokens_per_second=int(cfg.tokens_per_second),
                  window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_block_indexes),
                  out_hidden_size=cfg.hidden_size, rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    return dict(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", text_config=text,
                vision_config=vision, image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                vision_start_token_id=cfg.vision_start_token_id, tie_word_embeddings=cfg.tie_word_embeddings,
                dtype=str(dtype).removeprefix("torch."),  # and vision_end_token_id, if given
                **{k: token_ids[k] for k in TOKEN_ID_FIELDS[3:] if token_ids.get(k) is not None})
