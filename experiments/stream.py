"""Plans in a stream (beyond the paper; beyond/stream.py): tau and speed-up when each frame's chain of causation is
drafted from the frame before, on held-out toy clips (driving.make_clips), against the per-frame event rate and the
replanning interval.

Four arms, timed interleaved in one process (measure.timing.interleaved; an item is a clip, decoded frame by frame, each
arm's stream reading the plan that arm wrote one frame before): target-only; tree, the single-frame default tree
(evaluate.TREE, FlatRoPE draft seed 0); stream, the earlier plan alone (no draft model); tree+stream, both merged as a
trie. Greedy, fp32, eager: every arm's every plan is compared with target-only's, token for token.
Settings: interval 0.5 s at event rates 0, driving.event_rate(0.5) (the default), 0.2, 0.5 and 1 (every frame a new
scene), and 0.1 s at its default rate; at the default and at rate 1 the drafts of seeds 1 and 2 give the seed spread
of tau (untimed). ms/token: the decode (prefills excluded) over every frame's tokens; the speed-up's range is over 8
blocks of clips, each block's arms timed back to back.

run: python experiments/stream.py [--out runs/stream.json] [--figure runs/stream.png]
     (the README's: --out experiments/stream_steady.json --figure docs/figures/stream_steady.png)
"""
import argparse
import functools
import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from beyond import stream  # noqa: E402
from beyond.stream import ARMS, decode_clip  # noqa: E402
import driving  # noqa: E402
import numpy as np  # noqa: E402
import evaluate  # noqa: E402
from ops import checkpoint, cli, files  # noqa: E402
from measure import choose as chooser, flags, timing  # noqa: E402
from speculate import GREEDY, SpecResult  # noqa: E402

def setting(target, drafts, tok, n, frames, interval, rate, blocks, spread, samples=1, sampling=GREEDY, clip_seed=0,
            compile=False, split="test", shape=evaluate.TREE, merged=None, reword=None, **stream_kw):
    """One (interval, rate): the four arms timed on n held-out clips (measure.timing.stream_arms), each frame's plan
    `samples` rows under `sampling`; drafts[1:] (the other seeds) decode the same clips for tau only. stream_kw: the
    lookup's settings (Stream's M, alpha, ...); split: "val" to choose on; shape: the tree arm's tree; merged:
    tree+stream's tree (None: shape); reword: the rewording rate r of the earlier plans (beyond/stream.reword; None:
    none)."""
    clips = [evaluate.scene_prompts(c, tok, "cpu")
             for c in driving.make_clips(split, n, frames, interval, rate, seed=clip_seed)]
    stop, kw = tok.cot_end_id, dict(samples=samples, sampling=sampling, merged=merged, **stream_kw)
    rng = (lambda i: functools.partial(stream.reword, r=reword, rng=np.random.default_rng([clip_seed, 7, i]), tok=tok)
           ) if reword is not None else None  # clip i's rewording, its own generator
    arms, res = timing.stream_arms(target, drafts[0], clips, shape, evaluate.MAX_NEW_TOKENS, stop, 1, blocks,
                                   compile=compile, reword=rng, **kw)
    rows = (lambda f: f) if samples > 1 else (lambda f: [f])
    ref = [[[r.tokens for r in rows(f)] for f in clip] for clip in res["target-only"]]  # [clip][frame][row]
    out = {"interval_s": interval, "event_rate": rate, **({} if reword is None else {"reword": reword}), "clips": n,
           "frames": frames, "samples": samples,
           "coc_changed": sum(a != b for c in ref for a, b in zip(c, c[1:])) / (n * (frames - 1)), **arms}
    for a in ("tree", "tree+stream") if spread else ():  # tau of the other seeds' drafts, the same clips, untimed
        out[a]["tau_by_seed"] = [out[a]["tau"]] + [SpecResult.pooled([r for c in clips for f in decode_clip(
            target, d, c, a, shape, evaluate.MAX_NEW_TOKENS, stop, **kw) for r in rows(f)]).tau
            for d in drafts[1:]]
    return out


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default=checkpoint.SHIPPED, help="the toy's run folder (target, draft_flat_s0..s2)")
    ap.add_argument("--clips", type=int, default=64, help="held-out clips of the claims' settings (0.5 s at the default "
                    "rate and at rate 1)")
    ap.add_argument("--sweep-clips", type=int, default=16, help="held-out clips of every other setting")
    ap.add_argument("--frames", type=int, default=10, help="frames per clip (>= 2)")
    ap.add_argument("--rates", default="0,default,0.2,0.5,1",
                    help="per-frame event rates at 0.5 s, comma-separated ('default': driving.event_rate(0.5))")
    # the lookup's settings (beyond/stream.py's defaults); the first stream, README's experiments/stream.json, ran
    # --M 16 --alpha 4 --swap 0 --skip - --steady 0
    ap.add_argument("--M", type=int, default=stream.M, help="the stream's most nodes a round")
    ap.add_argument("--alpha", type=int, default=None, help="tokens proposed per matched token (default: the module's, "
                    f"{stream.ALPHA}, or {stream.SAMPLED_ALPHA} for sampled rows)")
    ap.add_argument("--swap", type=int, choices=(0, 1), default=int(stream.SWAP), help="1: a match may step over one "
                    "differing token")
    ap.add_argument("--skip", default="-" if stream.SKIP is None else str(stream.SKIP), help="a steady round whose "
                    "proposals all reach this many tokens runs no model tree ('-': never)")
    ap.add_argument("--steady", type=int, choices=(0, 1), default=int(stream.STEADY), help="1: read the two plans "
                    "before (steady rows); 0: the one plan before")
    ap.add_argument("--samples", type=int, default=1, help="rows a frame's plan samples (Alpamayo-R1: 6; with "
                    "--temperature), decoded as one batch; the stream reads the frames before's rows and the siblings'")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (one row a frame)")
    ap.add_argument("--top-p", type=float, default=None, help="nucleus sampling (Alpamayo-R1: 0.98)")
    ap.add_argument("--clip-seed", type=int, default=0, help="the held-out clips' generator seed (a claim measured "
                    "once spends its clips: the next one draws a new seed)")
    ap.add_argument("--tree", default=None, help="N/D/k: the tree arm's tree (default: the chooser's for one frame's "
                    "plan on this machine, measure.choose on val scenes, eager; with --compile "
                    f"{chooser.shape_key(evaluate.TREE)}, evaluate.TREE)")
    ap.add_argument("--merged", default=None, help="N/D/k: the tree merged with the stream (default: the tree arm's)")
    ap.add_argument("--reword", default=None, help="rewording rates r in [0, 1], comma-separated: the default setting "
                    "at each r on --sweep-clips clips, its earlier plans reworded (beyond/stream.reword), instead of the "
                    "settings")
    ap.add_argument("--split", choices=("test", "val"), default="test", help="the clips' split (val: to choose on)")
    ap.add_argument("--compile", action="store_true", help="every arm on compiled steps (ops/compiled.py), the "
                    "stream's width padded to a few sizes")
    ap.add_argument("--seeds", type=int, default=3, help="draft seeds (seed 0 timed, the rest for the tau spread)")
    ap.add_argument("--out", default="runs/stream.json", help="the JSON written")
    ap.add_argument("--figure", default=None, help="also draw the figure here (needs matplotlib)")
    only = ap.add_mutually_exclusive_group()  # one setting alone: two of them would silently keep the first
    only.add_argument("--default-only", action="store_true", help="the default setting alone (0.5 s, the default rate): "
                    "its timing again on a quiet machine")
    only.add_argument("--rate1-only", action="store_true", help="0.5 s at event rate 1 alone (nothing to reuse: what "
                    "the stream costs)")
    ap.add_argument("--replot", action="store_true", help="draw --figure from the --out JSON already written, no run")
    a = cli.checked(ap, ap.parse_args(argv), counts=("clips", "sweep_clips", "seeds"), out="runs/stream.json",
                    program="experiments/stream.py")
    if a.replot:
        with cli.user_errors(ap):
            if not a.figure:
                raise ValueError("--replot draws --figure: give --figure")
            cli.check_out(a.figure, "--figure", others={"--out": a.out}, program="experiments/stream.py")
            files.check_regular(a.out, f"--out {a.out}")
            rows = files.read_json(a.out).get("settings") if cli.own_output(a.out, "experiments/stream.py") else None
            if not isinstance(rows, list) or not rows or not all(
                    isinstance(r, dict) and {"interval_s", "event_rate", *ARMS[1:]} <= set(r) for r in rows):
                raise ValueError(f"--out {a.out} holds no settings to draw (not an experiments/stream.py JSON)")
            figure(rows, a.figure)
        return print(f"drawn from {a.out} to {a.figure}")
    with cli.user_errors(ap):
        try:
            kw = dict(M=a.M, alpha=a.alpha, swap=bool(a.swap), skip=None if a.skip == "-" else int(a.skip),
                      steady=bool(a.steady))
            stream.Stream(None, [], **kw)  # its own checks, before any work
        except ValueError:
            raise ValueError(f"--M and --alpha take ints >= 1, --skip an int >= 1 or '-'; got {a.M}, {a.alpha}, "
                             f"{a.skip!r}") from None
        merged = None if a.merged is None else flags.tree_shape(a.merged, "--merged")
        shape = None if a.tree is None else flags.tree_shape(a.tree, "--tree")
        shape = evaluate.TREE if shape is None and a.compile else shape  # the chooser's compiled profile: not here
        if a.clip_seed < 0:
            raise ValueError(f"--clip-seed takes an int >= 0, got {a.clip_seed}")
        sampling = flags.sampling(a.temperature, None, a.top_p, a.clip_seed)
        if (a.samples > 1) != (a.temperature > 0) or a.samples < 1:
            raise ValueError(f"--samples {a.samples} rows a plan go with --temperature > 0 (a greedy plan is one row), "
                             f"got --temperature {a.temperature}")
        for n in (a.clips, a.sweep_clips):
            driving.check_clips(n, a.frames, clips_flag="--clips / --sweep-clips", frames_flag="--frames")
        try:
            rewords = [] if a.reword is None else [float(r) for r in a.reword.split(",")]
        except ValueError:
            raise ValueError(f"--reword takes rates in [0, 1], comma-separated; got {a.reword!r}") from None
        if not all(0 <= r <= 1 for r in rewords):
            raise ValueError(f"--reword {a.reword}: each rate is a probability in [0, 1]")
        rates = [driving.event_rate(0.5) if r.strip() == "default" else float(r) for r in a.rates.split(",")]
        if not all(0 <= r <= 1 for r in rates):
            raise ValueError(f"--rates {a.rates}: each rate is a per-frame probability in [0, 1]")
        if a.figure:
            cli.check_out(a.figure, "--figure", others={"--out": a.out}, program="experiments/stream.py")
        t0, cpu0 = time.time(), time.process_time()
        target = checkpoint.load(os.path.join(a.run, "target")).eval()
        drafts = [checkpoint.load(checkpoint.draft_dir(a.run, "flat", s), target=target).eval()
                  for s in range(a.seeds)]
        tok, blocks = driving.Tokenizer(), 8
        choice = None
        if shape is None:  # the tree for this machine: the chooser's, on val plans of the decoding that runs
            val = driving.make_split("val", chooser.val_prompts(1, a.samples), seed=0)
            val = evaluate.scene_prompts(val, tok, "cpu")
            shape, choice = chooser.stream_tree(target, drafts[0], val, evaluate.MAX_NEW_TOKENS, tok.cot_end_id,
                                                sampling, a.samples)
        # the claims' settings first (the JSON is written after each setting: a stopped run keeps what it measured)
        claims = [(0.5, driving.event_rate(0.5)), (0.5, 1.0)]
        settings = claims + [s for s in [(0.5, r) for r in rates] + [(0.1, driving.event_rate(0.1))] if s not in claims]
        settings = settings[:1] if a.default_only else settings[1:2] if a.rate1_only else settings
        settings = [(0.5, driving.event_rate(0.5), r) for r in rewords] if rewords else [s + (None,) for s in settings]
        sib = {"siblings": a.samples, "frames_back": stream.K_FRAMES} if a.samples > 1 else {}
        res = {"command": "python experiments/stream.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "tree": [shape.nodes, shape.depth, shape.width], "choice": choice, "split": a.split,
               "merged": None if merged is None else [merged.nodes, merged.depth, merged.width],
               **{f"stream_{k}": v for k, v in stream.settings(**kw, **sib).items()}, "clip_seed": a.clip_seed,
               "decoding": flags.sampling_json(sampling), "samples": a.samples, "compiled": a.compile,
               "event_rate_per_s": driving.EVENT_RATE, "ring_rate_per_s": driving.RING_RATE, "settings": [],
               "environment": timing.environment("cpu")}
        for interval, rate, r in settings:
            n = a.clips if (interval, rate) in claims and r is None else a.sweep_clips
            cli.progress(f"interval {interval} s, event rate {rate:.3f}: {n} clips x {a.frames} frames")
            res["settings"].append(setting(target, drafts, tok, n, a.frames, interval, rate, blocks,
                                           (interval, rate) in claims and r is None and a.seeds > 1, a.samples,
                                           sampling,
                                           a.clip_seed, a.compile, a.split, shape, merged, r, **kw))
            files.write_json(a.out, res | {"complete": len(res["settings"]) == len(settings)} | cli.ran(a, t0, cpu0))
        rows = sorted(res["settings"], key=lambda r: (-r["interval_s"], r["event_rate"], r.get("reword", 0)))
        res["settings"] = rows
        files.write_json(a.out, res | {"complete": True} | cli.ran(a, t0, cpu0))
        if a.figure:
            figure(rows, a.figure)
    for r in rows:
        said = f", reworded {r['reword']:g}" if "reword" in r else ""
        arms = "; ".join(f"{k} tau {r[k]['tau']:.2f} {r[k]['speedup']:.2f}x" for k in ARMS[1:])
        print(f"{r['interval_s']} s, rate {r['event_rate']:.3f}{said} (CoC changed {r['coc_changed']:.2f}): {arms}" +
              ("" if r[ARMS[1]]["frames_differing"] is None else
               f"; frames differing from target-only {sum(r[k]['frames_differing'] for k in ARMS[1:])}"))
    print(f"written to {a.out}" + (f" and {a.figure}" if a.figure else ""))
    return res


def figure(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    x = "reword" if "reword" in rows[0] else "event_rate"  # the rewording figure, or the event rate's
    at = [r for r in rows if r["interval_s"] == 0.5]
    for ax, key, label in ((axes[0], "tau", "tau (tokens per target forward)"),
                           (axes[1], "speedup", "speed-up over target-only")):
        for arm, style in zip(ARMS[1:], ("o-", "s--", "^-")):
            ax.plot([r[x] for r in at], [r[arm][key] for r in at], style, label=f"{arm}, 0.5 s")
            ax.plot([r[x] for r in rows if r["interval_s"] == 0.1],
                    [r[arm][key] for r in rows if r["interval_s"] == 0.1], style[0], mfc="none", color="k")
        ax.set_xlabel("rewording rate r of the earlier plans" if x == "reword" else
                      "event rate per frame (1: a new scene each frame)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7, title=None if x == "reword" else "open black: 0.1 s", title_fontsize=7)
    fig.tight_layout()
    files.atomic_write(path, lambda p: fig.savefig(p, dpi=110, format="png"))


if __name__ == "__main__":
    main()
