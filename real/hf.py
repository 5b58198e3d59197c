"""Hugging Face checkpoints: a Qwen2.5-VL / Qwen3-VL or Alpamayo-R1 folder read into model.VLA (load_pretrained),
through one name / shape map (hf_layout; experiments/hf_export.py writes the toy as such a folder with it, for the
comparisons with transformers). Paper: the deliberative reasoner is an unmodified Alpamayo-R1 (a Qwen-VL backbone)
(docs/background.md, "Alpamayo-R1 prompt layout").

run: python -m pytest -q tests/test_checkpoint.py tests/test_export.py tests/test_alpamayo.py
"""
import dataclasses
import logging
import os
import re

import torch

from model import PRESETS, QWEN_IDS, VLA, ModelConfig, VisionConfig
from ops.checkpoint import WEIGHTS, check_keys, check_shape, empty_model, existing_kind, open_safetensors
from ops.files import read_json
from real.expert import ActionExpert, ExpertConfig, config_field, fourier_freqs

CONFIG = "config.json"


# ---- loading ----
def on_model(prompt, model):
    """A prompt dict's tensors on the model's device, its pixels in the model's dtype (ids stay integers)."""
    w = next(model.parameters())
    return {k: v.to(w.device, w.dtype if v.is_floating_point() else None) for k, v in prompt.items()}


def load_pretrained(path, dtype=None, device=None) -> VLA:
    """One file or shards, every key used, every weight found; an Alpamayo action expert as `model.expert`."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: checkpoint folder not found")
    cfg, family, alpamayo = read_config(path)  # alpamayo: an Alpamayo folder's own config.json, else None
    expert_cfg = (ExpertConfig.from_alpamayo(alpamayo, cfg, os.path.join(path, CONFIG))
                  if "expert_cfg" in (alpamayo or {}) else None)
    cfg = cfg if expert_cfg is None else dataclasses.replace(cfg, traj_len=0)  # it plans with its expert, not a head
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index)
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise ValueError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        key_file = {k: os.path.join(path, v) for k, v in weight_map["weight_map"].items()}
    elif os.path.isfile(os.path.join(path, WEIGHTS)):
        key_file = dict.fromkeys(open_safetensors(os.path.join(path, WEIGHTS)).keys(), os.path.join(path, WEIGHTS))
    else:
        raise FileNotFoundError(f"{path}: no {WEIGHTS} or model.safetensors.index.json")
    handles = {file: open_safetensors(file) for file in sorted(set(key_file.values()))}
    found = {}  # our name -> (file, key)
    want = None if expert_cfg is None else fourier_freqs(expert_cfg.fourier_feats, expert_cfg.max_freq)
    for key, file in key_file.items():
        if alpamayo and key.startswith(("expert.", "action_in_proj.", "action_out_proj.")):  # the action expert's
            if want is not None and key.startswith("action_in_proj.") and key.endswith(".freqs"):
                got = handles[file].get_tensor(key).float().flatten()  # stored (1, F / 2), possibly in bf16
                if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-2):
                    raise ValueError(f"{file}: {key!r} holds Fourier frequencies {got.tolist()}, but "
                                     f"action_in_proj_cfg gives {want.tolist()}")
                continue
            k = key if key.startswith("expert.") else "expert." + key  # action_*_proj live in model.expert
        else:
            # both on-disk layouts -> one: 'model.language_model.X' / 'model.X' -> 'X'; 'model.visual.X' -> 'visual.X'
            k = re.sub(r"^model\.(language_model\.)?", "", key.removeprefix("vlm.") if alpamayo else key)
        if not (k == "lm_head.weight" and cfg.tie_word_embeddings):  # tied: embed_tokens.weight is the one that counts
            found[k] = (file, key)
    if not found:
        raise ValueError(f"{path}: the safetensors file(s) hold no tensors")
    for file, f in handles.items():  # an index that maps a key to the wrong shard
        if stray := sorted({key for fl, key in found.values() if fl == file} - set(f.keys())):
            raise ValueError(f"{index}: maps {len(stray)} key(s) to {file}, which does not hold them: {stray[:5]}")
    file, key = found.get("embed_tokens.weight", next(iter(found.values())))  # dtype None keeps the file's
    model = empty_model(cfg, None, dtype or handles[file].get_tensor(key).dtype, device or "cpu",
                        None if expert_cfg is None else lambda vlm: ActionExpert(expert_cfg, vlm))
    shapes, parts = hf_layout(model)
    check_keys(shapes, found, f"{path} ({family}{', Alpamayo' if alpamayo else ''})")
    for k, (file, key) in found.items():
        check_shape(file, key, shapes[k], handles[file].get_slice(key).get_shape())
    sd = model.state_dict()
    with torch.no_grad():
        for name, hf_names in parts.items():
            ts = [handles[found[h][0]].get_tensor(found[h][1]) for h in hf_names]
            sd[name].copy_(torch.cat(ts).reshape(sd[name].shape))
        if model.traj_head is not None:
            model.traj_head.apply(VLA._init_weights)
            logging.getLogger(__name__).warning("load_pretrained(%s): trajectory head not in the checkpoint, randomly "
                                                "initialised", path)
    model.checkpoint_files = (os.path.join(path, CONFIG), sorted((key, file) for file, key in found.values()))
    return model


def hf_layout(model: VLA):
    """{hf name: shape} a folder must hold, and {our name: [hf names]} joined along dim 0 (fused q/k/v, gate/up)."""
    cfg, shapes, parts = model.cfg, {}, {}
    for name, t in model.state_dict().items():
        if name.startswith("traj_head.") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        c = model.expert.layer_cfg if name.startswith("expert.") else cfg  # the expert's decoder has its own sizes
        q, kv, inter = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.intermediate_size
        base, leaf = name.rsplit(".", 1)
        split = ((("q_proj", q), ("k_proj", kv), ("v_proj", kv)) if base.endswith("self_attn.qkv") else
                 (("gate_proj", inter), ("up_proj", inter)) if base.endswith("mlp.gate_up") else ())
        parts[name] = [f"{base.rsplit('.', 1)[0]}.{p}.{leaf}" for p, _ in split] or [name]
        shapes.update({hf: (n, *t.shape[1:]) for hf, (_, n) in zip(parts[name], split)} or {name: tuple(t.shape)})
    if model.visual is not None:  # Qwen stores the patch embedding as a Conv3d kernel (hidden, C, tp, p, p)
        v = cfg.vision
        shapes["visual.patch_embed.proj.weight"] = (v.hidden, v.in_channels, v.temporal_patch_size, *[v.patch_size] * 2)
    return shapes, parts


# ---- config.json ----
def read_config(path):
    """(ModelConfig, family, the Alpamayo config.json or None) from a Hugging Face / Alpamayo config.json."""
    cfg_path = os.path.join(path, CONFIG)
    if (existing_kind(path) or "").endswith(("target", " draft")):
        raise ValueError(f"{path}: a checkpoint of this repo's own format (checkpoint.save), not a Hugging Face "
                         "folder: load it with checkpoint.load (bench.py: its run folder as --run, a draft as --draft)")
    raw = top = read_json(cfg_path)
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    alpamayo = "vlm_name_or_path" in raw or "alpamayo" in str(raw.get("model_type", "")).lower()
    if alpamayo:  # the VLM config is nested, or (released checkpoints) named by vlm_name_or_path
        vlm, name = raw.get("vlm_config"), str(raw.get("vlm_name_or_path", ""))
        if vlm is None and os.path.isfile(os.path.join(name, CONFIG)):
            vlm = read_json(os.path.join(name, CONFIG))
        elif vlm is None and name.rstrip("/").split("/")[-1].lower() == "qwen3-vl-8b-instruct":
            cfg = dataclasses.replace(PRESETS["qwen3-vl-8b"], vocab_size=raw.get("vocab_size", 151936))
            return cfg, "qwen3_vl", top
        elif vlm is None:
            raise ValueError(f"{cfg_path}: Alpamayo config without a 'vlm_config' entry and unknown VLM {name!r}: add "
                             "the VLM's config.json as 'vlm_config'")
        raw = dict(vlm, vocab_size=raw.get("vocab_size", vlm.get("vocab_size")))
    family = raw.get("model_type")
    if family not in ("qwen2_5_vl", "qwen3_vl"):
        raise ValueError(f"{cfg_path}: unsupported architecture model_type={family!r} "
                         f"(architectures={raw.get('architectures')}); supported: qwen2_5_vl, qwen3_vl, Alpamayo-R1")
    text = raw.get("text_config") or raw  # transformers 5 nests it
    config_field(text, "hidden_size", cfg_path, "config field")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or raw.get("rope_scaling") or {}
    for d, key in ((text, "rope_parameters"), (text, "rope_scaling"), (raw, "rope_parameters"), (raw, "rope_scaling")):
        r = d.get(key) if isinstance(d.get(key), dict) else {}
        kind = r.get("rope_type", r.get("type", "default"))
        if kind not in ("default", "mrope"):  # "mrope": older Qwen2-VL configs' name for the default M-RoPE
            raise ValueError(f"{cfg_path}: unsupported RoPE scaling {key}.rope_type={kind!r}: this code implements "
                             "unscaled (M-)RoPE only, and would silently ignore the scaling")
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{cfg_path}: unsupported hidden_act {text['hidden_act']!r}")
    if family == "qwen3_vl" and text.get("attention_bias"):
        raise ValueError(f"{cfg_path}: unsupported attention_bias=True for qwen3_vl")
    vraw = config_field(raw, "vision_config", cfg_path, "config field")  # a default: hundreds of mismatched keys
    q3, vision = family == "qwen3_vl", _vision(family, vraw, text, cfg_path)
    try:
        cfg = ModelConfig(
            vocab_size=raw.get("vocab_size") or text["vocab_size"], hidden_size=text["hidden_size"],
            n_layers=text["num_hidden_layers"], n_heads=text["num_attention_heads"],
            n_kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"], head_dim=text.get("head_dim"),
            intermediate_size=text["intermediate_size"],
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 5e6 if q3 else 1e6)),
            mrope_section=tuple(rope.get("mrope_section", (24, 20, 20) if q3 else (16, 24, 24))),
            mrope_interleaved=q3, qkv_bias=not q3, qk_norm=q3, rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings") or text.get("tie_word_embeddings")),
            **{k: raw.get(k, default) for k, default in QWEN_IDS.items()},
            tokens_per_second=vraw.get("tokens_per_second", 2), video_frame_blocks=q3,
            spatial_merge_size=vraw.get("spatial_merge_size", 2), vision=vision,
            traj_len=64, max_seq_len=text.get("max_position_embeddings", 8192))
    except (KeyError, ValueError) as e:
        raise ValueError(f"{cfg_path}: {'missing config field ' if isinstance(e, KeyError) else ''}{e}") from None
    return cfg, family, top if alpamayo else None


def _vision(family, v, text, cfg_path):
    """Qwen3-VL's vision_config must hold every field read; Qwen2.5-VL's falls back to the released models' values."""
    q3, where = family == "qwen3_vl", f"{cfg_path} (vision_config)"
    get = lambda k, default: config_field(v, k, where, "config field") if q3 else v.get(k, default)  # noqa: E731
    for key, want in (("hidden_act", "gelu_pytorch_tanh" if q3 else "silu"), ("out_hidden_size", text["hidden_size"])):
        if get(key, want) != want:
            raise ValueError(f"{cfg_path}: unsupported vision {key} {v[key]!r} (expected {want!r})")
    own = {k: get(k, d) for k, d in ((("num_position_embeddings", 0), ("deepstack_visual_indexes", ())) if q3 else
                                     (("window_size", 112), ("fullatt_block_indexes", (7, 15, 23, 31))))}
    return VisionConfig(
        family=family, patch_size=get("patch_size", 14), temporal_patch_size=get("temporal_patch_size", 2),
        spatial_merge_size=get("spatial_merge_size", 2), in_channels=get("in_channels", v.get("in_chans", 3)),
        depth=get("depth", 32), hidden=get("hidden_size", 3584), heads=get("num_heads", 16),
        intermediate=get("intermediate_size", 3420),
        rope_theta=(v.get("rope_parameters") or {}).get("rope_theta", 10000.0), **own)
