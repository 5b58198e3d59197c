"""Draft trees on the toy (issue: draft trees): held-out tau of real tree decoding against the tree's shape, for
every shipped draft, beside the chain; the shape chosen on the validation split by the measured cost model; the
tree verify's step time T_target(n) / T_target(1) for n up to 65.

Paper: the routine reasoner proposes, the deliberative reasoner verifies (speculate.py); a tree lets the draft
hedge where it is unsure (EAGLE-2's dynamic tree), and one target forward verifies every branch.

run: python experiments/tree_sweep.py [--scenes 64] [--out experiments/tree_sweep.json]
"""
import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import checkpoint  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
import speculate  # noqa: E402
from speculate import TreeShape  # noqa: E402

KINDS = {"replica": "mrope", "flatrope": "flat", "flatrope+aarl": "aarl"}
GRID = [TreeShape(n, d, k) for k in (2, 3, 4) for d in (4, 6, 8) for n in (8, 16, 32)
        if d <= n <= TreeShape(d, d, k).candidates(d)]
BUDGETS = (4, 8, 16, 24, 32, 48, 64)
CHAIN = (4, 5, 6, 7, 8)


def tau_of(target, draft, prompts, shape, stop):
    s = evaluate.spec_stats(target, {"d": draft}, prompts, shape, stop_token=stop, check_greedy=False)["d"]
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="checkpoints/toy")
    ap.add_argument("--scenes", type=int, default=64)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="experiments/tree_sweep.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    tok = driving.Tokenizer()
    stop = tok.cot_end_id
    target = checkpoint.load(os.path.join(a.run, "target")).eval()
    splits = {s: driving.Data(s, a.scenes, 0, tok) for s in ("val", "test")}
    prompts = {s: evaluate.scene_prompts(d.scenes, tok, "cpu", views=d.views_at(0)) for s, d in splits.items()}
    refs = {s: [speculate.autoregressive(target, p, evaluate.MAX_NEW_TOKENS, stop_token=stop).tokens for p in ps]
            for s, ps in prompts.items()}
    seeds = [int(s) for s in a.seeds.split(",")]
    drafts = {row: {s: checkpoint.load(checkpoint.draft_dir(a.run, kind, s), target=target).eval() for s in seeds}
              for row, kind in KINDS.items()}
    # step times: the chain's (forward) and the tree's (VLA.step under a mask), on the first val prompt
    d0 = drafts["flatrope"][seeds[0]]
    # CPU time of one thread (time.process_time): on a CPU shared with other work it counts a step's own cost
    chain_t = speculate.step_times(target, d0, prompts["val"][0], [1] + [g + 1 for g in CHAIN], timer=time.process_time)
    tree_t = {k: speculate.tree_step_times(target, d0, prompts["val"][0], sorted({*BUDGETS, 7, 15, 31}), k,
                                           timer=time.process_time) for k in (2, 3, 4)}
    t1, td = chain_t["target"][1], chain_t["draft"]

    def tree_sp(tau, sh):
        return speculate.tree_speedup(tau, t1, td, tree_t[sh.width]["draft_level"], tree_t[sh.width]["target"][sh.nodes],
                                      sh)

    out = {"scenes": a.scenes, "seeds": seeds, "threads": 1, "timer": "process_time",
           "step_ms": {"target_1": 1e3 * t1, "draft_1": 1e3 * td,
                       "chain_verify": {g: 1e3 * chain_t["target"][g + 1] for g in CHAIN},
                       "tree_verify": {n: 1e3 * v for n, v in tree_t[3]["target"].items()},
                       "draft_level": {k: 1e3 * v["draft_level"] for k, v in tree_t.items()}},
           "rows": {}}
    out["step_ms"]["verify_ratio"] = {n: v / out["step_ms"]["target_1"] for n, v in out["step_ms"]["tree_verify"].items()}
    print(json.dumps(out["step_ms"]), flush=True)
    for row, by_seed in drafts.items():
        first = by_seed[seeds[0]]
        # choose on val (first seed): the chain's gamma and the tree's shape with the best predicted speed-up
        val_chain = {g: tau_of(target, first, prompts["val"], g, stop)["tau"] for g in CHAIN}
        val_tree = {}
        for sh in GRID:
            val_tree[sh] = tau_of(target, first, prompts["val"], sh, stop)["tau"]
            print(row, "val", sh, f"{val_tree[sh]:.3f}", f"{time.time() - t0:.0f}s", flush=True)
        g = max(CHAIN, key=lambda g: speculate.measured_speedup(val_chain[g], t1, td, chain_t["target"][g + 1], g))
        best = max(GRID, key=lambda sh: tree_sp(val_tree[sh], sh))
        r = {"val_chain": val_chain, "val_tree": {str(sh): v for sh, v in val_tree.items()},
             "chain_gamma": g, "tree": [best.nodes, best.depth, best.width]}
        # held-out: every seed, the chosen chain and tree, and tau against the node budget at the chosen D, k
        test = {"chain": [], "tree": [], "budget": {n: [] for n in BUDGETS}, "greedy_match": True,
                "alpha_by_depth": []}
        for s, d in by_seed.items():
            c = tau_of(target, d, prompts["test"], g, stop)
            t = tau_of(target, d, prompts["test"], best, stop)
            test["chain"].append(c["tau"])
            test["tree"].append(t["tau"])
            test["greedy_match"] &= c["tokens"] == refs["test"] and t["tokens"] == refs["test"]
            for n in BUDGETS:
                D = min(best.depth, n)  # a budget below the depth cuts the depth to it
                sh = TreeShape(min(n, TreeShape(D, D, best.width).candidates(D)), D, best.width)
                test["budget"][n].append(tau_of(target, d, prompts["test"], sh, stop)["tau"])
            print(row, "seed", s, "chain", f"{c['tau']:.3f}", "tree", f"{t['tau']:.3f}", f"{time.time() - t0:.0f}s",
                  flush=True)
        for k in ("chain", "tree"):
            test[k + "_mean"], test[k + "_spread"] = statistics.mean(test[k]), max(test[k]) - min(test[k])
        test["budget_mean"] = {n: statistics.mean(v) for n, v in test["budget"].items()}
        test["predicted_speedup_chain"] = speculate.measured_speedup(test["chain_mean"], t1, td,
                                                                     chain_t["target"][g + 1], g)
        test["predicted_speedup_tree"] = tree_sp(test["tree_mean"], best)
        r["test"] = test
        out["rows"][row] = r
        print(row, json.dumps(test), flush=True)
    out["wall_s"] = time.time() - t0
    tmp = a.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
