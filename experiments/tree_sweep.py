"""Draft trees on the toy: tau of real tree decoding against the tree's width, depth and node budget (validation
split, the FlatRoPE draft), held-out tau against the node budget beside the chain for every draft kind (seed 0), and
the tree verify's step time T_target(n) / T_target(1) for n up to 64 (the figure data of docs/toy-notes.md; the
table's trees are chosen by rsd.py on val).

Paper: the routine reasoner proposes, the deliberative reasoner verifies (speculate.py); a tree lets the draft
hedge where it is unsure (EAGLE-2's dynamic tree), and one target forward verifies every branch.

run: python experiments/tree_sweep.py [--scenes 64] [--out experiments/tree_sweep.json]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from ops import checkpoint  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import cli, files  # noqa: E402
from measure.timing import step_times, tree_step_times  # noqa: E402
from tree import TreeShape  # noqa: E402

KINDS = {"replica": "mrope", "flatrope": "flat", "flatrope+aarl": "aarl"}
# the shapes compared on val with the FlatRoPE draft (seed 0): which width, depth and budget pay
GRID = [TreeShape(n, d, k) for k in (2, 3, 4) for d in (6, 8) for n in (16, 32) if n <= k + (d - 1) * k * k]
BUDGETS = (4, 8, 16, 32, 64)  # held-out tau against the node budget: depth min(8, N), width 3
CHAIN = (4, 6, 8)


def budget_shape(n, depth=8, width=3):
    d = min(depth, n)  # a budget below the depth cuts the depth to it
    return TreeShape(min(n, TreeShape(d, d, width).candidates(d)), d, width)


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="checkpoints/toy")
    ap.add_argument("--scenes", type=int, default=64)
    ap.add_argument("--out", default="runs/tree_sweep.json",  # git-ignored: never the committed JSON
                    help="the JSON (the README's: experiments/tree_sweep.json)")
    a = cli.checked(ap, ap.parse_args(argv), counts=("scenes",), lists=(),
                    out="runs/tree_sweep.json")
    cli.progress(f"tree sweep: {a.scenes} val and test scenes")
    torch.set_num_threads(1)
    t0 = time.time()
    tok = driving.Tokenizer()
    stop = tok.cot_end_id
    target = checkpoint.load(os.path.join(a.run, "target")).eval()
    splits = {s: driving.Data(s, a.scenes, 0, tok) for s in ("val", "test")}
    prompts = {s: evaluate.scene_prompts(d.scenes, tok, "cpu", views=d.views_at(0)) for s, d in splits.items()}
    drafts = {row: checkpoint.load(checkpoint.draft_dir(a.run, kind, 0), target=target).eval()
              for row, kind in KINDS.items()}
    # step times, CPU time of one thread (time.process_time): on a CPU shared with other work it counts a step's own
    # cost; the chain's verify is VLA.step under the causal mask, the tree's under the tree's
    d0 = drafts["flatrope"]
    chain_t = step_times(target, d0, prompts["val"][0], [1] + [g + 1 for g in CHAIN], timer=time.process_time)
    tree_t = tree_step_times(target, d0, prompts["val"][0], (7, 15, 31, 63), 3, timer=time.process_time)
    t1 = chain_t["target"][1]
    out = {"scenes": a.scenes, "draft_seed": 0, "threads": 1, "timer": "process_time",
           "step_ms": {"target_1": 1e3 * t1, "draft_1": 1e3 * chain_t["draft"],
                       "chain_verify": {g: 1e3 * chain_t["target"][g + 1] for g in CHAIN},
                       "tree_verify": {n + 1: 1e3 * v for n, v in tree_t["target"].items()},
                       "draft_level_3": 1e3 * tree_t["draft_level"]}}
    out["step_ms"]["tree_verify_ratio"] = {n: v / out["step_ms"]["target_1"]
                                           for n, v in out["step_ms"]["tree_verify"].items()}
    print(json.dumps(out["step_ms"]), flush=True)

    def tau(draft, split, shape):
        st = evaluate.spec_stats(target, {"d": draft}, prompts[split], shape, stop_token=stop, check_greedy=False)["d"]
        print(split, shape, f"tau {st['tau']:.3f}", f"{time.time() - t0:.0f}s", flush=True)
        return st["tau"]

    out["val_grid_flatrope"] = {f"{sh.nodes}/{sh.depth}/{sh.width}": tau(d0, "val", sh) for sh in GRID}
    out["test"] = {row: {"chain": {g: tau(d, "test", g) for g in CHAIN},
                         "tree": {n: tau(d, "test", budget_shape(n)) for n in BUDGETS}}
                   for row, d in drafts.items()}
    out["wall_s"] = time.time() - t0
    files.write_json(a.out, out)  # atomic


if __name__ == "__main__":
    main()
