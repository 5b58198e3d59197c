"""What the scripts share: one flag per field of a config dataclass (its comments are the help), the --dtype names,
the --device check, every value check of the flags (check_values' rules; the decoding flags: measure/flags.py),
expected errors as argparse's one line, outputs checked before any work.
Paper: none (operations under every program).

run: python train.py --help   (the flags add_config_flags makes; also aarl.py, rsd.py, bench.py)
"""
import argparse
import contextlib
import dataclasses
import functools
import inspect
import io
import math
import os
import sys
import textwrap
import time
import tokenize

import torch

import driving
from ops import files, runs
from ops.files import FolderLocked

START = time.time()  # when the program imported this: progress() counts from it
SHIPPED = files.SHIPPED  # the repo's models: no program writes there
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
    """Expected errors (a bad value or file, a full disk, a locked run folder) as argparse's one line, exit status 2;
    a Ctrl-C as one line saying where the training state stands (runs.interrupted_note), exit status 130."""
    try:
        yield
    except (ValueError, OSError, FolderLocked, FloatingPointError) as e:
        ap.error(one_line(e))
    except KeyboardInterrupt:
        ap.exit(130, f"{ap.prog}: {runs.interrupted_note()}\n")


def program(main):
    """A program's main(argv): a Ctrl-C anywhere in it is one line and exit status 130, an expected error one line
    and exit status 2 (user_errors, for the work no block of the program's own wraps); what it writes is atomic
    (ops.files), so an interrupted run leaves no partial file."""
    @functools.wraps(main)
    def wrapped(*a, **k):
        ap = argparse.ArgumentParser()  # only its prog (the program's file name) and its error line are used
        with user_errors(ap):
            return main(*a, **k)
    return wrapped


@contextlib.contextmanager
def json_stdout(on):
    """--json: everything the block prints goes to stderr, so that stdout holds only the one JSON line the program
    prints after it (`python X.py --json | tail -n 1` or `| jq`)."""
    with contextlib.redirect_stdout(sys.stderr) if on else contextlib.nullcontext():
        yield


def check_out(path, flag="--out", inputs=(), default=None, folder=False, others=None, program=None):
    """A ValueError unless `path` may take a program's output file, before any work: not a folder nor anything but a
    regular file, not one of its input files (inputs: paths), not inside the shipped checkpoints/, not another output
    of the same run (others: {flag: path}), and, where it exists and `program` is given, that program's own earlier
    output (a JSON whose "command" runs it, or a PNG figure), in a folder that exists and takes a file (the default's,
    under the git-ignored runs/, is made). folder: `path` is an output folder (made with its parents, as runs/x): not
    a file."""
    parent, real = os.path.dirname(os.path.abspath(path)), os.path.realpath(path)
    if os.path.commonpath([real, SHIPPED]) == SHIPPED:
        raise ValueError(f"{flag} {path} is inside the shipped {SHIPPED}: write it elsewhere")
    for other, p in (others or {}).items():
        if p and os.path.realpath(p) == real:
            raise ValueError(f"{flag} {path} is also this run's {other}: give each output its own path")
    if folder and os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is not a folder: give the output folder")
    if folder:
        return path
    if os.path.lexists(path) and not os.path.isfile(path):
        raise ValueError(f"{flag} {path} " + ("is a directory: give a file path" if os.path.isdir(path) else
                                              "exists and is not a regular file"))
    for p in inputs:
        if p and os.path.exists(p) and os.path.exists(path) and os.path.samefile(p, path):
            raise ValueError(f"{flag} {path} is an input of this run ({p}): give another {flag}")
    if program and os.path.exists(path) and not own_output(path, program):
        raise ValueError(f"{flag} {path} exists and is not an output of {program}: refusing to replace it; give "
                         f"another {flag}")
    if path == default:
        files.check_writable(parent)  # made (under runs/) or a clear error: a file in its place, no permission
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: its folder {parent} does not exist")
    files.check_writable(parent)
    return path


def own_output(path, program):
    """Whether the regular file at path is what `program` writes: a PNG figure, or a JSON object whose "command" is
    `python {program} ...`."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head == b"\x89PNG\r\n\x1a\n":
        return path.lower().endswith(".png")
    try:
        return str(files.read_json(path).get("command", "")).startswith(f"python {program}")
    except (ValueError, AttributeError, OSError):
        return False


def number_list(text, flag, kind=int, rule=">= 0", unique=True, sep=","):
    """--flag A,B,C -> [kind] (sorted if unique), or a ValueError naming the flag: not a list of numbers, empty, a value
    breaking its rule (a key of RULES), a repeat."""
    try:
        vals = [kind(v) for v in text.split(sep)]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None
    bad = [v for v in vals if not RULES[rule](v)]
    if bad:
        raise ValueError(f"{flag}: every value must be {rule}, got {bad[0]!r}")
    if unique and len(set(vals)) < len(vals):
        raise ValueError(f"{flag} repeats a value: {text!r}")
    return sorted(vals) if unique else vals


def checked(ap, a, counts=(), lists=(), out=None, inputs=(), program=None):
    """The flags a (parsed by ap) checked before any work, each defect one line naming its flag: counts (names) >= 1,
    lists (names) comma-separated ints >= 0 without repeats (replaced by the list), out (the default of --out, under
    runs/): a.out may take the output file and is none of the input files (check_out); a --work folder (where an
    experiment trains its drafts) is an output folder, checked as one. Returns a."""
    with user_errors(ap):
        check_values(a, [(">= 1", counts)], flags=True)
        for name in lists:
            setattr(a, name, number_list(getattr(a, name), "--" + name.replace("_", "-")))
        if out is not None:
            check_out(a.out, inputs=inputs, default=out, program=program)
        if getattr(a, "work", None):
            check_out(a.work, "--work", folder=True)
    return a


def ran(args, t0, cpu0):
    """What a report says ran: every flag as given or derived (plain values: inputs, decoder, repeats, max-new, views,
    compile...), torch's version and threads, the wall and CPU seconds of the whole command (t0 time.time(), cpu0
    time.process_time() at its start)."""
    plain = (str, int, float, bool, type(None))
    return {"flags": {k: v for k, v in sorted(vars(args).items()) if isinstance(v, plain)}, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "wall_s": time.time() - t0, "cpu_s": time.process_time() - cpu0}


_LAST = [0.0]  # when progress last printed


def progress(text, every=0.0):
    """A stage of long work on stderr, with the seconds since the program started (START): stdout keeps the report
    (and with --json its one JSON line). every: print only if that many seconds passed since the last line (a loop's
    steps: a line at least every so often, not one per step)."""
    if time.time() - _LAST[0] >= every:
        _LAST[0] = time.time()
        print(f"[{time.time() - START:5.0f} s] {text}", file=sys.stderr, flush=True)


def one_line(e):
    """The error itself: a DataLoader worker's carries the worker's whole traceback in its message (`Caught X in
    DataLoader worker process 0. Original Traceback ...`), the error after its last `X: `."""
    text, head = str(e), f"\n{type(e).__name__}: "
    return text.rsplit(head, 1)[1] if "Traceback (most recent call last)" in text and head in text else text


# ---- value checks ----
VIEWS_RULE = f"in 0..{driving.MAX_VIEWS} (the geometries the toy target was trained on)"
MAX_VIEWS_RULE = f"at most {driving.MAX_VIEWS} (the world's surround views)"
# every float rule is finite: an infinite lr, clip, temperature or weight passes "> 0" and turns the weights to NaN
RULES = {">= 1": lambda v: v >= 1, ">= 0": lambda v: v >= 0, ">= 3": lambda v: v >= 3,
         "a finite number > 0": lambda v: 0 < v < math.inf,  # "not 0 < v" catches NaN
         "a finite number >= 0": lambda v: 0 <= v < math.inf,
         "in [0, 1]": lambda v: 0 <= v <= 1, VIEWS_RULE: lambda v: 0 <= v <= driving.MAX_VIEWS,
         MAX_VIEWS_RULE: lambda v: v <= driving.MAX_VIEWS,
         "in 0..2**30-1": lambda v: 0 <= v < 2**30}  # seeds: combined into 64-bit torch seeds (driving.Data.batch)


def typed(rule, kind=int):
    """An argparse type: a `kind` that keeps RULES[rule]; anything else is argparse's one line naming the flag."""
    def parse(text):
        v = kind(text)  # not a number: argparse's "invalid int value" (its name: parse.__name__)
        if not RULES[rule](v):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return v
    parse.__name__ = kind.__name__
    return parse


def check_values(obj, rules, flags=False):
    """ValueError naming the first field of obj (a config or parsed flags) that breaks its rule, before any work;
    rules: [(a key of RULES, field names)]; flags: name the fields as the command-line flags."""
    for rule, names in rules:
        for name in names:
            if not RULES[rule](getattr(obj, name)):
                shown = "--" + name.replace("_", "-") if flags else name
                raise ValueError(f"{shown} must be {rule}, got {getattr(obj, name)}")


