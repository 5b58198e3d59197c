"""The compiled path (bench.py --compile): model.VLA.step, the one cached step, through torch.compile over one
persistent KVCache, CUDA graphs on a GPU (gpt-fast's recipe: a static cache, fixed shapes, one graph per step length).
Paper: none; it serves the speed-up measurements, and speculate.py / tree.py run it unchanged.

run: python bench.py --device cpu --compile        (tests: python -m pytest -q tests/test_speculate.py -k compiled)
"""
import torch
import torch.nn.functional as F

from model import VLA, KVCache, feed


class CompiledSteps:
    """`model` with its one cached step, VLA.step, torch.compile'd over one persistent KVCache: inductor on a CPU
    (weights frozen into the graph: for decoding, not training), CUDA graphs on CUDA (mode "reduce-overhead": the
    cache's buffers sit at fixed addresses). Everything else (the prefill, embed, cfg, ...) is the model's own, so
    speculate.py and tree.py run it unchanged.

    A step of T tokens runs padded to the shortest of step_lengths >= T, so every call reuses one of a few graphs,
    each compiled at its first call (bench.py warms them up). The padding writes the slots after the step's last
    one, where every later step writes before any query reads: a decode's cache needs max(step_lengths) - 1 slots
    more than it writes (new_cache checks)."""

    def __init__(self, model: VLA, max_len: int, step_lengths, batch=1, compile=True):
        if max_len > model.cfg.max_seq_len:
            raise ValueError(f"a compiled cache of {max_len} positions is longer than the model's max_seq_len "
                             f"{model.cfg.max_seq_len}")
        self.model, self.step_lengths, self.compiled = model, sorted(set(step_lengths)), compile
        self.cache = model.new_cache(batch, max_len)
        self.cuda = self.cache.k[0].device.type == "cuda"
        self.copy_out = compile and self.cuda  # a CUDA graph's next replay overwrites its outputs; callers keep them
        self._fused = {}
        self._step = model.step
        if compile:
            # target and draft share VLA.step's code object: past the default 8 variants it falls back to eager silently
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            if self.cuda:  # the buffers are graph inputs written in place at fixed addresses (as HF's StaticCache)
                for buf in self.cache.k + self.cache.v:
                    torch._dynamo.mark_static_address(buf)
            self._step = self.compile(model.step)

    def compile(self, fn):
        """fn through torch.compile: CUDA graphs on CUDA, inductor with frozen weights on a CPU; one graph per shape."""
        if self.cuda:
            return torch.compile(fn, mode="reduce-overhead", fullgraph=True, dynamic=False)
        return torch.compile(fn, fullgraph=True, dynamic=False, options={"freezing": True})

    def fused(self, fn):
        """fn(model, cache, *tensors), a fixed-shape function of the model's steps and small tensor ops (tree.grow, a
        draft tree's levels; tree.tree_forward, its verify), as one compiled graph called with the model itself: one
        call instead of one per step and op. Eager (compile False): fn as it is, with these steps."""
        if not self.compiled:
            return fn
        if fn not in self._fused:  # dont_skip_tracing: dynamo skips a file named like a package it never traces
            self._fused[fn] = self.compile(torch._dynamo.dont_skip_tracing(fn))  # (tree.py: dm-tree's "tree")

        def run(model, cache, *args):
            out = self._call_fused(fn.__name__, self._fused[fn], self.model, self._ready(cache), *args)
            return tuple(t.clone() for t in out) if self.copy_out else out
        return run

    def _ready(self, cache):
        if cache is not self.cache:
            raise ValueError("CompiledSteps steps only its own cache (from its new_cache)")
        if self.compiled and self.model.cfg.draft_vocab:
            self.model.head_rows()  # a reduced head's kept rows, checked (and gathered if stale) outside the graph
        return cache

    def _call_fused(self, name, compiled, *args):  # experiments/probes.py CompileWatch counts through here
        return compiled(*args)

    def __getattr__(self, name):  # cfg, embed, visual, expert, ...: the model's
        return getattr(self.model, name)

    def __call__(self, *args, cache=None, **kwargs):
        if cache is not None and any(cache.lengths):
            raise ValueError("CompiledSteps: a cached continuation goes through .step (forward would run it eagerly)")
        return self.model(*args, cache=cache, **kwargs)  # the prefill, eager (M-RoPE, padding, DeepStack)

    def new_cache(self, batch=1, max_len=None, dtype=None, device=None) -> KVCache:
        """The persistent cache, emptied; refused where a decode of max_len slots (plus the padding) would not fit."""
        c, k0 = self.cache, self.cache.k[0]
        if batch != len(c.lengths):
            raise ValueError(f"these compiled steps decode batch {len(c.lengths)}, asked for batch {batch}")
        if max_len is not None and max_len + self.step_lengths[-1] - 1 > c.max_len:
            raise ValueError(f"a decode needs a cache of {max_len} positions (+ {self.step_lengths[-1] - 1} of step "
                             f"padding), the compiled cache holds {c.max_len}: build CompiledSteps with a larger "
                             "max_len")
        if dtype not in (None, k0.dtype) or (device is not None and torch.device(device) != k0.device):
            raise ValueError(f"the compiled cache is {k0.dtype} on {k0.device}, asked for {dtype} on {device}")
        c.crop(0)
        c.key_mask = None
        return c

    @torch.no_grad()  # the decodes' grad mode: a step compiled under another would compile again
    def warm(self):
        """Every step length compiled now, each fed once on the emptied cache: a timing never pays a first call (a
        decode whose pending lengths vary, as the stream's, would otherwise compile in its timed passes)."""
        cache = self.new_cache(len(self.cache.lengths))
        for n in self.step_lengths:
            feed(self, cache, torch.zeros(len(cache.lengths), n, dtype=torch.long, device=cache.device))
            cache.crop(0)

    def step(self, input_ids, input_pos, cache, mask, positions=None):
        """VLA.step, compiled: padded to T <= n of step_lengths tokens and to the whole buffer's width."""
        B, T = input_ids.shape
        n = next((s for s in self.step_lengths if s >= T), None)
        if n is None:
            raise ValueError(f"a step of {T} tokens is longer than the longest step length {self.step_lengths}")
        mask = F.pad(mask, (0, cache.max_len - mask.shape[-1]))  # (B, T, max_len): one width, one graph
        if n > T:  # any ids will do; slots and positions go on after the last; the mask rows repeat the last
            more = torch.arange(1, n - T + 1, device=input_pos.device)  # (n - T,)
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(B, n - T)], 1)  # (B, n)
            positions = None if positions is None else torch.cat([positions, positions[:, -1:] + more], 1)
            input_pos = torch.cat([input_pos, input_pos[:, -1:] + more], 1)  # (B, n)
            mask = torch.cat([mask, mask[:, -1:].expand(B, n - T, -1)], 1)  # (B, n, max_len)
        logits = self._step(input_ids, input_pos, self._ready(cache), mask, positions)[:, :T]  # (B, T, V) unpadded
        return logits.clone() if self.copy_out else logits
