"""The table's greedy-CoC stage (evaluate.greedy_outputs on 64 val + 64 test scenes, fp32) at two or more checkouts,
alternated in one process (each checkout's modules imported in turn, the other's dropped), two visits each. Paper:
none; it times the stage rsd.py runs first (issue #51: is the one autoregressive loop slower than evaluate.generate?).

run: python experiments/greedy_stage_ab.py . ../old-checkout [--visits 2]   (seconds per visit and the tokens written)
"""
import time

from decode_ab import checkouts_args, cli, modules_of


@cli.program
def main(argv=None):
    args = checkouts_args("greedy_stage_ab", argv, __doc__, "--visits", 2, "visits")
    for visit in range(args.visits):
        for repo in args.repos:
            m = modules_of(repo)
            target = m["ops.checkpoint"].load(repo + "/checkpoints/toy/target").eval()
            tok = m["driving"].Tokenizer()
            t0 = time.perf_counter()
            n = sum(len(c) for split in ("val", "test")
                    for c in m["evaluate"].greedy_outputs(target, m["driving"].Data(split, 64, 0, tok)))
            print(f"{repo} visit {visit}: {time.perf_counter() - t0:.2f} s, {n} tokens", flush=True)


if __name__ == "__main__":
    main()
