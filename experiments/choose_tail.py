"""Would a chooser that ranks by val's hard plans have picked better on the spent grids? Each candidate's rounds on
every val plan (the chooser's acceptance record: cached, or decoded exactly), then each committed grid of the design
seeds re-ranked offline: the grid's own predicted round times, the rounds read as the mean over all val plans (the
rule before measure.choose.TAIL) or over the plans hardest for that candidate (a lower-tail mean of per-plan
speed-ups, CVaR at alpha). The grids' seeds are spent, so this is a design probe: a rule it suggests is claimed only on
grids of new seeds.

Paper: none; the machine-dependent choice of decoder (docs/results.md, "Chosen for the machine").

run: python experiments/choose_tail.py --out experiments/choose_tail.json
"""
import argparse
import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import checkpoint, cli, files  # noqa: E402
from measure import choose, flags, timing  # noqa: E402

SETTINGS = {"eager": (1, 1, 0.0, None), "compiled": (1, 1, 0.0, None), "batch6": (6, 1, 0.0, None),
            "samples6": (1, 6, 0.6, 0.98)}  # the grids' file names: (batch, samples, temperature, top-p)
# the grids measured before the rule was fixed (the design set); later seeds (91 on) are its test, never read here
DESIGN_SEEDS = range(61, 88)
ALPHAS = (1.0, 0.5, 0.25)  # 1.0: every plan, today's rule (up to the timed-first ranking)


def tail_speedup(rounds, round_ms, n, alpha):
    """The lower-tail mean (the worst alpha share of plans) of candidate n's per-plan predicted speed-up."""
    t0 = round_ms[evaluate.TARGET_ONLY]
    return choose.lower_tail([b * t0 / (r * round_ms[n]) for b, r in zip(rounds[evaluate.TARGET_ONLY], rounds[n])],
                             alpha)


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description="The spent grids re-ranked by val's hard plans.")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    with cli.user_errors(ap):
        cli.check_out(a.out)
    ckpt = checkpoint.SHIPPED
    target = checkpoint.load(os.path.join(ckpt, "target"), dtype=torch.float32).eval()
    draft = checkpoint.load(checkpoint.draft_dir(ckpt, "aarl", 0), target=target).eval()
    tok, views = driving.Tokenizer(), driving.WorldConfig().views
    out = {"command": "python experiments/choose_tail.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "settings": {}}
    val_rounds = {}
    for mode, (batch, samples, temp, top_p) in SETTINGS.items():
        grids = sorted(g for g in glob.glob(os.path.join(os.path.dirname(__file__), f"choose_grid_{mode}_s*.json"))
                       if int(re.search(r"_s(\d+)\.json$", g).group(1)) in DESIGN_SEEDS)
        if not grids:
            continue
        sampling = flags.sampling(temp, None, top_p, 0)
        val = evaluate.scene_prompts(driving.make_split("val", choose.val_prompts(batch, samples), seed=0), tok,
                                     "cpu", torch.float32, views)
        plans, stop = timing.plan_batches(val, batch), tok.cot_end_id
        cli.progress(f"{mode}: per-plan rounds of every candidate on {len(plans)} val plans (the chooser's record)")
        acc, _ = choose.cached("acceptance", choose.acceptance_key(target, draft, plans, evaluate.MAX_NEW_TOKENS, stop,
                                                                   sampling, samples),
                               lambda: choose.measure_acceptance(target, draft, plans, evaluate.MAX_NEW_TOKENS, stop,
                                                                 sampling, samples))
        rounds = {n: v["plan_rounds"] for n, v in acc.items()}
        val_rounds[f"batch {batch} samples {samples} T {temp}"] = rounds
        rows = []
        for g in grids:
            d = json.load(open(g))
            ms = {n: v["round_ms"] for n, v in d["choice"]["predicted"].items()}
            meas = {n: v["speedup"] for n, v in d["grid"].items()}
            row = {"grid": os.path.basename(g), "best": d["best"], "chosen_then": d["choice"]["chosen"],
                   "chosen_then_over_best": d["chosen_over_best"]}
            for alpha in ALPHAS:
                pred = {n: tail_speedup(rounds, ms, n, alpha) for n in ms}
                pick = max(pred, key=pred.get)
                row[f"alpha {alpha}"] = {"pick": pick, "over_best": meas[pick] / meas[d["best"]],
                                         "predicted": pred[pick], "measured": meas[pick],
                                         "error": pred[pick] / meas[pick] - 1}
            rows.append(row)
            print(row["grid"], row["best"], "| then", row["chosen_then"], f"{row['chosen_then_over_best']:.2f} |",
                  " | ".join(f"a{al} {row[f'alpha {al}']['pick']} {row[f'alpha {al}']['over_best']:.2f} "
                             f"{100 * row[f'alpha {al}']['error']:+.0f}%" for al in ALPHAS))
        out["settings"][mode] = rows
    out["val_rounds"] = val_rounds
    files.write_json(a.out, out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
