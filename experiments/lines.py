"""The house's line budgets at a commit: every .py outside tests/ and experiments/ (library + scripts) per file and
in all, and per room (ROOMS: the reader's path, the paper's programs and world, measuring, infrastructure, beyond the
paper, real checkpoints) against its budget. Paper: none; the budgets are the project's (README, "File map").

run: python experiments/lines.py [REV ...]      (no REV: the working tree; two: per file, before -> after)
"""
import argparse
import subprocess

READERS_PATH = ("rope.py", "model.py", "speculate.py", "tree.py")
# room: (its files, or folders ending in "/"; its budget)
ROOMS = {"reader's path": (READERS_PATH, 1500),
         "paper's programs and world": (("aarl.py", "train.py", "driving.py", "evaluate.py", "vision.py"), 2200),
         "measuring": (("bench.py", "rsd.py", "measure/", "ops/cli.py"), 1500),  # ops/cli: the flags' checks
         "infrastructure": (("ops/files.py", "ops/checkpoint.py", "ops/runs.py", "ops/compiled.py"), 750),
         "beyond the paper": (("beyond/",), 450),
         "real checkpoints": (("real/",), 1650),
         # moved out of the reader's path (the measuring-room issue): counted, with no budget of its own
         "the reader's path's input checks": (("checks.py",), None)}


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
    rooms = {name: sum(n for f, n in c.items() if any(f == m or m.endswith("/") and f.startswith(m) for m in members))
             for name, (members, _) in ROOMS.items()}
    return f"library + scripts {sum(c.values())} (budget 8000); " + "; ".join(
        f"{name} {n}" + (f" ({ROOMS[name][1]})" if ROOMS[name][1] else "") for name, n in rooms.items()) + \
        f"; largest file {max(c.values())}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("revs", nargs="*", help="git revisions (none: the working tree; two: per file, before -> after)")
    revs = ap.parse_args(argv).revs or [None]
    tables = [counts(r) for r in revs]
    if len(tables) == 2:
        for f in sorted(set(tables[0]) | set(tables[1])):
            a, b = tables[0].get(f, 0), tables[1].get(f, 0)
            if a != b:
                print(f"{f:<24} {a:>5} -> {b:>5} ({b - a:+d})")
    for r, c in zip(revs, tables):
        print(f"{r or 'working tree'}: {summary(c)}")


if __name__ == "__main__":
    main()
