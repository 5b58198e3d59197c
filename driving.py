"""Synthetic driving world: a toy where the paper's premise (most chain-of-causation tokens are *routine*, predictable
from the ego-trajectory history; a few are *commitments* that need fresh visual evidence) holds by construction.

Each scene mirrors Alpamayo-R1's prompt and CoC layout (docs/background.md): a 2-frame front-camera video (12 merged
tokens, all the decision evidence), `views` surround images of roadside clutter (24 merged tokens each), 16 past steps
at 10 Hz as 48 binned (dx, dy, dheading) history tokens, a CoC "state , decision , roadside actors" (docs/results.md
has an example) and 32 future waypoints from a unicycle rollout that follows the decision. `commitment_positions`
marks the ~5.7 of ~22 tokens that the history class and the CoC prefix leave open. Design: docs/toy-notes.md.

run: python driving.py --seed 0
"""
import argparse
from collections import Counter, defaultdict
import copy
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import product

import math

import numpy as np
import torch

from vision import patchify  # vision.py owns the Qwen2-VL flattening order, so the vision tower sees HF's layout

# ---- config ----
MAX_VIEWS = 21  # the most surround views a prompt may have: the toy target trains on every count 0..MAX_VIEWS


@dataclass(frozen=True)
class WorldConfig:
    height: int = 24               # front raster (px): 2 x 3 merged tokens per frame at PATCH 4, MERGE 3
    width: int = 36
    res: float = 1.25              # metres per pixel: the view reaches ~26 m ahead of the ego and ~22 m to each side
    ego_row: int = 21              # ego's pixel row (x = 0); rows above it are ahead
    ego_col: int = 18              # ego's pixel column (ego-lane centre at y = 0): the middle token column's centre
    dt: float = 0.1                # 10 Hz poses, as in Alpamayo
    n_hist: int = 16               # past steps -> 16 x (dx, dy, dh) = 48 history tokens
    n_future: int = 32             # future waypoints (3.2 s)
    # per-step history bins (lo, hi, n), fine enough that the tokens fix every routine factor (read_history)
    dx_bins: tuple = (0.0, 1.6, 32)          # forward motion (m): 0.05 m = 0.5 m/s per bin
    dy_bins: tuple = (-0.032, 0.032, 16)     # lateral motion in the previous pose's frame (m)
    dh_bins: tuple = (-0.03225, 0.03225, 129)  # heading change (rad), 0.0005 per bin; straight driving: one bin
    lane_width: float = 3.5        # the ego lane spans l in [-1.75, 1.75], the oncoming lane [1.75, 5.25]
    stop_margin: float = 1.5       # a stop ends at least this far (m) before the stop line / actor
    stop_within: float = 3.0       # ... and within this many seconds, so stops finish inside the 3.2 s horizon
    nudge_offset: float = 1.5      # lateral offset (m) of a nudge around a cone
    views: int = 16                # surround-camera images in the prompt: the visual-token knob (24 tokens each)
    view_size: tuple = (48, 72)    # (H, W) px of a surround view: 4 x 6 merged tokens


# one plane per channel of an object-level raster, as a perception stack draws it (the surround views: CLUTTER only)
CHANNELS = ("stop_line", "ego", "vehicle", "pedestrian", "cone", "cyclist", "light_red", "light_green", "brake",
            "object", "in_lane", "range_5", "range_10", "range_15", "range_20",
            "building", "vegetation", "curb", "lane_line")
CH = {name: i for i, name in enumerate(CHANNELS)}  # channel name -> plane
APPEARANCE = ("vehicle", "pedestrian", "cone", "cyclist", "light_red", "light_green", "brake")  # what an actor is
CLUTTER = ("building", "vegetation", "curb", "lane_line")
# the raster's tokenisation (train.target_config's vision tower): 4-px patches merged 3x3, a token per 12 x 12 px
PATCH, MERGE = 4, 3
SPECIALS = {"pad": "<pad>", "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>",  # Tokenizer.<name>_id
            "image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "hist_start": "<traj_history_start>",
            "hist_end": "<traj_history_end>", "cot_start": "<cot_start>", "cot_end": "<cot_end>",
            "traj_future_start": "<traj_future_start>"}
SYSTEM = "you are the driving planner of the ego car ."
INSTRUCTION = "explain your decision then plan the trajectory"

# ---- world tables ----
ROADS = {"straight": 0.35, "curve_left": 0.275, "curve_right": 0.275, "intersection": 0.1}
TURN = {"straight": "straight", "curve_left": "left", "curve_right": "right", "intersection": "straight"}
FLAT = {"cruise": .4, "accel": .3, "decel": .3}
# event -> (P(event | non-intersection road), P(history speed profile | event)); intersections: red / green, 50/50.
# Histories correlate with the decision but never fix it: that residual ambiguity is what a commitment token is.
EVENTS = {
    "clear":         (0.15, FLAT),
    "lead_cruise":   (0.17, FLAT),
    "lead_brake":    (0.17, {"cruise": .5, "decel": .4, "accel": .1}),
    "ped_cross":     (0.17, {"cruise": .5, "decel": .4, "accel": .1}),
    "cone_lane":     (0.17, {"cruise": .5, "decel": .2, "accel": .3}),
    "cyclist_lane":  (0.17, {"cruise": .5, "decel": .3, "accel": .2}),
    "red":           (0.0,  {"cruise": .3, "decel": .5, "stand": .2}),
    "green":         (0.0,  {"cruise": .4, "decel": .1, "accel": .2, "stand": .3}),
}
KINDS = ("vehicle", "pedestrian", "cone", "cyclist")
# P(an actor beside the ego lane, per side): never of the in-lane actor's kind, so the kinds in view leave it open
P_ROADSIDE = 0.6
# P(the current frame shows what the actors are, one-hop readable); otherwise only the earlier frame does
P_SEEN_NOW = 0.5
# Held-out (event, roadside kind, road): never in train/val, the whole test split; both assignments of a kind pair
# are held out, so that the kinds in view plus the road never give the answer (docs/toy-notes.md).
HELD_OUT = (("cone_lane", "pedestrian", "curve_left"), ("ped_cross", "cone", "curve_left"),
            ("ped_cross", "vehicle", "curve_right"), ("lead_cruise", "pedestrian", "curve_right"),
            ("lead_brake", "pedestrian", "curve_right"))
SPLITS = {"train": 0, "val": 1, "test": 2}
# speed bands (km/h word -> current speed range in m/s), >= 2.8 dx bins apart: the latest dx token gives the band
BAND_V = {"10": (2.2, 3.6), "20": (5.0, 6.4), "30": (7.6, 9.0), "40": (10.4, 11.8)}
BANDS = {"cruise": ("10", "20", "30", "40"), "decel": ("10", "20", "30"), "accel": ("20", "30", "40"), "stand": (None,)}
HIST_ACCEL = {"cruise": 0.0, "decel": -2.0, "accel": 1.5, "stand": 0.0}  # m/s^2 over the 1.6 s history
# curvature ranges (1/m): dh / dx tells them apart at every band; an in-lane actor stays in the centre token column
KAPPA = {"gentle": (0.006, 0.010), "sharp": (0.020, 0.025)}
# Range rings: bands of 4 pixel rows (5 m) ahead of the ego; an actor is placed so that its block lies in its ring.
BUCKET_ROWS = {5: (16, 19), 10: (12, 15), 15: (8, 11), 20: (4, 7)}
ACTORS = {"lead_cruise": "vehicle", "lead_brake": "vehicle", "ped_cross": "pedestrian", "cone_lane": "cone",
          "cyclist_lane": "cyclist"}  # in-lane event -> kind
IN_LANE_L, ROADSIDE_L = (-1.2, 1.2), {"left": (3.0, 25.0), "right": (-25.0, -3.0)}  # lateral offsets (m) at t = 0
COLUMN = {"left": 0, "centre": 1, "right": 2}  # token column of each part of the front view


@dataclass(frozen=True)
class Factors:
    """The discrete factors that fix the CoC. hist_class is what the history tokens tell; the rest needs the image."""
    road: str
    event: str
    speed: str              # history speed profile: cruise | decel | accel | stand
    band: object            # speed band word "10" .. "40" (km/h), None when standing
    sharp: object           # "gentle" | "sharp" on a curve, else None
    bucket: object          # range ring 5 / 10 / 15 / 20 (m) of the in-lane actor / stop line, None on a clear road
    left: object = None     # (kind, range ring) of the actor on the left of the view, or None
    right: object = None    # the same on the right

    turn = property(lambda self: TURN[self.road])
    hist_class = property(lambda self: (self.speed, self.band, self.turn, self.sharp))

    @property
    def decision(self):
        if self.speed == "stand":  # only ever at a light (EVENTS)
            return "stay" if self.event == "red" else "start"
        return {"clear": "keep", "lead_cruise": "follow", "lead_brake": "follow", "ped_cross": "stop", "red": "stop",
                "cone_lane": "nudge", "cyclist_lane": "slow", "green": "proceed"}[self.event]


# ---- grammar ----
def main_words(f):
    """State , decision: the state is what the history tokens tell; the decision word, the lead vehicle's state and
    the range ring need the image."""
    verb = {"cruise": "cruising", "decel": "slowing", "accel": "accelerating"}.get(f.speed)
    road = ["straight"] if f.turn == "straight" else ["in", "a", f.sharp, f.turn, "curve"]
    state = ["standing", "at", "the", "line"] if f.speed == "stand" else [verb] + road + ["at", f.band, "km/h"]
    ahead = [] if f.bucket is None else [str(f.bucket), "m", "ahead"]
    act = {
        "keep": ["keep", "lane", "and"] + {"cruise": ["maintain", "speed"], "decel": ["resume", "speed"],
                                           "accel": ["keep", "accelerating"]}.get(f.speed, []),
        "follow": ["follow", "the", "braking" if f.event == "lead_brake" else "steady", "vehicle"] + ahead,
        "stop": (["stop", "for", "the", "pedestrian"] if f.event == "ped_cross" else
                 ["stop", "at", "the", "red", "light"]) + ahead,
        "nudge": ["nudge", "around", "the", "cone"] + ahead,
        "slow": ["slow", "behind", "the", "cyclist"] + ahead,
        "proceed": ["proceed", "on", "the", "green", "light"],
        "stay": ["stay", "stopped", "at", "the", "red", "light"],
        "start": ["start", "moving", "on", "the", "green", "light"],
    }[f.decision]
    return state + [","] + act


def roadside_words(left, right):
    """The roadside clause (away from intersections): each actor's kind, range ring and side of the view."""
    if left is None and right is None:
        return [",", "nothing", "else", "near"]
    words = []
    for sep, actor, side in ((",", left, "left"), ("and" if left else ",", right, "right")):
        if actor is not None:
            words += [sep, actor[0], str(actor[1]), "m", side]
    return words


def coc_words(f):
    """CoC = state , decision [, roadside actors]."""
    return main_words(f) + ([] if f.road == "intersection" else roadside_words(f.left, f.right))


def _roadside_options(event):
    """One side's possible actors given the in-lane event, with prior probabilities: None or (kind, ring)."""
    kinds = [k for k in KINDS if k != ACTORS.get(event)]
    p = P_ROADSIDE / len(kinds) / len(BUCKET_ROWS)
    return [(None, 1 - P_ROADSIDE)] + [((k, b), p) for k in kinds for b in BUCKET_ROWS]


def _roadside_prior(road, event, split):
    """[((left, right), prior)] that the split allows: held-out combinations only in test, never elsewhere."""
    opts = _roadside_options(event)
    return [((l, r), pl * pr) for l, pl in opts for r, pr in opts
            if any((event, a[0], road) in HELD_OUT for a in (l, r) if a is not None) == (split == "test")]


@lru_cache(maxsize=None)
def roadside_distribution(road, event, split):
    """[((left, right), probability)] for the split (_roadside_prior normalised)."""
    if road == "intersection":
        return [((None, None), 1.0)]
    rows = _roadside_prior(road, event, split)
    z = sum(p for _, p in rows)
    return [(lr, p / z) for lr, p in rows]


@lru_cache(maxsize=None)
def main_distribution(split):
    """[(Factors without roadside actors, probability)] for the split: the prior over road, event, history class
    and range ring, times the prior mass of the roadside combinations the split allows."""
    rows, z = [], sum(EVENTS[e][0] for e in EVENTS)
    for road, p_road in ROADS.items():
        events = {"red": 0.5, "green": 0.5} if road == "intersection" else {
            e: EVENTS[e][0] / z for e in EVENTS if EVENTS[e][0] > 0}
        for event, p_event in events.items():
            allowed = float(split != "test") if road == "intersection" else sum(
                p for _, p in _roadside_prior(road, event, split))
            for speed, p_speed in EVENTS[event][1].items():
                sharps = list(KAPPA) if road.startswith("curve") else [None]
                # rings of the in-lane actor / stop line: 5 m only when waiting at the line (too close to stop or
                # nudge in time from speed: roadside actors only)
                buckets = [None] if event == "clear" else [5] if speed == "stand" else [10, 15, 20]
                for band, sharp, bucket in product(BANDS[speed], sharps, buckets):
                    p = p_road * p_event * allowed * p_speed / len(BANDS[speed]) / len(sharps) / len(buckets)
                    if p > 0:
                        rows.append((Factors(road, event, speed, band, sharp, bucket), p))
    z = sum(p for _, p in rows)
    return [(f, p / z) for f, p in rows]


def _draw(rng, rows):
    """One item of [(item, probability)] by inverse CDF (rng.choice with p= is linear in len(rows) per call)."""
    cdf = np.cumsum([p for _, p in rows])
    return rows[min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(rows) - 1)][0]


def sample_factors(rng, split):
    """The split's factor distribution (main_distribution x roadside_distribution); val shares train's."""
    split = "test" if split == "test" else "train"
    f = _draw(rng, main_distribution(split))
    left, right = _draw(rng, roadside_distribution(f.road, f.event, split))
    return replace(f, left=left, right=right)


def _main_clause(f):
    """The main clause and the token after it: <cot_end> at an intersection, else the roadside clause's ","."""
    return main_words(f) + (["<cot_end>"] if f.road == "intersection" else [","])


@lru_cache(maxsize=None)
def _continuations():
    """(history class, main-clause prefix) and (event, roadside-clause prefix) -> every word the world can write next,
    over both splits. The roadside clause (+ <cot_end>) depends only on the event, which the main clause fixes."""
    clauses = {(f.hist_class, tuple(_main_clause(f))) for s in ("train", "test") for f, _ in main_distribution(s)}
    clauses |= {(e, tuple(roadside_words(l, r)[1:]) + ("<cot_end>",))
                for e in EVENTS for (l, _), (r, _) in product(_roadside_options(e), repeat=2)}
    nxt = defaultdict(set)
    for key, words in clauses:
        for i, w in enumerate(words):
            nxt[key, words[:i]].add(w)
    return nxt


@lru_cache(maxsize=65536)
def commitment_positions(f):
    """Per CoC word and <cot_end>: True where it commits (history class + prefix leave more than one continuation)."""
    rest = [] if f.road == "intersection" else roadside_words(f.left, f.right)[1:] + ["<cot_end>"]
    return tuple(len(_continuations()[key, tuple(words[:i])]) > 1
                 for key, words in ((f.hist_class, _main_clause(f)), (f.event, rest)) for i in range(len(words)))


def commitment_words(main_clause_only=False):
    """Every word the grammar leaves open after some prefix: the routine relaxed rule's (beyond/relaxed.py) commitments
    at decode time, without the answer's positions; a word also written where it is routine ("at") stays exact there
    too. main_clause_only: the main clause's alone (what the plan follows), not the roadside actors'."""
    return sorted(set().union(*(words for (key, _), words in _continuations().items()
                                if len(words) > 1 and not (main_clause_only and isinstance(key, str)))))


def routine_share(split="train"):
    """The exact share of CoC tokens (with <cot_end>) that the Bayes-optimal reader of the history class and the CoC
    prefix gets right under the split's distribution (in the roadside clause, P given (road, event)): the toy's
    counterpart of the paper's ~78% of routine tokens."""
    ctx, length, right = defaultdict(Counter), 0.0, 0.0
    for f, p in main_distribution(split):
        words = _main_clause(f)
        for i, w in enumerate(words):
            ctx[(f.hist_class, tuple(words[:i]))][w] += p
        length += p * len(words)
        if f.road != "intersection":  # the roadside clause's expected length and Bayes-right tokens
            side = defaultdict(Counter)
            for (l, r), q in roadside_distribution(f.road, f.event, split):
                rest = roadside_words(l, r)[1:] + ["<cot_end>"]
                length += p * q * len(rest)
                for i, w in enumerate(rest):
                    side[tuple(rest[:i])][w] += q
            right += p * sum(max(c.values()) for c in side.values())
    right += sum(max(c.values()) for c in ctx.values())
    return right / length


# ---- geometry ----
def road_to_xy(s, l, kappa):
    """Lane coordinates (arc length s, lateral l, left positive) -> ego frame (x forward, y left)."""
    if kappa == 0:
        return s, l
    phi = kappa * s
    return (1 / kappa - l) * np.sin(phi), l * np.cos(phi) + (1 - np.cos(phi)) / kappa


# ---- scene ----
@dataclass
class Scene:
    f: Factors              # the discrete factors (road, event, history class, range rings, the off-lane actor)
    kappa: float            # road curvature (1/m, left positive)
    v0: float               # current ego speed (m/s)
    dist: float             # arc length (m) to the actor / stop line at t = 0 (nan if none)
    hist: np.ndarray        # (16, 3) per-step (dx, dy, dh) in the previous pose's frame
    frames: np.ndarray      # (2, C, H, W) uint8 front raster at t = -0.5 s and t = 0 (0 / 1 per channel)
    seen_now: bool          # the current frame shows the actors' appearance too (one-hop readable)
    view_seed: int          # seed of the surround views (render_views): rendered when a prompt is built, not stored
    coc: list               # CoC words (without <cot_end>)
    commit: list            # bool per CoC word + <cot_end>
    traj: np.ndarray        # (32, 2) future waypoints (x, y) in metres, ego frame


def rollout(v0, accel, kappa, cfg):
    """Unicycle: per-step acceleration and curvature (n_future,) -> waypoints (n_future, 2); speed clamps at 0."""
    x = y = th = 0.0
    v, out = v0, []
    for a, k in zip(accel, kappa):
        v_next = max(v + a * cfg.dt, 0.0)
        ds = 0.5 * (v + v_next) * cfg.dt if v_next > 0 else (v * v / (-2 * a) if a < 0 else 0.0)  # exact at standstill
        x, y, th, v = x + ds * np.cos(th + k * ds / 2), y + ds * np.sin(th + k * ds / 2), th + k * ds, v_next
        out.append((x, y))
    return np.array(out, dtype=np.float32)


def plan(f, v0, kappa, dist, cfg):
    """The trajectory follows the decision (and, for follow, the cause): tests/test_driving.py checks it."""
    acc, kap = np.zeros(cfg.n_future), np.full(cfg.n_future, kappa)  # (n_future,) per-step acceleration, curvature
    keep = {"cruise": 0.0, "decel": 1.0, "accel": 1.5}.get(f.speed)  # maintain / resume speed / keep accelerating
    # follow the lead's braking, drop back behind a slower cyclist, start on green
    acc[:] = {"keep": keep, "proceed": keep, "follow": -2.5 if f.event == "lead_brake" else 0.0, "slow": -1.5,
              "start": 2.0}.get(f.decision, 0.0)
    if f.decision == "stop":
        # standstill stop_margin before the obstacle, or earlier so that it happens inside the horizon
        acc[:] = -v0 ** 2 / (2 * min(dist - cfg.stop_margin, 0.5 * v0 * cfg.stop_within))
    if f.decision == "nudge":
        # curvature doublet (left, then back): lateral offset ~ k v^2 tau^2, heading restored to the lane's
        tau = 8
        k = cfg.nudge_offset / (v0 * tau * cfg.dt) ** 2
        kap[:2 * tau] += np.repeat([k, -k], tau)
    return rollout(v0, acc, kap, cfg)                               # "stay": v0 = 0, acc = 0


def lane_planes(kappa, cfg):
    """Per-pixel lane coordinates (S, L) and the ego_lane plane: pixel centres with |l| < lane_width / 2."""
    r, c = np.mgrid[0:cfg.height, 0:cfg.width]
    S, L = x, y = (cfg.ego_row - r) * cfg.res, (cfg.ego_col - c) * cfg.res  # ego frame at each pixel centre
    if kappa != 0:  # road_to_xy inverted
        R = 1 / kappa
        S, L = R * np.arctan2(x / R, (R - y) / R), R - np.sign(R) * np.hypot(x, y - R)
    return S, L, np.abs(L) < cfg.lane_width / 2


def block(s, l, kappa, cfg):
    """The 2x2-px block (top-left pixel (r, c), both even) that holds (s, l). Even-aligned, it never straddles a
    PATCH = 4 ViT patch, so an actor's kind, lane and range sit in one patch's pixels."""
    x, y = road_to_xy(s, l, kappa)
    r, c = int(round(cfg.ego_row - x / cfg.res)), int(round(cfg.ego_col - y / cfg.res))
    return r - r % 2, c - c % 2


def token_of(r, c):
    """The merged video token (row, col) of frame pixel (r, c)."""
    return r // (PATCH * MERGE), c // (PATCH * MERGE)


def render(kappa, actors, stop_line, seen_now, cfg):
    """actors: [(appearance channels, (s, l))]; stop_line: s or None -> (2, C, H, W) uint8. Frame 0, an earlier
    detection registered to the current ego pose as a perception stack's tracks are, paints each actor's APPEARANCE on
    its block now; frame 1 (t = 0) "object", "in_lane" (>= 2 of its pixels in the ego lane), its range ring and, if
    seen_now, its appearance again."""
    S, L, ego_lane = lane_planes(kappa, cfg)
    ring_of_row = {r: b for b, (lo, hi) in BUCKET_ROWS.items() for r in range(lo, hi + 1)}
    out = np.zeros((2, len(CHANNELS), cfg.height, cfg.width), dtype=np.uint8)
    if stop_line is not None:
        out[:, CH["stop_line"]] = (np.abs(S - stop_line) < cfg.res / 2) & (np.abs(L) <= cfg.lane_width / 2)
    out[:, CH["ego"], cfg.ego_row:cfg.ego_row + 2, cfg.ego_col] = 1
    for appearance, pose in actors:
        r, c = block(*pose, kappa, cfg)
        rs, cs = slice(r, r + 2), slice(c, c + 2)   # placement keeps every block inside the raster
        out[:1 + seen_now, [CH[name] for name in appearance], rs, cs] = 1
        out[1, CH["object"], rs, cs] = 1
        if ego_lane[rs, cs].sum() >= 2:
            out[1, CH["in_lane"], rs, cs] = 1
        if r in ring_of_row:
            out[1, CH[f"range_{ring_of_row[r]}"], rs, cs] = 1
    return out


def _place(rng, bucket, l_range, in_lane, kappa, cfg, ego_lane, side):
    """Rejection-sample an actor's (s, l) at t = 0 whose block sits in the bucket's rows inside the raster, with >= 2
    of its pixels on the ego lane (in_lane) or none, in the token column of `side` ("left" / "centre" / "right")."""
    lo, hi = BUCKET_ROWS[bucket]
    for _ in range(1000):
        x = (cfg.ego_row - rng.integers(lo, hi + 1) + rng.uniform(-0.4, 0.4)) * cfg.res
        l = rng.uniform(*l_range)
        # the arc length at which lateral offset l reaches forward distance x (road_to_xy: x = (1/kappa - l) sin phi)
        s = x if kappa == 0 else np.arcsin(np.clip(x / (1 / kappa - l), -1, 1)) / kappa
        r, c = block(s, l, kappa, cfg)
        if token_of(r, c)[1] != COLUMN[side] or not (lo <= r <= hi and r <= cfg.height - 2 and 0 <= c <= cfg.width - 2):
            continue
        hits = int(ego_lane[r:r + 2, c:c + 2].sum())  # pixels of the block in the ego lane
        if hits >= 2 if in_lane else hits == 0:
            return float(s), float(l)
    raise RuntimeError("actor placement failed")


def make_scene(rng, split="train", cfg=WorldConfig(), f=None):
    """A scene of the split: its factors f (drawn from the split's distribution when None), then everything continuous
    (speed, curvature, actor poses, the history, the rasters) drawn given them."""
    f = sample_factors(rng, split) if f is None else f
    kappa = {"curve_left": 1.0, "curve_right": -1.0}.get(f.road, 0.0) * (rng.uniform(*KAPPA[f.sharp]) if f.sharp else 0)
    v0 = rng.uniform(*BAND_V[f.band]) if f.band else 0.0
    # history (16, 3): per step the chord (dx, dy) in the previous pose's frame and dh; constant accel, curvature to v0
    v = v0 - HIST_ACCEL[f.speed] * cfg.dt * np.arange(cfg.n_hist, -1, -1)  # (17,) speeds at the 17 poses
    ds = 0.5 * (v[:-1] + v[1:]) * cfg.dt                                 # (16,) arc length per step
    hist = np.stack([ds * np.cos(kappa * ds / 2), ds * np.sin(kappa * ds / 2), kappa * ds], axis=1)
    ego_lane = lane_planes(kappa, cfg)[2]
    actors, stop_line, dist = [], None, float("nan")
    if f.event in ("red", "green"):
        dist = stop_line = _place(rng, f.bucket, (0.0, 0.0), True, 0.0, cfg, ego_lane, "centre")[0]
        actors.append((("light_" + f.event,), (dist, -3.0)))    # beside the stop line
    else:
        if f.event != "clear":
            dist, l = _place(rng, f.bucket, IN_LANE_L, True, kappa, cfg, ego_lane, "centre")
            actors.append((("vehicle", "brake") if f.event == "lead_brake" else (ACTORS[f.event],), (dist, l)))
        for side, actor in (("left", f.left), ("right", f.right)):  # each in its side's token column: one per token
            if actor is not None:
                actors.append(((actor[0],), _place(rng, actor[1], ROADSIDE_L[side], False, kappa, cfg, ego_lane, side)))
    seen_now = bool(rng.random() < P_SEEN_NOW)
    frames = render(kappa, actors, stop_line, seen_now, cfg)
    return Scene(f, float(kappa), float(v0), dist, hist, frames, seen_now, int(rng.integers(2**31)), coc_words(f),
                 list(commitment_positions(f)), plan(f, v0, kappa, dist, cfg))


def render_views(seed, n, cfg=WorldConfig()):
    """n surround-camera images (n, C, H, W) uint8: 2x2-px blocks of each CLUTTER channel at a density drawn per view
    (every merged token differs; no front-camera channel). View v depends only on (seed, v): fewer are a prefix."""
    H, W = cfg.view_size
    out = np.zeros((n, len(CHANNELS), H, W), dtype=np.uint8)
    first = CHANNELS.index(CLUTTER[0])
    for v in range(n):
        rng = np.random.default_rng([seed, v])
        density = rng.uniform(0.02, 0.2, size=(len(CLUTTER), 1, 1))
        blocks = (rng.random((len(CLUTTER), H // 2, W // 2)) < density).astype(np.uint8)
        out[v, first:first + len(CLUTTER)] = blocks.repeat(2, axis=1).repeat(2, axis=2)
    return out


# ---- tokenizer ----
def bin_edges(spec):
    lo, hi, n = spec
    return lo, (hi - lo) / n, n


class Tokenizer:
    """Whitespace words + special tokens + one id per history bin (dx, dy, dh bins are separate ids)."""

    def __init__(self, cfg=WorldConfig()):
        self.cfg = cfg
        self.bins = {"dx": cfg.dx_bins, "dy": cfg.dy_bins, "dh": cfg.dh_bins}
        hist = [f"<{k}{i}>" for k, spec in self.bins.items() for i in range(spec[2])]
        words = set((SYSTEM + " " + INSTRUCTION).split()).union(*_continuations().values()) - set(SPECIALS.values())
        self.vocab = list(SPECIALS.values()) + hist + sorted(words)
        self.id = {w: i for i, w in enumerate(self.vocab)}
        for name, w in SPECIALS.items():
            setattr(self, name + "_id", self.id[w])

    def __len__(self):
        return len(self.vocab)

    def encode(self, text):
        return [self.id[w] for w in (text.split() if isinstance(text, str) else text)]

    def decode(self, ids):
        return " ".join(self.vocab[int(i)] for i in ids)

    def encode_history(self, hist):
        """(16, 3) deltas -> 48 ids, uniform bins, values clipped into the outer bins."""
        edges = [(k, *bin_edges(spec)) for k, spec in self.bins.items()]
        return [self.id[f"<{k}{int(np.clip((v - lo) // w, 0, n - 1))}>"]
                for row in hist for (k, lo, w, n), v in zip(edges, row)]


# ---- prompts and training examples ----
def build_prompt(scene, tok, views=WorldConfig().views):
    """model.forward kwargs for batch 1, in Alpamayo's order: system text, the camera images (the front camera's two
    frames as a video, then `views` surround images), the history, the instruction, <cot_start>."""
    frames = torch.from_numpy(scene.frames).float()                           # (2, C, 24, 36)
    pixels, grid = patchify(frames, PATCH, 1, MERGE)                          # (108, C*16), (3,): t=2, 6 x 9 patches
    n_video = int(grid.prod()) // MERGE ** 2                                  # merged tokens: 2 x 2 x 3 = 12
    ids = tok.encode(SYSTEM) + [tok.vision_start_id] + [tok.video_token_id] * n_video + [tok.vision_end_id]
    prompt = {"pixel_values_videos": pixels, "video_grid_thw": grid.view(1, 3)}
    if views:
        imgs = torch.from_numpy(render_views(scene.view_seed, views)).float()  # (views, C, 48, 72)
        patches = [patchify(img[None], PATCH, 1, MERGE) for img in imgs]  # per view: (216, C*16), (3,) = (1, 12, 18)
        prompt["pixel_values"] = torch.cat([p for p, _ in patches])          # (views * 216, C*16)
        prompt["image_grid_thw"] = torch.stack([g for _, g in patches])      # (views, 3)
        n_img = int(patches[0][1].prod()) // MERGE ** 2                       # 4 x 6 = 24 merged tokens per view
        ids += ([tok.vision_start_id] + [tok.image_token_id] * n_img + [tok.vision_end_id]) * views
    ids += ([tok.hist_start_id] + tok.encode_history(scene.hist) + [tok.hist_end_id]
            + tok.encode(INSTRUCTION) + [tok.cot_start_id])
    prompt["input_ids"] = torch.tensor([ids])
    return prompt


VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
MAX_COC = 27  # the longest CoC in words (an actor each side); a batch pads to it + <cot_end>, <traj_future_start>


def make_example(scene, tok, views=WorldConfig().views):
    """prompt + CoC + <cot_end> + <traj_future_start>; masks are over positions whose *next* token is CoC/<cot_end>."""
    prompt = build_prompt(scene, tok, views)
    P, n = prompt["input_ids"].shape[1], len(scene.coc)
    coc = tok.encode(scene.coc) + [tok.cot_end_id]
    ids = torch.cat([prompt["input_ids"][0], torch.tensor(coc + [tok.traj_future_start_id])])  # (L,), L = P + n + 2
    loss_mask, commit_mask = torch.zeros(len(ids), dtype=torch.bool), torch.zeros(len(ids), dtype=torch.bool)
    # <cot_start> predicts word 0 ... the last word predicts <cot_end>
    loss_mask[P - 1:P + n], commit_mask[P - 1:P + n] = True, torch.tensor(scene.commit)
    return {"input_ids": ids, "loss_mask": loss_mask, "commit_mask": commit_mask, "prompt_len": P,
            "coc_ids": coc, "traj_index": P + n + 1, "traj": torch.from_numpy(scene.traj),
            **{k: prompt[k] for k in VISION_KEYS if k in prompt}}


def collate(examples, pad_id, length=None, device="cpu"):
    """Right-pad to `length` (default: the longest); vision inputs concatenate in batch order, as the model scatters."""
    B, L = len(examples), max([len(e["input_ids"]) for e in examples] + [length or 0])
    ids, attn = torch.full((B, L), pad_id, dtype=torch.long), torch.zeros(B, L, dtype=torch.long)
    loss, commit = torch.zeros(B, L, dtype=torch.bool), torch.zeros(B, L, dtype=torch.bool)
    for b, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[b, :n], attn[b, :n], loss[b, :n], commit[b, :n] = e["input_ids"], 1, e["loss_mask"], e["commit_mask"]
    out = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss, "commit_mask": commit,
           **{k: torch.tensor([e[k] for e in examples]) for k in ("traj_index", "prompt_len")},
           "traj": torch.stack([e["traj"] for e in examples]),                            # (B, 32, 2)
           "coc_ids": [e["coc_ids"] for e in examples]}
    for k in VISION_KEYS:   # pixel rows (B * N, C*tp*p*p) and grids (B * n_blocks, 3)
        if any(k in e for e in examples):
            out[k] = torch.cat([e[k] for e in examples if k in e])
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in out.items()}


def vision_kwargs(batch):
    return {k: batch[k] for k in VISION_KEYS if k in batch}


def grid_kwargs(batch):
    """The grids alone: what a draft reading the target's prompt embeddings needs for its positions."""
    return {k: batch[k] for k in ("image_grid_thw", "video_grid_thw") if k in batch}


# ---- splits ----
def make_split(name, n, seed=0, cfg=WorldConfig()):
    """Scene i has its own generator seeded by (seed, split, i): splits never share a stream, prefixes are stable."""
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}; expected one of {list(SPLITS)}")
    return [make_scene(np.random.default_rng([seed, SPLITS[name], i]), name, cfg) for i in range(n)]


# ---- clips: the car replans every frame (beyond the paper; stream.py drafts each plan from the one before) ----
EVENT_RATE = 0.1  # events a second (a lead starts to brake, a pedestrian steps out, an actor leaves): one per 10 s
RING_RATE = 0.5   # range-ring changes a second, per actor: a 5 m ring crossed at a 2.5 m/s closing speed


def event_rate(interval, per_s=EVENT_RATE):
    """The per-frame probability of an event at a replanning interval (s), events arriving at per_s a second."""
    return 1 - float(np.exp(-per_s * interval))


def next_factors(rng, f, split, interval, rate):
    """The next frame's factors. With probability `rate` an event: every factor drawn anew (a new situation). Else
    each range ring moves with probability RING_RATE * interval, drawn from the split's distribution given every
    other factor. Both are Gibbs steps on the split's distribution, so every frame of a clip is distributed as a
    single scene is: the target was trained on it, and held-out clips stay held out."""
    if rng.random() < rate:
        return sample_factors(rng, split)
    move, split = min(1.0, RING_RATE * interval), "test" if split == "test" else "train"
    if f.bucket is not None and rng.random() < move:  # the in-lane actor / stop line: another ring, the rest kept
        same = replace(f, bucket=None, left=None, right=None)
        f = replace(f, bucket=_draw(rng, [(g.bucket, p) for g, p in main_distribution(split)
                                          if replace(g, bucket=None) == same]))
    for i in (0, 1):  # a roadside actor (left, right): another ring, its kind and the other side kept
        lr = (f.left, f.right)
        if lr[i] is not None and rng.random() < move:
            rows = [(x, p) for x, p in roadside_distribution(f.road, f.event, split)
                    if x[1 - i] == lr[1 - i] and x[i] is not None and x[i][0] == lr[i][0]]
            f = replace(f, **dict(zip(("left", "right"), _draw(rng, rows))))
    return f


def make_clip(rng, split, frames, interval, rate, cfg=WorldConfig()):
    """`frames` consecutive scenes, replanned every `interval` seconds: the factors carry over (next_factors), speed,
    poses and the history are drawn again each frame given them."""
    f, out = sample_factors(rng, split), []
    for t in range(frames):
        f = next_factors(rng, f, split, interval, rate) if t else f
        out.append(make_scene(rng, split, cfg, f))
    return out


MAX_CLIP_FRAMES, MAX_CLIPS = 1000, 10_000  # over 8 minutes of driving at 0.5 s; days of decoding on a CPU


def check_clips(n, frames, interval=0.5, clips_flag="clips", frames_flag="frames"):
    """A ValueError naming the flags unless 0 <= n <= MAX_CLIPS, 2 <= frames <= MAX_CLIP_FRAMES and the interval is
    finite > 0: the clips bounded before any is built (a typo's 10**8 frames would build for minutes)."""
    if not (isinstance(n, int) and 0 <= n <= MAX_CLIPS and isinstance(frames, int) and 2 <= frames <= MAX_CLIP_FRAMES
            and isinstance(interval, (int, float)) and math.isfinite(interval) and interval > 0):
        raise ValueError(f"{clips_flag} takes 0..{MAX_CLIPS} clips, {frames_flag} 2..{MAX_CLIP_FRAMES} frames a clip "
                         f"and the interval a finite number of seconds > 0; got {n!r}, {frames!r}, {interval!r}")


def make_clips(split, n, frames=10, interval=0.5, rate=None, seed=0, cfg=WorldConfig()):
    """n clips of the split (rate None: event_rate(interval)); clip i has its own generator, apart from the scenes'."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLITS)}")
    check_clips(n, frames, interval)
    if not 0 <= (rate := event_rate(interval) if rate is None else rate) <= 1:
        raise ValueError(f"the event rate is a per-frame probability in [0, 1], got {rate!r}")
    return [make_clip(np.random.default_rng([seed, 3 + SPLITS[split], i]), split, frames, interval, rate, cfg)
            for i in range(n)]


class Data:
    """The scenes of one split and their batches, built when drawn. Batch indices are a pure function of (seed, step),
    so a resumed run sees the batches it would have seen on any number of ranks. views: the surround-view count of
    every batch, or a function step -> count (one geometry per batch: prompts in a batch have equal length)."""

    def __init__(self, split, n, seed, tok, views=WorldConfig().views):
        self.scenes = make_split(split, n, seed)
        self.tok, self.seed, self.views = tok, seed, views

    def views_at(self, step):
        return self.views(step) if callable(self.views) else self.views

    def with_views(self, views):
        """The same scenes at another view count or schedule (no scene is generated again)."""
        other = copy.copy(self)
        other.views = views
        return other

    def coc_ids(self):
        """The reference CoC of every scene: ids up to and including <cot_end>."""
        return [self.tok.encode(s.coc) + [self.tok.cot_end_id] for s in self.scenes]

    def batch(self, step, size, rank=0, world=1, device="cpu", order=0):
        """order: another seed for the permutations (the drafts' seeds), the same scenes."""
        if size > len(self.scenes):
            raise ValueError(f"batch size {size} is larger than the {len(self.scenes)} scenes of this split")
        epoch, k = divmod(step, len(self.scenes) // size)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + order * 7_919_000_011)
        idx = torch.randperm(len(self.scenes), generator=g)[k * size:(k + 1) * size][rank::world]
        examples = [make_example(self.scenes[i], self.tok, self.views_at(step)) for i in idx]
        # one padded length per geometry: a CPU's bf16 kernels are built per input shape
        return collate(examples, self.tok.pad_id, examples[0]["prompt_len"] + MAX_COC + 2, device)

    def batches(self, size, device="cpu"):
        """The whole split in order, for evaluation, at the view count of step 0."""
        for i in range(0, len(self.scenes), size):
            yield collate([make_example(s, self.tok, self.views_at(0)) for s in self.scenes[i:i + size]],
                          self.tok.pad_id, device=device)


# ---- demo (the rasters as ASCII: experiments/render_scenes.py) ----
def main(argv=None):
    ap = argparse.ArgumentParser(description="Print a few scenes of the synthetic driving world and its routine share.")
    ap.add_argument("--seed", type=int, default=0, help="seed of the printed scenes and of the routine-share estimate")
    ap.add_argument("--n", type=int, default=6, help="scenes to print")
    ap.add_argument("--split", default="train", choices=list(SPLITS), help="split to draw the printed scenes from")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    try:  # a Ctrl-C is one line and exit status 130, as in every program (ops.cli.program, a layer above this one)
        show(args)
    except KeyboardInterrupt:
        ap.exit(130, f"{ap.prog}: interrupted: nothing is written; rerun to start again\n")


def show(args):
    for sc in make_split(args.split, args.n, args.seed):
        f = sc.f
        speeds = np.linalg.norm(np.diff(np.vstack([[0, 0], sc.traj]), axis=0), axis=1) / 0.1
        print(f"{f.road} / {f.event} / roadside {f.left} {f.right} | history class {f.hist_class} v0 {sc.v0:.1f} m/s | "
              f"decision {f.decision}")
        print("  CoC: " + " ".join(w + ("*" if c else "") for w, c in zip(sc.coc + ["<cot_end>"], sc.commit)))
        print(f"  trajectory: end ({sc.traj[-1, 0]:.1f}, {sc.traj[-1, 1]:.1f}) m, speed {speeds[0]:.1f} -> "
              f"{speeds[-1]:.1f} m/s" + ("" if np.isnan(sc.dist) else f", obstacle at {sc.dist:.1f} m"))
    print("(* = commitment token: not determined by history class + CoC prefix)")
    sample = make_split("train", 2000, args.seed)
    n_tok, n_commit = sum(len(s.commit) for s in sample), sum(sum(s.commit) for s in sample)
    print(f"by construction: {n_commit / len(sample):.2f} commitment tokens per CoC of {n_tok / len(sample):.1f} "
          f"(incl. <cot_end>), routine share by mask {1 - n_commit / n_tok:.3f}")
    print(f"routine share (the Bayes-optimal reader of history class + CoC prefix, exact): "
          f"train/val {routine_share('train'):.3f}, held-out test {routine_share('test'):.3f}")


if __name__ == "__main__":
    main()
