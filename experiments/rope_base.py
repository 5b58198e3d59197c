"""The drafts' RoPE base: the toy's base of 1e4 against Qwen2.5-VL's 1e6, both drafts (replica M-RoPE and FlatRoPE)
distilled from the same target at the default geometry, three seeds each; held-out tau and attention split.

Paper: FlatRoPE (the routine reasoner's 1D positions) against the target's M-RoPE; the RoPE base sets how far apart
two positions must be before the two schemes differ.

Why it is a question: a base sets the distances at which positions matter. Qwen2.5-VL pairs 1e6 with a 32k context;
over the few hundred positions of the toy's prompt most frequency pairs of a 1e6 base barely rotate, so a flat and a
3D position scheme look almost alike to the draft (docs/background.md, "FlatRoPE"). The target keeps its base (1e4);
only the drafts' changes.

run: python experiments/rope_base.py [--run checkpoints/toy]   (writes experiments/rope_base.json)
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ops import checkpoint  # noqa: E402
from ops import cli, files  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
import model as M  # noqa: E402
import train as T  # noqa: E402
from driving import Data  # noqa: E402

KINDS = ("mrope", "flat")


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="checkpoints/toy", help="folder with target/ and the base-1e4 drafts")
    ap.add_argument("--work", default="runs/rope_base", help="where the base-1e6 drafts are trained")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--scenes", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=evaluate.GAMMA)
    ap.add_argument("--out", default="runs/rope_base.json",  # git-ignored: never the committed JSON
                    help="the JSON (the README's: experiments/rope_base.json)")
    a = cli.checked(ap, ap.parse_args(argv), counts=("scenes", "gamma"), lists=("seeds",),
                    out="runs/rope_base.json")
    cli.progress(f"rope base: {len(a.seeds)} seeds")
    seeds = a.seeds
    t0 = time.time()
    tok = driving.Tokenizer()
    target = checkpoint.load(os.path.join(a.run, "target")).eval()
    M.DRAFT_PRESETS["toy-draft-base1e6"] = dict(n_layers=1, rope_theta=1e6)
    for s in seeds:
        if not all(os.path.isdir(checkpoint.draft_dir(a.work, k, s)) for k in KINDS):
            cfg = dataclasses.replace(T.TrainConfig(), out=a.work, draft_seed=s, draft_preset="toy-draft-base1e6")
            T.train_drafts(cfg, target, Data("train", cfg.n_train, cfg.seed, tok, views=cfg.views))
    data = Data("test", a.scenes, 0, tok)
    outputs = evaluate.greedy_outputs(target, data)
    drafts = {(base, k, s): checkpoint.load(checkpoint.draft_dir(folder, k, s), target=target).eval()
              for base, folder in (("1e4", a.run), ("1e6", a.work)) for k in KINDS for s in seeds}
    matches = evaluate.draft_matches(drafts, target, data, outputs)
    result = {}
    for base in ("1e4", "1e6"):
        for k in KINDS:
            taus = [evaluate.tau_by_gamma(matches[(base, k, s)], [a.gamma])[a.gamma]["tau"] for s in seeds]
            attn = [evaluate.attention_split(drafts[(base, k, s)], target, data) for s in seeds]
            result[f"{base}/{k}"] = {"tau": taus, "tau_mean": statistics.mean(taus), "tau_spread": max(taus) - min(taus),
                                     **{f"attn_{x}": statistics.mean(t[x] for t in attn) for x in ("history", "image")}}
    for name, r in result.items():
        print(f"base {name.replace('/', ' '):9s}: held-out tau at gamma {a.gamma} {r['tau_mean']:.3f} (spread "
              f"{r['tau_spread']:.3f})  attention history {r['attn_history']:.3f} image {r['attn_image']:.3f}")
    wall = time.time() - t0
    command = "python experiments/rope_base.py " + " ".join(argv or sys.argv[1:])
    files.write_json(a.out, dict(command=command, gamma=a.gamma, seeds=seeds, scenes=a.scenes, result=result,
                                      wall_s=wall))
    print(f"wrote {a.out} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
