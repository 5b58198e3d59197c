"""The GPU probe's side measurements (experiments/gpu_check.py): what compiled steps did and which attention kernel ran.

  CompileWatch     dynamo's compilations per phase and step length around each compiled call (CompiledSteps' _step
                   and _call_fused), and on CUDA the CUDA graphs captured and replayed and inductor's skips with reasons
  sdpa_steps       the attention kernel of the target's prefill, decode and verify steps (and a tree's verify) at a
                   prompt: q / k shapes, mask, the dispatcher's choice and which SDPA backends run them alone
                   (first_sdpa_call catches one step's SDPA call, sdpa_kernel_of asks torch about it)

Nothing in the library imports this; gpu_check.py's stages a_env (sdpa_steps) and d_compiled / e_full (CompileWatch)
and the CUDA-graph test in tests/test_speculate.py do.

run: python experiments/gpu_check.py --out DIR     (a_env.json's sdpa, d_compiled.json's compilations)
"""
import importlib
import logging
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import speculate  # noqa: E402
from measure.timing import _step  # noqa: E402


class CompileWatch:
    """Per phase (from "compile" to next_phase's) and step length: calls and dynamo's compilations; on CUDA the graphs
    captured and replayed and inductor's CUDA-graph skips with reasons. Why: dynamo guards on the grad mode (a step
    warmed up under no_grad compiles again under inference_mode), and a skipped CUDA graph runs without a word."""

    def __init__(self, decoders):
        from torch._dynamo.utils import counters
        self.counters, self.phase, self.counts, self.patched, self.skip_reasons = counters, "compile", {}, [], []
        self.graphs, self.skips0 = {"captured": 0, "replayed": 0}, counters["inductor"]["cudagraph_skips"]
        for name, dec in decoders.items():  # each compiled call: a step of T tokens, or a fused function (tree.grow)
            def step(input_ids, *args, _name=name, _step=dec._step):
                return self.counted(f"{_name} T={input_ids.shape[1]}", _step, input_ids, *args)

            def fused(fn_name, compiled, *args, _name=name, _call=dec._call_fused):
                return self.counted(f"{_name} {fn_name}", _call, fn_name, compiled, *args)
            dec._step, dec._call_fused = step, fused
        self.cuda = any(dec.copy_out for dec in decoders.values())  # compiled on CUDA: CUDA graphs expected
        if self.cuda:
            G = torch.cuda.CUDAGraph
            for attr, field in (("capture_begin", "captured"), ("replay", "replayed")):
                def counted(graph, *args, _orig=getattr(G, attr), _field=field, **kwargs):
                    self.graphs[_field] += 1
                    return _orig(graph, *args, **kwargs)
                self.patched.append(lambda attr=attr, orig=getattr(G, attr): setattr(G, attr, orig))
                setattr(G, attr, counted)
            try:  # private: inductor logs every skip reason to this logger (torch 2.11 to 2.13 at least)
                log = importlib.import_module("torch._inductor.cudagraph_utils").cudagraphs_log
                handler = logging.Handler(logging.WARNING)
                handler.emit = lambda record: self.skip_reasons.append(record.getMessage())
                log.addHandler(handler)
                self.patched.append(lambda: log.removeHandler(handler))
            except (ImportError, AttributeError):
                pass  # the skip counter still counts them, without reasons

    def counted(self, key, fn, *args):
        before = self.counters["stats"]["unique_graphs"]
        out = fn(*args)
        c = self.counts.setdefault(self.phase, {}).setdefault(key, {"calls": 0, "compilations": 0})
        c["calls"] += 1
        c["compilations"] += self.counters["stats"]["unique_graphs"] - before
        return out

    def next_phase(self, name):
        self.phase = name

    def recompiled(self):
        """Compilations after the "compile" phase, by phase and step: {} when every step compiled only there."""
        return {phase: again for phase, steps in self.counts.items() if phase != "compile"
                and (again := {k: v["compilations"] for k, v in steps.items() if v["compilations"]})}

    def report(self):
        skips = self.counters["inductor"]["cudagraph_skips"] - self.skips0
        return {"what": "per phase and step: calls, and dynamo compilations (torch._dynamo.utils.counters['stats']"
                        "['unique_graphs']) counted around each compiled call",
                "steps": self.counts, "recompiled_after_compile": self.recompiled(),
                "cuda_graphs": None if not self.cuda else {
                    "ran": self.graphs["replayed"] > 0 and skips == 0, **self.graphs, "skips": skips,
                    "skip_reasons": self.skip_reasons,
                    "what": "torch.cuda.CUDAGraph capture_begin / replay calls; inductor's cudagraph_skips counter "
                            "and the reasons it logged"}}

    def close(self):
        while self.patched:
            self.patched.pop()()


def first_sdpa_call(fn):
    """(args, kwargs) of fn()'s first F.scaled_dot_product_attention call (every layer's has the same shapes)."""
    sdpa, seen = F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        F.scaled_dot_product_attention = sdpa  # one call is enough, and CausalBias dispatches only to the original
        return sdpa(*args, **kwargs)
    F.scaled_dot_product_attention = spy
    try:
        fn()
    finally:
        F.scaled_dot_product_attention = sdpa
    return seen[0]


@torch.no_grad()
def sdpa_kernel_of(args, kwargs):
    """One SDPA call's shapes and mask; `dispatcher`: the backend torch picks (_fused_sdp_choice, or CausalBias's rule);
    `backends`: "ok" or the first line of each one's refusal. A compiled step's kernel is chosen from the same."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = args[:3]
    mask, causal, gqa = kwargs.get("attn_mask"), kwargs.get("is_causal", False), kwargs.get("enable_gqa", False)
    info = {"q": list(q.shape), "k": list(k.shape), "dtype": str(q.dtype).replace("torch.", ""),
            "mask": "none, is_causal" if causal else "none" if mask is None else f"{mask.dtype} tensor",
            "enable_gqa": gqa}
    try:  # private, positional (q, k, v, mask, dropout_p, is_causal), then scale, enable_gqa
        info["dispatcher"] = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, enable_gqa=gqa)).name
    except (AttributeError, TypeError, RuntimeError) as e:
        info["dispatcher"] = f"unknown ({type(e).__name__}: {str(e)[:100]})"
    info["backends"] = {}
    for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):  # all in torch >= 2.4
        try:
            with warnings.catch_warnings(), sdpa_kernel([getattr(SDPBackend, b)]):
                warnings.simplefilter("ignore")  # the refusal's reasons come again in the error
                F.scaled_dot_product_attention(*args, **kwargs)
            info["backends"][b] = "ok"
        except RuntimeError as e:
            info["backends"][b] = (str(e).strip().splitlines() or ["refused"])[0][:200]
    return info


def sdpa_steps(target, prompt, gamma, tree=False):
    """sdpa_kernel_of for the target's prefill, 1-token decode and (gamma+1)-token verify at this prompt, each run once
    eagerly (a compiled step picks its kernel from the same shapes); with tree (gamma is its N) the tree verify of
    N + 1 tokens under its mask. The vision tower's SDPA is not counted."""
    L, x = prompt["input_ids"].shape[1], prompt["input_ids"][:, -1:]
    with torch.no_grad():
        embeds, deepstack = speculate.embed_prompt(target, prompt)  # (1, L, D)
        cache = target.new_cache(batch=1, max_len=L + gamma + 1)
        calls = {"prefill": first_sdpa_call(lambda: speculate.prefill(target, prompt, embeds, cache, deepstack))}
        steps = [("decode", 1, False), ("verify", gamma + 1, False)] + [("tree verify", gamma + 1, True)] * tree
        for name, n, tree_verify in steps:  # a tree's verify: positions and a mask of its own (tree.tree_round)
            calls[name] = first_sdpa_call(_step(target, cache, x.repeat(1, n), tree_verify))
    return {name: sdpa_kernel_of(*call) for name, call in calls.items()}
