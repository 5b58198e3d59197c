"""experiments/probes.py, the GPU probe's side measurements, on a CPU: CompileWatch counts dynamo's compilations per
phase (bench.py --compile's steps compile in the decodes timed as compile_s and never again) and sees a recompilation;
sdpa_steps names each step's attention shapes and kernel.

run: python -m pytest -q tests/test_probes.py
"""
import pytest
import torch

import bench
from experiments import probes
from model import make_draft
from ops import compiled
from measure import choose, timing
import speculate
from tiny_models import image_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def watched_benchmark(monkeypatch, *args, **kwargs):
    """bench.benchmark with a CompileWatch on its compiled steps, in bench's phases: "compile" (every decode before
    time_arms: those timed as compile_s, and choose's candidates), "warm-up" (time_arms' own warm-up pass), "timed"
    (its passes) and "cost model" (the compiled steps' step times). -> (bench's record, the watch's report)."""
    pair, watches = timing.compiled_pair, []

    def compiled_pair(*a, **kw):
        ct, cd = pair(*a, **kw)
        watches.append(probes.CompileWatch({"target": ct, "draft": cd}))
        return ct, cd

    def entering(fn, phase, unless=None, after=None):
        """fn, its call entering `phase` (not from phase `unless`; with `after`, only from that phase: the chooser's
        timed val decodes run through timing.interleaved too, in the compile phase)."""
        def run(*a, **kw):
            if watches[0].phase != unless and after in (None, watches[0].phase):
                watches[0].next_phase(phase)
            return fn(*a, **kw)
        return run

    monkeypatch.setattr(timing, "compiled_pair", compiled_pair)
    monkeypatch.setattr(timing, "time_arms", entering(timing.time_arms, "warm-up"))
    monkeypatch.setattr(timing, "interleaved", entering(timing.interleaved, "timed", after="warm-up"))
    monkeypatch.setattr(bench, "cost_model", entering(bench.cost_model, "cost model", unless="compile"))
    try:
        res = bench.benchmark(*args, **kwargs)
    finally:
        for w in watches:
            w.close()
    return res, watches[0].report()


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_compiled_step_compiles_only_in_its_compile_pass(eager_dynamo, monkeypatch, tmp_path, tree):
    """--compile: every step shape compiles in the decodes timed as compile_s and never again: not in the timed
    passes' warm-up, the timed passes or the cost model (dynamo guards on the grad mode and the inputs' dispatch
    keys, so timing under another grad mode than the compile pass recompiles every shape). A tree as bench's toy
    mode runs it: chosen on val scenes from the compiled steps' profile (every candidate's shapes compiled there, a
    tree's verify and growth fused: tree.tree_forward, tree.grow), the runner-up timed beside it."""
    target = tiny_model(max_seq_len=128)  # the chooser's 32-node trees need the room
    draft = make_draft(target, n_layers=1).eval()
    prompts = [image_prompt(seed=s) for s in range(2)]
    kw = dict(choose=[image_prompt(seed=9)]) if tree else {}
    monkeypatch.setattr(choose, "CACHE", str(tmp_path))  # the profile and val rounds measured here, not reused
    res, c = watched_benchmark(monkeypatch, target, draft, prompts, 3, 6, repeats=3, compile=True, chain_gamma=3, **kw)
    assert set(c["steps"]) == {"compile", "warm-up", "timed", "cost model"}, c["steps"].keys()
    warm = c["steps"]["compile"]  # the decodes timed as compile_s (and the chooser's profile and val rounds)
    want = {"target T=1", "draft T=1"} | ({"target tree_forward", "draft grow"} if tree else {"target T=4"})
    assert want <= set(warm) and all(v["compilations"] for v in warm.values()), warm
    for phase in ("warm-up", "timed", "cost model"):
        steps = c["steps"][phase]
        assert sum(v["calls"] for v in steps.values()) > 0
        assert all(v["compilations"] == 0 for v in steps.values()), (phase, steps)
    assert c["recompiled_after_compile"] == {} and c["cuda_graphs"] is None  # no CUDA graphs on a CPU
    assert res["compiled"]["greedy_match"]


def test_compile_watch_sees_a_recompilation(eager_dynamo):
    """The counter the test above relies on moves: a step timed under inference_mode after a no_grad warm-up."""
    target = tiny_model()
    st = compiled.CompiledSteps(target, 40, (1,))
    watch = probes.CompileWatch({"target": st})
    prompt = image_prompt()
    with torch.no_grad():
        speculate.autoregressive(st, prompt, 3)
    assert list(watch.counts["compile"]) == ["target T=1"] and watch.counts["compile"]["target T=1"]["compilations"]
    watch.next_phase("timed")
    with torch.inference_mode():
        speculate.autoregressive(st, prompt, 3)
    watch.close()
    again = watch.recompiled()
    assert list(again) == ["timed"] and list(again["timed"]) == ["target T=1"] and again["timed"]["target T=1"] >= 1


def test_sdpa_steps_name_each_steps_shapes_and_kernel():
    target = tiny_model()
    prompt = image_prompt()
    L, cfg = prompt["input_ids"].shape[1], target.cfg
    steps = probes.sdpa_steps(target, prompt, 3, tree=True)
    assert set(steps) == {"prefill", "decode", "verify", "tree verify"}
    g = cfg.n_heads // cfg.n_kv_heads
    # one cached step (VLA.step): the grouped layout and an additive mask; the prefill over its L - 1 tokens, the
    # verify over 4 reading the L + 3 slots it needs, a tree's verify over 4 reading the whole cache
    for name, T, S in (("prefill", L - 1, L - 1), ("verify", 4, L + 3), ("tree verify", 4, L + 4)):
        assert steps[name]["q"] == [1, cfg.n_kv_heads, g * T, cfg.head_dim]
        assert steps[name]["k"] == [1, cfg.n_kv_heads, S, cfg.head_dim]
        assert steps[name]["mask"] == "torch.float32 tensor"
    for name, s in steps.items():
        assert s["backends"]["MATH"] == "ok" and s["backends"][s["dispatcher"]] == "ok", (name, s)
