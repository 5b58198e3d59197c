"""The FlatRoPE claim from another side, learning speed: held-out tau of both drafts (replica M-RoPE and FlatRoPE)
against distillation steps and against the number of training scenes, three draft seeds each.

Paper: FlatRoPE lets a shallow draft read the trajectory history instead of the visual tokens (docs/background.md,
"FlatRoPE"); a draft that reads the history may learn faster even where both converge to the same tau. Every run is
train.py's own draft distillation (train.train_drafts: same 300 steps, lr, batch, schedule and seeded batch order)
from the shipped target; only n_train differs. The drafts are scored along the way: train_drafts calls
ops.runs.save_state every eval_every steps, and this probe stands in for it (nothing is written) to replay greedy
speculative decoding of the val and held-out test scenes from the drafts at that step (evaluate.draft_matches on the
target's greedy outputs, computed once, and evaluate.tau_by_gamma). At 300 steps x 16 a run draws 4,800 scenes, so an
n_train of 4,800 or more is one pass over distinct scenes and a smaller one repeats them.

run: python experiments/learning_speed.py [--run checkpoints/toy] [--n-train 200,1000,32000] [--seeds 0,1,2]
     (writes experiments/learning_speed.json, reusing the runs of an existing one with the same settings;
      --plot draws figures/learning_speed.png, --plot-only redraws it from the JSON)
"""
import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ops import checkpoint  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import cli, files  # noqa: E402
import train as T  # noqa: E402
from ops import runs  # noqa: E402
from driving import Data  # noqa: E402

KINDS = ("mrope", "flat")
OUT = "runs/learning_speed.json"  # git-ignored: a quick run never replaces the committed JSON
NAMES = {"mrope": "replica (M-RoPE)", "flat": "FlatRoPE"}
SPLITS = ("val", "test")


def stats(values):
    return {"mean": statistics.mean(values), "spread": max(values) - min(values), "per_seed": values}


@contextlib.contextmanager
def scored_at(steps, score):
    """train.train_drafts with score(step, drafts) in place of its runs.save_state at each step of `steps` (and no
    resumable state written at any step)."""
    saved = runs.save_state
    runs.save_state = lambda path, step, models, *args, **kwargs: score(step, models) if step in steps else None
    try:
        yield
    finally:
        runs.save_state = saved


def held_out_tau(drafts, target, evals, gamma):
    """{split: {kind: tau at gamma}} by the exact replay of greedy speculative decoding; evals: {split: (data,
    the target's greedy outputs)}."""
    for d in drafts.values():
        d.eval()  # the training loop sets train() again before its next step
    out = {}
    for split, (data, outputs) in evals.items():
        matches = evaluate.draft_matches(drafts, target, data, outputs)
        out[split] = {k: evaluate.tau_by_gamma(matches[k], [gamma])[gamma]["tau"] for k in drafts}
    return out


def distil(target, train, evals, n_train, seed, steps, gamma, work):
    """One train.py draft run (both kinds, draft seed `seed`, n_train scenes) -> {"tau": {split: {kind: {step: tau}}},
    "wall_s", "final_dir"}."""
    cfg = dataclasses.replace(T.TrainConfig(), out=os.path.join(work, f"n{n_train}"), n_train=n_train,
                              draft_seed=seed, eval_every=math.gcd(*steps))
    if os.path.exists(os.path.join(cfg.out, f"drafts_s{seed}.state.pt")):  # train_drafts would resume it
        raise SystemExit(f"{cfg.out} holds a resumable draft state: delete it or pass another --work")
    tau = {split: {k: {} for k in KINDS} for split in SPLITS}

    def score(step, drafts):
        for split, by_kind in held_out_tau(drafts, target, evals, gamma).items():
            for k, v in by_kind.items():
                tau[split][k][step] = v
        print(f"  n_train {n_train:5d} seed {seed} step {step:3d}: test tau "
              + "  ".join(f"{k} {tau['test'][k][step]:.3f}" for k in KINDS), flush=True)

    t0 = time.time()
    with scored_at(set(steps), score):
        T.train_drafts(cfg, target, train)
    return {"tau": tau, "wall_s": time.time() - t0, "final_dir": cfg.out}


def first_reaching(curve, steps, frac):
    """The first step of `steps` at which curve ({step: tau}) reaches frac of its value at the last step."""
    return next(s for s in steps if curve[s] >= frac * curve[steps[-1]])


def summarise(runs, n_trains, seeds, steps, frac=0.95):
    """Per (kind, n_train, step): mean, spread and per-seed values of val and test tau; steps to reach frac of the
    final tau per (kind, n_train): on the seed-mean test curve and per seed; the paired test-tau difference FlatRoPE -
    replica per (n_train, step) over seeds (a seed's two drafts see the same batches)."""
    table, reach = [], []
    for n in n_trains:
        for k in KINDS:
            for s in steps:
                table.append({"kind": k, "n_train": n, "step": s,
                              **{split: stats([runs[f"{n}/{seed}"]["tau"][split][k][s] for seed in seeds])
                                 for split in SPLITS}})
            mean_curve = {s: statistics.mean(runs[f"{n}/{seed}"]["tau"]["test"][k][s] for seed in seeds)
                          for s in steps}
            reach.append({"kind": k, "n_train": n, "frac": frac, "final_test_tau": mean_curve[steps[-1]],
                          "step_mean_curve": first_reaching(mean_curve, steps, frac),
                          "step_per_seed": [first_reaching(runs[f"{n}/{seed}"]["tau"]["test"][k], steps, frac)
                                            for seed in seeds]})
    paired = [{"n_train": n, "step": s, "flat_minus_replica": stats(
        [runs[f"{n}/{seed}"]["tau"]["test"]["flat"][s] - runs[f"{n}/{seed}"]["tau"]["test"]["mrope"][s]
         for seed in seeds])} for n in n_trains for s in steps]  # the same seed's batches: a paired difference
    return table, reach, paired


def print_tables(result):
    steps = result["settings"]["steps"]
    rows = {(r["kind"], r["n_train"], r["step"]): r for r in result["table"]}
    for split in ("test", "val"):
        print(f"\n{split} tau at gamma {result['settings']['gamma']}, mean +- half the spread over seeds "
              f"{result['settings']['seeds']}")
        print(f"{'n_train':>7s} {'draft':17s} " + " ".join(f"{'step ' + str(s):>13s}" for s in steps))
        for n in result["settings"]["n_train"]:
            for k in KINDS:
                print(f"{n:7d} {NAMES[k]:17s} " + " ".join(
                    f"{rows[(k, n, s)][split]['mean']:7.2f} +-{rows[(k, n, s)][split]['spread'] / 2:4.2f}"
                    for s in steps))
    print("\ntest tau, FlatRoPE - replica per seed (same batches), mean +- half the spread")
    for n in result["settings"]["n_train"]:
        diffs = [p["flat_minus_replica"] for p in result["paired_test"] if p["n_train"] == n]
        print(f"{n:7d} " + " ".join(f"{d['mean']:+7.2f} +-{d['spread'] / 2:4.2f}" for d in diffs))
    for r in result["steps_to_reach"]:
        print(f"{NAMES[r['kind']]:17s} n_train {r['n_train']:5d}: {r['frac']:.0%} of its final test tau "
              f"{r['final_test_tau']:.2f} at step {r['step_mean_curve']} (seed-mean curve), "
              f"per seed {r['step_per_seed']}")


def plot(result, path="figures/learning_speed.png"):
    """Left: test tau against distillation step, one line per (kind, n_train), the band the seeds' min..max.
    Right: test tau at the last step against n_train."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps, n_trains = result["settings"]["steps"], result["settings"]["n_train"]
    rows = {(r["kind"], r["n_train"], r["step"]): r["test"] for r in result["table"]}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.cm.viridis([i / max(1, len(n_trains) - 1) * 0.85 for i in range(len(n_trains))])
    for c, n in zip(colors, n_trains):
        for k, style in zip(KINDS, ("--", "-")):
            cells = [rows[(k, n, s)] for s in steps]
            ax.plot(steps, [x["mean"] for x in cells], style, color=c, marker="o", ms=3, label=f"{NAMES[k]}, n {n}")
            ax.fill_between(steps, [min(x["per_seed"]) for x in cells], [max(x["per_seed"]) for x in cells],
                            color=c, alpha=0.08)
    ax.set(xlabel="distillation step", ylabel=f"held-out tau (gamma {result['settings']['gamma']})",
           title="tau against steps (band: seeds' min..max)")
    ax.legend(fontsize=7, ncol=2)
    for k, style, shift in zip(KINDS, ("--", "-"), (0.97, 1.03)):
        cells = [rows[(k, n, steps[-1])] for n in n_trains]
        bx.errorbar([n * shift for n in n_trains], [x["mean"] for x in cells], fmt="o" + style,
                    yerr=[[x["mean"] - min(x["per_seed"]) for x in cells],
                          [max(x["per_seed"]) - x["mean"] for x in cells]],
                    capsize=3, label=NAMES[k])
    bx.set_xscale("log")
    bx.set_xticks(n_trains, [str(n) for n in n_trains])
    bx.minorticks_off()
    bx.set(xlabel="training scenes (n_train)", ylabel="held-out tau", title=f"tau at step {steps[-1]} (bars: min..max)")
    bx.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default, what in (
            ("--run", "checkpoints/toy", "folder with target/ and the shipped drafts"),
            ("--work", "runs/learning_speed", "where each n_train's final drafts are written"),
            ("--n-train", "200,1000,32000", "training-set sizes (32000: the shipped drafts')"),
            ("--seeds", "0,1,2", "draft seeds"),
            ("--steps", "25,50,100,150,200,300", "where tau is measured; the last is train.py's draft_steps"),
            ("--scenes", 64, "val / held-out scenes"), ("--gamma", evaluate.GAMMA, "draft length of tau"),
            ("--out", OUT, "the JSON (its runs are reused when the settings match; the README's: "
                     "experiments/learning_speed.json)")):
        ap.add_argument(flag, type=type(default), default=default, help=what)
    ap.add_argument("--plot", action="store_true", help="also draw figures/learning_speed.png")
    ap.add_argument("--plot-only", action="store_true", help="only redraw the figure from --out")
    a = ap.parse_args(argv)
    if a.plot_only:
        return plot(files.read_json(a.out))
    a = cli.checked(ap, a, counts=("scenes", "gamma"), lists=("n_train", "seeds", "steps"), out=OUT)
    n_trains, seeds, steps = a.n_train, a.seeds, a.steps
    if steps[-1] != T.TrainConfig().draft_steps or min(n_trains + steps) < 1:
        ap.error(f"--steps and --n-train must be >= 1, --steps end at train.py's draft_steps "
                 f"{T.TrainConfig().draft_steps}")
    cli.progress(f"learning speed: {len(n_trains)} training-set sizes x {len(seeds)} seeds")
    t0 = time.time()
    tok = driving.Tokenizer()
    target = checkpoint.load(os.path.join(a.run, "target")).eval()
    settings = {"n_train": n_trains, "seeds": seeds, "steps": steps, "scenes": a.scenes, "gamma": a.gamma,
                "target": checkpoint.fingerprint(target), "train_config": dataclasses.asdict(T.TrainConfig())}
    command = "python experiments/learning_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    old = files.read_json(a.out) if os.path.exists(a.out) else {}
    same = {k: v for k, v in old.get("settings", {}).items() if k not in ("n_train", "seeds")} == \
        {k: v for k, v in settings.items() if k not in ("n_train", "seeds")}
    runs = dict(old.get("runs", {})) if same else {}  # a run's values depend only on these settings, n and its seed
    commands = old.get("commands", []) if same else []
    print(f"reusing {len(runs)} runs of {a.out}" if runs else f"no runs of {a.out} to reuse", flush=True)
    # JSON keys are strings: the steps of reused runs come back as "25", ...
    for r in runs.values():
        r["tau"] = {sp: {k: {int(s): v for s, v in c.items()} for k, c in by.items()} for sp, by in r["tau"].items()}
    evals = {}
    for split in SPLITS:
        data = Data(split, a.scenes, 0, tok)
        evals[split] = (data, evaluate.greedy_outputs(target, data))
    shipped = {}  # the shipped drafts (train.py's run at n_train 32000) under the same evaluation
    for seed in seeds:
        drafts = {k: checkpoint.load(checkpoint.draft_dir(a.run, k, seed), target=target) for k in KINDS}
        shipped[seed] = held_out_tau(drafts, target, evals, a.gamma)
    print(f"shipped drafts, test tau at gamma {a.gamma}: " + "  ".join(
        f"seed {s} " + " ".join(f"{k} {v['test'][k]:.3f}" for k in KINDS) for s, v in shipped.items()), flush=True)
    for n in n_trains:
        train = None
        for seed in seeds:
            if f"{n}/{seed}" in runs:
                continue
            if train is None:
                train = Data("train", n, T.TrainConfig().seed, tok)  # as train.run builds it
            run = distil(target, train, evals, n, seed, steps, a.gamma, a.work)
            if n == T.TrainConfig().n_train:  # the shipped run's setting: how far are the weights from the shipped?
                run["max_abs_weight_diff_to_shipped"] = {k: max(
                    float((p - q).detach().abs().max()) for p, q in zip(
                        checkpoint.load(checkpoint.draft_dir(run["final_dir"], k, seed), target=target).parameters(),
                        checkpoint.load(checkpoint.draft_dir(a.run, k, seed), target=target).parameters()))
                    for k in KINDS}
            runs[f"{n}/{seed}"] = run
            print(f"n_train {n} seed {seed}: {run['wall_s']:.0f} s", flush=True)
            # written after every run: an interrupted probe resumes from here
            files.write_json(a.out, {"commands": commands + [command], "settings": settings, "runs": runs})
    done = [n for n in sorted(n_trains) if all(f"{n}/{s}" in runs for s in seeds)]
    table, reach, paired = summarise(runs, done, seeds, steps)
    result = {"commands": commands + [command], "settings": {**settings, "n_train": done}, "shipped": shipped,
              "runs": runs, "table": table, "steps_to_reach": reach, "paired_test": paired,
              "wall_s": time.time() - t0, "wall_s_runs": sum(r["wall_s"] for r in runs.values())}
    files.write_json(a.out, result)
    print_tables(result)
    print(f"wrote {a.out} ({time.time() - t0:.0f} s this command, {result['wall_s_runs']:.0f} s in all runs)")
    if a.plot:
        plot(result)


if __name__ == "__main__":
    main()
