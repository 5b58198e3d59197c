"""The toy target through the path a real target takes: exported as a Hugging Face Qwen2.5-VL folder
(hf_export.py), loaded back (hf.load_pretrained, through distill.load_target), its own greedy CoCs on the toy
world's training scenes written by scenes.distill_data, and FlatRoPE drafts distilled on them by distill.distill_draft
(`python -m real.distill --target DIR --toy-scenes N`), one sequence per forward with gradient accumulation. Paper: the routine
reasoner (draft q) is distilled from the deliberative reasoner (target p). The drafts are scored as the shipped ones
are (evaluate.draft_matches + evaluate.tau_by_gamma: the exact replay of greedy speculative decoding on the held-out
test scenes), the shipped FlatRoPE drafts beside them under the same scoring, and greedy speculative decoding with each
new draft is measured by bench.py --scenes' own function (alpamayo.heldout: real speculative decoding of the first 64
test scenes against target-only decoding of the loaded-back target, token for token).

Same budget as the shipped drafts (train.py's defaults): 300 updates of 16 sequences, lr 3e-3, 20 warm-up steps;
4,800 training scenes, one pass (the shipped drafts draw 4,800 of their 32,000). What differs: the CoCs are the
target's own greedy ones, not the world's ground truth, and the draft's initialisation seed.

run: python experiments/toy_roundtrip.py [--seeds 0,1,2] [--n-train 4800] [--work runs/toy_roundtrip]
     (writes experiments/toy_roundtrip.json; drafts already in --work are scored again, not retrained)
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from real import alpamayo  # noqa: E402
from ops import checkpoint  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import cli, files  # noqa: E402
from real import hf  # noqa: E402
from real import distill  # noqa: E402
from driving import Data  # noqa: E402
from hf_export import export_pretrained  # noqa: E402


def test_tau(target, drafts, data, outputs, gamma):
    """{name: held-out tau at gamma} by the exact replay (the learning-speed probe's scoring)."""
    matches = evaluate.draft_matches(drafts, target, data, outputs)
    return {k: evaluate.tau_by_gamma(matches[k], [gamma])[gamma]["tau"] for k in drafts}


def heldout(target, draft, data, n, gamma):
    """bench.py --scenes' measurement (alpamayo.heldout), the real target's evaluation path, on the first n test
    scenes: real speculative decoding against target-only decoding, tau, routine share and greedy identity."""
    scenes_ = [SimpleNamespace(past=None, future=None)] * n  # the toy target has no action expert: no poses read
    prompts = [(f"test{i}", driving.build_prompt(s, data.tok, data.views)) for i, s in enumerate(data.scenes[:n])]
    res = alpamayo.heldout(target, draft, scenes_, prompts, data.tok.cot_end_id, evaluate.MAX_NEW_TOKENS, gamma,
                           repeats=1)
    return {k: res[k] for k in ("scenes", "identical", "tau", "alpha", "alpha_by_position", "routine_share")}


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="checkpoints/toy", help="the shipped target and drafts")
    ap.add_argument("--work", default="runs/toy_roundtrip", help="the exported folder, the data and the drafts")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--n-train", type=int, default=4800)
    ap.add_argument("--n-test", type=int, default=256)
    ap.add_argument("--steps", type=int, default=distill.DraftConfig.steps, help="draft updates (train.py's 300)")
    ap.add_argument("--gamma", type=int, default=6)
    ap.add_argument("--identity-scenes", type=int, default=64, help="test scenes decoded by alpamayo.heldout")
    ap.add_argument("--out", default="runs/toy_roundtrip.json",  # git-ignored: never the committed JSON
                    help="the JSON (the README's: experiments/toy_roundtrip.json)")
    args = cli.checked(ap, ap.parse_args(argv), counts=("n_train", "n_test", "steps", "gamma", "identity_scenes"),
                       lists=("seeds",), out="runs/toy_roundtrip.json")
    cli.progress(f"toy round trip: export, data, {len(args.seeds)} drafts")
    seeds = args.seeds
    t0 = time.time()
    ours = checkpoint.load(os.path.join(args.run, "target")).eval()
    folder = os.path.join(args.work, "hf_target")
    if not os.path.exists(os.path.join(folder, hf.CONFIG)):
        export_pretrained(ours, folder)
    loaded = distill.load_target(folder).eval()
    tok = driving.Tokenizer()
    test = Data("test", args.n_test, 0, tok)
    outputs = evaluate.greedy_outputs(loaded, test)
    same_target = sum(a == b for a, b in zip(outputs, evaluate.greedy_outputs(ours, test)))
    print(f"loaded-back target: greedy CoC equal to the original's on {same_target} / {len(outputs)} test scenes")
    shipped = {f"shipped_s{s}": checkpoint.load(checkpoint.draft_dir(args.run, "flat", s), target=ours).eval()
               for s in (0, 1, 2)}
    shipped_tau = test_tau(ours, shipped, test, evaluate.greedy_outputs(ours, test), args.gamma)
    runs, before = {}, files.read_json(args.out) if os.path.exists(args.out) else {"roundtrip": {}}
    for seed in seeds:
        cfg = dataclasses.replace(distill.DraftConfig(), target=folder, toy_scenes=args.n_train, out=args.work, seed=seed,
                                  steps=args.steps, max_new=evaluate.MAX_NEW_TOKENS)
        t, path = time.time(), checkpoint.draft_dir(args.work, "flat", seed)
        if checkpoint.existing_kind(path) is None:  # else trained by an earlier run of this script: scored again
            distill.run_draft(cfg)
            wall = time.time() - t
        else:
            old = before["roundtrip"].get(str(seed), {})
            wall = old.get("train_wall_s", old.get("wall_s"))
        draft = checkpoint.load(path, target=loaded).eval()
        runs[seed] = {"test_tau": test_tau(loaded, {"flat": draft}, test, outputs, args.gamma)["flat"],
                      "heldout": heldout(loaded, draft, test, args.identity_scenes, args.gamma), "train_wall_s": wall}
        h = runs[seed]["heldout"]
        print(f"seed {seed}: test tau {runs[seed]['test_tau']:.3f} (replay, {len(outputs)} scenes); alpamayo.heldout "
              f"on {h['scenes']} scenes: tau {h['tau']:.3f}, greedy identical on {h['identical']}", flush=True)
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
