"""End-to-end tests of rsd.py and bench.py on tiny checkpoints: the JSON contracts, greedy
exactness of every arm (fp32), and the real-shape benchmark path with a shrunken preset.
Timing values are only checked to be present and positive: speed is bench.py's job.

run: python -m pytest -q tests/test_end_to_end.py
"""
import copy
import json
import os

import pytest
import torch

import aarl
import bench
import checkpoint
import driving
import model as M
import rsd
import train as T
from test_train import TINY, TINY_DRAFT, tiny_cfg


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Tiny target + both drafts (train.py) + a 2-step AARL draft, as rsd.ensure_checkpoints lays them out."""
    M.PRESETS["test-tiny"], M.DRAFT_PRESETS["test-tiny-draft"] = TINY, TINY_DRAFT
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run")
    T.run(tiny_cfg(out, target_steps=20, draft_steps=20, n_val=8, n_test=8), log=lambda *_: None)
    tok = driving.Tokenizer()
    target = checkpoint.load(out / "target").eval()
    sft = checkpoint.load(out / "draft_flat", target=target)
    aarl.train_aarl(target, copy.deepcopy(sft), driving.Data("train", 16, 0, tok),
                    aarl.AARLConfig(steps=2, scenes=2, group=2, max_new=8), out=str(out / "draft_aarl"), ref=sft)
    yield out
    del M.PRESETS["test-tiny"], M.DRAFT_PRESETS["test-tiny-draft"]


def last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_rsd_json_contract_and_exactness(run_dir, capsys):
    rsd.main(["--run", str(run_dir), "--scenes", "6", "--time-scenes", "2", "--show", "1", "--sweep", "2,6", "--json"])
    out = last_json(capsys)
    # the sweep at the table's gamma (6) on the same test scenes gives the table's tau; no draft beats the ceiling
    assert set(out["sweep"]) == {"val", "test"} and set(out["sweep"]["test"]) == {"2", "6"}
    for r in out["rows"][1:]:
        assert out["sweep"]["test"]["6"][r["name"]] == pytest.approx(r["tau"])
    for split in out["sweep"].values():
        for g in split.values():
            assert all(g[name] <= g["ceiling"] + 1e-9 for name in ("replica", "flatrope", "flatrope+aarl"))
    assert out["greedy_match"] is True
    assert set(out["target"]) == {"coc_exact", "commitment_acc", "ade"}
    assert [r["name"] for r in out["rows"]] == ["target-only", "replica", "flatrope", "flatrope+aarl"]
    for r in out["rows"]:
        assert set(r) == {"name", "tau", "routine_fraction", "commit_acc", "ms_per_token", "speedup", "ade",
                          "attn_history", "attn_image"}
        assert r["ms_per_token"] > 0 and 0 <= r["attn_history"] <= 1 and 0 <= r["attn_image"] <= 1
        assert 0 <= r["commit_acc"] <= 1 and r["tau"] <= out["tau_ceiling"] + 1e-9   # no draft beats a perfect one
        # greedy exactness: every arm plans from the same CoCs, so the same trajectories
        assert r["ade"] == pytest.approx(out["rows"][0]["ade"])
    assert out["rows"][0]["tau"] == 1.0 and out["rows"][0]["routine_fraction"] == 0.0


def test_bench_toy_json(run_dir, capsys):
    res = bench.main(["--run", str(run_dir), "--prompts", "3", "--dtype", "fp32", "--json"])
    out = last_json(capsys)
    for key in ("device", "dtype", "gamma", "tau", "alpha", "routine_fraction", "ar_ms_per_token",
                "spec_ms_per_token", "speedup", "greedy_match", "t_target_1", "t_target_gamma1", "t_draft_1"):
        assert key in out, key
    assert out["greedy_match"] is True and out["dtype"] == "fp32"
    assert out["speedup"] == pytest.approx(out["ar_ms_per_token"] / out["spec_ms_per_token"])
    assert os.path.exists(run_dir / "bench.json") and res["tau"] >= 1


def test_bench_real_shape_preset(run_dir, capsys):
    """A real shape shrunk to 1 layer and 1 image (random weights) runs, and says acceptance is meaningless."""
    bench.main(["--preset", "qwen2.5-vl-7b", "--layers", "1", "--images", "1", "--max-new", "3", "--repeats", "3",
                "--run", str(run_dir), "--json"])
    text = capsys.readouterr().out
    out = json.loads(text.strip().splitlines()[-1])
    assert "not meaningful" in text
    assert out["prompt_tokens"] > 180 and out["model"] == "qwen2.5-vl-7b (1 layers)"
    assert "predicted_speedup_at_toy_alpha" in out  # the toy's bench.json from the test above


def test_rsd_rejects_a_bad_sweep():
    for sweep in ("4,x", "0,6"):
        with pytest.raises(SystemExit):
            rsd.main(["--sweep", sweep])


def test_bench_without_toy_checkpoints_says_what_to_run(tmp_path, capsys):
    """bench.py does not train: without checkpoints it stops and names the command that writes them."""
    with pytest.raises(SystemExit):
        bench.main(["--run", str(tmp_path / "nothing")])
    assert "run `python rsd.py` first" in capsys.readouterr().err


def test_bench_rejects_bad_arguments():
    for argv in (["--gamma", "0"], ["--repeats", "2"], ["--preset", "qwen2.5-vl-7b", "--target", "x"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
