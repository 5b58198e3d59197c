"""Decode speed of two checkouts of this repo in one process (before / after a change to the decode core), eager:
each checkout's modules imported in turn (the other's dropped from sys.modules), alternating, so both run on the same
process and the same moment of a shared CPU. Per arm (target-only, the chain at gamma 6, the default tree) on the
shipped toy, bf16, held-out scenes: the reasoning step alone (SpecResult.decode_s, the prefill excluded), the best of
3 passes in ms/token. Paper: the reasoning step's latency, which every speed-up claim divides by.

run: python experiments/decode_ab.py --a . --b ../old-checkout [--pairs 3]
     python experiments/decode_ab.py --a CHECKOUT --compile --pairs 1   (compiled: one checkout per process, the
     processes alternated by hand: dynamo's skip rules are per file path and process-wide, so two checkouts' trees
     cannot be compiled in one process)
     (eager: again with --a and --b swapped, the second checkout of each pair tends to measure faster on a shared
     CPU; experiments/decode_ab_stop41.json holds both orders, eager and compiled, for the one cached step)
"""
import argparse
import importlib
import json
import os
import sys

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout modules_of adds goes first
from ops import cli, files  # noqa: E402

PACKAGES = {"model", "rope", "vision", "speculate", "tree", "driving", "evaluate", "ops", "measure", "static", "bench",
            "real", "beyond", "relaxed", "aarl", "train", "rsd"}


def modules_of(repo):
    """The repo's modules, freshly imported (any other checkout's dropped first)."""
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]
    sys.path.insert(0, repo)
    try:
        timing = "measure.timing" if os.path.isdir(os.path.join(repo, "measure")) else "ops.timing"  # older: ops/
        m = {n: importlib.import_module(n) for n in ("ops.checkpoint", timing, "driving", "evaluate", "speculate",
                                                     "tree", "bench")}
        return m | {"timing": m[timing]}
    finally:
        sys.path.remove(repo)


def checkouts_args(name, argv, doc, flag, default, what):
    """The command line of an A/B tool over checkouts (step_ab, greedy_stage_ab): the checkouts and `flag`, how many
    alternations, checked before any import; the first line printed."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("repos", nargs="+", help="checkouts of this repo")
    ap.add_argument(flag, type=int, default=default, help=f"{what} over the checkouts, alternating")
    args = cli.checked(ap, ap.parse_args(argv), counts=(flag[2:],))
    check_checkouts(ap, args.repos)
    cli.progress(f"{name}: {getattr(args, flag[2:])} {what} over {', '.join(args.repos)}")
    return args


def check_checkouts(ap, repos):
    """Each checkout's shipped target weights a regular file, before any is imported: one line naming the checkout."""
    with cli.user_errors(ap):
        for repo in repos:
            files.check_regular(os.path.join(repo, "checkpoints", "toy", "target", "model.safetensors"),
                                f"{repo}: its checkpoints/toy/target/model.safetensors")


def ms_per_token(repo, scenes, compile=False):
    m = modules_of(repo)
    checkpoint, driving, evaluate, speculate, tree = (m[k] for k in ("ops.checkpoint", "driving", "evaluate",
                                                                     "speculate", "tree"))
    target = checkpoint.load(os.path.join(repo, "checkpoints/toy/target"), dtype=torch.bfloat16).eval()
    draft = checkpoint.load(os.path.join(repo, "checkpoints/toy/draft_aarl_s0"), target=target).eval()
    tok = driving.Tokenizer()
    prompts = evaluate.scene_prompts(driving.make_split("test", scenes, seed=0), tok, "cpu", torch.bfloat16,
                                     driving.WorldConfig().views)
    kw = dict(stop_token=tok.cot_end_id, timing=True)
    if compile:  # each checkout's CompiledSteps over its own caches (timing.compiled_pair: every step length once)
        pair = getattr(m["timing"], "compiled_pair", None) or m["bench"].compiled_pair  # bench.py's in older checkouts
        target, draft = pair(target, draft, prompts, [evaluate.GAMMA, evaluate.TREE], 64)
    tree_decode = getattr(tree, "speculative", speculate.speculative)  # older checkouts: a TreeShape through tree.py
    arms = {"target-only": lambda p: speculate.autoregressive(target, p, 64, **kw),
            "chain": lambda p: speculate.speculative(target, draft, p, evaluate.GAMMA, 64, **kw),
            "tree": lambda p: tree_decode(target, draft, p, evaluate.TREE, 64, **kw)}
    out = {}
    for name, decode in arms.items():
        decode(prompts[0])  # warm-up
        best = float("inf")
        for _ in range(3):
            res = [decode(p) for p in prompts]
            best = min(best, sum(r.decode_s for r in res) / sum(len(r.tokens) for r in res))
        out[name] = round(1e3 * best, 3)
    return out


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", default=".", help="one checkout (default: this one)")
    ap.add_argument("--b", help="the other checkout (eager only)")
    ap.add_argument("--pairs", type=int, default=3, help="alternations a, b")
    ap.add_argument("--scenes", type=int, default=6)
    ap.add_argument("--compile", action="store_true", help="each checkout's torch.compile'd steps (bench.py --compile)")
    args = cli.checked(ap, ap.parse_args(argv), counts=("pairs", "scenes"))
    if bool(args.b) == args.compile:
        ap.error("give --b (eager, two checkouts in one process) or --compile (one checkout per process)")
    check_checkouts(ap, [r for r in (args.a, args.b) if r])
    cli.progress(f"decode_ab: {args.pairs} pass(es) over {args.a}{f' and {args.b}' if args.b else ''}")
    torch.set_num_threads(2)
    for _ in range(args.pairs):
        for repo in (args.a, args.b) if args.b else (args.a,):
            print(json.dumps({"repo": os.path.abspath(repo), "compile": args.compile,
                              "ms_per_token": ms_per_token(os.path.abspath(repo), args.scenes, args.compile)}),
                  flush=True)


if __name__ == "__main__":
    main()
