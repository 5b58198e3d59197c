"""The FlatRoPE claim against the prompt's geometry: both drafts (replica M-RoPE and FlatRoPE), three seeds each,
distilled from the same target at several surround-view counts, and their held-out tau and attention split.

Paper: FlatRoPE helps because a shallow draft's attention is diluted by many redundant visual tokens, which M-RoPE
packs next to the text and a flat 1D index puts far from it (docs/background.md, "FlatRoPE"). The toy's target was
trained on every view count 0..21, so one target serves every point; the drafts are trained at each point as
train.py trains them (same steps, data and seeds; only the view count differs). The default geometry's drafts are
the run folder's own.

run: python experiments/views_sweep.py [--run checkpoints/toy] [--views 0,4,21] [--seeds 0,1,2]
     (writes experiments/views_sweep.json; python rsd.py --plot draws figures/views_sweep.png from it)
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ops import checkpoint  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import cli, files  # noqa: E402
import train as T  # noqa: E402
from driving import Data  # noqa: E402

KINDS = ("mrope", "flat")


def stats(values):
    return {"mean": statistics.mean(values), "spread": max(values) - min(values), "per_seed": values}


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="checkpoints/toy", help="folder with target/ and the default geometry's drafts")
    ap.add_argument("--work", default="runs/views_sweep", help="where the other geometries' drafts are trained")
    ap.add_argument("--views", default="0,4,16,21", help="surround-view counts (12 + 24 x views visual tokens)")
    ap.add_argument("--seeds", default="0,1,2", help="draft seeds")
    ap.add_argument("--scenes", type=int, default=64, help="val / held-out scenes per point")
    ap.add_argument("--gamma", type=int, default=evaluate.GAMMA, help="the draft length of the summary tau")
    ap.add_argument("--out", default="runs/views_sweep.json",  # git-ignored: never the committed JSON
                    help="the JSON (the README's: experiments/views_sweep.json)")
    a = cli.checked(ap, ap.parse_args(argv), counts=("scenes", "gamma"), lists=("views", "seeds"),
                    out="runs/views_sweep.json")
    cli.progress(f"views sweep: {len(a.views)} geometries x {len(a.seeds)} seeds")
    if a.views[-1] > driving.MAX_VIEWS:
        ap.error(f"--views: at most {driving.MAX_VIEWS} (the world's surround views), got {a.views[-1]}")
    views, seeds = a.views, a.seeds
    t0 = time.time()
    tok = driving.Tokenizer()
    target = checkpoint.load(os.path.join(a.run, "target")).eval()
    default = driving.WorldConfig().views
    points = []
    for v in views:
        folder = a.run if v == default else os.path.join(a.work, f"views{v}")
        for s in seeds:
            if not all(os.path.isdir(checkpoint.draft_dir(folder, k, s)) for k in KINDS):
                cfg = dataclasses.replace(T.TrainConfig(), out=folder, views=v, draft_seed=s)
                T.train_drafts(cfg, target, Data("train", cfg.n_train, cfg.seed, tok, views=v))
        drafts = {(k, s): checkpoint.load(checkpoint.draft_dir(folder, k, s), target=target).eval()
                  for k in KINDS for s in seeds}
        point = {"views": v, "visual_tokens": 12 + 24 * v}
        for split in ("val", "test"):
            data = Data(split, a.scenes, 0, tok, views=v)
            outputs = evaluate.greedy_outputs(target, data)
            matches = evaluate.draft_matches(drafts, target, data, outputs)
            for k in KINDS:
                taus = [evaluate.tau_by_gamma(matches[(k, s)], range(2, 9)) for s in seeds]
                p = point.setdefault(k, {})
                p[f"{split}_tau_by_gamma"] = {g: stats([t[g]["tau"] for t in taus]) for g in range(2, 9)}
                if split == "test":
                    p["tau"] = stats([t[a.gamma]["tau"] for t in taus])
                    attn = [evaluate.attention_split(drafts[(k, s)], target, data) for s in seeds]
                    for key in ("history", "image", "text"):
                        p[f"attn_{key}"] = stats([x[key] for x in attn])
        points.append(point)
        print(f"views {v:2d} ({point['visual_tokens']:3d} visual tokens): held-out tau at gamma {a.gamma}: "
              + "  ".join(f"{k} {point[k]['tau']['mean']:.2f} (spread {point[k]['tau']['spread']:.2f}), "
                          f"attention history {point[k]['attn_history']['mean']:.3f} image "
                          f"{point[k]['attn_image']['mean']:.3f}" for k in KINDS), flush=True)
    files.write_json(a.out, {"command": "python experiments/views_sweep.py " + " ".join(argv or sys.argv[1:]),
                                  "gamma": a.gamma, "seeds": seeds, "scenes": a.scenes, "points": points,
                                  "wall_s": time.time() - t0})
    print(f"wrote {a.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
