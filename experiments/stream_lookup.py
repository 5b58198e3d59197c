"""Plans in a stream (beyond the paper; beyond/stream.py): the stream's lookup chosen on validation clips, never on the
held-out ones. Greedy, the stream alone accepts the longest common prefix of its proposal and the target's own plan,
so its tau is simulated exactly from target-only's plans: no draft, and the target decodes each frame once.

Swept: alpha (tokens proposed per matched token), M (the most a round proposes) and swap (a match may step over one
word that differs, as when a range ring is crossed). Also reported per setting: the proposed tokens the target
rejected a token of plan (what the verify carries for nothing). --check N decodes the first N clips' frames with the
real stream arm too and asserts the simulation's rounds equal the decode's. --time M/alpha/swap/skip,... then times
the four arms of each such Stream (measure.timing.stream_arms; skip '-': never) on the first --time-clips clips.

run: python experiments/stream_lookup.py [--out runs/stream_lookup.json] [--time 16/4/0/-,32/32/1/16]
     (the README's, 13 min: --check 2 --out experiments/stream_lookup_val.json --time 32/2/1/8,32/2/1/-,32/4/1/8)
"""
import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from beyond import stream  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import checkpoint, cli, files  # noqa: E402
from measure import timing  # noqa: E402
import speculate  # noqa: E402


def simulate(earlier, plan, M, alpha, swap, steady=True):
    """The stream alone, greedy, on one frame: earlier, the two frames before's plans (most recent first, as many as
    there are), plan, this frame's (each from <cot_start>, plan_tokens) -> (rounds, proposed tokens left unaccepted)."""
    context, pos, rounds, wasted = plan[:1], 1, 0, 0
    whole = stream.Stream(None, [earlier], steady=steady).steady[0]  # Stream's own rule
    while pos < len(plan):
        prop = stream.lookup(context, earlier, M, alpha, swap, whole=whole)
        a = 0
        while a < len(prop) and pos + a < len(plan) and prop[a] == plan[pos + a]:
            a += 1
        take = min(a + 1, len(plan) - pos)  # the accepted and the target's next token, up to the plan's end
        context, pos, rounds, wasted = context + plan[pos:pos + take], pos + take, rounds + 1, wasted + len(prop) - a
    return rounds, wasted


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default=checkpoint.SHIPPED, help="the toy's run folder (its target)")
    ap.add_argument("--clips", type=int, default=64, help="validation clips of 10 frames")
    ap.add_argument("--check", type=int, default=2, help="clips also decoded by the real stream arm (0: none)")
    ap.add_argument("--out", default="runs/stream_lookup.json", help="the JSON written")
    ap.add_argument("--time", default="", help="Streams to time, M/alpha/swap/skip comma-separated (skip '-': never)")
    ap.add_argument("--time-clips", type=int, default=16, help="clips each --time Stream is timed on")
    a = cli.checked(ap, ap.parse_args(argv), counts=("clips", "time_clips"), out="runs/stream_lookup.json",
                    program="experiments/stream_lookup.py")
    with cli.user_errors(ap):
        if a.check < 0:
            raise ValueError(f"--check takes a number of clips >= 0 (0: none), got {a.check}")
        try:
            timed = [dict(M=int(M), alpha=int(al), swap={"0": False, "1": True}[sw], skip=None if sk == "-" else int(sk),
                          steady=True) for M, al, sw, sk in (c.split("/") for c in a.time.split(",") if c)]
            for kw in timed:  # Stream's own checks, before the decoding work
                stream.Stream(None, [], **kw)
        except (ValueError, KeyError):
            raise ValueError(f"--time {a.time!r}: each Stream is M/alpha/swap/skip: M and alpha ints >= 1, swap 0 or "
                             "1, skip an int >= 1 or -") from None
    t0, cpu0 = time.time(), time.process_time()
    target = checkpoint.load(os.path.join(a.run, "target")).eval()
    draft = checkpoint.load(checkpoint.draft_dir(a.run, "flat", 0), target=target).eval() if timed else None
    tok = driving.Tokenizer()
    res = {"command": "python experiments/stream_lookup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "settings": []}
    for interval, rate in ((0.5, driving.event_rate(0.5)), (0.5, 1.0)):
        clips = [evaluate.scene_prompts(c, tok, "cpu") for c in driving.make_clips("val", a.clips, 10, interval, rate)]
        cli.progress(f"val, {interval} s, rate {rate:.3f}: target-only plans of {a.clips} clips")
        plans = [[stream.plan_tokens(p, speculate.autoregressive(target, p, evaluate.MAX_NEW_TOKENS,
                                                                 stop_token=tok.cot_end_id)) for p in c] for c in clips]
        for c in range(min(a.check, a.clips)):  # the simulation is the decode: rounds equal, frame by frame
            real = stream.decode_clip(target, target, clips[c], "stream", None, evaluate.MAX_NEW_TOKENS,
                                      tok.cot_end_id)
            n = 2 if stream.STEADY else 1  # the earlier plans decode_clip gives a frame's Stream
            sim = [simulate(plans[c][t - 1::-1][:n] if t else [], q, stream.M, stream.ALPHA, stream.SWAP,
                            stream.STEADY)[0] for t, q in enumerate(plans[c])]
            assert [r.rounds for r in real] == sim, (c, [r.rounds for r in real], sim)
        tokens = sum(len(q) - 1 for c in plans for q in c)
        rows = []
        for M, alpha, swap in itertools.product((16, 32), (2, 4, 8), (False, True)):
            sims = [simulate(c[t - 1::-1][:2] if t else [], q, M, alpha, swap) for c in plans for t, q in enumerate(c)]
            rows.append({"M": M, "alpha": alpha, "swap": swap, "tau": tokens / sum(s[0] for s in sims),
                         "wasted_per_token": sum(s[1] for s in sims) / tokens})
            print(f"rate {rate:.3f} M {M} alpha {alpha} swap {swap}: stream tau {rows[-1]['tau']:.2f}, proposed and "
                  f"rejected {rows[-1]['wasted_per_token']:.2f} a token")
        res["settings"].append({"interval_s": interval, "event_rate": rate, "clips": a.clips, "rows": rows,
                                "timed": []})
        for kw in timed:  # the four arms of each Stream, interleaved, on the first clips
            cli.progress(f"timing {kw} on {a.time_clips} clips")
            arms, _ = timing.stream_arms(target, draft, clips[:a.time_clips], evaluate.TREE, evaluate.MAX_NEW_TOKENS,
                                         tok.cot_end_id, **kw)
            res["settings"][-1]["timed"].append(kw | {k: {m: v for m, v in arms[k].items()} for k in arms})
            print(f"rate {rate:.3f} {kw}: " + "; ".join(f"{k} tau {arms[k]['tau']:.2f} {arms[k]['speedup']:.2f}x"
                                                         for k in stream.ARMS[1:]))
            files.write_json(a.out, res | cli.ran(a, t0, cpu0))
        files.write_json(a.out, res | cli.ran(a, t0, cpu0))
    print(f"written to {a.out}")
    return res


if __name__ == "__main__":
    main()
