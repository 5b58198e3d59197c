"""The repo's house stays as the README says: the paper's path at the top level (at most 12 files), ops/ and real/ for
the other audiences, every import pointing down the layers, the file map listing every module with its line count
(within 10%), every repo path the README names existing, and every README command's --help listing the flags it uses.

run: python -m pytest -q tests/test_layout.py
"""
import ast
import contextlib
import glob
import importlib
import io
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
ROW = re.compile(r"^\| `([^`]+)` \| ([0-9,]+) \|", re.M)  # a file-map row: | `file.py` | 1,234 | what |
PROGRAMS_AT_TOP = {"train", "aarl"}  # runnable paper modules that real/ builds on
SCRIPTS = {"bench", "rsd"}  # the top: they may import anything
FOLDERS = ("ops", "beyond", "measure", "real")


def modules():
    """{dotted name: path} of every module of the library and scripts (tests and experiments excluded)."""
    paths = glob.glob(os.path.join(ROOT, "*.py"))
    paths += [p for f in FOLDERS for p in glob.glob(os.path.join(ROOT, f, "*.py"))]
    return {os.path.relpath(p, ROOT)[:-3].replace(os.sep, "."): p for p in paths if not p.endswith("__init__.py")}


def layer(m):
    """Lower layers never import higher ones: the paper's core 0 < ops 0.25 (infrastructure: it reads the model and
    the world, nothing above) < beyond 0.5 < measure 1 < train / aarl 2 < real 3 < bench / rsd 4."""
    if m in SCRIPTS:
        return 4
    if m.startswith("real."):
        return 3
    if m in PROGRAMS_AT_TOP:
        return 2
    return {"ops": 0.25, "beyond": 0.5, "measure": 1}.get(m.split(".")[0], 0)


def imports():
    mods = modules()
    deps = {}
    for m, path in mods.items():
        found = set()
        for n in ast.walk(ast.parse(open(path).read())):
            if isinstance(n, ast.Import):
                found |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module:
                found |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
        deps[m] = found & set(mods) - {m}
    return deps


def test_top_level_is_the_papers_path():
    top = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))
    assert len(top) <= 12, f"{len(top)} .py files at the top level: {top}"
    for folder in FOLDERS:
        assert os.path.isfile(os.path.join(ROOT, folder, "__init__.py")), folder


def test_imports_point_down_the_layers_and_never_cycle():
    deps = imports()
    up = {m: sorted(d for d in ds if layer(d) > layer(m)) for m, ds in deps.items()}
    assert not {m: u for m, u in up.items() if u}, "an import points up the layers"

    def reach(m, seen):
        for d in deps[m] - seen:
            seen.add(d)
            reach(d, seen)
        return seen

    assert not [m for m in deps if m in reach(m, set())], "import cycle"


def test_no_script_picks_its_program_from_argv():
    """One script, one program: what a command does is its parser's, not a scan of its arguments for a flag."""
    sniff = re.compile(r"sys\.argv\[1:\]|for \w+ in argv\b|in argv\)")
    for m, path in modules().items():
        assert not sniff.search(open(path).read()), f"{path} scans its command line"


def test_a_program_runs_once():
    """At most one `if __name__ == "__main__"` block per module: real.aarl_real had two, so a finished run ran again
    and refused to replace the draft it had just saved (exit 2 after a success; issue #33)."""
    for m, path in modules().items():
        assert open(path).read().count('if __name__ == "__main__":') <= 1, path


def test_file_map_lists_every_module_with_its_line_count():
    rows = {f: int(n.replace(",", "")) for f, n in ROW.findall(README)}
    want = sorted(os.path.relpath(p, ROOT) for p in modules().values())
    assert sorted(rows) == want, "README's file map must list exactly the library's and scripts' .py files"
    for f, n in rows.items():  # near, not exact: a fork's small edit does not fail the suite, a stale map does
        with open(os.path.join(ROOT, f)) as fh:
            have = sum(1 for _ in fh)
        assert abs(have - n) <= max(20, n // 10), f"README says {f} has {n} lines, it has {have}: update the file map"


def test_named_paths_exist():
    for path in set(re.findall(r"\b((?:docs|experiments|checkpoints|ops|real)/[\w./-]*\w)", README)):
        assert os.path.exists(os.path.join(ROOT, path)), f"README names {path}, which is not in the repo"


def readme_commands():
    """(module, [its words before the first flag: a subcommand], [flags]) of every `python X.py ...` / `python -m pkg.mod ...` / `torchrun ... X` command the README
    shows in a code block."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for cmd in re.split(r"&&|;", line.split("#")[0]):
                words = shlex.split(cmd)
                if not words or words[0] not in ("python", "torchrun"):
                    continue
                if "-m" in words:
                    at = words.index("-m") + 1
                else:
                    at = next((i for i, w in enumerate(words) if w.endswith(".py")), 0)
                mod, rest = words[at].removesuffix(".py"), words[at + 1:]
                if mod in modules():
                    sub = rest[:next((i for i, w in enumerate(rest) if w.startswith("-")), len(rest))]
                    out.append((mod, sub, sorted({w.split("=")[0] for w in words if w.startswith("--")}
                                                 - {"--nproc_per_node"})))
    return out


@pytest.mark.parametrize("mod,sub,flags", readme_commands())
def test_readme_commands_show_every_flag_in_help(mod, sub, flags):
    """Each README command's program (its subcommand's, bench.py's modes) lists every flag the README gives it under
    --help (no hidden second program)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        importlib.import_module(mod).main(sub + ["--help"])
    missing = [f for f in flags if f not in buf.getvalue()]
    assert not missing, f"{mod} --help lacks {missing}"


def test_readme_opens_with_a_reading_order():
    head = "\n".join(README.splitlines()[:40])
    order = [head.find(f"`{f}`") for f in ("rope.py", "model.py", "speculate.py", "tree.py", "aarl.py", "train.py",
                                           "rsd.py")]
    assert -1 not in order and order == sorted(order), "the reading order within the README's first 40 lines"
