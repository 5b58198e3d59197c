"""Latency benchmark of the reasoning step: target-only decoding vs the two reasoners
(draft q proposes, target p verifies), both arms in one process on the same prompts.

Paper: the reasoning step (the chain-of-causation decode) dominates a plan's latency and
is what RSD accelerates (~4x reported on a GPU). The measured speed-up is
ms/token(target-only) / ms/token(speculative) over the reasoning step only; the prefill
(vision tower + prompt) is timed and reported separately because both arms share it.
The cost model beside it (Leviathan et al.; docs/background.md, "Speculative decoding"):

    predicted speed-up = tau * T_target(1) / (gamma * T_draft(1) + T_target(gamma + 1))

Fairness: the target-only arm is speculate.autoregressive, the same KV-cached single-token
forward the verifier uses, in the same dtype; every shape is warmed up first; the device is
synchronised before each clock reading (timing.Clock, the one timer); the arms alternate
within each repeat and the median of the repeats is reported. tau, alpha and greedy exactness
come from evaluate.spec_stats, as in rsd.py and aarl.py.

Decoding: greedy by default; --temperature > 0 (with --top-k / --top-p) times both arms sampling, as
Alpamayo-R1's released inference samples its CoC, and reports the sampled runs' tau and alpha beside
greedy's (prompt i's generator seeded --sampling-seed + i). Sampled outputs are lossless in distribution,
not token by token, so only the greedy runs are compared with target-only decoding; where a greedy output
differs (in bf16 the verify step's batched matmuls can flip a near-tie), the report names the prompt, the
first differing token and the target's top-2 logit margin there.

--compile adds two arms timed in the same passes: target-only and speculative decoding through
static.StaticDecoder (fixed-shape steps over one persistent cache: the 1-token step, the
(gamma+1)-token verify step and the draft's step, torch.compile'd; inductor on a CPU, CUDA graphs
on CUDA), with their own greedy check, cost model and compile time. Eager stays the default:
compiling takes minutes, and where Python dispatch is not the bottleneck it buys nothing.

What a reader of a GPU number needs besides it is in the JSON: `environment` (GPU, torch, the CUDA and cuDNN torch
was built with, triton), `peak_memory`, `sdpa` (the attention kernel of the target's prefill, decode and verify
steps, and of the static steps --compile compiles: sdpa_steps), and with --compile `compiled.compilations`
(CompileWatch: dynamo's compilations per step shape in each phase, none allowed after the compile pass; on CUDA the
CUDA graphs captured, replayed and skipped, with inductor's reasons). Random weights (--preset, or --target without
--draft) predict the speed-up at a recorded toy acceptance: experiments/bench_cpu.json, or the --toy-json given,
named in the report with its settings.

A real checkpoint (--target) runs the whole plan on pixels (--images-dir, or generated images):
prefill (vision tower + prompt), the reasoning step (both arms) and, for an Alpamayo folder, the
trajectory (the flow-matching action expert over the cache of prompt + CoC), each timed; the CoC
is printed with the target's own tokens in [brackets]. Its prompt is Alpamayo-R1's, built by
alpamayo.build_prompt, when the folder (or --processor) has a tokenizer; otherwise the prompt's
layout with placeholder text ids around the same pixels.

run: python bench.py --device cpu [--compile]                     (the toy, from the shipped checkpoints/toy)
     python bench.py --device cuda --preset qwen2.5-vl-7b          (real shapes, random weights)
     python bench.py --device cuda --preset qwen3-vl-8b --draft-vocab 32768   (the draft's head over 32k ids)
     python bench.py --device cuda --target PATH [--draft PATH]    (a Hugging Face / Alpamayo folder)
     python bench.py --device cpu --peer hf                         (also transformers' generate and assisted
                                                                    generation on the same weights: peer.py)
"""
import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import re
import statistics
import warnings

import torch
import torch.nn.functional as F

import alpamayo
import checkpoint
import driving
import evaluate
import model as M
import peer
import speculate
import static
from checkpoint import DTYPES
from evaluate import TARGET_ONLY
from expert import config_field, speed_from_history
from timing import (Clock, expected_speedup, expected_tau, measured_speedup, median_time, step_times, tree_speedup,
                    tree_step_times)
from tree import TreeShape

TOY_DRAFT = ("aarl", 0)  # the toy mode's default draft: FlatRoPE + AARL (static anchor), seed 0
TOY_JSON = "runs/bench_toy.json"  # where the toy mode writes its report (whatever settings that run had)
ROOT = os.path.dirname(os.path.abspath(__file__))
# The real-shape mode's prediction reads a recorded toy acceptance from a committed experiment (32 held-out
# prompts, bf16, the shipped FlatRoPE + AARL draft, gamma 6, greedy), so a fresh machine needs no CPU run first
# and the number does not depend on whichever toy benchmark ran last; --toy-json names another.
TOY_ACCEPTANCE = os.path.join("experiments", "bench_cpu.json")  # relative to ROOT; the chain's (gamma 6)
TOY_TREE_ACCEPTANCE = os.path.join("experiments", "bench_cpu_tree.json")  # the default tree's (evaluate.TREE)

# ---- timing ----


def cost_model(target, draft, prompt, gamma, tau, reps=20):
    """The measured step times in ms and the speed-up they predict at the measured tau. The chain (gamma an int):
    T_target(1), T_target(gamma + 1), T_draft(1) (timing.step_times, timing.measured_speedup). A tree (gamma a
    tree.TreeShape): also T_target(N + 1) of its verify and T_draft(k) of one level (timing.tree_step_times,
    timing.tree_speedup)."""
    if not isinstance(gamma, TreeShape):
        t = step_times(target, draft, prompt, (1, gamma + 1), reps)
        t1, tg, td = t["target"][1], t["target"][gamma + 1], t["draft"]
        return {"t_target_1": 1e3 * t1, "t_target_gamma1": 1e3 * tg, "t_draft_1": 1e3 * td,
                "predicted_speedup": measured_speedup(tau, t1, td, tg, gamma)}
    t = step_times(target, draft, prompt, (1,), reps)
    tt = tree_step_times(target, draft, prompt, (gamma.nodes,), gamma.width, reps)
    t1, td, tv, tl = t["target"][1], t["draft"], tt["target"][gamma.nodes], tt["draft_level"]
    return {"t_target_1": 1e3 * t1, "t_target_verify": 1e3 * tv, "t_draft_1": 1e3 * td, "t_draft_level": 1e3 * tl,
            "predicted_speedup": tree_speedup(tau, t1, td, tl, tv, gamma)}


def decoder(args):
    """The decoder the flags ask for: the chain of --gamma (--tree 0), or a tree.TreeShape (ValueError if the
    shape is impossible)."""
    if not args.tree:
        return args.gamma
    return TreeShape(args.tree, args.tree_depth, args.tree_width)


def decoder_json(gamma):
    if isinstance(gamma, TreeShape):
        return {"kind": "tree", "nodes": gamma.nodes, "depth": gamma.depth, "width": gamma.width}
    return {"kind": "chain", "gamma": gamma}


@torch.no_grad()  # the grad mode the compiled steps were warmed up in (evaluate.spec_stats): see CompileWatch
def time_arms(target, drafts, prompts, gamma, max_new, stop_token, repeats, decoding=None, extra=None,
              on_timed=None):
    """Reasoning-step latency of target-only decoding (arm TARGET_ONLY) and of speculative
    decoding with each draft in `drafts` (name -> draft), on every prompt: a warm-up pass first
    (every prompt, every shape), then `repeats` passes in which the arms alternate. Greedy, or
    sampled under `decoding` (evaluate.decoding_mode) with the same seeds in every pass.
    extra: more arms {name: (target, draft or None[, gamma])} timed in the same passes (--compile's
    StaticDecoder pair; with a gamma of its own, the chain beside a tree). on_timed: called between the warm-up and
    the timed passes (CompileWatch's phase).

    Returns {arm: {prefill_ms (per prompt), ms_per_token (reasoning step), speedup (vs
    target-only)}}, medians over the passes."""
    arms = {TARGET_ONLY: (target, None), **{name: (target, d) for name, d in drafts.items()}, **(extra or {})}
    arms = {name: (*arm, gamma)[:3] for name, arm in arms.items()}  # (target, draft, gamma) each
    for t, draft, g in arms.values():
        for i, p in enumerate(prompts):
            evaluate.decode(t, draft, p, g, max_new, stop_token, **evaluate.sampling_kwargs(decoding, i))
    passes = {name: [] for name in arms}
    if on_timed is not None:
        on_timed()
    for _ in range(repeats):
        for name, (t, draft, g) in arms.items():
            res = [evaluate.decode(t, draft, p, g, max_new, stop_token, timing=True,
                                   **evaluate.sampling_kwargs(decoding, i)) for i, p in enumerate(prompts)]
            tokens = sum(len(r.tokens) for r in res)
            passes[name].append((1e3 * sum(r.prefill_s for r in res) / len(res),
                                 1e3 * sum(r.decode_s for r in res) / tokens))
    out = {name: {"prefill_ms": statistics.median(p[0] for p in passes[name]),
                  "ms_per_token": statistics.median(p[1] for p in passes[name])} for name in arms}
    for name in arms:
        out[name]["speedup"] = out[TARGET_ONLY]["ms_per_token"] / out[name]["ms_per_token"]
    return out


COMPILED = ("target-only compiled", "speculative compiled")  # --compile's arms, timed beside the eager ones
CHAIN_ARM = "speculative chain"  # with a tree: the chain of evaluate.GAMMA, the same draft, timed in the same passes


def compiled_pair(target, draft, prompts, gamma, max_new):
    """target and draft as compiled static.StaticDecoder's with one static cache length for every prompt (the longest
    prompt's decode or cost-model step, plus the padding's slack) and steps of 1, 2 or gamma + 1 tokens, so each
    model compiles at most three graphs."""
    L = max(p["input_ids"].shape[1] for p in prompts)
    max_len = L + max(max_new, gamma + 1) + gamma
    lengths = (1, 2, gamma + 1)
    return (static.StaticDecoder(target, max_len, compile=True, step_lengths=lengths),
            static.StaticDecoder(draft, max_len, compile=True, step_lengths=lengths))


def benchmark(target, draft, prompts, gamma, max_new, stop_token=None, repeats=3, decoding=None, compile=False):
    """The full report for one draft: greedy statistics and where greedy outputs diverge from target-only decoding,
    the sampled statistics when `decoding` (evaluate.decoding_mode) samples, both arms timed in that mode, the cost
    model on the first prompt, the predictions at the timed mode's tau and alpha.
    compile: also both arms with torch.compile'd static-shape steps (static.StaticDecoder), timed in the same passes
    as the eager ones, with their own greedy check, cost model and compile time (res["compiled"])."""
    decoding = decoding or evaluate.decoding_mode()
    greedy = evaluate.spec_stats(target, {"speculative": draft}, prompts, gamma, max_new, stop_token)
    spec = greedy["speculative"]
    extra, comp, watch = None, {}, None
    if compile:
        ct, cd = compiled_pair(target, draft, prompts, gamma, max_new)
        watch = CompileWatch({"target": ct, "draft": cd})
        clock = Clock(prompts[0]["input_ids"].device, enabled=True)
        # the compiled arms' greedy outputs; the first decodes compile every step shape, and the clock says how long
        cg = evaluate.spec_stats(ct, {"speculative": cd}, prompts, gamma, max_new, stop_token)
        comp["compile_s"] = clock.lap()
        reference = greedy[TARGET_ONLY]["tokens"]  # eager target-only decoding
        comp["divergences"] = {arm: divergences(target, prompts, reference, cg[key]["tokens"])
                               for arm, key in zip(COMPILED, (TARGET_ONLY, "speculative"))}
        comp["greedy_match"] = not any(comp["divergences"].values())
        extra = {COMPILED[0]: (ct, None), COMPILED[1]: (ct, cd)}
    tree = isinstance(gamma, TreeShape)
    if tree:  # the chain of evaluate.GAMMA with the same draft, in the same passes: is the tree faster here?
        extra = {**(extra or {}), CHAIN_ARM: (target, draft, evaluate.GAMMA)}
    if watch:
        watch.next_phase("warm-up")  # time_arms' own warm-up pass: after compile_s, so nothing may compile here
    try:
        timing = time_arms(target, {"speculative": draft}, prompts, gamma, max_new, stop_token, repeats, decoding,
                           extra, on_timed=watch and (lambda: watch.next_phase("timed")))
    except BaseException:
        watch and watch.close()
        raise
    ar, spec_t = timing[TARGET_ONLY], timing["speculative"]
    res = {"decoding": decoding, "greedy_match": spec["greedy_match"], "tau": spec["tau"], "alpha": spec["alpha"],
           "routine_fraction": spec["routine_fraction"], "tokens": spec["n_tokens"], "prompts": len(prompts),
           "divergences": divergences(target, prompts, greedy[TARGET_ONLY]["tokens"], spec["tokens"]),
           "ar_prefill_ms": ar["prefill_ms"], "spec_prefill_ms": spec_t["prefill_ms"],
           "ar_ms_per_token": ar["ms_per_token"], "spec_ms_per_token": spec_t["ms_per_token"],
           "speedup": spec_t["speedup"]}
    if tree:
        c = timing[CHAIN_ARM]
        res["chain"] = {"gamma": evaluate.GAMMA, "ms_per_token": c["ms_per_token"], "speedup": c["speedup"],
                        "tree_over_chain": c["ms_per_token"] / spec_t["ms_per_token"]}
    timed = spec
    if decoding["mode"] == "sampling":
        # the timed runs' own statistics: the same seeds, so the same tokens as every timed pass
        timed = evaluate.spec_stats(target, {"speculative": draft}, prompts, gamma, max_new, stop_token,
                                    decoding=decoding)["speculative"]
        res["sampled"] = {"tau": timed["tau"], "alpha": timed["alpha"], "routine_fraction": timed["routine_fraction"],
                          "tokens": timed["n_tokens"]}
    res.update(cost_model(target, draft, prompts[0], gamma, timed["tau"]))
    res["c"] = res["t_draft_1"] / res["t_target_1"]
    if not isinstance(gamma, TreeShape):  # Leviathan's closed form is the chain's
        res["leviathan_speedup"] = expected_speedup(timed["alpha"], gamma, res["c"])
    if compile:
        ar_c, spec_c = timing[COMPILED[0]], timing[COMPILED[1]]
        comp.update(ar_prefill_ms=ar_c["prefill_ms"], spec_prefill_ms=spec_c["prefill_ms"],
                    ar_ms_per_token=ar_c["ms_per_token"], spec_ms_per_token=spec_c["ms_per_token"],
                    speedup=ar_c["ms_per_token"] / spec_c["ms_per_token"],  # compiled speculative vs compiled target
                    speedup_vs_eager=spec_c["speedup"],  # compiled speculative vs eager target-only
                    target_only_vs_eager=ar_c["speedup"])  # eager target-only / compiled target-only
        watch.next_phase("cost model")
        try:
            comp.update(cost_model(ct, cd, prompts[0], gamma, timed["tau"]))
        finally:
            watch.close()
        comp["compilations"] = watch.report()
        res["compiled"] = comp
    res["sdpa"] = sdpa_steps(target, prompts[0], gamma.nodes if tree else gamma,
                             static_len=ct.cache.max_len if compile else None, tree=tree)
    return res


# ---- what a reader of a GPU number needs to trust it ----


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device):
    """The software and the device a number was measured on: Python, torch, the CUDA and cuDNN torch was built with,
    triton and transformers (None where absent), and on CUDA the GPU's name, compute capability and memory."""
    device = torch.device(device)
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
           "triton": _version("triton"), "transformers": _version("transformers"), "platform": platform.platform()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", gpu_memory_gib=p.total_memory / 2 ** 30,
                   driver_cuda=torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion")
                   else None)
    return env


def reset_peak_memory(device):
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device):
    """Peak memory since reset_peak_memory, with what was read: on CUDA the caching allocator's peak allocated and
    reserved bytes; on a CPU the process's peak resident set (all of its life, not only since the reset)."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"what": "torch.cuda.max_memory_allocated / max_memory_reserved since the run began",
                "allocated_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30,
                "reserved_gib": torch.cuda.max_memory_reserved(device) / 2 ** 30}
    try:
        import resource  # POSIX only
    except ImportError:
        return {"what": "not measured (no resource module)"}
    return {"what": "the process's peak resident set (getrusage ru_maxrss)",
            "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}  # KiB on Linux


class CompileWatch:
    """What the compiled steps really did, per phase ("compile" until next_phase is called, then the names given):
    for each StaticDecoder (by name) and step length, the calls and dynamo's compilations during those calls (its
    unique-graph counter), and on CUDA the graphs captured and replayed (counted on torch.cuda.CUDAGraph, which
    inductor's CUDA-graph trees record through) and inductor's CUDA-graph skips with their logged reasons.

    Why: dynamo guards on the grad mode and on the dispatch keys of the inputs (inference tensors have none of
    autograd's), so a step warmed up under torch.no_grad and timed under torch.inference_mode compiles (and on CUDA
    records its graph) a second time inside the timed passes; and a CUDA-graph step that is skipped, or re-recorded
    past the limit, runs as plain inductor without a word. Both show here."""

    def __init__(self, decoders):
        from torch._dynamo.utils import counters
        self.counters = counters
        self.phase, self.counts = "compile", {}
        self.captures = self.replays = 0
        self.skip_reasons = []
        self.skips0 = counters["inductor"]["cudagraph_skips"]
        for name, dec in decoders.items():
            dec._step = self._counted(name, dec._step)
        self.patched = []
        if any(dec.copy_out for dec in decoders.values()):  # compiled on CUDA: CUDA graphs expected
            for attr in ("capture_begin", "replay"):
                self._count_graph_calls(attr)
            try:  # private: inductor logs every skip reason to this logger (torch 2.11 to 2.13 at least)
                log = importlib.import_module("torch._inductor.cudagraph_utils").cudagraphs_log
            except (ImportError, AttributeError):
                log = None  # the skip counter still counts them, without reasons
            if log is not None:
                self.handler = _ListHandler(self.skip_reasons)
                log.addHandler(self.handler)
                self.patched.append(lambda: log.removeHandler(self.handler))

    def _counted(self, name, step):
        def counted(input_ids, input_pos, cache):
            before = self.counters["stats"]["unique_graphs"]
            out = step(input_ids, input_pos, cache)
            c = self.counts.setdefault(self.phase, {}).setdefault(f"{name} T={input_ids.shape[1]}",
                                                                  {"calls": 0, "compilations": 0})
            c["calls"] += 1
            c["compilations"] += self.counters["stats"]["unique_graphs"] - before
            return out
        return counted

    def _count_graph_calls(self, attr):
        cls, orig = torch.cuda.CUDAGraph, getattr(torch.cuda.CUDAGraph, attr)
        field = "captures" if attr == "capture_begin" else "replays"

        def counted(graph, *args, **kwargs):
            setattr(self, field, getattr(self, field) + 1)
            return orig(graph, *args, **kwargs)
        setattr(cls, attr, counted)
        self.patched.append(lambda: setattr(cls, attr, orig))

    def next_phase(self, name):
        self.phase = name

    def recompiled(self):
        """Compilations after the "compile" phase, by phase and step: {} when every step compiled only there."""
        return {phase: {k: v["compilations"] for k, v in steps.items() if v["compilations"]}
                for phase, steps in self.counts.items() if phase != "compile"
                and any(v["compilations"] for v in steps.values())}

    def report(self):
        cuda = bool(self.patched)
        skips = self.counters["inductor"]["cudagraph_skips"] - self.skips0
        return {"what": "per phase and step: calls, and dynamo compilations (torch._dynamo.utils.counters['stats']"
                        "['unique_graphs']) counted around each compiled call",
                "steps": self.counts, "recompiled_after_compile": self.recompiled(),
                "cuda_graphs": None if not cuda else {
                    "ran": self.replays > 0 and skips == 0, "captured": self.captures, "replayed": self.replays,
                    "skips": skips, "skip_reasons": self.skip_reasons,
                    "what": "torch.cuda.CUDAGraph capture_begin / replay calls; inductor's cudagraph_skips counter "
                            "and the reasons it logged"}}

    def close(self):
        for undo in self.patched:
            undo()
        self.patched = []


class _ListHandler(logging.Handler):
    def __init__(self, out):
        super().__init__(logging.WARNING)
        self.out = out

    def emit(self, record):
        self.out.append(record.getMessage())


SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def sdpa_steps(target, prompt, gamma, static_len=None, tree=False):
    """The attention kernel behind the target's steps at this prompt: the prefill, the 1-token decode step, the
    (gamma+1)-token verify step, and (static_len: a StaticDecoder's cache length) the static 1-token and verify
    steps that --compile compiles; with tree (gamma is then its N) also the tree verify of N + 1 tokens (VLA.step).
    Each step runs once eagerly with F.scaled_dot_product_attention wrapped, and its
    first layer's call (every layer's has the same shapes) is re-run on its own: `dispatcher` is the backend
    torch's dispatcher picks for exactly those arguments (torch._fused_sdp_choice; for the lower-right causal bias of
    the CUDA verify step the rule of torch.nn.attention.bias: flash, else memory-efficient, else a materialised
    mask), and `backends` says for each backend whether it runs those arguments alone (sdpa_kernel([backend]):
    "ok", or the first line of its refusal). A compiled step's kernel is chosen when the graph is traced, from the
    same arguments; it is not read back from the compiled graph."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import CausalBias
    sdpa, seen = F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        # restored around the call: CausalBias dispatches only if F.scaled_dot_product_attention is the original
        F.scaled_dot_product_attention = sdpa
        try:
            return sdpa(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = spy

    def first_call(fn):
        seen.clear()
        F.scaled_dot_product_attention = spy
        try:
            fn()
        finally:
            F.scaled_dot_product_attention = sdpa
        return seen[0]

    L = prompt["input_ids"].shape[1]
    x = prompt["input_ids"][:, -1:]
    calls = {}
    with torch.no_grad():
        embeds, deepstack = speculate.embed_prompt(target, prompt)  # (1, L, D); the vision tower's SDPA not counted
        cache = target.new_cache(batch=1, max_len=L + gamma + 1)
        calls["prefill"] = first_call(lambda: speculate.prefill(target, prompt, embeds, cache, deepstack))
        base = cache.length
        for name, n in (("decode", 1), ("verify", gamma + 1)):
            calls[name] = first_call(lambda: target(x.repeat(1, n), cache=cache))
            cache.crop(base)
        if tree:  # a tree's verify runs VLA.step under its mask (tree.tree_round); gamma is then its N
            slots = torch.arange(base, base + gamma + 1, device=x.device)  # (N+1,)
            calls["tree verify"] = first_call(lambda: target.step(x.repeat(1, gamma + 1), slots, cache))
        if static_len:
            st = static.StaticDecoder(target, max(static_len, L + gamma + 1))
            scache = st.new_cache()
            speculate.prefill(st, prompt, embeds, scache, deepstack)
            for name, n in (("static decode", 1), ("static verify", gamma + 1)):
                calls[name] = first_call(lambda: st(x.repeat(1, n), cache=scache))
                scache.crop(base)
    out = {}
    for name, (args, kwargs) in calls.items():
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask")
        causal, gqa = kwargs.get("is_causal", False), kwargs.get("enable_gqa", False)
        lower_right = isinstance(mask, CausalBias)  # a Tensor subclass: tested before the plain-tensor case
        info = {"q": list(q.shape), "k": list(k.shape), "dtype": str(q.dtype).replace("torch.", ""),
                "mask": "lower-right causal bias" if lower_right else
                        "none, is_causal" if causal else "none" if mask is None else f"{mask.dtype} tensor",
                "enable_gqa": gqa}
        with torch.no_grad():
            if lower_right:
                params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, gqa)
                info["dispatcher"] = ("FLASH_ATTENTION" if torch.backends.cuda.can_use_flash_attention(params) else
                                      "EFFICIENT_ATTENTION" if torch.backends.cuda.can_use_efficient_attention(params)
                                      else "materialised mask")
            else:
                try:  # private, positional (q, k, v, mask, dropout_p, is_causal), then scale, enable_gqa
                    info["dispatcher"] = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal,
                                                                            enable_gqa=gqa)).name
                except (AttributeError, TypeError, RuntimeError) as e:
                    info["dispatcher"] = f"unknown ({type(e).__name__}: {str(e)[:100]})"
            info["backends"] = {}
            for b in SDPA_BACKENDS:
                if not hasattr(SDPBackend, b):
                    continue
                try:
                    with warnings.catch_warnings(), sdpa_kernel([getattr(SDPBackend, b)]):
                        warnings.simplefilter("ignore")  # the refusal's reasons come again in the error
                        sdpa(*args, **kwargs)
                    info["backends"][b] = "ok"
                except RuntimeError as e:
                    info["backends"][b] = (str(e).strip().splitlines() or ["refused"])[0][:200]
        out[name] = info
    return out


def toy_acceptance(path, want=None):
    """The toy's recorded acceptance that the real-shape prediction uses, with where it comes from: {source, alpha,
    tau, gamma, prompts, dtype, draft, decoding, torch, hardware} from a toy bench.py JSON (TOY_ACCEPTANCE, or
    --toy-json). A ValueError naming the file if it is not a toy report, if its draft was the target itself
    (alpha 1 then says nothing about a draft), or if `want` (decoder_json) is a tree it did not run."""
    full = path if os.path.isabs(path) or os.path.exists(path) else os.path.join(ROOT, path)
    if not os.path.isfile(full):
        raise ValueError(f"--toy-json {path}: no such file (the committed default is {TOY_ACCEPTANCE})")
    try:
        d = checkpoint.read_json(full)
    except ValueError as e:
        raise ValueError(f"--toy-json {path}: not JSON ({e})") from None
    if not isinstance(d, dict) or d.get("mode") != "toy" or not isinstance(d.get("alpha"), (int, float)):
        raise ValueError(f"--toy-json {path}: not a toy bench.py report (needs mode 'toy' and an alpha)")
    draft = d.get("draft", "")
    if os.path.basename(os.path.normpath(draft)) == "target" or draft == d.get("target"):
        raise ValueError(f"--toy-json {path}: its draft {draft} is the target itself (alpha {d['alpha']:.3f} says "
                         f"nothing about a draft)")
    recorded = d.get("decoder") or {"kind": "chain", "gamma": d.get("gamma")}  # reports before trees: a chain
    if want is not None and want["kind"] == "tree" and recorded != want:
        raise ValueError(f"--toy-json {path} ran {decoder_text(recorded)}, this run {decoder_text(want)}: a tree's "
                         "prediction needs the toy's tau with the same tree (python bench.py --device cpu --json with "
                         "the same --tree flags writes one)")
    return {"source": path, "alpha": d["alpha"], "tau": d.get("tau"), "gamma": d.get("gamma"), "decoder": recorded,
            "prompts": d.get("prompts"), "dtype": d.get("dtype"), "draft": draft, "decoding": d.get("decoding"),
            "torch": d.get("torch"), "hardware": d.get("hardware")}


# ---- where greedy outputs part ----


@torch.inference_mode()
def top2_margin(target, prompt, prefix):
    """The target's top-1 minus top-2 logit for the token after prompt + prefix (a list of ids), and that gap in
    steps of the logits' dtype at the top logit (a bf16 step at a logit of 10 is 2^-4): the prompt but its last
    token prefilled as speculate does, then one forward over [last prompt token] + prefix."""
    L = prompt["input_ids"].shape[1]
    cache = target.new_cache(batch=1, max_len=L + len(prefix))
    embeds, deepstack = speculate.embed_prompt(target, prompt)  # (1, L, D)
    x_last = speculate.prefill(target, prompt, embeds, cache, deepstack, name="target")  # (1, 1)
    x = torch.cat([x_last, torch.tensor([prefix], dtype=torch.long, device=x_last.device).view(1, -1)], 1)  # (1, 1 + j)
    top = target(x, cache=cache, logits_to_keep=1)[0, -1].topk(2).values  # (2,) in the logits' dtype
    info = torch.finfo(top.dtype)
    step = info.eps * 2.0 ** math.floor(math.log2(max(abs(float(top[0])), info.tiny)))  # spacing at the top logit
    margin = float(top[0]) - float(top[1])  # in Python floats: a bf16 subtraction would round the gap itself
    return margin, margin / step


def divergences(target, prompts, reference, outputs):
    """Where greedy outputs leave the reference (target-only decoding's): for every prompt i whose output differs,
    {"prompt": i, "position": j (the first differing token), "top2_margin": the target's top-1 minus top-2 logit
    there, "margin_steps": that gap in steps of the dtype, "target_only_token", "speculative_token"}; [] when every
    output is identical. The margin tells numerics from a bug: greedy speculative decoding is exact in fp32
    (tests/test_speculate.py), while in bf16 the verify step's batched matmuls round differently from single-token
    steps and can flip a near-tie (a margin of a few steps)."""
    out = []
    for i, (prompt, ref, got) in enumerate(zip(prompts, reference, outputs)):
        if ref == got:
            continue
        j = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        margin, steps = top2_margin(target, prompt, ref[:j])
        out.append({"prompt": i, "position": j, "top2_margin": margin, "margin_steps": steps,
                    "target_only_token": ref[j] if j < len(ref) else None,
                    "speculative_token": got[j] if j < len(got) else None})
    return out


# ---- prompts of a real shape ----


def real_prompt(cfg: M.ModelConfig, device, n_images=16, grid=(1, 20, 36), n_history=48, seed=0):
    """An Alpamayo-shaped prompt for a Qwen-VL config: system text, n_images images of `grid`
    patches (10 x 18 = 180 merged tokens each at merge 2, ~2900 image tokens in all), 48 history
    tokens, instruction text. Token ids and pixels are random: only shapes matter for latency.
    A model without a vision tower gets the placeholders and grids only (its positions are real)."""
    g = torch.Generator().manual_seed(seed)
    m = cfg.spatial_merge_size
    n_tok = grid[0] * (grid[1] // m) * (grid[2] // m)
    V, special = cfg.vocab_size, (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id)
    ordinary = torch.tensor([i for i in range(min(1000, V // 2), min(100_000, V)) if i not in special])
    text = lambda n: ordinary[torch.randint(len(ordinary), (n,), generator=g)].tolist()  # noqa: E731
    ids = text(24)
    for _ in range(n_images):
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n_tok + text(1)  # text(1): <|vision_end|>
    ids += text(n_history + 2) + text(16)
    prompt = {"input_ids": torch.tensor([ids], device=device),
              "image_grid_thw": torch.tensor([grid] * n_images, device=device)}
    if cfg.vision is not None:
        v = cfg.vision
        dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        prompt["pixel_values"] = torch.randn(n_images * grid[0] * grid[1] * grid[2], dim, generator=g).to(device)
    return prompt


def build_preset(name, device, dtype, layers=None, draft_vocab=0):
    """Random weights of a real model's shape, built directly on the device in dtype.
    layers: keep only that many decoder layers (to fit a small machine; says so in the report).
    draft_vocab K > 0: the draft's head covers the first K token ids (model.VLA.head; with random weights which
    ids does not change a step's cost)."""
    cfg = M.PRESETS[name]
    if layers:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = M.VLA(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    draft = M.make_draft(target, **M.DRAFT_PRESETS.get(f"{name}-draft", {"n_layers": 1}),
                         vocab_ids=torch.arange(draft_vocab) if draft_vocab else None).eval()
    return target, draft


# ---- modes ----


def toy(args, device, dtype, decoding):
    """The toy checkpoints (written by rsd.py) on held-out test scenes."""
    target = checkpoint.load(os.path.join(args.run, "target"), dtype=dtype, device=device).eval()
    draft_dir = args.draft or checkpoint.draft_dir(args.run, *TOY_DRAFT)
    draft = checkpoint.load(draft_dir, target=target).eval()  # in the target's dtype: they share embedding and head
    tok = driving.Tokenizer()
    prompts = evaluate.scene_prompts(driving.make_split("test", args.prompts, seed=0), tok, device, dtype, args.views)
    res = benchmark(target, draft, prompts, args.decoder, args.max_new, tok.cot_end_id, args.repeats, decoding,
                    args.compile)
    res.update(mode="toy", draft=draft_dir, target=os.path.join(args.run, "target"))
    if args.peer:
        res["peers"] = peers(args, target, prompts, tok)
    return res


# ---- the peer arm: transformers on the same weights ----


def peers(args, target, prompts, tok):
    """--peer hf: transformers' generate and assisted generation beside our target-only and speculative arms, all
    with the M-RoPE replica draft (the one draft transformers can run: peer.py), on the same prompts."""
    draft_dir = checkpoint.draft_dir(args.run, *peer.PEER_DRAFT)
    draft = checkpoint.load(draft_dir, target=target).eval()
    res = peer.compare(target, draft, prompts, args.gamma, args.max_new, tok.cot_end_id, tok.pad_id, args.repeats)
    res["draft"] = draft_dir
    return res


# ---- a real checkpoint: the whole plan on pixels ----


def scene_images(args):
    """A list of (3, H, W) uint8 images: the files of --images-dir in name order (PIL, an optional
    extra), or --images generated ones (a colour field with a ramp and noise, fixed by the seed)."""
    if args.images_dir:
        from PIL import Image  # optional extra: only a folder of images needs it
        names = sorted(n for n in os.listdir(args.images_dir) if n.lower().endswith((".jpg", ".jpeg", ".png")))
        if not names:
            raise FileNotFoundError(f"{args.images_dir}: no .jpg / .png images")
        images = [Image.open(os.path.join(args.images_dir, n)).convert("RGB") for n in names]
        # (H * W * 3,) bytes -> (H, W, 3) -> (3, H, W)
        return [torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(im.height, im.width, 3)
                .permute(2, 0, 1) for im in images]
    H, W = (int(s) for s in args.image_size.split("x"))
    g = torch.Generator().manual_seed(0)
    base = 255 * torch.rand(args.images, 3, 1, 1, generator=g)
    ramp = torch.linspace(0.4, 1.0, W)  # (W,): a left-to-right brightness ramp
    x = base * ramp + 20 * torch.randn(args.images, 3, H, W, generator=g)  # (n, 3, H, W)
    return list(x.clamp(0, 255).to(torch.uint8))


def history_poses(speed=8.0, dt=0.1):
    """16 past poses (16, 3) of a car driving straight at `speed` m/s, ego frame at the last one."""
    t = torch.arange(-(alpamayo.N_POSES - 1), 1) * dt  # (16,) seconds, 0 = now
    return torch.stack([speed * t, torch.zeros_like(t), torch.zeros_like(t)], -1)


def pixel_prompt(cfg: M.ModelConfig, images, max_pixels, device):
    """Without a tokenizer: real_prompt's layout (placeholder text ids) around the images, resized to
    one grid under max_pixels, scaled to [-1, 1] and flattened by vision.patchify. Shapes and pixels
    are real, token ids are not: a timing prompt."""
    v = cfg.vision
    f = v.patch_size * v.spatial_merge_size
    H, W = images[0].shape[-2:]
    s = min(1.0, (max_pixels / (H * W)) ** 0.5)
    h, w = max(f, round(H * s / f) * f), max(f, round(W * s / f) * f)
    x = torch.stack([F.interpolate(im[None].float(), size=(h, w), mode="bicubic")[0] for im in images])
    x = (x / 255 - 0.5) / 0.5  # (n, 3, h, w)
    prompt = real_prompt(cfg, device, n_images=len(images), grid=(1, h // v.patch_size, w // v.patch_size))
    prompt["pixel_values"] = torch.cat([M.patchify(im[None], v.patch_size, v.temporal_patch_size,
                                                   v.spatial_merge_size)[0] for im in x]).to(device)
    return prompt


def target_prompt(args, target, device, dtype):
    """The prompt of the --target run, its tokenizer (None without one), the id that ends the reasoning
    step (<|traj_future_start|> for Alpamayo, else None) and how the prompt was built."""
    raw = checkpoint.read_json(os.path.join(args.target, checkpoint.CONFIG))
    src = args.processor or args.target
    has_tok = any(os.path.isfile(os.path.join(src, n)) for n in ("tokenizer.json", "tokenizer_config.json"))
    stop = None
    if getattr(target, "expert", None) is not None:  # the reasoning step ends where the expert takes over
        stop = config_field(raw, "traj_token_ids.future_start", args.target)
    images = scene_images(args)
    tok = None
    if has_tok and "traj_token_ids" in raw:
        from transformers import AutoTokenizer  # optional extra, as in alpamayo.build_prompt
        tok = AutoTokenizer.from_pretrained(src)
        prompt = alpamayo.build_prompt(args.target, images, history_poses(), args.processor, args.min_pixels,
                                       args.max_pixels)
        how = "Alpamayo-R1 prompt (alpamayo.build_prompt)"
    else:
        prompt = pixel_prompt(target.cfg, images, args.max_pixels, device)
        why = (f"no tokenizer in {src}" if not has_tok else
               f"{os.path.join(args.target, checkpoint.CONFIG)} has no traj_token_ids (not an Alpamayo-R1 config)")
        how = f"placeholder text ids around real pixels ({why})"
    prompt = {k: v.to(device) for k, v in prompt.items()}
    prompt["pixel_values"] = prompt["pixel_values"].to(dtype)
    return prompt, tok, stop, how


def marked_coc(tokens, from_draft, tok):
    """The CoC as text pieces, the target's own tokens in [brackets] (rsd.py's display)."""
    text = [tok.decode([t]) if tok is not None else str(t) for t in tokens]
    return " ".join(s if d else f"[{s}]" for s, d in zip(text, from_draft))


@torch.inference_mode()
def trajectory(target, prompt, coc, future_start, repeats):
    """The expert's waypoints (1, N, 2) after prompt + CoC + <|traj_future_start|> (appended when the
    CoC did not end with it), and the median time (s) of the expert alone over `repeats` runs."""
    exp = target.expert
    seq = coc + ([] if coc[-1:] == [future_start] else [future_start])
    L = prompt["input_ids"].shape[1]
    cache = target.new_cache(max_len=L + len(seq) + exp.cfg.n_waypoints)
    embeds, deepstack = speculate.embed_prompt(target, prompt)  # (1, L, D)
    grids = {k: prompt[k] for k in speculate.GRID_KEYS if prompt.get(k) is not None}
    target(prompt["input_ids"], inputs_embeds=embeds, deepstack=deepstack, cache=cache, logits_to_keep=1, **grids)
    target(torch.tensor([seq], device=cache.k.device), cache=cache, logits_to_keep=1)  # the CoC, teacher-forced
    v0 = speed_from_history(history_poses()[None]).to(cache.k.device)  # (1,)
    g = torch.Generator(device=cache.k.device)
    run = lambda: exp(cache, v0, generator=g.manual_seed(0))  # noqa: E731
    return run(), median_time(run, cache.k.device, repeats)


def real(args, device, dtype, decoding):
    """A real checkpoint (--target): the whole plan on pixels; a real shape with random weights (--preset)."""
    stop = tok = None
    if args.target:
        target = checkpoint.load_pretrained(args.target, dtype=dtype, device=device).eval()
        draft = (checkpoint.load(args.draft, target=target, dtype=dtype, device=device) if args.draft
                 else M.make_draft(target, n_layers=1)).eval()
        name = args.target
        prompt, tok, stop, how = target_prompt(args, target, device, dtype)
    else:
        target, draft = build_preset(args.preset, device, dtype, args.layers, args.draft_vocab)
        name = args.preset + (f" ({args.layers} layers)" if args.layers else "")
        name += f", draft head over {args.draft_vocab} ids" if args.draft_vocab else ""
        prompt = real_prompt(target.cfg, device, n_images=args.images)
        if "pixel_values" in prompt:
            prompt["pixel_values"] = prompt["pixel_values"].to(dtype)
    res = benchmark(target, draft, [prompt], args.decoder, args.max_new, stop, args.repeats, decoding, args.compile)
    res.update(mode="real", model=name, prompt_tokens=prompt["input_ids"].shape[1],
               trained_draft=bool(args.draft))
    if args.target:
        spec = evaluate.decode(target, draft, prompt, args.decoder, args.max_new, stop,
                               **evaluate.sampling_kwargs(decoding, 0))
        res.update(prompt_source=how, images=int(prompt["image_grid_thw"].shape[0]),
                   visual_tokens=int((prompt["input_ids"] == target.cfg.image_token_id).sum()),
                   coc_tokens=spec.tokens, coc=marked_coc(spec.tokens, spec.from_draft, tok))
        if getattr(target, "expert", None) is not None:
            waypoints, t = trajectory(target, prompt, spec.tokens, stop, args.repeats)
            res.update(trajectory_ms=1e3 * t, waypoints=waypoints[0].float().tolist())
    if args.tree:  # what a tree verify costs against one token at this shape: the number trees live by
        nodes = tuple(n for n in (7, 15, 31, 63) if n <= max(7, args.decoder.nodes))  # up to this tree's size
        tt = tree_step_times(target, draft, prompt, nodes, args.decoder.width, reps=5)
        res["verify_ratio"] = {n + 1: tt["target"][n] / (1e-3 * res["t_target_1"]) for n in nodes}
    if not args.draft:
        # Random weights: acceptance says nothing; the cost model does. Predict the speed-up with a recorded toy
        # acceptance (toy_acceptance: the committed experiment unless --toy-json names another; main read it): the
        # chain's alpha through Leviathan's tau at this gamma, or the same tree's tau.
        toy = args.toy_acceptance
        res["toy_acceptance"] = toy
        if args.tree:
            res["toy_tau"] = toy["tau"]
            res["predicted_speedup_at_toy_tau"] = tree_speedup(
                toy["tau"], res["t_target_1"], res["t_draft_1"], res["t_draft_level"], res["t_target_verify"],
                args.decoder)
        else:
            res["toy_alpha"] = toy["alpha"]
            res["predicted_speedup_at_toy_alpha"] = measured_speedup(
                expected_tau(toy["alpha"], args.gamma), res["t_target_1"], res["t_draft_1"],
                res["t_target_gamma1"], args.gamma)
    return res


# ---- main ----


def decoder_text(d):
    if d["kind"] == "chain":
        return f"chain draft, gamma {d['gamma']}"
    return f"tree draft, {d['nodes']} nodes, depth {d['depth']}, width {d['width']}"


def decoding_text(d):
    if d["mode"] == "greedy":
        return "greedy"
    return (f"sampling at temperature {d['temperature']:g}, top-k {d['top_k'] or 'off'}, top-p {d['top_p'] or 'off'}, "
            f"prompt i's generator seeded {d['seed']} + i")


def divergence_lines(res):
    """'identical' only where every greedy output is; else each diverging prompt with the target's margin there."""
    n, div = res["prompts"], res["divergences"]
    if not div:
        return [f"greedy outputs identical to target-only on all {n} prompts"]
    lines = [f"greedy outputs identical to target-only on {n - len(div)} of {n} prompts; where the others diverge "
             f"(first differing token, the target's top-1 minus top-2 logit there):"]
    lines += [f"  prompt {d['prompt']}: token {d['position']}, margin {d['top2_margin']:.4g} "
              f"({d['margin_steps']:.1f} {res['dtype']} steps at the top logit)" for d in div]
    if res["dtype"] == "fp32":
        lines.append("  greedy speculative decoding is exact in fp32 (tests/test_speculate.py): this is a bug")
    else:
        lines.append(f"  a margin of a few {res['dtype']} steps is a near-tie that the verify step's batched "
                     f"{res['dtype']} matmuls rounded the other way; in fp32 the outputs are identical")
    return lines


def report(res, args):
    lines = []
    if res["mode"] == "real" and not res.get("trained_draft"):
        lines.append("NOTE: untrained draft -> acceptance (tau, alpha, speed-up) is not meaningful; "
                     "read the cost model and the prediction at the toy's alpha.")
    sampled = res["decoding"]["mode"] == "sampling"
    lines += [
        f"device {res['device']} ({res['hardware']}), dtype {res['dtype']}, threads {res['threads']}, "
        f"{decoder_text(res['decoder'])}, decoding {decoding_text(res['decoding'])}",
        f"prefill        target-only {res['ar_prefill_ms']:.2f} ms   speculative {res['spec_prefill_ms']:.2f} ms",
        f"reasoning step target-only {res['ar_ms_per_token']:.3f} ms/token   "
        f"speculative {res['spec_ms_per_token']:.3f} ms/token   speed-up {res['speedup']:.2f}x"
        + ("   (both arms sampling)" if sampled else ""),
        f"{'greedy         ' if sampled else ''}tau {res['tau']:.2f}   alpha {res['alpha']:.3f}   "
        f"routine fraction {res['routine_fraction']:.3f}",
    ]
    if sampled:
        s = res["sampled"]
        lines.append(f"sampled        tau {s['tau']:.2f}   alpha {s['alpha']:.3f}   routine fraction "
                     f"{s['routine_fraction']:.3f}   (the timed runs; lossless in distribution, so not compared "
                     f"with target-only token by token)")
    if "chain" in res:
        c = res["chain"]
        lines.append(f"chain arm      the same draft, gamma {c['gamma']}, in the same passes: {c['ms_per_token']:.3f} "
                     f"ms/token, speed-up {c['speedup']:.2f}x; the tree is {c['tree_over_chain']:.2f}x the chain")
    lines += divergence_lines(res)
    if res["decoder"]["kind"] == "tree":
        lines += [
            f"cost model     T_target(1) {res['t_target_1']:.3f} ms   T_target(N+1) {res['t_target_verify']:.3f} ms   "
            f"T_draft(1) {res['t_draft_1']:.3f} ms   T_draft(k) {res['t_draft_level']:.3f} ms   c {res['c']:.3f}",
            f"predicted      speed-up {res['predicted_speedup']:.2f}x (measured {'sampled ' if sampled else ''}tau)"]
    else:
        lines += [
            f"cost model     T_target(1) {res['t_target_1']:.3f} ms   T_target(gamma+1) {res['t_target_gamma1']:.3f} ms"
            f"   T_draft(1) {res['t_draft_1']:.3f} ms   c {res['c']:.3f}",
            f"predicted      speed-up {res['predicted_speedup']:.2f}x (measured {'sampled ' if sampled else ''}tau)   "
            f"{res['leviathan_speedup']:.2f}x (Leviathan, measured {'sampled ' if sampled else ''}alpha)"]
    if "compiled" in res:
        c = res["compiled"]
        lines += [
            f"compiled       target-only {c['ar_ms_per_token']:.3f} ms/token "
            f"({c['target_only_vs_eager']:.2f}x eager)   "
            f"speculative {c['spec_ms_per_token']:.3f} ms/token   speed-up {c['speedup']:.2f}x "
            f"({c['speedup_vs_eager']:.2f}x over eager target-only)   compile + first decodes {c['compile_s']:.0f} s",
            f"compiled cost  T_target(1) {c['t_target_1']:.3f} ms   T_target(gamma+1) {c['t_target_gamma1']:.3f} ms   "
            f"T_draft(1) {c['t_draft_1']:.3f} ms   predicted speed-up {c['predicted_speedup']:.2f}x"]
        for arm, div in c["divergences"].items():
            lines += [f"{arm}: " + line for line in divergence_lines({**res, "divergences": div})]
    if "verify_ratio" in res:
        lines.append("tree verify    T_target(n) / T_target(1): " + "   ".join(f"n {n}: {r:.2f}"
                                                                         for n, r in res["verify_ratio"].items()))
    if "predicted_speedup_at_toy_tau" in res:
        t = res["toy_acceptance"]
        lines.append(f"at the toy's tau {res['toy_tau']:.2f} ({t['source']}: {t['prompts']} prompts, {t['dtype']}, "
                     f"draft {t['draft']}, the same tree): predicted speed-up "
                     f"{res['predicted_speedup_at_toy_tau']:.2f}x")
    if "predicted_speedup_at_toy_alpha" in res:
        t = res["toy_acceptance"]
        lines.append(f"at the toy's alpha {res['toy_alpha']:.3f} ({t['source']}: {t['prompts']} prompts, {t['dtype']}, "
                     f"draft {t['draft']}, gamma {t['gamma']}, {t['decoding'] and t['decoding'].get('mode')}): "
                     f"predicted speed-up {res['predicted_speedup_at_toy_alpha']:.2f}x at gamma {res['gamma']}")
    if "compiled" in res:
        c = res["compiled"]["compilations"]
        g = c["cuda_graphs"]
        lines.append("compilations   " + ("none after the compile pass" if not c["recompiled_after_compile"] else
                                         f"AFTER the compile pass: {c['recompiled_after_compile']}")
                     + ("" if g is None else f"   CUDA graphs {'ran' if g['ran'] else 'DID NOT all run'}: "
                        f"{g['captured']} captured, {g['replayed']} replayed, {g['skips']} skipped"
                        + (f" ({g['skip_reasons'][0]})" if g["skip_reasons"] else "")))
    if "sdpa" in res:
        lines.append("attention      " + "   ".join(f"{k}: {v.get('dispatcher', '?')}" for k, v in res["sdpa"].items()))
    if "coc" in res:
        n = len(res["coc_tokens"])
        lines += [f"prompt         {res['prompt_tokens']} tokens, {res['images']} images, {res['visual_tokens']} "
                  f"visual tokens: {res['prompt_source']}",
                  f"plan timings   prefill (vision tower + prompt) {res['ar_prefill_ms']:.2f} ms   reasoning step "
                  f"({n} tokens) target-only {n * res['ar_ms_per_token']:.2f} ms, speculative "
                  f"{n * res['spec_ms_per_token']:.2f} ms   trajectory (action expert) "
                  + (f"{res['trajectory_ms']:.2f} ms" if "trajectory_ms" in res else "none: no action expert"),
                  f"CoC (routine, [deliberative]): {res['coc']}"]
    if "peers" in res:
        lines += peer.report_lines(res["peers"], res["dtype"])
    if "waypoints" in res:
        w = res["waypoints"]
        at = lambda i: f"({w[min(i, len(w) - 1)][0]:.1f}, {w[min(i, len(w) - 1)][1]:.1f})"  # noqa: E731
        lines.append(f"trajectory     {len(w)} waypoints (x, y) m, 10 Hz: 1 s {at(9)}, 3 s {at(29)}, last {at(-1)}")
    print("\n".join(lines))


def check_geometry_flags(ap, args):
    """Parse-time checks of the prompt's geometry and the folders it is read from: each bad value is one line."""
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1 (omit it for torch's default), got {args.threads}")
    if not 0 <= args.views <= driving.MAX_VIEWS:
        ap.error(f"--views must be in 0..{driving.MAX_VIEWS} (the geometries the toy target was trained on), "
                 f"got {args.views}")
    size = re.fullmatch(r"(\d+)x(\d+)", args.image_size)
    if not size or not all(1 <= int(n) <= 8192 for n in size.groups()):  # 8192: a camera frame, not all of memory
        ap.error(f"--image-size must be HxW in pixels, each in 1..8192 (e.g. 288x512), got {args.image_size!r}")
    if not 1 <= args.min_pixels <= args.max_pixels:
        ap.error(f"--min-pixels and --max-pixels must satisfy 1 <= min <= max, got {args.min_pixels} and "
                 f"{args.max_pixels}")
    for flag in ("images_dir", "processor"):
        if getattr(args, flag) and not args.target:
            ap.error(f"--{flag.replace('_', '-')} goes with --target")
    for flag in ("target", "draft", "images_dir", "processor"):
        path = getattr(args, flag)
        if path is not None and not os.path.isdir(path):
            ap.error(f"--{flag.replace('_', '-')} {path}: folder not found")
    if args.images_dir and importlib.util.find_spec("PIL") is None:
        ap.error("--images-dir needs Pillow to read the images: pip install pillow")
    src = args.processor or args.target
    if src and importlib.util.find_spec("transformers") is None and any(
            os.path.isfile(os.path.join(src, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
        ap.error(f"{src} has a tokenizer, which needs transformers: pip install -r requirements-test.txt")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Reasoning-step latency: target-only vs speculative (RSD).")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="weights, activations and KV cache")
    ap.add_argument("--run", default=checkpoint.SHIPPED, help="toy checkpoints folder (default: the shipped "
                    "checkpoints/toy)")
    ap.add_argument("--target", default=None, help="Hugging Face Qwen2.5-VL / Qwen3-VL / Alpamayo folder")
    ap.add_argument("--draft", default=None, help="draft folder (checkpoint.save format) trained for that target")
    ap.add_argument("--preset", default=None, choices=sorted(k for k in M.PRESETS if not k.startswith("toy")),
                    help="real model shape with random weights")
    ap.add_argument("--layers", type=int, default=None, help="with --preset: keep only this many decoder layers")
    ap.add_argument("--draft-vocab", type=int, default=0, help="with --preset: the draft's head covers only the "
                    "first K token ids (a reduced-vocabulary head; 0 = the full head)")
    ap.add_argument("--images", type=int, default=16, help="images in the real-shape / generated prompt")
    ap.add_argument("--images-dir", default=None, help="with --target: a folder of camera images (name order)")
    ap.add_argument("--image-size", default="288x512", help="with --target: HxW of the generated images")
    ap.add_argument("--processor", default=None, help="with --target: tokenizer + image processor folder "
                    "(default: the target folder)")
    ap.add_argument("--min-pixels", type=int, default=alpamayo.MIN_PIXELS, help="with --target: image size bounds")
    ap.add_argument("--max-pixels", type=int, default=alpamayo.MAX_PIXELS, help="with --target: image size bounds")
    ap.add_argument("--gamma", type=int, default=evaluate.GAMMA, help="the chain's draft length (with --tree 0)")
    ap.add_argument("--tree", type=int, default=None, help="a draft tree of this many nodes (the node budget N); 0 = "
                    f"the chain of --gamma; default {evaluate.TREE.nodes}, or the chain with --compile / --peer")
    ap.add_argument("--tree-depth", type=int, default=evaluate.TREE.depth, help="with --tree: its depth D")
    ap.add_argument("--tree-width", type=int, default=evaluate.TREE.width, help="with --tree: nodes expanded per "
                    "level and children per node, k")
    ap.add_argument("--max-new", type=int, default=evaluate.MAX_NEW_TOKENS, help="reasoning tokens per prompt at most")
    evaluate.add_decoding_flags(ap, "> 0 times both arms sampling (lossless verification; Alpamayo-R1 samples its "
                                "CoC at 0.6, top-p 0.98)")
    ap.add_argument("--prompts", type=int, default=32, help="toy: held-out test scenes benchmarked")
    ap.add_argument("--views", type=int, default=driving.WorldConfig().views, help="toy: surround views per prompt")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (median reported), >= 3")
    ap.add_argument("--compile", action="store_true", help="also time both arms with torch.compile'd static-shape "
                    "steps (inductor on a CPU, CUDA graphs on CUDA), beside the eager ones; compiling takes minutes")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--peer", default=None, choices=["hf"], help="toy, greedy: also time transformers' generate and "
                    "assisted generation on the same weights and prompts (peer.py; needs transformers)")
    ap.add_argument("--toy-json", default=None, help="random-weight runs: the toy bench.py JSON whose acceptance "
                    f"the predicted speed-up uses (default: the committed {TOY_ACCEPTANCE} for the chain, "
                    f"{TOY_TREE_ACCEPTANCE} for the default tree; runs/bench_toy.json is the last toy run's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.target and args.preset:
        ap.error("give --target or --preset, not both")
    if args.gamma < 1 or args.max_new < 1 or args.prompts < 1 or args.images < 1:
        ap.error("--gamma, --max-new, --prompts and --images must be >= 1")
    if args.repeats < 3:
        ap.error("--repeats must be >= 3 (the median of at least three passes is reported)")
    check_geometry_flags(ap, args)
    if args.draft_vocab and not (args.preset and 1 <= args.draft_vocab <= M.PRESETS[args.preset].vocab_size):
        ap.error(f"--draft-vocab takes 1..vocab_size token ids of a --preset"
                 + (f" (1..{M.PRESETS[args.preset].vocab_size} for {args.preset})" if args.preset else "")
                 + f", got {args.draft_vocab}")
    if args.layers is not None and not (args.preset and 1 <= args.layers <= M.PRESETS[args.preset].n_layers):
        ap.error(f"--layers keeps 1..n_layers decoder layers of a --preset"
                 + (f" (1..{M.PRESETS[args.preset].n_layers} for {args.preset})" if args.preset else "")
                 + f", got {args.layers}")
    if args.tree is None:  # --compile and --peer time chains (no compiled tree path; transformers' assistant)
        args.tree = 0 if (args.compile or args.peer) else evaluate.TREE.nodes
    if args.tree < 0:
        ap.error(f"--tree takes a node budget >= 1, or 0 for the chain; got {args.tree}")
    if args.tree and args.compile:
        ap.error("--compile runs the chain only (the tree's steps have no static-shape path yet): add --tree 0")
    if args.tree and args.peer:
        ap.error("--peer compares with transformers' assisted generation, a chain: add --tree 0")
    try:
        args.decoder = decoder(args)
        checkpoint.check_device(args.device)
        decoding = evaluate.decoding_mode(args.temperature, args.top_k, args.top_p, args.sampling_seed)
    except ValueError as e:
        ap.error(str(e))
    toy_mode = not (args.target or args.preset)
    if args.draft and os.path.isfile(os.path.join(args.draft, checkpoint.CONFIG)) and \
            checkpoint.read_json(os.path.join(args.draft, checkpoint.CONFIG)).get("draft") is False:
        ap.error(f"--draft {args.draft} holds a target model, not a draft (as its own draft it accepts every token)")
    args.toy_acceptance = None
    if not toy_mode and not args.draft:
        try:
            args.toy_acceptance = toy_acceptance(args.toy_json or (TOY_TREE_ACCEPTANCE if args.tree else
                                                                   TOY_ACCEPTANCE), decoder_json(args.decoder))
        except ValueError as e:
            ap.error(str(e))
    if args.peer and not toy_mode:
        ap.error("--peer runs on the toy checkpoints only (drop --target / --preset)")
    if args.peer and decoding["mode"] != "greedy":
        ap.error("--peer compares greedy tokens and times: drop --temperature")
    if args.peer and importlib.util.find_spec("transformers") is None:
        ap.error("--peer hf needs transformers (pip install -r requirements-test.txt)")
    needed = [os.path.join(args.run, "target"), args.draft or checkpoint.draft_dir(args.run, *TOY_DRAFT)]
    if args.peer:
        needed.append(checkpoint.draft_dir(args.run, *peer.PEER_DRAFT))
    missing = [d for d in needed if not os.path.isdir(d)]
    if toy_mode and missing:
        ap.error(f"no toy checkpoints (missing {', '.join(missing)}): use the shipped checkpoints/toy, or train "
                 f"them with `python rsd.py --retrain --run {args.run}`")
    if toy_mode:  # where the report goes, checked before the benchmark runs
        try:
            checkpoint.check_writable(os.path.dirname(TOY_JSON) or ".")
        except PermissionError as e:
            ap.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    reset_peak_memory(device)
    torch.manual_seed(0)
    with checkpoint.user_errors(ap):  # a bad folder or file, a gamma past the model's positions: one line
        res = toy(args, device, dtype, decoding) if toy_mode else real(args, device, dtype, decoding)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or
                                                                                  platform.machine())
    res.update(device=str(device), hardware=hardware, dtype=args.dtype, decoder=decoder_json(args.decoder),
               gamma=None if args.tree else args.gamma, threads=torch.get_num_threads(), torch=torch.__version__,
               environment=environment(device), peak_memory=peak_memory(device))
    report(res, args)  # printed first: a failing write below loses no measurement
    if args.json:
        print(json.dumps(res))
    if res["mode"] == "toy":
        with checkpoint.user_errors(ap):
            checkpoint.write_json(TOY_JSON, res)
    return res


if __name__ == "__main__":
    main()
