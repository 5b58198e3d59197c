"""A Qwen-VL-style VLA: vision tower, decoder with KV cache, trajectory head, the routine-reasoner
draft, and checkpoints that load real Qwen2.5-VL / Qwen3-VL / Alpamayo-R1 weights.

Paper map: `VLA` with rope_mode "mrope" is the deliberative reasoner (the unmodified target,
3D M-RoPE); `make_draft` builds the routine reasoner (1-2 layers, FlatRoPE, shares the
target's embedding and LM head, reads the target's image embeddings); `TrajHead` is the cheap
parallel trajectory step that follows the chain of causation (PAPER.md, "The paper").
The verify step of speculative decoding is a multi-token forward over a `KVCache`.

Letters: B batch, T new tokens, S keys (cached + new), D hidden, H heads, Hk KV heads,
hd head dim, g = H / Hk, V vocab, N vision patches, m spatial merge.

run: python model.py --preset toy-target --device cpu
"""
import argparse
import copy
import dataclasses
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from rope import (apply_rope, check_mrope_section, decode_positions, flat_position_ids, get_rope_index,
                  mrope_cos_sin, rope_cos_sin, rope_inv_freq)

log = logging.getLogger(__name__)

# ---- config ----


@dataclass
class VisionConfig:
    patch_size: int = 2  # p: pixels per patch side (Qwen2.5-VL: 14)
    temporal_patch_size: int = 1  # frames per patch (Qwen2.5-VL: 2)
    spatial_merge_size: int = 2  # m: m x m patches merge into one LM token
    in_channels: int = 3
    depth: int = 2  # ViT blocks
    hidden: int = 128  # ViT width
    heads: int = 4  # ViT heads; hidden / heads must be divisible by 4 (2D rotary)
    intermediate: int = 256  # ViT SwiGLU width
    window_size: int = 16  # window side in pixels for windowed blocks (Qwen2.5-VL: 112)
    fullatt_block_indexes: tuple = (1,)  # blocks with full per-frame attention; the rest are windowed
    rope_theta: float = 10000.0  # base of the 2D (row, col) rotary embedding

    def __post_init__(self):
        self.fullatt_block_indexes = tuple(self.fullatt_block_indexes)
        hd = self.hidden // self.heads
        if self.hidden % self.heads or hd % 4:
            raise ValueError(f"vision hidden {self.hidden} must split into {self.heads} heads of a size divisible by 4")
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(f"vision window_size {self.window_size} must be a multiple of patch_size * "
                             f"spatial_merge_size = {self.patch_size * self.spatial_merge_size}")
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(f"fullatt_block_indexes {self.fullatt_block_indexes} out of range for depth {self.depth}")


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
    qkv_bias: bool = True  # Qwen2.5-VL has q/k/v biases
    qk_norm: bool = False  # Qwen3-VL: per-head RMSNorm on q and k before RoPE
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    image_token_id: int = 1  # placeholder token of one merged image patch
    video_token_id: int = 2  # placeholder token of one merged video patch
    vision_start_token_id: int = 3  # <|vision_start|>, opens every image / video block
    tokens_per_second: float = 2.0  # video t-id scale: t ids advance by this per second of video
    spatial_merge_size: int | None = None  # m used by get_rope_index; None = vision.spatial_merge_size (or 2)
    # the vision tower; None: none (image / video placeholders keep their token embeddings)
    vision: VisionConfig | None = field(default_factory=VisionConfig)
    traj_len: int = 32  # waypoints emitted by the trajectory head (0 = no head)
    max_seq_len: int = 4096  # default KV-cache length
    shared_width: int | None = None  # drafts only: width of the target's shared embedding / LM head

    def __post_init__(self):
        if isinstance(self.vision, dict):
            self.vision = VisionConfig(**self.vision)
        self.mrope_section = tuple(self.mrope_section)
        if self.head_dim is None:
            if self.hidden_size % self.n_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by n_heads {self.n_heads}")
            self.head_dim = self.hidden_size // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        check_mrope_section(self.mrope_section, self.head_dim)
        if self.rope_mode not in ("mrope", "flat"):
            raise ValueError(f"rope_mode must be 'mrope' or 'flat', got {self.rope_mode!r}")
        vm = self.vision.spatial_merge_size if self.vision is not None else None
        if self.spatial_merge_size is None:
            self.spatial_merge_size = vm or 2
        elif vm is not None and vm != self.spatial_merge_size:
            raise ValueError(f"spatial_merge_size {self.spatial_merge_size} != vision.spatial_merge_size {vm}")

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        return cls(**d)


QWEN25_VISION = VisionConfig(patch_size=14, temporal_patch_size=2, spatial_merge_size=2, depth=32, hidden=1280,
                             heads=16, intermediate=3420, window_size=112, fullatt_block_indexes=(7, 15, 23, 31))
QWEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)
PRESETS = {
    # the toy target of the synthetic driving world (train.target_config sets vocab_size, token ids, vision input).
    # Narrow and 8 layers deep: on 2 CPU cores an SFT step at width 128 costs a third of one at 384, and in the
    # 6-minute budget more steps beat width on the held-out split (CoC exact 0.73 after 750 steps at width 384 in a
    # probe, 0.965 after 2600 at 128; README). The 1-layer draft's token still costs ~1/6 of the target's (bench.py).
    "toy-target": ModelConfig(hidden_size=128, n_heads=2, n_kv_heads=1, intermediate_size=384),
    # real shapes, random weights (benchmarks). Qwen3-VL's vision tower is not implemented: vision=None.
    "qwen2.5-vl-7b": ModelConfig(vocab_size=152064, hidden_size=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                                 intermediate_size=18944, rope_theta=1e6, mrope_section=(16, 24, 24),
                                 qkv_bias=True, tokens_per_second=2, vision=QWEN25_VISION, traj_len=64,
                                 max_seq_len=8192, **QWEN_IDS),
    "qwen3-vl-8b": ModelConfig(vocab_size=151936, hidden_size=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                               head_dim=128, intermediate_size=12288, rope_theta=5e6, mrope_section=(24, 20, 20),
                               mrope_interleaved=True, qkv_bias=False, qk_norm=True, vision=None,
                               spatial_merge_size=2, traj_len=64, max_seq_len=8192, **QWEN_IDS),
}
DRAFT_PRESETS = {  # make_draft(target, **DRAFT_PRESETS[name])
    "toy-draft": dict(n_layers=1),  # one decoder layer of the target's shape
    "qwen2.5-vl-7b-draft": dict(n_layers=1),
    "qwen3-vl-8b-draft": dict(n_layers=1),
}

# ---- decoder ----


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalise in fp32, cast back, then scale: Qwen's order (matters in bf16)
        return F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype) * self.weight


class Attention(nn.Module):
    """Grouped-query attention. q, k, v come from one fused projection (one matmul per step on
    the decode hot path); the checkpoint loaders split / join Qwen's q_proj, k_proj, v_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.H, self.Hk, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (self.H + 2 * self.Hk) * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.H * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def project(self, x, cos, sin):
        """x (B, T, D) -> rotated q (B, H, T, hd), rotated k and v (B, Hk, T, hd). Also the entry
        point of train.attention_probs, the diagnostic that recomputes attention weights."""
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

    def forward(self, x, cos, sin, cache, layer, mask, causal, grouped):
        B, T, _ = x.shape
        H, Hk, hd = self.H, self.Hk, self.hd
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, Hk, S, hd)
        if grouped:
            # cached step: the g query heads sharing a KV head become g*T query rows of that head,
            # so no K/V copies (enable_gqa is slow on CPU in bf16); mask rows were tiled to match
            q = q.reshape(B, Hk, (H // Hk) * T, hd)  # (B, Hk, g*T, hd)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).reshape(B, H, T, hd)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
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

    def forward(self, x, cos, sin, cache, layer, mask, causal, grouped):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask, causal, grouped)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---- vision tower (Qwen2.5-VL) ----


def _segments(lengths: torch.Tensor):
    """Contiguous segments of a packed sequence as a padded gather: idx, valid (n_seg, Lmax)."""
    starts = lengths.cumsum(0) - lengths
    ar = torch.arange(int(lengths.max()), device=lengths.device)
    valid = ar < lengths[:, None]  # (n_seg, Lmax)
    return (starts[:, None] + ar).clamp(max=int(lengths.sum()) - 1), valid


class VisionAttention(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.heads = vc.heads
        self.qkv = nn.Linear(vc.hidden, 3 * vc.hidden)
        self.proj = nn.Linear(vc.hidden, vc.hidden)

    def forward(self, x, cos, sin, seg):
        N, C = x.shape
        q, k, v = self.qkv(x).view(N, 3, self.heads, -1).unbind(1)  # 3 x (N, heads, hd)
        q = apply_rope(q.float(), cos, sin).to(x.dtype)  # rotary in fp32 as Qwen does; cos (N, 1, hd)
        k = apply_rope(k.float(), cos, sin).to(x.dtype)
        idx, valid = seg  # attention stays inside each frame / window: pad segments into a batch
        q, k, v = (t[idx].transpose(1, 2) for t in (q, k, v))  # (n_seg, heads, Lmax, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
        return self.proj(y.transpose(1, 2)[valid].reshape(N, C))  # (n_seg, Lmax, heads, hd) -> (N, C)


class VisionMLP(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(vc.hidden, vc.intermediate)
        self.up_proj = nn.Linear(vc.hidden, vc.intermediate)
        self.down_proj = nn.Linear(vc.intermediate, vc.hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(vc.hidden), RMSNorm(vc.hidden)
        self.attn = VisionAttention(vc)
        self.mlp = VisionMLP(vc)

    def forward(self, x, cos, sin, seg):
        x = x + self.attn(self.norm1(x), cos, sin, seg)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, vc: VisionConfig, out_dim):
        super().__init__()
        self.width = vc.hidden * vc.spatial_merge_size ** 2
        self.ln_q = RMSNorm(vc.hidden)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.width))  # (N, C) -> (N / m^2, m^2 C) -> (N / m^2, D)


class VisionTower(nn.Module):
    """Qwen2.5-VL ViT: patch embedding, blocks with 2D rotary (row, col) positions, window
    attention except in fullatt blocks, and an m x m patch merger into the LM width."""

    def __init__(self, vc: VisionConfig, out_dim):
        super().__init__()
        self.vc = vc
        # a Linear over the flattened (C, tp, p, p) patch == Qwen's stride-p Conv3d
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2, vc.hidden,
                                          bias=False)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        self.merger = PatchMerger(vc, out_dim)
        self.reset_buffers()

    def reset_buffers(self, device=None):
        hd = self.vc.hidden // self.vc.heads  # rows and cols each take hd/4 frequency pairs
        self.register_buffer("inv_freq", rope_inv_freq(hd // 2, self.vc.rope_theta).to(device), persistent=False)

    def windows(self, grid):
        """Permutation of merged tokens into windows of ws x ws merged tokens (ragged at the edges),
        and the window lengths in patches."""
        m, ws = self.vc.spatial_merge_size, self.vc.window_size // self.vc.spatial_merge_size // self.vc.patch_size
        order, lens, off = [], [], 0
        for t, h, w in grid:
            gh, gw = h // m, w // m
            nh, nw = -(-gh // ws), -(-gw // ws)
            idx = F.pad(torch.arange(t * gh * gw).view(t, gh, gw), (0, nw * ws - gw, 0, nh * ws - gh), value=-1)
            idx = idx.view(t, nh, ws, nw, ws).permute(0, 1, 3, 2, 4)  # (t, nh, nw, ws, ws)
            idx = idx.reshape(t * nh * nw, ws * ws)  # a row per window
            keep = idx >= 0
            order.append(idx[keep] + off)
            n = keep.sum(1)
            lens.append(n[n > 0] * m * m)
            off += t * gh * gw
        return torch.cat(order), torch.cat(lens)

    def patch_positions(self, grid):
        """(row, col) of every patch, patches listed in m x m merge-block order -> (N, 2)."""
        m, out = self.vc.spatial_merge_size, []
        for t, h, w in grid:
            rc = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1)  # (h, w, 2)
            rc = rc.view(h // m, m, w // m, m, 2).permute(0, 2, 1, 3, 4).reshape(h * w, 2)  # (h/m, w/m, m, m, 2)
            out.append(rc.repeat(t, 1))
        return torch.cat(out)

    def forward(self, pixel_values, grid_thw):
        """pixel_values (N, C*tp*p*p) in patchify order, grid_thw (n, 3) -> (N / m^2, D)."""
        mu = self.vc.spatial_merge_size ** 2
        grid = grid_thw.tolist()
        dev = pixel_values.device
        x = self.patch_embed.proj(pixel_values.to(self.patch_embed.proj.weight.dtype))  # (N, C)
        N = x.shape[0]
        order, win_lens = self.windows(grid)
        order = order.to(dev)
        x = x.view(N // mu, mu, -1)[order].view(N, -1)  # (N/m^2, m^2, C): merge groups regrouped by window
        pos = self.patch_positions(grid).to(dev).view(N // mu, mu, 2)[order].view(N, 2)  # (N, 2) in the same order
        angles = (pos[..., None].float() * self.inv_freq).flatten(1)  # (N, 2, hd/4) -> (N, hd/2): rows, cols
        emb = torch.cat((angles, angles), -1)[:, None]  # (N, 1, hd)
        cos, sin = emb.cos(), emb.sin()
        frames = _segments(torch.tensor([h * w for t, h, w in grid for _ in range(t)], device=dev))
        wins = _segments(win_lens.to(dev))
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frames if i in self.vc.fullatt_block_indexes else wins)
        return self.merger(x)[torch.argsort(order)]  # (N / m^2, D), back in patchify order


# ---- KV cache ----


class KVCache:
    """Preallocated K/V buffers (n_layers, B, Hk, max_len, hd) and the committed length.

    Writes go to [length, length + T); the model advances `length` after all layers have
    written. `crop(n)` rolls back to the first n committed positions (speculative rejection).
    `rope_delta` (B, 1) is set at prefill: a token at cache index c gets position c + rope_delta.
    `key_mask` (B, max_len) is kept only when the prefill had padding."""

    def __init__(self, n_layers, batch, n_kv_heads, max_len, head_dim, dtype=torch.float32, device=None):
        self.k = torch.zeros(n_layers, batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.max_len = max_len
        self.length = 0
        self.rope_delta = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.key_mask = None

    def update(self, layer_idx, k, v):
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} + {k.shape[2]} tokens > max_len {self.max_len}")
        self.k[layer_idx, :, :, self.length:end] = k  # (B, Hk, T, hd) into (B, Hk, max_len, hd)
        self.v[layer_idx, :, :, self.length:end] = v
        return self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end]  # (B, Hk, S, hd) views

    def crop(self, n):
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop KV cache of length {self.length} to {n}")
        self.length = n


# ---- trajectory head ----


class TrajHead(nn.Module):
    """Waypoints (x, y) in metres, ego frame, from the final hidden state of <traj_future_start>.

    Deliberate simplification: Alpamayo-R1 runs a flow-matching action expert that attends to the
    VLM's KV cache. The paper accelerates the reasoning step, and the trajectory step only has to be
    cheap, parallel and conditioned on prompt + CoC; the <traj_future_start> state already attends to
    both through the cache, so a 2-layer MLP to traj_len x 2 keeps the AARL action reward meaningful
    at a fraction of the code."""

    def __init__(self, dim, traj_len):
        super().__init__()
        self.traj_len = traj_len
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 2 * traj_len))

    def forward(self, h):
        return self.net(h).view(-1, self.traj_len, 2)  # (B, D) -> (B, traj_len, 2)


# ---- VLA ----


class VLA(nn.Module):
    """Vision tower + decoder + LM head + trajectory head. With cfg.shared_width set it is a draft:
    no vision tower, and `embed_tokens` / `lm_head` are the target's modules held as plain
    attributes, so draft.parameters() and draft.state_dict() contain only the draft's own weights."""

    def __init__(self, cfg: ModelConfig, shared: "VLA | None" = None):
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden_size
        self.proj_in = self.proj_out = None
        if cfg.shared_width is None:
            self.visual = VisionTower(cfg.vision, D) if cfg.vision is not None else None
            self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
            self.lm_head = nn.Linear(D, cfg.vocab_size, bias=False)
        else:
            if shared is None:
                raise ValueError("a draft config (shared_width set) needs its target: "
                                 "use make_draft or load(dir, target=...)")
            self.visual = None
            self.__dict__["embed_tokens"] = shared.embed_tokens  # shared, deliberately not registered
            self.__dict__["lm_head"] = shared.lm_head
            if cfg.shared_width != D:  # bridge the target's width and the narrower draft
                self.proj_in = nn.Linear(cfg.shared_width, D, bias=False)
                self.proj_out = nn.Linear(D, cfg.shared_width, bias=False)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.traj_head = TrajHead(cfg.shared_width or D, cfg.traj_len) if cfg.traj_len > 0 else None
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
        # .to(bf16) / .half() would round the rotary frequencies (and so every angle) to 8 bits;
        # recompute them in fp32 on the new device after any conversion, as Qwen's code keeps them.
        super()._apply(fn, recurse)
        self.reset_buffers(self.inv_freq.device)
        return self

    def __deepcopy__(self, memo):
        # a copied draft (e.g. a frozen reference for AARL) keeps sharing the target's modules
        if self.cfg.shared_width is not None:
            memo[id(self.embed_tokens)], memo[id(self.lm_head)] = self.embed_tokens, self.lm_head
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def new_cache(self, batch=1, max_len=None, dtype=None, device=None) -> KVCache:
        w = self.layers[0].self_attn.qkv.weight
        return KVCache(self.cfg.n_layers, batch, self.cfg.n_kv_heads, max_len or self.cfg.max_seq_len,
                       self.cfg.head_dim, dtype or w.dtype, device or w.device)

    def embed(self, input_ids, pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None):
        """Token embeddings (B, L, D) with vision features scattered into the placeholder slots
        (row-major over the batch, images / videos in grid order, as in transformers)."""
        x = self.embed_tokens(input_ids)  # (B, L, D)
        m2 = self.cfg.spatial_merge_size ** 2
        for pv, grid, tok, name in ((pixel_values, image_grid_thw, self.cfg.image_token_id, "image"),
                                    (pixel_values_videos, video_grid_thw, self.cfg.video_token_id, "video")):
            if pv is None:
                continue
            if self.visual is None:
                raise ValueError(f"{name} pixels given but this model has no vision tower "
                                 "(a draft reads inputs_embeds=target.embed(...))")
            if grid is None:
                raise ValueError(f"{name} pixels given without {name}_grid_thw")
            n_patch = int(grid.prod(-1).sum())
            if pv.shape[0] != n_patch:
                raise ValueError(f"{name} pixel values have {pv.shape[0]} patches but {name}_grid_thw "
                                 f"{grid.tolist()} describes {n_patch}")
            slots = input_ids == tok  # (B, L)
            n_tok = int(slots.sum())
            if n_tok != n_patch // m2:
                raise ValueError(f"{n_tok} {name} tokens (id {tok}) in input_ids but {name}_grid_thw "
                                 f"{grid.tolist()} gives {n_patch // m2} merged tokens")
            feats = self.visual(pv, grid).to(x.dtype)  # (n_tok, D)
            x = x.masked_scatter(slots[..., None], feats)
        return x

    def rope_tables(self, input_ids, x, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                    cache, position_ids):
        """cos, sin (B, T, hd) for the new tokens, applying the position rule (see forward)."""
        past = cache.length if cache is not None else 0
        if position_ids is None and past > 0:  # decode / verify: c + rope_delta on all three axes == 1D RoPE
            return rope_cos_sin(decode_positions(past, x.shape[1], cache.rope_delta), self.inv_freq)
        if position_ids is None:
            if self.cfg.rope_mode == "mrope" and input_ids is not None:
                c = self.cfg
                position_ids, delta = get_rope_index(
                    input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                    spatial_merge_size=c.spatial_merge_size, image_token_id=c.image_token_id,
                    video_token_id=c.video_token_id, vision_start_token_id=c.vision_start_token_id,
                    tokens_per_second=c.tokens_per_second)
            else:  # FlatRoPE (or no ids to find images in): 1D index over the whole sequence
                position_ids, delta = flat_position_ids(x[..., 0], attention_mask)
        else:
            if position_ids.dim() == 2:
                position_ids = position_ids.expand(3, -1, -1)
            delta = position_ids.amax(dim=(0, 2))[:, None] + 1 - position_ids.shape[2]
        if cache is not None and past == 0:
            cache.rope_delta = delta.to(cache.k.device)
        return mrope_cos_sin(position_ids, self.inv_freq, self.cfg.mrope_section, self.cfg.mrope_interleaved)

    def forward(self, input_ids=None, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                video_grid_thw=None, second_per_grid_ts=None, attention_mask=None, cache=None, inputs_embeds=None,
                position_ids=None, return_hidden=False, logits_to_keep=0):
        """Logits (B, T, V), or (logits, hidden (B, T, D_out)) with return_hidden.

        Positions: without a cache or with an empty one (prefill) they come from get_rope_index
        (rope_mode "mrope") or flat_position_ids ("flat"), and the cache keeps rope_delta; with a
        non-empty cache the T new tokens get cache.length + arange(T) + rope_delta on all axes.
        A cached forward appends T tokens (causal over the cached prefix for T > 1: the verify
        step). attention_mask (B, L) is read at prefill only; the cache remembers the padding.
        logits_to_keep > 0 computes logits for the last that many positions only."""
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        x = inputs_embeds
        B, T, _ = x.shape
        past = cache.length if cache is not None else 0
        if cache is not None and past + T > cache.max_len:
            raise ValueError(f"KV cache overflow: {past} + {T} tokens > max_len {cache.max_len}")
        cos, sin = self.rope_tables(input_ids, x, image_grid_thw, video_grid_thw, second_per_grid_ts,
                                    attention_mask, cache, position_ids)
        cos, sin = cos.to(x.dtype).unsqueeze(2), sin.to(x.dtype).unsqueeze(2)  # (B, T, 1, hd)

        mask, causal, grouped = None, T > 1, past > 0
        if past == 0:  # prefill
            valid = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
            if valid is not None:  # causal & real keys; the diagonal keeps padded query rows finite
                ar = torch.arange(T, device=x.device)
                mask = ((ar[None, :] <= ar[:, None]) & valid[:, None, :]) | torch.eye(T, dtype=torch.bool,
                                                                                    device=x.device)
                mask, causal = mask[:, None], False  # (B, 1, T, T)
            if cache is not None:
                cache.key_mask = None
                if valid is not None:
                    cache.key_mask = torch.ones(B, cache.max_len, dtype=torch.bool, device=x.device)
                    cache.key_mask[:, :T] = valid
        else:
            if T > 1:  # verify step: new token i sees the prefix and new tokens <= i
                ar = torch.arange(past + T, device=x.device)
                mask = (ar[None, :] <= past + ar[:T, None]).repeat(self.cfg.n_heads // self.cfg.n_kv_heads, 1)
            if cache.key_mask is not None:
                km = cache.key_mask[:, None, None, :past + T]  # (B, 1, 1, S)
                mask = km if mask is None else mask & km

        if self.proj_in is not None:
            x = self.proj_in(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, mask, causal, grouped)
        if cache is not None:
            cache.length = past + T
        h = self.norm(x)
        if self.proj_out is not None:
            h = self.proj_out(h)
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        return (logits, h) if return_hidden else logits

    def traj(self, hidden_last):
        """Trajectory from the final hidden state of <traj_future_start>: (B, D) -> (B, traj_len, 2)."""
        if self.traj_head is None:
            raise ValueError("this model has no trajectory head (traj_len = 0)")
        return self.traj_head(hidden_last)


# ---- draft (routine reasoner) ----


def make_draft(target: VLA, n_layers=1, hidden_size=None, rope_mode="flat", n_heads=None, n_kv_heads=None,
               intermediate_size=None) -> VLA:
    """The routine reasoner: a small text-only decoder on FlatRoPE positions (rope_mode "mrope"
    gives the baseline replica draft) that shares the target's token embedding and LM head
    (the same module objects) and reads the target's prompt embeddings, image features included,
    via draft(input_ids, inputs_embeds=target.embed(...), <grids>, cache=...): no second vision encoder.

    Training: draft.parameters() are exactly the draft's own weights (the shared modules are not
    registered in it), so an optimizer over them never updates the target; gradients still flow
    into the shared modules unless the caller freezes the target. Width defaults to the target's;
    a narrower draft keeps the target's head_dim (so M-RoPE sections stay valid) with
    hidden_size // head_dim heads, and gets linear in/out projections."""
    t = target.cfg
    D = hidden_size or t.hidden_size
    H = n_heads or (t.n_heads if D == t.hidden_size else D // t.head_dim)
    if H < 1:
        raise ValueError(f"draft hidden_size {D} is smaller than the target's head_dim {t.head_dim}")
    Hk = n_kv_heads
    if Hk is None:  # as many KV heads as the target, at most H, dividing H
        Hk = min(t.n_kv_heads, H)
        while H % Hk:
            Hk -= 1
    inter = intermediate_size or (t.intermediate_size if D == t.hidden_size
                                  else int(t.intermediate_size * D / t.hidden_size))
    cfg = dataclasses.replace(t, hidden_size=D, n_layers=n_layers, n_heads=H, n_kv_heads=Hk, head_dim=t.head_dim,
                              intermediate_size=inter, rope_mode=rope_mode, vision=None,
                              spatial_merge_size=t.spatial_merge_size, traj_len=0, tie_word_embeddings=False,
                              shared_width=t.hidden_size)
    w = target.embed_tokens.weight
    return VLA(cfg, shared=target).to(device=w.device, dtype=w.dtype)


# ---- patchify ----


def patchify(frames, patch_size, temporal_patch_size, merge_size):
    """frames (T, C, H, W), already normalised -> pixel_values (N, C*tp*p*p), grid_thw (3,).

    The Qwen2-VL image processor's flattening: patches in (t, row block, col block, row in block,
    col in block) order, each flattened as (C, tp, p, p); T is padded to a multiple of
    temporal_patch_size by repeating the last frame."""
    T, C, H, W = frames.shape
    p, tp, m = patch_size, temporal_patch_size, merge_size
    if H % (p * m) or W % (p * m):
        raise ValueError(f"frame size {H}x{W} must be divisible by patch_size * merge_size = {p * m}")
    if T % tp:
        frames = torch.cat([frames, frames[-1:].expand(tp - T % tp, -1, -1, -1)])
    gt, gh, gw = frames.shape[0] // tp, H // p, W // p
    x = frames.reshape(gt, tp, C, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, C, tp, p, p)
    return x.reshape(gt * gh * gw, C * tp * p * p), torch.tensor([gt, gh, gw])


# ---- checkpoints: our own format ----

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def _atomic_write(path, write):
    """write(tmp_path) into a temp file in the same folder, fsync, then rename over path."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save(model: VLA, dir):
    """config.json + model.safetensors, each written atomically. A draft's file holds only its own
    weights (the shared target embedding / LM head are re-attached by load(dir, target=...))."""
    from safetensors.torch import save_file
    os.makedirs(dir, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings and model.cfg.shared_width is None:
        sd.pop("lm_head.weight")  # tied: the same tensor as embed_tokens.weight
    meta = {"format": "rsd-vla", "draft": model.cfg.shared_width is not None, "config": model.cfg.to_dict()}
    _atomic_write(os.path.join(dir, WEIGHTS), lambda p: save_file(sd, p))
    _atomic_write(os.path.join(dir, CONFIG), lambda p: _write_text(p, json.dumps(meta, indent=1)))


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def _read_json(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: file not found")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _open_safetensors(path):
    from safetensors import safe_open
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: weights file not found")
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises its own error type for bad headers / short files
        raise ValueError(f"{path}: cannot read safetensors file (truncated or corrupt?): {e}") from None


def _read_tensor(f, path, key):
    try:
        return f.get_tensor(key)
    except Exception as e:
        raise ValueError(f"{path}: cannot read tensor {key!r} (truncated or corrupt?): {e}") from None


def _check_keys(expected, found, where):
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        fmt = lambda ks: f"{len(ks)} {ks[:20]}{' ...' if len(ks) > 20 else ''}"
        raise ValueError(f"{where}: key mismatch: missing {fmt(missing)}; unexpected {fmt(unexpected)}")


def _check_shape(path, key, expected, got):
    if tuple(expected) != tuple(got):
        raise ValueError(f"{path}: shape mismatch for {key!r}: expected {tuple(expected)}, got {tuple(got)}")


def _empty_model(cfg, shared, dtype, device):
    """A VLA with uninitialised storage (no random init of weights about to be overwritten)."""
    with torch.device("meta"):
        model = VLA(cfg, shared=shared)
    model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.reset_buffers(device)
    return model


def load(dir, target: VLA | None = None, dtype=None, device=None) -> VLA:
    """Load a model written by save(); a draft needs the target it was made from (re-attached, shared)."""
    if not os.path.isdir(dir):
        raise FileNotFoundError(f"{dir}: checkpoint folder not found")
    meta = _read_json(os.path.join(dir, CONFIG))
    if meta.get("format") != "rsd-vla":
        raise ValueError(f"{os.path.join(dir, CONFIG)}: not a checkpoint written by model.save "
                         "(for Hugging Face / Alpamayo folders use load_pretrained)")
    cfg = ModelConfig.from_dict(meta["config"])
    if meta["draft"]:
        if target is None:
            raise ValueError(f"{dir} holds a draft: pass target= (the model whose embedding and LM head it shares)")
        if (target.cfg.hidden_size, target.cfg.vocab_size) != (cfg.shared_width, cfg.vocab_size):
            raise ValueError(f"{dir}: draft expects a target of width {cfg.shared_width} and vocab {cfg.vocab_size}, "
                             f"got {target.cfg.hidden_size} and {target.cfg.vocab_size}")
        device = device or target.embed_tokens.weight.device
    path = os.path.join(dir, WEIGHTS)
    f = _open_safetensors(path)
    keys = list(f.keys())
    if dtype is None:  # a draft must match its target; otherwise keep the file's dtype
        dtype = target.embed_tokens.weight.dtype if meta["draft"] else _read_tensor(f, path, keys[0]).dtype
    model = _empty_model(cfg, target if meta["draft"] else None, dtype, device or "cpu")
    sd = model.state_dict()
    if cfg.tie_word_embeddings and cfg.shared_width is None:
        sd.pop("lm_head.weight")
    _check_keys(sd, keys, path)
    with torch.no_grad():
        for k in keys:
            _check_shape(path, k, sd[k].shape, f.get_slice(k).get_shape())
            sd[k].copy_(_read_tensor(f, path, k))
    return model


# ---- checkpoints: Hugging Face Qwen2.5-VL / Qwen3-VL and Alpamayo-R1 folders ----

ALPAMAYO_SKIP = ("expert.", "action_in_proj.", "action_out_proj.")


def _hf_config(path):
    """(ModelConfig, family, alpamayo) from a Hugging Face / Alpamayo config.json."""
    cfg_path = os.path.join(path, CONFIG)
    raw = _read_json(cfg_path)
    alpamayo = "vlm_name_or_path" in raw or "alpamayo" in str(raw.get("model_type", "")).lower()
    if alpamayo:  # the VLM config is nested, or (released checkpoints) named by vlm_name_or_path
        vlm = raw.get("vlm_config")
        if vlm is None:
            name = str(raw.get("vlm_name_or_path", ""))
            if os.path.isfile(os.path.join(name, CONFIG)):
                vlm = _read_json(os.path.join(name, CONFIG))
            elif name.rstrip("/").split("/")[-1].lower() == "qwen3-vl-8b-instruct":
                return (dataclasses.replace(PRESETS["qwen3-vl-8b"], vocab_size=raw.get("vocab_size", 151936)),
                        "qwen3_vl", True)
            else:
                raise ValueError(f"{cfg_path}: Alpamayo config without a 'vlm_config' entry and unknown VLM "
                                 f"{name!r}: add the VLM's config.json as 'vlm_config'")
        raw = dict(vlm, vocab_size=raw.get("vocab_size", vlm.get("vocab_size")))
    family = raw.get("model_type")
    if family not in ("qwen2_5_vl", "qwen3_vl"):
        raise ValueError(f"{cfg_path}: unsupported architecture model_type={family!r} "
                         f"(architectures={raw.get('architectures')}); supported: qwen2_5_vl, qwen3_vl, Alpamayo-R1")
    text = raw.get("text_config") or raw  # transformers 5 nests it; older configs keep it top-level
    rope = text.get("rope_parameters") or text.get("rope_scaling") or raw.get("rope_scaling") or {}
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{cfg_path}: unsupported hidden_act {text['hidden_act']!r}")
    if family == "qwen3_vl" and text.get("attention_bias"):
        raise ValueError(f"{cfg_path}: unsupported attention_bias=True for qwen3_vl")
    vraw = raw.get("vision_config") or {}
    vision = None
    if family == "qwen2_5_vl":
        vision = VisionConfig(
            patch_size=vraw.get("patch_size", 14), temporal_patch_size=vraw.get("temporal_patch_size", 2),
            spatial_merge_size=vraw.get("spatial_merge_size", 2),
            in_channels=vraw.get("in_channels", vraw.get("in_chans", 3)),
            depth=vraw.get("depth", 32), hidden=vraw.get("hidden_size", 3584), heads=vraw.get("num_heads", 16),
            intermediate=vraw.get("intermediate_size", 3420), window_size=vraw.get("window_size", 112),
            fullatt_block_indexes=vraw.get("fullatt_block_indexes", (7, 15, 23, 31)),
            rope_theta=(vraw.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        if vraw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg_path}: unsupported vision hidden_act {vraw['hidden_act']!r}")
        if vraw.get("out_hidden_size", text["hidden_size"]) != text["hidden_size"]:
            raise ValueError(f"{cfg_path}: vision out_hidden_size {vraw['out_hidden_size']} != hidden_size "
                             f"{text['hidden_size']}")
    try:
        cfg = ModelConfig(
            vocab_size=raw.get("vocab_size") or text["vocab_size"], hidden_size=text["hidden_size"],
            n_layers=text["num_hidden_layers"], n_heads=text["num_attention_heads"],
            n_kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"], head_dim=text.get("head_dim"),
            intermediate_size=text["intermediate_size"],
            rope_theta=rope.get("rope_theta", text.get("rope_theta", 1e6 if family == "qwen2_5_vl" else 5e6)),
            mrope_section=tuple(rope.get("mrope_section", (16, 24, 24) if family == "qwen2_5_vl" else (24, 20, 20))),
            mrope_interleaved=family == "qwen3_vl", qkv_bias=family == "qwen2_5_vl", qk_norm=family == "qwen3_vl",
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings") or text.get("tie_word_embeddings")),
            image_token_id=raw.get("image_token_id", 151655), video_token_id=raw.get("video_token_id", 151656),
            vision_start_token_id=raw.get("vision_start_token_id", 151652),
            tokens_per_second=vraw.get("tokens_per_second", 2), spatial_merge_size=vraw.get("spatial_merge_size", 2),
            vision=vision, traj_len=64, max_seq_len=min(text.get("max_position_embeddings", 8192), 8192))
    except KeyError as e:
        raise ValueError(f"{cfg_path}: missing config field {e}") from None
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    return cfg, family, alpamayo


def _hf_name(key):
    """Both on-disk layouts -> one: 'model.language_model.X' / 'model.X' -> 'X'; 'model.visual.X' -> 'visual.X'."""
    for prefix, new in (("model.language_model.", ""), ("model.visual.", "visual."), ("model.", "")):
        if key.startswith(prefix):
            return new + key[len(prefix):]
    return key


def _hf_layout(model: VLA):
    """{hf name: shape} the checkpoint must hold, and {our name: [hf names]} joined along dim 0."""
    cfg, shapes, parts = model.cfg, {}, {}
    q, kv, inter = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    for name, t in model.state_dict().items():
        if name.startswith("traj_head.") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        base, leaf = name.rsplit(".", 1)
        if base.endswith("self_attn.qkv"):
            split = [(base[:-3] + p, n) for p, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]
        elif base.endswith("mlp.gate_up"):
            split = [(base[:-7] + p, inter) for p in ("gate_proj", "up_proj")]
        else:
            split = [(base, None)]
        parts[name] = [f"{b}.{leaf}" for b, _ in split]
        for (b, n), hf in zip(split, parts[name]):
            shapes[hf] = (n, *t.shape[1:]) if n is not None else tuple(t.shape)
    if model.visual is not None:  # Qwen stores the patch embedding as a Conv3d kernel
        vc = model.cfg.vision
        shapes["visual.patch_embed.proj.weight"] = (vc.hidden, vc.in_channels, vc.temporal_patch_size,
                                                    vc.patch_size, vc.patch_size)
    return shapes, parts


def load_pretrained(path, dtype=None, device=None) -> VLA:
    """Load a Hugging Face Qwen2.5-VL (language model + vision tower) or Qwen3-VL (language model)
    folder, or an Alpamayo-R1 folder ('vlm.' prefix), one file or shards with an index.

    Accepts both layouts ('model.layers.*' / 'visual.*' and 'model.language_model.*' /
    'model.visual.*'). Skipped with a logged note: Alpamayo's action expert ('expert.*',
    'action_in_proj.*', 'action_out_proj.*') and Qwen3-VL's vision tower (not implemented).
    The trajectory head is not in these checkpoints and stays randomly initialised.
    dtype None keeps the checkpoint's dtype."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: checkpoint folder not found")
    cfg, family, alpamayo = _hf_config(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        key_file = {k: os.path.join(path, v) for k, v in _read_json(index)["weight_map"].items()}
    elif os.path.isfile(os.path.join(path, WEIGHTS)):
        key_file = None
    else:
        raise FileNotFoundError(f"{path}: no {WEIGHTS} or model.safetensors.index.json")
    handles = {}

    def handle(file):
        if file not in handles:
            handles[file] = _open_safetensors(file)
        return handles[file]

    if key_file is None:
        key_file = dict.fromkeys(handle(os.path.join(path, WEIGHTS)).keys(), os.path.join(path, WEIGHTS))
    found, skipped = {}, {"Alpamayo action expert": 0, "Qwen3-VL vision tower (not implemented)": 0}
    for key, file in key_file.items():
        k = key
        if alpamayo:
            if k.startswith(ALPAMAYO_SKIP):
                skipped["Alpamayo action expert"] += 1
                continue
            k = k[4:] if k.startswith("vlm.") else k
        k = _hf_name(k)
        if family == "qwen3_vl" and k.startswith("visual."):
            skipped["Qwen3-VL vision tower (not implemented)"] += 1
            continue
        if k == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: embed_tokens.weight is the one that counts
        found[k] = (file, key)
    for what, n in skipped.items():
        if n:
            log.warning("load_pretrained(%s): skipped %d tensors of the %s", path, n, what)
    first_file, first_key = found.get("embed_tokens.weight", next(iter(found.values())))
    dtype = dtype or _read_tensor(handle(first_file), first_file, first_key).dtype
    model = _empty_model(cfg, None, dtype, device or "cpu")
    shapes, parts = _hf_layout(model)
    _check_keys(shapes, found, f"{path} ({family}{', Alpamayo' if alpamayo else ''})")
    for k, (file, key) in found.items():
        _check_shape(file, key, shapes[k], handle(file).get_slice(key).get_shape())
    sd = model.state_dict()
    with torch.no_grad():
        for name, hf_names in parts.items():
            ts = [_read_tensor(handle(found[h][0]), found[h][0], found[h][1]) for h in hf_names]
            sd[name].copy_(torch.cat(ts).reshape(sd[name].shape))
        if model.traj_head is not None:
            model.traj_head.apply(VLA._init_weights)
    log.warning("load_pretrained(%s): trajectory head not in the checkpoint, randomly initialised", path)
    return model


# ---- main: sizes and a decode-speed sanity check ----

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Build a preset, print its size, time prefill and decode.")
    ap.add_argument("--preset", default="toy-target", choices=sorted(PRESETS), help="model preset")
    ap.add_argument("--draft", default=None, choices=sorted(DRAFT_PRESETS), help="also build this draft")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and cache dtype")
    ap.add_argument("--prompt", type=int, default=256, help="prompt length for the timing")
    ap.add_argument("--steps", type=int, default=32, help="decode steps for the timing")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = PRESETS[args.preset]
    with torch.device(args.device):
        target = VLA(cfg).to(getattr(torch, args.dtype)).eval()
    models = {"target": target}
    if args.draft:
        models["draft"] = make_draft(target, **DRAFT_PRESETS[args.draft]).eval()
    for name, model in models.items():
        n = sum(p.numel() for p in model.parameters())
        ids = torch.randint(10, cfg.vocab_size, (1, args.prompt), device=args.device)
        with torch.inference_mode():
            warm = model.new_cache(max_len=args.prompt + 2)  # first calls pay one-time allocation costs
            model(model(ids, cache=warm, logits_to_keep=1).argmax(-1), cache=warm)
            cache = model.new_cache(max_len=args.prompt + args.steps)
            t0 = time.perf_counter()
            logits = model(ids, cache=cache, logits_to_keep=1)
            t1 = time.perf_counter()
            for _ in range(args.steps):
                logits = model(logits[:, -1:].argmax(-1), cache=cache)
            t2 = time.perf_counter()
        print(f"{name}: {n / 1e6:.2f}M own params, prefill {args.prompt} tok {1e3 * (t1 - t0):.1f} ms, "
              f"decode {1e3 * (t2 - t1) / args.steps:.2f} ms/token ({args.dtype}, {args.device})")
