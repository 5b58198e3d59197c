"""The house's line budgets at a commit: every .py outside tests/ and experiments/ (library + scripts) per file and
in all, and the reader's path (rope.py + model.py + speculate.py + tree.py). Paper: none; the budgets are the
project's (README, "File map").

run: python experiments/lines.py [REV ...]      (no REV: the working tree; two: per file, before -> after)
"""
import subprocess
import sys

READERS_PATH = ("rope.py", "model.py", "speculate.py", "tree.py")


def counts(rev=None):
    """{file: lines} of library + scripts at rev (git's tracked files), or in the working tree."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev] if rev else ["git", "ls-files"],
                           capture_output=True, text=True, check=True).stdout.split()
    out = {}
    for f in names:
        if f.endswith(".py") and not f.startswith(("tests/", "experiments/")):
            text = subprocess.run(["git", "show", f"{rev}:{f}"], capture_output=True, text=True, check=True).stdout \
                if rev else open(f).read()
            out[f] = len(text.splitlines())
    return out


def summary(c):
    return f"library + scripts {sum(c.values())}, reader's path {sum(c.get(f, 0) for f in READERS_PATH)}"


if __name__ == "__main__":
    revs = sys.argv[1:] or [None]
    tables = [counts(r) for r in revs]
    if len(tables) == 2:
        for f in sorted(set(tables[0]) | set(tables[1])):
            a, b = tables[0].get(f, 0), tables[1].get(f, 0)
            if a != b:
                print(f"{f:<24} {a:>5} -> {b:>5} ({b - a:+d})")
    for r, c in zip(revs, tables):
        print(f"{r or 'working tree'}: {summary(c)}")
