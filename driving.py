"""Synthetic driving world: a toy where the paper's premise (most chain-of-causation
tokens are *routine*, predictable from the ego-trajectory history; a few are
*commitments* that need fresh visual evidence) holds by construction and is measured.

Each scene mirrors Alpamayo-R1's prompt and CoC layout (docs/background.md, "The
Alpamayo-R1 prompt layout"): a 2-frame bird's-eye raster fed as a video, 16 past steps at 10 Hz as
48 binned (dx, dy, dheading) history tokens, a CoC "state , decision since cause"
(e.g. "slowing in a left curve , follow the lead vehicle since it is braking ahead")
and 32 future waypoints from a unicycle rollout of (acceleration, curvature) that
follows the decision.

Which tokens are commitments (`commitment_mask`; the grammar is `coc_words`):
  - the state clause restates the history class (speed profile, turn): routine;
  - the decision's first word (keep / follow / slow / nudge / proceed / stay /
    start) needs the image: the kind of the actor that stands in the ego lane
    (vehicle -> follow, pedestrian -> stop, cone -> nudge; none -> keep), or the
    light's colour;
  - in the cause, the lead vehicle's predicate (braking or not);
  - everything else follows from (history class, CoC prefix).
A CoC has 1-2 commitments among ~16 tokens; `measure_routine_share` gives the share a
perfect history-only reader gets right.

Reading the evidence takes more than one attention hop (the paper's premise: the deliberative
reasoner's deep attention over the video vs the routine reasoner's one layer). The
raster is object-level (see CHANNELS) and split across the two frames: the earlier
frame (t = -0.5 s) shows what each actor *is* (kind, brake lights), the current frame
(t = 0) where it *is* (occupancy, ego lane, range). Most scenes hold a second actor of
another kind off the ego lane (a decoy), so the kinds in view do not say which one is
in the lane: that needs finding the in-lane token and reading what is drawn at the
same place in the earlier frame (two hops), or, in the half of the scenes whose
current frame shows the kinds too (seen_now), reading the kind on the in-lane token
(one selective hop). Each actor stays inside one merged video token across the two
frames and actors never share a token, so the link is exact. The vision tower attends
within windows of one merged token (train.target_config says why), so it cannot make the
cross-frame link: the language model has to. `read_raster` in tests/test_driving.py is the
exact two-hop reader.

`Data` holds the pre-generated examples of one split and batches them for training and evaluation.

run: python driving.py --seed 0
"""
import argparse
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from model import patchify  # model.py owns the Qwen2-VL flattening order, so the vision tower sees HF's layout


# ---- config ----
@dataclass(frozen=True)
class WorldConfig:
    size: int = 24                 # raster height = width (px): 2x2 merged tokens per frame at PATCH 4, MERGE 3
    res: float = 1.25              # metres per pixel: the view reaches ~26 m ahead of the ego
    ego_row: int = 21              # ego's pixel row (x = 0); rows above it are ahead
    ego_col: int = 12              # ego's pixel column (ego-lane centre at y = 0): on the boundary of the
    #                                two token columns, so that an in-lane actor falls in either one
    frame_gap: float = 0.5         # seconds between the two frames (t = -0.5 s, t = 0): enough for motion of >= 2 px
    dt: float = 0.1                # 10 Hz poses, as in Alpamayo
    n_hist: int = 16               # past steps -> 16 x (dx, dy, dh) = 48 history tokens
    n_future: int = 32             # future waypoints (3.2 s)
    dx_bins: tuple = (0.0, 1.2, 24)     # per-step forward motion (m): lo, hi, n bins (0.5 m/s resolution)
    dy_bins: tuple = (-0.02, 0.02, 8)   # per-step lateral motion in the previous pose's frame (m)
    dh_bins: tuple = (-0.04, 0.04, 16)  # per-step heading change (rad)
    lane_width: float = 3.5        # the ego lane spans l in [-1.75, 1.75], the oncoming lane [1.75, 5.25]
    stop_margin: float = 1.5       # a stop ends at least this far (m) before the stop line / actor
    stop_within: float = 3.0       # ... and within this many seconds, so stops finish inside the 3.2 s horizon
    nudge_offset: float = 1.5      # lateral offset (m) of a nudge around a cone


# One plane per channel: an object-level raster, as a perception stack's output would be drawn, split by frame. At
# t = -0.5 s an actor paints what it is (APPEARANCE): its kind, "brake" when its brake lights are lit, a light's
# colour. At t = 0 it paints where it is: "object", "in_lane" when it stands in the ego lane, and its range ring (the
# row bands of BUCKET_ROWS, 5 m apart), plus its appearance again when the scene is seen_now (P_SEEN_NOW). The road
# itself (drivable area, lane lines) is not drawn: its curvature is in the history, and with it drawn a target
# trained from scratch for minutes on a CPU did not learn to read the actors (docs/toy-notes.md, "The world").
CHANNELS = ("stop_line", "ego", "vehicle", "pedestrian", "cone", "light_red", "light_green", "brake", "object",
            "in_lane", "range_5", "range_10", "range_15", "range_20")
APPEARANCE = ("vehicle", "pedestrian", "cone", "light_red", "light_green", "brake")  # what an actor is
# The raster's tokenisation (train.target_config builds the vision tower with the same numbers): 4-px patches merged
# 3x3 give 2x2 merged tokens per frame, 8 video tokens in all, which keeps the prompt short and an SFT step cheap;
# M-RoPE still gives every video token distinct (t, h, w) ids.
PATCH, MERGE = 4, 3
SPECIALS = ("<pad>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<traj_history_start>",
            "<traj_history_end>", "<cot_start>", "<cot_end>", "<traj_future_start>")
SYSTEM = "you are the driving planner of the ego car ."
INSTRUCTION = "explain your decision then plan the trajectory"

# ---- world tables ----
ROADS = {"straight": 0.3, "curve_left": 0.25, "curve_right": 0.25, "intersection": 0.2}
TURN = {"straight": "straight", "curve_left": "left", "curve_right": "right", "intersection": "straight"}
FLAT = {"cruise": .4, "accel": .3, "decel": .3}
# event -> (P(event | non-intersection road), P(history speed profile | event)); intersections hold red / green only
# (50/50). "clear" means nothing in the ego lane; it usually holds a decoy off the lane. Priors are balanced so that
# each history class leaves several decisions open: histories correlate with the decision (slowing -> stop) but
# never fix it, and that residual ambiguity is what a commitment token is.
EVENTS = {
    "clear":         (0.36, FLAT),
    "lead_cruise":   (0.12, FLAT),
    "lead_brake":    (0.14, {"cruise": .5, "decel": .4, "accel": .1}),
    "ped_cross":     (0.19, {"cruise": .5, "decel": .4, "accel": .1}),
    "cone_lane":     (0.19, {"cruise": .5, "decel": .2, "accel": .3}),
    "red":           (0.0,  {"cruise": .3, "decel": .5, "stand": .2}),
    "green":         (0.0,  {"cruise": .4, "decel": .1, "accel": .2, "stand": .3}),
}
KINDS = ("vehicle", "pedestrian", "cone")
# P(decoy kind | event): a decoy is an actor off the ego lane, never of the in-lane actor's kind, so the kinds in view
# leave the in-lane one open in 9 of 10 actor scenes. None: no decoy. Only a lead vehicle brakes.
P_DECOY = 0.9
# P(the current frame shows what the actors are): otherwise (a detector dropout, for the whole frame) only the earlier
# frame does. Scenes with the appearance in view now can be read in one hop; they are also what lets a target learn
# the two-hop reading in minutes (docs/toy-notes.md).
P_SEEN_NOW = 0.5
# Held-out (event, decoy, road): never in train/val, the whole test split. On a left curve a cone and a pedestrian are
# never in view together in training, nor on a right curve a pedestrian and a vehicle, whichever of the two is in the
# lane; each event is seen on that road with its other decoy, and every decision word after every state clause. Both
# assignments of a pair are held out: holding out one alone would leave its mirror in training on that road, and
# "which kinds are in view" plus the road would then give the wrong answer on test every time.
HELD_OUT = (("cone_lane", "pedestrian", "curve_left"), ("ped_cross", "cone", "curve_left"),
            ("ped_cross", "vehicle", "curve_right"), ("lead_cruise", "pedestrian", "curve_right"),
            ("lead_brake", "pedestrian", "curve_right"))
SPLITS = {"train": 0, "val": 1, "test": 2}
V_RANGE = {"cruise": (5.0, 8.5), "decel": (3.0, 7.0), "accel": (4.0, 8.0), "stand": (0.0, 0.0)}  # v0 (m/s)
HIST_ACCEL = {"cruise": 0.0, "decel": -2.0, "accel": 1.5, "stand": 0.0}  # m/s^2 over the 1.6 s history
# Range rings: bands of 4 pixel rows (5 m) ahead of the ego; an actor is placed so that its block lies in its ring.
BUCKET_ROWS = {5: (16, 19), 10: (12, 15), 15: (8, 11), 20: (4, 7)}
# An actor is drawn as the 2x2-px block that holds its position; "in the ego lane" means that at least 2 of its 4
# pixels lie on the ego lane (lane_planes), "off" that none does. Placement rejects anything in between, so the
# evidence is unambiguous. l intervals (lateral offset at t = 0, one drawn) span both token columns (ego_col).
ACTORS = {  # in-lane event -> kind
    "lead_cruise": "vehicle", "lead_brake": "vehicle", "ped_cross": "pedestrian", "cone_lane": "cone"}
IN_LANE_L = (-1.2, 1.2)
DECOY_L = {"vehicle": ((3.0, 4.5),),                   # oncoming lane
           "pedestrian": ((-4.5, -3.0), (5.9, 6.9)),   # right or left sidewalk
           "cone": ((-4.0, -3.0), (3.0, 4.5))}         # shoulder, or the oncoming lane's edge


@dataclass(frozen=True)
class Factors:
    """The discrete factors that fix the CoC. (speed, turn) is the history class; the rest needs the image."""
    road: str
    event: str
    speed: str              # history speed profile: cruise | decel | accel | stand
    bucket: object          # range ring 5 / 10 / 15 / 20 (m) of the in-lane actor / stop line, None on a clear road
    decoy: object = None    # kind of the off-lane actor, or None; it never enters the CoC

    @property
    def turn(self):
        return TURN[self.road]

    @property
    def hist_class(self):
        return self.speed, self.turn

    @property
    def decision(self):
        if self.event == "clear":
            return "keep"
        if self.event in ("red", "green") and self.speed == "stand":
            return "stay" if self.event == "red" else "start"
        return {"lead_cruise": "follow", "lead_brake": "follow", "ped_cross": "stop", "red": "stop",
                "cone_lane": "nudge", "green": "proceed"}[self.event]


# ---- grammar ----
def coc_words(f):
    """CoC = state , decision since cause. The state restates the history class (routine); the decision's first
    word and the cause's actor / predicate where the decision leaves several need the image."""
    state = ["standing", "still"] if f.speed == "stand" else (
        [{"cruise": "cruising", "decel": "slowing", "accel": "accelerating"}[f.speed]]
        + (["straight"] if f.turn == "straight" else ["in", "a", f.turn, "curve"]))
    act = {
        "keep": ["keep", "lane", "and"] + {"cruise": ["maintain", "speed"], "decel": ["resume", "speed"],
                                           "accel": ["keep", "accelerating"]}.get(f.speed, []),
        "follow": ["follow", "the", "lead", "vehicle"],
        "stop": ["slow", "down", "and", "stop"],
        "nudge": ["nudge", "left", "around", "the", "cone"],
        "proceed": ["proceed", "through", "the", "intersection"],
        "stay": ["stay", "stopped"],
        "start": ["start", "moving"],
    }[f.decision]
    cause = {
        "clear": "our lane ahead is clear",
        "lead_cruise": "it moves steadily ahead",
        "lead_brake": "it is braking ahead",
        "ped_cross": "the pedestrian ahead is crossing our lane",
        "cone_lane": "it blocks our lane ahead",
        "red": "the traffic light ahead is red",
        "green": "the traffic light ahead is green",
    }[f.event].split()
    return state + [","] + act + ["since"] + cause


def _buckets(event, speed):
    if event == "clear":
        return [None]
    if speed == "stand":
        return [5]                      # waiting at the stop line
    return [10, 15, 20]                 # 5 m is too close to stop or nudge in time from speed: decoys only


def _support():
    """Every Factors the world can produce (all splits), decoy left at None: the grammar's support."""
    for road in ROADS:
        events = ("red", "green") if road == "intersection" else [e for e in EVENTS if EVENTS[e][0] > 0]
        for event in events:
            for speed in EVENTS[event][1]:
                for b in _buckets(event, speed):
                    yield Factors(road, event, speed, b)


@lru_cache(maxsize=None)
def _next_token_sets():
    """(history class, CoC prefix) -> set of possible next words over the world's support."""
    nxt = defaultdict(set)
    for f in _support():
        words = coc_words(f) + ["<cot_end>"]
        for i, w in enumerate(words):
            nxt[(f.hist_class, tuple(words[:i]))].add(w)
    return dict(nxt)


def commitment_mask(words, hist_class):
    """One bool per CoC word plus <cot_end>: True where history class + prefix leave more than one continuation."""
    nxt = _next_token_sets()
    full = list(words) + ["<cot_end>"]
    return [len(nxt[(hist_class, tuple(full[:i]))]) > 1 for i in range(len(full))]


# ---- geometry ----
def road_to_xy(s, l, kappa):
    """Lane coordinates (arc length s, lateral l, left positive) -> ego frame (x forward, y left)."""
    if kappa == 0:
        return s, l
    phi = kappa * s
    return (1 / kappa - l) * np.sin(phi), l * np.cos(phi) + (1 - np.cos(phi)) / kappa


def xy_to_road(x, y, kappa):
    if kappa == 0:
        return x, y
    R = 1 / kappa
    rho = np.hypot(x, y - R)
    return R * np.arctan2(x / R, (R - y) / R), R - np.sign(R) * rho


def pixel_grid(cfg):
    r, c = np.mgrid[0:cfg.size, 0:cfg.size]
    return (cfg.ego_row - r) * cfg.res, (cfg.ego_col - c) * cfg.res  # x, y of each pixel centre


def to_pixel(s, l, kappa, cfg):
    x, y = road_to_xy(s, l, kappa)
    return int(round(cfg.ego_row - x / cfg.res)), int(round(cfg.ego_col - y / cfg.res))


# ---- scene ----
@dataclass
class Scene:
    f: Factors              # the discrete factors (road, event, history speed profile, range ring)
    kappa: float            # road curvature (1/m, left positive)
    v0: float               # current ego speed (m/s)
    dist: float             # arc length (m) to the actor / stop line at t = 0 (nan if none)
    hist: np.ndarray        # (16, 3) per-step (dx, dy, dh) in the previous pose's frame
    frames: np.ndarray      # (2, C, H, W) float32 raster at t = -0.5 s and t = 0
    seen_now: bool          # the current frame shows the actors' appearance too (one-hop readable)
    coc: list               # CoC words (without <cot_end>)
    commit: list            # bool per CoC word + <cot_end>
    traj: np.ndarray        # (32, 2) future waypoints (x, y) in metres, ego frame


def sample_decoy(rng, event):
    """The decoy's kind (or None): any kind on a clear road, another kind than the in-lane actor's beside one."""
    if event in ("red", "green") or rng.random() >= P_DECOY:
        return None
    kinds = [k for k in KINDS if k != ACTORS.get(event)]
    return kinds[rng.integers(len(kinds))]


def sample_factors(rng, split):
    if split == "test":
        event, decoy, road = HELD_OUT[rng.integers(len(HELD_OUT))]
    else:
        while True:
            road = str(rng.choice(list(ROADS), p=list(ROADS.values())))
            if road == "intersection":
                event = str(rng.choice(["red", "green"]))
            else:
                names = [e for e in EVENTS if EVENTS[e][0] > 0]
                event = str(rng.choice(names, p=[EVENTS[e][0] for e in names]))
            decoy = sample_decoy(rng, event)
            if (event, decoy, road) not in HELD_OUT:
                break
    prof = EVENTS[event][1]
    speed = str(rng.choice(list(prof), p=list(prof.values())))
    buckets = _buckets(event, speed)
    bucket = buckets[rng.integers(len(buckets))]
    return Factors(road, event, speed, None if bucket is None else int(bucket), decoy)


def history_deltas(v0, speed, kappa, cfg):
    """16 per-step (dx, dy, dh) of a constant-acceleration, constant-curvature unicycle that ends at speed v0."""
    a = HIST_ACCEL[speed]
    v = v0 - a * cfg.dt * np.arange(cfg.n_hist, -1, -1)            # (17,) speeds at the 17 poses
    ds = 0.5 * (v[:-1] + v[1:]) * cfg.dt                           # (16,) arc length per step
    dh = kappa * ds
    return np.stack([ds * np.cos(dh / 2), ds * np.sin(dh / 2), dh], axis=1)  # chord in the previous pose's frame


def rollout(v0, accel, kappa, cfg):
    """Unicycle: per-step acceleration and curvature (n_future,) -> waypoints (n_future, 2); speed clamps at 0."""
    x = y = th = 0.0
    v, out = v0, []
    for a, k in zip(accel, kappa):
        v_next = max(v + a * cfg.dt, 0.0)
        ds = 0.5 * (v + v_next) * cfg.dt if v_next > 0 else (v * v / (-2 * a) if a < 0 else 0.0)  # exact at standstill
        x += ds * np.cos(th + k * ds / 2)
        y += ds * np.sin(th + k * ds / 2)
        th += k * ds
        v = v_next
        out.append((x, y))
    return np.array(out, dtype=np.float32)


def plan(f, v0, kappa, dist, cfg):
    """The trajectory follows the decision (and, for follow, the cause): tests/test_driving.py checks it."""
    n = cfg.n_future
    acc, kap = np.zeros(n), np.full(n, kappa)                       # (n,) per-step acceleration and curvature
    if f.decision in ("keep", "proceed"):
        acc[:] = {"cruise": 0.0, "decel": 1.0, "accel": 1.5}[f.speed]  # maintain / resume speed / keep accelerating
    elif f.decision == "follow":
        acc[:] = -2.5 if f.event == "lead_brake" else 0.0
    elif f.decision == "stop":
        # standstill stop_margin before the obstacle, or earlier so that it happens inside the horizon
        s_stop = min(dist - cfg.stop_margin, 0.5 * v0 * cfg.stop_within)
        acc[:] = -v0 ** 2 / (2 * s_stop)
    elif f.decision == "start":
        acc[:] = 2.0
    elif f.decision == "nudge":
        # curvature doublet (left, then back): lateral offset ~ k v^2 tau^2, heading restored to the lane's
        tau = 8
        k = cfg.nudge_offset / (v0 * tau * cfg.dt) ** 2
        kap[:tau] += k
        kap[tau:2 * tau] -= k
    return rollout(v0, acc, kap, cfg)                               # "stay": v0 = 0, acc = 0


def lane_planes(kappa, cfg):
    """Per-pixel lane coordinates (S, L) and the ego_lane plane: pixel centres with |l| < lane_width / 2."""
    X, Y = pixel_grid(cfg)
    S, L = xy_to_road(X, Y, kappa)
    return S, L, np.abs(L) < cfg.lane_width / 2


def block(s, l, kappa, cfg):
    """The 2x2-px block (top-left pixel (r, c), both even) that holds (s, l). Even-aligned, it never straddles a
    PATCH = 4 ViT patch, so an actor's kind, lane and range sit in one patch's pixels."""
    r, c = to_pixel(s, l, kappa, cfg)
    return r - r % 2, c - c % 2


def token_of(r, c):
    """The merged video token (row, col) of frame pixel (r, c)."""
    return r // (PATCH * MERGE), c // (PATCH * MERGE)


def render(kappa, actors, stop_line, seen_now, cfg):
    """actors: [(appearance channels, [(s, l) at frame 0, (s, l) at frame 1])]; stop_line: [s per frame] or None
    -> (2, C, H, W). At t = -0.5 s an actor paints its appearance (APPEARANCE: kind, brake, light colour) on its
    block; at t = 0 it paints "object", "in_lane" where >= 2 of the block's pixels lie in the ego lane, its range
    ring, and its appearance again if seen_now. The ego and a stop line across the ego lane are drawn in both
    frames."""
    S, L, ego_lane = lane_planes(kappa, cfg)
    ch = {n: i for i, n in enumerate(CHANNELS)}
    ring_of_row = {r: b for b, (lo, hi) in BUCKET_ROWS.items() for r in range(lo, hi + 1)}
    out = np.zeros((2, len(CHANNELS), cfg.size, cfg.size), dtype=np.float32)
    for f in range(2):
        img = out[f]
        if stop_line is not None:
            img[ch["stop_line"]] = (np.abs(S - stop_line[f]) < cfg.res / 2) & (np.abs(L) <= cfg.lane_width / 2)
        img[ch["ego"], cfg.ego_row:cfg.ego_row + 2, cfg.ego_col] = 1
        for appearance, poses in actors:
            r, c = block(*poses[f], kappa, cfg)
            rs, cs = slice(r, r + 2), slice(c, c + 2)   # placement keeps every block inside the raster
            if f == 0 or seen_now:
                for name in appearance:
                    img[ch[name], rs, cs] = 1
            if f == 0:
                continue
            img[ch["object"], rs, cs] = 1
            if ego_lane[rs, cs].sum() >= 2:
                img[ch["in_lane"], rs, cs] = 1
            if r in ring_of_row:
                img[ch[f"range_{ring_of_row[r]}"], rs, cs] = 1
    return out


def _lane_hits(s, l, kappa, cfg, ego_lane):
    """(r, c) of the block holding (s, l) and how many of its 4 pixels are in the ego lane (-1 if clipped)."""
    r, c = block(s, l, kappa, cfg)
    if not (0 <= r <= cfg.size - 2 and 0 <= c <= cfg.size - 2):
        return r, c, -1
    return r, c, int(ego_lane[r:r + 2, c:c + 2].sum())


def _place(rng, bucket, l_range, in_lane, kappa, cfg, ego_lane):
    """Rejection-sample an actor's (s, l) at t = 0 whose block sits in the bucket's rows, fully inside the raster,
    with >= 2 of its pixels on the ego lane (in_lane) or none (off the lane)."""
    lo, hi = BUCKET_ROWS[bucket]
    for _ in range(1000):
        x = (cfg.ego_row - rng.integers(lo, hi + 1) + rng.uniform(-0.4, 0.4)) * cfg.res
        s = x if kappa == 0 else np.arcsin(np.clip(kappa * x, -1, 1)) / kappa
        l = rng.uniform(*l_range)
        r, _, hits = _lane_hits(s, l, kappa, cfg, ego_lane)
        if lo <= r <= hi and hits >= 0 and (hits >= 2 if in_lane else hits == 0):
            return float(s), float(l)
    raise RuntimeError("actor placement failed")


def _frame0(rng, motion, dist, l, back, kappa, cfg):
    """An actor's (s, l) at t = -0.5 s, given its (dist, l) at t = 0 and the ego's travel `back` in between.
    motion: an in-lane event, or "decoy_<kind>"."""
    s0, l0 = dist + back, l                                  # static in the world
    if motion == "decoy_vehicle":                            # oncoming: approaches faster than the ego's travel
        s0 += rng.uniform(4.0, 7.0) * cfg.frame_gap
    elif motion == "decoy_pedestrian":
        s0 += rng.uniform(-0.8, 0.8)                          # standing or walking along the sidewalk
    elif motion == "lead_cruise":
        s0 = dist                                             # keeps the gap: same block in both frames
    elif motion == "lead_brake":                              # closes in by >= one block (2 rows) in the frame gap
        s0 = dist + rng.uniform(2.5, 3.5)
        while block(s0, l, kappa, cfg)[0] > block(dist, l, kappa, cfg)[0] - 2:
            s0 += 0.5                                         # a curve turns arc length into fewer rows
    elif motion == "ped_cross":                               # stepped in from the oncoming lane or the shoulder
        l0 = rng.choice([-1.0, 1.0]) * rng.uniform(2.5, 4.0)
    return s0, l0


def _tracked(poses, kappa, cfg, ego_lane, off_lane_then=False):
    """The merged token an actor occupies in both frames, or None if its blocks leave the raster or change token
    (the two-hop link is "same token, earlier frame"). off_lane_then: its t = -0.5 s block must be off the lane."""
    hits = [_lane_hits(s, l, kappa, cfg, ego_lane) for s, l in poses]
    if any(h < 0 for _, _, h in hits) or (off_lane_then and hits[0][2] != 0):
        return None
    tokens = {token_of(r, c) for r, c, _ in hits}
    return tokens.pop() if len(tokens) == 1 else None


def make_scene(rng, split="train", cfg=WorldConfig()):
    f = sample_factors(rng, split)
    kappa = {"curve_left": 1.0, "curve_right": -1.0}.get(f.road, 0.0) * rng.uniform(0.018, 0.028)
    v0 = rng.uniform(*V_RANGE[f.speed])
    hist = history_deltas(v0, f.speed, kappa, cfg)
    back = hist[-int(round(cfg.frame_gap / cfg.dt)):, 0].sum()  # ego travel between frames: static things approach by it
    ego_lane = lane_planes(kappa, cfg)[2]
    actors, stop_line, dist = [], None, float("nan")
    if f.event in ("red", "green"):
        for _ in range(1000):   # the light, like every actor, keeps one merged token across the frames
            dist, _ = _place(rng, f.bucket, (0.0, 0.0), True, 0.0, cfg, ego_lane)
            poses = [(dist + back, -3.0), (dist, -3.0)]                  # beside the stop line
            if _tracked(poses, kappa, cfg, ego_lane) is not None:
                break
        else:
            raise RuntimeError(f"light placement failed for {f}")
        stop_line = [dist + back, dist]
        actors.append((("light_" + f.event,), poses))
    else:
        # Rejection: every actor keeps one merged token across the two frames, and no two actors share one.
        for _ in range(1000):
            actors, tokens = [], []
            if f.event != "clear":
                kind = ACTORS[f.event]
                dist, l = _place(rng, f.bucket, IN_LANE_L, True, kappa, cfg, ego_lane)
                poses = [_frame0(rng, f.event, dist, l, back, kappa, cfg), (dist, l)]
                tokens.append(_tracked(poses, kappa, cfg, ego_lane, off_lane_then=f.event == "ped_cross"))
                actors.append(((kind, "brake") if f.event == "lead_brake" else (kind,), poses))
            if f.decoy is not None:
                ranges = DECOY_L[f.decoy]
                s, l = _place(rng, int(rng.choice(list(BUCKET_ROWS))), ranges[rng.integers(len(ranges))], False,
                              kappa, cfg, ego_lane)
                poses = [_frame0(rng, "decoy_" + f.decoy, s, l, back, kappa, cfg), (s, l)]
                tokens.append(_tracked(poses, kappa, cfg, ego_lane))
                actors.append(((f.decoy,), poses))
            if None not in tokens and len(set(tokens)) == len(tokens):
                break
        else:
            raise RuntimeError(f"actor placement failed for {f}")
    seen_now = bool(rng.random() < P_SEEN_NOW)
    frames = render(kappa, actors, stop_line, seen_now, cfg)
    coc = coc_words(f)
    return Scene(f, float(kappa), float(v0), dist, hist, frames, seen_now, coc, commitment_mask(coc, f.hist_class),
                 plan(f, v0, kappa, dist, cfg))


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
        words = set((SYSTEM + " " + INSTRUCTION).split())
        for f in _support():
            words.update(coc_words(f))
        self.vocab = list(SPECIALS) + hist + sorted(words)
        self.id = {w: i for i, w in enumerate(self.vocab)}
        for name, w in [("pad", "<pad>"), ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"),
                        ("image_token", "<|image_pad|>"), ("video_token", "<|video_pad|>"),
                        ("hist_start", "<traj_history_start>"), ("hist_end", "<traj_history_end>"),
                        ("cot_start", "<cot_start>"), ("cot_end", "<cot_end>"),
                        ("traj_future_start", "<traj_future_start>")]:
            setattr(self, name + "_id", self.id[w])

    def __len__(self):
        return len(self.vocab)

    def encode(self, text):
        return [self.id[w] for w in (text.split() if isinstance(text, str) else text)]

    def decode(self, ids):
        return " ".join(self.vocab[int(i)] for i in ids)

    def encode_history(self, hist):
        """(16, 3) deltas -> 48 ids, uniform bins, values clipped into the outer bins."""
        out = []
        for row in hist:
            for (k, spec), v in zip(self.bins.items(), row):
                lo, w, n = bin_edges(spec)
                out.append(self.id[f"<{k}{int(np.clip((v - lo) // w, 0, n - 1))}>"])
        return out

    def decode_history(self, ids):
        """48 ids -> (16, 3) bin centres."""
        vals = []
        for i in ids:
            word = self.vocab[int(i)]
            lo, w, _ = bin_edges(self.bins[word[1:3]])
            vals.append(lo + (int(word[3:-1]) + 0.5) * w)
        return np.array(vals).reshape(-1, 3)


# ---- prompts and training examples ----
def build_prompt(scene, tok, patch_size=PATCH, temporal_patch_size=1, merge_size=MERGE):
    """model.forward kwargs for batch 1, Alpamayo order: system, video, history, instruction, <cot_start>."""
    pixels, grid = patchify(torch.from_numpy(scene.frames), patch_size, temporal_patch_size, merge_size)
    grid = torch.as_tensor(grid, dtype=torch.long).view(1, 3)       # (1, 3): t=2, h, w in patches
    n_video = int(grid.prod()) // merge_size ** 2                   # merged tokens: 2 x 2 x 2 = 8 at 24 px
    ids = (tok.encode(SYSTEM) + [tok.vision_start_id] + [tok.video_token_id] * n_video + [tok.vision_end_id]
           + [tok.hist_start_id] + tok.encode_history(scene.hist) + [tok.hist_end_id]
           + tok.encode(INSTRUCTION) + [tok.cot_start_id])
    return {"input_ids": torch.tensor([ids]), "pixel_values_videos": pixels, "video_grid_thw": grid}


def make_example(scene, tok, **patch_kw):
    """prompt + CoC + <cot_end> + <traj_future_start>; masks are over positions whose *next* token is CoC/<cot_end>."""
    prompt = build_prompt(scene, tok, **patch_kw)
    P, n = prompt["input_ids"].shape[1], len(scene.coc)
    coc = tok.encode(scene.coc) + [tok.cot_end_id]
    ids = torch.cat([prompt["input_ids"][0], torch.tensor(coc + [tok.traj_future_start_id])])  # (L,), L = P + n + 2
    loss_mask = torch.zeros(len(ids), dtype=torch.bool)
    loss_mask[P - 1:P + n] = True                                   # <cot_start> predicts word 0 ... last word predicts <cot_end>
    commit_mask = torch.zeros(len(ids), dtype=torch.bool)
    commit_mask[P - 1:P + n] = torch.tensor(scene.commit)
    return {"input_ids": ids, "loss_mask": loss_mask, "commit_mask": commit_mask, "prompt_len": P,
            "coc_ids": coc, "traj_index": P + n + 1, "traj": torch.from_numpy(scene.traj),
            "pixel_values_videos": prompt["pixel_values_videos"], "video_grid_thw": prompt["video_grid_thw"]}


def collate(examples, pad_id):
    """Right-pad to the longest example; vision inputs concatenate in batch order, as the model scatters them."""
    B, L = len(examples), max(len(e["input_ids"]) for e in examples)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn, loss, commit = (torch.zeros(B, L, dtype=torch.long),
                          torch.zeros(B, L, dtype=torch.bool), torch.zeros(B, L, dtype=torch.bool))
    for b, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[b, :n], attn[b, :n], loss[b, :n], commit[b, :n] = e["input_ids"], 1, e["loss_mask"], e["commit_mask"]
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss, "commit_mask": commit,
            "traj_index": torch.tensor([e["traj_index"] for e in examples]),
            "prompt_len": torch.tensor([e["prompt_len"] for e in examples]),
            "traj": torch.stack([e["traj"] for e in examples]),                            # (B, 32, 2)
            "pixel_values_videos": torch.cat([e["pixel_values_videos"] for e in examples]),  # (B * N, C*tp*p*p)
            "video_grid_thw": torch.cat([e["video_grid_thw"] for e in examples]),            # (B, 3)
            "coc_ids": [e["coc_ids"] for e in examples]}


def to_device(batch, device):
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def vision_kwargs(batch):
    """The video inputs of a collated batch, as model.forward / model.embed take them."""
    return {"pixel_values_videos": batch["pixel_values_videos"], "video_grid_thw": batch["video_grid_thw"]}


# ---- splits ----
def make_split(name, n, seed=0, cfg=WorldConfig()):
    """Scene i of a split has its own generator seeded by (seed, split, i): splits never share a stream, and a
    prefix of a larger split equals the smaller split."""
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}; expected one of {list(SPLITS)}")
    return [make_scene(np.random.default_rng([seed, SPLITS[name], i]), name, cfg) for i in range(n)]


class Data:
    """Pre-generated examples of one split; batch indices are a pure function of (seed, step),
    so a resumed run sees exactly the batches it would have seen, on any number of ranks.
    Batches walk a seeded permutation per epoch, so no scene repeats before the split is used up."""

    def __init__(self, split, n, seed, tok):
        self.scenes = make_split(split, n, seed)
        self.examples = [make_example(s, tok) for s in self.scenes]
        self.tok, self.seed = tok, seed

    def batch(self, step, size, rank=0, world=1, device="cpu"):
        if size > len(self.examples):
            raise ValueError(f"batch size {size} is larger than the {len(self.examples)} scenes of this split")
        epoch, k = divmod(step, len(self.examples) // size)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        idx = torch.randperm(len(self.examples), generator=g)[k * size:(k + 1) * size][rank::world]
        return to_device(collate([self.examples[i] for i in idx], self.tok.pad_id), device)

    def batches(self, size, device="cpu"):
        """The whole split in order, for evaluation."""
        for i in range(0, len(self.examples), size):
            yield to_device(collate(self.examples[i:i + size], self.tok.pad_id), device)


# ---- metrics ----
def ade_fde(pred, true, per_scene=False):
    """(B, 32, 2) waypoints -> (average, final) displacement error in metres: floats averaged over the batch, or
    (B,) tensors with per_scene."""
    d = torch.linalg.vector_norm(torch.as_tensor(pred) - torch.as_tensor(true), dim=-1)   # (B, 32)
    if per_scene:
        return d.mean(-1), d[:, -1]
    return d.mean().item(), d[:, -1].mean().item()


def coc_exact_match(pred, true):
    """Fraction of CoCs (id lists up to and including <cot_end>) generated exactly."""
    return sum(list(p) == list(t) for p, t in zip(pred, true)) / len(true)


def commitment_hits(pred_next, input_ids, commit_mask):
    """Teacher-forced: pred_next (B, L) is the argmax at each position, input_ids[:, i + 1] its target -> (right,
    total) commitment tokens, integers, so that batches add up exactly (accuracy = right / total). Teacher forcing
    scores every commitment token on the reference prefix, so an early miss cannot hide later ones."""
    hit = pred_next[:, :-1] == input_ids[:, 1:]                    # (B, L-1)
    m = commit_mask[:, :-1]
    return (hit & m).sum().item(), m.sum().item()


def measure_routine_share(n=20000, seed=0, split="train"):
    """Bayes-optimal guess of each CoC token from (history class, CoC prefix), fitted by counts on n scenes and scored
    on n fresh ones: the share of tokens a perfect history-only reader gets right (the paper's ~78%)."""
    def coc_stream(s):
        rng = np.random.default_rng(s)
        for _ in range(n):
            f = sample_factors(rng, split)
            yield f.hist_class, coc_words(f) + ["<cot_end>"]

    counts = defaultdict(Counter)
    for cls, words in coc_stream([seed, 100]):
        for i, w in enumerate(words):
            counts[(cls, tuple(words[:i]))][w] += 1
    right = total = 0
    for cls, words in coc_stream([seed, 101]):
        for i, w in enumerate(words):
            c = counts.get((cls, tuple(words[:i])))
            right += bool(c) and c.most_common(1)[0][0] == w
            total += 1
    return right / total


# ---- demo ----
GLYPHS = (("ego", "E"), ("vehicle", "V"), ("pedestrian", "P"), ("cone", "C"), ("light_red", "R"),
          ("light_green", "G"), ("in_lane", "L"), ("object", "o"), ("stop_line", "="))


def ascii_render(frames):
    """Both frames side by side, one character per pixel, the first matching channel of GLYPHS wins."""
    ch = {n: i for i, n in enumerate(CHANNELS)}
    rows = []
    for r in range(frames.shape[2]):
        line = []
        for f in range(frames.shape[0]):
            line.append("".join(next((g for n, g in GLYPHS if frames[f, ch[n], r, c] > 0), " ")
                                for c in range(frames.shape[3])))
        rows.append("   ".join(line))
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser(description="Print a few scenes of the synthetic driving world and its routine share.")
    ap.add_argument("--seed", type=int, default=0, help="seed of the printed scenes and of the routine-share estimate")
    ap.add_argument("--n", type=int, default=6, help="scenes to print")
    ap.add_argument("--split", default="train", choices=list(SPLITS), help="split to draw the printed scenes from")
    ap.add_argument("--render", action="store_true", help="also print an ASCII raster (t = -0.5 s | t = 0) per scene")
    ap.add_argument("--share_n", type=int, default=20000, help="scenes to fit and to score the routine share on")
    args = ap.parse_args()
    for sc in make_split(args.split, args.n, args.seed):
        f = sc.f
        speeds = np.linalg.norm(np.diff(np.vstack([[0, 0], sc.traj]), axis=0), axis=1) / 0.1
        print(f"{f.road} / {f.event} / decoy {f.decoy} | history class {f.hist_class} v0 {sc.v0:.1f} m/s | "
              f"decision {f.decision}")
        print("  CoC: " + " ".join(w + ("*" if c else "") for w, c in zip(sc.coc + ["<cot_end>"], sc.commit)))
        print(f"  trajectory: end ({sc.traj[-1, 0]:.1f}, {sc.traj[-1, 1]:.1f}) m, speed {speeds[0]:.1f} -> "
              f"{speeds[-1]:.1f} m/s" + ("" if np.isnan(sc.dist) else f", obstacle at {sc.dist:.1f} m"))
        if args.render:
            print(ascii_render(sc.frames))
    print("(* = commitment token: not determined by history class + CoC prefix)")
    sample = make_split("train", 2000, args.seed)
    n_tok, n_commit = sum(len(s.commit) for s in sample), sum(sum(s.commit) for s in sample)
    print(f"by construction: {n_commit / len(sample):.2f} commitment tokens per CoC of {n_tok / len(sample):.1f} "
          f"(incl. <cot_end>), routine share by mask {1 - n_commit / n_tok:.3f}")
    share = measure_routine_share(args.share_n, args.seed)
    print(f"measured routine share (Bayes guess from history class + prefix, fit on {args.share_n} scenes, "
          f"scored on {args.share_n} fresh ones): {share:.3f}")


if __name__ == "__main__":
    main()
