"""The VLA's vision towers: Qwen2.5-VL's windowed ViT and Qwen3-VL's ViT with DeepStack, both ending in an m x m patch
merger into the language model's width, and `patchify`, the Qwen-VL image processor's patch flattening; semantics as
transformers' vision models (the version pinned in requirements-test.txt), written anew.

Paper: the deliberative reasoner Alpamayo-R1 (Qwen3-VL-8B; the paper era used Qwen2.5-VL) fills the prompt's image
placeholders with ~2,900 visual tokens (docs/background.md, "Qwen3-VL's vision tower and DeepStack").

Letters: N patches (every frame of every image / video, in patchify order), C tower width, m spatial merge, hd head
dim, n_seg attention segments (frames or windows), Lmax their longest.

run: python -m pytest -q tests/test_model.py tests/test_checkpoint.py
"""
from dataclasses import dataclass

from einops import rearrange
import torch
import torch.nn as nn
import torch.nn.functional as F

from rope import apply_rope, rope_inv_freq

FAMILIES = ("qwen2_5_vl", "qwen3_vl")

# ---- config ----
@dataclass
class VisionConfig:
    family: str = "qwen2_5_vl"  # "qwen2_5_vl": windowed ViT, RMSNorm, SwiGLU; "qwen3_vl": learned positions, DeepStack
    patch_size: int = 2  # p: pixels per patch side (Qwen2.5-VL: 14, Qwen3-VL: 16)
    temporal_patch_size: int = 1  # frames per patch (Qwen2.5-VL / Qwen3-VL: 2)
    spatial_merge_size: int = 2  # m: m x m patches merge into one LM token
    in_channels: int = 3
    depth: int = 2  # ViT blocks
    hidden: int = 128  # ViT width
    heads: int = 4  # ViT heads; hidden / heads must be divisible by 4 (2D rotary)
    intermediate: int = 256  # ViT MLP width
    window_size: int = 16  # qwen2_5_vl: window side in pixels for windowed blocks (Qwen2.5-VL: 112)
    fullatt_block_indexes: tuple = (1,)  # qwen2_5_vl: blocks with full per-frame attention; the rest are windowed
    rope_theta: float = 10000.0  # base of the 2D (row, col) rotary embedding
    num_position_embeddings: int = 2304  # qwen3_vl: learned positions on a square grid (48 x 48 for Qwen3-VL-8B)
    deepstack_visual_indexes: tuple = ()  # qwen3_vl: blocks whose output feeds a DeepStack merger (8B: 8, 16, 24)

    def __post_init__(self):
        self.fullatt_block_indexes = tuple(self.fullatt_block_indexes)
        self.deepstack_visual_indexes = tuple(self.deepstack_visual_indexes)
        check_config(self)


# ---- shared layers ----
def _segments(lengths: torch.Tensor):
    """Contiguous segments of a packed sequence as a padded gather: idx, valid (n_seg, Lmax)."""
    starts = lengths.cumsum(0) - lengths
    ar = torch.arange(int(lengths.max()), device=lengths.device)
    valid = ar < lengths[:, None]  # (n_seg, Lmax)
    return (starts[:, None] + ar).clamp(max=int(lengths.sum()) - 1), valid


def in_patch_order(grid, m, per_patch):
    """per_patch(h, w) (h, w, k) of every (t, h, w) in grid, rows listed as patchify lists patches -> (N, k): in
    merge-block order (block row, block col, row in block, col in block), repeated for every temporal patch."""
    return torch.cat([rearrange(per_patch(h, w), "(bh mr) (bw mc) k -> (bh bw mr mc) k", mr=m, mc=m).repeat(t, 1)
                      for t, h, w in grid])


def patch_positions(grid, m):
    """(row, col) of every patch, patches listed in m x m merge-block order -> (N, 2)."""
    def rows_cols(h, w):  # (h, w, 2)
        return torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1)
    return in_patch_order(grid, m, rows_cols)


def rotary_2d(pos, inv_freq):
    """cos, sin (N, 1, hd) of the 2D rotary: the first hd/4 pairs rotate by the row, the next by the column."""
    angles = (pos[..., None].float() * inv_freq).flatten(1)  # (N, 2, hd/4) -> (N, hd/2): rows, cols
    emb = torch.cat((angles, angles), -1)[:, None]  # (N, 1, hd)
    return emb.cos(), emb.sin()


def frame_segments(grid, device):
    """Attention segments of full per-frame attention: one per temporal patch of every image / video."""
    return _segments(torch.tensor([h * w for t, h, w in grid for _ in range(t)], device=device))


class VisionAttention(nn.Module):
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.heads = vc.heads
        self.qkv = nn.Linear(vc.hidden, 3 * vc.hidden)
        self.proj = nn.Linear(vc.hidden, vc.hidden)

    def forward(self, x, cos, sin, seg):
        N, C = x.shape
        q, k, v = self.qkv(x).view(N, 3, self.heads, -1).unbind(1)  # 3 x (N, heads, hd)
        q, k = (apply_rope(t.float(), cos, sin).to(x.dtype) for t in (q, k))  # rotary in fp32 as Qwen; cos (N, 1, hd)
        idx, valid = seg  # attention stays inside each frame / window: pad segments into a batch
        q, k, v = (t[idx].transpose(1, 2) for t in (q, k, v))  # (n_seg, heads, Lmax, hd)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
        return self.proj(y.transpose(1, 2)[valid].reshape(N, C))  # (n_seg, Lmax, heads, hd) -> (N, C)


class VisionMLP(nn.Module):  # Qwen2.5-VL's SwiGLU or Qwen3-VL's GELU MLP, each with its Hugging Face names
    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.swiglu, C, inter = vc.family == "qwen2_5_vl", vc.hidden, vc.intermediate
        if self.swiglu:
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(C, inter), nn.Linear(C, inter), nn.Linear(inter, C)
        else:
            self.linear_fc1, self.linear_fc2 = nn.Linear(C, inter), nn.Linear(inter, C)

    def forward(self, x):
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))  # Qwen3-VL: gelu_pytorch_tanh


class VisionBlock(nn.Module):  # pre-norm attention + MLP; Qwen2.5-VL's norm is RMSNorm, Qwen3-VL's LayerNorm
    def __init__(self, vc: VisionConfig, rms_norm):
        super().__init__()
        self.norm1, self.norm2 = (nn.LayerNorm(vc.hidden, eps=1e-6) if vc.family == "qwen3_vl" else rms_norm(vc.hidden)
                                  for _ in range(2))
        self.attn, self.mlp = VisionAttention(vc), VisionMLP(vc)

    def forward(self, x, cos, sin, seg):
        x = x + self.attn(self.norm1(x), cos, sin, seg)
        return x + self.mlp(self.norm2(x))


class _Tower(nn.Module):
    """What both towers share: the patch embedding, a Linear over the flattened (C, tp, p, p) patch (== Qwen's
    stride-p Conv3d), and the 2D rotary's frequencies."""

    def __init__(self, vc: VisionConfig, bias):
        super().__init__()
        self.vc = vc
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2, vc.hidden,
                                          bias=bias)
        self.reset_buffers()

    def reset_buffers(self, device=None):
        hd = self.vc.hidden // self.vc.heads  # rows and cols each take hd/4 frequency pairs
        self.register_buffer("inv_freq", rope_inv_freq(hd // 2, self.vc.rope_theta).to(device), persistent=False)


# ---- Qwen2.5-VL tower ----
class PatchMerger(nn.Module):
    def __init__(self, vc: VisionConfig, out_dim, rms_norm):
        super().__init__()
        self.width = vc.hidden * vc.spatial_merge_size ** 2
        self.ln_q = rms_norm(vc.hidden)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.width))  # (N, C) -> (N / m^2, m^2 C) -> (N / m^2, D)


class VisionTower(_Tower):
    """Qwen2.5-VL ViT: patch embedding, 2D rotary blocks, window attention except in fullatt blocks, m x m merger."""

    def __init__(self, vc: VisionConfig, out_dim, rms_norm):
        super().__init__(vc, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(vc, rms_norm) for _ in range(vc.depth))
        self.merger = PatchMerger(vc, out_dim, rms_norm)

    def windows(self, grid):
        """Permutation of merged tokens into ws x ws windows (ragged at the edges), and the window lengths (patches)."""
        m, ws = self.vc.spatial_merge_size, self.vc.window_size // self.vc.spatial_merge_size // self.vc.patch_size
        order, lens, off = [], [], 0
        for t, h, w in grid:
            gh, gw = h // m, w // m
            nh, nw = -(-gh // ws), -(-gw // ws)
            idx = F.pad(torch.arange(t * gh * gw).view(t, gh, gw), (0, nw * ws - gw, 0, nh * ws - gh), value=-1)
            # (t, nh*ws, nw*ws) -> (t*nh*nw, ws*ws): a row per window, its merged tokens in row-major order
            idx = rearrange(idx, "t (nh wr) (nw wc) -> (t nh nw) (wr wc)", wr=ws, wc=ws)
            keep = idx >= 0
            order.append(idx[keep] + off)
            n = keep.sum(1)
            lens.append(n[n > 0] * m * m)
            off += t * gh * gw
        return torch.cat(order), torch.cat(lens)

    def forward(self, pixel_values, grid_thw):
        """pixel_values (N, C*tp*p*p) in patchify order, grid_thw (n, 3) -> (N / m^2, D)."""
        mu = self.vc.spatial_merge_size ** 2
        grid, dev = grid_thw.tolist(), pixel_values.device
        x = self.patch_embed.proj(pixel_values.to(self.patch_embed.proj.weight.dtype))  # (N, C)
        N = x.shape[0]
        order, win_lens = (t.to(dev) for t in self.windows(grid))
        x = x.view(N // mu, mu, -1)[order].view(N, -1)  # (N/m^2, m^2, C): merge groups regrouped by window
        pos = patch_positions(grid, self.vc.spatial_merge_size).to(dev).view(N // mu, mu, 2)[order].view(N, 2)  # (N, 2)
        cos, sin = rotary_2d(pos, self.inv_freq)
        frames, wins = frame_segments(grid, dev), _segments(win_lens)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frames if i in self.vc.fullatt_block_indexes else wins)
        return self.merger(x)[torch.argsort(order)]  # (N / m^2, D), back in patchify order


# ---- Qwen3-VL tower with DeepStack ----
class Qwen3PatchMerger(nn.Module):
    """m x m patches -> one LM token; DeepStack's (postshuffle) normalise after the merge, the final merger before."""

    def __init__(self, vc: VisionConfig, out_dim, postshuffle):
        super().__init__()
        self.width, self.postshuffle = vc.hidden * vc.spatial_merge_size ** 2, postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else vc.hidden, eps=1e-6)
        self.linear_fc1, self.linear_fc2 = nn.Linear(self.width, self.width), nn.Linear(self.width, out_dim)

    def forward(self, x):
        # (N, C) -> (N / m^2, m^2 C), normalised after the merge (postshuffle) or before it
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # (N / m^2, D)


class Qwen3VisionTower(_Tower):
    """Qwen3-VL ViT: patch embedding (with bias) plus learned positions; 2D rotary blocks, full attention per frame; the
    m x m merger, and a DeepStack merger per listed block, whose features the first decoder layers add."""

    def __init__(self, vc: VisionConfig, out_dim):
        super().__init__(vc, bias=True)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden)
        self.blocks = nn.ModuleList(VisionBlock(vc, None) for _ in range(vc.depth))
        self.merger = Qwen3PatchMerger(vc, out_dim, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(vc, out_dim, postshuffle=True)
                                                   for _ in vc.deepstack_visual_indexes)

    def position_embedding(self, grid):
        """The learned grid, resampled bilinearly (corners aligned) to each (h, w), in patchify order -> (N, C) fp32."""
        side = round(self.vc.num_position_embeddings ** 0.5)
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)  # (side^2, C) -> (1, C, side, side)
        return in_patch_order(grid, self.vc.spatial_merge_size, lambda h, w: F.interpolate(
            table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0))  # (C, h, w) -> (h, w, C)

    def forward(self, pixel_values, grid_thw):
        """pixel_values (N, C*tp*p*p) in patchify order, grid_thw (n, 3) -> merged features (N / m^2, D)
        and the DeepStack features, one (N / m^2, D) per entry of deepstack_visual_indexes."""
        grid, dev = grid_thw.tolist(), pixel_values.device
        x = self.patch_embed.proj(pixel_values.to(self.patch_embed.proj.weight.dtype))  # (N, C)
        x = x + self.position_embedding(grid).to(dev, x.dtype)
        cos, sin = rotary_2d(patch_positions(grid, self.vc.spatial_merge_size).to(dev), self.inv_freq)
        frames = frame_segments(grid, dev)
        deepstack = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frames)
            if i in self.vc.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.vc.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack


def make_tower(vc: VisionConfig, out_dim, rms_norm):
    """The family's tower. rms_norm: the decoder's RMSNorm class (model.RMSNorm), which Qwen2.5-VL's tower uses too;
    passed in because model.py imports this file, not the other way round."""
    return VisionTower(vc, out_dim, rms_norm) if vc.family == "qwen2_5_vl" else Qwen3VisionTower(vc, out_dim)


# ---- patchify ----
def patchify(frames, patch_size, temporal_patch_size, merge_size):
    """frames (T, C, H, W), already normalised -> pixel_values (N, C*tp*p*p), grid_thw (3,): the Qwen2-VL image
    processor's flattening; T is padded to a multiple of temporal_patch_size by repeating the last frame."""
    T, C, H, W = frames.shape
    p, tp, m = patch_size, temporal_patch_size, merge_size
    if H % (p * m) or W % (p * m):
        raise ValueError(f"frame size {H}x{W} must be divisible by patch_size * merge_size = {p * m}")
    if T % tp:
        frames = torch.cat([frames, frames[-1:].expand(tp - T % tp, -1, -1, -1)])
    gt, gh, gw = frames.shape[0] // tp, H // p, W // p
    # (gt*tp, C, gh*p, gw*p) -> (gt*gh*gw, C*tp*p*p): patches in merge-block order, each flattened as (C, tp, p, p)
    x = rearrange(frames, "(gt tp) c (bh mr ph) (bw mc pw) -> (gt bh bw mr mc) (c tp ph pw)",
                  tp=tp, mr=m, mc=m, ph=p, pw=p)
    return x, torch.tensor([gt, gh, gw])


# ---- config checks ----
def check_config(vc: VisionConfig):
    """A clear error for a config the towers cannot build (a preset, a checkpoint's config)."""
    if vc.family not in FAMILIES:
        raise ValueError(f"vision family must be one of {FAMILIES}, got {vc.family!r}")
    if vc.hidden % vc.heads or (vc.hidden // vc.heads) % 4:
        raise ValueError(f"vision hidden {vc.hidden} must split into {vc.heads} heads of a size divisible by 4")
    if vc.family == "qwen2_5_vl" and vc.window_size % (vc.patch_size * vc.spatial_merge_size):
        raise ValueError(f"vision window_size {vc.window_size} must be a multiple of patch_size * "
                         f"spatial_merge_size = {vc.patch_size * vc.spatial_merge_size}")
    if vc.family == "qwen3_vl" and round(vc.num_position_embeddings ** 0.5) ** 2 != vc.num_position_embeddings:
        raise ValueError(f"num_position_embeddings {vc.num_position_embeddings} is not a square grid")
    name = "fullatt_block_indexes" if vc.family == "qwen2_5_vl" else "deepstack_visual_indexes"
    if any(not 0 <= i < vc.depth for i in getattr(vc, name)):
        raise ValueError(f"{name} {getattr(vc, name)} out of range for depth {vc.depth}")


def check_vision_input(model, name, pv, grid, slots, tok):
    """Pixels, grid and placeholders that disagree would scatter features into the wrong slots, or fail obscurely."""
    if model.visual is None:
        raise ValueError(f"{name} pixels given but this model has no vision tower "
                         "(a draft reads inputs_embeds=target.embed(...))")
    if grid is None:
        raise ValueError(f"{name} pixels given without {name}_grid_thw")
    n_patch, n_tok, m2 = int(grid.prod(-1).sum()), int(slots.sum()), model.cfg.spatial_merge_size ** 2
    if pv.shape[0] != n_patch:
        raise ValueError(f"{name} pixel values have {pv.shape[0]} patches but {name}_grid_thw {grid.tolist()} "
                         f"describes {n_patch}")
    if n_tok != n_patch // m2:
        raise ValueError(f"{n_tok} {name} tokens (id {tok}) in input_ids but {name}_grid_thw {grid.tolist()} gives "
                         f"{n_patch // m2} merged tokens")
