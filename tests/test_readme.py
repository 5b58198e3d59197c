"""The README's file map stays true: every top-level module is listed once with its real line count, and every
repo path the README names exists (docs/, experiments/, checkpoints/).

run: python -m pytest -q tests/test_readme.py
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
