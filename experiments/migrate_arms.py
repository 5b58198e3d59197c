"""Migrates bench.py reports written before the arms record (the measuring-room issue) to it, in place: the flattened
keys of a toy / real report (ar_ / spec_ prefill and ms per token, speedup, runner_up; the same under "compiled") and a
plans report's per-arm objects become "arms" {arm: {decoder, tau, ms_per_token | ms_per_plan, speedup, speedup_range,
greedy_match, ...}}, which measure.timing.arms_lines prints. What an old report never recorded stays None (a
runner-up's tau), or reads as what it had (a plans arm's speed-up range: its speed-up). Numbers are moved, never
recomputed; a report that has "arms" is left as it is. Paper: none (the project's JSON).

run: python experiments/migrate_arms.py FILE [FILE ...]      (e.g. experiments/bench_*.json experiments/peer_hf.json)
"""
import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from evaluate import TARGET_ONLY  # noqa: E402
from measure import timing  # noqa: E402
from ops import cli, files  # noqa: E402


def arms_of(res, src, sfx=""):
    """The arms of one set of flattened keys (src: the report, or its "compiled" object), popped from src."""
    sampled = res.get("decoding", {}).get("mode") == "sampling"
    greedy = None if sampled else res.get("greedy_match")
    up = src.pop("speedup") if sfx else src["speedup"]  # the top level keeps its headline speed-up
    arms = {TARGET_ONLY + sfx: {"decoder": None, "ms_per_token": src.pop("ar_ms_per_token"),
                                "prefill_ms": src.pop("ar_prefill_ms", None), "speedup": 1.0,
                                "speedup_range": [1.0, 1.0], "tau": 1.0,
                                "greedy_match": None if greedy is None else True},
            "speculative" + sfx: {"decoder": res.get("decoder"), "ms_per_token": src.pop("spec_ms_per_token"),
                                  "prefill_ms": src.pop("spec_prefill_ms", None), "speedup": up,
                                  "speedup_range": src.pop("speedup_range", [up, up]),
                                  "tau": (res.get("sampled") or res)["tau"],
                                  "greedy_match": src.get("greedy_match") if sfx else greedy}}
    if r := src.pop("runner_up", None):
        arms[timing.CHAIN_ARM + sfx] = {"decoder": r["decoder"], "ms_per_token": r["ms_per_token"],
                                        "speedup": r["speedup"], "tau": None, "greedy_match": None,
                                        "speedup_range": r.get("speedup_range", [r["speedup"]] * 2)}
    if sfx:
        src["speedup"] = up  # the compiled headline: over compiled target-only
    return arms


def migrate(res):
    """The report with "arms" (True if it changed)."""
    if "arms" in res or "arms" in res.get("plan", {}) or res.get("mode") not in ("toy", "real", "plans"):
        return False
    if "decoder" not in res:  # a report from before the tree: the chain of its gamma
        res["decoder"] = {"kind": "chain", "gamma": res["gamma"]}
    if res["mode"] == "plans":
        p = res["plan"]
        rows = p.get("greedy_match_per_row", {})
        p["arms"] = {}
        for name in [k for k, v in p.items() if isinstance(v, dict) and "ms_per_plan" in v]:
            a = p.pop(name)
            a["tau"] = a.pop("mean_tau")
            spec = name in ("speculative", "speculative compiled")  # the other arms' decoders were not recorded
            p["arms"][name] = {"decoder": res.get("decoder") if spec else None, **a,
                               "speedup_range": a.get("speedup_range", [a["speedup"]] * 2),  # older: none recorded
                               "greedy_match": all(rows[name]) if name in rows else None}
        return True
    res["arms"] = arms_of(res, res) | (arms_of(res, res["compiled"], " compiled") if "compiled" in res else {})
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="bench.py reports (a --out JSON, or a --json run's last line)")
    a = ap.parse_args(argv)
    with cli.user_errors(ap):  # a folder, a FIFO, not JSON, a report missing a key: one line naming the file
        for path in a.files:
            files.check_regular(path)
            text = open(path).read()
            try:
                res = json.loads(text)
                changed = migrate(res)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                why = f"{type(e).__name__} {e}" if isinstance(e, KeyError) else cli.one_line(e)
                raise ValueError(f"{path}: not a bench.py report of the old layout ({why})") from None
            if changed:  # written in its own layout (one line, or indented), atomically
                text = json.dumps(res) + "\n" if len(text.strip().splitlines()) == 1 else json.dumps(res, indent=1)
                files.atomic_write(path, lambda p, text=text: pathlib.Path(p).write_text(text))
                print(f"migrated {path}")


if __name__ == "__main__":
    main()
