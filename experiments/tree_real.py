"""The draft tree's cost at the real shape: T_target(n) / T_target(1) of the tree verify for n = 9, 17, 33, 65 and the
speed-up the cost model predicts at the toy's held-out tree tau, with the draft's full and reduced-vocabulary heads.

Paper: the deliberative reasoner verifies every branch of the routine reasoner's tree in one forward
(speculate.tree_round); whether that pays depends on what a wider verify costs. Measured on the qwen3-vl-8b preset
(bench.build_preset: random weights, bf16, the real width, heads and 151,936-token vocabulary) with 1 and 2 decoder
layers, CPU time of one thread, and extrapolated to 36 layers from the per-layer difference, as
experiments/draft_vocab.py --real does. A CPU's matmuls cost about n times more for n tokens; a GPU reads the same
weights for 1 or 64 tokens, so this is a CPU number, and bench.py --device cuda --preset qwen3-vl-8b measures the GPU's.

run: python experiments/tree_real.py [--out experiments/tree_real.json]   (about 3 min on one core)
"""
import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import bench  # noqa: E402
import model as M  # noqa: E402
import speculate  # noqa: E402

NODES = (8, 16, 32, 64)  # node budgets N of experiments/tree_sweep.py; the verify forward covers x_last + N tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-vl-8b")
    ap.add_argument("--prompt-len", type=int, default=128, help="text-only prompt tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--width", type=int, default=3, help="the tree's k (one level's draft forward covers k nodes)")
    ap.add_argument("--ks", default="32768,4096", help="reduced draft heads (first K ids)")
    ap.add_argument("--sweep", default="experiments/tree_sweep.json", help="the toy's held-out taus")
    ap.add_argument("--out", default="experiments/tree_real.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    g = torch.Generator().manual_seed(0)
    prompt = {"input_ids": torch.randint(1000, 100_000, (1, a.prompt_len), generator=g)}
    target_ms, draft_ms = {}, {}
    for layers in (1, 2):
        target, draft = bench.build_preset(a.preset, "cpu", torch.bfloat16, layers=layers)
        t1 = speculate.step_times(target, draft, prompt, (1, 7), a.reps, time.process_time)
        tt = speculate.tree_step_times(target, draft, prompt, NODES, a.width, a.reps, time.process_time)
        target_ms[layers] = {"1": 1e3 * t1["target"][1], "chain_7": 1e3 * t1["target"][7],
                             **{str(n + 1): 1e3 * v for n, v in tt["target"].items()}}
        print(layers, "layer(s):", json.dumps(target_ms[layers]), flush=True)
        if layers == 1:
            draft_ms["full"] = {"1": 1e3 * t1["draft"], "level": 1e3 * tt["draft_level"]}
            for k in map(int, a.ks.split(",")):
                d = M.make_draft(target, **M.DRAFT_PRESETS[f"{a.preset}-draft"], vocab_ids=torch.arange(k)).eval()
                s = speculate.step_times(target, d, prompt, (), a.reps, time.process_time)["draft"]
                lv = speculate.tree_step_times(target, d, prompt, (), a.width, a.reps, time.process_time)["draft_level"]
                draft_ms[f"k{k}"] = {"1": 1e3 * s, "level": 1e3 * lv}
                del d
            print("draft:", json.dumps(draft_ms), flush=True)
        del target, draft
        gc.collect()
    n_layers = M.PRESETS[a.preset].n_layers
    full = {key: target_ms[1][key] + (n_layers - 1) * (target_ms[2][key] - target_ms[1][key]) for key in target_ms[1]}
    out = {"preset": a.preset, "dtype": "bf16", "clock": "process CPU time, 1 thread", "prompt_tokens": a.prompt_len,
           "reps": a.reps, "width": a.width, "target_ms_by_layers": target_ms, "draft_ms": draft_ms,
           f"extrapolated_{n_layers}_layers_ms": full,
           "verify_ratio": {n: full[n] / full["1"] for n in full if n != "1"}}
    if os.path.exists(a.sweep):  # the toy's held-out tau (FlatRoPE, seed 0) at each node budget and the chain's
        sweep = json.load(open(a.sweep))["test"]["flatrope"]
        pred = {}
        for nodes in NODES:
            tau = sweep["tree"][str(nodes)]
            shape = speculate.TreeShape(nodes, 8, a.width)  # the sweep's trees: depth 8, width 3
            pred[f"tree_{nodes}"] = {head: speculate.tree_speedup(tau, full["1"], v["1"], v["level"],
                                                                  full[str(nodes + 1)], shape)
                                     for head, v in draft_ms.items()}
            pred[f"tree_{nodes}"]["tau"] = tau
        tau6 = sweep["chain"]["6"]
        pred["chain_6"] = {head: speculate.measured_speedup(tau6, full["1"], v["1"], full["chain_7"], 6)
                           for head, v in draft_ms.items()}
        pred["chain_6"]["tau"] = tau6
        out["predicted_speedup"] = pred
    out["wall_s"] = time.time() - t0
    print(json.dumps(out), flush=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
