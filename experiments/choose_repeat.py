"""How repeatable is the chooser's round time, and how near the held-out one? The chooser run again and again on the
toy's val plans, its profile measured anew each time (--reprofile's), each run's timed real decodes as their round's
ratio to target-only's; beside them, every committed grid's (experiments/choose_grid_<plans>_s<seed>.json): its
chooser's timed ratio against the ratio its held-out plans measured (every candidate timed in the same interleaved
passes). Reads val and the committed grids only: a design probe, no held-out plan is decoded.

Paper: none; the machine-dependent choice of decoder (docs/results.md, "Chosen for the machine").

run: python experiments/choose_repeat.py --out experiments/choose_repeat.json
     python experiments/choose_repeat.py --samples 6 --out experiments/choose_repeat_samples6.json
     python experiments/choose_repeat.py --samples 6 --runs 4 --timed-rows 12 --timed-passes 2 --out ...
        (a variant of the chooser: its timed decodes over two plans of six rows, two passes)
"""
import argparse
import glob
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import checkpoint, cli, files  # noqa: E402
from measure import choose, flags, timing  # noqa: E402

TO = evaluate.TARGET_ONLY
PLAN_BY_PLAN = 101  # the first grid seed whose chooser timed its decodes plan by plan (PROFILE_METHOD 11)


def ratios(rec):
    """{candidate: its timed round over target-only's} of a chooser's record."""
    t = rec["timed_rounds_ms"]
    return {n: s / t[TO] for n, s in t.items() if n != TO}


def committed(mode):
    """[{seed, the chooser's timed ratio and the held-out one, per timed candidate}] of the committed grids of mode."""
    out = []
    for path in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"choose_grid_{mode}_s*.json")):
        g = files.read_json(path)
        held = {n: v["round_ms"] / g["grid"][TO]["round_ms"] for n, v in g["grid"].items()}
        out.append({"seed": int(re.search(r"_s(\d+)\.json$", path).group(1)),
                    "timed": {n: {"chooser": r, "held_out": held[n], "over": r / held[n]}
                              for n, r in ratios(g["choice"]).items()}})
    return sorted(out, key=lambda g: g["seed"])


def spread(overs):
    """The timed ratio over the held-out one: its mean, its range, and the share within 10%."""
    return {"n": len(overs), "mean": statistics.fmean(overs), "min": min(overs), "max": max(overs),
            "within_10pct": sum(abs(o - 1) <= 0.1 for o in overs) / len(overs)} if overs else None


def one_run(k, a, target, draft, val, tok, sampling):
    """The chooser's k-th run, its profile measured anew -> {profile_s, chosen, predicted, timed (ratios)}, printed."""
    cli.progress(f"the chooser, run {k + 1} of {a.runs}, its profile measured anew")
    _, rec = choose.choice(target, draft, val[0], timing.plan_batches(val, 1), evaluate.MAX_NEW_TOKENS,
                           tok.cot_end_id, sampling, a.samples, reprofile=True)
    run = {"profile_s": rec["profile_s"], "chosen": rec["chosen"],
           "predicted": rec["predicted"][rec["chosen"]]["predicted_speedup"], "timed": ratios(rec)}
    print(f"run {k + 1}: profile {rec['profile_s']:.1f} s, chosen {rec['chosen']} (predicted {run['predicted']:.2f}x); "
          "round over target-only's: " + ", ".join(f"{n} {r:.2f}" for n, r in run["timed"].items()))
    return run


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description="The chooser's timed rounds, again and again on val.")
    ap.add_argument("--runs", type=cli.typed(">= 1"), default=6, help="the chooser's runs, each profiled anew")
    ap.add_argument("--samples", type=int, choices=(1, 6), default=1, help="rows a plan (6: sampled, T 0.6, top-p "
                    "0.98, as Alpamayo-R1 runs)")
    ap.add_argument("--timed-rows", type=cli.typed(">= 1"), default=choose.TIMED_ROWS, help="the chooser's "
                    "TIMED_ROWS for these runs: its timed decodes run as many val plans as make this many rows")
    ap.add_argument("--timed-passes", type=cli.typed(">= 1"), default=None, help="the chooser's TIMED_PASSES and "
                    "TIMED_PASSES_ROWS for these runs: its timed decodes' passes over those plans, at any rows "
                    "(default: its own)")
    ap.add_argument("--out", required=True, help="the JSON record")
    a = ap.parse_args(argv)
    with cli.user_errors(ap):
        cli.check_out(a.out, program="experiments/choose_repeat.py")
    device = torch.device("cpu")
    dtype_name, why = choose.auto_dtype(device)
    target = checkpoint.load(os.path.join(checkpoint.SHIPPED, "target"), dtype=cli.DTYPES[dtype_name]).eval()
    draft = checkpoint.load(checkpoint.draft_dir(checkpoint.SHIPPED, "aarl", 0), target=target).eval()
    tok = driving.Tokenizer()
    sampling = flags.sampling(*((0.6, None, 0.98) if a.samples > 1 else (0.0, None, None)), 0)
    val = evaluate.scene_prompts(driving.make_split("val", choose.val_prompts(1, a.samples), seed=0), tok, device,
                                 cli.DTYPES[dtype_name], driving.WorldConfig().views)
    knobs = ("TIMED_ROWS", "TIMED_PASSES", "TIMED_PASSES_ROWS")
    runs, kept = [], {n: getattr(choose, n) for n in knobs}
    for n, v in zip(knobs, (a.timed_rows, a.timed_passes, a.timed_passes)):  # a design probe's variant, restored below
        setattr(choose, n, kept[n] if v is None else v)
    try:
        for k in range(a.runs):
            runs.append(one_run(k, a, target, draft, val, tok, sampling))
    finally:
        for n, v in kept.items():
            setattr(choose, n, v)

    names = sorted({n for r in runs for n in r["timed"]})
    here = {n: [r["timed"][n] for r in runs if n in r["timed"]] for n in names}
    grids = committed("eager" if a.samples == 1 else "samples6")
    overs = {era: [t["over"] for g in grids if (g["seed"] >= PLAN_BY_PLAN) == (era == "plan by plan")
                   for t in g["timed"].values()] for era in ("a set of plans at a time", "plan by plan")}
    for n, v in here.items():
        print(f"{n:<12} this probe's runs: {statistics.fmean(v):.2f} [{min(v):.2f}-{max(v):.2f}] over {len(v)} run(s)")
    for era, o in overs.items():
        s = spread(o)
        print(f"committed grids, timed {era}: " + ("none" if s is None else
              f"timed / held-out ratio {s['mean']:.2f} [{s['min']:.2f}-{s['max']:.2f}] over {s['n']} timed "
              f"candidates, {100 * s['within_10pct']:.0f}% within 10%"))
    files.write_json(a.out, {
        "what": "the chooser's timed round ratios (candidate over target-only) over runs profiled anew on val, and the "
                "committed grids' timed ratios over their held-out ones",
        "command": "python experiments/choose_repeat.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "hardware": choose.hardware(device),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": dtype_name, "dtype_why": why,
        "samples": a.samples, "decoding": flags.sampling_json(sampling), "runs": runs,
        "timed_rows": a.timed_rows, "timed_passes": a.timed_passes or (choose.TIMED_PASSES if a.samples == 1 else
                                                                       choose.TIMED_PASSES_ROWS),
        "this_probe": {n: {"mean": statistics.fmean(v), "min": min(v), "max": max(v)} for n, v in here.items()},
        "committed_grids": grids, "timed_over_held_out": {era: spread(o) for era, o in overs.items()}})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
