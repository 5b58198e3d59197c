"""A Qwen-VL-style VLA (decoder, KV cache, DeepStack, trajectory head) and its draft, around vision.py's tower: the
toy and real Qwen2.5-VL / Qwen3-VL / Alpamayo-R1 weights (hf.py loads them; an Alpamayo action expert is expert.py).

Paper: `VLA` (rope_mode "mrope") is the deliberative reasoner p; `make_draft` the routine reasoner q (FlatRoPE, the
target's embedding and LM head; `vocab_ids`: EAGLE-3's reduced vocabulary). Every cached forward (decode, draft,
verify, a draft tree's levels and verify) is one `VLA.step` over one `KVCache`; ops/compiled.py compiles that step.

Letters: B batch, T new tokens, S keys (cached + new), D hidden, H heads, Hk KV heads,
hd head dim, g = H / Hk, V vocab, K reduced draft vocab, N vision patches, m spatial merge, n_vis visual tokens.

run: python -m pytest -q tests/test_model.py      (sizes and speed: python bench.py --device cpu [--compile])
"""
import copy
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from checks import check_config, check_vocab_ids
from rope import (
    apply_rope,
    flat_position_ids,
    get_rope_index,
    mrope_cos_sin,
    rope_cos_sin,
    rope_inv_freq
)
from vision import VisionConfig, check_vision_input, make_tower

# ---- config ----
@dataclass
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 384  # D
    n_layers: int = 8
    n_heads: int = 6  # H
    n_kv_heads: int = 2  # Hk (grouped-query attention)
    head_dim: int | None = None  # hd; None = hidden_size // n_heads
    intermediate_size: int = 1024  # SwiGLU width
    rope_theta: float = 1e6
    mrope_section: tuple = (8, 12, 12)  # (t, h, w) frequency pairs, summing to hd / 2
    mrope_interleaved: bool = False  # False: chunked (Qwen2.5-VL); True: interleaved (Qwen3-VL)
    rope_mode: str = "mrope"  # "mrope": 3D ids from get_rope_index; "flat": FlatRoPE 1D ids (the draft)
    # drafts only: the history-only routine reasoner; no image / video token is ever one of its keys (its prefill
    # and cache leave them out, the others at their positions; a full forward masks them)
    skip_visual: bool = False
    qkv_bias: bool = True  # Qwen2.5-VL has q/k/v biases
    qk_norm: bool = False  # Qwen3-VL: per-head RMSNorm on q and k before RoPE
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    image_token_id: int = 1  # placeholder token of one merged image patch
    video_token_id: int = 2  # placeholder token of one merged video patch
    vision_start_token_id: int = 3  # <|vision_start|>, opens every image / video block
    tokens_per_second: float = 2.0  # video t-id scale: t ids advance by this per second of video
    video_frame_blocks: bool = False  # Qwen3-VL: each temporal patch of a video is its own vision block
    spatial_merge_size: int | None = None  # m used by get_rope_index; None = vision.spatial_merge_size (or 2)
    # the vision tower; None: none (image / video placeholders keep their token embeddings)
    vision: VisionConfig | None = field(default_factory=VisionConfig)
    traj_len: int = 32  # waypoints emitted by the trajectory head (0 = no head)
    max_seq_len: int = 4096  # positions a sequence may span (prompt + generated; longer is refused); default cache
    shared_width: int | None = None  # drafts only: width of the target's shared embedding / LM head
    draft_vocab: int = 0  # drafts only: K > 0, a reduced head over K target ids (VLA.vocab_ids), -inf at the rest

    def __post_init__(self):
        if isinstance(self.vision, dict):
            self.vision = VisionConfig(**self.vision)
        self.mrope_section = tuple(self.mrope_section)
        if self.head_dim is None and not self.hidden_size % self.n_heads:
            self.head_dim = self.hidden_size // self.n_heads
        check_config(self)
        if self.spatial_merge_size is None:
            self.spatial_merge_size = getattr(self.vision, "spatial_merge_size", None) or 2

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        if unknown := set(d) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        return cls(**d)


QWEN25_VISION = VisionConfig(patch_size=14, temporal_patch_size=2, spatial_merge_size=2, depth=32, hidden=1280,
                             heads=16, intermediate=3420, window_size=112, fullatt_block_indexes=(7, 15, 23, 31))
QWEN3_VISION = VisionConfig(family="qwen3_vl", patch_size=16, temporal_patch_size=2, spatial_merge_size=2, depth=27,
                            hidden=1152, heads=16, intermediate=4304, num_position_embeddings=2304,
                            deepstack_visual_indexes=(8, 16, 24))
QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)
PRESETS = {
    # the toy target (train.target_config sets vocab, token ids, vision); why this shape: docs/toy-notes.md
    "toy-target": ModelConfig(hidden_size=128, n_layers=20, n_heads=2, n_kv_heads=1, intermediate_size=384,
                              rope_theta=1e4),
    # real shapes, random weights (benchmarks)
    "qwen2.5-vl-7b": ModelConfig(vocab_size=152064, hidden_size=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                                 intermediate_size=18944, rope_theta=1e6, mrope_section=(16, 24, 24),
                                 qkv_bias=True, tokens_per_second=2, vision=QWEN25_VISION, traj_len=64,
                                 max_seq_len=8192, **QWEN_IDS),
    "qwen3-vl-8b": ModelConfig(vocab_size=151936, hidden_size=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                               head_dim=128, intermediate_size=12288, rope_theta=5e6, mrope_section=(24, 20, 20),
                               mrope_interleaved=True, qkv_bias=False, qk_norm=True, vision=QWEN3_VISION,
                               video_frame_blocks=True, traj_len=64, max_seq_len=8192, **QWEN_IDS),
}
# make_draft(target, **DRAFT_PRESETS[name]): one decoder layer of the target's shape
DRAFT_PRESETS = {f"{name}-draft": dict(n_layers=1) for name in ("toy", "qwen2.5-vl-7b", "qwen3-vl-8b")}

# ---- decoder ----
class RMSNorm(nn.Module):  # Qwen's: the decoder's, the action expert's and the Qwen2.5-VL tower's (vision.make_tower)
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalise in fp32, cast back, then scale: Qwen's order (matters in bf16)
        return F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype) * self.weight


class Attention(nn.Module):
    """Grouped-query attention; one fused q, k, v projection: one matmul per decode step (checkpoint.py splits it)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.H, self.Hk, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.H + 2 * self.Hk) * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.H * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project(self, x, cos, sin):
        """x (B, T, D) -> rotated q (B, H, T, hd), rotated k and v (B, Hk, T, hd) (also evaluate.attention_probs')."""
        B, T, _ = x.shape
        H, Hk, hd = self.H, self.Hk, self.hd
        qkv = self.qkv(x).view(B, T, H + 2 * Hk, hd)  # (B, T, H + 2Hk, hd)
        if self.q_norm is None:  # rotate q and k together; cos, sin: (B, T, 1, hd)
            qk = apply_rope(qkv[:, :, :H + Hk], cos, sin)  # (B, T, H + Hk, hd)
            q, k = qk[:, :, :H], qk[:, :, H:]
        else:
            q = apply_rope(self.q_norm(qkv[:, :, :H]), cos, sin)  # (B, T, H, hd)
            k = apply_rope(self.k_norm(qkv[:, :, H:H + Hk]), cos, sin)  # (B, T, Hk, hd)
        return q.transpose(1, 2), k.transpose(1, 2), qkv[:, :, H + Hk:].transpose(1, 2)  # (B, H|Hk, T, hd)

    def forward(self, x, cos, sin, cache=None, layer=0, mask=None, input_pos=None):
        """Without a cache (training): attention over its own T keys, causal, or under mask (B, 1, T, T) (padding).
        With one (VLA.step, the prefill included): the T keys / values go to slots input_pos (B, T) of `cache`
        (KVCache.write), and the queries read slots [0, S) under the additive mask (B, 1, g*T, S): a KV head's g query
        heads as its g*T query rows, no K/V copies (enable_gqa is slow on CPU in bf16)."""
        B, T, _ = x.shape
        H, Hk, hd = self.H, self.Hk, self.hd
        q, k, v = self.project(x, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                               enable_gqa=True)
        else:
            kb, vb = cache.write(layer, input_pos, k, v)  # (B, Hk, max_len, hd) each
            S = mask.shape[-1]
            q = q.reshape(B, Hk, (H // Hk) * T, hd)  # (B, Hk, g*T, hd)
            y = F.scaled_dot_product_attention(q, kb[:, :, :S], vb[:, :, :S], attn_mask=mask).reshape(B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))  # (B, H, T, hd) -> (B, T, D)


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)  # Qwen's gate_proj and up_proj, fused
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache=None, layer=0, mask=None, input_pos=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask, input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


def feed(model, cache, x, n=None, return_hidden=False):
    """model.step of x (B, T) after each row's committed length -> logits (B, T, V); then row b's first n[b] tokens
    are committed (n None: all T; the rest is padding, beyond the length). The mask reaches no further than the step's
    last slot: an eager step reads no empty slot. model: a VLA or CompiledSteps."""
    input_pos = cache.slots(x.shape[1])  # (B, T), checked to fit
    mask = causal_mask(input_pos, cache, max(cache.lengths) + x.shape[1])  # (B, T, S)
    hidden = {"return_hidden": True} if return_hidden else {}  # VLA.forward's only: CompiledSteps returns logits
    out = model.step(x, input_pos, cache, mask, **hidden)
    cache.commit(x.shape[1] if n is None else n)
    return out


def causal_mask(input_pos, cache, S, anc=None):
    """The one mask builder of a cached step: (B, T, S) bool. The step's T tokens sit at consecutive slots from
    input_pos[b, 0]; token t sees the slots before them that hold real keys (a left-padded prompt's padding hidden),
    of the step's own those anc[b, t] marks (anc (B, T, T) bool: a draft tree's ancestors and itself, tree.py; None:
    causal, its own and those before it), and always its own (a padding query stays finite)."""
    cols = torch.arange(S, device=input_pos.device)  # (S,)
    if anc is None:
        mask = cols <= input_pos[..., None]  # (B, T, S)
    else:
        T, rel = anc.shape[-1], (cols - input_pos[:, :1])[:, None]  # rel (B, 1, S): slot c holds step token rel
        mask = (rel < 0) | (rel < T) & anc.gather(2, rel.clamp(0, T - 1).expand(-1, T, -1))  # (B, T, S)
    if cache.key_mask is None:
        return mask
    return mask & cache.key_mask[:, None, :S] | (cols == input_pos[..., None])


def grouped_mask(mask, g, dtype):
    """What each token sees, mask (B, T, S) bool, as the grouped query rows' additive mask (B, 1, g*T, S) in the
    attention's dtype (Attention): 0 where seen, -inf elsewhere (on a CPU SDPA takes a much slower path with a
    boolean mask; adding 0 leaves the scores exact)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(1, g, 1)[:, None]


# ---- KV cache ----
class KVCache:
    """The one cache: K and V preallocated per layer, (B, Hk, max_len, hd) each (a compiled step writes a graph input
    in place only when it is a whole tensor), and per row b the committed length `lengths[b]` (slots [0, lengths[b])
    hold its prompt and committed tokens) and `rope_delta[b]`, set at the prefill: slot c is position c + rope_delta.
    Only its methods change the lengths: `commit` (a step's tokens), `crop` (a rejected draft), `take_rows`; a tree
    round `move`s its accepted path to consecutive slots; what lies beyond a row's length is never read before a step
    writes it. key_mask (B, max_len): the real keys, after a prefill with padding only."""

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, dtype=torch.float32, device=None):
        self.k = [torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
                  for _ in range(n_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.max_len = max_len
        self.lengths = [0] * batch  # host ints: every round ends in a host sync that knows them
        self.rope_delta = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.key_mask = None

    @property
    def device(self):
        return self.rope_delta.device

    @property
    def length(self):
        """The committed length of rows that all have the same (batch 1, rows of one prompt)."""
        if any(n != self.lengths[0] for n in self.lengths):
            raise ValueError(f"the cache's rows have different lengths {self.lengths}: read cache.lengths")
        return self.lengths[0]

    def check_room(self, T):
        if max(self.lengths) + T > self.max_len:
            raise ValueError(f"KV cache overflow: {max(self.lengths)} + {T} tokens > max_len {self.max_len}")

    def slots(self, T):
        """Slots (B, T) of T tokens after each row's committed length, checked to fit."""
        self.check_room(T)
        n, cols = self.lengths[0], torch.arange(T, device=self.device)  # (T,)
        if all(m == n for m in self.lengths):  # rows of one length: no host-to-device copy
            return (cols + n).expand(len(self.lengths), T)  # (B, T)
        return torch.tensor(self.lengths, device=self.device)[:, None] + cols  # (B, T)

    def write(self, layer, input_pos, k, v):
        """The one cache write: k, v (B, Hk, T, hd) of row b into its slots input_pos[b] (B, T) of `layer` -> that
        layer's buffers (B, Hk, max_len, hd), written in place."""
        kb, vb = self.k[layer], self.v[layer]
        if input_pos.shape[0] == 1:  # one row: index_copy_, a third of index_put_'s cost per call on a CPU
            kb.index_copy_(2, input_pos[0], k), vb.index_copy_(2, input_pos[0], v)
        else:  # kb[rows, :, input_pos] is (B, T, Hk, hd)
            rows = torch.arange(len(input_pos), device=input_pos.device)[:, None]  # (B, 1)
            kb[rows, :, input_pos], vb[rows, :, input_pos] = k.transpose(1, 2), v.transpose(1, 2)
        return kb, vb

    def commit(self, n):  # row b's next n[b] slots (n: an int for every row) are committed tokens
        self.lengths = [m + k for m, k in zip(self.lengths, [n] * len(self.lengths) if isinstance(n, int) else n)]

    def crop(self, n):
        """Row b keeps its first n[b] committed slots (n: an int for every row): the verifier's undo."""
        n = [n] * len(self.lengths) if isinstance(n, int) else list(n)
        if not all(0 <= k <= m for k, m in zip(n, self.lengths)):
            raise ValueError(f"cannot crop KV cache of lengths {self.lengths} to {n}")
        self.lengths = n

    def move(self, src, dst):
        """Copy, in row b, the keys / values of slots src[b] to slots dst[b] (B, m) (dst[b, i] <= src[b, i], each row's
        accepted tree path to consecutive slots; a column a row does not use copies a slot onto itself), on the
        device: no host sync. Gathered first, so a source is never overwritten before it is read."""
        rows = torch.arange(len(src), device=src.device)[:, None]  # (B, 1)
        for buf in self.k + self.v:  # (B, Hk, max_len, hd) each
            if len(src) == 1:  # one row: index_select + index_copy_, cheaper than the advanced indexing below
                buf.index_copy_(2, dst[0], buf.index_select(2, src[0]))
            else:  # buf[rows, :, src] is (B, m, Hk, hd)
                buf[rows, :, dst] = buf[rows, :, src]

    def take_rows(self, src, rows):
        """Row b := row rows[b] of src, a cache of <= max_len slots: a prompt's prefill shared by several rows (its
        samples) without running it again. Slots, committed length, rope delta and real keys."""
        n, rows_t = src.max_len, torch.tensor(rows, device=self.rope_delta.device)
        for buf, s in zip(self.k + self.v, src.k + src.v):
            buf[:, :, :n] = s.index_select(0, rows_t)  # (B, Hk, n, hd)
        self.lengths = [src.lengths[r] for r in rows]
        self.rope_delta = src.rope_delta.index_select(0, rows_t)  # (B, 1)
        self.key_mask = None if src.key_mask is None else \
            F.pad(src.key_mask.index_select(0, rows_t), (0, self.max_len - n), value=True)  # (B, max_len)


# ---- trajectory head ----
class TrajHead(nn.Module):
    """Waypoints (x, y) in metres, ego frame: the toy's cheap parallel trajectory step after the CoC (Alpamayo-R1's
    flow-matching action expert is expert.py), which keeps AARL's action reward meaningful."""

    def __init__(self, dim, traj_len):
        super().__init__()
        self.traj_len = traj_len
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 2 * traj_len))

    def forward(self, h):
        return self.net(h).view(-1, self.traj_len, 2)  # (B, D) -> (B, traj_len, 2)


# ---- VLA ----
class VLA(nn.Module):
    """Vision tower + decoder + LM head + trajectory head. A draft (cfg.shared_width set) has no tower and holds the
    target's `embed_tokens` / `lm_head` as plain attributes (not its parameters(); gradients reach them unless frozen);
    with draft_vocab K, `vocab_ids` (K,). An Alpamayo model holds `expert` (expert.ActionExpert), no TrajHead."""

    def __init__(self, cfg: ModelConfig, shared: "VLA | None" = None):
        super().__init__()
        self.cfg, self.g = cfg, cfg.n_heads // cfg.n_kv_heads  # g query heads per KV head
        D = cfg.hidden_size
        self.proj_in = self.proj_out = None
        has_tower = cfg.vision is not None and cfg.shared_width is None
        self.visual = make_tower(cfg.vision, D, RMSNorm) if has_tower else None
        if cfg.shared_width is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
            self.lm_head = nn.Linear(D, cfg.vocab_size, bias=False)
        else:
            if shared is None:
                raise ValueError("a draft config (shared_width set) needs its target: "
                                 "use make_draft or load(dir, target=...)")
            self.__dict__["embed_tokens"] = shared.embed_tokens  # shared, deliberately not registered
            self.__dict__["lm_head"] = shared.lm_head
            if cfg.shared_width != D:  # bridge the target's width and the narrower draft
                self.proj_in = nn.Linear(cfg.shared_width, D, bias=False)
                self.proj_out = nn.Linear(D, cfg.shared_width, bias=False)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.traj_head = TrajHead(cfg.shared_width or D, cfg.traj_len) if cfg.traj_len > 0 else None
        self._rows = self._rows_key = None  # the reduced head's cached rows of the target's head (head_rows)
        if cfg.draft_vocab:  # placeholder ids until set_vocab or a checkpoint fills them
            self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab), persistent=True)
        self.apply(self._init_weights)
        self.tie_weights()
        self.reset_buffers()

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def tie_weights(self):
        if self.cfg.tie_word_embeddings and self.cfg.shared_width is None:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_buffers(self, device=None):
        self.register_buffer("inv_freq", rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta).to(device),
                             persistent=False)
        if self.visual is not None:
            self.visual.reset_buffers(device)

    def _apply(self, fn, recurse=True):
        # recompute the rotary frequencies in fp32 after any conversion: .to(bf16) would round every angle to 8 bits
        super()._apply(fn, recurse)
        self.reset_buffers(self.inv_freq.device)
        self._rows = self._rows_key = None
        return self

    def __deepcopy__(self, memo):
        # a copied draft (e.g. a frozen reference for AARL) keeps sharing the target's modules
        if self.cfg.shared_width is not None:
            memo[id(self.embed_tokens)], memo[id(self.lm_head)] = self.embed_tokens, self.lm_head
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "_rows"}, memo))
        new._rows = new._rows_key = None  # a cache: the copy gathers its own on first use
        return new

    # ---- the reduced-vocabulary head (drafts with cfg.draft_vocab = K) ----

    def set_vocab(self, ids):
        if not self.cfg.draft_vocab:
            raise ValueError("set_vocab: this model has the full head (draft_vocab 0); build the draft with "
                             "make_draft(target, vocab_ids=...)")
        ids = torch.as_tensor(ids, dtype=torch.long)
        check_vocab_ids(ids, self.cfg.vocab_size, self.cfg.draft_vocab)
        with torch.no_grad():
            self.vocab_ids.copy_(ids)  # in place: the version bump tells head_rows to gather again

    def head_rows(self):
        """The target head's rows at vocab_ids (K, D_out), kept (W[ids] per step would read, write and re-read K rows);
        gathered again when the ids or the head change (moved, cast, replaced, written in place: the key below)."""
        W = self.lm_head.weight  # (V, D_out), the target's
        version = lambda t: -1 if t.is_inference() else t._version  # noqa: E731  inference tensors keep none
        key = (W.data_ptr(), W.dtype, W.device, version(W), self.vocab_ids.data_ptr(), version(self.vocab_ids))
        if key != self._rows_key:
            with torch.no_grad():
                self._rows = W.index_select(0, self.vocab_ids.to(W.device))  # (K, D_out)
            self._rows_key = key
        return self._rows

    def head(self, h):
        """Logits (..., V) from h (..., D_out); a reduced head's -inf off vocab_ids keeps speculate.py lossless."""
        if not self.cfg.draft_vocab:
            return self.lm_head(h)
        W = self.lm_head.weight
        if torch.is_grad_enabled() and W.requires_grad:
            w = W[self.vocab_ids]  # the slow, obvious path: a fresh gather per call, so gradients reach the head
        elif torch.compiler.is_compiling():
            w = self._rows  # gathered by CompiledSteps.step before each compiled step (head_rows does not trace)
        else:
            w = self.head_rows()  # the kept copy: the target's head is frozen here
        small = F.linear(h, w)  # (..., D_out) x (K, D_out)^T -> (..., K)
        full = small.new_full((*small.shape[:-1], self.cfg.vocab_size), float("-inf"))  # (..., V)
        return full.index_copy_(-1, self.vocab_ids, small)  # (..., K) into (..., V) at vocab_ids

    def new_cache(self, batch=1, max_len=None, dtype=None, device=None) -> KVCache:
        w = self.layers[0].self_attn.qkv.weight
        return KVCache(self.cfg.n_layers, batch, self.cfg.n_kv_heads, max_len or self.cfg.max_seq_len,
                       self.cfg.head_dim, dtype or w.dtype, device or w.device)

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
              return_deepstack=False):
        """Token embeddings (B, L, D), vision features scattered into the placeholder slots (row-major over the batch,
        grid order, as in transformers). return_deepstack: also forward's `deepstack`, a list of (slots (B, L) bool,
        [(n_vis, D) per level]) per modality with pixels; empty without DeepStack (Qwen2.5-VL, the toy)."""
        x = self.embed_tokens(input_ids)  # (B, L, D)
        deepstack = []
        for pv, grid, tok, name in ((pixel_values, image_grid_thw, self.cfg.image_token_id, "image"),
                                    (pixel_values_videos, video_grid_thw, self.cfg.video_token_id, "video")):
            if pv is None:
                continue
            slots = input_ids == tok  # (B, L)
            check_vision_input(self, name, pv, grid, slots, tok)
            out = self.visual(pv, grid)  # Qwen3-VL's tower also returns its DeepStack features
            feats, levels = out if isinstance(out, tuple) else (out, [])
            x = x.masked_scatter(slots[..., None], feats.to(x.dtype))  # (n_tok, D) into the slots
            if levels:
                deepstack.append((slots, [f.to(x.dtype) for f in levels]))
        return (x, deepstack) if return_deepstack else x

    def prompt_positions(self, input_ids, x, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                         cache, position_ids):
        """The (t, h, w) positions (3, B, T) of a full forward (a prefill), applying the position rule (see forward);
        a cache keeps the offset of the text after them (rope_delta)."""
        c = self.cfg
        if position_ids is not None:
            position_ids = position_ids.expand(3, -1, -1)  # 1D ids (B, T) -> (3, B, T); (3, B, T) as is
            delta = position_ids.amax(dim=(0, 2))[:, None] + 1 - position_ids.shape[2]
        elif c.rope_mode == "mrope" and input_ids is not None:
            if c.video_frame_blocks and video_grid_thw is not None:
                # Qwen3-VL: t temporal patches are t one-frame blocks (text timestamps between), t id = start
                video_grid_thw = video_grid_thw.repeat_interleave(video_grid_thw[:, 0], 0)  # (sum t, 3)
                video_grid_thw = torch.cat([torch.ones_like(video_grid_thw[:, :1]), video_grid_thw[:, 1:]], 1)
            position_ids, delta = get_rope_index(
                input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                spatial_merge_size=c.spatial_merge_size, image_token_id=c.image_token_id,
                video_token_id=c.video_token_id, vision_start_token_id=c.vision_start_token_id,
                tokens_per_second=c.tokens_per_second)
        else:  # FlatRoPE (or no ids to find images in): 1D index over the whole sequence
            position_ids, delta = flat_position_ids(x[..., 0], attention_mask)
        if cache is not None:
            cache.rope_delta = delta.to(cache.rope_delta.device)
        return position_ids

    def forward(self, input_ids=None, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                video_grid_thw=None, second_per_grid_ts=None, attention_mask=None, cache=None, inputs_embeds=None,
                position_ids=None, return_hidden=False, logits_to_keep=0, deepstack=None):
        """Logits (B, T, V) (and hidden (B, T, D_out)). An empty cache (or none): the full forward, at
        get_rope_index's ("mrope") or flat_position_ids' ("flat") positions, the cache keeping rope_delta; causal, or
        causal over the real keys under padding (attention_mask). DeepStack (Qwen3-VL): layer i's output gets the
        tower's level-i features at the visual slots (from pixels, or embed's `deepstack`). A cache holding tokens:
        input_ids go through `step` after each row's committed length, and are committed."""
        cached = cache is not None and any(cache.lengths)
        if cached and (input_ids is None or inputs_embeds is not None or deepstack or position_ids is not None):
            raise ValueError("a cached continuation takes token ids alone (positions follow the cache; DeepStack "
                             "and inputs_embeds are for a prefill, an empty cache)")
        n = (input_ids if inputs_embeds is None else inputs_embeds).shape[1] + (max(cache.lengths) if cached else 0)
        if n > self.cfg.max_seq_len:  # beyond the positions the model was built (and trained) for
            raise ValueError(f"sequence of {n} tokens is longer than the model's max_seq_len {self.cfg.max_seq_len}")
        if cached:
            logits, h = feed(self, cache, input_ids, return_hidden=True)
            logits = logits[:, -logits_to_keep:] if logits_to_keep else logits
        else:
            if inputs_embeds is None:
                inputs_embeds, deepstack = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                                      video_grid_thw, return_deepstack=True)
            x, T = inputs_embeds, inputs_embeds.shape[1]  # (B, T, D)
            pos = self.prompt_positions(input_ids, x, image_grid_thw, video_grid_thw, second_per_grid_ts,
                                        attention_mask, cache, position_ids)  # (3, B, T)
            valid = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()  # (B, T)
            if self.cfg.skip_visual:  # the history-only draft: an image / video token is never a key
                if input_ids is None:
                    raise ValueError("the history-only draft (skip_visual) needs input_ids to find the image tokens")
                valid = ~self.visual_tokens(input_ids) if valid is None else valid & ~self.visual_tokens(input_ids)
                if cache is not None:  # and its prefill leaves them out: fewer tokens, a shorter cache
                    x, pos, valid = self.drop_keys(x, pos, valid, cache)
                    T = x.shape[1]
            if cache is not None:  # the prefill: the one cached step over the prompt, at slots [0, T)
                input_pos = cache.slots(T)  # (B, T), checked to fit
                cache.key_mask = None if valid is None else F.pad(valid, (0, cache.max_len - T), value=True)
                logits, h = self.step(None, input_pos, cache, causal_mask(input_pos, cache, T), pos, True, x,
                                      deepstack, logits_to_keep)
                cache.commit(T)  # the cache was empty: its rows now hold the prompt
                return (logits, h) if return_hidden else logits
            mask = None  # causal
            if valid is not None:  # training under padding: causal over the real keys, the diagonal kept finite
                causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (T, T)
                mask = ((causal & valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=x.device))[:, None]
            cos, sin = mrope_cos_sin(pos, self.inv_freq, self.cfg.mrope_section, self.cfg.mrope_interleaved)
            h = self.decoder(x, cos, sin, None, mask, None, deepstack)
            logits = self.head(h[:, -logits_to_keep:] if logits_to_keep else h)
        return (logits, h) if return_hidden else logits

    def visual_tokens(self, input_ids):
        """(B, T) bool: the image / video placeholders of input_ids (B, T)."""
        return (input_ids == self.cfg.image_token_id) | (input_ids == self.cfg.video_token_id)

    def prompt_slots(self, input_ids):
        """Cache slots a prefill of input_ids (B, T) fills: T, or the history-only draft's most non-visual tokens."""
        return int((~self.visual_tokens(input_ids)).sum(1).max()) if self.cfg.skip_visual else input_ids.shape[1]

    @staticmethod
    def drop_keys(x, pos, keys, cache):
        """The history-only prefill: each row's keys (B, T) bool alone, in order, at the end of T' = the most any row
        keeps (left padding for the rest), with their positions -> x (B, T', D), pos (3, B, T'), keys (B, T') or
        None. The cache's rope_delta grows by T - T': slot T' is still the position after the prompt."""
        T, Tk = keys.shape[1], int(keys.sum(1).max())
        order = keys.int().sort(dim=1, stable=True).indices[:, T - Tk:]  # (B, T'): the kept ones, in order, last
        cache.rope_delta = cache.rope_delta + (T - Tk)
        keys = keys.gather(1, order)  # (B, T')
        return (x.gather(1, order[..., None].expand(-1, -1, x.shape[-1])), pos.gather(2, order.expand(3, -1, -1)),
                None if bool(keys.all()) else keys)

    def step(self, input_ids, input_pos, cache, mask, positions=None, return_hidden=False, embeds=None,
             deepstack=None, logits_to_keep=0):
        """The one cached step (every cached forward, the prefill included; compiled by CompiledSteps): input_ids
        (B, T) (or their embeds (B, T, D), a prompt's image features in place) -> logits (B, T, V) (the last
        logits_to_keep alone, if > 0). Their keys / values go to cache slots input_pos (B, T), at positions (default
        the slots): 3D (3, B, T), a prompt's (t, h, w) M-RoPE ids as they are; 1D (B, T), text after the prompt, +
        rope_delta on all three axes. DeepStack: as in forward. Token t of row b sees slot s < S where mask[b, t, s],
        mask (B, T, S <= max_len) (causal_mask, or a tree's): an eager step reads only the slots it needs, a compiled
        one the whole buffer. The committed lengths are neither read (no recompiles as they grow) nor advanced."""
        pos = input_pos if positions is None else positions
        c = self.cfg
        cos, sin = mrope_cos_sin(pos, self.inv_freq, c.mrope_section, c.mrope_interleaved) if pos.dim() == 3 else \
            rope_cos_sin(pos + cache.rope_delta, self.inv_freq)  # (B, T, hd) each
        x = self.embed_tokens(input_ids) if embeds is None else embeds  # (B, T, D)
        h = self.decoder(x, cos, sin, cache, grouped_mask(mask, self.g, x.dtype), input_pos, deepstack)
        logits = self.head(h[:, -logits_to_keep:] if logits_to_keep else h)  # mask (B, 1, g*T, S) above
        return (logits, h) if return_hidden else logits

    def decoder(self, x, cos, sin, cache, mask, input_pos=None, deepstack=None):
        """The decoder layers, final norm and projection to the shared width: x (B, T, D) -> h (B, T, D_out)."""
        cos, sin = cos.to(x.dtype).unsqueeze(2), sin.to(x.dtype).unsqueeze(2)  # (B, T, 1, hd)
        if self.proj_in is not None:
            x = self.proj_in(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, mask, input_pos)
            for slots, levels in deepstack or ():
                if i < len(levels):  # x[slots] += level i, out of place
                    x = x.index_put((slots[:, :x.shape[1]],), levels[i], accumulate=True)
        h = self.norm(x)
        return h if self.proj_out is None else self.proj_out(h)

    def traj(self, hidden_last):
        if self.traj_head is None:
            raise ValueError("this model has no trajectory head (traj_len = 0)")
        return self.traj_head(hidden_last)  # <traj_future_start>'s final hidden (B, D) -> (B, traj_len, 2)


# ---- draft (routine reasoner) ----
# The one table of draft kinds: name -> its config fields. train.py --kinds, the checkpoint folders
# (draft_<kind>_s<seed>), rsd.py's rows, bench.py, aarl.py, real/distill.py and the tests read it: a new kind is a row
# here, plus the model code its fields switch on.
DRAFT_KINDS = {
    "flat": dict(rope_mode="flat"),  # FlatRoPE: the paper's routine reasoner, 1D positions over the whole prompt
    "mrope": dict(rope_mode="mrope"),  # the replica: standard speculative decoding's draft, the target's positions
    "history": dict(rope_mode="mrope", skip_visual=True),  # history-only: text and trajectory history, no image token
}


def draft_kind(cfg: ModelConfig) -> str:
    """The DRAFT_KINDS name of a draft's config."""
    return next(k for k, f in DRAFT_KINDS.items()
                if all(getattr(cfg, n) == v for n, v in {"skip_visual": False, **f}.items()))


def make_draft(target: VLA, n_layers=1, hidden_size=None, kind="flat", n_heads=None, n_kv_heads=None,
               intermediate_size=None, rope_theta=None, vocab_ids=None) -> VLA:
    """The routine reasoner of a DRAFT_KINDS kind: a small text-only decoder sharing the target's embedding and LM
    head and reading inputs_embeds=target.embed(...), image features included (the history-only kind drops them): no
    second tower. A narrower draft keeps head_dim (M-RoPE sections stay valid), with in/out projections."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft kind {kind!r} is not one of {sorted(DRAFT_KINDS)} (model.DRAFT_KINDS)")
    t = target.cfg
    D = hidden_size or t.hidden_size
    H = n_heads or (t.n_heads if D == t.hidden_size else D // t.head_dim)
    if H < 1:
        raise ValueError(f"draft hidden_size {D} is smaller than the target's head_dim {t.head_dim}")
    # default: as many KV heads as the target, at most H, dividing H
    Hk = n_kv_heads if n_kv_heads is not None else max(h for h in range(1, min(t.n_kv_heads, H) + 1) if not H % h)
    inter = intermediate_size or int(t.intermediate_size * D / t.hidden_size)  # == the target's at its width
    if vocab_ids is not None:
        vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long)
        check_vocab_ids(vocab_ids, t.vocab_size)
    cfg = dataclasses.replace(t, hidden_size=D, n_layers=n_layers, n_heads=H, n_kv_heads=Hk, head_dim=t.head_dim,
                              intermediate_size=inter, rope_theta=rope_theta or t.rope_theta, **DRAFT_KINDS[kind],
                              vision=None, spatial_merge_size=t.spatial_merge_size, traj_len=0, tie_word_embeddings=False,
                              shared_width=t.hidden_size, draft_vocab=0 if vocab_ids is None else len(vocab_ids))
    draft = VLA(cfg, shared=target)
    if vocab_ids is not None:
        draft.set_vocab(vocab_ids)
    return draft.to(target.embed_tokens.weight.device, target.embed_tokens.weight.dtype)
