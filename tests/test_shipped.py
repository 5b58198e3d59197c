"""The shipped toy checkpoints (checkpoints/toy) still compute what was recorded when they shipped: the target's
greedy CoC exact match and commitment accuracy, and every draft's exact greedy tau, on a small validation sample.
A code change that silently changes the model, the world, the prompt or the replay of speculative decoding fails here.

run: python -m pytest -q tests/test_shipped.py
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import ship_toy  # noqa: E402

from ops import compiled, files  # noqa: E402

SHIPPED = os.path.join(ROOT, "checkpoints", "toy")


@pytest.mark.usefixtures("one_thread")
def test_shipped_checkpoints_reproduce_their_recorded_check():
    recorded = files.read_json(os.path.join(SHIPPED, "metrics.json"))["check"]
    seeds = sorted({int(name.rsplit("_s", 1)[1]) for name in recorded["tau"]})
    now = ship_toy.check_metrics(SHIPPED, seeds)
    assert now["coc_exact"] == recorded["coc_exact"] and now["commitment_acc"] == recorded["commitment_acc"]
    assert now["tau"] == pytest.approx(recorded["tau"], abs=1e-12)
    assert recorded["coc_exact"] >= 0.9 and recorded["commitment_acc"] >= 0.95     # a trained target, not a stub


def test_every_kind_of_draft_is_shipped():
    assert sorted(d for d in os.listdir(SHIPPED) if d.startswith("draft_")) == sorted(
        f"draft_{k}_s{s}" for k in ship_toy.KINDS for s in range(3))


@pytest.mark.usefixtures("one_thread", "eager_dynamo")
@pytest.mark.parametrize("kind", ship_toy.KINDS)
def test_every_shipped_draft_decodes_the_targets_greedy_tokens_on_every_path(kind):
    """Each shipped draft of the kind (every seed), fp32, on held-out scenes: the eager chain and tree, and the
    compiled path's chain and tree (compiled.CompiledSteps through dynamo's graphs, run by its eager backend: the real
    tracing, fused tree growth and verify, padding and persistent caches at test speed), emit target-only greedy
    decoding's tokens, with the stop token and with max-new cutting inside an accepted path. (Inductor's own kernels:
    tests/test_speculate.py's slow tests.)"""
    from measure import timing
    import driving
    import evaluate
    from ops import checkpoint
    import speculate
    import tree
    target = checkpoint.load(os.path.join(SHIPPED, "target")).eval()
    tok = driving.Tokenizer()
    prompts = evaluate.scene_prompts(driving.make_split("test", 2, seed=0), tok, "cpu", views=2)
    stop, shape, gamma = tok.cot_end_id, tree.TreeShape(16, 6, 3), 6
    refs = {n: [speculate.autoregressive(target, p, n, stop_token=stop).tokens for p in prompts] for n in (7, 32)}
    assert any(len(r) < 32 for r in refs[32]) and all(len(r) == 7 for r in refs[7])  # a stop, and cuts at 7
    for name in (f"draft_{kind}_s{s}" for s in range(3)):
        draft = checkpoint.load(os.path.join(SHIPPED, name), target=target).eval()
        pairs = {"eager": (target, draft), "compiled": timing.compiled_pair(target, draft, prompts, [shape, gamma], 32)}
        for path, (t, d) in pairs.items():
            for n, ref in refs.items():
                for p, want in zip(prompts, ref):
                    assert speculate.speculative(t, d, p, gamma, n, stop_token=stop).tokens == want, (name, path, n)
                    assert speculate.speculative(t, d, p, shape, n, stop_token=stop).tokens == want, (name, path, n)
    assert isinstance(pairs["compiled"][0], compiled.CompiledSteps)


def test_the_shipped_val_rounds_answer_bench_pys_default_run(tmp_path, monkeypatch):
    """checkpoints/toy/choose holds the val rounds of `python bench.py --device cpu` (one row, greedy, fp32): their key
    is what that run computes from the shipped models and its val prompts, so a fresh clone reads them instead of
    decoding 64 val plans x 13 candidates for minutes; new weights change the key and fail here."""
    import importlib.util

    import torch

    import bench
    import driving
    import evaluate
    from measure import choose
    from ops import checkpoint
    spec = importlib.util.spec_from_file_location("choose_defaults", choose.__file__)  # its constants, not conftest's
    defaults = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(defaults)
    target = checkpoint.load(os.path.join(SHIPPED, "target"), dtype=torch.float32).eval()
    draft = checkpoint.load(checkpoint.draft_dir(SHIPPED, *bench.TOY_DRAFT), target=target).eval()
    tok = driving.Tokenizer()
    val = evaluate.scene_prompts(driving.make_split("val", defaults.val_prompts(), seed=0), tok, "cpu", torch.float32)
    key = choose.acceptance_key(target, draft, val, evaluate.MAX_NEW_TOKENS, tok.cot_end_id)
    monkeypatch.setattr(choose, "CACHE", str(tmp_path))  # no run cache: only the shipped record can answer
    monkeypatch.setattr(choose, "SHIPPED", defaults.SHIPPED)
    value, how = choose.cached("acceptance", key, lambda: pytest.fail("the shipped record did not answer the key"))
    assert how.startswith(f"reused {defaults.SHIPPED}") and len(val) == 64
    assert value["target-only"]["rounds"] == value["target-only"]["tokens"] == value["tree 16/6/3"]["tokens"]
