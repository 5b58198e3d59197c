"""Rotary position embeddings: 1D RoPE, Qwen-VL's 3D M-RoPE, and the draft's FlatRoPE.

Paper: the target (deliberative reasoner) uses 3D M-RoPE as in Qwen2-VL / Qwen2.5-VL
(chunked sections) or Qwen3-VL (interleaved sections); the routine-reasoner draft uses
FlatRoPE, a plain 1D index over the whole sequence, image tokens included (the paper's
FlatRoPE). Semantics follow Hugging Face transformers' Qwen2.5-VL `get_rope_index`
(docs/background.md, "Qwen-VL M-RoPE").

Shapes: B batch, L sequence, H heads, D head_dim, n_img / n_vid number of images / videos.

run: python -m pytest -q tests/test_rope.py
"""
import torch

# ---- 1D rotary basics ----
def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies theta^(-2j/D) for the D/2 rotated pairs -> (D//2,) float32."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor):
    """1D RoPE tables: positions (B, L) int -> cos, sin (B, L, D) float32; M-RoPE's for equal t/h/w ids (decode)."""
    angles = positions[..., None].float() * inv_freq  # (B, L, 1) * (D/2,) -> (B, L, D/2)
    emb = torch.cat((angles, angles), dim=-1)  # (B, L, D): rotate-half pairs j and j + D/2
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, L, D) by cos/sin (B, L, D). cos/sin with as many dims as x are used as
    they are (e.g. (B, L, 1, D) for x laid out (B, L, H, D), or (N, 1, D) for x (N, H, D))."""
    if cos.dim() == x.dim() - 1:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, L, D)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin  # rotate-half: pair (j, j + D/2) rotated by angle j


# ---- 3D M-RoPE ----
def check_mrope_section(mrope_section, head_dim: int) -> None:
    if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2 or min(mrope_section) < 0:
        raise ValueError(
            f"bad mrope_section {list(mrope_section)}: need 3 non-negative (t, h, w) sizes summing to "
            f"head_dim // 2 = {head_dim // 2}, got sum {sum(mrope_section)}")


def mrope_axis(mrope_section, interleaved: bool) -> torch.Tensor:
    """Which position axis (0 = t, 1 = h, 2 = w) each of the D/2 frequency pairs reads -> (D/2,) long.

    Chunked (Qwen2/2.5-VL): the first s_t pairs read t, the next s_h read h, the last s_w read w.
    Interleaved (Qwen3-VL): pair j reads h if j % 3 == 1 and j < 3 s_h, w if j % 3 == 2 and
    j < 3 s_w, else t -- so every axis gets both high and low frequencies."""
    s_t, s_h, s_w = mrope_section
    n = s_t + s_h + s_w
    if not interleaved:
        return torch.tensor([0] * s_t + [1] * s_h + [2] * s_w)
    j = torch.arange(n)
    axis = torch.zeros(n, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * s_h)] = 1
    axis[(j % 3 == 2) & (j < 3 * s_w)] = 2
    return axis


def mrope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, mrope_section, interleaved: bool):
    """M-RoPE tables: position_ids (3, B, L) -> cos, sin (B, L, D) float32. Pair j rotates by
    position_ids[axis[j]] * inv_freq[j]; with t == h == w this is exactly 1D RoPE (rope_cos_sin),
    which is why the FlatRoPE draft is the same decoder fed equal ids on all three axes."""
    check_mrope_section(mrope_section, 2 * inv_freq.numel())
    axis = mrope_axis(mrope_section, interleaved).to(position_ids.device)
    pos = position_ids.permute(1, 2, 0)[..., axis]  # (B, L, 3) -> (B, L, D/2): the id each pair reads
    angles = pos.float() * inv_freq  # (B, L, D/2)
    emb = torch.cat((angles, angles), dim=-1)  # (B, L, D)
    return emb.cos(), emb.sin()


# ---- position ids for a VLA prompt ----
def get_rope_index(input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                   attention_mask=None, *, spatial_merge_size, image_token_id, video_token_id,
                   vision_start_token_id=None, tokens_per_second=1.0):
    """3D position ids (3, B, L) and rope_delta (B, 1) for a prompt of text, images and videos.

    Text: t = h = w = consecutive index. An image/video block with grid (t, H, W) patches and
    spatial merge m is t*(H/m)*(W/m) placeholder tokens in (t, row, col) order; token
    (i, r, c) gets (s + i*interval, s + r, s + c) with s the next free id, interval = 1 for
    images and tokens_per_second * second_per_grid_t for videos (truncated to int as in HF).
    Text after a block resumes at max(previous ids) + 1 (Qwen's rule; see below).
    Grids are consumed in order across the batch, one per block, as in transformers.

    Padding: rows are read through attention_mask, padded slots get id 0, and rope_delta =
    max(id) + 1 - L with L the *padded* length, so "cache index c is position c + rope_delta on
    all three axes" holds per row (transformers 5.x gives the same ids another way).

    Deviation: for a video whose scaled t ids run past its spatial extent, transformers 5.24
    resumes text at s + max(H, W)/m, which can reuse ids; we follow the original Qwen2.5-VL code
    (docs/background.md) and resume at max + 1. The two agree for every image and short videos.
    vision_start_token_id, when given, must open every vision block (<|vision_start|> ...)."""
    B, L = input_ids.shape
    device = input_ids.device
    position_ids = torch.zeros(3, B, L, dtype=torch.long, device=device)
    deltas = torch.zeros(B, 1, dtype=torch.long, device=device)
    grids = {image_token_id: iter(image_grid_thw.tolist() if image_grid_thw is not None else ()),
             video_token_id: iter(video_grid_thw.tolist() if video_grid_thw is not None else ())}
    n_video = 0
    m = spatial_merge_size
    for b in range(B):
        keep = torch.ones(L, dtype=torch.bool, device=device) if attention_mask is None else attention_mask[b].bool()
        ids = input_ids[b][keep]
        ids_list = ids.tolist()
        vis = ((ids == image_token_id) | (ids == video_token_id)).nonzero().flatten().tolist()
        chunks, p, i, k = [], 0, 0, 0  # p: next free id, i: next token, k: index into vis
        while k < len(vis):
            s = vis[k]
            if s > i:  # text before the block
                chunks.append(torch.arange(p, p + s - i).expand(3, -1))
                p += s - i
            kind = ids_list[s]
            name = "image" if kind == image_token_id else "video"
            grid = next(grids[kind], None)
            if grid is None:
                raise ValueError(f"row {b}: {name} block at token {s} has no matching entry in {name}_grid_thw "
                                 f"(more {name} blocks in input_ids than grids)")
            if vision_start_token_id is not None and (s == 0 or ids_list[s - 1] != vision_start_token_id):
                raise ValueError(f"row {b}: {name} block at token {s} is not preceded by the vision_start "
                                 f"token (id {vision_start_token_id})")
            t, h, w = grid
            gh, gw = h // m, w // m
            n = t * gh * gw
            if ids_list[s:s + n] != [kind] * n:
                got = next((j for j in range(s, min(s + n, len(ids_list))) if ids_list[j] != kind), len(ids_list)) - s
                raise ValueError(f"row {b}: {name} block at token {s} has {got} placeholder tokens but its grid "
                                 f"{[t, h, w]} needs t*(h/{m})*(w/{m}) = {n}")
            if kind == video_token_id:
                sec = second_per_grid_ts[n_video] if second_per_grid_ts is not None else 1
                t_ids = (torch.arange(t) * (tokens_per_second * sec)).long()  # HF: float32 product, truncated
                n_video += 1
            else:
                t_ids = torch.arange(t)
            block = torch.stack([  # (3, t, gh, gw) -> (3, n)
                (t_ids.view(t, 1, 1) + p).expand(t, gh, gw),
                (torch.arange(gh).view(1, gh, 1) + p).expand(t, gh, gw),
                (torch.arange(gw).view(1, 1, gw) + p).expand(t, gh, gw)]).reshape(3, n)
            chunks.append(block)
            p = int(block.max()) + 1
            i, k = s + n, k + n
        if i < len(ids_list):
            chunks.append(torch.arange(p, p + len(ids_list) - i).expand(3, -1))
        row = torch.cat(chunks, dim=1).to(device) if chunks else torch.zeros(3, 0, dtype=torch.long, device=device)
        position_ids[:, b, keep] = row
        deltas[b, 0] = (int(row.max()) + 1 if row.numel() else 0) - L
    for kind, name in ((image_token_id, "image"), (video_token_id, "video")):
        if next(grids[kind], None) is not None:
            raise ValueError(f"{name}_grid_thw has more entries than there are {name} blocks in input_ids")
    return position_ids, deltas


def flat_position_ids(input_ids, attention_mask=None):
    """FlatRoPE: the draft's ids 0, 1, 2, ... over the whole sequence, image tokens included, equal on all
    three axes -> position_ids (3, B, L), rope_delta (B, 1) (0 without padding); reads only input_ids' shape and device.
    Why (the paper): under M-RoPE the ~2900 image tokens of an Alpamayo prompt span only max(h, w) ids, a few
    dozen from the text, and dominate attention; flat, they lie far from the CoC being written, and RoPE's
    distance decay moves the draft's attention to the nearby trajectory-history tokens."""
    B, L = input_ids.shape[:2]
    device = input_ids.device
    mask = torch.ones(B, L, dtype=torch.long, device=device) if attention_mask is None else attention_mask.long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0) * mask  # (B, L): consecutive over real tokens, 0 on pads
    delta = mask.sum(-1, keepdim=True) - L  # (B, 1): next id = c + delta with c the padded cache index
    return pos.unsqueeze(0).expand(3, B, L), delta
