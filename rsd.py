"""Reasoning-aware Speculative Decoding end to end (the paper's table). The routine reasoner (a 1-layer FlatRoPE draft,
post-trained with AARL) proposes CoC tokens, the deliberative reasoner (the unmodified target, M-RoPE) verifies them
and writes the commitments itself, the trajectory head plans from prompt + CoC. On the synthetic driving world's
held-out test split: target-only, the replica draft (M-RoPE), the FlatRoPE draft and FlatRoPE + AARL at their
speed-optimal gamma on val (mean over the draft seeds), then their draft trees. tau at every gamma comes from one
teacher-forced replay of the target's greedy outputs (evaluate.simulate_rounds); real speculative decoding checks the
outputs and times the speed-up. The top of the layering: it calls the scripts train.py, aarl.py and bench.py.

run: python rsd.py [--json] [--plot]        (--retrain trains what is missing: train.py, aarl.py)
"""
import argparse
import importlib.util
import json
import os
import statistics
import time

import torch

import aarl
import bench
import driving
from driving import Data
import evaluate
from evaluate import MAX_NEW_TOKENS, TARGET_ONLY
from ops import checkpoint, cli, files
from ops.timing import step_times, tree_step_times
import speculate
import train as T
from tree import TreeShape, tree_speedup

ROWS = (("replica", "mrope"), ("flatrope", "flat"), ("flatrope+aarl", "aarl"))  # table row -> draft kind on disk
GAMMAS = tuple(range(2, 9))
# the draft trees a tree row chooses from on val (width 3: experiments/tree_sweep.py); --tree N keeps those of <= N nodes
TREES = tuple(TreeShape(n, d, 3) for n in (16, 32) for d in (6, 8))
FIGURES = "figures"  # --plot's folder
# --plot's views sweep, written by python experiments/views_sweep.py; found from any working folder
SWEEP_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "experiments", "views_sweep.json")


# ---- the table ----
def paper_table(target, drafts, splits, n_time, repeats, decoding=None, compile=False):
    """The chain rows (ms/token: the first seed's draft against target-only in the same passes) and the sweep (mean tau
    per split and gamma, and the ceiling). Sampling `decoding`: timed sampling, plus real sampled decoding's
    sampled_tau / sampled_alpha; compile: both timed arms on compiled static-shape steps (bench.compiled_pair)."""
    test, stop = splits["test"], splits["test"].tok.cot_end_id
    outputs = {split: evaluate.greedy_outputs(target, data) for split, data in splits.items()}
    mean_tau = lambda per_seed, g: statistics.mean(t[g]["tau"] for t in per_seed)  # noqa: E731
    flat = {(row, s): d for row, by_seed in drafts.items() for s, d in by_seed.items()}
    # {split: {row: [tau_by_gamma of each seed]}}, from one teacher-forced pass per draft
    matches = {split: evaluate.draft_matches(flat, target, data, outputs[split]) for split, data in splits.items()}
    taus = {split: {row: [evaluate.tau_by_gamma(m[(row, s)], GAMMAS) for s in by_seed]
                    for row, by_seed in drafts.items()} for split, m in matches.items()}
    sweep = {split: {g: {"ceiling": speculate.tau_ceiling([len(o) for o in outputs[split]], g),
                         **{row: mean_tau(taus[split][row], g) for row in drafts}} for g in GAMMAS}
             for split in splits}
    prompts = evaluate.scene_prompts(test.scenes, test.tok, next(target.parameters()).device, views=test.views_at(0))
    first = {row: next(iter(by_seed.values())) for row, by_seed in drafts.items()}
    times = step_times(target, first["flatrope"], prompts[0], [1] + [g + 1 for g in GAMMAS])
    ade = evaluate.trajectory_ade(target, test, outputs["test"])[0]  # every arm emits the target's greedy CoC
    attn = evaluate.attention_split(target, target, test)
    sampling = decoding is not None and decoding["mode"] == "sampling"
    rows = [{"name": TARGET_ONLY, "gamma": None, "tau": 1.0, "tau_spread": 0.0, "tau_by_gamma": None,
             "tau_ceiling": 1.0, "routine_fraction": 0.0, "commit_acc": evaluate.commitment_acc(target, target, test),
             "speedup": 1.0, "ade": ade, "greedy_match": True, **{f"attn_{k}": v for k, v in attn.items()},
             **({"sampled_tau": 1.0, "sampled_alpha": None} if sampling else {})}]
    for name, by_seed in drafts.items():
        per_seed = taus["test"][name]
        g = evaluate.speed_optimal_gamma({gg: mean_tau(taus["val"][name], gg) for gg in GAMMAS}, times)
        spec = evaluate.spec_stats(target, {name: first[name]}, prompts, g, stop_token=stop, check_greedy=False)[name]
        t, d = (bench.compiled_pair(target, first[name], prompts[:n_time], g, MAX_NEW_TOKENS) if compile
                else (target, first[name]))
        timing = bench.time_arms(t, {name: d}, prompts[:n_time], g, MAX_NEW_TOKENS, stop, repeats, decoding)
        rows[0].setdefault("ms_per_token", timing[TARGET_ONLY]["ms_per_token"])
        attn = [evaluate.attention_split(d, target, test) for d in by_seed.values()]
        rows.append({"name": name, "gamma": g, "tau": mean_tau(per_seed, g),
                     "tau_spread": max(t[g]["tau"] for t in per_seed) - min(t[g]["tau"] for t in per_seed),
                     "tau_by_gamma": {gg: mean_tau(per_seed, gg) for gg in GAMMAS},
                     "tau_ceiling": sweep["test"][g]["ceiling"],
                     "routine_fraction": statistics.mean(t[g]["routine_fraction"] for t in per_seed),
                     "commit_acc": statistics.mean(evaluate.commitment_acc(d, target, test) for d in by_seed.values()),
                     "ms_per_token": timing[name]["ms_per_token"], "speedup": timing[name]["speedup"], "ade": ade,
                     **{f"attn_{k}": statistics.mean(a[k] for a in attn) for k in ("history", "image", "text")},
                     # real speculative decoding emits the target's greedy output, at the tau the replay predicts
                     "greedy_match": spec["tokens"] == outputs["test"],
                     "replay_exact": spec["tau"] == per_seed[0][g]["tau"]})
        if sampling:  # the replay is greedy; sampled tau needs real decoding
            s = evaluate.spec_stats(target, {name: first[name]}, prompts, g, stop_token=stop, decoding=decoding)[name]
            rows[-1].update(sampled_tau=s["tau"], sampled_alpha=s["alpha"])
    return rows, sweep, times


def tree_rows(target, drafts, chain_rows, splits, n_time, repeats, decoding=None, max_nodes=32):
    """One tree row per draft kind: the shape of TREES (<= max_nodes nodes) predicted fastest on val, then every seed's
    held-out tree decoding. Commitment accuracy, attention and ADE are the chain row's: the draft's, not the decoder's."""
    stop = driving.Tokenizer().cot_end_id
    shapes = [sh for sh in TREES if sh.nodes <= max_nodes]
    val, test = (evaluate.scene_prompts(d.scenes, d.tok, next(target.parameters()).device, views=d.views_at(0))
                 for d in (splits["val"], splits["test"]))
    first = {row: next(iter(by_seed.values())) for row, by_seed in drafts.items()}
    times = step_times(target, first["flatrope"], val[0], (1,))
    t1, td = times["target"][1], times["draft"]
    tt = tree_step_times(target, first["flatrope"], val[0], sorted({sh.nodes for sh in shapes}), 3)
    predicted = lambda tau, sh: tree_speedup(tau, t1, td, tt["draft_level"], tt["target"][sh.nodes], sh)  # noqa: E731
    rows = []
    for name, by_seed in drafts.items():
        chain = next(r for r in chain_rows if r["name"] == name)
        val_tau = {sh: evaluate.spec_stats(target, {name: first[name]}, val, sh, stop_token=stop,
                                           check_greedy=False)[name]["tau"] for sh in shapes}
        sh = max(shapes, key=lambda x: predicted(val_tau[x], x))
        stats = [evaluate.spec_stats(target, {name: d}, test, sh, stop_token=stop)[name] for d in by_seed.values()]
        timing = bench.time_arms(target, {name: first[name]}, test[:n_time], sh, MAX_NEW_TOKENS, stop, repeats,
                                 decoding)
        taus = [st["tau"] for st in stats]
        row = {**{k: chain[k] for k in ("commit_acc", "ade", "attn_history", "attn_image", "attn_text")},
               "name": f"{name} tree", "gamma": None, "tree": [sh.nodes, sh.depth, sh.width],
               "tau": statistics.mean(taus), "tau_spread": max(taus) - min(taus), "tau_by_seed": taus,
               "tau_ceiling": stats[0]["tau_ceiling"], "val_tau": {str(x): v for x, v in val_tau.items()},
               "routine_fraction": statistics.mean(st["routine_fraction"] for st in stats),
               "alpha_by_depth": stats[0]["alpha_by_depth"], "nodes_per_round": stats[0]["nodes_per_round"],
               "ms_per_token": timing[name]["ms_per_token"], "speedup": timing[name]["speedup"],
               "greedy_match": all(st["greedy_match"] for st in stats), "replay_exact": True}
        if decoding is not None and decoding["mode"] == "sampling":
            s = evaluate.spec_stats(target, {name: first[name]}, test, sh, stop_token=stop, decoding=decoding)[name]
            row.update(sampled_tau=s["tau"], sampled_alpha=s["alpha"])
        rows.append(row)
    return rows


# ---- display ----
def show_scenes(target, draft, data: Data, gamma, n, log=print, decoding=None):
    """A few scenes planned by the two reasoners, next to target-only decoding (both sampled under `decoding`)."""
    tok, device = data.tok, next(target.parameters()).device
    prompts = evaluate.scene_prompts(data.scenes[:n], tok, device, views=data.views_at(0))
    for i, (scene, prompt) in enumerate(zip(data.scenes, prompts)):
        sampling = evaluate.sampling_kwargs(decoding, i)
        spec = evaluate.decode(target, draft, prompt, gamma, MAX_NEW_TOKENS, tok.cot_end_id, **sampling)
        base = evaluate.decode(target, None, prompt, gamma, MAX_NEW_TOKENS, tok.cot_end_id, **sampling)
        # sampled outputs share the target's distribution, not its tokens: no token-by-token comparison
        same = "" if sampling else f"   identical: {spec.tokens == base.tokens}"
        log(f"scene {i} ({scene.f.road}, {scene.f.event}, history {scene.f.hist_class}):")
        log(f"  RSD    tau {spec.tau:.1f}: {evaluate.marked_coc([tok.vocab[t] for t in spec.tokens], spec.from_draft)}")
        log(f"  target-only: {tok.decode(base.tokens)}{same}")


def print_table(rows, log=print):
    sampled = "sampled_tau" in rows[0]  # a column only when the run samples
    log(f"{'':20s} {'gamma':>7s} {'tau':>11s} " + (f"{'tau sampled':>11s} " if sampled else "")
        + f"{'routine':>8s} {'commit':>7s} {'ms/token':>9s} {'speed-up':>9s} {'ADE m':>6s} {'attn hist':>9s} "
        f"{'attn img':>9s}")
    for r in rows:
        g = "/".join(map(str, r["tree"])) if r.get("tree") else "" if r["gamma"] is None else str(r["gamma"])
        tau = f"{r['tau']:.2f}" + (f" ±{r['tau_spread'] / 2:.2f}" if g else "")
        stau = f"{r['sampled_tau']:11.2f} " if sampled else ""
        log(f"{r['name']:20s} {g:>7s} {tau:>11s} {stau}{r['routine_fraction']:8.3f} {r['commit_acc']:7.3f} "
            f"{r['ms_per_token']:9.3f} {r['speedup']:8.2f}x {r['ade']:6.2f} {r['attn_history']:9.3f} "
            f"{r['attn_image']:9.3f}")


def print_sweep(sweep, rows, log=print):
    names = [r["name"] for r in rows if r["gamma"] is not None]  # the chain rows
    log("tau by draft length (mean over seeds; ceiling = a draft the verifier never rejects):")
    log(f"{'split':6s} {'gamma':>5s} {'ceiling':>8s} " + " ".join(f"{n:>14s}" for n in names))
    for split, by_g in sweep.items():
        for g, v in by_g.items():
            log(f"{split:6s} {g:5d} {v['ceiling']:8.2f} " + " ".join(f"{v[n]:14.2f}" for n in names))


# ---- figures ----
def plot(rows, out=FIGURES, sweep_json=SWEEP_JSON):
    """figures/attention.png (where each model's attention goes while it writes the CoC) and, from the views sweep
    of experiments/views_sweep.py, figures/views_sweep.png (tau of both drafts against the visual-token count)."""
    import matplotlib  # main checks that it is installed before any work
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(out, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3))
    names, bottom = [r["name"] for r in rows], [0.0] * len(rows)
    for key, label in (("attn_image", "image tokens"), ("attn_history", "trajectory history"), ("attn_text", "text")):
        ax.bar(names, [r[key] for r in rows], bottom=bottom, label=label)
        bottom = [b + r[key] for b, r in zip(bottom, rows)]
    ax.set_ylabel("attention mass while writing the CoC")
    ax.legend(fontsize=7)
    save = lambda fig, name: files.atomic_write(  # noqa: E731
        os.path.join(out, name), lambda p: fig.savefig(p, format="png", dpi=120, bbox_inches="tight"))
    save(fig, "attention.png")
    written = [f"{out}/attention.png"]
    if os.path.exists(sweep_json):
        sweep = files.read_json(sweep_json)
        fig, axes = plt.subplots(1, 2, figsize=(9, 3))
        for ax, (key, label) in zip(axes, (("tau", "held-out tau at gamma 6"), ("attn_history", "attention on history"))):
            for kind, style in (("mrope", "o-"), ("flat", "s-")):
                pts = sorted((p["visual_tokens"], p[kind][key]["mean"], p[kind][key]["spread"]) for p in sweep["points"])
                x, y, e = zip(*pts)
                ax.errorbar(x, y, yerr=[s / 2 for s in e], fmt=style, capsize=3,
                            label={"mrope": "replica (M-RoPE)", "flat": "FlatRoPE"}[kind])
            ax.set(xscale="log", xlabel="visual tokens in the prompt", ylabel=label)
            ax.legend(fontsize=7)
        save(fig, "views_sweep.png")
        written.append(f"{out}/views_sweep.png")
    else:
        print(f"{sweep_json} not found: run python experiments/views_sweep.py for figures/views_sweep.png")
    print("figures written: " + ", ".join(written))


# ---- main ----
def main(argv=None):
    ap, a, seeds, decoding, device = parse_args(argv)
    t0 = time.time()
    with cli.user_errors(ap):  # a failed retrain, a corrupt file, a draft distilled from another target: one line
        if a.retrain:
            retrain(a.run, seeds, device)
        if gone := missing(a.run, seeds):
            raise ValueError(f"missing checkpoints: {', '.join(gone)}; use the shipped checkpoints/toy, or train them "
                             f"with `python rsd.py --retrain --run {a.run}`")
        target = checkpoint.load(os.path.join(a.run, "target"), dtype=cli.DTYPES[a.dtype], device=device).eval()
        drafts = {row: {s: checkpoint.load(checkpoint.draft_dir(a.run, kind, s), target=target).eval() for s in seeds}
                  for row, kind in ROWS}
    tok = driving.Tokenizer()
    splits = {split: Data(split, a.scenes, 0, tok, views=a.views) for split in ("val", "test")}
    test = splits["test"]
    metrics = evaluate.evaluate_target(target, test)
    print(f"target on the held-out test split: CoC exact {metrics['coc_exact']:.3f}, "
          f"commitment accuracy {metrics['commitment_acc']:.3f}, ADE {metrics['ade']:.2f} m")
    rows, sweep, times = paper_table(target, drafts, splits, a.time_scenes, a.repeats, decoding, a.compile)
    aarl_row = rows[-1]
    if a.tree:
        rows += tree_rows(target, drafts, rows, splits, a.time_scenes, a.repeats, decoding, a.tree)
    show_scenes(target, drafts["flatrope+aarl"][seeds[0]], test, aarl_row["gamma"], a.show, decoding=decoding)
    ids = evaluate.scene_prompts(test.scenes[:1], tok, device, views=a.views)[0]["input_ids"]
    n_visual, n_hist = int(((ids == tok.image_token_id) | (ids == tok.video_token_id)).sum()), 3 * tok.cfg.n_hist
    print(f"\nheld-out test split, {a.scenes} scenes, {n_visual} visual and {n_hist} history "
          f"tokens per prompt, {a.dtype} on {a.device} ({torch.get_num_threads()} threads); draft rows: mean ± half "
          f"the spread over seeds {seeds} at the row's speed-optimal gamma (chosen on {a.scenes} val scenes); "
          f"speed-up = reasoning-step ms/token vs target-only, seed {seeds[0]}'s draft"
          + (", both arms torch.compile'd" if a.compile else ""))
    if decoding["mode"] == "sampling":
        print(f"decoding: {bench.decoding_text(decoding)} (prompt i = test scene i). tau = the exact greedy replay "
              f"(gamma chosen on it); tau sampled = real sampled speculative decoding with seed {seeds[0]}'s draft; "
              f"ms/token and speed-up timed sampling; ADE after the greedy CoC")
    print_table(rows)
    print(f"step times: T_target(1) {1e3 * times['target'][1]:.2f} ms, T_draft(1) {1e3 * times['draft']:.3f} ms; "
          f"commit = teacher-forced accuracy on the commitment tokens")
    for r in rows:
        if r.get("tree"):
            print(f"{r['name']}: tree of N/D/k = {'/'.join(map(str, r['tree']))} (chosen on val), "
                  f"{r['nodes_per_round']:.1f} nodes per round, alpha by depth "
                  + " ".join("-" if x is None else f"{x:.2f}" for x in r["alpha_by_depth"]) + f" (seed {seeds[0]})")
    greedy_match = all(r["greedy_match"] for r in rows)
    print(f"greedy outputs identical to target-only on every scene and draft: {greedy_match}; real speculative "
          f"decoding's tau equals the replay's: {all(r.get('replay_exact', True) for r in rows)}\n")
    print_sweep(sweep, rows)
    share = driving.routine_share("train")
    print(f"routine share of the world (the Bayes-optimal reader of the history, python driving.py): {share:.3f}")
    print(f"wall time {time.time() - t0:.0f} s")
    if a.json:
        keys = ("name", "gamma", "tau", "tau_spread", "tau_by_gamma", "tau_ceiling", "routine_fraction", "commit_acc",
                "ms_per_token", "speedup", "ade", "attn_history", "attn_image", "attn_text")
        keys += ("sampled_tau", "sampled_alpha") if decoding["mode"] == "sampling" else ()
        keys += ("tree", "tau_by_seed", "val_tau", "alpha_by_depth", "nodes_per_round")  # None on chain rows
        print(json.dumps({"decoding": decoding, "compiled": a.compile, "greedy_match": greedy_match,
                          "tau_ceiling": aarl_row["tau_ceiling"], "sweep": sweep,
                          "target": {k: metrics[k] for k in ("coc_exact", "commitment_acc", "ade")},
                          "prompt": {"visual_tokens": n_visual, "history_tokens": n_hist},
                          "routine_share_world": share, "seeds": seeds,
                          "rows": [{k: r.get(k) for k in keys} for r in rows]}))
    if a.plot:  # after the report: a failing figure loses no result
        with cli.user_errors(ap):
            plot(rows, FIGURES)


# ---- operations: checkpoints, retraining, the command line and its checks ----
def missing(run, seeds):
    paths = [os.path.join(run, "target")] + [checkpoint.draft_dir(run, kind, s) for _, kind in ROWS for s in seeds]
    return [p for p in paths if not os.path.isdir(p)]


def retrain(run, seeds, device="cpu", log=print):
    """Train what `run` lacks, under its writer lock: the target and SFT drafts (train.py), then AARL's (aarl.py)."""
    with files.writer_lock(run):
        for seed in seeds:
            sft = [os.path.join(run, "target")] + [checkpoint.draft_dir(run, kind, seed) for kind in ("mrope", "flat")]
            if not all(os.path.isdir(p) for p in sft):  # a missing AARL draft alone retrains nothing
                stage = "all" if not os.path.isdir(sft[0]) else "drafts"
                log(f"training into {run}: stage {stage}, draft seed {seed} (train.py defaults)")
                T.run(T.TrainConfig(out=run, device=str(device), draft_seed=seed), stage=stage, log=log)
            if not os.path.isdir(aarl.out_dir(run, "static", seed)):
                log(f"post-training the FlatRoPE draft of seed {seed} with AARL (aarl.py defaults, static anchor)")
                aarl.print_result(aarl.run(aarl.AARLConfig(seed=seed), run, device=device,
                                           out=aarl.out_dir(run, "static", seed)))


def parse_args(argv):
    """(parser, flags, seeds, decoding, device), every flag checked before any work: one line `rsd.py: error: ...`."""
    ap = argparse.ArgumentParser(description="The two-reasoner planner (RSD) on the synthetic driving world.")
    ap.add_argument("--run", default=checkpoint.SHIPPED, help="run folder (default: the shipped checkpoints/toy)")
    ap.add_argument("--retrain", action="store_true", help="train whatever is missing in --run first")
    ap.add_argument("--seeds", default="0,1,2", help="draft seeds of every row (mean and spread over them)")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--views", type=int, default=driving.WorldConfig().views,
                    help="surround views per prompt (the geometry the drafts were trained at)")
    ap.add_argument("--scenes", type=int, default=64, help="held-out scenes of the table (and val scenes for gamma)")
    ap.add_argument("--time-scenes", type=int, default=16, help="of those, scenes timed for ms/token")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (median)")
    ap.add_argument("--show", type=int, default=3, help="scenes printed with routine / [deliberative] tokens")
    ap.add_argument("--dtype", default="fp32", choices=sorted(cli.DTYPES),
                    help="inference dtype (fp32: the exactness claims hold bit for bit)")
    cli.add_decoding_flags(ap, "> 0 also reports the sampled tau of real speculative decoding per row and "
                                "times both arms sampling (prompt i = held-out scene i)")
    ap.add_argument("--compile", action="store_true", help="time both arms with torch.compile'd static-shape steps "
                    "(minutes of compilation; gamma is still chosen with the eager cost model)")
    ap.add_argument("--tree", type=int, default=None, help="draft-tree rows beside the chain rows of at most this many "
                    "nodes (the shape chosen on val from rsd.TREES); 0 = chain rows; default 32 (0 with --compile)")
    ap.add_argument("--plot", action="store_true", help="write figures/ (needs matplotlib), after the report")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = ap.parse_args(argv)
    a.tree = (0 if a.compile else 32) if a.tree is None else a.tree  # --compile times chains only (no compiled trees)
    with cli.user_errors(ap):
        cli.check_values(a, [(">= 1", ("scenes", "time_scenes", "repeats")), ("a finite number >= 0", ("show",)),
                                  (cli.VIEWS_RULE, ("views",))], flags=True)
        try:
            seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
        except ValueError:
            seeds = []
        for bad, msg in ((a.tree and not any(sh.nodes <= a.tree for sh in TREES), f"--tree {a.tree}: the smallest tree "
                          f"rsd.py chooses from has {min(sh.nodes for sh in TREES)} nodes (0 = chain rows only)"),
                         (a.tree and a.compile, "--compile times the chain only (the tree's steps have no static-shape "
                          "path yet): add --tree 0"),  # below: both are taken from the --scenes held-out scenes
                         (a.time_scenes > a.scenes or a.show > a.scenes, f"--time-scenes ({a.time_scenes}) and --show "
                          f"({a.show}) must be at most --scenes ({a.scenes})"),
                         (not seeds or min(seeds) < 0, f"--seeds must be non-negative integers, got {a.seeds!r}"),
                         (len(set(seeds)) < len(seeds),  # a repeated seed would count twice in the mean and spread
                          f"--seeds must not repeat a seed, got {a.seeds!r}")):
            if bad:
                raise ValueError(msg)
        decoding = cli.decoding_mode(a.temperature, a.top_k, a.top_p, a.sampling_seed)
        device = cli.check_device(a.device)
        if a.plot:  # figures come after minutes of work: their dependency and folder are checked first
            if importlib.util.find_spec("matplotlib") is None:
                raise ValueError("--plot needs matplotlib: pip install matplotlib")
            files.check_writable(FIGURES)
    return ap, a, seeds, decoding, device


if __name__ == "__main__":
    main()
