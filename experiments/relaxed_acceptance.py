"""Relaxed (lossy) acceptance priced in trajectory error: the held-out test split decoded by the shipped FlatRoPE
drafts (every seed) under a sweep of bounds of both rules of speculate.Relaxed, token-level (Medusa's typical
acceptance at every position) and reasoning-aware (the same at routine positions only, the commitments, the words
the CoC grammar leaves open, verified exactly).

The claim, stated before measuring: at equal tau gained over lossless decoding, the reasoning-aware rule moves the
plan less than the token-level rule. Each record: rule, bound, tau, ade (to the ground truth), ade_vs_exact (to the
plan after the lossless CoC), commitment_acc (the ground truth's commitment words at their places in the decoded CoC),
coc_exact, coc_same (the lossless CoC), speedup (target-only / relaxed CPU seconds of decoding every CoC, prefill
included, one thread, same process: CPU time, as the machine is shared; noisy) and speedup_model (the cost model at
this tau: tau T_target(1) / (gamma T_draft(1) + T_target(gamma + 1)), the least of five interleaved blocks of step
times, the target's pooled over the seeds: the same tau, the same number).
Bound 0 of each rule is the lossless point, checked greedy-identical to target-only decoding here.

run: python experiments/relaxed_acceptance.py --out experiments/relaxed_acceptance.json \
         --figure docs/figures/relaxed_acceptance.png    (the committed ones; by default runs/; --plot-only redraws
     the figure from the JSON)
"""
import argparse
from dataclasses import astuple, replace
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import checkpoint, cli, files  # noqa: E402
from measure import flags, timing  # noqa: E402
from beyond.relaxed import Relaxed  # noqa: E402
from speculate import SpecResult  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT, FIGURE = "runs/relaxed_acceptance.json", "runs/relaxed_acceptance.png"
BOUNDS = (0.0, 0.99, 0.9999, 0.999999, 0.99999999, 1.0)  # eps = 1 - bound: 1e-2 .. 1e-8, then every draft
# series: the token-level rule; the reasoning-aware rule keeping every commitment word exact (the issue's); the same
# keeping only the main clause's (decision, lead state, range ring) exact, the roadside actors relaxed: why the second
# gains nothing on the toy (see the README)
RULES = {"typical": ("typical", False), "routine": ("routine", False), "routine_main": ("routine", True)}


def commitment_acc(data, cocs):
    """Share of the ground truth's commitment words (driving.commitment_positions) found at their own places in cocs."""
    right = total = 0
    for scene, coc in zip(data.scenes, cocs):
        ref = data.tok.encode(scene.coc) + [data.tok.cot_end_id]
        for i, (r, c) in enumerate(zip(ref, scene.commit)):
            right += c and i < len(coc) and coc[i] == r
            total += c
    return right / total


def decode_all(target, draft, prompts, decoder, sampling, stop):
    """Every prompt decoded (batch 1; prompt i's draws seeded sampling.offset(i)) -> (results, CPU seconds of it
    all)."""
    t = time.process_time()
    res = [evaluate.decode(target, draft, p, decoder, evaluate.MAX_NEW_TOKENS, stop, sampling.offset(i))
           for i, p in enumerate(prompts)]
    return res, time.process_time() - t


def record(target, data, res, seconds, exact, base_s):
    """One sweep point: tau, its price (evaluate.relaxed_cost, against the exact CoCs), the CoC's correctness."""
    cocs = [r.tokens for r in res]
    cost = evaluate.relaxed_cost(target, data, exact, cocs)
    return {"tau": SpecResult.pooled(res).tau, "ade": cost["ade_relaxed"], "ade_vs_exact": cost["plan_moved_m"],
            "commitment_acc": commitment_acc(data, cocs), "coc_exact": evaluate.coc_exact_match(cocs, data.coc_ids()),
            "coc_same": 1 - cost["cocs_changed"], "speedup": base_s / seconds}


def rejections(res, commit):
    """Where the exact rule loses its rounds: the target's corrections (its own token after a rejected draft) that
    are commitment words, and the rest (the most the routine rule could ever relax)."""
    out = {"commitment": 0, "routine": 0}
    for r in res:
        pos = 0
        for n, block, depth in zip(r.accepted, r.blocks, r.depths):
            if n < depth and block == n + 1:  # a rejection, its block not cut by the stop token or max-new
                out["commitment" if r.tokens[pos + n] in commit else "routine"] += 1
            pos += block
    return out


def reprice(result, target, run, gamma, data=None, tok=None, blocks=5):
    """speedup_model on every record of result: the chain's cost model at its tau, from each seed's step times
    (measure.timing.step_times on the first test prompt, the least of `blocks` measurements)."""
    if not gamma:
        raise ValueError("--reprice prices the chain (the tree's cost model is bench.py's)")
    tok = tok or driving.Tokenizer()
    data = data or driving.Data("test", result["scenes"], 0, tok)
    if isinstance(target, str):
        target = checkpoint.load(target).eval()
    prompt = evaluate.scene_prompts(data.scenes[:1], tok, "cpu", views=data.views_at(0))[0]
    torch.set_num_threads(1)
    drafts = {s: checkpoint.load(checkpoint.draft_dir(run, "flat", s), target=target).eval() for s in result["seeds"]}
    runs = {s: [] for s in drafts}
    for _ in range(blocks):  # the seeds interleaved: one target, so its step times pool over every block
        for s, draft in drafts.items():
            runs[s].append(timing.step_times(target, draft, prompt, (1, gamma + 1)))
    t1, tg = (min(r["target"][n] for rs in runs.values() for r in rs) for n in (1, gamma + 1))
    result["step_times_ms"] = {"target_1": 1e3 * t1, f"target_{gamma + 1}": 1e3 * tg}
    for s, rs in runs.items():
        td = min(r["draft"] for r in rs)
        result["step_times_ms"][f"draft_1_seed{s}"] = 1e3 * td
        for r in result["records"]:
            if r["seed"] == s:
                r["speedup_model"] = evaluate.measured_speedup(r["tau"], t1, td, tg, gamma)


def first_gain(rows, gain=1.0):
    """The first bound (ascending) whose tau is at least `gain` above the bound-0 tau, with its record; None if none."""
    rows = sorted(rows, key=lambda r: r["bound"])
    return next((r for r in rows if r["tau"] >= rows[0]["tau"] + gain), None)


def at_gain(rows, gain):
    """ade_vs_exact linearly interpolated at tau = tau(bound 0) + gain along the sweep (None beyond its reach)."""
    rows = sorted(rows, key=lambda r: r["bound"])
    goal = rows[0]["tau"] + gain
    for a, b in zip(rows, rows[1:]):
        if a["tau"] <= goal <= b["tau"] and b["tau"] > a["tau"]:
            w = (goal - a["tau"]) / (b["tau"] - a["tau"])
            return a["ade_vs_exact"] + w * (b["ade_vs_exact"] - a["ade_vs_exact"])
    return None


def summary(records, seeds, gains=(0.5, 1.0)):
    """Per seed and rule: the first bound gaining >= 1.0 tau (tau, ade_vs_exact there) and ade_vs_exact at equal tau
    gains; the claim holds at a gain for a seed when the routine rule's is below the typical rule's."""
    out = {}
    for s in seeds:
        rows = {rule: [r for r in records if r["seed"] == s and r["rule"] == rule] for rule in RULES}
        first = {rule: first_gain(rows[rule]) for rule in RULES}
        out[s] = {"first_gain_1": {rule: None if f is None else {k: f[k] for k in ("bound", "tau", "ade_vs_exact")}
                                   for rule, f in first.items()},
                  "ade_vs_exact_at_gain": {str(g): {rule: at_gain(rows[rule], g) for rule in RULES} for g in gains}}
    return out


def plot(result, path):
    """tau gained over the lossless decode (per seed) against ade_vs_exact, every series: the mean over seeds, the
    seed range as bars; the lossless point at the origin."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = result["records"]
    base = {(r["seed"], r["rule"]): r["tau"] for r in recs if r["bound"] == 0}
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for rule, color, marker, label in (("typical", "C3", "o", "token-level (typical acceptance)"),
                                       ("routine", "C0", "s", "reasoning-aware (every commitment exact)"),
                                       ("routine_main", "C2", "^", "main clause exact, roadside relaxed")):
        pts = []
        for b in result["bounds"]:
            rows = [r for r in recs if r["rule"] == rule and r["bound"] == b]
            gain, ade = [r["tau"] - base[r["seed"], rule] for r in rows], [r["ade_vs_exact"] for r in rows]
            pts.append((sum(gain) / len(gain), sum(ade) / len(ade), min(gain), max(gain), min(ade), max(ade)))
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                    xerr=[[p[0] - p[2] for p in pts], [p[3] - p[0] for p in pts]],
                    yerr=[[p[1] - p[4] for p in pts], [p[5] - p[1] for p in pts]], fmt="-" + marker, ms=4,
                    color=color, label=label, capsize=2, alpha=0.85)
    ax.plot([0], [0], "k*", ms=11, label="lossless (bound 0)", zorder=5)
    ax.set_xlabel("tau gained over lossless decoding (held-out test, per seed)")
    ax.set_ylabel("plan moved: ADE to the lossless plan (m)")
    ax.set_title(f"relaxed acceptance, FlatRoPE drafts (seeds {result['seeds']}), {result['decoder']}; bounds "
                 f"{result['bounds'][1]:g}..{result['bounds'][-1]:g}", fontsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path + ".tmp.png", dpi=130)
    os.replace(path + ".tmp.png", path)  # atomic
    print(f"wrote {path}", file=sys.stderr)


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=os.path.join(ROOT, "checkpoints", "toy"))
    ap.add_argument("--scenes", type=int, default=64, help="held-out test scenes (rsd.py's table uses 64)")
    ap.add_argument("--seeds", default="0,1,2", help="the shipped FlatRoPE drafts' seeds")
    ap.add_argument("--gamma", type=int, default=evaluate.GAMMA, help="the chain's draft length (0: the tree)")
    ap.add_argument("--tree", help="with --gamma 0: the tree N/D/k (default 32/8/3)")
    ap.add_argument("--bounds", default=",".join(map(str, BOUNDS)), help="in [0, 1], 0 (the lossless point) included")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 (Alpamayo-R1: 0.6 --top-p 0.98): "
                    "sampled, prompt i seeded i, the exact plan the lossless speculative decode's with the same draws")
    ap.add_argument("--top-p", type=float, default=None, help="with --temperature > 0")
    # runs/ (git-ignored): a quick run never replaces the committed experiments/relaxed_acceptance.json and figure
    ap.add_argument("--out", default=OUT, help=f"the JSON (default {OUT}; the README's: "
                    "experiments/relaxed_acceptance.json)")
    ap.add_argument("--figure", default=FIGURE, help=f"the figure (default {FIGURE})")
    ap.add_argument("--plot-only", action="store_true", help="redraw the figure from --out")
    ap.add_argument("--reprice", action="store_true", help="add speedup_model to --out's records (step times measured "
                    "now), redraw")
    a = ap.parse_args(argv)
    with cli.user_errors(ap):  # every flag before any work: one line naming it
        if a.plot_only or a.reprice:
            files.check_regular(a.out, f"--out {a.out}")
        cli.check_out(a.figure, "--figure", default=FIGURE)
        if a.plot_only:
            return plot(files.read_json(a.out), a.figure)
        cli.check_out(a.out, default=OUT)
        if a.reprice:
            result = files.read_json(a.out)
            reprice(result, os.path.join(a.run, "target"), a.run, a.gamma)
            files.write_json(a.out, result)  # atomic
            return print(f"wrote {a.out}", file=sys.stderr)
        seeds, bounds = cli.number_list(a.seeds, "--seeds"), cli.number_list(a.bounds, "--bounds", float, "in [0, 1]")
        cli.check_values(a, [(">= 1", ("scenes",)), (">= 0", ("gamma",))], flags=True)
        if bounds[0] != 0:
            raise ValueError("--bounds must include 0 (the lossless point of each rule)")
        if a.gamma and a.tree:
            raise ValueError("--tree is the decoder of --gamma 0: give one of them")
        decoder = a.gamma or flags.tree_shape(a.tree or "32/8/3")
        base = flags.sampling(a.temperature, None, a.top_p, 0)  # --top-p at temperature 0 would be ignored: refused
        gone = [d for d in [os.path.join(a.run, "target")] + [checkpoint.draft_dir(a.run, "flat", s) for s in seeds]
                if not os.path.isdir(d)]
        if gone:
            raise ValueError(f"--run {a.run} lacks {', '.join(gone)} (--seeds {a.seeds})")
    cli.progress(f"{len(seeds)} seeds x {len(RULES)} rules x {len(bounds)} bounds, {a.scenes} scenes each")
    torch.set_num_threads(1)
    tok = driving.Tokenizer()
    commit = frozenset(tok.encode(driving.commitment_words()))
    commits = {name: frozenset(tok.encode(driving.commitment_words(main))) for name, (_, main) in RULES.items()}
    target = checkpoint.load(os.path.join(a.run, "target")).eval()
    data = driving.Data("test", a.scenes, 0, tok)
    prompts = evaluate.scene_prompts(data.scenes, tok, "cpu", views=data.views_at(0))
    exact = evaluate.greedy_outputs(target, data)  # greedy: every lossless decode's; sampled: per draft, below
    result = {"scenes": a.scenes, "split": "test",
              "decoder": f"gamma {a.gamma}" if a.gamma else "tree {}/{}/{}".format(*astuple(decoder)),
              "seeds": seeds, "bounds": bounds, "commitment_words": driving.commitment_words(),
              "main_clause_words": driving.commitment_words(True),
              "threads": 1, "device": "cpu", "dtype": "fp32", "torch": torch.__version__, "records": [],
              "decoding": {"temperature": a.temperature, "top_p": a.top_p, "seed": base.seed}}
    t0 = time.time()
    for s in seeds:
        draft = checkpoint.load(checkpoint.draft_dir(a.run, "flat", s), target=target).eval()
        _, base_s = decode_all(target, None, prompts, decoder, base, tok.cot_end_id)  # target-only
        if not base.greedy:  # the lossless plan to price against: this draft's exact decode with the same draws
            exact = [r.tokens for r in decode_all(target, draft, prompts, decoder, base, tok.cot_end_id)[0]]
        for rule, (kind, _) in RULES.items():
            for b in bounds:
                res, sec = decode_all(target, draft, prompts, decoder,
                                      replace(base, relaxed=Relaxed(kind, b, commits[rule])), tok.cot_end_id)
                if b == 0 and [r.tokens for r in res] != [list(e) for e in exact]:
                    raise AssertionError(f"bound 0 ({rule}, seed {s}) is not the lossless output")
                rec = {"seed": s, "rule": rule, "bound": b,
                       **record(target, data, res, sec, exact, base_s)}
                if b == 0:
                    rec["rejections"] = rejections(res, commit)
                result["records"].append(rec)
                print(f"seed {s} {rule:8s} bound {b:<6} tau {rec['tau']:.2f} ade_vs_exact {rec['ade_vs_exact']:.3f} "
                      f"ade {rec['ade']:.3f} commit {rec['commitment_acc']:.3f} speedup {rec['speedup']:.2f} "
                      f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    if a.gamma:  # the chain's cost model (a tree's is bench.py's)
        reprice(result, target, a.run, a.gamma, data=data, tok=tok)
    result["summary"] = summary(result["records"], seeds)
    result["wall_s"] = time.time() - t0
    files.write_json(a.out, result)  # atomic
    print(f"wrote {a.out}", file=sys.stderr)
    try:
        plot(result, a.figure)
    except ImportError:
        print("matplotlib is not installed: no figure (pip install matplotlib, then --plot-only)", file=sys.stderr)


if __name__ == "__main__":
    main()
