"""What the scripts share: one flag per field of a config dataclass (its comments are the help), the --dtype names,
the --device check, and expected errors as argparse's one line.

run: python train.py --help   (the flags add_config_flags makes; also aarl.py, rsd.py, bench.py)
"""
import argparse
import contextlib
import dataclasses
import inspect
import io
import textwrap
import tokenize

import torch

from files import FolderLocked

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_config_flags(ap: argparse.ArgumentParser, cls, choices=None):
    """--field-name per field of the dataclass cls, of its type and default, the comment on its line as help; a bool
    field defaulting to False is --field-name, one defaulting to True is --no-field-name."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (e.g. a frozen build): flags without help
        src = ""
    helps = {t.line.split(":")[0].strip(): t.string.lstrip("#").strip()  # `name: type = default  # help`
             for t in tokenize.generate_tokens(io.StringIO(src).readline) if t.type == tokenize.COMMENT}
    for f in dataclasses.fields(cls):
        flag, default = "--" + f.name.replace("_", "-"), f.default
        text = helps.get(f.name, "").replace("%", "%%")  # argparse formats help with %
        if default is True:
            ap.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=f"turn off: {text}")
        elif default is False:
            ap.add_argument(flag, dest=f.name, action="store_true", help=text)
        else:
            ap.add_argument(flag, dest=f.name, type=type(default), default=default, choices=(choices or {}).get(f.name),
                            help=f"{text} (default: %(default)s)")


def config_from_args(cls, args):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def check_device(name):
    """torch.device(name), or a clear error before any work for a device torch does not know or this machine lacks."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}, but torch.cuda.is_available() is False (no GPU, or a CPU-only torch)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r}, but torch.backends.mps.is_available() is False")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {name!r}: this code runs on cpu, cuda or mps")
    return device


@contextlib.contextmanager
def user_errors(ap: argparse.ArgumentParser):
    """Expected errors (a bad value or file, a full disk, a locked run folder) as argparse's one line, exit status 2."""
    try:
        yield
    except (ValueError, OSError, FolderLocked) as e:
        ap.error(str(e))
