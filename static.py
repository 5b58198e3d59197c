"""The gpt-fast style static-shape decode for torch.compile / CUDA graphs: an operational fast path, not the
paper's algorithm. `StaticDecoder` runs model.VLA.step (the cached step at fixed shapes) over one persistent
`StaticCache`, behind the model's own calling convention, so speculate.py and tree.py run it unchanged; bench.py
--compile times it, tests/test_speculate.py checks it agrees with the eager path token for token.

run: python -m pytest -q tests/test_speculate.py -k static
"""
import torch

from model import VLA, KVCache

# ---- static cache ----


class StaticCache(KVCache):
    """One K and one V tensor per layer: a compiled step writes a graph input in place only when it is a whole tensor
    (a view of one (n_layers, ...) tensor is copied back whole, every step). `k` / `v` stack the layers (a copy)."""

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, dtype=torch.float32, device=None):
        self.ks = [torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
                   for _ in range(n_layers)]
        self.vs = [torch.zeros_like(k) for k in self.ks]
        self.max_len = max_len
        self.length = 0
        self.rope_delta = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.key_mask = None

    k = property(lambda self: torch.stack(self.ks))  # (n_layers, B, Hk, max_len, hd)
    v = property(lambda self: torch.stack(self.vs))

    def layer(self, i):
        return self.ks[i], self.vs[i]

    def buffers(self):
        return self.ks + self.vs


# ---- static decoder ----


class StaticDecoder:
    """gpt-fast's recipe (a static cache written at `input_pos`, steps compiled "reduce-overhead", fullgraph), eager or
    compiled. `new_cache` returns the persistent cache, emptied (CUDA graphs replay fixed addresses); a cached step
    `decoder(x (1, T), cache=cache)` is VLA.step at input_pos = length + arange(T), one graph per T, rollback an
    integer (`crop`); anything else (the prefill, a call with logits_to_keep) is the model's eager forward.

    compile: VLA.step through inductor on a CPU (weights frozen), CUDA graphs on CUDA; each shape compiles at its
    first call (bench.py warms every shape up). step_lengths (e.g. (1, 2, gamma + 1)): a step of T tokens runs padded
    to the shortest of them >= T, so a short last round reuses a graph; the padding's keys land after the new length,
    where every later step writes before any query reads, so max_len needs max(step_lengths) - 1 of slack."""

    def __init__(self, model: VLA, max_len: int, compile: bool = False, step_lengths=None):
        if max_len > model.cfg.max_seq_len:
            raise ValueError(f"static cache of {max_len} positions is longer than the model's max_seq_len "
                             f"{model.cfg.max_seq_len}")
        self.model, self.compiled = model, compile
        self.step_lengths = sorted(step_lengths) if step_lengths else None
        w = model.layers[0].self_attn.qkv.weight
        self.cache = StaticCache(model.cfg.n_layers, 1, model.cfg.n_kv_heads, max_len, model.cfg.head_dim, w.dtype,
                                 w.device)
        cuda = w.device.type == "cuda"
        self.copy_out = compile and cuda  # a CUDA graph's next replay overwrites its outputs; speculate keeps logits
        self._step = model.step
        if compile:
            # target and draft share VLA.step's code object: past the default 8 variants it falls back to eager silently
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            if cuda:  # the buffers are graph inputs at fixed addresses, written in place (as HF's StaticCache)
                for buf in self.cache.ks + self.cache.vs:
                    torch._dynamo.mark_static_address(buf)
                self._step = torch.compile(model.step, mode="reduce-overhead", fullgraph=True, dynamic=False)
            else:  # freezing: the weights become graph constants (stale if they change: decode only, no training)
                self._step = torch.compile(model.step, fullgraph=True, dynamic=False, options={"freezing": True})

    def __getattr__(self, name):  # cfg, embed, visual, expert, ...: the model's
        return getattr(self.model, name)

    def new_cache(self, batch=1, max_len=None, dtype=None, device=None) -> KVCache:
        c = self.cache
        if batch != 1:
            raise ValueError(f"StaticDecoder decodes batch size 1, got batch {batch}")
        if max_len is not None and max_len > c.max_len:
            raise ValueError(f"a decode needs a cache of {max_len} positions, the static cache holds {c.max_len}: "
                             f"build the StaticDecoder with a larger max_len")
        k0 = c.ks[0]
        if dtype not in (None, k0.dtype) or (device is not None and torch.device(device) != k0.device):
            raise ValueError(f"the static cache is {k0.dtype} on {k0.device}, asked for {dtype} on {device}")
        c.length, c.key_mask = 0, None
        return c

    def __call__(self, input_ids=None, cache=None, **kwargs):
        if cache is None or cache.length == 0 or kwargs:
            return self.model(input_ids, cache=cache, **kwargs)
        if cache is not self.cache or cache.key_mask is not None:
            raise ValueError("StaticDecoder steps only its own cache (from its new_cache), of an unpadded prompt")
        T = n = input_ids.shape[1]
        if self.step_lengths is not None:
            n = next((s for s in self.step_lengths if s >= T), None)
            if n is None:
                raise ValueError(f"a step of {T} tokens is longer than the longest step length {self.step_lengths}")
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(-1, n - T)], 1)  # (1, n): any ids will do
        if cache.length + n > cache.max_len:
            raise ValueError(f"KV cache overflow: {cache.length} + {n} tokens > max_len {cache.max_len}")
        if self.compiled and self.model.cfg.draft_vocab:
            self.model.head_rows()  # a reduced head's kept rows, checked (and gathered if stale) outside the graph
        input_pos = torch.arange(cache.length, cache.length + n, device=input_ids.device)  # (n,)
        logits = self._step(input_ids, input_pos, cache)[:, :T]  # (1, T, V): the padding's logits dropped
        cache.length += T
        return logits.clone() if self.copy_out else logits
