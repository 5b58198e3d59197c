"""The table's greedy-CoC stage (evaluate.greedy_outputs on 64 val + 64 test scenes, fp32) at two or more checkouts,
alternated in one process (each checkout's modules imported in turn, the other's dropped), two visits each. Paper:
none; it times the stage rsd.py runs first (issue #51: is the one autoregressive loop slower than evaluate.generate?).

run: python experiments/greedy_stage_ab.py . ../old-checkout      (seconds per visit and the tokens written)
"""
import importlib
import sys
import time

PACKAGES = {"model", "rope", "vision", "speculate", "tree", "driving", "evaluate", "ops", "bench", "real", "beyond",
            "relaxed", "aarl", "train", "rsd"}


def modules_of(repo):
    """The repo's modules, freshly imported (any other checkout's dropped first)."""
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]
    sys.path.insert(0, repo)
    try:
        return {n: importlib.import_module(n) for n in ("ops.checkpoint", "driving", "evaluate")}
    finally:
        sys.path.remove(repo)


if __name__ == "__main__":
    for visit in range(2):
        for repo in sys.argv[1:]:
            m = modules_of(repo)
            target = m["ops.checkpoint"].load(repo + "/checkpoints/toy/target").eval()
            tok = m["driving"].Tokenizer()
            t0 = time.perf_counter()
            n = sum(len(c) for split in ("val", "test")
                    for c in m["evaluate"].greedy_outputs(target, m["driving"].Data(split, 64, 0, tok)))
            print(f"{repo} visit {visit}: {time.perf_counter() - t0:.2f} s, {n} tokens", flush=True)
