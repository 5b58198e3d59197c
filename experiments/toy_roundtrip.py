"""The toy target through the path a real target takes: exported as a Hugging Face Qwen2.5-VL folder
(hf.export_pretrained), loaded back (hf.load_pretrained, through train.load_target), its own greedy CoCs on the toy
world's training scenes written by scenes.distill_data, and FlatRoPE drafts distilled on them by train.distill_draft
(`train.py --target DIR --toy-scenes N`), one sequence per forward with gradient accumulation. Paper: the routine
reasoner (draft q) is distilled from the deliberative reasoner (target p). The drafts are scored as the shipped ones
are (evaluate.draft_matches + evaluate.tau_by_gamma: the exact replay of greedy speculative decoding on the held-out
test scenes), the shipped FlatRoPE drafts beside them under the same scoring, and greedy speculative decoding with each
new draft is checked token for token against target-only decoding of the loaded-back target.

Same budget as the shipped drafts (train.py's defaults): 300 updates of 16 sequences, lr 3e-3, 20 warm-up steps;
4,800 training scenes, one pass (the shipped drafts draw 4,800 of their 32,000). What differs: the CoCs are the
target's own greedy ones, not the world's ground truth, and the draft's initialisation seed.

run: python experiments/toy_roundtrip.py [--seeds 0,1,2] [--n-train 4800] [--work runs/toy_roundtrip]
     (writes experiments/toy_roundtrip.json)
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
import files  # noqa: E402
import hf  # noqa: E402
import speculate  # noqa: E402
import train as T  # noqa: E402
from driving import Data  # noqa: E402


def test_tau(target, drafts, data, outputs, gamma):
    """{name: held-out tau at gamma} by the exact replay (the learning-speed probe's scoring)."""
    matches = evaluate.draft_matches(drafts, target, data, outputs)
    return {k: evaluate.tau_by_gamma(matches[k], [gamma])[gamma]["tau"] for k in drafts}


def greedy_identical(target, draft, data, n, gamma):
    """Scenes (of the first n test scenes) whose greedy speculative output equals target-only greedy decoding."""
    same = 0
    for scene in data.scenes[:n]:
        prompt = driving.build_prompt(scene, data.tok, data.views)
        ar = speculate.autoregressive(target, prompt, evaluate.MAX_NEW_TOKENS, stop_token=data.tok.cot_end_id)
        spec = speculate.speculative(target, draft, prompt, gamma, evaluate.MAX_NEW_TOKENS,
                                     stop_token=data.tok.cot_end_id)
        same += spec.tokens == ar.tokens
    return same


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="checkpoints/toy", help="the shipped target and drafts")
    ap.add_argument("--work", default="runs/toy_roundtrip", help="the exported folder, the data and the drafts")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--n-train", type=int, default=4800)
    ap.add_argument("--n-test", type=int, default=256)
    ap.add_argument("--steps", type=int, default=T.DraftConfig.steps, help="draft updates (train.py's 300)")
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--identity-scenes", type=int, default=32)
    ap.add_argument("--out", default="experiments/toy_roundtrip.json")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.time()
    ours = checkpoint.load(os.path.join(args.run, "target")).eval()
    folder = os.path.join(args.work, "hf_target")
    if not os.path.exists(os.path.join(folder, hf.CONFIG)):
        hf.export_pretrained(ours, folder)
    loaded = T.load_target(folder).eval()
    tok = driving.Tokenizer()
    test = Data("test", args.n_test, 0, tok)
    outputs = evaluate.greedy_outputs(loaded, test)
    same_target = sum(a == b for a, b in zip(outputs, evaluate.greedy_outputs(ours, test)))
    print(f"loaded-back target: greedy CoC equal to the original's on {same_target} / {len(outputs)} test scenes")
    shipped = {f"shipped_s{s}": checkpoint.load(checkpoint.draft_dir(args.run, "flat", s), target=ours).eval()
               for s in (0, 1, 2)}
    shipped_tau = test_tau(ours, shipped, test, evaluate.greedy_outputs(ours, test), args.gamma)
    runs = {}
    for seed in seeds:
        cfg = dataclasses.replace(T.DraftConfig(), target=folder, toy_scenes=args.n_train, out=args.work, seed=seed,
                                  steps=args.steps, max_new=evaluate.MAX_NEW_TOKENS)
        t = time.time()
        res = T.run_draft(cfg)
        draft = res["draft"].eval()
        runs[seed] = {"test_tau": test_tau(loaded, {"flat": draft}, test, outputs, args.gamma)["flat"],
                      "greedy_identical": greedy_identical(loaded, draft, test, args.identity_scenes, args.gamma),
                      "wall_s": time.time() - t}
        print(f"seed {seed}: test tau {runs[seed]['test_tau']:.3f}, greedy identical on "
              f"{runs[seed]['greedy_identical']} / {args.identity_scenes} scenes, {runs[seed]['wall_s']:.0f} s",
              flush=True)
    data = files.read_json(os.path.join(args.work, "data", "part0", "index.json"))  # one process: one part
    new, old = [r["test_tau"] for r in runs.values()], list(shipped_tau.values())
    result = {"settings": vars(args), "loaded_target_greedy_equal": [same_target, len(outputs)],
              "data": {"records": sum(len(s["records"]) for s in data["shards"]),
                       "complete": sum(r["complete"] for s in data["shards"] for r in s["records"]),
                       "prefill_s": data["prefill_s"], "decode_s": data["decode_s"]},
              "shipped_flat_test_tau": shipped_tau, "roundtrip": runs,
              "summary": {"roundtrip_mean": statistics.mean(new), "roundtrip_range": [min(new), max(new)],
                          "shipped_mean": statistics.mean(old), "shipped_range": [min(old), max(old)]},
              "wall_s": time.time() - t0, "environment": {"torch": torch.__version__,
                                                          "threads": torch.get_num_threads()}}
    files.write_json(args.out, result)
    print(f"held-out tau at gamma {args.gamma}: round trip {statistics.mean(new):.3f} (range {min(new):.3f}.."
          f"{max(new):.3f}), shipped FlatRoPE {statistics.mean(old):.3f} (range {min(old):.3f}..{max(old):.3f})")


if __name__ == "__main__":
    main()
