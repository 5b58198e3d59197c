# ---- step times ----
"""The cost model (Leviathan et al. Theorem 3.8), expected from alpha or from measured T_target, T_draft: the
synchronised Clock, medians of single steps, and the speed-ups they predict for a chain or a draft tree."""
import statistics
import time

import torch

from speculate import EMBED_KEYS, prefill


class Clock:
    """Wall-clock marks for timing=True: the device is synchronised before each reading, so
    queued GPU work is counted where it belongs (prefill vs decode). Disabled: no syncs.
    timer: the clock read; time.process_time counts only this process's CPU time, which on a CPU
    shared with other work is its own cost where the wall clock would add its waits (CPU only)."""

    def __init__(self, device, enabled, timer=time.perf_counter):
        self.enabled = enabled
        self.cuda = enabled and torch.device(device).type == "cuda"
        self.timer = timer
        self.t = self.now()

    def now(self):
        if not self.enabled:
            return 0.0
        if self.cuda:
            torch.cuda.synchronize()
        return self.timer()

    def lap(self):
        t, self.t = self.t, self.now()
        return self.t - t


def median_time(fn, device, reps, timer=time.perf_counter):
    """Median time (s) of fn() over reps calls, after one warm-up call, read with Clock (timer: its clock, by default
    the wall clock)."""
    fn()
    clock, times = Clock(device, enabled=True, timer=timer), []
    for _ in range(reps):
        clock.lap()
        fn()
        times.append(clock.lap())
    return statistics.median(times)


@torch.no_grad()  # not inference_mode: a compiled step warmed up under no_grad would compile again under it
def step_times(target, draft, prompt, lengths, reps=20, timer=time.perf_counter):
    """The measured cost model's step times in seconds: {"target": {n: T_target(n) for n in lengths}, "draft":
    T_draft(1)}, each a single forward on a cache that holds the prompt, followed by a crop back to it (the
    verifier's rollback). timer: Clock's clock (time.process_time: CPU time, for a shared CPU)."""
    device = prompt["input_ids"].device
    L = prompt["input_ids"].shape[1]
    embeds = target.embed(**{k: prompt[k] for k in EMBED_KEYS if prompt.get(k) is not None})  # (1, L, D)

    def time_step(m, n):
        cache = m.new_cache(batch=1, max_len=L + n)
        prefill(m, prompt, embeds, cache)  # the prompt except its last token
        x = prompt["input_ids"][:, -1:].repeat(1, n)  # (1, n) tokens; their values do not matter for time
        base = cache.length

        def step():
            m(x, cache=cache)
            cache.crop(base)

        return median_time(step, device, reps, timer)

    return {"target": {n: time_step(target, n) for n in lengths}, "draft": time_step(draft, 1)}


@torch.inference_mode()
def tree_step_times(target, draft, prompt, nodes, width, reps=20, timer=time.perf_counter):
    """The tree round's step times in seconds, each a single VLA.step on a cache that holds the prompt (as
    tree_round calls it; the mask's values do not change the work): {"target": {n: T_verify(n + 1)} for n in nodes,
    the target over x_last and n nodes, "draft_level": T_draft(width), one level's forward over `width` expanded
    nodes}."""
    device = prompt["input_ids"].device
    L = prompt["input_ids"].shape[1]
    embeds = target.embed(**{k: prompt[k] for k in EMBED_KEYS if prompt.get(k) is not None})  # (1, L, D)

    def time_step(m, n):
        cache = m.new_cache(batch=1, max_len=L + n)
        prefill(m, prompt, embeds, cache)
        x = prompt["input_ids"][:, -1:].repeat(1, n)  # (1, n)
        slots = torch.arange(L - 1, L - 1 + n, device=device)  # (n,)
        mask = torch.arange(cache.max_len, device=device)[None] <= slots[:, None]  # (n, S)
        return median_time(lambda: m.step(x, slots, cache, positions=slots, mask=mask), device, reps, timer)

    return {"target": {n: time_step(target, n + 1) for n in nodes}, "draft_level": time_step(draft, width)}


def tree_speedup(tau, t_target_1, t_draft_1, t_draft_level, t_verify, shape):
    """tau * T_target(1) / (T_draft(1) + (D - 1) T_draft(k) + T_verify(N + 1)): a tree round drafts its root level
    from the pending token, then D - 1 levels of k expanded nodes, and verifies x_last + N nodes in one forward."""
    return tau * t_target_1 / (t_draft_1 + (shape.depth - 1) * t_draft_level + t_verify)


def measured_speedup(tau, t_target_1, t_draft_1, t_target_gamma1, gamma):
    """tau * T_target(1) / (gamma * T_draft(1) + T_target(gamma+1)), from measured step times."""
    return tau * t_target_1 / (gamma * t_draft_1 + t_target_gamma1)


def expected_tau(alpha, gamma):
    """Expected tokens per round for an i.i.d. acceptance rate alpha: (1 - a^(g+1)) / (1 - a)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha, gamma, c):
    """Leviathan et al. Theorem 3.8: (1 - a^(g+1)) / ((1 - a)(g c + 1)), c = draft step / target step."""
    return expected_tau(alpha, gamma) / (gamma * c + 1.0)
