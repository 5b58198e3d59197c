"""The repo's layout stays as the README says: the file map lists every top-level module with its real line count,
every repo path the README names exists, no import cycle, and no library module imports a script.

run: python -m pytest -q tests/test_layout.py
"""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
ROW = re.compile(r"^\| `([^`]+)` \| ([0-9,]+) \|", re.M)  # a file-map row: | `file.py` | 1,234 | what |


def test_file_map_lists_every_module_with_its_line_count():
    rows = {f: int(n.replace(",", "")) for f, n in ROW.findall(README)}
    modules = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))
    assert sorted(rows) == modules, "README's file map must list exactly the top-level .py files"
    for f, n in rows.items():
        with open(os.path.join(ROOT, f)) as fh:
            assert sum(1 for _ in fh) == n, f"README says {f} has {n} lines"


def test_named_paths_exist():
    for path in set(re.findall(r"\b((?:docs|experiments|checkpoints)/[\w./-]*\w)", README)):
        assert os.path.exists(os.path.join(ROOT, path)), f"README names {path}, which is not in the repo"


def test_no_import_cycle_between_modules():
    """The layering the README states: library modules import no script, and no two modules import each other
    through any chain (an import cycle breaks a reader's top-down path through the files)."""
    import ast
    mods = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))}
    deps = {}
    for m in mods:
        tree = ast.parse(open(os.path.join(ROOT, m + ".py")).read())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        deps[m] = names & mods - {m}

    def reach(m, seen):
        for d in deps[m] - seen:
            seen.add(d)
            reach(d, seen)
        return seen

    assert not [m for m in mods if m in reach(m, set())], "import cycle"
    scripts = {"rsd", "train", "aarl", "bench"}
    assert not {m: deps[m] & scripts for m in mods - scripts if deps[m] & scripts}, "a library module imports a script"
