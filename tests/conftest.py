"""Shared pytest setup: offline Hugging Face hub, the repo importable, a one-thread fixture, torch.compile on
dynamo's eager backend, the chooser's cache in a folder of the session's (and its profile cut short), a run killed after its first save, the `slow` and `peer` markers.

Tests marked `@pytest.mark.slow` (torch.compile: minutes of compilation on a CPU; a real shape's random weights) are
skipped unless pytest gets --slow, so the default suite keeps its budget on 2 CPU cores.

run: python -m pytest -q -n 2 tests     (the slow ones too: python -m pytest -q -n 2 tests --slow)
"""
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The repo is a flat set of top-level modules; make them importable from tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True, scope="session")
def choose_cache(tmp_path_factory):
    """The chooser's profiles and val rounds (measure/choose.py) cached in a folder of the session's, not the checkout's
    runs/choose/: a test never reads what an earlier run of the programs measured."""
    from measure import choose
    # one round of one call per profiled forward and 4 val plans: the tests check the chooser's flow and records, not
    # its precision (tests/test_choose.py checks the choice on profiles it builds)
    fast = {"CACHE": str(tmp_path_factory.mktemp("choose")), "MIN_ROUNDS": 1, "TIMED_PASSES": 1, "TIMED_PASSES_ROWS": 1,
            "MAX_ROUNDS": 1, "REPS": 1, "VAL_PLANS": 4, "VAL_ROWS": 4}
    saved = {k: getattr(choose, k) for k in fast}
    for k, v in fast.items():
        setattr(choose, k, v)
    yield
    for k, v in saved.items():
        setattr(choose, k, v)


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test, restored after: thousands of tiny ops, where more threads only add
    spin-waits (badly so on a busy 2-core machine). Test files opt in with pytestmark."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def eager_dynamo(monkeypatch):
    """torch.compile through dynamo with the eager backend: dynamo's guards, graph breaks and recompilations are the
    real ones (they are dynamo's, not inductor's), at a few seconds instead of minutes of inductor on a CPU."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", fullgraph=kw["fullgraph"],
                                                                    dynamic=kw["dynamic"]))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Killed(Exception):
    """What a run 'killed' by the kill_after_save fixture raises."""


@pytest.fixture
def kill_after_save(monkeypatch):
    """A context: training runs inside it (train.py, real/distill.py, real/aarl_real.py) die right after their first
    resumable state is written (as a kill -9 then would leave them), raising Killed; outside it they save as usual."""
    import contextlib

    from ops import runs

    @contextlib.contextmanager
    def killed():
        save_state = runs.save_state

        def save_then_die(path, step, *args, **kwargs):
            save_state(path, step, *args, **kwargs)
            raise Killed

        monkeypatch.setattr(runs, "save_state", save_then_die)
        with pytest.raises(Killed):
            yield
        monkeypatch.setattr(runs, "save_state", save_state)
    return killed


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a full disk: a 64 KiB tmpfs mounted for the test where this runs as root and may mount, else None
    (the test then makes the write raise the library's own error instead)."""
    import subprocess
    d = tmp_path / "full"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)],
                                           capture_output=True).returncode:
        yield None
        return
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run tests marked slow (torch.compile, a real shape)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes on a CPU (torch.compile, a real shape); run with --slow")
    config.addinivalue_line("markers", "peer: runs transformers beside our decoding on the shipped toy (about 10 s; "
                                       "deselect with -m 'not peer')")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow (torch.compile, a real shape): run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
