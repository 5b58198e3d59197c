"""The shipped toy checkpoints (checkpoints/toy) still compute what was recorded when they shipped: the target's
greedy CoC exact match and commitment accuracy, and every draft's exact greedy tau, on a small validation sample.
A code change that silently changes the model, the world, the prompt or the replay of speculative decoding fails here.

run: python -m pytest -q tests/test_shipped.py
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import ship_toy  # noqa: E402

from ops import files  # noqa: E402

SHIPPED = os.path.join(ROOT, "checkpoints", "toy")


def test_shipped_checkpoints_reproduce_their_recorded_check():
    torch.set_num_threads(2)
    recorded = files.read_json(os.path.join(SHIPPED, "metrics.json"))["check"]
    seeds = sorted({int(name.rsplit("_s", 1)[1]) for name in recorded["tau"]})
    now = ship_toy.check_metrics(SHIPPED, seeds)
    assert now["coc_exact"] == recorded["coc_exact"] and now["commitment_acc"] == recorded["commitment_acc"]
    assert now["tau"] == pytest.approx(recorded["tau"], abs=1e-12)
    assert recorded["coc_exact"] >= 0.9 and recorded["commitment_acc"] >= 0.95     # a trained target, not a stub
