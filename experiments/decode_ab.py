"""Eager decode speed of one checkout of this repo, to compare two versions (before / after a change to the decode
core): target-only, the chain (gamma 6) and the default tree (32/8/3) on the shipped toy, bf16, 8 held-out scenes;
per arm the reasoning step alone (SpecResult.decode_s: the prefill excluded), the best of 5 passes in ms/token, the
least disturbed pass on a shared CPU (where the wall clock moves by up to a quarter from one process to the next:
alternate the two checkouts and compare several runs).

run: python experiments/decode_ab.py --repo .            (then with --repo at the other checkout, alternating)
"""
import argparse
import json
import os
import sys

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--repo", default=".", help="the checkout whose code is timed (its checkpoints/toy too)")
ap.add_argument("--scenes", type=int, default=8)
a = ap.parse_args()
sys.path.insert(0, os.path.abspath(a.repo))
os.chdir(a.repo)

import torch  # noqa: E402

import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import checkpoint  # noqa: E402
import speculate  # noqa: E402
import tree  # noqa: E402

torch.set_num_threads(2)
target = checkpoint.load("checkpoints/toy/target", dtype=torch.bfloat16).eval()
draft = checkpoint.load("checkpoints/toy/draft_aarl_s0", target=target).eval()
tok = driving.Tokenizer()
prompts = evaluate.scene_prompts(driving.make_split("test", a.scenes, seed=0), tok, "cpu", torch.bfloat16,
                                 driving.WorldConfig().views)
stop = tok.cot_end_id
arms = {"target-only": lambda p: speculate.autoregressive(target, p, 64, stop_token=stop, timing=True),
        "chain": lambda p: speculate.speculative(target, draft, p, evaluate.GAMMA, 64, stop_token=stop, timing=True),
        "tree": lambda p: tree.speculative(target, draft, p, evaluate.TREE, 64, stop_token=stop, timing=True)}
out = {}
for name, decode in arms.items():
    decode(prompts[0])  # warm-up
    best = float("inf")
    for _ in range(5):
        res = [decode(p) for p in prompts]
        best = min(best, sum(r.decode_s for r in res) / sum(len(r.tokens) for r in res))
    out[name] = round(1e3 * best, 3)
print(json.dumps({"repo": os.path.abspath("."), "ms_per_token": out}))
