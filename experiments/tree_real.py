"""The draft tree's cost at the real shape: T_target(n) / T_target(1) of the tree verify for n = 9, 17, 33, 65 tokens
(x_last + 8 / 16 / 32 / 64 nodes) and the speed-up the cost model predicts at the toy's held-out tree tau, with the
draft's full and reduced-vocabulary heads.

Paper: the deliberative reasoner verifies every branch of the routine reasoner's tree in one forward
(tree.tree_round); whether that pays depends on what a wider verify costs. Measured on the qwen3-vl-8b shape
(random weights, bf16, the real width, heads and 151,936-token vocabulary), CPU time of one thread, by parts: one
decoder layer's cached step over n tokens under a tree-shaped mask (model.Block with input_pos, the step VLA.step runs
per layer) on a cache holding a 128-token prompt, and the LM head over n rows (full, or K rows for a reduced draft
head). A step is then n_layers x layer + head: T_target(n) = 36 T_layer(n) + T_head(n), T_draft(1) = T_layer(1) +
T_head(1), one tree level T_draft(k) = T_layer(k) + T_head(k). Timing the parts directly avoids extrapolating from
the difference of two whole-model timings, which a memory-bound step on a shared CPU makes noisy. A CPU's matmuls cost
about n times more for n tokens once compute-bound; a GPU reads the same weights for 1 or 64 tokens, so this is a CPU
number; bench.py preset qwen3-vl-8b --device cuda and experiments/gpu_check.py measure the GPU's.

run: python experiments/tree_real.py [--out experiments/tree_real.json]   (about 2 min on one core)
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ops import cli, files  # noqa: E402
import model as M  # noqa: E402
from rope import rope_cos_sin, rope_inv_freq  # noqa: E402
from measure.timing import median_time  # noqa: E402
from evaluate import measured_speedup  # noqa: E402
from evaluate import tree_speedup  # noqa: E402
from tree import TreeShape  # noqa: E402

NODES = (8, 16, 32, 64)  # node budgets N of experiments/tree_sweep.py; the verify covers x_last + N tokens
WIDTH = 3  # the tree's k: one draft level covers k nodes


@torch.no_grad()
def layer_ms(cfg, n, prompt_len, reps):
    """CPU ms of one decoder layer's cached step over n new tokens (B = 1) on a cache of prompt_len tokens."""
    block = M.Block(cfg).to(torch.bfloat16).eval()
    cache = M.KVCache(1, 1, cfg.n_kv_heads, prompt_len + n, cfg.head_dim, torch.bfloat16)
    cache.k[0].normal_(), cache.v[0].normal_()  # (1, Hk, S, hd): key values do not change the time
    x = torch.randn(1, n, cfg.hidden_size, dtype=torch.bfloat16)  # (1, n, D)
    pos = torch.arange(prompt_len, prompt_len + n)[None]  # (1, n) the new tokens' slots
    cos, sin = (t.to(torch.bfloat16).unsqueeze(2) for t in rope_cos_sin(pos, rope_inv_freq(cfg.head_dim,
                                                                                          cfg.rope_theta)))
    mask = M.grouped_mask(torch.arange(prompt_len + n) <= pos[..., None], cfg.n_heads // cfg.n_kv_heads,
                          torch.bfloat16)
    return 1e3 * median_time(lambda: block(x, cos, sin, cache, 0, mask, pos), "cpu", reps, time.process_time)


@torch.no_grad()
def head_ms(cfg, n, rows, reps):
    """CPU ms of the LM head over n hidden states with `rows` output rows (the vocabulary, or a reduced head's K)."""
    w = torch.randn(rows, cfg.hidden_size, dtype=torch.bfloat16) * 0.02  # (K, D)
    h = torch.randn(1, n, cfg.hidden_size, dtype=torch.bfloat16)  # (1, n, D)
    return 1e3 * median_time(lambda: F.linear(h, w), "cpu", reps, time.process_time)


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-vl-8b")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens already in the cache")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ks", default="32768,4096", help="reduced draft heads: K rows")
    ap.add_argument("--sweep", default="experiments/tree_sweep.json", help="the toy's held-out taus")
    ap.add_argument("--out", default="runs/tree_real.json",  # git-ignored: never the committed JSON
                    help="the JSON (the README's: experiments/tree_real.json)")
    a = ap.parse_args(argv)
    a = cli.checked(ap, a, counts=("prompt_len", "reps"), lists=("ks",), out="runs/tree_real.json", inputs=[a.sweep])
    if os.path.lexists(a.sweep):  # read after minutes of timing: a FIFO or a folder is refused now
        with cli.user_errors(ap):
            files.check_regular(a.sweep, f"--sweep {a.sweep}")
    cli.progress(f"tree_real: step times of {a.preset}'s layer and heads")
    torch.set_num_threads(1)
    t0 = time.time()
    cfg = M.PRESETS[a.preset]
    ns = sorted({1, 7, WIDTH, *(n + 1 for n in NODES)})  # 1-token step, the chain's gamma 6 verify, a level, verifies
    layer = {n: layer_ms(cfg, n, a.prompt_len, a.reps) for n in ns}
    print("layer ms:", json.dumps(layer), flush=True)
    heads = {"full": cfg.vocab_size, **{f"k{k}": int(k) for k in a.ks}}
    head = {name: {n: head_ms(cfg, n, rows, a.reps) for n in ns} for name, rows in heads.items()}
    print("head ms:", json.dumps(head), flush=True)
    L = cfg.n_layers
    target = {n: L * layer[n] + head["full"][n] for n in ns}  # T_target(n), ms
    draft = {name: {"1": layer[1] + h[1], "level": layer[WIDTH] + h[WIDTH]} for name, h in head.items()}
    out = {"preset": a.preset, "dtype": "bf16", "clock": "process CPU time, 1 thread", "prompt_tokens": a.prompt_len,
           "reps": a.reps, "width": WIDTH, "layer_ms": layer, "head_ms": head, f"t_target_{L}_layers_ms": target,
           "t_draft_ms": draft, "verify_ratio": {n: target[n] / target[1] for n in ns if n > 1}}
    if os.path.exists(a.sweep):  # the toy's held-out tau (FlatRoPE, seed 0) at each node budget, and the chain's
        sweep = files.read_json(a.sweep)["test"]["flatrope"]
        pred = {}
        for nodes in NODES:
            tau, shape = sweep["tree"][str(nodes)], TreeShape(nodes, 8, WIDTH)  # the sweep's trees
            pred[f"tree_{nodes}"] = {"tau": tau, **{name: tree_speedup(
                tau, target[1], d["1"], d["level"], target[nodes + 1], shape) for name, d in draft.items()}}
        tau6 = sweep["chain"]["6"]
        pred["chain_6"] = {"tau": tau6, **{name: measured_speedup(tau6, target[1], d["1"], target[7], 6)
                                           for name, d in draft.items()}}
        out["predicted_speedup"] = pred
    out["wall_s"] = time.time() - t0
    print(json.dumps(out), flush=True)
    files.write_json(a.out, out)  # atomic


if __name__ == "__main__":
    main()
