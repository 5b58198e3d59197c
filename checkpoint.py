"""How a run is stored and described: our checkpoint format, the Hugging Face Qwen2.5-VL /
Qwen3-VL / Alpamayo-R1 folder loader, the one atomic file writer, JSON reading with clear
errors, the inference dtypes, and command-line flags generated from a config dataclass.

Paper: the deliberative reasoner is an unmodified Alpamayo-R1-style VLA (a Qwen-VL backbone);
`load_pretrained` reads such checkpoints into `model.VLA` so that the same decoder, KV cache and
speculative decoding run on real weights (docs/background.md, "Alpamayo-R1 prompt layout").

Files on disk (our format): a folder with config.json ({"format": "rsd-vla", "draft": bool,
"config": ModelConfig}) and model.safetensors. A draft's file holds only its own weights; the
target's embedding and LM head are re-attached by load(dir, target=...).

Hugging Face / Alpamayo config.json fields read by the Qwen3-VL vision tower (each required; a
folder missing one gets an error naming it): vision_config.{depth, hidden_size, num_heads,
intermediate_size, patch_size, temporal_patch_size, spatial_merge_size, in_channels,
num_position_embeddings, deepstack_visual_indexes, out_hidden_size, hidden_act}; optional
vision_config.rope_parameters.rope_theta (transformers' default 10000). An Alpamayo folder with an
`expert_cfg` loads its action expert: the fields expert.ExpertConfig.from_alpamayo lists.

run: python -m pytest -q tests/test_checkpoint.py
"""
import argparse
import dataclasses
import inspect
import io
import json
import logging
import os
import tempfile
import textwrap
import tokenize

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from expert import ActionExpert, ExpertConfig, fourier_freqs
from model import PRESETS, VLA, ModelConfig, VisionConfig

log = logging.getLogger(__name__)

WEIGHTS, CONFIG = "model.safetensors", "config.json"
# The one dtype vocabulary of every script's --dtype flag.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# ---- files: the one atomic writer, JSON ----


def atomic_write(path, write):
    """write(tmp_path) into a temp file in the same folder, fsync, then rename over path: a crash
    mid-write leaves the previous file intact and no temp file behind."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def write_json(path, obj):
    atomic_write(path, lambda p: _write_text(p, json.dumps(obj, indent=1)))


def torch_save(obj, path):
    atomic_write(path, lambda p: torch.save(obj, p))


def read_json(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: file not found")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


# ---- command-line flags from a config dataclass ----


def field_comments(cls):
    """{field: the comment on its line in the class body}: the dataclass's comments are its help text."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (e.g. a frozen build): flags without help
        return {}
    first_name, comments = {}, {}
    for t in tokenize.generate_tokens(io.StringIO(src).readline):
        if t.type == tokenize.NAME and t.start[0] not in first_name:
            first_name[t.start[0]] = t.string
        elif t.type == tokenize.COMMENT and t.start[0] in first_name:
            comments[first_name[t.start[0]]] = t.string.lstrip("#").strip()
    return comments


def add_config_flags(ap: argparse.ArgumentParser, cls, choices=None):
    """One flag per field of the dataclass cls: --field-name with the field's type and default; a bool
    field defaulting to False is --field-name, one defaulting to True is --no-field-name."""
    helps, choices = field_comments(cls), choices or {}
    for f in dataclasses.fields(cls):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        text = helps.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        if isinstance(default, bool):
            if default:
                ap.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=f"turn off: {text}")
            else:
                ap.add_argument(flag, dest=f.name, action="store_true", help=text)
        else:
            ap.add_argument(flag, dest=f.name, type=type(default), default=default, choices=choices.get(f.name),
                            help=f"{text} (default: %(default)s)")


def config_from_args(cls, args):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


# ---- our own format ----


def draft_dir(run, kind, seed=0):
    """The run folder's layout for drafts: run/draft_<kind>_s<seed>, kind mrope (the replica), flat (FlatRoPE) or
    aarl (FlatRoPE + AARL with the static anchor); seeds vary the drafts' initialisation and batch order only."""
    return os.path.join(run, f"draft_{kind}_s{seed}")


def save(model: VLA, dir):
    """config.json + model.safetensors, each written atomically. A draft's file holds only its own
    weights (the shared target embedding / LM head are re-attached by load(dir, target=...))."""
    if getattr(model, "expert", None) is not None:
        raise ValueError("this format holds no Alpamayo action expert: keep the model's Alpamayo folder")
    os.makedirs(dir, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings and model.cfg.shared_width is None:
        sd.pop("lm_head.weight")  # tied: the same tensor as embed_tokens.weight
    meta = {"format": "rsd-vla", "draft": model.cfg.shared_width is not None, "config": model.cfg.to_dict()}
    atomic_write(os.path.join(dir, WEIGHTS), lambda p: save_file(sd, p))
    write_json(os.path.join(dir, CONFIG), meta)


def _open_safetensors(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: weights file not found")
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises its own error type for bad headers / short files
        raise ValueError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None


def _read_tensor(f, path, key):
    try:
        return f.get_tensor(key)
    except Exception as e:
        raise ValueError(f"{path}: cannot read tensor {key!r} (truncated or corrupt?): {e}") from None


def _check_keys(expected, found, where):
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        fmt = lambda ks: f"{len(ks)} {ks[:20]}{' ...' if len(ks) > 20 else ''}"
        raise ValueError(f"{where}: key mismatch: missing {fmt(missing)}; unexpected {fmt(unexpected)}")


def _check_shape(path, key, expected, got):
    if tuple(expected) != tuple(got):
        raise ValueError(f"{path}: shape mismatch for {key!r}: expected {tuple(expected)}, got {tuple(got)}")


def _empty_model(cfg, shared, dtype, device, expert_cfg=None):
    """A VLA (with an Alpamayo action expert as `model.expert` when expert_cfg is given) with
    uninitialised storage (no random init of weights about to be overwritten)."""
    with torch.device("meta"):
        model = VLA(cfg, shared=shared)
        if expert_cfg is not None:
            model.expert = ActionExpert(expert_cfg, cfg)
    model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.reset_buffers(device)
    return model


def load(dir, target: VLA | None = None, dtype=None, device=None) -> VLA:
    """Load a model written by save(); a draft needs the target it was made from (re-attached, shared)."""
    if not os.path.isdir(dir):
        raise FileNotFoundError(f"{dir}: checkpoint folder not found")
    meta = read_json(os.path.join(dir, CONFIG))
    if meta.get("format") != "rsd-vla":
        raise ValueError(f"{os.path.join(dir, CONFIG)}: not a checkpoint written by checkpoint.save "
                         "(for Hugging Face / Alpamayo folders use load_pretrained)")
    cfg = ModelConfig.from_dict(meta["config"])
    if meta["draft"]:
        if target is None:
            raise ValueError(f"{dir} holds a draft: pass target= (the model whose embedding and LM head it shares)")
        if (target.cfg.hidden_size, target.cfg.vocab_size) != (cfg.shared_width, cfg.vocab_size):
            raise ValueError(f"{dir}: draft expects a target of width {cfg.shared_width} and vocab {cfg.vocab_size}, "
                             f"got {target.cfg.hidden_size} and {target.cfg.vocab_size}")
        device = device or target.embed_tokens.weight.device
    path = os.path.join(dir, WEIGHTS)
    f = _open_safetensors(path)
    keys = list(f.keys())
    if dtype is None:  # a draft must match its target; otherwise keep the file's dtype
        dtype = target.embed_tokens.weight.dtype if meta["draft"] else _read_tensor(f, path, keys[0]).dtype
    model = _empty_model(cfg, target if meta["draft"] else None, dtype, device or "cpu")
    sd = model.state_dict()
    if cfg.tie_word_embeddings and cfg.shared_width is None:
        sd.pop("lm_head.weight")
    _check_keys(sd, keys, path)
    with torch.no_grad():
        for k in keys:
            _check_shape(path, k, sd[k].shape, f.get_slice(k).get_shape())
            sd[k].copy_(_read_tensor(f, path, k))
    return model


# ---- Hugging Face Qwen2.5-VL / Qwen3-VL and Alpamayo-R1 folders ----

ALPAMAYO_EXPERT = ("expert.", "action_in_proj.", "action_out_proj.")  # the action expert's keys, next to 'vlm.'


def _required(d, key, where):
    if key not in d:
        raise ValueError(f"{where}: missing config field {key!r}")
    return d[key]


def _qwen3_vision(vraw, text, cfg_path):
    """VisionConfig of a Qwen3-VL vision_config (the fields listed in this file's docstring)."""
    get = lambda key: _required(vraw, key, f"{cfg_path} (vision_config)")  # noqa: E731
    if get("hidden_act") != "gelu_pytorch_tanh":
        raise ValueError(f"{cfg_path}: unsupported vision hidden_act {vraw['hidden_act']!r}")
    if get("out_hidden_size") != text["hidden_size"]:
        raise ValueError(f"{cfg_path}: vision out_hidden_size {vraw['out_hidden_size']} != hidden_size "
                         f"{text['hidden_size']}")
    return VisionConfig(
        family="qwen3_vl", patch_size=get("patch_size"), temporal_patch_size=get("temporal_patch_size"),
        spatial_merge_size=get("spatial_merge_size"), in_channels=get("in_channels"), depth=get("depth"),
        hidden=get("hidden_size"), heads=get("num_heads"), intermediate=get("intermediate_size"),
        num_position_embeddings=get("num_position_embeddings"),
        deepstack_visual_indexes=get("deepstack_visual_indexes"),
        rope_theta=(vraw.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def _hf_config(path):
    """(ModelConfig, family, alpamayo, ExpertConfig or None) from a Hugging Face / Alpamayo config.json."""
    cfg_path = os.path.join(path, CONFIG)
    raw = top = read_json(cfg_path)
    alpamayo = "vlm_name_or_path" in raw or "alpamayo" in str(raw.get("model_type", "")).lower()
    if alpamayo:  # the VLM config is nested, or (released checkpoints) named by vlm_name_or_path
        vlm = raw.get("vlm_config")
        if vlm is None:
            name = str(raw.get("vlm_name_or_path", ""))
            if os.path.isfile(os.path.join(name, CONFIG)):
                vlm = read_json(os.path.join(name, CONFIG))
            elif name.rstrip("/").split("/")[-1].lower() == "qwen3-vl-8b-instruct":
                cfg = dataclasses.replace(PRESETS["qwen3-vl-8b"], vocab_size=raw.get("vocab_size", 151936))
                return _with_expert(cfg, "qwen3_vl", top, cfg_path)
            else:
                raise ValueError(f"{cfg_path}: Alpamayo config without a 'vlm_config' entry and unknown VLM "
                                 f"{name!r}: add the VLM's config.json as 'vlm_config'")
        raw = dict(vlm, vocab_size=raw.get("vocab_size", vlm.get("vocab_size")))
    family = raw.get("model_type")
    if family not in ("qwen2_5_vl", "qwen3_vl"):
        raise ValueError(f"{cfg_path}: unsupported architecture model_type={family!r} "
                         f"(architectures={raw.get('architectures')}); supported: qwen2_5_vl, qwen3_vl, Alpamayo-R1")
    text = raw.get("text_config") or raw  # transformers 5 nests it; older configs keep it top-level
    rope = text.get("rope_parameters") or text.get("rope_scaling") or raw.get("rope_scaling") or {}
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{cfg_path}: unsupported hidden_act {text['hidden_act']!r}")
    if family == "qwen3_vl" and text.get("attention_bias"):
        raise ValueError(f"{cfg_path}: unsupported attention_bias=True for qwen3_vl")
    vraw = raw.get("vision_config") or {}
    if family == "qwen2_5_vl":
        vision = VisionConfig(
            patch_size=vraw.get("patch_size", 14), temporal_patch_size=vraw.get("temporal_patch_size", 2),
            spatial_merge_size=vraw.get("spatial_merge_size", 2),
            in_channels=vraw.get("in_channels", vraw.get("in_chans", 3)),
            depth=vraw.get("depth", 32), hidden=vraw.get("hidden_size", 3584), heads=vraw.get("num_heads", 16),
            intermediate=vraw.get("intermediate_size", 3420), window_size=vraw.get("window_size", 112),
            fullatt_block_indexes=vraw.get("fullatt_block_indexes", (7, 15, 23, 31)),
            rope_theta=(vraw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        if vraw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg_path}: unsupported vision hidden_act {vraw['hidden_act']!r}")
        if vraw.get("out_hidden_size", text["hidden_size"]) != text["hidden_size"]:
            raise ValueError(f"{cfg_path}: vision out_hidden_size {vraw['out_hidden_size']} != hidden_size "
                             f"{text['hidden_size']}")
    else:
        vision = _qwen3_vision(_required(raw, "vision_config", cfg_path), text, cfg_path)
    try:
        cfg = ModelConfig(
            vocab_size=raw.get("vocab_size") or text["vocab_size"], hidden_size=text["hidden_size"],
            n_layers=text["num_hidden_layers"], n_heads=text["num_attention_heads"],
            n_kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"], head_dim=text.get("head_dim"),
            intermediate_size=text["intermediate_size"],
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 1e6 if family == "qwen2_5_vl" else 5e6)),
            mrope_section=tuple(rope.get("mrope_section", (16, 24, 24) if family == "qwen2_5_vl" else (24, 20, 20))),
            mrope_interleaved=family == "qwen3_vl", qkv_bias=family == "qwen2_5_vl", qk_norm=family == "qwen3_vl",
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings") or text.get("tie_word_embeddings")),
            image_token_id=raw.get("image_token_id", 151655), video_token_id=raw.get("video_token_id", 151656),
            vision_start_token_id=raw.get("vision_start_token_id", 151652),
            tokens_per_second=vraw.get("tokens_per_second", 2), video_frame_blocks=family == "qwen3_vl",
            spatial_merge_size=vraw.get("spatial_merge_size", 2), vision=vision, traj_len=64,
            max_seq_len=min(text.get("max_position_embeddings", 8192), 8192))
    except KeyError as e:
        raise ValueError(f"{cfg_path}: missing config field {e}") from None
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    return _with_expert(cfg, family, top, cfg_path) if alpamayo else (cfg, family, False, None)


def _with_expert(cfg, family, top, cfg_path):
    """An Alpamayo folder with an expert_cfg plans with its action expert, not with an MLP head."""
    if "expert_cfg" not in top:
        return cfg, family, True, None
    return dataclasses.replace(cfg, traj_len=0), family, True, ExpertConfig.from_alpamayo(top, cfg, cfg_path)


def _hf_name(key):
    """Both on-disk layouts -> one: 'model.language_model.X' / 'model.X' -> 'X'; 'model.visual.X' -> 'visual.X'."""
    for prefix, new in (("model.language_model.", ""), ("model.visual.", "visual."), ("model.", "")):
        if key.startswith(prefix):
            return new + key[len(prefix):]
    return key


def _hf_layout(model: VLA):
    """{hf name: shape} the checkpoint must hold, and {our name: [hf names]} joined along dim 0."""
    cfg, shapes, parts = model.cfg, {}, {}
    for name, t in model.state_dict().items():
        if name.startswith("traj_head.") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        c = model.expert.layer_cfg if name.startswith("expert.") else cfg  # the expert's decoder has its own sizes
        q, kv, inter = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.intermediate_size
        base, leaf = name.rsplit(".", 1)
        if base.endswith("self_attn.qkv"):
            split = [(base[:-3] + p, n) for p, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]
        elif base.endswith("mlp.gate_up"):
            split = [(base[:-7] + p, inter) for p in ("gate_proj", "up_proj")]
        else:
            split = [(base, None)]
        parts[name] = [f"{b}.{leaf}" for b, _ in split]
        for (b, n), hf in zip(split, parts[name]):
            shapes[hf] = (n, *t.shape[1:]) if n is not None else tuple(t.shape)
    if model.visual is not None:  # Qwen stores the patch embedding as a Conv3d kernel
        vc = model.cfg.vision
        shapes["visual.patch_embed.proj.weight"] = (vc.hidden, vc.in_channels, vc.temporal_patch_size,
                                                    vc.patch_size, vc.patch_size)
    return shapes, parts


def _check_fourier_buffers(path, stored, cfg: ExpertConfig):
    """Alpamayo's Fourier frequencies are fixed by its config; a folder that stores them must agree."""
    want = fourier_freqs(cfg.fourier_feats, cfg.max_freq)
    for key, (file, tensor) in stored.items():
        got = tensor.float().flatten()  # stored (1, F / 2), possibly in bf16
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-2):
            raise ValueError(f"{file}: {key!r} holds Fourier frequencies {got.tolist()}, but action_in_proj_cfg "
                             f"gives {want.tolist()}")


def load_pretrained(path, dtype=None, device=None) -> VLA:
    """Load a Hugging Face Qwen2.5-VL or Qwen3-VL folder (language model and vision tower, DeepStack
    mergers included), or an Alpamayo-R1 folder ('vlm.' prefix) with its flow-matching action expert
    ('expert.*', 'action_in_proj.*', 'action_out_proj.*' -> `model.expert`, an expert.ActionExpert);
    one file or shards with an index.

    Accepts both layouts ('model.layers.*' / 'visual.*' and 'model.language_model.*' /
    'model.visual.*'). Every key must be used and every weight found: a missing or unknown key is
    an error naming it. The only keys not loaded are the Fourier frequencies of action_in_proj,
    which the config fixes (checked to agree). The MLP trajectory head of a plain Qwen-VL folder is
    not in these checkpoints and stays randomly initialised; an Alpamayo model has none.
    dtype None keeps the checkpoint's dtype."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: checkpoint folder not found")
    cfg, family, alpamayo, expert_cfg = _hf_config(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        key_file = {k: os.path.join(path, v) for k, v in read_json(index)["weight_map"].items()}
    elif os.path.isfile(os.path.join(path, WEIGHTS)):
        key_file = None
    else:
        raise FileNotFoundError(f"{path}: no {WEIGHTS} or model.safetensors.index.json")
    handles = {}

    def handle(file):
        if file not in handles:
            handles[file] = _open_safetensors(file)
        return handles[file]

    if key_file is None:
        key_file = dict.fromkeys(handle(os.path.join(path, WEIGHTS)).keys(), os.path.join(path, WEIGHTS))
    found, freqs = {}, {}
    for key, file in key_file.items():
        k = key
        if alpamayo and k.startswith(ALPAMAYO_EXPERT):
            if expert_cfg is not None and k.startswith("action_in_proj.") and k.endswith(".freqs"):
                freqs[key] = (file, _read_tensor(handle(file), file, key))
                continue
            k = k if k.startswith("expert.") else "expert." + k  # action_*_proj live in model.expert
        else:
            k = _hf_name(k[4:] if alpamayo and k.startswith("vlm.") else k)
        if k == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: embed_tokens.weight is the one that counts
        found[k] = (file, key)
    if expert_cfg is not None:
        _check_fourier_buffers(path, freqs, expert_cfg)
    first_file, first_key = found.get("embed_tokens.weight", next(iter(found.values())))
    dtype = dtype or _read_tensor(handle(first_file), first_file, first_key).dtype
    model = _empty_model(cfg, None, dtype, device or "cpu", expert_cfg)
    shapes, parts = _hf_layout(model)
    _check_keys(shapes, found, f"{path} ({family}{', Alpamayo' if alpamayo else ''})")
    for k, (file, key) in found.items():
        _check_shape(file, key, shapes[k], handle(file).get_slice(key).get_shape())
    sd = model.state_dict()
    with torch.no_grad():
        for name, hf_names in parts.items():
            ts = [_read_tensor(handle(found[h][0]), found[h][0], found[h][1]) for h in hf_names]
            sd[name].copy_(torch.cat(ts).reshape(sd[name].shape))
        if model.traj_head is not None:
            model.traj_head.apply(VLA._init_weights)
            log.warning("load_pretrained(%s): trajectory head not in the checkpoint, randomly initialised", path)
    return model
