"""End-to-end tests of rsd.py and bench.py on tiny checkpoints: the JSON contracts, greedy
exactness of every arm (fp32), and the real-shape benchmark path with a shrunken preset.
Timing values are only checked to be present and positive: speed is bench.py's job.

run: python -m pytest -q tests/test_end_to_end.py
"""
import copy
import json
import os
import shutil
import sys

import pytest
from test_train import TINY, TINY_DRAFT, tiny_cfg
import torch

import aarl
import bench
from beyond import stream
import driving
import evaluate
from evaluate import TARGET_ONLY
import model as M
from ops import checkpoint, files
from measure import choose, timing
import rsd
import speculate
import train as T
from tree import TreeShape

VIEWS = 2  # surround views of the tiny world's prompts: 12 + 2 x 24 = 60 visual tokens, fast to test


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Tiny target + the three SFT drafts of two seeds (train.py) + a 2-step AARL draft per seed, as rsd.retrain lays them
    out."""
    M.PRESETS["test-tiny"], M.DRAFT_PRESETS["test-tiny-draft"] = TINY, TINY_DRAFT
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run")
    tok = driving.Tokenizer()
    for seed in (0, 1):
        cfg = tiny_cfg(out, target_steps=80, draft_steps=60, n_val=8, n_test=8, views=VIEWS, max_views=VIEWS,
                       target_lr=3e-3,
                       draft_seed=seed, kinds="flat,mrope,history")
        T.run(cfg, stage="all" if seed == 0 else "drafts", log=lambda *_: None)
        target, sft = aarl.load_run(str(out), seed, "cpu")
        cfg = aarl.AARLConfig(steps=2, scenes=2, group=2, max_new=8, views=VIEWS, seed=seed)
        draft = aarl.train_aarl(target, copy.deepcopy(sft), driving.Data("train", 16, 0, tok), cfg, ref=sft)
        checkpoint.save(draft, aarl.out_dir(str(out), "static", seed), target=target)
    yield out
    del M.PRESETS["test-tiny"], M.DRAFT_PRESETS["test-tiny-draft"]


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_rsd_json_contract_and_exactness(run_dir, capsys):
    rsd.main(["--run", str(run_dir), "--seeds", "0,1", "--views", str(VIEWS), "--scenes", "6", "--time-scenes", "2",
              "--show", "1", "--stream", "1", "--stream-frames", "2", "--json"])
    out = last_json(capsys)
    assert out["greedy_match"] is True and out["seeds"] == [0, 1]
    # issue #59: what_ran names each row's searched decoder and its folders; the decoder flags did not shape the run
    for r, ran in zip(out["rows"][1:], out["what_ran"]["rows"][1:]):
        assert ran["decoder"] == (f"tree {'/'.join(map(str, r['tree']))}" if r["tree"] else f"chain {r['gamma']}")
        assert len(ran["drafts"]) == 2 and all(os.path.isdir(d) for d in ran["drafts"])
    assert out["what_ran"]["ignored"] == ["gamma", "tree"]
    # --stream: every draft row's four arms on one clip of two frames, each frame's plan target-only's
    assert list(out["stream"]) == [r["name"] for r in out["rows"][1:]]
    for arms in out["stream"].values():
        assert list(arms) == ["target-only", "tree", "stream", "tree+stream"]
        assert all(a["frames_differing"] == 0 and a["tau"] >= 1 and a["speedup"] > 0 for a in arms.values())
    assert set(out["target"]) == {"coc_exact", "commitment_acc", "ade"}
    assert out["prompt"] == {"visual_tokens": 12 + 24 * VIEWS, "history_tokens": 48}
    assert out["routine_share_world"] == pytest.approx(driving.routine_share("train"))
    chains = ["replica", "flatrope", "history-only", "flatrope+aarl"]
    assert [r["name"] for r in out["rows"]] == ["target-only", *chains, *(f"{n} tree" for n in chains)]
    assert set(out["sweep"]) == {"val", "test"} and set(out["sweep"]["test"]) == {str(g) for g in rsd.GAMMAS}
    for r in out["rows"]:
        assert set(r) == {"name", "gamma", "tau", "tau_spread", "tau_by_gamma", "tau_ceiling", "routine_fraction",
                          "commit_acc", "ms_per_token", "speedup", "ms_per_token_range", "speedup_range", "ade",
                          "attn_history", "attn_image", "attn_text", "tree", "tau_by_seed", "val_tau", "alpha_by_depth",
                          "nodes_per_round", "tau_pm"}
        # the table's ± is half the spread over the seeds' folders (two here); target-only has no draft
        assert r["tau_pm"] == (None if r["name"] == "target-only" else pytest.approx(r["tau_spread"] / 2))
        assert r["ms_per_token"] > 0 and 0 <= r["commit_acc"] <= 1
        lo, hi = r["speedup_range"]  # min..max over the timed blocks: 2 scenes, 2 blocks of 1
        assert 0 < lo <= hi and r["ms_per_token_range"][0] <= r["ms_per_token_range"][1]
        assert r["attn_history"] + r["attn_image"] + r["attn_text"] == pytest.approx(1.0, abs=1e-4)
        # greedy exactness: every arm plans from the same CoCs, so the same trajectories
        assert r["ade"] == pytest.approx(out["rows"][0]["ade"])
    tok = driving.Tokenizer()
    target = checkpoint.load(run_dir / "target").eval()
    test = driving.Data("test", 6, 0, tok, views=VIEWS)
    prompts = evaluate.scene_prompts(test.scenes, tok, "cpu", views=test.views_at(0))
    for r in out["rows"][1 + len(chains):]:  # tree rows: a shape of rsd.TREES, every seed's real tree decoding on the test scenes
        shape = TreeShape(*r["tree"])
        assert shape in rsd.TREES and r["gamma"] is None and len(r["tau_by_seed"]) == 2
        kind = dict(rsd.ROWS)[r["name"].removesuffix(" tree")]
        draft = checkpoint.load(checkpoint.draft_dir(str(run_dir), kind, 1), target=target).eval()
        res = [speculate.speculative(target, draft, p, shape, evaluate.MAX_NEW_TOKENS, stop_token=tok.cot_end_id)
               for p in prompts]
        assert r["tau_by_seed"][1] == pytest.approx(sum(len(x.tokens) for x in res) / sum(x.rounds for x in res))
        assert r["tau"] == pytest.approx(sum(r["tau_by_seed"]) / 2) and r["tau"] <= r["tau_ceiling"] + 1e-9
        assert all(a is None or 0 <= a <= 1 for a in r["alpha_by_depth"]) and 1 <= r["nodes_per_round"] <= shape.nodes
    for r in out["rows"][1:1 + len(chains)]:
        g = str(r["gamma"])
        # the row's tau is its tau at its gamma, the sweep's on the same scenes, and no draft beats a perfect one
        assert r["gamma"] in rsd.GAMMAS and r["tau"] == pytest.approx(r["tau_by_gamma"][g])
        assert r["tau"] == pytest.approx(out["sweep"]["test"][g][r["name"]]) and r["tau_spread"] >= 0
        assert r["tau"] <= r["tau_ceiling"] + 1e-9 == out["sweep"]["test"][g]["ceiling"] + 1e-9
    for split in out["sweep"].values():
        for g in split.values():
            assert all(g[name] <= g["ceiling"] + 1e-9 for name in ("replica", "flatrope", "history-only", "flatrope+aarl"))
    assert out["rows"][0]["tau"] == 1.0 and out["rows"][0]["routine_fraction"] == 0.0


def test_rsd_search_is_recorded_and_a_stale_record_is_not_used(run_dir, tmp_path, monkeypatch, capsys):
    """--search records the val search beside the checkpoints; a later run with the same checkpoints and settings reads
    it (the same gamma and trees: the step costs are the machine's cached profile); after a draft changed (another fingerprint) the record is
    not used and the search runs again."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    argv = ["--run", str(run), "--seeds", "0", "--views", str(VIEWS), "--scenes", "2", "--time-scenes", "1",
            "--show", "0", "--json"]
    rsd.main(argv + ["--search"])
    searched = last_json(capsys)
    rec = files.read_json(run / rsd.SEARCH_JSON)
    assert set(rec["tree_val_tau"]["replica"]) == {choose.shape_key(sh) for sh in rsd.TREES}  # --search: every tree
    assert set(rec) == {"what", "command", "key", "val_sweep", "tree_val_tau"}  # no step time: the machine's profile
    assert rec["key"]["drafts"]["flatrope"] == [checkpoint.fingerprint(
        checkpoint.load(checkpoint.draft_dir(str(run), "flat", 0), target=checkpoint.load(run / "target")))]
    assert rec["val_sweep"] == searched["sweep"]["val"]  # the val sweep the search measured and the table printed
    calls, real_search, greedy = [], rsd.search, evaluate.greedy_outputs

    def counted(*args):
        calls.append(args)
        return real_search(*args)

    def decoded(target, data, *a, **k):
        calls.append("greedy")
        return greedy(target, data, *a, **k)

    monkeypatch.setattr(rsd, "search", counted)
    monkeypatch.setattr(evaluate, "greedy_outputs", decoded)
    rsd.main(argv)
    text = "".join(capsys.readouterr()[::-1])  # stderr (--json: the report), stdout
    again = json.loads(text.strip().splitlines()[-1])
    # the recorded val sweep: no greedy decoding of val (evaluate.greedy_outputs), no search
    assert calls == [] and f"recorded by python rsd.py --search in {run / rsd.SEARCH_JSON}" in text
    assert again["sweep"] == searched["sweep"]
    assert [(r["gamma"], r["tree"]) for r in again["rows"]] == [(r["gamma"], r["tree"]) for r in searched["rows"]]
    assert "±" not in text  # one seed: no spread over seeds to show
    calls.clear()
    shutil.rmtree(run / "draft_aarl_s0")  # another draft in the row's place: another fingerprint
    shutil.copytree(run / "draft_flat_s0", run / "draft_aarl_s0")
    rsd.main(argv)
    text = "".join(capsys.readouterr()[::-1])  # stderr (--json: the report), stdout
    assert ["greedy" if c == "greedy" else "search" for c in calls] == ["search", "greedy"]  # val: the search's
    assert "(drafts (flatrope+aarl) differ): not used" in text and "measured now" in text


def test_compare_rsd_compares_a_row_at_its_decoder():
    """experiments/compare_rsd.py: a row whose timing-chosen decoder moved (a tree row's shape, a chain row's gamma) is a
    note and its tau is not compared; at the same decoder a changed tau is a difference."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
    import compare_rsd
    old = {"rows": [{"name": "x tree", "gamma": None, "tree": [16, 8, 3], "tau": 5.0},
                    {"name": "x", "gamma": 5, "tau": 3.0}]}
    moved = {"rows": [{"name": "x tree", "gamma": None, "tree": [16, 6, 3], "tau": 4.9},
                      {"name": "x", "gamma": 7, "tau": 3.2}]}
    assert compare_rsd.compare(old, moved) == ([], ["x tree: tree 16/8/3 -> tree 16/6/3 (timing-chosen; tau compared "
                                                    "through tau_by_gamma)", "x: gamma 5 -> gamma 7 (timing-chosen; "
                                                    "tau compared through tau_by_gamma)"])
    changed = {"rows": [dict(old["rows"][0], tau=4.9), dict(old["rows"][1], tau=3.2)]}
    assert compare_rsd.compare(old, changed)[0] == ["x tree/tau: 5.0 -> 4.9", "x/tau: 3.0 -> 3.2"]


def test_replay_equals_speculative_decoding(run_dir):
    """evaluate.simulate_rounds, replayed from one teacher-forced pass, gives exactly the rounds and routine tokens of
    real speculative decoding, for every draft, scene and draft length (fp32)."""
    tok = driving.Tokenizer()
    target = checkpoint.load(run_dir / "target").eval()
    drafts = {(k, s): checkpoint.load(checkpoint.draft_dir(str(run_dir), k, s), target=target).eval()
              for k in ("mrope", "flat", "aarl") for s in (0, 1)}
    data = driving.Data("test", 6, 0, tok, views=VIEWS)
    outputs = evaluate.greedy_outputs(target, data)
    matches = evaluate.draft_matches(drafts, target, data, outputs)
    prompts = evaluate.scene_prompts(data.scenes, tok, "cpu", views=VIEWS)
    assert any(any(m) for ms in matches.values() for m in ms) and not all(all(m) for ms in matches.values() for m in ms)
    for key, draft in drafts.items():
        for gamma in (1, 2, 4, 6):
            for prompt, out, match in zip(prompts, outputs, matches[key]):
                res = speculate.speculative(target, draft, prompt, gamma, evaluate.MAX_NEW_TOKENS,
                                            stop_token=tok.cot_end_id)
                assert res.tokens == out
                assert evaluate.simulate_rounds(match, gamma) == (res.rounds, sum(res.from_draft)), (key, gamma)


def test_aarl_cli_reports_before_after_and_its_updates(run_dir, tmp_path, capsys):
    """aarl.py end to end on the tiny run: the before / after report of both splits at one gamma, greedy outputs
    identical, and the statistics of its updates (first / last means)."""
    out = tmp_path / "draft_aarl_moving_s0"
    aarl.main(["--run", str(run_dir), "--reference", "moving", "--refresh", "10", "--steps", "3", "--scenes", "2",
               "--group", "2", "--max-new", "8", "--n-train", "16", "--views", str(VIEWS), "--n-report", "4",
               "--out", str(out), "--json"])
    res = last_json(capsys)
    for split in ("val", "test"):
        before, after = res["before"][split], res["after"][split]
        assert after["gamma"] == before["gamma"] == res["before"]["val"]["gamma"]
        assert after["greedy_match"] is True and before["kl_to_sft"] == pytest.approx(0, abs=1e-6)
    assert res["training"]["updates"] == 3
    assert set(res["training"]["first"]) == {"reward", "ade", "agree", "kl", "reward_std_in_group"}
    assert os.path.isdir(out)


def test_bench_toy_json(run_dir, capsys):
    common = ("device", "dtype", "decoder", "tau", "alpha", "routine_fraction", "arms", "speedup", "greedy_match",
              "t_target_1", "t_draft_1")
    bench.main(["--run", str(run_dir), "--prompts", "3", "--dtype", "fp32", "--views", str(VIEWS), "--tree", "0",
                "--json"])
    out = last_json(capsys)
    for key in common + ("gamma", "t_target_gamma1", "leviathan_speedup"):
        assert key in out, key
    assert out["decoder"] == {"kind": "chain", "gamma": evaluate.GAMMA} and out["greedy_match"] is True
    # the default, last: its report is the one the real-shape test below reads back. No decoder named: the chooser's
    # best-predicted decoder, its runner-up beside it in the same passes
    res = bench.main(["--run", str(run_dir), "--prompts", "3", "--dtype", "fp32", "--views", str(VIEWS), "--json"])
    out = last_json(capsys)
    for key in common:
        assert key in out, key
    # the arms record: target-only, the chosen decoder, its runner-up, each with its decoder, tau and greedy identity
    ch, arms = out["choice"], out["arms"]
    assert ch["mode"] == "eager" and set(ch["measured"]) >= {evaluate.TARGET_ONLY} and len(ch["predicted"]) == 14
    assert list(arms) == [evaluate.TARGET_ONLY, "speculative", timing.CHAIN_ARM] and arms[evaluate.TARGET_ONLY] | {
        "decoder": None, "tau": 1.0, "greedy_match": True} == arms[evaluate.TARGET_ONLY]
    assert arms["speculative"]["decoder"] == out["decoder"] != arms[timing.CHAIN_ARM]["decoder"]
    assert all(a["greedy_match"] is True and a["tau"] >= 1 and a["ms_per_token"] > 0 for a in arms.values())
    assert out["greedy_match"] is True and out["dtype"] == "fp32" and out["cpu_capability"]
    assert out["speedup"] == arms["speculative"]["speedup"] and arms["speculative"]["tau"] == out["tau"]
    assert os.path.exists(bench.TOY_JSON) and res["tau"] >= 1


def test_bench_stream_times_four_arms_on_clips(run_dir, capsys):
    """--stream: held-out clips, target-only / the tree / the stream / both timed in the same passes, every frame's
    greedy plan the target's; the report prints first, then the JSON."""
    bench.main(["--run", str(run_dir), "--stream", "3", "--prompts", "2", "--dtype", "fp32", "--views", str(VIEWS),
                "--max-new", "8", "--tree", "4/2/3", "--json"])
    out = last_json(capsys)
    st = out["stream"]
    assert out["mode"] == "stream" and out["greedy_match"] is True and set(st["arms"]) == set(stream.ARMS)
    assert st["clips"] == 2 and st["frames"] == 3 and st["event_rate"] == pytest.approx(driving.event_rate(0.5))
    for arm, a in st["arms"].items():
        assert a["frames_differing"] == 0 and a["ms_per_token"] > 0 and a["tau"] >= 1, arm
        assert a["speedup_range"][0] - 1e-9 <= a["speedup"] <= a["speedup_range"][1] + 1e-9, arm  # a mediant
    assert st["arms"]["target-only"]["tau"] == 1.0 and out["what_ran"]["flags"]["stream"] == 3
    # issue #60: a sampled plan of 3 rows a frame, the stream's trie from the frames before and the siblings
    # no --tree: the tree is the chooser's for one frame's plan of 3 sampled rows on this machine (a chain as the tree
    # of width 1), and the report says what it predicted and what the tree arm measured
    bench.main(["--run", str(run_dir), "--stream", "3", "--prompts", "2", "--dtype", "fp32", "--views", str(VIEWS),
                "--max-new", "8", "--samples", "3", "--temperature", "0.6", "--top-p", "0.98", "--json"])
    printed = capsys.readouterr()
    out = json.loads(printed.out.strip().splitlines()[-1])
    st, ch, d = out["stream"], out["choice"], out["decoder"]
    name = f"tree {d['nodes']}/{d['depth']}/{d['width']}"
    assert ch["rows"] == 3 and (ch["chosen"] == name or ch["chosen"] == f"chain {d['depth']}" and d["width"] == 1)
    assert ch["measured"][name] == st["arms"]["tree"]["speedup"] and "chosen " in printed.err  # --json: the report
    assert out["greedy_match"] is None and not out["lossy"] and out["decoding"]["mode"] == "sampling"
    assert st["samples"] == 3 and st["siblings"] == 3 and st["frames_back"] == stream.K_FRAMES
    for arm, a in st["arms"].items():
        assert a["frames_differing"] is None and a["ms_per_plan"] > 0 and a["tau"] >= 1, arm


def test_bench_stream_compiled(run_dir, capsys, eager_dynamo):
    """--stream --compile (dynamo's graphs, its eager backend): the four arms on compiled steps, the stream's widths
    padded, every frame's greedy plan the target's."""
    bench.main(["--run", str(run_dir), "--stream", "3", "--prompts", "1", "--dtype", "fp32", "--views", str(VIEWS),
                "--max-new", "8", "--tree", "4/2/3", "--compile", "--json"])
    out = last_json(capsys)
    assert out["stream"]["compiled"] is True and out["greedy_match"] is True
    assert all(a["frames_differing"] == 0 for a in out["stream"]["arms"].values())


@pytest.mark.slow
def test_bench_toy_compiled(run_dir, capsys):
    """--compile: the compiled arms (target-only, the decoder chosen from the compiled steps' profile, its runner-up) are timed
    beside the eager ones, emit the target's greedy tokens (fp32), and report their own cost model and compile time."""
    bench.main(["--run", str(run_dir), "--prompts", "2", "--dtype", "fp32", "--views", str(VIEWS), "--compile",
                "--json"])
    text = "".join(capsys.readouterr()[::-1])  # stderr (--json: the report), stdout
    c = json.loads(text.strip().splitlines()[-1])["compiled"]
    assert c["greedy_match"] is True and c["divergences"] == {arm: [] for arm in (*timing.COMPILED,
                                                                                  timing.COMPILED_CHAIN)}
    for key in ("t_target_1", "t_target_verify", "t_draft_1", "t_draft_level", "compile_s", "speedup_vs_eager"):
        assert c[key] > 0, key
    out = json.loads(text.strip().splitlines()[-1])
    ch, arms = out["choice"], out["arms"]
    assert ch["mode"] == "compiled" and arms[timing.COMPILED_CHAIN]["ms_per_token"] > 0
    assert c["speedup"] == arms[timing.COMPILED[1]]["speedup"] and arms[timing.COMPILED[0]]["speedup"] == 1.0
    assert all(f"{arm:<22}" in text for arm in arms) and "compiled       " in text


@pytest.mark.slow
def test_rsd_compiled(run_dir, capsys):
    """rsd.py --compile times its arms with the compiled steps and keeps every exactness check."""
    rsd.main(["--run", str(run_dir), "--seeds", "0", "--views", str(VIEWS), "--scenes", "2", "--time-scenes", "1",
              "--repeats", "1", "--show", "0", "--compile", "--json"])
    out = last_json(capsys)
    assert out["compiled"] is True and out["greedy_match"] is True
    assert all(r["ms_per_token"] > 0 for r in out["rows"])


@pytest.mark.slow  # 110 s of the suite's ~8 min: building the 7B shape's random weights on a CPU
def test_bench_real_shape_preset(run_dir, capsys):
    """A real shape shrunk to 1 layer and 1 image (random weights), its draft's head over 4096 ids, with a small tree
    (the 152k-id head over 33 rows is slow on a CPU), runs and says acceptance is meaningless (the speed-up at the
    toy's acceptance: experiments/gpu_check.py). One preset run only: building the 7B shape's random vision tower and
    running it take about 70 s here."""
    bench.main(["preset", "qwen2.5-vl-7b", "--layers", "1", "--images", "1", "--max-new", "3", "--repeats", "3",
                "--gamma", "2",  # the chain arm timed beside the tree: every round verifies gamma + 1 at the 152k head
                "--draft-vocab", "4096", "--run", str(run_dir), "--json", "--tree", "4/2/2"])
    text = "".join(capsys.readouterr()[::-1])  # stderr (--json: the report), stdout
    out = json.loads(text.strip().splitlines()[-1])
    assert "not meaningful" in text
    assert out["prompt_tokens"] > 180 and out["model"] == "qwen2.5-vl-7b (1 layers), draft head over 4096 ids"
    assert out["environment"]["torch"] == torch.__version__


def test_bench_sampling_reports_the_sampled_runs_beside_greedy(run_dir, capsys):
    """--temperature: the JSON names the mode; the sampled tau is that of real speculative decoding with prompt i's
    generator seeded --sampling-seed + i (the timed runs'); greedy's statistics and exactness stay beside it."""
    bench.main(["--run", str(run_dir), "--prompts", "3", "--dtype", "fp32", "--views", str(VIEWS), "--temperature",
                "0.8", "--top-p", "0.95", "--sampling-seed", "7", "--json"])
    text = "".join(capsys.readouterr()[::-1])  # stderr (--json: the report), stdout
    out = json.loads(text.strip().splitlines()[-1])
    assert out["decoding"] == {"mode": "sampling", "temperature": 0.8, "top_k": None, "top_p": 0.95, "seed": 7,
                               "lossy": False, "verification": "exact"}
    assert out["greedy_match"] is True and out["divergences"] == []
    tok = driving.Tokenizer()
    target = checkpoint.load(run_dir / "target").eval()
    draft = checkpoint.load(out["draft"], target=target).eval()
    prompts = evaluate.scene_prompts(driving.make_split("test", 3, seed=0), tok, "cpu", torch.float32, VIEWS)
    d = out["decoder"]  # the chooser's: a chain or a tree
    decoder = speculate.Chain(d["gamma"]) if d["kind"] == "chain" else TreeShape(d["nodes"], d["depth"], d["width"])
    res = [speculate.speculative(target, draft, p, decoder, evaluate.MAX_NEW_TOKENS,
                            speculate.Sampling(0.8, top_p=0.95, seed=7 + i), stop_token=tok.cot_end_id) for i, p in enumerate(prompts)]
    n = sum(len(r.tokens) for r in res)
    assert out["sampled"]["tokens"] == n and out["sampled"]["tau"] == pytest.approx(n / sum(r.rounds for r in res))
    assert 0 <= out["sampled"]["alpha"] <= 1
    assert "sampled        tau" in text and "greedy         tau" in text and "not compared" in text
    assert "identical to target-only on all 3 prompts" in text


def test_rsd_sampling_gives_each_row_a_sampled_tau(run_dir, capsys):
    rsd.main(["--run", str(run_dir), "--seeds", "0", "--views", str(VIEWS), "--scenes", "3", "--time-scenes", "1",
              "--repeats", "1", "--show", "1", "--temperature", "1.0", "--top-k", "20", "--sampling-seed", "3",
              "--stream", "1", "--stream-frames", "2", "--stream-samples", "2", "--json"])
    text = "".join(capsys.readouterr()[::-1])  # stderr (--json: the report), stdout
    out = json.loads(text.strip().splitlines()[-1])
    assert out["decoding"] == {"mode": "sampling", "temperature": 1.0, "top_k": 20, "top_p": None, "seed": 3,
                               "lossy": False, "verification": "exact"}
    assert out["greedy_match"] is True  # the greedy checks still run, greedy
    rows = {r["name"]: r for r in out["rows"]}
    assert rows["target-only"]["sampled_tau"] == 1.0
    tok = driving.Tokenizer()
    test = driving.Data("test", 3, 0, tok, views=VIEWS)
    prompts = evaluate.scene_prompts(test.scenes, tok, "cpu", views=test.views_at(0))
    target = checkpoint.load(run_dir / "target").eval()
    draft = checkpoint.load(checkpoint.draft_dir(str(run_dir), "aarl", 0), target=target).eval()
    row = rows["flatrope+aarl"]
    res = [speculate.speculative(target, draft, p, row["gamma"], evaluate.MAX_NEW_TOKENS,
                                 speculate.Sampling(1.0, top_k=20, seed=3 + i), stop_token=tok.cot_end_id) for i, p in enumerate(prompts)]
    assert row["sampled_tau"] == pytest.approx(sum(len(r.tokens) for r in res) / sum(r.rounds for r in res))
    assert all(0 <= r["sampled_alpha"] <= 1 for r in out["rows"][1:])
    # issue #60: the stream section samples each frame's plan of 2 rows, drafted from the frame before and siblings
    assert out["stream_settings"]["samples"] == 2 and out["stream_settings"]["siblings"] == 2
    assert list(out["stream"]) == [r["name"] for r in out["rows"][1:]]
    for arms in out["stream"].values():
        assert all(a["frames_differing"] is None and a["ms_per_plan"] > 0 and a["tau"] >= 1 for a in arms.values())
    assert "tau sampled" in text and "prompt i's generator seeded 3 + i" in text
    shown = [line for line in text.splitlines() if line.startswith("  target-only:")]
    assert shown and not any("identical" in line for line in shown)  # sampled outputs are not compared token by token


def test_rsd_rejects_bad_seeds_and_missing_checkpoints(tmp_path, capsys):
    for seeds in ("4,x", "-1", ""):
        with pytest.raises(SystemExit):
            rsd.main(["--seeds", seeds])
    with pytest.raises(SystemExit):
        rsd.main(["--top-p", "0.9"])
    assert "give a temperature > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rsd.main(["--run", str(tmp_path / "nothing")])
    assert "--retrain" in capsys.readouterr().err


def test_bench_without_toy_checkpoints_says_what_to_run(tmp_path, capsys):
    """bench.py does not train: without checkpoints it stops and names the command that writes them."""
    with pytest.raises(SystemExit):
        bench.main(["--run", str(tmp_path / "nothing")])
    assert "python rsd.py --retrain" in capsys.readouterr().err


def test_bench_rejects_bad_arguments(capsys):
    for argv, msg in ((["--gamma", "0"], "--gamma"), (["--repeats", "2"], "--repeats"),
                      (["preset", "qwen2.5-vl-7b", "--target", "x"], "--target is a flag of `bench.py real`"),
                      (["preset", "qwen2.5-vl-7b", "--layers", "-1"], "argument --layers: must be >= 1, got -1"),
                      (["preset", "qwen2.5-vl-7b", "--layers", "0"], "got 0"),  # was: all 28 layers, 8.3B weights
                      (["preset", "qwen2.5-vl-7b", "--layers", "29"], "got 29"),
                      (["--layers", "2"], "--layers is a flag of `bench.py preset`"),
                      (["--draft-vocab", "8"], "--draft-vocab is a flag of `bench.py preset`"),
                      (["preset", "qwen2.5-vl-7b", "--draft-vocab", "-1"], "(qwen2.5-vl-7b: 1..152064), got -1"),
                      (["--device", "tpu"], "unknown device 'tpu'"),
                      (["--temperature", "-1"], "temperature must be finite and >= 0"),
                      (["--temperature", "1", "--top-p", "0"], "top_p must be None or in (0, 1]"),
                      (["--top-k", "5"], "give a temperature > 0"),
                      (["--tree", "-1"], "--tree takes N/D/k"),
                      (["--tree", "5/8/3"], "needs at least 8 nodes"),
                      (["--tree", "64/2/2"], "has 6 candidates")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert msg in capsys.readouterr().err


def test_bench_checks_its_output_first_and_prints_before_writing(run_dir, tmp_path, monkeypatch, capsys):
    """An unwritable report folder stops bench.py before the benchmark; a write that fails anyway comes after the
    report is printed, so no measurement is lost."""
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(bench, "TOY_JSON", str(tmp_path / "file" / "bench_toy.json"))
    with pytest.raises(SystemExit):
        bench.main(["--run", str(run_dir)])
    assert "file: output folder is not writable" in capsys.readouterr().err
    monkeypatch.setattr(bench, "TOY_JSON", str(tmp_path / "bench_toy.json"))

    def read_only(path, obj):
        raise PermissionError(f"{path}: read-only file system")
    monkeypatch.setattr(bench.files, "write_json", read_only)
    with pytest.raises(SystemExit):  # one line naming the file, after the report
        bench.main(["--run", str(run_dir), "--prompts", "1", "--max-new", "4", "--gamma", "2", "--tree", "0",
                    "--dtype", "fp32", "--views", str(VIEWS)])
    captured = capsys.readouterr()
    assert "reasoning step (decode, prefill apart" in captured.out and "speculative           chain 2" in captured.out
    assert "bench_toy.json: read-only file system" in captured.err and "Traceback" not in captured.err


def test_rsd_refuses_a_stale_draft_and_a_bad_device(run_dir, tmp_path, capsys):
    """A run folder whose target was replaced after its drafts were distilled: rsd.py names the stale draft before
    any work, instead of reporting tau and accuracy of a mismatched pair."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    target = checkpoint.load(run / "target")
    with torch.no_grad():
        target.norm.weight.mul_(1.01)  # "retrained"
    checkpoint.save(target, run / "target")
    with pytest.raises(SystemExit):
        rsd.main(["--run", str(run), "--seeds", "0,1", "--views", str(VIEWS)])
    err = capsys.readouterr().err
    assert "draft_mrope_s0: stale draft: it was distilled from another target (its weights" in err
    with pytest.raises(SystemExit):
        rsd.main(["--run", str(run), "--device", "tpu"])
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_fork_a_draft_variant(run_dir, tmp_path, capsys):
    """The README's "Fork it": a 2-layer FlatRoPE draft distilled from a given target folder (not copied), one kind,
    two seeds in one call; each seed's validation KL and tau recorded at every evaluation beside its checkpoint and the
    target's metrics untouched; then timed by bench.py --draft, its chain arm at --gamma, its JSON at --out."""
    out = tmp_path / "fork"
    T.main(["--stage", "drafts", "--target-dir", str(run_dir / "target"), "--out", str(out), "--kinds", "flat",
            "--draft-layers", "2", "--draft-seeds", "0,1", "--draft-preset", "test-tiny-draft", "--n-train", "64",
            "--n-val", "8", "--batch-size", "4", "--draft-steps", "4", "--eval-every", "2", "--warmup", "1",
            "--views", str(VIEWS), "--max-views", str(VIEWS), "--no-amp"])
    assert sorted(os.listdir(out)) == ["draft_flat_s0", "draft_flat_s0.metrics.json", "draft_flat_s1",
                                       "draft_flat_s1.metrics.json", "drafts_s0.state.pt", "drafts_s1.state.pt"]
    target = checkpoint.load(run_dir / "target")
    for seed in (0, 1):
        draft = checkpoint.load(out / f"draft_flat_s{seed}", target=target)
        assert draft.cfg.n_layers == 2 and draft.cfg.rope_mode == "flat"
        rec = files.read_json(out / f"draft_flat_s{seed}.metrics.json")
        assert [e["step"] for e in rec["evaluations"]] == [2, 4] and rec["draft_seed"] == seed
        for e in rec["evaluations"]:
            assert e["val_kl"] > 0 and set(e["val_tau"]) == {str(g) for g in evaluate.GAMMAS}
            assert all(1 <= t <= g + 1 for g, t in ((int(g), t) for g, t in e["val_tau"].items()))
    res = bench.main(["--run", str(run_dir), "--draft", str(out / "draft_flat_s1"), "--prompts", "2", "--dtype",
                      "fp32", "--views", str(VIEWS), "--gamma", "3", "--out", str(tmp_path / "b.json")])
    assert res["draft"] == str(out / "draft_flat_s1") and res["decoder"] == {"kind": "chain", "gamma": 3} and \
        res["greedy_match"]
    assert files.read_json(tmp_path / "b.json")["tau"] == res["tau"]
    capsys.readouterr()
    # scored beside the shipped-style FlatRoPE row by rsd.py --drafts: that row's figures equal the default table's
    flags = ["--run", str(run_dir), "--views", str(VIEWS), "--scenes", "4", "--time-scenes", "2", "--show", "0",
             "--tree", "0", "--json"]
    rsd.main(flags + ["--seeds", "0,1"])
    default = {r["name"]: r for r in last_json(capsys)["rows"]}
    rsd.main(flags + ["--drafts", *(f"flatrope={run_dir / f'draft_flat_s{s}'}" for s in (0, 1)),
                      *(f"two-layer={out / f'draft_flat_s{s}'}" for s in (0, 1))])
    got = last_json(capsys)
    rows = {r["name"]: r for r in got["rows"]}
    assert list(rows) == [TARGET_ONLY, "flatrope", "two-layer"] and got["greedy_match"] is True
    for k in ("tau_by_gamma", "commit_acc", "attn_history", "attn_image", "attn_text"):
        assert rows["flatrope"][k] == default["flatrope"][k], k
    assert got["drafts"]["two-layer"] == [str(out / f"draft_flat_s{s}") for s in (0, 1)]


def test_rsd_drafts_at_given_decoders_skip_the_search(run_dir, monkeypatch, capsys):
    """rsd.py --drafts with --gamma and / or --tree N/D/k (issue #42): nothing is searched on val (no step time
    measured, no tree decoded there, no record read); only the decoders given are decoded and timed, the chain rows'
    tau the replay's at the given gamma, greedy outputs still the target's."""
    def searched(*args, **kwargs):
        raise AssertionError("searched on val")

    for name in ("search", "recorded_search"):
        monkeypatch.setattr(rsd, name, searched)
    monkeypatch.setattr(rsd.chooser, "profile", searched)
    flags = ["--run", str(run_dir), "--views", str(VIEWS), "--scenes", "3", "--time-scenes", "1", "--show", "0",
             "--json", "--drafts", *(f"one={run_dir / f'draft_flat_s{s}'}" for s in (0, 1)),
             f"two={run_dir / 'draft_aarl_s0'}"]
    for given, want in ((["--gamma", "3"], [3, 3]), (["--tree", "16/6/3"], [evaluate.GAMMA] * 2 + [[16, 6, 3]] * 2),
                        (["--gamma", "4", "--tree", "16/8/3"], [4, 4, [16, 8, 3], [16, 8, 3]])):
        rsd.main(flags + given)
        text = "".join(capsys.readouterr()[::-1])  # stderr (--json: the report), stdout
        got = json.loads(text.strip().splitlines()[-1])
        assert [r["name"] for r in got["rows"]] == [TARGET_ONLY, "one", "two"] + ["one tree", "two tree"][:len(want) - 2]
        assert [r["gamma"] or r["tree"] for r in got["rows"][1:]] == want and got["greedy_match"] is True
        assert got["what_ran"]["ignored"] == ["seeds"] and got["what_ran"]["rows"][1]["drafts"] == [
            str(run_dir / f"draft_flat_s{s}") for s in (0, 1)]
        for r in got["rows"][1:3]:
            assert r["tau"] == pytest.approx(r["tau_by_gamma"][str(r["gamma"])])
        assert "as given, no search on val" in text and "step times" not in text
    with pytest.raises(SystemExit):
        rsd.main(flags + ["--gamma", "3", "--tree", "16"])  # a node budget asks for the search --gamma skips
    assert "--tree N/D/k give the decoders" in capsys.readouterr().err


def test_rsd_relaxed_section_is_lossy_and_priced(run_dir, capsys):
    """rsd.py --relaxed: the paper's table stays lossless (greedy_match), a LOSSY section gives each row's relaxed tau
    beside its exact one and the plan's price; at bound 1 every draft is accepted (tau up, CoCs changed)."""
    rsd.main(["--run", str(run_dir), "--seeds", "0", "--views", str(VIEWS), "--scenes", "3", "--time-scenes", "1",
              "--show", "0", "--gamma", "3", "--tree", "0", "--relaxed", "typical:1", "--json"])
    captured = capsys.readouterr()
    out, text = json.loads(captured.out), captured.err  # --json: stdout is the one JSON line, the report on stderr
    assert captured.out.count("\n") == 1 and "] the table: every row's real decoding" in text  # progress too
    ran = out["what_ran"]
    assert {"dtype", "scenes", "views", "tree", "gamma", "run", "repeats", "relaxed"} <= set(ran["flags"])
    assert ran["torch"] == torch.__version__ and ran["wall_s"] > 0 and ran["device"] == "cpu"
    assert "LOSSY: relaxed acceptance, rule typical, bound 1" in text
    # issue #59: the top level is the whole run's; the lossless table's own identity sits under its own key
    assert out["lossy"] and out["greedy_match"] is False and out["exact_greedy_match"] is True
    assert out["decoding"]["lossy"] and set(out["relaxed"]) == {"replica", "flatrope", "flatrope+aarl", "history-only"}
    for r in out["relaxed"].values():
        assert r["tau"] > r["tau_exact"] and r["cocs_changed"] > 0 and r["plan_moved_m"] >= 0
        assert r["lossy"] and r["identical_to_lossless"] is False
    # issue #59: what_ran names what each row ran (the given --gamma 3 here), and the folders it loaded
    rows = {r["name"]: r for r in ran["rows"]}
    assert rows["target-only"]["decoder"] == "target-only" and rows["flatrope"]["decoder"] == "chain 3"
    assert rows["flatrope"]["drafts"] == [str(run_dir / "draft_flat_s0")] and ran["ignored"] == []
