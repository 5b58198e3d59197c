"""World invariants of driving.py: the prompt's geometry, the trajectory follows the decision, the history tokens
determine the routine factors and the front raster the visual ones, held-out combinations only in test, the exact
routine share, commitment positions vs grammar, determinism.

run: python -m pytest -q tests/test_driving.py
"""
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch

import driving as D
import evaluate
from rope import flat_position_ids, get_rope_index

CFG = D.WorldConfig()


@pytest.fixture(scope="module")
def train():
    return D.make_split("train", 600, seed=0)


@pytest.fixture(scope="module")
def test_split():
    return D.make_split("test", 200, seed=0)


@pytest.fixture(scope="module")
def tok():
    return D.Tokenizer()


def speeds(traj):
    """(32, 2) waypoints -> (32,) mean speed over each 0.1 s step, starting from the origin."""
    return np.linalg.norm(np.diff(np.vstack([[0.0, 0.0], traj]), axis=0), axis=1) / CFG.dt


# ---- the prompt's geometry ----
def test_prompt_geometry_like_alpamayo(train, tok):
    """Many visual tokens, few history tokens; each surround view a short M-RoPE span, its full length under FlatRoPE."""
    sc = train[0]
    for views in (0, 1, 4, CFG.views, 21):
        p = D.build_prompt(sc, tok, views)
        ids = p["input_ids"]
        n_vis = int(((ids == tok.image_token_id) | (ids == tok.video_token_id)).sum())
        assert n_vis == 12 + 24 * views
        if views:
            assert p["image_grid_thw"].tolist() == [[1, 12, 18]] * views
    p = D.build_prompt(sc, tok)
    ids = p["input_ids"]
    n_hist = int(ids[0].tolist().index(tok.hist_end_id) - ids[0].tolist().index(tok.hist_start_id) - 1)
    n_vis = int(((ids == tok.image_token_id) | (ids == tok.video_token_id)).sum())
    assert n_hist == 48 and n_vis >= 8 * n_hist                       # the default: 396 visual tokens vs 48
    pos, _ = get_rope_index(ids, p["image_grid_thw"], p["video_grid_thw"], spatial_merge_size=D.MERGE,
                            image_token_id=tok.image_token_id, video_token_id=tok.video_token_id,
                            vision_start_token_id=tok.vision_start_id, tokens_per_second=1.0)
    flat, _ = flat_position_ids(ids)
    h = ids[0].tolist().index(tok.hist_start_id)
    # M-RoPE: the history starts after 12 visual tokens spanning 3 ids and 16 views spanning 6 ids each
    n_text_before = h - n_vis
    assert int(pos[0, 0, h]) == n_text_before + 3 + 6 * CFG.views
    assert int(flat[0, 0, h]) == h                                     # flat: every token takes an id


def test_views_are_clutter_and_prefix_consistent():
    a, b = D.render_views(7, 4), D.render_views(7, 6)
    assert np.array_equal(a, b[:4]) and a.shape == (4, len(D.CHANNELS), *CFG.view_size)
    front = [D.CHANNELS.index(c) for c in D.CHANNELS if c not in D.CLUTTER]
    assert b[:, front].sum() == 0 and b.sum() > 0
    assert not np.array_equal(b[0], b[1])


# ---- trajectory follows the decision ----
def test_trajectory_follows_decision(train):
    seen = Counter()
    for sc in train:
        f, v = sc.f, speeds(sc.traj)
        seen[f.decision] += 1
        if f.decision == "stop":
            assert v[-1] < 0.3 and np.all(np.diff(v) <= 1e-6)
            assert np.sum(v) * CFG.dt <= sc.dist - CFG.stop_margin + 1e-3
        elif f.decision == "stay":
            assert np.abs(sc.traj).max() < 1e-6
        elif f.decision == "start":
            assert v[0] < 0.2 and v[-1] > 5.0
        elif f.decision == "follow" and f.event == "lead_brake":
            assert v[-1] < v[0] - 2.0
        elif f.decision == "slow":
            assert v[-1] < v[0] - min(2.0, v[0] - 0.1)
        elif (f.decision in ("keep", "proceed") or f.event == "lead_cruise") and f.speed == "cruise":
            assert np.allclose(v, sc.v0, rtol=1e-3)
        elif f.decision in ("keep", "proceed"):
            assert np.all(np.diff(v) > 0)
        if f.decision == "nudge":
            lane = D.rollout(sc.v0, np.zeros(CFG.n_future), np.full(CFG.n_future, sc.kappa), CFG)
            heading = np.arctan2(*(lane[-1] - lane[-2])[::-1])
            off = sc.traj[-1] - lane[-1]
            lateral = -np.sin(heading) * off[0] + np.cos(heading) * off[1]
            assert 1.0 < lateral < 2.5
        if f.turn != "straight" and f.decision in ("keep", "follow", "proceed") and v[-1] > 3:
            assert np.sign(sc.traj[-1, 1]) == np.sign(sc.kappa)
    assert set(seen) == {"keep", "follow", "stop", "nudge", "slow", "proceed", "stay", "start"}


# ---- tokenizer and history ----
def test_tokenizer_round_trip(train, tok):
    assert len(set(tok.vocab)) == len(tok)
    for sc in train[:100]:
        text = " ".join(sc.coc)
        assert tok.decode(tok.encode(text)) == text


def decode_history(ids, tok):
    """48 history ids -> (16, 3) bin centres."""
    words = [tok.vocab[int(i)] for i in ids]  # "<dx12>": the bin's name and index
    edges = [D.bin_edges(tok.bins[w[1:3]]) for w in words]
    return np.array([lo + (int(w[3:-1]) + 0.5) * width for w, (lo, width, _) in zip(words, edges)]).reshape(-1, 3)


def test_history_tokens_decode_within_one_bin(train, tok):
    widths = np.array([D.bin_edges(s)[1] for s in (CFG.dx_bins, CFG.dy_bins, CFG.dh_bins)])
    for sc in train:
        ids = tok.encode_history(sc.hist)
        assert len(ids) == 3 * CFG.n_hist == 48
        assert np.all(np.abs(decode_history(ids, tok) - sc.hist) <= widths / 2 + 1e-9)


def read_history(ids, tok):
    """The exact reader of the history tokens -> (speed, band, turn, sharp): the band from the latest dx bin, the
    profile from the first and last dx bins, the turn from the dh bins' sign, the sharpness from the bounds that the
    bins put on dh / dx. If it is exact, the history determines every routine word."""
    idx = np.array([int(tok.vocab[i][3:-1]) for i in ids]).reshape(-1, 3)   # (16, 3) bin indices (dx, dy, dh)
    (x0, xw, _), (h0, hw, nh) = D.bin_edges(CFG.dx_bins), D.bin_edges(CFG.dh_bins)
    if idx[:, 0].max() == 0:
        return "stand", None, "straight", None
    v_last = (x0 + (idx[-1, 0] + 0.5) * xw) / CFG.dt
    band = min(D.BAND_V, key=lambda b: abs(np.mean(D.BAND_V[b]) - v_last))
    d = idx[-1, 0] - idx[0, 0]
    speed = "cruise" if abs(d) <= 1 else ("accel" if d > 0 else "decel")
    mid = (nh - 1) // 2
    if (idx[:, 2] == mid).all():
        return speed, band, "straight", None
    dh_lo, dh_hi = np.abs(h0 + idx[:, 2] * hw), np.abs(h0 + (idx[:, 2] + 1) * hw)   # |dh| bounds per step
    dh_lo, dh_hi = np.minimum(dh_lo, dh_hi), np.maximum(dh_lo, dh_hi)
    k_lo = (dh_lo / (x0 + (idx[:, 0] + 1) * xw)).max()
    k_hi = (dh_hi / np.maximum(x0 + idx[:, 0] * xw, 1e-9)).min()
    sharp = "sharp" if (k_lo + k_hi) / 2 > (D.KAPPA["gentle"][1] + D.KAPPA["sharp"][0]) / 2 else "gentle"
    return speed, band, "left" if idx[-1, 2] > mid else "right", sharp


def test_history_tokens_determine_the_routine_factors(train, test_split, tok):
    for sc in train + test_split:
        assert read_history(tok.encode_history(sc.hist), tok) == sc.f.hist_class, sc.f


# ---- splits ----
def test_held_out_combinations_only_in_test(train, test_split):
    val = D.make_split("val", 300, seed=0)
    triples = lambda sc: {(sc.f.event, a[0], sc.f.road) for a in (sc.f.left, sc.f.right) if a}
    held = set(D.HELD_OUT)
    assert not any(triples(sc) & held for sc in train + val)
    assert all(triples(sc) & held for sc in test_split)
    assert set().union(*(triples(sc) & held for sc in test_split)) == held
    # composable: each held-out (event, road) and (event, roadside kind) pair is seen in train, just not together
    seen = set().union(*(triples(sc) for sc in D.make_split("train", 3000, seed=1)))
    for e, k, r in held:
        assert any(s[0] == e and s[2] == r for s in seen) and any(s[:2] == (e, k) for s in seen)


def test_deterministic_with_seed():
    a, b, c = D.make_split("train", 20, seed=3), D.make_split("train", 20, seed=3), D.make_split("train", 20, seed=4)
    for x, y in zip(a, b):
        assert x.f == y.f and x.coc == y.coc and x.view_seed == y.view_seed
        assert np.array_equal(x.frames, y.frames) and np.array_equal(x.traj, y.traj)
    assert any(not np.array_equal(x.frames, z.frames) for x, z in zip(a, c))
    assert D.make_split("train", 5, seed=3)[4].f == a[4].f
    with pytest.raises(ValueError):
        D.make_split("dev", 1)


# ---- the premise: routine vs commitment tokens ----
def bayes_contexts(split):
    """routine_share's definition without its decomposition: every (main, roadside) combination with its probability,
    summed per (history class, full prefix) -> {context: Counter(next word -> probability)}, mean CoC length."""
    ctx, length = defaultdict(Counter), 0.0
    for f, p in D.main_distribution(split):
        for (left, right), q in D.roadside_distribution(f.road, f.event, split):
            g = D.replace(f, left=left, right=right)
            words = D.coc_words(g) + ["<cot_end>"]
            length += p * q * len(words)
            for i, w in enumerate(words):
                ctx[(g.hist_class, tuple(words[:i]))][w] += p * q
    return ctx, length


def test_routine_share():
    assert 0.75 <= D.routine_share("train") <= 0.85                  # the paper: about 0.78 of CoC tokens routine
    ctx, length = bayes_contexts("test")
    share = D.routine_share("test")
    assert share == pytest.approx(sum(max(c.values()) for c in ctx.values()) / length, abs=1e-12)
    # sample_factors draws from the distribution routine_share sums over: the Bayes guess scored on sampled scenes
    # agrees (5000 scenes; the tolerance is > 4 standard errors of a token-level rate over ~110k tokens)
    rng, right, total = np.random.default_rng(0), 0, 0
    for _ in range(5000):
        f = D.sample_factors(rng, "test")
        words = D.coc_words(f) + ["<cot_end>"]
        for i, w in enumerate(words):
            c = ctx[(f.hist_class, tuple(words[:i]))]
            right += max(c, key=c.get) == w
            total += 1
    assert right / total == pytest.approx(share, abs=0.01)


def test_commitment_positions_consistent_with_grammar(train, test_split):
    # the positions equal their definition (more than one continuation over the world's support) on every scene ...
    support = defaultdict(set)
    for split in ("train", "test"):
        for f, _ in D.main_distribution(split):
            for (left, right), _ in D.roadside_distribution(f.road, f.event, split):
                support[f.hist_class].add(tuple(D.coc_words(D.replace(f, left=left, right=right))) + ("<cot_end>",))
    for sc in train[:150] + test_split[:50]:
        words = tuple(sc.coc) + ("<cot_end>",)
        options = support[sc.f.hist_class]
        assert sc.commit == [len({o[i] for o in options if o[:i] == words[:i]}) > 1 for i in range(len(words))]
    # ... the state clause is routine, the decision word a commitment, about 4 or more commitments per CoC
    for sc in train:
        comma = sc.coc.index(",")
        assert not any(sc.commit[:comma + 1])
        if sc.f.speed != "stand":
            assert sc.commit[comma + 1]
    assert np.mean([sum(sc.commit) for sc in train]) >= 2
    assert 16 <= np.mean([len(sc.commit) for sc in train]) <= 24
    assert max(len(o) - 1 for options in support.values() for o in options) == D.MAX_COC


def test_same_history_different_decision():
    classes = defaultdict(set)
    for f, _ in D.main_distribution("train"):
        classes[f.hist_class].add(f.decision)
    assert len(classes) > 40 and all(len(v) >= 2 for v in classes.values())


# ---- front raster: the evidence is there, and it takes two hops ----
CH = {n: i for i, n in enumerate(D.CHANNELS)}
TOKEN_PX = D.PATCH * D.MERGE                                             # pixels per merged token side


def blocks(plane):
    """Top-left pixels of the 2x2 blocks set in a (H, W) plane, checking that they are whole, even-aligned blocks."""
    rows, cols = np.nonzero(plane)
    tops = sorted({(r - r % 2, c - c % 2) for r, c in zip(rows, cols)})
    assert len(rows) == 4 * len(tops) and all(plane[r:r + 2, c:c + 2].all() for r, c in tops)
    return tops


def test_raster_evidence(train):
    appearance = [CH[n] for n in D.APPEARANCE]
    for sc in train:
        f, fr = sc.f, sc.frames
        assert fr.shape == (2, len(D.CHANNELS), CFG.height, CFG.width) and fr.dtype == np.uint8
        assert fr[:, [CH[c] for c in D.CLUTTER]].sum() == 0            # clutter only in the surround views
        assert fr[0, [CH["object"], CH["in_lane"]] + [CH[f"range_{b}"] for b in D.BUCKET_ROWS]].sum() == 0
        before, now = blocks(fr[0, appearance].max(0)), blocks(fr[1, CH["object"]])
        assert before == now                                             # frame 0 is registered to the current one
        if sc.seen_now:
            assert blocks(fr[1, appearance].max(0)) == now
        else:
            assert fr[1, appearance].sum() == 0
        roadside = [a for a in (f.left, f.right) if a]
        n_actors = (f.event in D.ACTORS) + len(roadside) + (f.event in ("red", "green"))
        assert len(now) == n_actors == len({D.token_of(r, c) for r, c in now})   # one token per actor
        lane = blocks(fr[1, CH["in_lane"]])
        assert len(lane) == (f.event in D.ACTORS)
        for (r, c), (side, actor) in [(b, s) for b in now for s in (("left", f.left), ("right", f.right))
                                      if s[1] and D.token_of(*b)[1] == D.COLUMN[s[0]]]:
            lo, hi = D.BUCKET_ROWS[actor[1]]
            assert lo <= r <= hi and fr[0, CH[actor[0]], r, c]
        if lane:
            (r, c), = lane
            assert D.token_of(r, c)[1] == D.COLUMN["centre"] and fr[1, CH[f"range_{f.bucket}"], r, c]
        kinds_seen = {k for k in D.KINDS if fr[0, CH[k]].any()}
        assert kinds_seen == {D.ACTORS.get(f.event)} - {None} | {a[0] for a in roadside}
        assert fr[0, CH["brake"]].any() == (f.event == "lead_brake")


def read_raster(frames):
    """The exact two-hop reader of the front raster alone -> (event, bucket, left, right): find the objects at t = 0
    (hop 1), read what is drawn in the same merged token in the earlier frame (hop 2); the token column gives the
    side, the ring the range. If it is exact, the image determines every commitment."""
    before, now = frames
    ring = lambda r, c: next((b for b in D.BUCKET_ROWS if now[CH[f"range_{b}"], r, c]), None)
    kind = lambda r, c: next(k for k in D.KINDS if before[CH[k], r, c])
    out = {"left": None, "right": None}
    for r, c in blocks(now[CH["object"]]):
        col = D.token_of(r, c)[1]
        if col != D.COLUMN["centre"]:
            out["left" if col == D.COLUMN["left"] else "right"] = (kind(r, c), ring(r, c))
    for light in ("red", "green"):
        if before[CH["light_" + light]].any():
            return light, ring(*blocks(now[CH["object"]])[0]), None, None
    lane = blocks(now[CH["in_lane"]])
    if not lane:
        return "clear", None, out["left"], out["right"]
    (r, c), = lane
    event = {"vehicle": "lead_brake" if before[CH["brake"], r, c] else "lead_cruise",
             "pedestrian": "ped_cross", "cone": "cone_lane", "cyclist": "cyclist_lane"}[kind(r, c)]
    return event, ring(r, c), out["left"], out["right"]


def test_raster_alone_determines_visual_factors(train, test_split):
    for sc in train + test_split:
        f = sc.f
        assert read_raster(sc.frames) == (f.event, f.bucket, f.left, f.right), f


def test_kinds_in_view_do_not_give_the_decision(train):
    """A reader that pools the evidence over the video (which kinds, brake lights and in_lane marks are in view, not
    where) cannot tell the decision in most scenes with an actor in the lane."""
    pooled = [CH[n] for n in D.APPEARANCE] + [CH["in_lane"]]
    bag = lambda sc: tuple(sc.frames[:, pooled].any(axis=(0, 2, 3)))
    in_lane = [sc for sc in train if sc.f.event in D.ACTORS]
    decisions = defaultdict(set)
    for sc in in_lane:
        decisions[bag(sc)].add(sc.f.decision)
    assert sum(len(decisions[bag(sc)]) > 1 for sc in in_lane) / len(in_lane) > 0.6


# ---- examples and metrics ----
def test_example_layout(train, tok):
    exs = [D.make_example(s, tok, 2) for s in train[:4]]
    for e, s in zip(exs, train[:4]):
        x = e["input_ids"]
        assert x[e["traj_index"]] == tok.traj_future_start_id
        assert x[1:][e["loss_mask"][:-1]].tolist() == tok.encode(s.coc) + [tok.cot_end_id] == e["coc_ids"]
        assert x[1:][e["commit_mask"][:-1]].tolist() == [i for i, m in zip(e["coc_ids"], s.commit) if m]
    b = D.collate(exs, tok.pad_id)
    C = len(D.CHANNELS) * D.PATCH ** 2
    assert b["pixel_values_videos"].shape == (4 * 108, C) and b["video_grid_thw"].shape == (4, 3)
    assert b["pixel_values"].shape == (4 * 2 * 216, C) and b["image_grid_thw"].shape == (8, 3)
    assert (b["input_ids"][b["attention_mask"] == 0] == tok.pad_id).all()


def test_metrics(train, tok):
    t = torch.zeros(2, 32, 2)
    p = t.clone()
    p[:, :, 1] = 3.0
    p[1, -1, 1] = 4.0
    ade, fde = evaluate.ade_fde(p, t)
    assert ade == pytest.approx(3.0 + 0.5 / 32) and fde == pytest.approx(3.5)
    assert evaluate.coc_exact_match([[1, 2], [1, 3]], [[1, 2], [1, 2]]) == 0.5
    b = D.collate([D.make_example(s, tok, 0) for s in train[:3]], tok.pad_id)
    perfect = torch.cat([b["input_ids"][:, 1:], b["input_ids"][:, :1]], dim=1)   # argmax at i = token i + 1
    hits, n = evaluate.commitment_hits(perfect, b["input_ids"], b["commit_mask"])
    assert n > 0 and hits == n
    wrong = perfect.clone()
    wrong[b["commit_mask"]] = tok.pad_id
    assert evaluate.commitment_hits(wrong, b["input_ids"], b["commit_mask"])[0] == 0


def test_batches_walk_a_permutation(tok):
    """No scene repeats inside an epoch, the order is a pure function of (seed, step), DDP ranks split a batch, and a
    view-count schedule sets each batch's geometry."""
    data = D.Data("train", 20, 0, tok, views=0)
    key = lambda b: [tuple(x[m.bool()].tolist()) for x, m in zip(b["input_ids"], b["attention_mask"])]  # unpadded
    seen = [s for step in range(4) for s in key(data.batch(step, 5))]
    assert sorted(seen) == sorted(key(next(data.batches(20))))           # epoch 0 = every scene once
    assert key(data.batch(2, 5)) == key(D.Data("train", 20, 0, tok, views=0).batch(2, 5))
    assert key(data.batch(4, 5)) != key(data.batch(0, 5))                 # epoch 1 has its own order
    whole = key(data.batch(1, 4))
    assert sorted(key(data.batch(1, 4, rank=0, world=2)) + key(data.batch(1, 4, rank=1, world=2))) == sorted(whole)
    with pytest.raises(ValueError, match="batch size 32 is larger than the 20 scenes"):
        data.batch(0, 32)
    mixed = D.Data("train", 20, 0, tok, views=lambda step: step)
    assert [int((mixed.batch(s, 2)["input_ids"] == tok.image_token_id).sum()) for s in range(3)] == [0, 48, 96]
