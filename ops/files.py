"""What a run writes, safely: atomic files (a kill at any point leaves the previous file), JSON, resumable training
state, and one writer per run folder (a lock that the kernel releases when its holder dies).

run: python -m pytest -q tests/test_checkpoint.py tests/test_user_errors.py
"""
import contextlib
import errno
import fcntl
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time

from safetensors import SafetensorError
import torch

LOCK = ".lock"  # in a run folder: flock'ed by its writer, who writes into it who it is
TMP = re.compile(r"\..+\.\d+\.[0-9a-f]{8}\.tmp")  # atomic_write's temporary files: .<name>.<pid>.<hex>.tmp
_HELD = set()  # realpaths of the run folders this process holds
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")  # the camera images a scene's cameras/ or an --images-dir folder holds
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")  # the repo's models


# ---- atomic files ----
def atomic_write(path, write):
    """write(tmp) to a temporary file beside path, fsync, os.replace over path: a kill at any point leaves the previous
    file (and at most the hidden .tmp). The file gets any other output's permissions (safetensors writes 0600)."""
    parent, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(parent):  # else the failed write below would read as a full disk
        raise FileNotFoundError(f"{path}: its folder {parent} does not exist")
    tmp = os.path.join(parent, f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        try:
            write(tmp)
        # torch reports a full disk as a RuntimeError naming no path or cause, safetensors as its own error type
        except (OSError, RuntimeError, SafetensorError) as e:
            free = shutil.disk_usage(parent).free if os.path.isdir(parent) else 0
            full = ": no space left on device" if getattr(e, "errno", None) == errno.ENOSPC or free < 2**20 else ""
            raise OSError(f"{path}: write failed ({(str(e).strip() or type(e).__name__).splitlines()[-1]}); "
                          f"{free / 2**20:.0f} MiB free on its disk{full}") from None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(parent)  # the rename is durable once its folder is synced
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def remove_stale_tmp(folder):
    """Remove atomic_write's temporary files from folder: a killed write's, once its folder's one writer starts."""
    for n in os.listdir(folder) if os.path.isdir(folder) else ():
        if TMP.fullmatch(n):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, n))


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def write_json(path, obj):
    atomic_write(path, lambda p: pathlib.Path(p).write_text(json.dumps(obj, indent=1)))


def torch_save(obj, path):
    atomic_write(path, lambda p: torch.save(obj, p))


def check_regular(path, what=None):
    """FileNotFoundError, or a ValueError for a path that exists but is not a regular file (a folder, a FIFO, a
    device): opening a FIFO waits for a writer forever, so every input file is checked before it is opened."""
    if not os.path.lexists(path) or (os.path.islink(path) and not os.path.exists(path)):
        raise FileNotFoundError(f"{what or path}: file not found")
    if not os.path.isfile(path):
        raise ValueError(f"{what or path}: {'is a directory' if os.path.isdir(path) else 'is not a regular file'}")


def listed(folder, suffixes):
    """folder's files whose names end in suffixes (case-insensitive; hidden ones skipped), sorted by name, each checked
    regular (check_regular, which follows a symlink) before any is opened: a file found by listing a folder is opened
    as one named by a flag is."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such folder")
    paths = [os.path.join(folder, n) for n in sorted(os.listdir(folder))
             if not n.startswith(".") and n.lower().endswith(suffixes)]
    for p in paths:
        check_regular(p)
    return paths


def read_json(path):
    check_regular(path)
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # the codec's words name no file
        raise ValueError(f"{path}: not valid JSON ({e})") from None


# ---- one writer per run folder ----
class FolderLocked(RuntimeError):
    """Another live process holds the run folder's writer lock."""


def check_out_dir(out, inputs, may_contain=()):
    """Refuse, before any work, an output folder that is a filesystem root, inside the repo's shipped checkpoints/, or
    that is, contains or lies inside an input folder (inputs: {flag: path or None}): the run would write its data and
    drafts into what it reads. may_contain: flags whose folder may sit inside out (an SFT draft beside the draft a run
    writes)."""
    o, shipped = os.path.realpath(out), os.path.realpath(SHIPPED)
    if os.path.dirname(o) == o:
        raise ValueError(f"--out {out} is a filesystem root: give a run folder")
    if os.path.commonpath([o, shipped]) == shipped:  # experiments/ship_toy.py alone writes there, by copying
        raise ValueError(f"--out {out} is inside the shipped {shipped}: give another --out")
    for flag, path in inputs.items():
        p = os.path.realpath(path) if path else None
        how = None if p is None else "is" if o == p else "lies inside" if o.startswith(p.rstrip(os.sep) + os.sep) \
            else "contains" if p.startswith(o + os.sep) and flag not in may_contain else None
        if how:
            raise ValueError(f"--out {out} {how} {flag} {path}: the run would write into what it reads; give "
                             "another --out")


def check_writable(folder):
    """Create folder if needed and prove it takes a file, before any work."""
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"{folder}: output folder is not writable (it is a file, not a folder)")
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise PermissionError(f"{folder}: output folder is not writable ({e.strerror or e})") from None


@contextlib.contextmanager
def new_folders(folder):
    """Create folder for the block (proved writable); the folders this made are removed again if the block leaves them
    empty: a refused or failed run leaves nothing behind."""
    made, f = [], os.path.abspath(folder)  # folder and its parents that makedirs creates, deepest first
    while not os.path.lexists(f):
        made.append(f)
        f = os.path.dirname(f)
    try:
        check_writable(folder)
        yield
    finally:
        for f in made:  # deepest first; one that holds anything stops it
            try:
                os.rmdir(f)
            except OSError:
                break


@contextlib.contextmanager
def writer_lock(folder):
    """Hold folder's writer lock for the block: flock on folder/.lock, which the kernel releases when its holder exits,
    kill -9 included; a second writer gets FolderLocked naming the holder. Re-entrant (rsd.py's retrain trains)."""
    key = os.path.realpath(folder)
    if key in _HELD:
        yield
        return
    with new_folders(folder), _locked(folder, key):
        yield


@contextlib.contextmanager
def _locked(folder, key):
    path = os.path.join(folder, LOCK)
    while True:  # lock the file that is at `path` (a holder unlinks it before it lets go)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise FolderLocked(f"{folder} is being written by {holder}: wait for it to finish, or write to another "
                               "folder (--out)") from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)
    if stale := os.read(fd, 4096).decode(errors="replace").strip():
        logging.getLogger(__name__).warning("%s: stale lock of %s, which is gone (killed?): taking it over", path,
                                            stale)
    _HELD.add(key)
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename} (`{' '.join(sys.argv)}`, since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')})".encode(), 0)
        except OSError as e:  # a full disk: the bare [Errno 28] would name no file
            raise OSError(f"{path}: cannot write the writer lock ({e.strerror})") from None
        remove_stale_tmp(folder)  # the folder's one writer now: any temporary file there is a killed write's
        yield
    finally:
        _HELD.discard(key)
        os.unlink(path)
        os.close(fd)
