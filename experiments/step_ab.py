"""The cost of one cached one-token target step (model.feed on the shipped toy target, bf16, one thread) in two or
more checkouts of this repo, in one process, alternating: the least CPU time of 7 blocks of 100 steps each, per round.
Paper: the reasoning step's latency is these steps (target-only decoding is one per token). Why CPU time and the least
of many blocks: on this shared VM the wall clock of the same step moves by a quarter from minute to minute, and other
jobs only ever add time. Made for issue #42's decode core (the one cached step against the int-slot fast path it
replaced, and KVCache.write without its one-row branch).

run: python experiments/step_ab.py CHECKOUT_A CHECKOUT_B [...] [--rounds 3]
"""
import json
import os
import sys
import time

import torch

from decode_ab import checkouts_args, cli, modules_of

@torch.no_grad()
def step_ms(repo, blocks=7, steps=100):
    m = modules_of(repo)  # decode_ab's: the checkout's modules, any other's dropped first
    feed = sys.modules["model"].feed  # the checkout's own (evaluate imported it)
    target = m["ops.checkpoint"].load(os.path.join(repo, "checkpoints/toy/target"), dtype=torch.bfloat16).eval()
    driving = m["driving"]
    prompt = m["evaluate"].scene_prompts(driving.make_split("test", 1, seed=0), driving.Tokenizer(), "cpu",
                                         torch.bfloat16, driving.WorldConfig().views)[0]
    L = prompt["input_ids"].shape[1]
    cache = target.new_cache(max_len=L + steps)
    target(prompt["input_ids"], cache=cache, **{k: v for k, v in prompt.items() if k != "input_ids"})
    x = torch.tensor([[5]])  # (1, 1): any token; the work does not depend on it
    for _ in range(20):  # warm-up
        feed(target, cache, x)
    best = float("inf")
    for _ in range(blocks):
        cache.crop(L)
        t0 = time.process_time()
        for _ in range(steps):
            feed(target, cache, x)  # the cache grows by one slot per step, as in decoding
        best = min(best, (time.process_time() - t0) / steps)
    return round(1e3 * best, 3)


@cli.program
def main(argv=None):
    args = checkouts_args("step_ab", argv, __doc__, "--rounds", 3, "rounds")
    torch.set_num_threads(1)
    for r in range(args.rounds):
        for repo in args.repos:
            print(json.dumps({"round": r, "repo": os.path.abspath(repo), "ms_per_step": step_ms(repo)}), flush=True)


if __name__ == "__main__":
    main()
