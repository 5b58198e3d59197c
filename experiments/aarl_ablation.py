"""AARL's reference ablation: static (the paper's frozen SFT anchor), moving (reset to the policy every `refresh`
updates) and none, three seeds each, every run from the SFT FlatRoPE draft of its seed, with the same report.

Paper: AARL with the static anchor raises accepted length on validation and held-out scenes (docs/background.md).

run: python experiments/aarl_ablation.py [--run checkpoints/toy] [--seeds 0,1,2]
     (writes experiments/aarl_ablation.json; each run's draft goes to runs/aarl_ablation/)
     python experiments/aarl_ablation.py --summary   (the README's table, from the saved JSON)
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aarl  # noqa: E402
from ops import checkpoint, cli, files  # noqa: E402

OUT = "runs/aarl_ablation.json"  # git-ignored: a quick run never replaces the committed experiments/ JSON


def fixed_gamma_table(results, references, gammas=(4, 6, 8)):
    """Mean tau over seeds of the SFT draft and of each reference's AARL draft at fixed draft lengths, with the
    mean change and its spread over seeds: the speed-optimal gamma of a run comes from measured step times, which a
    shared machine makes noisy, so the references are compared at the same gammas. Returns the printed rows."""
    lines = [f"{'reference':9s} {'split':5s} " + " ".join(f"{'gamma ' + str(g) + ': SFT -> AARL (change, spread)':>36s}"
                                                        for g in gammas) + "  drafted-CoC ADE  KL to SFT"]
    for ref in references:
        rs = [r for r in results if r["reference"] == ref]
        for split in ("val", "test"):
            cells = []
            for g in gammas:
                before = [r["before"][split]["tau_by_gamma"][g] for r in rs]
                delta = [r["after"][split]["tau_by_gamma"][g] - b for r, b in zip(rs, before)]
                cells.append(f"{statistics.mean(before):.2f} -> {statistics.mean(before) + statistics.mean(delta):.2f} "
                             f"({statistics.mean(delta):+.2f}, {max(delta) - min(delta):.2f})")
            ade = [statistics.mean(r[when][split]["drafted_ade"] for r in rs) for when in ("before", "after")]
            kl = statistics.mean(r["after"][split]["kl_to_sft"] for r in rs)
            lines.append(f"{ref:9s} {split:5s} " + " ".join(f"{c:>36s}" for c in cells)
                         + f"  {ade[0]:.2f} -> {ade[1]:.2f}     {kl:.3f}")
    return lines


def summarise_training(results, references):
    """Print and return, per reference, the mean over seeds of each update statistic over the first and the last 20
    updates (aarl.training_summary): the reward, its std within a group, the KL to the reference, ADE, agreement."""
    print("\nupdates (mean over seeds of the first -> last 20): reward, its std within a group, KL to the reference")
    out = {}
    for ref in references:
        rs = [r["training"] for r in results if r["reference"] == ref]
        m = lambda part, key: statistics.mean(t[part][key] for t in rs)
        out[f"{ref}/training"] = {part: {key: m(part, key) for key in rs[0][part]} for part in ("first", "last")}
        print(f"{ref:9s} reward {m('first', 'reward'):.3f} -> {m('last', 'reward'):.3f}  std in group "
              f"{m('first', 'reward_std_in_group'):.3f} -> {m('last', 'reward_std_in_group'):.3f}  KL "
              f"{m('first', 'kl'):.4f} -> {m('last', 'kl'):.4f}  drafted ADE {m('first', 'ade'):.2f} -> "
              f"{m('last', 'ade'):.2f}  agreement {m('first', 'agree'):.3f} -> {m('last', 'agree'):.3f}")
    return out


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="checkpoints/toy", help="folder with target/ and draft_flat_s<seed>/")
    ap.add_argument("--work", default="runs/aarl_ablation", help="where the ablation's drafts are written")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--references", default="static,moving,none")
    ap.add_argument("--n-report", type=int, default=64)
    ap.add_argument("--out", default=OUT, help=f"the JSON (default {OUT}; the README's: "
                    "experiments/aarl_ablation.json)")
    ap.add_argument("--overwrite", action="store_true", help="replace the drafts of an earlier ablation in --work")
    ap.add_argument("--summary", action="store_true", help="print the fixed-gamma table of --out's runs, run nothing")
    a = ap.parse_args(argv)
    if a.summary:  # reads --out
        a = cli.checked(ap, a)
        saved = files.read_json(a.out)
        refs = list(dict.fromkeys(r["reference"] for r in saved["runs"]))
        print("\n".join(fixed_gamma_table(saved["runs"], refs, gammas=("4", "6", "8"))))  # JSON keys are strings
        summarise_training(saved["runs"], refs)
        return
    a = cli.checked(ap, a, counts=("n_report",), lists=("seeds",), out=OUT)
    if bad := [r for r in a.references.split(",") if r not in aarl.REFERENCES]:
        ap.error(f"--references: {bad[0]!r} is not one of {', '.join(aarl.REFERENCES)}")
    if gone := [d for d in [checkpoint.draft_dir(a.run, "flat", s) for s in a.seeds] if not os.path.isdir(d)]:
        ap.error(f"--run {a.run} lacks the SFT drafts {', '.join(gone)} (--seeds)")
    t0, results = time.time(), []
    for ref in a.references.split(","):
        for seed in a.seeds:
            cli.progress(f"AARL, reference {ref}, seed {seed}")
            cfg = dataclasses.replace(aarl.AARLConfig(), reference=ref, seed=seed)
            res = aarl.run(cfg, a.run, a.n_report, out=checkpoint.draft_dir(a.work, f"aarl_{ref}", seed),
                           overwrite=a.overwrite)
            aarl.print_result(res)
            results.append(res)
    print(f"\n{'reference':9s} {'split':5s} {'gamma':>5s} {'SFT tau':>8s} {'AARL tau (mean, per seed)':>30s}")
    summary = {}
    for ref in a.references.split(","):
        rs = [r for r in results if r["reference"] == ref]
        for split in ("val", "test"):
            before = [r["before"][split]["tau"] for r in rs]
            after = [r["after"][split]["tau"] for r in rs]
            delta = [x - y for x, y in zip(after, before)]
            summary[f"{ref}/{split}"] = {"before": before, "after": after, "delta_mean": statistics.mean(delta),
                                         "delta_spread": max(delta) - min(delta),
                                         "headroom": [r["before"][split]["tau_ceiling"] - r["before"][split]["tau"]
                                                      for r in rs]}  # ceiling - SFT tau: what AARL could gain
            print(f"{ref:9s} {split:5s} {'':>5s} {statistics.mean(before):8.3f} "
                  f"{statistics.mean(after):8.3f} " + " ".join(f"{x:.3f}" for x in after)
                  + f"   change {statistics.mean(delta):+.3f} (spread {max(delta) - min(delta):.3f})")
    print("\n" + "\n".join(fixed_gamma_table(results, a.references.split(","))))
    summary.update(summarise_training(results, a.references.split(",")))
    files.write_json(a.out, {"command": "python experiments/aarl_ablation.py " + " ".join(argv or sys.argv[1:]),
                                  "summary": summary, "runs": results, "wall_s": time.time() - t0})
    print(f"wrote {a.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
