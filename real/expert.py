"""Alpamayo-R1's flow-matching action expert: the trajectory step that follows the chain of causation.

A decoder stack of its own width, layer i attending to layer i of the VLM's KV cache of prompt + CoC +
<|traj_future_start|>, runs over 64 action tokens (one per 0.1 s step: a normalised acceleration and curvature);
10 Euler steps of its flow velocity carry noise (t = 0) to actions (t = 1), which the unicycle model integrates.

Paper: RSD accelerates the unmodified Alpamayo-R1's reasoning step and leaves this one as it is (docs/background.md,
"Alpamayo-R1's action expert"; facts from NVIDIA's public Alpamayo-R1 code).
Letters: B batch, N action tokens, De expert width, F Fourier features per input, L tokens in the VLM cache.

run: python -m pytest -q tests/test_alpamayo.py
"""
import dataclasses
from dataclasses import dataclass
import math

import torch
import torch.nn as nn

from model import Block, KVCache, ModelConfig, RMSNorm, grouped_mask
from rope import rope_cos_sin, rope_inv_freq

# ---- config ----
def config_field(raw, path, where, what="Alpamayo config field"):
    """raw['a']['b'] for path 'a.b' of a config.json; a missing one is an error naming it (what: the field's kind)."""
    node = raw
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"{where}: missing {what} {path!r}")
        node = node[part]
    return node


@dataclass
class ExpertConfig:
    hidden_size: int = 2048  # De; the layers, KV heads, head_dim and RoPE are the VLM's
    n_heads: int = 16
    intermediate_size: int = 8256  # SwiGLU width
    n_waypoints: int = 64  # N action tokens, one per dt
    dt: float = 0.1  # s between waypoints
    accel_mean: float = 0.0  # action normalisation: a = a_norm * accel_std + accel_mean (m/s^2)
    accel_std: float = 1.0
    curvature_mean: float = 0.0  # kappa = kappa_norm * curvature_std + curvature_mean (1/m)
    curvature_std: float = 1.0
    fourier_feats: int = 20  # F per scalar input (sin and cos of F / 2 log-spaced frequencies)
    max_freq: float = 100.0  # highest Fourier frequency (cycles per unit input)
    in_proj_hidden: int = 512  # width of the input projection's MLP
    in_proj_layers: int = 2  # its RMSNorm + Linear stages after the first Linear
    euler_steps: int = 10  # flow integration steps from t = 0 to t = 1

    # Alpamayo config.json -> field; every entry is required (upstream writes all of them)
    FIELDS = {"hidden_size": "expert_cfg.hidden_size", "n_heads": "expert_cfg.num_attention_heads",
              "intermediate_size": "expert_cfg.intermediate_size", "n_waypoints": "action_space_cfg.n_waypoints",
              "dt": "action_space_cfg.dt", "accel_mean": "action_space_cfg.accel_mean",
              "accel_std": "action_space_cfg.accel_std", "curvature_mean": "action_space_cfg.curvature_mean",
              "curvature_std": "action_space_cfg.curvature_std",
              "fourier_feats": "action_in_proj_cfg.num_fourier_feats", "max_freq": "action_in_proj_cfg.max_freq",
              "in_proj_hidden": "action_in_proj_cfg.hidden_size", "in_proj_layers": "action_in_proj_cfg.num_enc_layers",
              "euler_steps": "diffusion_cfg.num_inference_steps"}

    @classmethod
    def from_alpamayo(cls, raw: dict, vlm: ModelConfig, where="config.json"):
        """Every path in FIELDS of an Alpamayo config.json (dict), checked against the VLM's: the expert reads its KV
        cache, so head_dim and KV heads must match; only Euler integration and non-causal action tokens."""
        cfg = cls(**{f.name: type(f.default)(config_field(raw, cls.FIELDS[f.name], where))
                     for f in dataclasses.fields(cls)})
        ex = raw["expert_cfg"]
        for key, want in (("head_dim", vlm.head_dim), ("num_key_value_heads", vlm.n_kv_heads)):
            if ex.get(key, want) != want:
                raise ValueError(f"{where}: expert_cfg.{key} = {ex[key]} but the VLM has {want}: the expert "
                                 "attends to the VLM's KV cache, so they must match")
        if raw["diffusion_cfg"].get("int_method", "euler") != "euler":
            raise ValueError(f"{where}: diffusion_cfg.int_method {raw['diffusion_cfg']['int_method']!r}: only euler")
        if not raw.get("expert_non_causal_attention", True):
            raise ValueError(f"{where}: expert_non_causal_attention false (causal action tokens) is not implemented")
        return cfg


# ---- action input projection ----
def fourier_freqs(n, max_freq, device=None):
    """The n / 2 frequencies of n Fourier features, log-spaced over [1, max_freq]: fixed by the config."""
    return torch.logspace(0, math.log10(max_freq), n // 2, device=device)


def fourier(x, n, max_freq):
    """x (...) -> (..., n): sin and cos of 2 pi f x for the fourier_freqs f, scaled by sqrt(2) (unit
    mean square). Computed in fp32 and never stored, so a dtype change cannot round the frequencies."""
    arg = x.float()[..., None] * fourier_freqs(n, max_freq, x.device) * (2 * math.pi)  # (..., n/2)
    return torch.cat([arg.sin(), arg.cos()], -1) * math.sqrt(2)


class ActionInProj(nn.Module):
    """Per action token: Fourier features of (acceleration, curvature) and of the flow time t,
    concatenated (3F), through an MLP (Linear, SiLU, then RMSNorm + Linear stages) to De, LayerNorm."""

    def __init__(self, cfg: ExpertConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.in_proj_hidden
        trunk = [nn.Linear(3 * cfg.fourier_feats, h), nn.SiLU()]
        for i in range(cfg.in_proj_layers):
            last = i == cfg.in_proj_layers - 1
            trunk += [RMSNorm(h, eps=1e-5), nn.Linear(h, cfg.hidden_size if last else h)]
            trunk += [] if last else [nn.SiLU()]
        self.encoder = nn.Module()
        self.encoder.trunk = nn.Sequential(*trunk)  # keys encoder.trunk.{0, 2, 3, 5, 6}: Alpamayo's layout
        self.norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, x, t):
        """x (B, N, 2) normalised actions at flow time t (B,) -> (B, N, De)."""
        c, N = self.cfg, x.shape[1]
        feats = [fourier(x[..., i], c.fourier_feats, c.max_freq) for i in range(2)]  # 2 x (B, N, F)
        feats.append(fourier(t, c.fourier_feats, c.max_freq)[:, None].expand(-1, N, -1))  # (B, F) -> (B, N, F)
        return self.norm(self.encoder.trunk(torch.cat(feats, -1).to(self.norm.weight.dtype)))  # 3F -> De


# ---- the expert ----
class ActionExpert(nn.Module):
    """Decoder layers of width De over the action tokens, reading the VLM's KV cache layer by layer;
    module names follow Alpamayo's keys (`expert.*`, `action_in_proj.*`, `action_out_proj.*`)."""

    def __init__(self, cfg: ExpertConfig, vlm: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # Alpamayo builds the expert from the VLM's text config with the width overridden
        self.layer_cfg = dataclasses.replace(vlm, hidden_size=cfg.hidden_size, n_heads=cfg.n_heads, vision=None,
                                             intermediate_size=cfg.intermediate_size, traj_len=0, shared_width=None)
        self.layers = nn.ModuleList(Block(self.layer_cfg) for _ in range(vlm.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, vlm.rms_norm_eps)
        self.action_in_proj = ActionInProj(cfg)
        self.action_out_proj = nn.Linear(cfg.hidden_size, 2)
        # rotary frequencies per device, built once (a copy per Euler step would host-sync inside the timed action
        # stage); a dict, not a buffer: a dtype conversion of the module cannot round them
        self._inv_freq = {}

    def inv_freq(self, device):  # (hd/2,) fp32
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.layer_cfg.head_dim, self.layer_cfg.rope_theta).to(device)
        return self._inv_freq[device]

    def stack(self, h, cache: KVCache):
        """Action tokens h (B, N, De) -> (B, N, De), each layer attending to the same layer of `cache` (prompt + CoC +
        <|traj_future_start|>, each row its own length: the release's per-row mask) and to its row's N tokens. Their
        K/V are written after each row's committed length, which never advances: the cache is unchanged for the next
        Euler step (Alpamayo appends them, then crops back)."""
        B, N, L = *h.shape[:2], max(cache.lengths)
        if L + N > cache.max_len:
            raise ValueError(f"the expert's {N} action tokens need a KV cache of {L} + {N} slots, max_len is "
                             f"{cache.max_len}")
        slots = cache.slots(N)  # (B, N): after each row's <|traj_future_start|>, equal on t, h, w
        cos, sin = (t.to(h.dtype).unsqueeze(2) for t in rope_cos_sin(slots + cache.rope_delta, self.inv_freq(h.device)))
        mask = (torch.arange(cache.max_len, device=h.device) <= slots[:, -1:])[:, None].expand(B, N, -1)  # (B, N, S):
        # the row's committed slots and its N action tokens, not causal
        if cache.key_mask is not None:
            mask = mask & cache.key_mask[:, None]
        mask = grouped_mask(mask, self.layer_cfg.n_heads // self.layer_cfg.n_kv_heads, h.dtype)  # (B, 1, g*N, S)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache, i, mask, slots)  # VLA.step's attention: bidirectional action tokens
        return self.norm(h)

    def velocity(self, x, t, cache):
        """The flow's velocity (B, N, 2) at normalised actions x (B, N, 2) and time t (B,)."""
        h = self.action_in_proj(x, t)  # (B, N, De)
        return self.action_out_proj(self.stack(h, cache)).float()

    @torch.no_grad()
    def sample(self, cache, generator=None):
        """Euler integration of the flow from noise (t = 0) to normalised actions (t = 1) -> (B, N, 2).
        Training pairs x_t = t x + (1 - t) noise with the velocity x - noise. generator: one, or a list, one per row
        (each row's noise its own: a row's plan does not change with its batch)."""
        B, n, shape, dev = len(cache.lengths), self.cfg.euler_steps, (self.cfg.n_waypoints, 2), cache.rope_delta.device
        if isinstance(generator, list):
            x = torch.stack([torch.randn(shape, generator=g, device=dev) for g in generator])  # (B, N, 2)
        else:
            x = torch.randn(B, *shape, generator=generator, device=dev)
        for k in range(n):
            x = x + self.velocity(x, torch.full((B,), k / n, device=x.device), cache) / n  # t = k / n
        return x

    def forward(self, cache, v0, generator=None):
        """Waypoints (B, N, 2) in metres, ego frame (x forward, y left), from a cache that ends with
        <|traj_future_start|> and the current speed v0 (B,) in m/s."""
        return unicycle(self.sample(cache, generator), v0, self.cfg)


# ---- kinematics ----
def unicycle(action, v0, cfg: ExpertConfig):
    """Normalised (acceleration, curvature) per step (B, N, 2) -> (x, y) waypoints (B, N, 2), by the unicycle model
    from speed v0 (B,), heading 0 at the origin: v_(k+1) = v_k + a_k dt; theta_(k+1) = theta_k + kappa_k (v_k dt +
    a_k dt^2 / 2) (the step's arc length); positions by the trapezoid rule on v cos(theta), v sin(theta)."""
    a = action[..., 0].float() * cfg.accel_std + cfg.accel_mean  # (B, N)
    kappa = action[..., 1].float() * cfg.curvature_std + cfg.curvature_mean
    dt = cfg.dt
    v = torch.cat([v0[:, None], v0[:, None] + torch.cumsum(a * dt, -1)], -1)  # (B, N + 1)
    dtheta = kappa * (v[:, :-1] * dt + a * dt * dt / 2)  # (B, N)
    theta = torch.cat([torch.zeros_like(v0)[:, None], torch.cumsum(dtheta, -1)], -1)  # (B, N + 1)
    vxy = torch.stack([v * theta.cos(), v * theta.sin()], -1)  # (B, N + 1, 2)
    return torch.cumsum((vxy[:, :-1] + vxy[:, 1:]) * dt / 2, 1)  # (B, N, 2): the trapezoid rule


def speed_from_history(xyz, dt=0.1):
    """Current speed (B,) from past poses xyz (B, T, 3), the last one now: the last step's length / dt.
    Alpamayo fits a smoothed velocity profile to the whole history; on a smooth history they agree."""
    return (xyz[:, -1, :2] - xyz[:, -2, :2]).norm(dim=-1) / dt
