"""Would a chooser that ranks by val's hard plans have picked better on the spent grids? Each candidate's rounds on
every val plan (measure/choose.py's plans, exact decodes), then each committed grid re-ranked offline: the grid's own
predicted round times, the rounds read as the mean over all val plans (today's rule) or over the plans hardest for
that candidate (a lower-tail mean of per-plan speed-ups, CVaR at alpha). The grids' seeds are spent, so this is a
design probe: a rule it suggests is claimed only on grids of new seeds.

Paper: none; the machine-dependent choice of decoder (docs/results.md, "Chosen for the machine").

run: python experiments/choose_tail.py --out experiments/choose_tail.json
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import checkpoint, cli, files  # noqa: E402
from measure import choose, flags, timing  # noqa: E402
import speculate  # noqa: E402

SETTINGS = {"eager": (1, 1, 0.0, None), "compiled": (1, 1, 0.0, None), "batch6": (6, 1, 0.0, None),
            "samples6": (1, 6, 0.6, 0.98)}  # the grids' file names: (batch, samples, temperature, top-p)
ALPHAS = (1.0, 0.5, 0.25)  # 1.0: every plan, today's rule (up to the timed-first ranking)


@torch.no_grad()
def per_plan_rounds(target, draft, plans, samples, sampling, stop):
    """{candidate: [rounds of plan j]}: a plan's rounds are its slowest row's, seeded as measure_acceptance seeds."""
    t, out = choose.shared_prefill(target), {}
    for c in choose.candidates():
        out[choose.name(c)] = []
        for j, p in enumerate(plans):
            kw = dict(samples=samples, stop_token=stop, sampling=sampling.offset(p["input_ids"].shape[0] * samples * j))
            rs = speculate.autoregressive_batch(t, p, evaluate.MAX_NEW_TOKENS, **kw) if c is None else \
                speculate.speculative_batch(t, draft, p, c, evaluate.MAX_NEW_TOKENS, **kw)
            out[choose.name(c)].append(max(r.rounds for r in rs))
    return out


def tail_speedup(rounds, round_ms, n, alpha):
    """The lower-tail mean (the worst alpha share of plans) of candidate n's per-plan predicted speed-up."""
    s = np.sort(np.array(rounds[evaluate.TARGET_ONLY]) * round_ms[evaluate.TARGET_ONLY]
                / (np.array(rounds[n]) * round_ms[n]))
    return float(s[:max(1, round(alpha * len(s)))].mean())


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
    for mode, (batch, samples, temp, top_p) in SETTINGS.items():
        grids = sorted(glob.glob(os.path.join(os.path.dirname(__file__), f"choose_grid_{mode}_s*.json")))
        if not grids:
            continue
        sampling = flags.sampling(temp, None, top_p, 0)
        val = evaluate.scene_prompts(driving.make_split("val", choose.val_prompts(batch, samples), seed=0), tok,
                                     "cpu", torch.float32, views)
        key = (batch, samples, temp)
        if key not in out.setdefault("_rounds", {}):
            cli.progress(f"{mode}: per-plan rounds of every candidate on {len(val) // batch} val plans")
            out["_rounds"][key] = per_plan_rounds(target, draft, timing.plan_batches(val, batch), samples, sampling,
                                                  tok.cot_end_id)
        rounds = out["_rounds"][key]
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
    out["val_rounds"] = {f"batch {k[0]} samples {k[1]} T {k[2]}": v for k, v in out.pop("_rounds").items()}
    files.write_json(a.out, out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
