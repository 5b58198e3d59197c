"""experiments/gpu_check.py's staging, without a GPU and without its real-shape models: every stage's JSON is
written the moment the stage ends, so a run killed in a later stage keeps the earlier ones; a failing stage records
its traceback and the next one runs; the full-depth stage runs only if stage d's compile times fit the budget.
(The real stages on a CPU: python experiments/gpu_check.py --device cpu --layers 1 --out DIR, about 3 minutes.)

run: python -m pytest -q tests/test_gpu_check.py
"""
import importlib.util
import json
import os
import re

import pytest

spec = importlib.util.spec_from_file_location(
    "gpu_check", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                              "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def test_each_stage_is_on_disk_when_it_ends_and_a_kill_keeps_them(tmp_path, monkeypatch):
    out = tmp_path / "check"
    seen = {}

    def tests_stage(run):
        raise RuntimeError("a CUDA test failed")

    def eager_stage(run):
        seen["on disk during c"] = sorted(os.listdir(out))
        raise KeyboardInterrupt  # the run is killed here

    monkeypatch.setattr(gpu_check, "env_stage", lambda run: {"environment": {"torch": "x"}})
    monkeypatch.setattr(gpu_check, "tests_stage", tests_stage)
    monkeypatch.setattr(gpu_check, "eager_stage", eager_stage)
    with pytest.raises(SystemExit) as e:  # a Ctrl-C: one line, exit status 130 (issue #52)
        gpu_check.main(["--device", "cpu", "--out", str(out)])
    assert e.value.code == 130
    assert seen["on disk during c"] == ["a_env.json", "b_cuda_tests.json"]
    assert sorted(os.listdir(out)) == ["a_env.json", "b_cuda_tests.json"]  # no half-written c, no temporary file
    a = json.loads((out / "a_env.json").read_text())
    b = json.loads((out / "b_cuda_tests.json").read_text())
    assert a["status"] == "ok" and a["environment"] == {"torch": "x"} and a["wall_s"] >= 0
    assert b["status"] == "error" and "a CUDA test failed" in b["error"]


class FakeRun:
    def __init__(self, left, depth=36):
        self._left, self._depth = left, depth

    def left(self):
        return self._left

    def depth(self):
        return self._depth


def test_the_full_depth_runs_only_within_the_budget(monkeypatch):
    d = {"depths": {1: {"compile_s_total": 40.0}, 2: {"compile_s_total": 50.0}}, "compile_s_per_layer": 10.0}
    skipped = gpu_check.full_stage(FakeRun(left=300.0), d)  # 50 + 10 * 34 + 30 = 420 s > 300 s
    assert skipped["skipped"] and skipped["estimate_s"] == pytest.approx(420.0) and "300 s" in skipped["why"]
    monkeypatch.setattr(gpu_check, "compiled_costs", lambda run, layers: {"layers": layers})
    ran = gpu_check.full_stage(FakeRun(left=500.0), d)
    assert ran == {"skipped": False, "estimate_s": pytest.approx(420.0), "layers": 36}
    same = gpu_check.full_stage(FakeRun(left=500.0, depth=2), d)
    assert same["skipped"] and same["same_as"] == d["depths"][2]
    assert gpu_check.full_stage(FakeRun(left=500.0), {"status": "error"})["skipped"]


def test_flags(capsys):
    assert gpu_check.parse_steps("1-4,8") == [1, 2, 3, 4, 8]
    with pytest.raises(ValueError, match="--steps"):
        gpu_check.parse_steps("0-3")
    for argv, msg in ((["--device", "cpu", "--out", "x", "--steps", "1-4"], "gamma \\+ 1 = 7"),
                      (["--device", "cpu", "--out", "x", "--stages", "a_env,z"], "--stages takes"),
                      (["--device", "cpu", "--out", "x", "--toy-json", "nowhere.json"], "--toy-json nowhere.json")):
        with pytest.raises(SystemExit):
            gpu_check.main(argv)
        assert len(re.findall(msg, capsys.readouterr().err)) == 1, msg


# ---- the toy acceptance behind the real-shape predictions (moved from bench.py) ----
def test_the_prediction_reads_a_named_recorded_acceptance(tmp_path):
    toy = gpu_check.toy_acceptance(gpu_check.TOY_ACCEPTANCE)  # the committed default, found from any working directory
    assert toy["source"] == "experiments/bench_cpu.json" and 0 < toy["alpha"] < 1
    assert (toy["prompts"], toy["dtype"], toy["gamma"], toy["decoding"]["mode"]) == (32, "bf16", 6, "greedy")
    assert toy["draft"].endswith("draft_aarl_s0")
    report = {"mode": "toy", "alpha": 1.0, "draft": "checkpoints/toy/target"}
    (tmp_path / "self.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match="self.json: its draft checkpoints/toy/target is the target itself"):
        gpu_check.toy_acceptance(str(tmp_path / "self.json"))
    (tmp_path / "real.json").write_text(json.dumps({**report, "mode": "real", "draft": "x"}))
    with pytest.raises(ValueError, match="real.json: not a toy bench.py report"):
        gpu_check.toy_acceptance(str(tmp_path / "real.json"))
    with pytest.raises(ValueError, match="--toy-json nowhere.json: no such file"):
        gpu_check.toy_acceptance("nowhere.json")


def test_the_committed_tree_run_is_the_default_trees_acceptance():
    """The default tree's real-shape prediction reads experiments/bench_cpu_tree.json, a toy run of that tree; another
    tree is refused with the command that records one; the chain's reads experiments/bench_cpu.json's alpha."""
    t = gpu_check.timing.decoder_json(gpu_check.evaluate.TREE)
    rec = gpu_check.toy_acceptance(gpu_check.TOY_TREE_ACCEPTANCE, t)
    assert rec["decoder"] == t and rec["tau"] > 1 and rec["source"] == gpu_check.TOY_TREE_ACCEPTANCE
    with pytest.raises(ValueError, match="the same tree"):
        gpu_check.toy_acceptance(gpu_check.TOY_TREE_ACCEPTANCE, {"kind": "tree", "nodes": 4, "depth": 2, "width": 2})
    chain = gpu_check.toy_acceptance(gpu_check.TOY_ACCEPTANCE, {"kind": "chain", "gamma": 6})  # the chain's: its alpha
    assert chain["alpha"] == gpu_check.files.read_json(os.path.join(gpu_check.ROOT, gpu_check.TOY_ACCEPTANCE))["alpha"]
    assert chain["decoder"] == {"kind": "chain", "gamma": 6}
