"""The hardware chooser (measure/choose.py): synthetic profiles choose what their cost curve says (a flat verify a large
tree, a steep one a chain or no speculation), the cache holds only for its key, --dtype auto follows the hardware, and
a real profile and acceptance on tiny models (the rounds are real decoding's).

run: python -m pytest -q tests/test_choose.py
"""
import json

import pytest
import torch

from model import make_draft
from ops import files
from measure import choose, timing
from speculate import Chain
from tiny_models import image_prompt, tiny_model
from tree import TreeShape

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = 300  # val tokens in the synthetic acceptance


def synthetic(step, verify_per_token, draft=0.02, overhead=0.0):
    """A profile (s): a one-token step `step`, each extra verified token adding verify_per_token x step, draft steps and
    tree levels `draft` of a step."""
    t = {n: step * (1 + verify_per_token * (n - 1)) for n in range(1, max(choose.GAMMAS) + 2)}
    return {"target": t, "verify": {sh.nodes: step * (1 + verify_per_token * sh.nodes) for sh in choose.FAMILY},
            "draft": {1: draft * step, 2: draft * step},
            "grow": {choose.shape_key(sh): (sh.depth - 1) * draft * step for sh in choose.FAMILY},
            "overhead": {**dict.fromkeys(("chain", "tree"), overhead), "chain_step": 0.0}}


def acceptance(alpha=0.8):
    """Rounds of TOKENS val tokens for an i.i.d. acceptance alpha: a chain's expected tau; a tree's its depth's chain
    tau raised by its width (more nodes, more chances at each depth)."""
    out = {"target-only": {"rounds": TOKENS, "tokens": TOKENS, "plan_rounds": [TOKENS]}}  # one val plan
    for c in choose.candidates()[1:]:
        a = 1 - (1 - alpha) ** c.width  # a level passes when any of its k candidates is the target's token
        tau = (1 - a ** (c.depth + 1)) / (1 - a) * min(1.0, c.nodes / (c.depth * c.width))
        n = round(TOKENS / max(tau, 1.0))
        out[choose.name(c)] = {"rounds": n, "tokens": TOKENS, "plan_rounds": [n]}
    return out


def test_the_prediction_reads_the_harder_half_of_the_val_plans(monkeypatch):
    """Two val plans: on the easy one a chain saves more rounds than a tree, on the hard one the chain's gain is gone
    and the tree keeps some. The mean over both plans ranks the chain first, the harder half (TAIL) the tree, and
    each candidate's prediction is its own hardest plan's speed-up."""
    prof = synthetic(0.01, 0.0)
    acc = {n: {"rounds": 2 * TOKENS, "tokens": 2 * TOKENS, "plan_rounds": [TOKENS, TOKENS]}
           for n in map(choose.name, choose.candidates())}  # every other candidate: no gain on either plan
    acc["chain 8"] = {"rounds": 40 + TOKENS, "tokens": 2 * TOKENS, "plan_rounds": [40, TOKENS]}
    acc["tree 16/6/3"] = {"rounds": 100 + 150, "tokens": 2 * TOKENS, "plan_rounds": [100, 150]}
    pred = choose.predict(prof, acc)
    assert choose.name(choose.choose(pred)[0]) == "tree 16/6/3"
    for n, c in {"chain 8": Chain(8), "tree 16/6/3": TreeShape(16, 6, 3)}.items():  # each its own worse plan
        worst = min(TOKENS * choose.round_s(prof, None) / (r * choose.round_s(prof, c)) for r in acc[n]["plan_rounds"])
        assert pred[n]["predicted_speedup"] == pytest.approx(worst)
        assert pred[n]["val_mean_speedup"] > pred[n]["predicted_speedup"]
    monkeypatch.setattr(choose, "TAIL", 1.0)  # every plan: the mean of the per-plan speed-ups ranks the chain first
    assert choose.name(choose.choose(choose.predict(prof, acc))[0]) == "chain 8"


def test_a_flat_verify_picks_a_large_tree_and_a_steep_one_a_chain_or_target_only():
    flat = choose.choose(choose.predict(synthetic(0.01, 0.0), acceptance()))
    assert flat[0].kind == "tree" and flat[0].nodes == 32  # a verify of 33 costs one step: the most nodes win
    mid = choose.choose(choose.predict(synthetic(0.01, 0.25), acceptance()))
    assert mid[0].kind == "chain"  # each verified token costs a quarter step: a short chain beats every tree
    steep = choose.predict(synthetic(0.01, 1.0, draft=0.3), acceptance(alpha=0.3))
    ranked = choose.choose(steep)
    assert ranked[0] is None and steep["target-only"]["predicted_speedup"] == 1.0  # nothing predicted faster
    assert all(v["predicted_speedup"] < 1 for k, v in steep.items() if k != "target-only")


def test_least_of_rounds_runs_the_rounds_its_share_of_the_seconds_allows(monkeypatch):
    """At least MIN_ROUNDS rounds, at most MAX_ROUNDS, more while the stage's STAGE_S allows; the least of each."""
    monkeypatch.setattr(choose, "MIN_ROUNDS", 2)
    monkeypatch.setattr(choose, "MAX_ROUNDS", 5)
    for share, rounds in ((0.0, 2), (1e9, 5)):
        monkeypatch.setattr(choose, "STAGE_S", share)
        calls = []

        def timer(name, seconds):  # seconds(the call's number)
            return lambda: calls.append(name) or seconds(len(calls))
        least = choose.least_of_rounds({"a": timer("a", lambda n: 1 / n), "b": timer("b", lambda n: 1.0)}, warm=False)
        assert calls.count("a") == calls.count("b") == rounds
        assert least == {"a": 1 / max(i + 1 for i, c in enumerate(calls) if c == "a"), "b": 1.0}


def test_the_timed_decodes_stop_past_max_timed_where_each_timing_moves_the_ranking(monkeypatch, tmp_path):
    """A plan's real round slower than every prediction demotes each candidate as it is timed (here its kind's other
    candidates are not calibrated by it): the chooser times MAX_TIMED candidates, then once more the one predicted
    fastest (a forwards' sum), and stops; target-only is timed beside every batch, the ranking over what it has."""
    monkeypatch.setattr(choose, "CACHE", str(tmp_path))
    monkeypatch.setattr(choose, "calibrated", lambda prof: prof)
    timed = []

    def slow(target, draft, plan, decoder, *a):  # every candidate's real round: 1 s, target-only's 10 ms
        timed.append(choose.name(decoder))
        return lambda j: 0.01 if decoder is None else 1.0
    monkeypatch.setattr(choose, "decode_timer", slow)
    target = tiny_model()
    prof = choose.timed_rounds(synthetic(0.01, 0.0), acceptance(), 1, target, target, [image_prompt()], 1,
                               choose.GREEDY, None, 6, "eager")
    candidates = [n for n in timed if n != "target-only"]
    assert len(candidates) == len(set(candidates)) == choose.MAX_TIMED + 1 == len(prof["rounds"]) - 1
    assert timed.count("target-only") == 3 and timed[0] == "target-only"  # batches of 2, 1 and the one past the cap
    assert {n.split()[0] for n in candidates[:2]} == {"chain", "tree"}  # the first batch: one of each kind
    assert all(prof["rounds"][n] == pytest.approx(1.0) for n in candidates)
    pred = choose.predict(prof, acceptance())
    assert choose.choose(pred)[0] is not None and not pred[choose.name(choose.choose(pred)[0])]["timed"]
    assert choose.ranking(pred)[0] is None  # an untimed one is predicted fastest; the timed target-only runs first


def test_a_timed_candidate_calibrates_its_kind():
    """A chain's real round twice its summed one doubles every untimed chain's predicted round, and no tree's; two
    timed trees, at 1x and 3x, calibrate theirs by the median (2x)."""
    prof = synthetic(0.01, 0.1, overhead=0.001)
    sums = {choose.name(c): choose.summed_round_s(prof, c) for c in choose.candidates()}
    prof = choose.calibrated(prof | {"rounds": {"target-only": 0.01, "chain 4": 2 * sums["chain 4"]}})
    assert prof["calibration"] == {"chain": pytest.approx(2.0)}
    assert choose.round_s(prof, Chain(7)) == pytest.approx(2 * sums["chain 7"])
    assert choose.round_s(prof, TreeShape(16, 6, 3)) == sums["tree 16/6/3"]
    prof = choose.calibrated(prof | {"rounds": prof["rounds"] | {"tree 8/4/3": sums["tree 8/4/3"],
                                                                 "tree 32/8/3": 3 * sums["tree 32/8/3"]}})
    assert prof["calibration"]["tree"] == pytest.approx(2.0)
    assert choose.round_s(prof, TreeShape(16, 6, 3)) == pytest.approx(2 * sums["tree 16/6/3"])
    assert choose.round_s(prof, TreeShape(8, 4, 3)) == sums["tree 8/4/3"]  # a timed one keeps its own round


def test_past_the_cap_the_fastest_predicted_is_timed_once(monkeypatch, tmp_path):
    """The cap spent on candidates whose real round is slower than predicted, the one the forwards' sum predicts
    fastest of all is still timed, and wins when its real round holds (it would otherwise never run: ranking)."""
    monkeypatch.setattr(choose, "CACHE", str(tmp_path))
    prof0, acc = synthetic(0.01, 0.0), acceptance()
    best = choose.choose(choose.predict(prof0, acc))[0]

    def timer(target, draft, plan, decoder, *a):  # its predicted round for the best, twice that for every other
        return lambda j: choose.round_s(prof0, decoder) * (1 if decoder in (None, best) else 2)
    monkeypatch.setattr(choose, "decode_timer", timer)
    monkeypatch.setattr(choose, "MAX_TIMED", 0)  # the cap reached with the first batch
    target = tiny_model()
    prof = choose.timed_rounds(prof0, acc, 1, target, target, [image_prompt()], 1, choose.GREEDY, None, 6, "eager")
    pred = choose.predict(prof, acc)
    assert choose.name(best) in prof["rounds"] and choose.ranking(pred)[0] == best


def test_a_timed_round_is_its_median_ratio_to_target_only_on_the_same_plans(monkeypatch):
    """A load common to both decodes of a plan in a pass cancels, and neither a burst on one plan nor a lucky dip on
    another, on the candidate alone, moves the median of the six ratios (its least would keep the dip): the
    candidate's round is target-only's least x the median ratio; every plan's decodes back to back, after a warm-up."""
    monkeypatch.setattr(choose, "TIMED_PASSES", 3)
    load = [1.0, 1.6, 1.2, 1.0, 1.3, 1.1]  # each (pass, plan)'s load, on both timers' decodes of that plan
    own = [3.0, 1.0, 1.0, 0.6, 1.0, 1.0]  # b's alone: a burst on one plan, a lucky dip on another
    calls = {"t": [], "b": []}

    def timer(what, s):
        def run(j):
            calls[what].append(j)
            k = len(calls[what]) - 2  # -1: interleaved's warm-up call
            return s * (1.0 if k < 0 else load[k] * (own[k] if what == "b" else 1.0))
        return run
    got = choose.paired_rounds({"t": timer("t", 0.01), "b": timer("b", 0.02)}, "t", 2, "cpu")
    assert calls["t"] == calls["b"] == [0] + [0, 1] * 3
    assert got == {"t": pytest.approx(0.01), "b": pytest.approx(0.02)}


def test_one_row_times_three_plans_in_three_passes_six_rows_two_in_two(monkeypatch, tmp_path):
    """The timed decodes' plans (timed_plans) and passes (paired_rounds through timing.interleaved): at one row
    TIMED_ROWS plans x TIMED_PASSES, at six rows TIMED_MIN_PLANS plans x TIMED_PASSES_ROWS."""
    for k, v in {"TIMED_ROWS": 3, "TIMED_MIN_PLANS": 2, "TIMED_PASSES": 3, "TIMED_PASSES_ROWS": 2,
                 "CACHE": str(tmp_path), "MAX_TIMED": 0}.items():
        monkeypatch.setattr(choose, k, v)
    assert [len(choose.timed_plans(list(range(16)), rows)) for rows in (1, 6)] == [3, 2]
    passes, interleaved = [], timing.interleaved
    monkeypatch.setattr(timing, "interleaved", lambda t, n, r, *a, **k: passes.append((n, r)) or interleaved(
        t, n, r, *a, **k))
    monkeypatch.setattr(choose, "decode_timer", lambda *a, **k: lambda j: 0.01)
    target = tiny_model()
    for rows, want in ((1, (3, 3)), (6, (2, 2))):
        passes.clear()
        plans = choose.timed_plans([image_prompt(seed=s) for s in range(4)], rows)
        choose.timed_rounds(synthetic(0.01, 0.0), acceptance(), rows, target, target, plans, 1, choose.GREEDY, None,
                            6, "eager")
        assert passes and all(p == want for p in passes), (rows, passes)


def test_the_prediction_is_rounds_times_the_round():
    prof, acc = synthetic(0.01, 0.1, overhead=0.001), acceptance()
    pred = choose.predict(prof, acc)
    c = Chain(4)
    round_s = 4 * prof["draft"][1] + prof["target"][5] + 0.001
    want = TOKENS * 0.01 / (acc["chain 4"]["rounds"] * round_s)  # target-only's round: its step alone
    assert pred["chain 4"]["predicted_speedup"] == pytest.approx(want) and choose.round_s(prof, c) == round_s
    sh = TreeShape(16, 6, 3)
    assert choose.round_s(prof, sh) == pytest.approx(prof["draft"][1] + prof["grow"]["16/6/3"]
                                                     + prof["verify"][16] + 0.001)
    timed = prof | {"rounds": {"chain 4": 0.05}}  # a real decode's round replaces the forwards' sum
    assert choose.round_s(timed, c) == 0.05 and choose.predict(timed, acc)["chain 4"]["timed"]
    assert choose.predict(timed, acc)["chain 4"]["predicted_speedup"] == pytest.approx(
        TOKENS * 0.01 / (acc["chain 4"]["rounds"] * 0.05))


def test_the_cache_holds_only_for_its_key(tmp_path, monkeypatch):
    monkeypatch.setattr(choose, "CACHE", str(tmp_path))
    calls, said = [], []
    measure = lambda: calls.append(1) or {"x": len(calls)}  # noqa: E731
    key = {"hardware": "cpu AVX2", "threads": 2, "torch": "2.13", "dtype": "float32", "mode": "eager"}
    assert choose.cached("profile", key, measure)[0] == {"x": 1}
    assert choose.cached("profile", key, measure)[0] == {"x": 1} and len(calls) == 1  # reused
    for field, other in (("hardware", "cpu AVX512"), ("threads", 1), ("torch", "2.11"), ("dtype", "bfloat16"),
                         ("mode", "compiled")):
        n = len(calls)
        choose.cached("profile", {**key, field: other}, measure)
        assert len(calls) == n + 1  # any field changed: measured again
    assert choose.cached("profile", key, measure, again=True)[0] == {"x": 7}  # --reprofile
    path = next(p for p in tmp_path.iterdir() if json.loads(p.read_text())["key"] == key)
    path.write_text("{not json")  # a bad cache file: one line, measured again, rewritten
    value, how = choose.cached("profile", key, measure, log=said.append)
    assert value == {"x": 8} and "measured now" in how and len(said) == 1 and "not valid JSON" in said[0]
    path.write_text(json.dumps({"key": {**key, "threads": 64}, "value": {"x": 0}}))  # another key at this name
    assert choose.cached("profile", key, measure, log=said.append)[0] == {"x": 9} and "another key" in said[1]
    assert files.read_json(str(path))["value"] == {"x": 9}


def test_a_shipped_record_is_read_where_the_run_cache_has_none(tmp_path, monkeypatch):
    """SHIPPED (the toy's val rounds beside its checkpoints) answers a key the run's cache lacks; the run's cache, where
    it has the key, comes first; again (--reprofile) measures anyway."""
    monkeypatch.setattr(choose, "CACHE", str(tmp_path / "runs"))
    monkeypatch.setattr(choose, "SHIPPED", str(tmp_path / "shipped"))
    calls = []
    measure = lambda: calls.append(1) or {"x": len(calls)}  # noqa: E731
    key = {"plans": 64, "rows": 1}
    choose.cached("acceptance", key, measure)
    (tmp_path / "runs").rename(tmp_path / "shipped")  # the record shipped, no run cache
    value, how = choose.cached("acceptance", key, measure)
    assert value == {"x": 1} and len(calls) == 1 and how.startswith(f"reused {tmp_path / 'shipped'}")
    assert choose.cached("acceptance", key, measure, again=True)[0] == {"x": 2}  # now in the run's cache too
    value, how = choose.cached("acceptance", key, measure)
    assert value == {"x": 2} and how.startswith(f"reused {tmp_path / 'runs'}") and len(calls) == 2


@pytest.mark.parametrize("device, flags, capability, bf16_gpu, want", [
    ("cpu", {"avx2", "fma"}, "AVX2", None, "fp32"),
    ("cpu", {"avx512f", "avx512bw"}, "AVX512", None, "fp32"),  # AVX-512 without its BF16 extension: emulated
    ("cpu", {"avx512f", "avx512_bf16"}, "AVX512", None, "bf16"),
    ("cpu", {"amx_bf16", "amx_tile"}, "AVX512", None, "bf16"),
    ("cuda", set(), "AVX2", True, "bf16"),
    ("cuda", set(), "AVX2", False, "fp32"),
])
def test_auto_dtype_follows_the_hardware(monkeypatch, device, flags, capability, bf16_gpu, want):
    monkeypatch.setattr(choose, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16_gpu)
    dtype, why = choose.auto_dtype(device)
    assert dtype == want and (capability in why or device == "cuda")


def test_a_real_profile_and_the_val_rounds_of_tiny_models(tmp_path, monkeypatch):
    """On tiny models: every forward of the profile timed; the rounds are real decoding's (the target-only rounds are
    its tokens); the choice is the best predicted, its record names every candidate, and the top two predicted are
    real decodes' rounds."""
    monkeypatch.setattr(choose, "CACHE", str(tmp_path))
    monkeypatch.setattr(choose, "REPS", 2)
    target = tiny_model(max_seq_len=128)  # the family's 32-node trees need the room
    draft = make_draft(target, n_layers=1).eval()
    val = [image_prompt(seed=s) for s in range(2)]
    ranked, rec = choose.choice(target, draft, val[0], val, 6, None)
    names = [choose.name(c) for c in choose.candidates()]
    assert set(rec["predicted"]) == set(names) and rec["chosen"] == choose.name(ranked[0])
    best = max((v for v in rec["predicted"].values() if v["timed"]), key=lambda v: v["predicted_speedup"])
    assert rec["predicted"][rec["chosen"]] == best and "measured now" in rec["profile"]
    assert len(rec["steps_ms"]) == 9 and all(v > 0 for v in rec["timed_rounds_ms"].values())
    ranked_pred = sorted(rec["predicted"], key=lambda n: -rec["predicted"][n]["predicted_speedup"])
    capped = len(rec["timed_rounds_ms"]) > choose.MAX_TIMED or rec["profile_s"] > choose.PROFILE_S  # its two caps
    assert all(rec["predicted"][n]["timed"] for n in ranked_pred[:choose.TIMED_TOP]) or capped
    assert len(rec["timed_rounds_ms"]) <= choose.MAX_TIMED + 2  # target-only, MAX_TIMED, one past the cap
    assert rec["predicted"]["target-only"]["timed"] and set(rec["timed_rounds_ms"]) == {
        n for n, v in rec["predicted"].items() if v["timed"]}
    acc = choose.measure_acceptance(target, draft, val, 6, None)
    assert acc["target-only"]["rounds"] == acc["target-only"]["tokens"] == 12  # 6 tokens each, one step each
    assert all(a["tokens"] == 12 and 1 <= a["rounds"] == sum(a["plan_rounds"]) <= 12 and len(a["plan_rounds"]) == 2
               for a in acc.values())
    again = choose.choice(target, draft, val[0], val, 6, None)[1]
    assert again["profile"].startswith("reused") and again["acceptance"].startswith("reused")
    monkeypatch.setattr(choose, "shared_prefill", lambda t: t)  # every decode its own prefill: the same rounds
    assert choose.measure_acceptance(target, draft, val, 6, None) == acc


def test_reprofile_without_the_chooser_is_one_line(capsys):
    """--reprofile re-measures the chooser's profile: with a decoder named (--tree, --gamma) nothing is chosen, so it
    is refused before any work (a compiled stream runs --tree's)."""
    import bench
    for named in (["--tree", "0"], ["--gamma", "3"], ["--stream", "2", "--compile"]):
        with pytest.raises(SystemExit):
            bench.main(["--reprofile", *named])
        assert "--reprofile measures the chooser's profile again" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_val_grid_of_the_choosers_own_plans_is_one_line(tmp_path, capsys):
    """choose_grid.py --split val times fresh scenes of val's distribution: seed 0 would be the chooser's own val
    plans (what it predicts from), so it is refused before any work, and nothing is written."""
    from experiments import choose_grid
    out = tmp_path / "g.json"
    with pytest.raises(SystemExit):
        choose_grid.main(["--split", "val", "--out", str(out)])
    assert "--split val --test-seed 0 would time the chooser's own val plans" in \
        capsys.readouterr().err.strip().splitlines()[-1]
    assert not out.exists()
