"""What a benchmark number needs to be trusted: one timing harness (interleaved) and the arms it times (every decoder
beside target-only on the same prompts, eager or on compiled steps; plans of several rows), the cost model's step times
(Leviathan et al. Theorem 3.8; for a chain or a draft tree), the runtime, peak memory, and where a greedy output parts
from target-only decoding (a dtype's near-tie, or a bug). Compile counts and SDPA kernels: experiments/probes.py.
Every timer returns one arms record (decoder, tau, ms, speed-up and its range, greedy identity per arm), printed by
arms_lines. Paper: the speed-up claims of its table and of Alpamayo-R1's plan.

Below the scripts: bench.py and rsd.py time their arms here.

run: python bench.py --device cpu --json        (the JSON's step times, environment, peak_memory and divergences)
"""
import dataclasses
import importlib.metadata
import math
import platform
import statistics
from statistics import median
import time

import torch

from beyond import stream
import evaluate
from evaluate import TARGET_ONLY
from model import causal_mask
from ops import cli, compiled
from measure import flags
import speculate
from speculate import EMBED_KEYS, GREEDY, feed, prefill
import tree

CHAIN_ARM = "runner-up"  # beside the decoder: the chooser's runner-up, or the chain of --gamma; the same passes
# --compile's arms, timed beside the eager ones: each eager arm's name + " compiled"
COMPILED, COMPILED_CHAIN = (TARGET_ONLY + " compiled", "speculative compiled"), CHAIN_ARM + " compiled"

# ---- the arms: every decoder and target-only, timed in the same passes ----
@torch.no_grad()  # the grad mode the compiled steps were warmed up in (evaluate.spec_stats); another recompiles
def time_arms(target, drafts, prompts, gamma, max_new, stop_token, repeats, sampling=GREEDY, extra=None, blocks=1,
              warm_all=True):
    """(the arms record {arm: {decoder (decoder_json; None: target-only), tau (the first pass's), greedy_match (every
    prompt's tokens target-only's; None when sampled), prefill_ms, and summary's ms_per_token, speedup and ranges}},
    {arm: [SpecResult per prompt] of the first pass}): every arm warmed up (warm_all: on every prompt, else on the
    first), then timing.interleaved's passes (the arms back to back on each prompt, the order rotated): load that drifts
    on a shared machine falls on every arm alike. extra: {name: (target, draft or None[, gamma])}; sampled: prompt i's
    seeds in every pass. Ranges: min..max over the passes' `blocks` blocks of prompts (a block's speed-up is paired:
    the same prompts, timed back to back)."""
    arms = {TARGET_ONLY: (target, None), **{name: (target, d) for name, d in drafts.items()}, **(extra or {})}
    arms = {name: (*arm, gamma)[:3] for name, arm in arms.items()}  # (target, draft, gamma) each
    for t, draft, g in arms.values() if warm_all else ():
        for i, p in enumerate(prompts):
            evaluate.decode(t, draft, p, g, max_new, stop_token, sampling.offset(i))
    runs = interleaved({name: lambda i, t=t, d=d, g=g: evaluate.decode(
        t, d, prompts[i], g, max_new, stop_token, sampling.offset(i), timing=True)
        for name, (t, d, g) in arms.items()}, len(prompts), repeats, prompts[0]["input_ids"].device,
        warmup=0 if warm_all else 1)
    res = {name: [[x.result for x in p] for p in passes] for name, passes in runs.items()}  # [pass][prompt]

    def ms(name, r, lo, hi):  # pass r's ms/token over prompts lo..hi-1
        return 1e3 * sum(x.decode_s for x in res[name][r][lo:hi]) / sum(len(x.tokens) for x in res[name][r][lo:hi])

    out, first = summary(ms, arms, repeats, len(prompts), blocks, "ms_per_token"), {n: r[0] for n, r in res.items()}
    for name, (_, d, g) in arms.items():
        out[name] |= {"decoder": None if d is None else decoder_json(g),
                      "tau": speculate.SpecResult.pooled(first[name]).tau,
                      "greedy_match": all(r.tokens == x.tokens for r, x in zip(first[name], first[TARGET_ONLY]))
                      if sampling.greedy else None,
                      "prefill_ms": median(1e3 * sum(x.prefill_s for x in p) / len(p) for p in res[name])}
    return out, first


def summary(cost, arms, repeats, n, blocks=1, unit="ms_per_token"):
    """The one record of timed arms (bench.py's arms, plans and streams; rsd.py's table): cost(arm, r, lo, hi), pass
    r's cost (ms per token or per plan) over items lo..hi-1 of n -> {arm: {unit: its median over the passes,
    unit_range: min..max over the units, "speedup": the median over the passes of base's cost over the arm's (paired:
    the same items, timed in the same pass; base: target-only, a compiled arm's compiled target-only),
    "speedup_range": min..max over the units}}; a unit is one pass over one of `blocks` blocks of items (block_bounds),
    each block's arms timed back to back."""
    units = [(r, lo, hi) for r in range(repeats) for lo, hi in block_bounds(n, blocks)]
    out = {}
    for arm in arms:
        base = COMPILED[0] if arm.endswith(" compiled") else TARGET_ONLY
        c, ups = [cost(arm, *u) for u in units], [cost(base, *u) / cost(arm, *u) for u in units]
        out[arm] = {unit: median(cost(arm, r, 0, n) for r in range(repeats)), f"{unit}_range": [min(c), max(c)],
                    "speedup": median(cost(base, r, 0, n) / cost(arm, r, 0, n) for r in range(repeats)),
                    "speedup_range": [min(ups), max(ups)]}
    return out


def arms_lines(arms, unit="ms_per_token"):
    """The one printer of an arms record (time_arms, plans, stream_arms): an arm a line, its decoder, ms per token or
    per plan, the speed-up over target-only (compiled: over compiled target-only) [min-max over blocks of items and
    passes], tau (a row's tokens per round), greedy identity with target-only (none: sampled)."""
    def line(name, a):
        d, (lo, hi), same = a.get("decoder"), a["speedup_range"], a.get("greedy_match")
        return (f"{name:<22}{decoder_name(d) if d else '':<14}{a[unit]:9.3f} {unit.replace('ms_per_', 'ms/')}   "
                f"speed-up {a['speedup']:.2f}x [{lo:.2f}-{hi:.2f}]"
                + ("" if a["tau"] is None else f"   tau {a['tau']:.2f}")  # None: not recorded (an old report's)
                + ("" if same is None else f"   greedy {'identical' if same else 'DIFFERS'}"))
    return [line(name, a) for name, a in arms.items()]


@torch.no_grad()
def stream_arms(target, draft, clips, shape, max_new, stop_token, repeats=1, blocks=8, samples=1,
                sampling=GREEDY, compile=False, merged=None, reword=None, **stream_kw):
    """Plans in a stream (beyond/stream.py) on clips (a list of clips, each its frames' batch-1 prompts in order):
    the four arms of stream.ARMS timed interleaved, an item a whole clip -> {arm: {tau (a row's), ms_per_token (the
    decode, prefills apart, over every frame's tokens; median over passes), ms_per_plan (a frame's plan: until its
    last row is done), speedup (target-only's ms per plan over the arm's), speedup_range (min..max over `blocks`
    blocks of clips, each block's arms back to back), frames_differing (greedy: plans not token for token
    target-only's; sampled: None)}}, and the first pass's results {arm: [clip][frame] SpecResult, or with samples > 1
    a list of the plan's rows}. samples, sampling: each frame's plan of `samples` rows (decode_clip's); stream_kw: the
    Stream's (M, alpha, ...); merged: the tree merged with the stream (None: shape, the tree arm's); reword: clip
    index -> decode_clip's reword (None: none); greedy_match: frames_differing == 0 (the arms record's); compile:
    every arm on compiled steps of `samples` rows
    (compiled_pair), each step length compiled before the passes."""
    if compile:
        sib = {"siblings": samples} if samples > 1 else {}
        like = stream.Stream(merged or shape, [[]] * samples, **stream_kw, **sib)  # every frame's Stream's steps
        target, draft = compiled_pair(target, draft, [p for c in clips for p in c], [shape, like], max_new, samples)
        target.warm(), draft.warm()
        warm_verify(target, like.steps[0], samples)  # a width the first clip never matched would compile in a pass
    runs = interleaved({arm: lambda i, arm=arm: stream.decode_clip(
        target, draft, clips[i], arm, shape, max_new, stop_token, timing=True, samples=samples, sampling=sampling,
        merged=merged, reword=reword and reword(i), **stream_kw) for arm in stream.ARMS}, len(clips), repeats,
        clips[0][0]["input_ids"].device)
    res = [{arm: [x.result for x in runs[arm][r]] for arm in stream.ARMS} for r in range(repeats)]  # [pass][arm][clip]
    rows = (lambda f: f) if samples > 1 else (lambda f: [f])  # a frame's plan as its rows

    def plan_ms(arm, r, lo, hi):  # pass r's ms per plan over clips lo..hi-1
        plans = [max(x.decode_s for x in rows(f)) for clip in res[r][arm][lo:hi] for f in clip]
        return 1e3 * sum(plans) / len(plans)

    def pooled(r, arm):
        return speculate.SpecResult.pooled([x for clip in res[r][arm] for f in clip for x in rows(f)])

    ref = [[[x.tokens for x in rows(f)] for f in clip] for clip in res[0]["target-only"]]
    out = summary(plan_ms, stream.ARMS, repeats, len(clips), blocks, "ms_per_plan")
    for arm in stream.ARMS:
        frames = [pooled(r, arm) for r in range(repeats)]
        differ = None if not sampling.greedy else sum(
            [x.tokens for x in rows(f)] != t for c, rc in zip(res[0][arm], ref) for f, t in zip(c, rc))
        out[arm] |= {"tau": frames[0].tau, "ms_per_token": median(1e3 * f.decode_s / len(f.tokens) for f in frames),
                     "frames_differing": differ, "greedy_match": None if differ is None else differ == 0}
    return out, res[0]


@torch.no_grad()  # the decodes' grad mode
def warm_verify(target, lengths, batch):
    """The fused tree verify (tree.tree_forward on compiled steps) of each of `lengths` tokens, root included,
    compiled now on the emptied cache with tensors of a round's dtypes and layouts."""
    verify, cache = target.fused(tree.tree_forward), target.new_cache(batch)
    for n in lengths:
        z = torch.zeros(batch, n, dtype=torch.long, device=cache.device)
        anc = torch.eye(n, dtype=torch.bool, device=cache.device).repeat(batch, 1, 1)
        verify(target, cache, z[:, :1].contiguous(), z[:, 1:].contiguous(), z, anc, z[:, 0].contiguous())
    cache.crop(0)


def block_bounds(n, blocks):
    """[(lo, hi)] of min(blocks, n) consecutive blocks of n items, as even as they go: a speed-up's range is over
    them, each block's arms timed back to back."""
    nb = min(blocks, n)
    cuts = [round(j * n / nb) for j in range(nb + 1)]
    return list(zip(cuts, cuts[1:]))


def compiled_pair(target, draft, prompts, decoders, max_new, batch=1, lengths=None):
    """compiled.CompiledSteps of target and draft, each cache sized for every prompt and decoder (speculate.Chain or
    gamma, tree.TreeShape), each step length a decode takes compiled once: target-only 1, each decoder's steps
    (lengths: the target's given instead, each step padded to the next; they must cover the longest)."""
    decoders = [speculate.decoder_of(d) for d in decoders]
    t_lengths = set(lengths or {1, *(n for d in decoders for n in d.steps[0])})
    d_lengths = {1, *(n for d in decoders for n in d.steps[1])}
    slack = max(max(d.slack) for d in decoders) + max(t_lengths | d_lengths)  # a round's slots, a step's padding
    max_len = max(p["input_ids"].shape[1] for p in prompts) + max_new + slack
    return (compiled.CompiledSteps(target, max_len, t_lengths, batch),
            compiled.CompiledSteps(draft, max_len, d_lengths, batch))


@torch.no_grad()
def plans(target, draft, prompts, gamma, max_new, stop_token, repeats, sampling, batch, samples, compile=False,
          chain_gamma=evaluate.GAMMA):
    """Plans of `batch` prompts x `samples` rows each, decoded as one batch (speculate.speculative_batch, tree or
    chain, against autoregressive_batch on the same rows), arms alternating in every pass, medians reported: per
    plan the reasoning step's ms until every row is done, tokens per second, tau per row, the speed-up; greedy rows
    compared with their own batch-1 target-only decode. compile: the same arms through CompiledSteps of B rows."""
    B, groups = batch * samples, plan_batches(prompts, batch)
    compiled_ = {" compiled": compiled_pair(target, draft, groups, [gamma, chain_gamma], max_new, B)} if compile else {}
    pairs = {"": (target, draft)} | compiled_

    def run(t, d, g, p, j):  # plan j's rows seeded seed + B j + r: the same draws in every pass
        kw = dict(samples=samples, stop_token=stop_token, sampling=sampling.offset(B * j), timing=True)
        calls[0] += 1
        cli.progress(f"plans: {calls[0]} of {total} plan decodes (every arm, a warm-up pass and {repeats} timed)", 10)
        if d is None:
            return speculate.autoregressive_batch(t, p, max_new, **kw)
        return speculate.speculative_batch(t, d, p, g, max_new, **kw)

    calls, total = [0], len(arm_table(pairs, gamma, chain_gamma)) * len(groups) * (repeats + 1)
    cli.progress(f"plans: {len(groups)} plans of {B} rows, {total} plan decodes" + (", compiling first" if compile
                                                                                      else ""))
    runs = interleaved({name: lambda j, arm=arm: run(*arm, groups[j], j) for name, arm in arm_table(
        pairs, gamma, chain_gamma).items()}, len(groups), repeats, groups[0]["input_ids"].device)  # warm-up, compile
    out = {name: [x.result for x in ps[0]] for name, ps in runs.items()}  # the same rows in every pass
    ms = plan_cost(runs)
    rec = {"batch": batch, "samples": samples, "rows": B, "plans": len(groups),
           "decoding": flags.sampling_json(sampling),
           "cocs": [r.tokens for r in out["speculative"][0]],  # the first plan's rows
           "what": "ms: the reasoning step of one plan, until every row is done (median over passes); "
                   "idle_row_share: row-rounds a finished row spends in the batch (its work thrown away)"}
    if sampling.greedy:  # greedy: each row equals its own prompt's batch-1 target-only decode
        cli.progress(f"plans: each of {len(prompts)} prompts' batch-1 target-only decode (the identity check)")
        ref = [speculate.autoregressive(target, p, max_new, stop_token=stop_token).tokens for p in prompts]
        want = [ref[j * batch + i] for j in range(len(groups)) for i in range(batch) for _ in range(samples)]
        rec["greedy_match_per_row"] = {name: [r.tokens == w for r, w in zip([r for plan in o for r in plan], want)]
                                       for name, o in out.items()}
        rec["greedy_match"] = all(all(v) for v in rec["greedy_match_per_row"].values())
    rec["arms"] = summary(ms, runs, repeats, len(groups), 1, "ms_per_plan")
    for name, (_, d, g) in arm_table(pairs, gamma, chain_gamma).items():
        rows = [r for plan in out[name] for r in plan]
        rec["arms"][name] |= {
            "decoder": None if d is None else decoder_json(g), "tau": sum(r.tau for r in rows) / len(rows),
            "greedy_match": all(rec["greedy_match_per_row"][name]) if sampling.greedy else None,
            "tau_per_row": [r.tau for r in rows],
            "tokens_per_s": 1e3 * sum(len(r.tokens) for r in rows) / len(groups) / rec["arms"][name]["ms_per_plan"],
            "idle_row_share": sum(max(r.rounds for r in plan) - r.rounds for plan in out[name] for r in plan) / sum(
                max(r.rounds for r in plan) * len(plan) for plan in out[name])}
    return rec


def plan_batches(prompts, batch):
    """The plans' prompts, `batch` at a time, each group one left-padded prompt of `batch` rows (a partial last group
    is left out: every plan has the same rows)."""
    return [evaluate.stack_prompts(prompts[i:i + batch]) for i in range(0, len(prompts) - batch + 1, batch)]


def arm_table(pairs, gamma, chain_gamma):
    """{arm: (target, draft or None, decoder)} for each (target, draft) of pairs {name suffix: pair}: target-only, the
    decoder, and beside it the runner-up chain_gamma (a decoder or gamma) with the same draft, timed in the same
    passes, where it is another decoder."""
    arms = ((TARGET_ONLY, False, gamma), ("speculative", True, gamma), (CHAIN_ARM, True, chain_gamma))
    return {name + sfx: (t, d if drafted else None, g) for sfx, (t, d) in pairs.items()
            for name, drafted, g in arms[:2 if speculate.decoder_of(gamma) == speculate.decoder_of(chain_gamma) else 3]}


def plan_cost(runs):
    """summary's cost of plans timed by interleaved (runs: {arm: [[Run per plan] per pass]}, a Run's result the plan's
    rows): pass r's ms per plan over plans lo..hi-1, each until its last row is done."""
    return lambda arm, r, lo, hi: 1e3 * sum(max(x.decode_s for x in p.result) for p in runs[arm][r][lo:hi]) / (hi - lo)


def decoder_name(d):
    """A decoder_json as the reports name it: chain 3, tree 16/8/3."""
    return f"chain {d['gamma']}" if d["kind"] == "chain" else f"tree {d['nodes']}/{d['depth']}/{d['width']}"


def decoder_json(decoder):
    """{"kind": "chain", "gamma"} or {"kind": "tree", "nodes", "depth", "width"} (decoder: speculate.decoder_of's)."""
    return {"kind": (d := speculate.decoder_of(decoder)).kind, **dataclasses.asdict(d)}


# ---- step times ----
class Clock:
    """Clock marks, the device synchronised before each (queued GPU work counted where it belongs); disabled: no syncs.
    timer: the clock read; time.process_time counts this process's CPU time alone, without a shared CPU's waits."""

    def __init__(self, device, enabled, timer=time.perf_counter):
        self.enabled, self.timer, self.cuda = enabled, timer, enabled and torch.device(device).type == "cuda"
        self.t = self.now()

    def now(self):
        if self.cuda:  # only when enabled
            torch.cuda.synchronize()
        return self.timer() if self.enabled else 0.0

    def lap(self):
        t, self.t = self.t, self.now()
        return self.t - t


def interleaved(arms, n, repeats, device, warmup=1):
    """The one timing harness (bench.py's arms and plans, rsd.py's table, the held-out bench, the peer comparison).
    arms: {name: run(i)}, the work on item i of n (a prompt, a plan). Every pass runs every arm on every item, the arms
    back to back on each item in an order rotated from item to item and pass to pass, so a load that comes and goes on
    a shared machine falls on every arm alike; `warmup` untimed passes over item 0 first (every shape compiled or
    warmed up). -> {name: [[Run per item] per pass]}: the wall and CPU seconds around each call (the device
    synchronised) and what it returned."""
    for _ in range(warmup):
        for run in arms.values():
            run(0)
    names, out = list(arms), {name: [[None] * n for _ in range(repeats)] for name in arms}
    clock = Clock(device, enabled=True)
    for r in range(repeats):
        for i in range(n):
            k = (i + r) % len(names)
            for name in names[k:] + names[:k]:
                clock.lap()
                cpu = time.process_time()
                res = arms[name](i)
                out[name][r][i] = Run(clock.lap(), time.process_time() - cpu, res)
    return out


@dataclasses.dataclass
class Run:
    wall_s: float  # the clock around the call, the device synchronised
    cpu_s: float  # this process's CPU time: on a shared CPU, without the waits for the other jobs
    result: object  # what the call returned (a SpecResult's decode_s: the decoder's own clock)


def median_time(fn, device, reps, timer=time.perf_counter, warmup=1):
    """Median time (s) of fn() over reps calls, after `warmup` untimed calls, read with Clock (timer: its clock)."""
    for _ in range(warmup):
        fn()
    clock, times = Clock(device, enabled=True, timer=timer), []
    for _ in range(reps):
        clock.lap()
        fn()
        times.append(clock.lap())
    return statistics.median(times)


@torch.no_grad()  # not inference_mode: a compiled step warmed up under no_grad would compile again under it
def step_times(target, draft, prompt, lengths, reps=20, timer=time.perf_counter):
    """The measured cost model's step times (s): {"target": {n: T_target(n) for n in lengths}, "draft": T_draft(1)}."""
    time_step = _step_timer(target, prompt, reps, timer)
    return {"target": {n: time_step(target, n) for n in lengths}, "draft": time_step(draft, 1)}


@torch.no_grad()  # as step_times: the grad mode the compiled steps were warmed up in
def tree_step_times(target, draft, prompt, nodes, width, reps=20, timer=time.perf_counter):
    """The tree round's step times (s): {"target": {n: T_verify(n + 1) for n in nodes} (x_last and n nodes),
    "draft_level": T_draft(width), one level's forward over `width` expanded nodes}."""
    time_step = _step_timer(target, prompt, reps, timer, tree=True)
    return {"target": {n: time_step(target, n + 1) for n in nodes}, "draft_level": time_step(draft, width)}


@torch.no_grad()
def grow_time(target, draft, prompt, shape, reps=20, timer=time.perf_counter):
    """T_grow (s): a draft tree's D - 1 levels and its construction after the root (tree.grow; one graph when the
    draft's steps are compiled), on a cache holding the prompt: the draft's part of a round but its root step."""
    embeds = target.embed(**{k: prompt[k] for k in EMBED_KEYS if prompt.get(k) is not None})  # (1, L, D)
    cache = draft.new_cache(batch=1, max_len=prompt["input_ids"].shape[1] + (shape.depth - 1) * shape.width)
    prefill(draft, prompt, embeds, cache)
    logits = feed(draft, cache, prompt["input_ids"][:, -1:])[:, -1]  # (1, V): q at the root
    root = torch.tensor(cache.lengths, device=logits.device)  # (1,)
    grow = getattr(draft, "fused", lambda fn: fn)(tree.grow)
    return median_time(lambda: grow(draft, cache, logits, root, shape), logits.device, reps, timer)


def _step_timer(target, prompt, reps, timer, tree=False):
    """(m, n) -> median_time of one n-token step of m after the prompt (_step: a tree verify, or a chain's)."""
    device, L = prompt["input_ids"].device, prompt["input_ids"].shape[1]
    embeds = target.embed(**{k: prompt[k] for k in EMBED_KEYS if prompt.get(k) is not None})  # (1, L, D)

    def time_step(m, n):
        cache = m.new_cache(batch=1, max_len=L - 1 + n)
        prefill(m, prompt, embeds, cache)  # the prompt except its last token
        x = prompt["input_ids"][:, -1:].repeat(1, n)  # (1, n) tokens; their values do not matter for time
        return median_time(_step(m, cache, x, tree), device, reps, timer)

    return time_step


def _step(m, cache, x, tree=False):
    """A re-runnable step of m on x (1, n) after the cache: with tree as tree_round calls it (positions and a mask;
    their values do not change the work), else as spec_round does, with a crop back (the verifier's undo)."""
    if tree:
        slots = cache.slots(x.shape[1])  # (1, n)
        mask = causal_mask(slots, cache, cache.max_len)  # (1, n, S)
        return lambda: m.step(x, slots, cache, positions=slots, mask=mask)
    base = cache.length

    def step():
        feed(m, cache, x)
        cache.crop(base)

    return step


# ---- the runtime a number was measured on ----
def environment(device):
    """Python, torch (and its CUDA, cuDNN), triton, transformers (None where absent), the CPU's capability as torch
    dispatches to it (AVX2, AVX512, ...); on CUDA the GPU and driver."""
    version = lambda p: next((d.version for d in importlib.metadata.distributions(name=p)), None)  # noqa: E731
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "triton": version("triton"), "transformers": version("transformers"), "platform": platform.platform(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=p.total_memory / 2 ** 30,
                   driver_cuda=getattr(torch._C, "_cuda_getDriverVersion", lambda: None)())
    return env


def reset_peak_memory(device):
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device):
    if torch.device(device).type == "cuda":
        return {"what": "torch.cuda.max_memory_allocated / max_memory_reserved since the run began",
                "allocated_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30,
                "reserved_gib": torch.cuda.max_memory_reserved(device) / 2 ** 30}
    import resource  # POSIX
    return {"what": "the process's peak resident set (getrusage ru_maxrss)",
            "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}  # KiB on Linux


# ---- where greedy outputs part ----
@torch.inference_mode()
def top2_margin(target, prompt, prefix):
    """The target's top-1 minus top-2 logit after prompt + prefix (ids), and in steps of its dtype at the top logit."""
    cache = target.new_cache(batch=1, max_len=prompt["input_ids"].shape[1] + len(prefix))
    embeds, deepstack = speculate.embed_prompt(target, prompt)  # (1, L, D)
    x_last = speculate.prefill(target, prompt, embeds, cache, deepstack, name="target")  # (1, 1)
    x = torch.cat([x_last, torch.tensor([prefix], dtype=torch.long, device=x_last.device).view(1, -1)], 1)  # (1, 1 + j)
    top = target(x, cache=cache, logits_to_keep=1)[0, -1].topk(2).values  # (2,) in the logits' dtype
    info = torch.finfo(top.dtype)
    step = info.eps * 2.0 ** math.floor(math.log2(max(abs(float(top[0])), info.tiny)))  # spacing at the top logit
    margin = float(top[0]) - float(top[1])  # in Python floats: a bf16 subtraction would round the gap itself
    return margin, margin / step


def divergences(target, prompts, reference, outputs):
    """Each greedy output that leaves the reference (target-only's): where, and the target's top-2 margin there. In
    bf16 the verify step's batched matmuls round unlike single steps and can flip a near-tie: the margin tells."""
    out = []
    for i, (prompt, ref, got) in enumerate(zip(prompts, reference, outputs)):
        if ref != got:
            j = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            margin, steps = top2_margin(target, prompt, ref[:j])
            out.append({"prompt": i, "position": j, "top2_margin": margin, "margin_steps": steps,
                        "target_only_token": ref[j] if j < len(ref) else None,
                        "speculative_token": got[j] if j < len(got) else None})
    return out


def divergence_lines(res):
    """'identical' only where every greedy output is; else each diverging prompt with the target's margin there."""
    n, div, dt = res["prompts"], res["divergences"], res["dtype"]
    if not div:
        return [f"greedy outputs identical to target-only on all {n} prompts"]
    return [f"greedy outputs identical to target-only on {n - len(div)} of {n} prompts; where the others diverge "
            "(first differing token, the target's top-1 minus top-2 logit there):"] + [
        f"  prompt {d['prompt']}: token {d['position']}, margin {d['top2_margin']:.4g} ({d['margin_steps']:.1f} {dt} "
        "steps at the top logit)" for d in div] + [
        "  greedy speculative decoding is exact in fp32 (tests/test_speculate.py): this is a bug" if dt == "fp32" else
        f"  a margin of a few {dt} steps is a near-tie that the verify step's batched {dt} matmuls rounded the other "
        "way; in fp32 the outputs are identical"]
