"""Our checkpoint format: one safetensors file per model, its config in the file's own header.

Paper: a routine reasoner q (draft) is only valid with the deliberative reasoner p (target) it was distilled from:
its file records that target's fingerprint, and loading it with another target is refused.

On disk: RUN/target/model.safetensors, RUN/draft_<kind>_s<seed>/model.safetensors, whose header's "rsd-vla" entry is
{"draft": bool, "config": every ModelConfig field, "target": the target's fingerprint (drafts)}. A draft stores only its
own weights (and a reduced vocabulary's `vocab_ids`). A save is one os.replace: config and weights cannot come apart,
and a kill at any point leaves the previous checkpoint. Hugging Face folders: hf.py.

run: python -m pytest -q tests/test_checkpoint.py
"""
import contextlib
import dataclasses
import hashlib
import json
import os
import sys

from safetensors import safe_open
from safetensors.torch import save_file
import torch

from checks import check_vocab_ids
from model import VLA, ModelConfig, VisionConfig, draft_kind
from ops import files
from ops.files import atomic_write, new_folders, read_json, remove_stale_tmp

WEIGHTS, KEY = "model.safetensors", "rsd-vla"  # a checkpoint folder's one file, and its header's entry
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo
SHIPPED = os.path.join(ROOT, "checkpoints", "toy")  # the scripts' default --run


# ---- save / load ----
def draft_dir(run, kind, seed=0):
    """kind: mrope (the replica), flat (FlatRoPE) or aarl (FlatRoPE + AARL); seeds vary init and batch order only."""
    return os.path.join(run, f"draft_{kind}_s{seed}")


def save(model: VLA, dir, target: VLA | None = None):
    """Write dir/model.safetensors over a checkpoint of the same kind only. A draft records its target's fingerprint."""
    draft = model.cfg.shared_width is not None
    if getattr(model, "expert", None) is not None:
        raise ValueError("this format holds no Alpamayo action expert: keep the model's Alpamayo folder")
    if draft and target is None:
        raise ValueError(f"{dir}: saving a draft needs target= (the model it was distilled from), whose fingerprint "
                         "the draft records")
    if draft and target.embed_tokens is not model.embed_tokens:
        raise ValueError(f"{dir}: target= is not the model whose embedding and LM head this draft shares")
    check_output(dir, f"{draft_kind(model.cfg)} draft" if draft else "target", overwrite=True)
    meta = {"draft": draft, "config": model.cfg.to_dict(), **({"target": fingerprint(target)} if draft else {})}
    sd = {k: v.detach().contiguous() for k, v in _stored(model).items()}
    if (bad := first_nonfinite(sd.items())) is not None:  # a diverged run's weights would load as garbage later
        raise FloatingPointError(f"{dir}: refusing to save a model whose {bad!r} holds NaN / inf")
    with new_folders(dir):  # a failed write leaves no folder it made
        remove_stale_tmp(dir)  # a killed save's (one writer per run)
        atomic_write(os.path.join(dir, WEIGHTS), lambda p: save_file(sd, p, metadata={KEY: json.dumps(meta)}))


def load(dir, target: VLA | None = None, dtype=None, device=None) -> VLA:
    """A model written by save(), carrying its file's fingerprint; dtype None keeps the file's. A draft needs the
    target it was distilled from (another is refused) and shares its embedding, LM head, dtype and device."""
    if not os.path.isdir(dir):
        raise FileNotFoundError(f"{dir}: checkpoint folder not found")
    path = os.path.join(dir, WEIGHTS)
    f = open_safetensors(path)
    meta, cfg = header(dir, f)
    if meta["draft"]:
        _check_target(dir, meta, cfg, target)
        dtype, device = dtype or target.embed_tokens.weight.dtype, device or target.embed_tokens.weight.device
    keys = sorted(f.keys())
    if not keys:
        raise ValueError(f"{path}: holds no tensors")
    model = empty_model(cfg, target if meta["draft"] else None, dtype or f.get_tensor(keys[0]).dtype, device or "cpu")
    sd = _stored(model)
    check_keys(sd, keys, path)
    h = hashlib.sha256()
    with torch.no_grad():
        for k in keys:
            check_shape(path, k, sd[k].shape, f.get_slice(k).get_shape())
            sd[k].copy_(_hash(h, k, f.get_tensor(k)))
            if first_nonfinite([(k, sd[k])]):
                raise ValueError(f"{path}: tensor {k!r} holds NaN / inf (written by a run that diverged): retrain it")
    if cfg.draft_vocab:  # a reduced-vocabulary draft's ids (its `vocab_ids` buffer) must be usable ids
        try:
            check_vocab_ids(model.vocab_ids, cfg.vocab_size, cfg.draft_vocab)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    model.checkpoint_fingerprint = {"config": config_hash(meta["config"]), "weights": h.hexdigest()[:16]}
    return model


def first_nonfinite(named):
    """The name of the first floating-point tensor of (name, tensor) pairs holding NaN or inf, else None."""
    return next((k for k, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)


def empty_model(cfg, shared, dtype, device, expert=None):
    """A VLA with uninitialised storage; expert: a function cfg -> module built as `model.expert` beside it (real/hf.py
    passes Alpamayo's action expert, which this format does not hold)."""
    with torch.device("meta"):
        model = VLA(cfg, shared=shared)
        if expert is not None:
            model.expert = expert(cfg)
    model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.reset_buffers(device)
    return model


def _stored(model):
    """The state dict a file holds: without a tied LM head (the same tensor as the embedding)."""
    tied = model.cfg.tie_word_embeddings and model.cfg.shared_width is None
    return {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


# ---- fingerprints: a draft bound to its target ----
def _hash(h, name, t):
    """Feed (name, dtype, shape, bytes) of t to the sha256 h; tensors go in name order."""
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
    h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return t


def config_hash(config: dict):
    """A config's hash (16 hex digits). A LATER_FIELDS field at its default is left out: a file written before it existed and one written after, of
    the same model, have one fingerprint (the drafts and search records that name it stay valid)."""
    config = {k: v for k, v in config.items() if k not in LATER_FIELDS or v != LATER_FIELDS[k]}
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(model) -> dict:
    """{"config", "weights"}: sha256 (16 hex digits) of a model's config and stored tensors; a model read by load() or
    hf.load_pretrained() keeps its file's (a target loaded in bf16 matches its fp32 file), others are hashed."""
    fp, h = getattr(model, "checkpoint_fingerprint", None), hashlib.sha256()
    if fp is None and getattr(model, "checkpoint_files", None):  # load_pretrained's: hashed when first asked (16 GB)
        cfg_path, keys = model.checkpoint_files
        handles = {file: open_safetensors(file) for _, file in keys}
        for key, file in keys:
            _hash(h, key, handles[file].get_tensor(key))
        fp = model.checkpoint_fingerprint = {"config": config_hash(read_json(cfg_path)), "weights": h.hexdigest()[:16]}
    if fp is None:
        for k, t in sorted(_stored(model).items()):
            _hash(h, k, t)
        fp = {"config": config_hash(model.cfg.to_dict()), "weights": h.hexdigest()[:16]}
    return fp


def _check_target(dir, meta, cfg, target):
    if target is None:
        raise ValueError(f"{dir} holds a draft: pass target= (the model whose embedding and LM head it shares)")
    if (target.cfg.hidden_size, target.cfg.vocab_size) != (cfg.shared_width, cfg.vocab_size):
        raise ValueError(f"{dir}: draft expects a target of width {cfg.shared_width} and vocab {cfg.vocab_size}, "
                         f"got {target.cfg.hidden_size} and {target.cfg.vocab_size}")
    want, have = meta.get("target") or {}, fingerprint(target)
    if stale := [part for part in ("weights", "config") if have.get(part) != want.get(part)]:
        folder = getattr(target, "checkpoint_files", None)  # a Hugging Face / Alpamayo folder's (hf.load_pretrained)
        retrain = (f"python -m real.distill --target {os.path.dirname(folder[0])} --scenes SCENES" if folder else
                   "python train.py --stage drafts, or python rsd.py --retrain")  # the toy's own programs
        raise ValueError(f"{dir}: stale draft: it was distilled from another target (its "
                         + " and ".join(f"{p} {want.get(p)} there, {have.get(p)} in the target given" for p in stale)
                         + f"); distil a draft for this target ({retrain}), or load it with the target it was made "
                         "from")


# ---- what a path holds: never replace what is not a checkpoint of the kind ----
def existing_kind(path):
    """What `path` holds, for a writer about to replace it: None (nothing, or an empty folder), "target" /
    "<kind> draft" (ours, model.DRAFT_KINDS), else words saying what is there."""
    if not os.path.isdir(path):
        return "a file" if os.path.lexists(path) else None
    if not (names := [n for n in os.listdir(path) if not n.endswith(".tmp")]):  # a killed save's leftover is not data
        return None
    with contextlib.suppress(OSError, ValueError):
        meta, cfg = header(path)
        return f"{draft_kind(cfg)} draft" if meta["draft"] else "target"
    return f"a folder of {len(names)} entries ({', '.join(sorted(names)[:3])}{', ...' if len(names) > 3 else ''})"


def check_output(path, kind, overwrite=False, how="pass overwrite=True to replace it, or write to another folder"):
    """Refuse, before any work, to write a `kind` checkpoint (existing_kind's words) at path over anything else, or
    over one of that kind unless overwrite; `how` says which command replaces it."""
    if (have := existing_kind(path)) is not None and have != kind:
        raise FileExistsError(f"{path} holds {have if have.startswith('a ') else 'a ' + have + ' checkpoint'}, not a "
                              f"{kind} checkpoint: refusing to replace it; write to another folder")
    if have is not None and not overwrite:
        raise FileExistsError(f"{path} holds a {kind} checkpoint already: {how}")


# ---- clear errors on a bad file ----
# Config fields added after checkpoints were shipped: a file without one loads with the default below, which is the
# behaviour of the code that wrote it (said once per process on stderr). Every other field is required.
LATER_FIELDS = {"skip_visual": False}
_said = set()


def header(dir, f=None):
    """(header, ModelConfig) of dir/model.safetensors, every field required but LATER_FIELDS (a default could change
    the logits)."""
    path = os.path.join(dir, WEIGHTS)
    f = f or open_safetensors(path)
    try:
        meta = json.loads((f.metadata() or {})[KEY])
        if not isinstance(meta["draft"], bool) or not isinstance(meta["config"], dict):
            raise TypeError
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: not a checkpoint written by checkpoint.save (no {KEY!r} header with 'draft' and "
                         "'config'; for Hugging Face / Alpamayo folders use hf.load_pretrained)") from None
    raw = meta["config"]
    if older := {k: v for k, v in LATER_FIELDS.items() if k not in raw}:
        if tuple(older) not in _said:
            _said.add(tuple(older))
            print(f"checkpoint: {path} (and any other file this old) predates config field(s) "
                  f"{', '.join(f'{k} (loaded as {v})' for k, v in older.items())}", file=sys.stderr)
        raw = raw | older
    missing = [fl.name for fl in dataclasses.fields(ModelConfig) if fl.name not in raw]
    if isinstance(raw.get("vision"), dict):
        missing += [f"vision.{fl.name}" for fl in dataclasses.fields(VisionConfig) if fl.name not in raw["vision"]]
    if missing:
        raise ValueError(f"{path}: missing config field(s) {missing}: this format requires every field the model "
                         "depends on")
    try:
        return meta, ModelConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad config: {e}") from None


def open_safetensors(path):
    if not os.path.lexists(path):  # an empty or foreign folder: say so, not a bare [Errno 2]
        raise FileNotFoundError(f"{path}: no such file (is {os.path.dirname(path)} a checkpoint folder?)")
    files.check_regular(path)  # a shard that is a FIFO would wait for a writer forever
    with open(path, "rb") as f:
        if f.read(40).startswith(b"version https://git-lfs"):
            raise ValueError(f"{path}: a git-lfs pointer, not the weights: fetch them with `git lfs pull`")
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises its own error type for bad headers / short files
        raise ValueError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None


def check_keys(expected, found, where):
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        fmt = lambda ks: f"{len(ks)} {ks[:20]}{' ...' if len(ks) > 20 else ''}"  # noqa: E731
        raise ValueError(f"{where}: key mismatch: missing {fmt(missing)}; unexpected {fmt(unexpected)}")


def check_shape(path, key, expected, got):
    if tuple(expected) != tuple(got):
        raise ValueError(f"{path}: shape mismatch for {key!r}: expected {tuple(expected)}, got {tuple(got)}")
