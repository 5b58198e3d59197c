"""Speculation chosen for the machine it runs on: the dtype the hardware runs natively, a cost profile measured here,
and one chooser over target-only, the chains of gamma 1-8 and a family of draft trees. The paper fixes its decoder on
one machine; a verify of N tokens costs a few one-token steps on one CPU and one step on another, so the fastest
decoder (and whether to speculate at all) is a property of the hardware. Sequoia (arXiv 2402.12374) sizes its tree
from the device's own verify-cost curve; here the same curve also chooses between no speculation, a chain and a tree.

- The profile: the target's and the draft's forward time against tokens per forward and rows, a draft tree's levels
  (tree.grow) and what a round costs beyond its forwards (read off real decodes), for the dtype and the mode (eager
  or compiled) that will run. Seconds; cached under runs/choose/ by what decides it (the device or CPU
  capability, threads, torch, dtype, mode, the models' configs, the prompt's length, rows) and reused.
- The acceptance: each candidate's rounds on val plans, 64 rows at least (real decoding: the same tokens on any
  machine, so it depends on the models, the scenes and the decoding, not the hardware); cached the same way, and
  bench.py's default run's shipped beside the toy's checkpoints.
- The prediction: a plan's ms = its rounds x the round's time (target-only: one step per token), and a candidate's
  predicted speed-up the mean over the half of the val plans where it gains least (TAIL). A round's time is its
  forwards plus its kind's overhead, or, for target-only and the candidates that may win, a real decode's: the
  chooser times the two fastest predicted by real decodes of a val plan (its own rows and prompts, the decoding that
  will run) until both are timed ones (the forwards' sum misses what a round does between them, a share that differs
  by machine, mode, rows and decoding, and by kind: it first times the fastest chain and the fastest tree, and each
  calibrates its kind's untimed candidates). Each is timed beside target-only, plan by plan, and kept as its median
  ratio to it: a load that slows both cancels. Past its cap the chooser times only a candidate predicted fastest of
  all; it keeps the fastest timed one and the runner-up. Target-only is a candidate, so it never runs a decoder
  predicted slower than not speculating.

run: python bench.py --device cpu        (the profile, each candidate's prediction, the chosen and the runner-up timed)
"""
import hashlib
import json
import os
import platform
import statistics
import time

import torch

import evaluate
from model import VLA, causal_mask
from ops import checkpoint, cli, files
from measure import flags, timing
import speculate
from speculate import EMBED_KEYS, GREEDY, Chain, prefill
import tree
from tree import TreeShape

GAMMAS = tuple(range(1, 9))  # the chains a choice may run
FAMILY = (TreeShape(8, 4, 3), *evaluate.TREES)  # EAGLE-2 trees: 16/32 nodes at depth 6/8, and a small one for B rows
CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "choose")
# what ships beside the toy's checkpoints, read where CACHE has no file for the key: the val rounds of bench.py's
# default run (one row, greedy, fp32), which no hardware changes and which take minutes to decode (64 plans x 13
# candidates), copied from CACHE after that run (docs/results.md names the file)
SHIPPED = os.path.join(checkpoint.SHIPPED, "choose")
# --compile's target step lengths: a chain's or a tree's verify runs padded to the next (ops/compiled.py), so the 8
# chains and the family compile 7 graphs, and the profile times each chain at its padded length
COMPILED_LENGTHS = (1, 2, 3, 5, 9, 17, 33)
PROFILE_METHOD = 12  # bumped when measure_profile measures another way: a cached profile of the old way is stale
REPS = 2  # each profiled forward, in each round: the median (here: the mean) of REPS calls
# each stage of the profile's forwards (the forwards, the overhead decodes) runs rounds while its share STAGE_S of the
# profile's seconds allows, at least MIN_ROUNDS and at most MAX_ROUNDS, and keeps the least of them: a load that comes
# and goes only adds time, so more rounds read truer, and a cheap profile (one row) affords more of them than a dear
# one (a decode at 6 rows costs as much as 50 forwards)
STAGE_S, MIN_ROUNDS, MAX_ROUNDS = 2.0, 2, 5
TIMED_PASSES = 3  # the timed val decodes' passes over their plans (paired_rounds: each plan's decodes back to back)
# at several rows a plan, their passes, over TIMED_MIN_PLANS plans at least: a decode of six rows costs as much as three
# or four of one, and a ratio read off one plan carries that plan's rows, whichever it drew
TIMED_PASSES_ROWS, TIMED_MIN_PLANS = 2, 2
PROFILE_S = 12.0  # past these seconds (or MAX_TIMED timed), only the one predicted fastest is timed, once
# the real decodes whose time per round, less the profile's forwards, is a round's overhead: a tree round's, and a
# chain's as a + b gamma (each draft step's feed and argmax beside its forward) from the shortest and the longest chain.
# Target-only's step is its forward alone: what it adds is a factor common to every candidate's predicted speed-up
# (it ranks them the same), and the chooser times target-only's real decodes beside the fastest
OVERHEAD_DECODERS = {"chain 1": Chain(1), "chain 8": Chain(8), "tree": FAMILY[1]}
VAL_PLANS = 16  # the val plans whose rounds choose (of --batch prompts each: a plan's rounds are its slowest row's),
# and more where they hold fewer than VAL_ROWS rows in all: a plan of one row is one sample of a chain's acceptance, and
# a long chain's tau over 16 of them is one lucky or unlucky draw of val scenes (docs/results.md)
VAL_ROWS = 64
# the share of val plans a prediction reads: each candidate's hardest (a lower-tail mean of its per-plan speed-ups,
# CVaR). The scenes a decoder will run on are not val's: the draft was trained on val's distribution, and a deployment
# (the toy's test split: combinations never in train or val) is harder for it. Where its acceptance drops, a chain's
# gain shrinks more than a tree's (a chain stops at its first wrong token, a tree has other branches), so the mean over
# every val plan ranks long chains too high and predicts too much; the harder half ranks by what survives the shift
TAIL = 0.5
ACCEPTANCE_METHOD = 2  # bumped when the acceptance record holds another thing: here each plan's rounds
TIMED_TOP = 2  # the chooser times real decodes of the fastest predicted candidates until these many are timed ones
# or MAX_TIMED candidates are: each costs two decodes of a plan, and where many candidates lie within a few percent of
# each other the ranking could move after every timing
MAX_TIMED = 3
TIMED_ROWS = 3  # the timed val decodes run as many plans as make this many rows (3 of 1), TIMED_MIN_PLANS at least
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of a CPU whose matrix units multiply bf16 natively


def candidates():
    """None (target-only), Chain(1..8), the trees of FAMILY."""
    return [None, *(Chain(g) for g in GAMMAS), *FAMILY]


def name(decoder):
    """target-only, chain 7, tree 16/8/3: a candidate's name in the records (timing.decoder_name's)."""
    return evaluate.TARGET_ONLY if decoder is None else timing.decoder_name(timing.decoder_json(decoder))


def shape_key(sh):
    """A TreeShape as --tree spells it: N/D/k (0, or None: the chain)."""
    return f"{sh.nodes}/{sh.depth}/{sh.width}" if sh else "0"


def val_prompts(batch=1, samples=1):
    """How many val prompts the chooser's plans take (`batch` prompts x `samples` rows a plan): VAL_PLANS plans, more
    where those would hold fewer than VAL_ROWS rows."""
    return batch * max(VAL_PLANS, -(-VAL_ROWS // (batch * samples)))


# ---- the dtype the hardware runs natively ----
def cpu_flags():
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def auto_dtype(device):
    """(--dtype name, why): bf16 where the hardware multiplies it natively (CUDA with bf16, a CPU with AVX-512 BF16 or
    AMX), else fp32: an emulated bf16 matmul converts every operand and runs slower than fp32's."""
    device = torch.device(device)
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        return ("bf16", f"{gpu} runs bf16 natively") if torch.cuda.is_bf16_supported() else \
            ("fp32", f"{gpu} has no native bf16")
    cap, native = torch.backends.cpu.get_cpu_capability(), [f for f in NATIVE_BF16 if f in cpu_flags()]
    if native:
        return "bf16", f"the CPU ({cap}) multiplies bf16 natively ({', '.join(native)})"
    return "fp32", f"the CPU ({cap}) has no native bf16 (no AVX-512 BF16, no AMX): bf16 would run emulated"


def hardware(device):
    """The device's name: the GPU's, or the CPU's with torch's vector capability (AVX2, AVX512, ...)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


# ---- the cost profile ----
def config_id(model):
    """What decides a model's step time: its config (the weights' values do not), hashed."""
    return checkpoint.config_hash(getattr(model, "model", model).cfg.to_dict())  # a CompiledSteps' model's


def dtype_of(model):
    """The weights' dtype of a model (or of a CompiledSteps' model)."""
    return next(getattr(model, "model", model).parameters()).dtype


def plans_id(plans):
    """The plans' prompt tokens, hashed: which val plans a record was measured on."""
    return hashlib.sha256(b"".join(p["input_ids"].cpu().numpy().tobytes() for p in plans)).hexdigest()[:16]


def profile_key(target, draft, prompt, dtype, mode, rows):
    device = prompt["input_ids"].device
    return {"method": PROFILE_METHOD, "hardware": hardware(device), "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "dtype": str(dtype).removeprefix("torch."), "mode": mode, "rows": rows, "target": config_id(target),
            "draft": config_id(draft), "prompt_tokens": prompt["input_ids"].shape[1],
            "trees": [shape_key(sh) for sh in FAMILY], "gammas": list(GAMMAS)}


def cached(kind, key, measure, again=False, log=cli.progress):
    """measure()'s result, kept in CACHE under key's hash and reused while key holds (from SHIPPED where CACHE has no
    file); again: measured anew. A cache file that cannot be read, or was written for another key, is measured again
    with one line."""
    name = f"{kind}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    path = os.path.join(CACHE, name)
    p = path if os.path.lexists(path) else os.path.join(SHIPPED, name)
    if not again and os.path.lexists(p):
        try:
            rec = files.read_json(p)
            if rec.get("key") != key or "value" not in rec:
                raise ValueError(f"{p}: written for another key")
            return rec["value"], f"reused {p}"
        except (OSError, ValueError) as e:
            log(f"{kind} cache {cli.one_line(e)}: measuring again")
    value = measure()
    try:
        os.makedirs(CACHE, exist_ok=True)
        files.write_json(path, {"key": key, "value": value})
        return value, f"measured now, cached in {path}"
    except OSError as e:  # a read-only checkout still runs: the choice just is not reused
        return value, f"measured now (not cached: {cli.one_line(e)})"


@torch.no_grad()
def measure_profile(target, draft, prompt, rows=1, stop_token=None, max_new=evaluate.MAX_NEW_TOKENS):
    """{"target": {n: s}, "verify": {N: s}, "draft": {n: s}} (one forward of n tokens over `rows` rows after the prompt,
    a chain's verify; a tree's verify of N + 1 as tree_forward runs it), "grow": {tree: s} (its levels after the root,
    tree.grow), "overhead": {kind: s} (a chain round's and a tree round's time beyond their forwards, read off real
    decodes of the prompt). Every measurement is taken in each of least_of_rounds' rounds, all
    of them back to back in each, and the least of its rounds kept: a machine's load that comes and goes only adds
    time."""
    device, L = prompt["input_ids"].device, prompt["input_ids"].shape[1]
    embeds = target.embed(**{k: prompt[k] for k in EMBED_KEYS if prompt.get(k) is not None})  # (1, L, D)
    # the decode's cache (speculate.new_cache: the prompt but its last token, max_new, a round's N nodes), which a tree
    # verify's mask spans whole
    size = L - 1 + max_new + max(sh.nodes for sh in FAMILY)

    def primed(m):  # m's cache of `rows` rows holding the prompt but its last token (one prefill, its rows copied)
        cache = m.new_cache(batch=rows, max_len=size)
        prefill(m, prompt, embeds, cache, samples=rows)
        return cache

    caches = {"target": primed(target), "draft": primed(draft)}  # a step writes past the length, commits nothing

    def forward(m, n, tree=False):  # one step of n tokens, as spec_round (feed's mask) or tree_forward runs it
        cache = caches["target" if m is target else "draft"]
        x = prompt["input_ids"][:, -1:].repeat(rows, n)  # (B, n): values do not change the work
        slots = cache.slots(n)  # (B, n)
        mask = causal_mask(slots, cache, cache.max_len if tree else cache.length + n)  # (B, n, S)
        step = lambda: m.step(x, slots, cache, positions=slots, mask=mask)  # noqa: E731
        return lambda: timing.median_time(step, device, REPS, warmup=0)  # least_of_rounds' round warms it up

    # tree.grow from the draft's root logits (timing.grow_time's, on B rows): the D - 1 levels and the tree's
    # construction, written past the committed length, nothing committed: re-runnable
    grown = primed(draft)
    q = speculate.feed(draft, grown, prompt["input_ids"][:, -1:].repeat(rows, 1))[:, -1]  # (B, V): q at the root
    root = torch.tensor(grown.lengths, device=device)  # (B,)
    grow = getattr(draft, "fused", lambda f: f)(tree.grow)

    def levels(sh):
        return lambda: timing.median_time(lambda: grow(draft, grown, q, root, sh), device, REPS, warmup=0)

    timers = {**{("target", n): forward(target, n) for n in range(1, max(GAMMAS) + 2)},
              **{("verify", sh.nodes): forward(target, sh.nodes + 1, tree=True) for sh in FAMILY},
              **{("draft", n): forward(draft, n) for n in (1, 2)},
              **{("grow", shape_key(sh)): levels(sh) for sh in FAMILY}}
    least = least_of_rounds(timers) | least_of_rounds(
        {("decode", kind): lambda run=decode_timer(target, draft, [prompt], d, rows, stop_token, max_new): run(0)
         for kind, d in OVERHEAD_DECODERS.items()})
    prof = {}
    for (kind, n), t in least.items():
        prof.setdefault(kind, {})[n] = t
    t = prof["target"]  # a step of more tokens never costs less: what looks cheaper than a longer one is noise
    for n in sorted(t, reverse=True)[1:]:
        t[n] = min(t[n], t[n + 1])
    # beyond the forwards: sampling or argmax, the verify's walk, the caches' commits, the host's loop
    # signed: where a decode runs faster than its forwards timed alone (caches warm, the host's loop overlapping the
    # device), the overhead is negative, and a round's time is still what the decode measured
    o = {kind: prof["decode"][kind] - round_forwards_s(prof, d) for kind, d in OVERHEAD_DECODERS.items()}
    per_step = (o["chain 8"] - o["chain 1"]) / 7
    prof["overhead"] = {"tree": o["tree"], "chain": o["chain 1"] - per_step, "chain_step": per_step}
    del prof["decode"]  # each of these decodes' rounds is its forwards plus its overhead again: round_s gives it
    return prof


def rounds_of(timers, warm=True):
    """{what: [its time in each round]} of each timer (a callable -> s), after a warm-up round, untimed, if warm (first
    calls allocate and pick kernels); every timer runs in every round, the order rotated from round to round;
    MIN_ROUNDS rounds, then more while the next one still ends within STAGE_S of the start (MAX_ROUNDS at most)."""
    t0 = time.perf_counter()
    for t in timers.values() if warm else ():
        t()
    out, r = {what: [] for what in timers}, 0
    while r < MIN_ROUNDS or r < MAX_ROUNDS and (time.perf_counter() - t0) * (r + 1) / r <= STAGE_S:
        for what in list(timers)[r % len(timers):] + list(timers)[:r % len(timers)]:
            out[what].append(timers[what]())
        r += 1
    return out


def least_of_rounds(timers, warm=True):
    """{what: the least of its rounds' timings} (rounds_of's): a load that comes and goes only adds time."""
    return {what: min(ts) for what, ts in rounds_of(timers, warm).items()}


def paired_rounds(timers, reference, n_plans, device, passes=None):
    """{reference: the least of its timings; every other timer: that least x the median, over every plan of every
    pass, of its round over reference's on the same plan}: timers {what: run(j) -> s per round of plan j}, timed by
    timing.interleaved (passes, TIMED_PASSES by default, over n_plans plans, each plan's decodes back to back, the order
    rotated; a warm-up on the first plan). A candidate's round is compared with target-only's taken on the same plan
    moments before or after: a load that slows both cancels, and one that falls on one of them moves one ratio of
    many, which the median drops."""
    runs = timing.interleaved(timers, n_plans, passes or TIMED_PASSES, device)
    per = {what: [x.result for p in by_pass for x in p] for what, by_pass in runs.items()}  # [pass x plan]
    ref = per[reference]
    return {what: min(ref) if what == reference else min(ref) * statistics.median(t / r for t, r in zip(v, ref))
            for what, v in per.items()}


def decode_timer(target, draft, plans, decoder, rows, stop_token, max_new, samples=None, sampling=GREEDY):
    """run(j) -> a real decode's seconds per round of plans[j] (its rows x samples; samples None: its one row copied to
    `rows`) under sampling (its seeds: the same draws every call); a plan's round lasts until every row is done.
    decoder None: target-only, whose round is one step."""
    kw = dict(samples=rows if samples is None else samples, stop_token=stop_token, timing=True, sampling=sampling)

    def run(j):
        rs = speculate.autoregressive_batch(target, plans[j], max_new, **kw) if decoder is None else \
            speculate.speculative_batch(target, draft, plans[j], decoder, max_new, **kw)
        return max(r.decode_s for r in rs) / max(r.rounds for r in rs)
    return run


def round_forwards_s(prof, decoder):
    """A round's forwards (s) in the profile: target-only one step; a chain gamma draft steps and a verify of gamma + 1;
    a tree its root step, its levels and a verify of N + 1."""
    t, d = prof["target"], prof["draft"]
    if decoder is None:
        return t[1]
    if decoder.kind == "chain":
        return decoder.gamma * d[1] + t[decoder.gamma + 1]
    return d[1] + prof["grow"][shape_key(decoder)] + prof["verify"][decoder.nodes]


def summed_round_s(prof, decoder):
    """A round's time (s) summed from the profile: its forwards and its kind's overhead (a chain's: a + b gamma)."""
    o = prof["overhead"]
    if decoder is None:
        return round_forwards_s(prof, None)
    steps = decoder.gamma * o["chain_step"] if decoder.kind == "chain" else 0.0
    return round_forwards_s(prof, decoder) + o[decoder.kind] + steps


def round_s(prof, decoder):
    """A round's predicted time (s): a real decode's where the profile timed one (prof["rounds"]), else its summed
    time times its kind's calibration (prof["calibration"], calibrated)."""
    if name(decoder) in prof.get("rounds", {}):
        return prof["rounds"][name(decoder)]
    return summed_round_s(prof, decoder) * prof.get("calibration", {}).get(decoder and decoder.kind, 1.0)


def calibrated(prof):
    """prof with {kind: the median of its timed candidates' real rounds over their summed ones} (prof["calibration"]):
    what the sum misses (masks built, paths walked, tokens fed one by one, the host's loop) is a share that differs by
    kind, chain or tree, more than by size within one, so a timed chain or tree corrects its kind's untimed ones."""
    timed = [c for c in candidates() if c is not None and name(c) in prof["rounds"]]
    return prof | {"calibration": {k: statistics.median(prof["rounds"][name(c)] / summed_round_s(prof, c)
                                                        for c in timed if c.kind == k)
                                   for k in {c.kind for c in timed}}}


def from_json(prof):
    """A profile read back from JSON (its token counts are string keys there)."""
    return {k: {int(n) if k in ("target", "verify", "draft") else n: s for n, s in v.items()} for k, v in prof.items()}


def shared_prefill(target):
    """The eager target with each plan's prefill computed once (evaluate.SharedPrefill): a decode's rounds and its
    decode_s never include the prefill, which at six rows of distinct prompts costs more than the decode; compiled
    steps keep their own caches."""
    return evaluate.SharedPrefill(target) if isinstance(target, VLA) else target


def timed_rounds(prof, acceptance, rows, target, draft, plans, samples, sampling, stop_token, max_new, mode,
                 reprofile=False, spent_s=0.0):
    """prof with the rounds of real decodes of val plans (prof["rounds"]: their rows, their own prompts, the decoding
    that will run; the profile's own decodes copy one prompt's row and run greedy) for target-only and the fastest
    predicted, each batch timed beside target-only (paired_rounds, cached as the profile is): first the fastest chain
    and the fastest tree, which calibrate their kinds' other candidates (calibrated), then the TIMED_TOP fastest not
    yet timed, the ranking redone after each batch, until the top TIMED_TOP are timed rounds. Past the cap (MAX_TIMED
    candidates timed, or the profile's seconds, spent_s before these decodes, past PROFILE_S) it times once more, and
    only the one predicted fastest of all, if a forwards' sum: ranking puts a timed round first, so a candidate never
    timed would otherwise lose to a timed one it is predicted to beat."""
    t0 = time.perf_counter() - spent_s
    base = profile_key(target, draft, plans[0], dtype_of(target), mode, rows) | {
        "plan": plans_id(plans), "samples": samples, "decoding": flags.sampling_json(sampling)}
    prof, ref, shared = prof | {"rounds": {}}, evaluate.TARGET_ONLY, shared_prefill(target)
    while True:
        timed = prof["rounds"]
        capped = len(timed) > MAX_TIMED or timed and time.perf_counter() - t0 > PROFILE_S  # len: target-only's too
        ranked = choose(predict(prof, acceptance, rows))
        # the first batch: the fastest chain and the fastest tree, which calibrate their kinds (calibrated)
        ranked = [next(c for c in ranked if c and c.kind == k) for k in ("chain", "tree")] if not timed else \
            ranked[:1 if capped else TIMED_TOP]
        todo = [c for c in ranked if c is not None and name(c) not in timed][:max(1, MAX_TIMED + 1 - len(timed))]
        if not todo:
            return prof
        cli.progress(f"timing real decodes of a val plan: {', '.join(map(name, todo))} (the fastest predicted) beside "
                     "target-only")
        timers = {name(c): decode_timer(shared, draft, plans, c, rows, stop_token, max_new, samples, sampling)
                  for c in [None, *todo]}
        got, _ = cached("rounds", base | {"decoders": sorted(timers)}, lambda: paired_rounds(
            timers, ref, len(plans), plans[0]["input_ids"].device, TIMED_PASSES if rows == 1 else TIMED_PASSES_ROWS),
            reprofile)
        # each batch's ratios over its own target-only, on one scale: the first batch's target-only round
        scale = timed.get(ref, got[ref]) / got[ref]
        prof = calibrated(prof | {"rounds": {ref: got[ref]} | timed | {n: s * scale for n, s in got.items()
                                                                       if n != ref}})
        if capped:
            return prof


def timed_plans(val_plans, rows):
    """The val plans the timed decodes run: as many as make TIMED_ROWS rows, TIMED_MIN_PLANS at least (3 of one row,
    2 of six)."""
    return val_plans[:max(TIMED_MIN_PLANS, TIMED_ROWS // rows)]


def profile(target, draft, prompt, rows=1, stop_token=None, max_new=evaluate.MAX_NEW_TOKENS, mode="eager",
            reprofile=False):
    """(this machine's profile, how it was had: reused from the cache or measured now)."""
    cli.progress(f"the machine's cost profile ({mode}, {rows} row(s)): the target's and the draft's forwards")
    prof, how = cached("profile", profile_key(target, draft, prompt, dtype_of(target), mode, rows),
                       lambda: measure_profile(target, draft, prompt, rows, stop_token, max_new), reprofile)
    return from_json(prof), how


def speedup(prof, decoder, tau):
    """The profile's predicted speed-up of a decoder at tau tokens per round (one row): tau T(target-only) /
    T(round)."""
    return tau * round_s(prof, None) / round_s(prof, decoder)


# ---- the acceptance on val: rounds per plan ----
@torch.no_grad()
def measure_acceptance(target, draft, plans, max_new, stop_token, sampling=GREEDY, samples=1):
    """{candidate name: {"rounds", "tokens" (summed over the val plans), "plan_rounds" (each plan's)}}: a plan is a
    prompt of B / samples rows, every row `samples` times; its rounds are its slowest row's (a batch runs until every
    row is done), target-only's rounds its steps. Real decoding, so exact; plan j's rows seeded as timing.plans seeds
    them."""
    target = shared_prefill(target)
    out = {}
    for c in candidates():
        plan_rounds, tokens = [], 0
        for j, p in enumerate(plans):
            kw = dict(samples=samples, stop_token=stop_token, sampling=sampling.offset(p["input_ids"].shape[0]
                                                                                        * samples * j))
            rs = speculate.autoregressive_batch(target, p, max_new, **kw) if c is None else \
                speculate.speculative_batch(target, draft, p, c, max_new, **kw)
            plan_rounds.append(max(r.rounds for r in rs))
            tokens += sum(len(r.tokens) for r in rs)
        out[name(c)] = {"rounds": sum(plan_rounds), "tokens": tokens, "plan_rounds": plan_rounds}
    return out


# ---- the chooser ----
def lower_tail(values, share=None):
    """The mean of the smallest `share` of values (TAIL when None; at least one value): CVaR at that share."""
    return statistics.fmean(sorted(values)[:max(1, round((TAIL if share is None else share) * len(values)))])


def predict(prof, acceptance, rows=1):
    """{candidate name: {"tau" (a row's tokens per round), "round_ms", "timed" (round_ms a real decode's),
    "predicted_speedup" (over the TAIL share of val plans where it gains least), "val_mean_speedup" (over all)}}: a
    plan's speed-up is target-only's ms over the candidate's, each rounds x round_s."""
    t0, base = round_s(prof, None), acceptance[evaluate.TARGET_ONLY]
    out = {}
    for c in candidates():
        a, r = acceptance[name(c)], round_s(prof, c)
        per_plan = [b * t0 / (n * r) for b, n in zip(base["plan_rounds"], a["plan_rounds"])]
        out[name(c)] = {"tau": a["tokens"] / a["rounds"] / rows if c else 1.0, "round_ms": 1e3 * r,
                        "timed": name(c) in prof.get("rounds", {}), "predicted_speedup": lower_tail(per_plan),
                        "val_mean_speedup": base["rounds"] * t0 / (a["rounds"] * r)}
    return out


def choose(predicted):
    """The candidates fastest predicted first (decoders, None for target-only)."""
    return sorted(candidates(), key=lambda c: -predicted[name(c)]["predicted_speedup"])


def ranking(predicted):
    """The chosen, then the runner-up, ...: the timed candidates fastest predicted first, then the others. A round
    read off real decodes of val plans outranks one summed from the forwards, which misses what a round does between
    them: where the timing stopped short (MAX_TIMED, PROFILE_S), an untimed candidate never runs first."""
    return sorted(choose(predicted), key=lambda c: not predicted[name(c)]["timed"])


def stream_tree(target, draft, val_prompts, max_new, stop_token, sampling=GREEDY, samples=1, reprofile=False):
    """The tree a stream runs (beyond/stream.py: its tree arm's, and the tree merged with the stream's proposal): the
    chooser's fastest decoder for one frame's plan of `samples` rows on this machine, eager (val_prompts: batch-1 val
    prompts, each a plan); a chain of gamma as the tree of width 1, target-only passed over (the stream's target-only
    arm is timed beside it). -> (TreeShape, the chooser's record)."""
    ranked, rec = choice(target, draft, val_prompts[0], val_prompts, max_new, stop_token, sampling, samples,
                         reprofile=reprofile)
    best, second = [c for c in ranked if c is not None][:2]
    rec |= {"chosen": name(best), "runner_up": name(second), "target_only_fastest": ranked[0] is None}
    return (best if best.kind == "tree" else TreeShape(best.gamma, best.gamma, 1)), rec


def acceptance_key(target, draft, val_plans, max_new, stop_token, sampling=GREEDY, samples=1):
    """What decides the val rounds: the models' weights, their dtype, the plans, the decoding, the candidates."""
    return {"method": ACCEPTANCE_METHOD, "target": checkpoint.fingerprint(getattr(target, "model", target)),
            "draft": checkpoint.fingerprint(getattr(draft, "model", draft)), "dtype": str(dtype_of(target)),
            "max_new": max_new, "plans": len(val_plans), "prompts": plans_id(val_plans),
            "rows": val_plans[0]["input_ids"].shape[0] * samples,
            "samples": samples, "stop_token": stop_token, "decoding": flags.sampling_json(sampling),
            "candidates": [name(c) for c in candidates()]}


def choice(target, draft, prompt, val_plans, max_new, stop_token, sampling=GREEDY, samples=1, mode="eager",
           reprofile=False):
    """The chooser end to end -> (the candidates ranked, fastest predicted first; the record: the profile, each
    candidate's prediction, how each part was had). prompt: one val prompt (batch 1) the profile runs on; val_plans:
    the plans whose rounds are counted."""
    rows = val_plans[0]["input_ids"].shape[0] * samples
    t0 = time.perf_counter()
    prof, how_p = profile(target, draft, prompt, rows, stop_token, max_new, mode, reprofile)
    profile_s = time.perf_counter() - t0
    key = acceptance_key(target, draft, val_plans, max_new, stop_token, sampling, samples)
    cli.progress(f"each candidate's rounds on {len(val_plans)} val plan(s) (once per models and decoding)")
    acc, how_a = cached("acceptance", key, lambda: measure_acceptance(target, draft, val_plans, max_new, stop_token,
                                                                      sampling, samples))
    t0 = time.perf_counter()
    timed = timed_plans(val_plans, rows)
    prof = timed_rounds(prof, acc, rows, target, draft, timed, samples, sampling, stop_token, max_new, mode,
                        reprofile, profile_s)
    profile_s += time.perf_counter() - t0  # the profile's seconds on this run: ~0 where both were reused
    predicted = predict(prof, acc, rows)
    for n, v in predicted.items():  # the rounds a val plan took: beside a held-out plan's, the acceptance's shift
        v["val_rounds_per_plan"] = acc[n]["rounds"] / len(val_plans)
    ranked = ranking(predicted)
    t1 = prof["target"][1]
    return ranked, {
        "what": "the decoder predicted fastest on this machine: rounds x the profile's round time, over the half of "
                "the val plans where each candidate gains least",
        "chosen": name(ranked[0]), "runner_up": name(ranked[1]), "mode": mode, "rows": rows, "profile": how_p,
        "profile_s": profile_s,
        "acceptance": how_a, "predicted": predicted, "steps_ms": {str(n): 1e3 * s for n, s in prof["target"].items()},
        "verify_ms": {str(n): 1e3 * s for n, s in prof["verify"].items()},
        "draft_ms": {str(n): 1e3 * s for n, s in prof["draft"].items()},
        "overhead_ms": {k: 1e3 * s for k, s in prof["overhead"].items()},
        "timed_rounds_ms": {k: 1e3 * s for k, s in prof["rounds"].items()}, "calibration": prof["calibration"],
        "steep": [n + 1 for n, s in prof["verify"].items() if s > 2 * t1]}  # verifies costing > 2 one-token steps
