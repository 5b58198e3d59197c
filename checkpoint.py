"""How a run is stored and described: our checkpoint format, the Hugging Face Qwen2.5-VL /
Qwen3-VL / Alpamayo-R1 folder loader and its reverse for Qwen2.5-VL (export_pretrained), the atomic
file and folder writers, the run folder's writer lock, JSON reading with clear errors, the inference
dtypes, and command-line flags generated from a config dataclass (with the --device check).

Paper: the deliberative reasoner is an unmodified Alpamayo-R1-style VLA (a Qwen-VL backbone);
`load_pretrained` reads such checkpoints into `model.VLA` so that the same decoder, KV cache and
speculative decoding run on real weights (docs/background.md, "Alpamayo-R1 prompt layout");
`export_pretrained` writes the toy target and its replica draft as Qwen2.5-VL folders, so that
transformers' generate and assisted generation run the same weights (peer.py).

Files on disk (our format): a folder with config.json ({"format": "rsd-vla", "draft": bool,
"config": ModelConfig, "fingerprint": {"config", "weights"}} and, for a draft, "target": the
fingerprint of the target it was distilled from) and model.safetensors. A draft's file holds only
its own weights (a reduced-vocabulary draft's also its `vocab_ids`, the K target ids its head
covers); the target's embedding and LM head are re-attached by load(dir, target=...), which
refuses a target whose fingerprint differs. Every ModelConfig field is required except LATER_FIELDS.
A folder is written as a whole (atomic_folder) and replaces only a checkpoint of its own kind (check_output); a run
folder has one writer at a time (writer_lock).

Hugging Face / Alpamayo config.json fields read by the Qwen3-VL vision tower (each required; a
folder missing one gets an error naming it): vision_config.{depth, hidden_size, num_heads,
intermediate_size, patch_size, temporal_patch_size, spatial_merge_size, in_channels,
num_position_embeddings, deepstack_visual_indexes, out_hidden_size, hidden_act}; optional
vision_config.rope_parameters.rope_theta (transformers' default 10000). An Alpamayo folder with an
`expert_cfg` loads its action expert: the fields expert.ExpertConfig.from_alpamayo lists.

run: python -m pytest -q tests/test_checkpoint.py tests/test_export.py
"""
import argparse
import contextlib
import dataclasses
import errno
import hashlib
import inspect
import io
import json
import logging
import os
import re
import shutil
import socket
import sys
import textwrap
import time
import tokenize

try:
    import fcntl  # POSIX file locks (writer_lock)
except ImportError:  # Windows
    fcntl = None

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from expert import ActionExpert, ExpertConfig, fourier_freqs
from model import PRESETS, VLA, ModelConfig, VisionConfig, check_vocab_ids

log = logging.getLogger(__name__)

WEIGHTS, CONFIG = "model.safetensors", "config.json"
# The shipped toy checkpoints, found from any working folder (the scripts' default --run).
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints", "toy")
# The one dtype vocabulary of every script's --dtype flag.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# ---- files: atomic writers, stale leftovers, JSON ----

# Temporary and set-aside entries are hidden siblings named after their writer, .NAME.HOST.PID.RANDOM.{tmp,old},
# so that the next writer can tell the leftovers of a killed one (pid gone) from a live writer's work.
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
_SIDE = re.compile(r"^\.(?P<name>.+)\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.(?P<kind>tmp|old)$")


def _side_path(path, kind):
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}.{_HOST}.{os.getpid()}.{os.urandom(4).hex()}.{kind}")


def _alive(host, pid):
    if host != _HOST or pid == os.getpid():  # another machine's writer (shared file system) or this process
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _usual_mode(path):
    """The permissions any other output gets (0666 minus the umask): safetensors writes its files 0600."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _fsync(path):
    """fsync a file, or a folder's entries (POSIX: a rename is durable once its folder is synced)."""
    if os.name != "posix" and os.path.isdir(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean_stale(folder, name=None):
    """Undo what writers killed mid-write (kill -9, power loss) left in folder, for entry `name` or all: their
    temporary files and folders go; a checkpoint moved aside to swap in a new one goes back in place when the new one
    never arrived. Entries of live writers are left alone. Returns one line per action (also logged)."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    done = []
    for n in names:
        m = _SIDE.match(n)
        if not m or (name is not None and m["name"] != name) or _alive(m["host"], int(m["pid"])):
            continue
        side, dest = os.path.join(folder, n), os.path.join(folder, m["name"])
        if m["kind"] == "old" and not os.path.exists(dest):
            os.rename(side, dest)
            done.append(f"{dest}: restored the previous checkpoint (pid {m['pid']} was killed while replacing it)")
        else:
            _remove(side)
            done.append(f"{side}: removed (left by pid {m['pid']}, killed while writing)")
    for line in done:
        log.warning(line)
    return done


def _writing(path, write, tmp):
    """write(tmp), a failure named by the path it was for: torch's serializer reports a full disk as a RuntimeError
    of its inline_container.cc with neither the path nor the cause."""
    try:
        write(tmp)
    except (OSError, RuntimeError) as e:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(tmp))).free
        why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        full = getattr(e, "errno", None) == errno.ENOSPC or free < 2**20
        raise OSError(f"{path}: write failed ({why}); {free / 2**20:.0f} MiB free on its disk"
                      + (": no space left on device" if full else "")) from None


def atomic_write(path, write):
    """write(tmp_path) into a temporary file beside path, fsync, then rename over path: a crash mid-write leaves the
    previous file intact, and its temporary file is removed by the next write (clean_stale). The file gets the
    permissions of any other output."""
    parent = os.path.dirname(os.path.abspath(path))
    clean_stale(parent, os.path.basename(path))
    tmp = _side_path(path, "tmp")
    try:
        _writing(path, write, tmp)
        _usual_mode(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(parent)
    except BaseException:
        _remove(tmp)
        raise


def atomic_folder(dir, write):
    """write(tmp_dir) fills a temporary folder beside dir; its files and the folder are fsynced, then it replaces dir
    as a whole: dir -> .dir...old, tmp -> dir, the old one deleted. A crash before the swap leaves the previous dir
    intact; one between the two renames leaves it under the .old name, which clean_stale puts back (the next write,
    writer_lock or load does). No reader ever sees new weights beside an old config.json."""
    parent, name = os.path.split(os.path.abspath(dir))
    os.makedirs(parent, exist_ok=True)
    clean_stale(parent, name)
    tmp, old = _side_path(dir, "tmp"), None
    os.mkdir(tmp)
    try:
        _writing(dir, write, tmp)
        for n in os.listdir(tmp):
            _usual_mode(os.path.join(tmp, n))
            _fsync(os.path.join(tmp, n))
        _fsync(tmp)
        if os.path.exists(dir):
            old = _side_path(dir, "old")
            os.rename(dir, old)
        os.rename(tmp, dir)
        _fsync(parent)
    except BaseException:
        if old is not None and not os.path.exists(dir):
            os.rename(old, dir)
            old = None
        _remove(tmp)
        raise
    if old is not None:
        _remove(old)


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def write_json(path, obj):
    atomic_write(path, lambda p: _write_text(p, json.dumps(obj, indent=1)))


def torch_save(obj, path):
    atomic_write(path, lambda p: torch.save(obj, p))


def existing_kind(path):
    """What `path` holds, for a writer about to replace it: None (nothing, or an empty folder: nothing to lose),
    "target" / "<rope_mode> draft" (our checkpoints), "qwen2_5_vl folder" (export_pretrained's), else words saying
    what is there."""
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return "a file"
    names = os.listdir(path)
    if not names:
        return None
    try:
        with open(os.path.join(path, CONFIG)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        meta = None
    if isinstance(meta, dict) and meta.get("format") == "rsd-vla":
        return f"{(meta.get('config') or {}).get('rope_mode')} draft" if meta.get("draft") else "target"
    if isinstance(meta, dict) and meta.get("model_type") == "qwen2_5_vl":
        return "qwen2_5_vl folder"
    shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
    return f"a folder of {len(names)} entries ({shown})"


def check_output(path, kind, overwrite=False, how="pass overwrite=True to replace it, or write to another folder"):
    """Refuse, before any work, to write a `kind` checkpoint (existing_kind's words) at path when that would destroy
    something: whatever is not a checkpoint of that kind always, an existing one of that kind unless overwrite.
    `how` says which command replaces it, for the message."""
    have = existing_kind(path)
    if have is None:
        return
    if have != kind:
        raise FileExistsError(f"{path} holds {have if have.startswith('a ') else 'a ' + have + ' checkpoint'}, not a "
                              f"{kind} checkpoint: refusing to replace it; write to another folder")
    if not overwrite:
        raise FileExistsError(f"{path} holds a {kind} checkpoint already: {how}")


def read_json(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: file not found")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def check_writable(folder):
    """Create folder if needed and prove it takes a file, before any work: a read-only output folder is an error that
    names it, not a PermissionError at the first checkpoint."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = _side_path(os.path.join(folder, "write-test"), "tmp")
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"{folder}: output folder is not writable ({e.strerror or e})") from None


# ---- the run folder's writer lock ----

LOCK = ".lock"  # in the run folder: exists while a writer holds it, and says who (JSON)
_HELD = {}  # realpath of a locked folder -> [fd, depth]: this process's locks, so that nested writers re-enter


class FolderLocked(RuntimeError):
    """Another live process holds the run folder's writer lock."""


def _holder_text(raw):
    try:
        h = json.loads(raw)
        return f"pid {h['pid']} on {h['host']} (`{h['command']}`, since {h['since']})"
    except (ValueError, KeyError, TypeError):
        return "an unknown process (unreadable lock file)"


@contextlib.contextmanager
def writer_lock(folder):
    """Hold folder's writer lock for the block: an OS lock (flock) on folder/.lock, which the kernel releases when the
    process exits however it exits (kill -9 included), so no lock outlives its holder. A second writer gets
    FolderLocked naming the holder; a .lock file left by a killed holder no longer locks and is reported as stale.
    Entering also creates folder, checks that it is writable and cleans what a killed writer left in it (clean_stale).
    Re-entrant within a process (rsd.py's retrain calls train.py's run)."""
    key = os.path.realpath(folder)
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield
        finally:
            _HELD[key][1] -= 1
        return
    check_writable(folder)
    if fcntl is None:  # no flock (Windows): no lock, and a warning that says so
        log.warning("%s: no file locking on this platform; make sure one process writes here at a time", folder)
        yield
        return
    path = os.path.join(folder, LOCK)
    while True:  # lock the file that is at `path` when we hold it (a releasing holder unlinks it first)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raw = os.read(fd, 4096).decode(errors="replace")
            os.close(fd)
            raise FolderLocked(f"{folder} is being written by {_holder_text(raw)}: wait for it to finish, or write "
                               "to another folder (--out)") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    stale = os.read(fd, 4096).decode(errors="replace")
    if stale.strip():
        log.warning("%s: stale lock of %s, which is gone (killed?): taking it over", path, _holder_text(stale))
    me = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
          "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _HELD[key] = [fd, 1]
    try:
        clean_stale(folder)
        yield
    finally:
        del _HELD[key]
        os.unlink(path)  # while still holding it: a waiting writer then finds no file at `path` and retries
        os.close(fd)


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


@contextlib.contextmanager
def user_errors(ap: argparse.ArgumentParser):
    """A script's expected errors (a bad value, a missing, unwritable or existing file, a full disk, a locked run
    folder) as argparse's one line `prog: error: ...` and exit status 2; anything else is a bug and keeps its
    traceback."""
    try:
        yield
    except (ValueError, OSError, FolderLocked) as e:
        ap.error(str(e))


def check_device(name):
    """torch.device(name), or a clear error before any work: a device torch does not know, or one this machine lacks
    (a script would otherwise fail at its first .to(device), after minutes of data generation)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}, but torch.cuda.is_available() is False (no GPU, or a CPU-only torch)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {name!r}, but torch.backends.mps.is_available() is False")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r}: this code runs on cpu, cuda or mps")
    return device


# ---- our own format ----

# Config fields added after folders had been written without them; their defaults reproduce what those folders meant.
# Every other field is required: a default there could silently change the logits (a toy target trained at RoPE base
# 1e4 would load at ModelConfig's 1e6).
LATER_FIELDS = ("video_frame_blocks", "draft_vocab")
LATER_VISION_FIELDS = ("family", "num_position_embeddings", "deepstack_visual_indexes")


def draft_dir(run, kind, seed=0):
    """The run folder's layout for drafts: run/draft_<kind>_s<seed>, kind mrope (the replica), flat (FlatRoPE) or
    aarl (FlatRoPE + AARL with the static anchor); seeds vary the drafts' initialisation and batch order only."""
    return os.path.join(run, f"draft_{kind}_s{seed}")


class _Hasher:
    """sha256 over (name, dtype, shape, bytes) of tensors fed in name order; 16 hex digits."""

    def __init__(self):
        self.h = hashlib.sha256()

    def add(self, name, t):
        self.h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        self.h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())

    def digest(self):
        return self.h.hexdigest()[:16]


def _config_hash(config: dict):
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def _stored(model):
    """The tensors save() writes: the state dict without a tied LM head (the same tensor as the embedding)."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings and model.cfg.shared_width is None:
        sd.pop("lm_head.weight")
    return sd


def _memory_fingerprint(model, sd=None):
    h = _Hasher()
    for k, t in sorted((sd or _stored(model)).items()):
        h.add(k, t)
    return {"config": _config_hash(model.cfg.to_dict()), "weights": h.digest()}


def fingerprint(model) -> dict:
    """{"config", "weights"}: sha256 (16 hex digits) of a model's config and of its stored tensors (name, dtype, shape,
    bytes). A draft records its target's. A model read by load() or load_pretrained() has its file's (the config as
    stored, the tensors as stored), so a target loaded in bf16 still matches the fp32 folder it came from, and a field
    added to ModelConfig later does not change an old folder's; changing such a model in place does not update it.
    Any other model is hashed from memory, in its dtype."""
    fp = getattr(model, "checkpoint_fingerprint", None)
    files = getattr(model, "checkpoint_files", None)
    if fp is None and files is not None:  # load_pretrained: hashed from the files when first asked (a 16 GB read)
        cfg_path, keys = files
        handles, h = {}, _Hasher()
        for key, file in keys:
            handles.setdefault(file, _open_safetensors(file))
            h.add(key, _read_tensor(handles[file], file, key))
        fp = model.checkpoint_fingerprint = {"config": _config_hash(read_json(cfg_path)), "weights": h.digest()}
    return fp if fp is not None else _memory_fingerprint(model)


def save(model: VLA, dir, target: VLA | None = None):
    """Write the folder dir as a whole (atomic_folder): config.json + model.safetensors. A draft's file holds only its
    own weights (load(dir, target=...) re-attaches the target's embedding / LM head); `target`, the model it was
    distilled from, is required for a draft, and its fingerprint is recorded so that a later load against another
    target is refused. It replaces only a checkpoint of the same kind (check_output): never a file, a run folder or a
    draft of another kind."""
    if getattr(model, "expert", None) is not None:
        raise ValueError("this format holds no Alpamayo action expert: keep the model's Alpamayo folder")
    draft = model.cfg.shared_width is not None
    if draft and target is None:
        raise ValueError(f"{dir}: saving a draft needs target= (the model it was distilled from), whose fingerprint "
                         "the draft records")
    if draft and target.embed_tokens is not model.embed_tokens:
        raise ValueError(f"{dir}: target= is not the model whose embedding and LM head this draft shares")
    check_output(dir, f"{model.cfg.rope_mode} draft" if draft else "target", overwrite=True)
    sd = _stored(model)
    meta = {"format": "rsd-vla", "draft": draft, "config": model.cfg.to_dict(),
            "fingerprint": _memory_fingerprint(model, sd)}
    if draft:
        meta["target"] = fingerprint(target)

    def write(tmp):
        save_file(sd, os.path.join(tmp, WEIGHTS))
        _write_text(os.path.join(tmp, CONFIG), json.dumps(meta, indent=1))

    atomic_folder(dir, write)


def _open_safetensors(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: weights file not found")
    with open(path, "rb") as f:
        if f.read(40).startswith(b"version https://git-lfs"):
            raise ValueError(f"{path}: a git-lfs pointer, not the weights: fetch them with `git lfs pull` in its "
                             "repository")
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


def _own_config(dir):
    """(meta, ModelConfig) of our config.json, every required field checked and named."""
    path = os.path.join(dir, CONFIG)
    meta = read_json(path)
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != "rsd-vla":
        raise ValueError(f"{path}: not a checkpoint written by checkpoint.save "
                         "(for Hugging Face / Alpamayo folders use load_pretrained)")
    if not isinstance(meta.get("draft"), bool):
        raise ValueError(f"{path}: missing or non-boolean field 'draft'")
    raw = meta.get("config")
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: missing field 'config' (an object of ModelConfig fields)")
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in raw and f.name not in LATER_FIELDS]
    if raw.get("vision") is not None:
        if not isinstance(raw["vision"], dict):
            raise ValueError(f"{path}: config field 'vision' must be an object or null")
        missing += [f"vision.{f.name}" for f in dataclasses.fields(VisionConfig)
                    if f.name not in raw["vision"] and f.name not in LATER_VISION_FIELDS]
    if missing:
        raise ValueError(f"{path}: missing config field(s) {missing}: this format requires every field the model "
                         "depends on (a default could change its logits)")
    try:
        return meta, ModelConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: bad config: {e}") from None


def _check_target(dir, meta, target):
    """A draft is bound to the target it was distilled from: refuse another one, saying what changed."""
    want = meta.get("target")
    if want is None:
        log.warning("%s: draft saved without its target's fingerprint (before drafts recorded one): cannot check that "
                    "it was distilled from the target it is loaded with", dir)
        return
    have = fingerprint(target)
    stale = [part for part in ("weights", "config") if have.get(part) != want.get(part)]
    if stale:
        raise ValueError(f"{dir}: stale draft: it was distilled from another target (its "
                         + " and ".join(f"{p} {want.get(p)} there, {have.get(p)} in the target given" for p in stale)
                         + "); retrain the draft from this target (delete it, then python train.py --stage drafts or "
                         "python rsd.py --retrain), or load it with the target it was made from")


def load(dir, target: VLA | None = None, dtype=None, device=None) -> VLA:
    """Load a model written by save(). A draft needs the target it was distilled from (its embedding and LM head are
    re-attached, shared); a target with another fingerprint is refused. The model carries its file's fingerprint."""
    if not os.path.isdir(dir):  # a writer killed mid-swap left the previous checkpoint aside: clean_stale restores it
        clean_stale(*os.path.split(os.path.abspath(dir)))
        if not os.path.isdir(dir):
            raise FileNotFoundError(f"{dir}: checkpoint folder not found")
    meta, cfg = _own_config(dir)
    if meta["draft"]:
        if target is None:
            raise ValueError(f"{dir} holds a draft: pass target= (the model whose embedding and LM head it shares)")
        if (target.cfg.hidden_size, target.cfg.vocab_size) != (cfg.shared_width, cfg.vocab_size):
            raise ValueError(f"{dir}: draft expects a target of width {cfg.shared_width} and vocab {cfg.vocab_size}, "
                             f"got {target.cfg.hidden_size} and {target.cfg.vocab_size}")
        _check_target(dir, meta, target)
        device = device or target.embed_tokens.weight.device
    path = os.path.join(dir, WEIGHTS)
    f = _open_safetensors(path)
    keys = sorted(f.keys())
    if not keys:
        raise ValueError(f"{path}: holds no tensors")
    if dtype is None:  # a draft must match its target; otherwise keep the file's dtype
        dtype = target.embed_tokens.weight.dtype if meta["draft"] else _read_tensor(f, path, keys[0]).dtype
    model = _empty_model(cfg, target if meta["draft"] else None, dtype, device or "cpu")
    sd = model.state_dict()
    if cfg.tie_word_embeddings and cfg.shared_width is None:
        sd.pop("lm_head.weight")
    _check_keys(sd, keys, path)
    h = _Hasher()
    with torch.no_grad():
        for k in keys:
            _check_shape(path, k, sd[k].shape, f.get_slice(k).get_shape())
            t = _read_tensor(f, path, k)
            h.add(k, t)
            sd[k].copy_(t)
    fp = {"config": _config_hash(meta["config"]), "weights": h.digest()}
    recorded = meta.get("fingerprint")  # absent in folders saved before fingerprints
    if recorded is not None and recorded != fp:
        parts = [p for p in ("config", "weights") if recorded.get(p) != fp[p]]
        raise ValueError(f"{dir}: {CONFIG} and {WEIGHTS} do not belong together ({' and '.join(parts)} differ from "
                         f"the fingerprint {CONFIG} records): one was replaced or edited without the other")
    if cfg.draft_vocab:  # a reduced-vocabulary draft's ids (its `vocab_ids` buffer) must be usable ids
        try:
            check_vocab_ids(model.vocab_ids, cfg.vocab_size, cfg.draft_vocab)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    model.checkpoint_fingerprint = fp
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
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") == "rsd-vla":
        raise ValueError(f"{cfg_path}: a checkpoint of this repo's own format (checkpoint.save), not a Hugging Face "
                         "folder: load it with checkpoint.load (bench.py: its run folder as --run, a draft as --draft)")
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
    if not isinstance(text, dict):
        raise ValueError(f"{cfg_path}: text_config must be an object, got {type(text).__name__}")
    _required(text, "hidden_size", cfg_path)
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
    # required: a default vision config would load as a mismatch of hundreds of keys, not as a missing field
    vraw = _required(raw, "vision_config", cfg_path)
    if not isinstance(vraw, dict):
        raise ValueError(f"{cfg_path}: vision_config must be an object, got {type(vraw).__name__}")
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
        vision = _qwen3_vision(vraw, text, cfg_path)
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
            max_seq_len=text.get("max_position_embeddings", 8192))
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
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object (tensor name -> shard file)")
        key_file = {k: os.path.join(path, v) for k, v in weight_map.items()}
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
    if not found:
        raise ValueError(f"{path}: the safetensors file(s) hold no tensors")
    for file in sorted({file for file, _ in found.values()}):  # an index that maps a key to the wrong shard
        stray = sorted({key for f, key in found.values() if f == file} - set(handle(file).keys()))
        if stray:
            raise ValueError(f"{index}: maps {len(stray)} key(s) to {file}, which does not hold them: {stray[:5]}")
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
    model.checkpoint_files = (os.path.join(path, CONFIG), sorted((key, file) for file, key in found.values()))
    return model


# ---- export: our model as a Hugging Face Qwen2.5-VL folder ----


def _hf_disk_name(name):
    """_hf_name's inverse, to the layout of the hub's Qwen2.5-VL files (what transformers 5.24's save_pretrained writes
    for this family): 'X' -> 'model.X', 'visual.X' and 'lm_head.weight' unchanged."""
    return name if name.startswith("visual.") or name == "lm_head.weight" else "model." + name


def _exportable(model: VLA, target: VLA | None, where):
    """The standalone model whose tensors export_pretrained writes: model itself, or for a draft a VLA of the draft's
    own layers with the target's embedding, LM head and vision tower. Refuses, saying why, what Qwen2.5-VL lacks."""
    cfg = model.cfg

    def refuse(why):
        raise ValueError(f"export_pretrained({where}): {why}")

    if getattr(model, "expert", None) is not None:
        refuse("an Alpamayo action expert has no Qwen2.5-VL counterpart (keep the model's Alpamayo folder)")
    vision = (target.cfg if cfg.shared_width is not None and target is not None else cfg).vision
    if cfg.qk_norm or cfg.mrope_interleaved or cfg.video_frame_blocks or (vision and vision.family != "qwen2_5_vl"):
        refuse("Qwen3-VL export is not implemented: this writes Qwen2.5-VL folders only (chunked M-RoPE, no q/k norms, "
               "the windowed ViT)")
    if cfg.rope_mode != "mrope":
        refuse(f"rope_mode {cfg.rope_mode!r}: FlatRoPE has no Hugging Face counterpart (transformers' Qwen2.5-VL "
               "always gives image tokens 3D M-RoPE positions); only the M-RoPE replica draft can be exported")
    if not cfg.qkv_bias:
        refuse("qkv_bias is False, but Qwen2.5-VL's q/k/v projections always have biases")
    if cfg.head_dim * cfg.n_heads != cfg.hidden_size:
        refuse(f"head_dim {cfg.head_dim} != hidden_size {cfg.hidden_size} / n_heads {cfg.n_heads}: transformers' "
               "Qwen2.5-VL derives head_dim from them")
    if vision is not None and cfg.tokens_per_second != int(cfg.tokens_per_second):
        refuse(f"tokens_per_second {cfg.tokens_per_second} is not an integer (an int in transformers' vision_config)")
    if cfg.shared_width is None:
        if model.visual is None:
            refuse("the model has no vision tower, and a Qwen2.5-VL always has one")
        return model
    if target is None:
        refuse("a draft shares its target's embedding and LM head: pass target= (the model it was distilled from)")
    if target.embed_tokens is not model.embed_tokens:
        refuse("target= is not the model whose embedding and LM head this draft shares")
    if cfg.shared_width != cfg.hidden_size:
        refuse(f"the draft's width {cfg.hidden_size} differs from its target's {cfg.shared_width}: its bridges "
               "proj_in / proj_out have no Qwen2.5-VL counterpart")
    if target.visual is None:
        refuse("the target has no vision tower, and a Qwen2.5-VL always has one")
    # the draft reads the target's image features (speculate.embed_prompt); a standalone model computes them itself,
    # so it gets a copy of the target's tower, and transformers' assistant then sees the same features
    own = dataclasses.replace(cfg, shared_width=None, vision=target.cfg.vision,
                              tie_word_embeddings=target.cfg.tie_word_embeddings)
    w = model.embed_tokens.weight
    standalone = _empty_model(own, None, w.dtype, w.device)
    sd = {**model.state_dict(), "embed_tokens.weight": target.embed_tokens.weight,
          "lm_head.weight": target.lm_head.weight,
          **{"visual." + k: v for k, v in target.visual.state_dict().items()}}
    standalone.load_state_dict(sd)
    return standalone


def _hf_json(cfg: ModelConfig, dtype, token_ids):
    """config.json in the form transformers 5.24's Qwen2_5_VLConfig reads (and _hf_config reads back)."""
    v = cfg.vision
    text = dict(model_type="qwen2_5_vl_text", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.n_layers,
                num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, hidden_act="silu",
                max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps, use_sliding_window=False,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                 "mrope_section": list(cfg.mrope_section)},
                bos_token_id=token_ids.get("bos_token_id"), eos_token_id=token_ids.get("eos_token_id"),
                pad_token_id=token_ids.get("pad_token_id"))
    vision = dict(model_type="qwen2_5_vl_vision", depth=v.depth, hidden_size=v.hidden, hidden_act="silu",
                  intermediate_size=v.intermediate, num_heads=v.heads, in_channels=v.in_channels,
                  patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                  spatial_merge_size=v.spatial_merge_size, tokens_per_second=int(cfg.tokens_per_second),
                  window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_block_indexes),
                  out_hidden_size=cfg.hidden_size, rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    out = dict(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", text_config=text,
               vision_config=vision, image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
               vision_start_token_id=cfg.vision_start_token_id, tie_word_embeddings=cfg.tie_word_embeddings,
               dtype=str(dtype).removeprefix("torch."))
    if token_ids.get("vision_end_token_id") is not None:
        out["vision_end_token_id"] = token_ids["vision_end_token_id"]
    return out


TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "vision_end_token_id")


def export_pretrained(model: VLA, dir, target: VLA | None = None, **token_ids):
    """Write `model` as a Hugging Face Qwen2.5-VL folder (config.json + model.safetensors) that transformers 5.24's
    Qwen2_5_VLForConditionalGeneration and load_pretrained both read: the reverse of load_pretrained, through the same
    name / shape map (_hf_layout). Our fused q/k/v and gate/up are split into q_proj, k_proj, v_proj and gate_proj,
    up_proj, the patch embedding becomes the Conv3d kernel (hidden, C, tp, p, p); the folder is written as a whole
    (atomic_folder), in the model's dtype.

    Not exported: the TrajHead (the toy's trajectory step has no Hugging Face counterpart; load_pretrained gives the
    folder a fresh one). A draft (cfg.shared_width set) needs target=, the model whose embedding and LM head it
    shares: it is written as a standalone Qwen2.5-VL with copies of the target's embedding, LM head and vision tower,
    so that a plain transformers model computes the target's image features itself (the assistant model of
    transformers' assisted generation). Only the M-RoPE replica of the target's width can be: FlatRoPE and the width
    bridges proj_in / proj_out have no Hugging Face counterpart, and are refused, as are Qwen3-VL models (export not
    implemented) and Alpamayo action experts.

    token_ids: bos_token_id, eos_token_id, pad_token_id (text_config), vision_end_token_id, ids ModelConfig does not
    hold; transformers 5.24 takes M-RoPE positions from mm_token_type_ids and reads no vision_start / vision_end ids,
    so they only document the prompt format. One difference stays with the prompts, not the weights: a video whose
    scaled t ids run past its spatial extent gets other positions in transformers 5.24 (rope.get_rope_index)."""
    unknown = sorted(set(token_ids) - set(TOKEN_ID_FIELDS))
    if unknown:
        raise TypeError(f"export_pretrained: unknown token id fields {unknown}; known: {list(TOKEN_ID_FIELDS)}")
    m = _exportable(model, target, dir)
    check_output(dir, "qwen2_5_vl folder", overwrite=True)
    shapes, parts = _hf_layout(m)
    sd, tensors = m.state_dict(), {}
    for name, hf_names in parts.items():
        t = sd[name].detach()
        if len(hf_names) > 1:
            # (H*hd + 2*Hk*hd, D) -> q (H*hd, D), k, v (Hk*hd, D); or (2*I, D) -> gate, up (I, D). Copies: safetensors
            # refuses tensors that share storage
            pieces = [p.clone() for p in t.split([shapes[h][0] for h in hf_names])]
        else:  # as is, but the patch embedding: (C_vit, C*tp*p*p) -> the Conv3d kernel (C_vit, C, tp, p, p)
            pieces = [t.reshape(shapes[hf_names[0]]).contiguous()]
        for h, p in zip(hf_names, pieces):
            tensors[_hf_disk_name(h)] = p
    meta = _hf_json(m.cfg, next(iter(tensors.values())).dtype, token_ids)

    def write(tmp):
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        _write_text(os.path.join(tmp, CONFIG), json.dumps(meta, indent=1))

    atomic_folder(dir, write)
