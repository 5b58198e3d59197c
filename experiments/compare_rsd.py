"""Compare the deterministic columns of two `python rsd.py --json` outputs (issue #23's behaviour-unchanged check).
Paper: its table (rsd.py), the columns that no machine changes.

Deterministic: tau at every gamma on both splits (`sweep`, each row's `tau_by_gamma`), the tau ceiling at every gamma,
the target's CoC exact match / commitment accuracy / ADE, the world's routine share, each row's commitment accuracy,
ADE and attention split, greedy identity. A row's gamma (or tree) is chosen with measured step times, so its `tau`,
`tau_spread`, `routine_fraction` and `tau_ceiling` are compared only where both runs chose the same gamma (a tree row:
the same tree). Timing
columns (ms_per_token, speedup) are never compared. Floats agree to 1e-6 relative (the attention split's sums differ
in their last bits between machines). A row only the new run has (a draft kind added since) is named, not a
difference: the old rows are what must not move.

run: python experiments/compare_rsd.py OLD.json NEW.json      (exit 1 on any difference)
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ops import cli, files  # noqa: E402

ROW_ALWAYS = ("tau_by_gamma", "commit_acc", "ade", "attn_history", "attn_image", "attn_text")
ROW_AT_GAMMA = ("tau", "tau_spread", "routine_fraction", "tau_ceiling")
TOP = ("greedy_match", "sweep", "target", "routine_share_world", "seeds", "prompt")


def same(a, b, where, out, rows=()):
    """Differences of b from a into out; rows: names of rows only the new run has (their sweep columns are added)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in a.keys() | b.keys():
            if k not in a or k not in b:
                if k not in rows:
                    out.append(f"{where}/{k}: only in {'new' if k in b else 'old'}")
            else:
                same(a[k], b[k], f"{where}/{k}", out, rows)
    elif isinstance(a, float) or isinstance(b, float):
        if not (isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)):
            out.append(f"{where}: {a} -> {b}")
    elif a != b:
        out.append(f"{where}: {a} -> {b}")


def decoder(row):
    """A row's decoder as chosen: gamma N for a chain row, tree N/D/k for a tree row."""
    return f"tree {'/'.join(map(str, row['tree']))}" if row.get("tree") else f"gamma {row.get('gamma')}"


def compare(old, new):
    out, notes = [], []
    added = {r["name"] for r in new["rows"]} - {r["name"] for r in old["rows"]}  # a draft row added since
    notes += [f"row {name}: only in new (added; the old rows are compared)" for name in sorted(added)]
    for k in TOP:
        same(old.get(k), new.get(k), k, out, added)
    if [r.get("gamma") for r in old["rows"]] == [r.get("gamma") for r in new["rows"][:len(old["rows"])]]:
        same(old.get("tau_ceiling"), new.get("tau_ceiling"), "tau_ceiling", out)  # the ceiling at the chosen gamma
    new_rows = {r["name"]: r for r in new["rows"]}
    for r in old["rows"]:
        s = new_rows.get(r["name"])
        if s is None:
            out.append(f"row {r['name']}: missing in new")
            continue
        for k in ROW_ALWAYS:
            same(r.get(k), s.get(k), f"{r['name']}/{k}", out)
        if decoder(r) == decoder(s):  # a chain row's gamma, a tree row's shape
            for k in ROW_AT_GAMMA:
                same(r.get(k), s.get(k), f"{r['name']}/{k}", out)
        else:
            notes.append(f"{r['name']}: {decoder(r)} -> {decoder(s)} (timing-chosen; tau compared through "
                         "tau_by_gamma)")
    return out, notes


def last_json_line(path):
    """The JSON object on the last line of path (an `rsd.py --json` output), read only if a regular file."""
    files.check_regular(path)
    try:
        return json.loads(open(path).read().strip().splitlines()[-1])
    except (IndexError, ValueError, UnicodeDecodeError):
        raise ValueError(f"{path}: its last line is not JSON (expected an `rsd.py --json` output)") from None


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="an earlier rsd.py --json output")
    ap.add_argument("new", help="the output to check against it")
    a = ap.parse_args(argv)
    old, new = last_json_line(a.old), last_json_line(a.new)
    diffs, notes = compare(old, new)
    print("\n".join(notes + diffs) or "", f"\n{len(diffs)} differences in the deterministic columns")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
