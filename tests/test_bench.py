"""bench.py's parts that need no checkpoints: where greedy outputs diverge (the report of honest bf16), the
sampling settings reaching every timed decode, and the report's wording.

run: python -m pytest -q tests/test_bench.py
"""
import json
import math
import os
import sys

import pytest
import torch

import bench
import evaluate
from model import make_draft
from ops import files
from measure import choose, flags, timing
import speculate
from speculate import GREEDY, Sampling
from tiny_models import image_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def reference_margin(target, prompt, prefix):
    """The slow, obvious path: one cache-free forward over prompt + prefix, top-1 minus top-2 of its last row."""
    ids = torch.cat([prompt["input_ids"], torch.tensor([prefix], dtype=torch.long).view(1, -1)], 1)
    top = target(**dict(prompt, input_ids=ids))[0, -1].topk(2).values
    return float(top[0] - top[1]), float(top[0])


def test_divergences_name_the_prompt_the_position_and_the_targets_margin():
    target, prompt = tiny_model(), image_prompt()
    ref = speculate.autoregressive(target, prompt, 8).tokens
    j = 3
    flipped = ref[:j] + [(ref[j] + 1) % 80 + 10] + ref[j + 1:]  # a text id other than the target's choice
    assert flipped[j] != ref[j]
    first = [(ref[0] + 1) % 80 + 10] + ref[1:]
    out = timing.divergences(target, [prompt] * 4, [ref] * 4, [flipped, ref, ref[:5], first])
    assert [(d["prompt"], d["position"]) for d in out] == [(0, j), (2, 5), (3, 0)]  # prompt 1 is identical: no entry
    d = out[0]
    assert d["target_only_token"] == ref[j] and d["speculative_token"] == flipped[j]
    margin, top1 = reference_margin(target, prompt, ref[:j])
    # the margin is read at position j, not next to it: the neighbours' margins differ by far more than the tolerance
    neighbours = [reference_margin(target, prompt, ref[:k])[0] for k in (j - 1, j + 1)]
    assert all(abs(m - margin) > 1e-2 for m in neighbours), (margin, neighbours)
    assert d["top2_margin"] == pytest.approx(margin, abs=1e-4) and d["top2_margin"] > 0
    step = torch.finfo(torch.float32).eps * 2.0 ** math.floor(math.log2(abs(top1)))
    assert d["margin_steps"] == pytest.approx(margin / step, rel=1e-3)
    assert out[1]["speculative_token"] is None and out[1]["target_only_token"] == ref[5]  # an output cut short
    assert out[2]["top2_margin"] == pytest.approx(reference_margin(target, prompt, [])[0], abs=1e-4)
    assert timing.divergences(target, [prompt], [ref], [list(ref)]) == []


def test_margin_steps_count_bf16_steps():
    target, prompt = tiny_model().to(torch.bfloat16), image_prompt()
    prompt = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in prompt.items()}
    margin, steps = timing.top2_margin(target, prompt, [12, 13])
    with torch.no_grad():
        top1 = float(target(**dict(prompt, input_ids=torch.cat([prompt["input_ids"], torch.tensor([[12, 13]])], 1)))
                     [0, -1].max())
    # bf16 keeps 8 significant bits: at a logit in [2^e, 2^(e+1)) one step is 2^(e-7)
    step = 2.0 ** (math.floor(math.log2(abs(top1))) - 7)
    # a gap between bf16 numbers is a whole number of half-steps (the second logit may sit one binade lower)
    assert steps == pytest.approx(margin / step) and 2 * steps == pytest.approx(round(2 * steps))


def report_of(divergences, dtype="bf16", n=4):
    return "\n".join(timing.divergence_lines({"prompts": n, "divergences": divergences, "dtype": dtype}))


def test_the_report_says_identical_only_where_it_is():
    assert report_of([]) == "greedy outputs identical to target-only on all 4 prompts"
    d = {"prompt": 2, "position": 7, "top2_margin": 0.0625, "margin_steps": 1.0}
    text = report_of([d])
    assert "identical to target-only on 3 of 4 prompts" in text and "on all" not in text
    assert "prompt 2: token 7, margin 0.0625 (1.0 bf16 steps at the top logit)" in text and "near-tie" in text
    assert "this is a bug" in report_of([d], dtype="fp32")


def test_sampling_reaches_every_timed_decode(monkeypatch):
    """Under sampling both arms of the timed passes sample, prompt i with seed + i in every pass; greedy passes none."""
    target = tiny_model()
    draft = make_draft(target, n_layers=1).eval()
    prompts = [image_prompt(seed=s) for s in range(2)]
    calls, decode = [], evaluate.decode

    def spy(target, draft, prompt, gamma, max_new, stop, sampling=GREEDY, **kw):
        calls.append((draft is None, next(i for i, p in enumerate(prompts) if p is prompt), sampling))
        return decode(target, draft, prompt, gamma, max_new, stop, sampling, **kw)

    monkeypatch.setattr(evaluate, "decode", spy)
    sampling = flags.sampling(0.8, top_k=20, top_p=0.9, seed=5)
    timing.time_arms(target, {"speculative": draft}, prompts, 3, 6, None, repeats=1, sampling=sampling)
    assert len(calls) == 2 * 2 * 2  # warm-up + 1 pass, 2 arms, 2 prompts
    for _, i, s in calls:  # prompt i's generators seeded 5 + i, in the warm-up and in every pass
        assert s == Sampling(0.8, top_k=20, top_p=0.9, seed=5 + i)
    assert {only for only, _, _ in calls} == {True, False}
    calls.clear()
    timing.time_arms(target, {"speculative": draft}, prompts, 3, 6, None, repeats=1)
    assert all(s.greedy for _, _, s in calls)


def test_a_tree_cut_by_max_new_runs_and_costs_its_whole_shape(monkeypatch, capsys):
    """--tree 32 (depth 8) at --max-new 4: every round still drafts and verifies the whole tree (fixed shapes, the
    last block cut), and the report and the cost model say so; a chain of gamma 6 likewise."""
    from tree import TreeShape
    target = tiny_model()
    draft = make_draft(target, n_layers=1).eval()
    timed, tree_steps = [], timing.tree_step_times
    monkeypatch.setattr(timing, "tree_step_times", lambda t, d, p, nodes, *a, **k: timed.append(nodes) or tree_steps(
        t, d, p, nodes, *a, **k))
    res = bench.benchmark(target, draft, [image_prompt()], TreeShape(32, 8, 3), 4, repeats=3)
    ran = res["ran"]
    assert (ran["nodes"], ran["depth"], ran["nodes_per_round"], ran["depth_per_round"]) == (32, 8, 32, 8)
    assert timed == [(32,)] and res["tokens"] == 4
    bench.report(dict(res, mode="toy", device="cpu", hardware="x", dtype="fp32", threads=1))
    out = capsys.readouterr().out
    assert "decoder tree 32/8/3" in out and "depth 8.0 per round" in out
    lengths, step_times = [], timing.step_times
    monkeypatch.setattr(timing, "step_times", lambda t, d, p, ls, *a: lengths.append(ls) or step_times(t, d, p, ls, *a))
    res = bench.benchmark(target, draft, [image_prompt()], 6, 4, repeats=3)
    assert res["ran"]["gamma"] == 6 and lengths == [(1, 7)]


def test_sampling_flags_are_checked():
    assert flags.sampling_json(flags.sampling()) == {"mode": "greedy", "temperature": 0.0, "top_k": None, "top_p": None,
                                                 "seed": None, "lossy": False, "verification": "exact"}
    assert flags.sampling_json(flags.sampling(0.6, top_p=0.98))["mode"] == "sampling"
    for kw, msg in ((dict(temperature=-1.0), "temperature must be finite and >= 0"),
                    (dict(temperature=math.nan), "temperature must be finite"),
                    (dict(temperature=1.0, top_k=0), "top_k must be"),
                    (dict(temperature=1.0, top_p=1.5), "top_p must be"),
                    (dict(top_p=0.9), "give a temperature > 0"),
                    (dict(temperature=1.0, seed=-1), "seed must be an int >= 0")):
        with pytest.raises(ValueError, match=msg):
            flags.sampling(**kw)


# ---- the compiled steps, and what the JSON says about them ----


def test_the_compiled_choice_is_the_best_predicted_and_timed_beside_its_runner_up(eager_dynamo):
    """--compile, no decoder named: the chooser's profile is of the compiled steps (every candidate's compiled before
    compile_s ends), its best-predicted decoder and runner-up are timed compiled in the same passes, and every compiled
    arm emits target-only's greedy tokens (what compiles when: tests/test_probes.py)."""
    target = tiny_model(max_seq_len=128)  # the family's 32-node trees need the room
    draft = make_draft(target, n_layers=1).eval()
    prompts, val = [image_prompt(seed=s) for s in range(2)], [image_prompt(seed=9)]
    res = bench.benchmark(target, draft, prompts, 3, 6, repeats=3, compile=True, choose=val)
    ch, c = res["choice"], res["compiled"]
    pred = ch["predicted"]
    # choose.ranking's rule: the timed candidates, fastest predicted first, then the rest
    ranked = sorted(pred, key=lambda n: (not pred[n]["timed"], -pred[n]["predicted_speedup"]))
    spec = [n for n in ranked if n != evaluate.TARGET_ONLY][:2]  # the two best decoders are the timed ones
    json_of = {choose.name(d): timing.decoder_json(d) for d in choose.candidates() if d}
    assert ch["mode"] == "compiled" and (ch["chosen"], ch["runner_up"]) == tuple(ranked[:2])
    assert res["decoder"] == json_of[spec[0]] == {k: v for k, v in res["ran"].items() if k in res["decoder"]}
    r_up = res["arms"][timing.COMPILED_CHAIN]
    assert r_up["decoder"] == json_of[spec[1]] and r_up["ms_per_token"] > 0
    assert ch["measured"] == {evaluate.TARGET_ONLY: 1.0, spec[0]: c["speedup"], spec[1]: r_up["speedup"]}
    assert c["greedy_match"] and set(c["divergences"]) == {*timing.COMPILED, timing.COMPILED_CHAIN}


def test_a_draft_that_is_its_own_target_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--draft", "checkpoints/toy/target"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--draft checkpoints/toy/target holds a target model, not a draft" in err


def test_plans_time_batched_rows_that_equal_their_own_decodes(eager_dynamo, capsys):
    """--batch / --samples: two prompts x two samples as one batch of four rows, tree and chain, eager and compiled
    (dynamo's graphs, eager backend): every row equals its prompt's batch-1 target-only greedy decode, tau per row
    and the plan's speed-up are reported; sampled plans of one prompt's three samples run without a reference."""
    from tree import TreeShape
    target = tiny_model()
    draft = make_draft(target, n_layers=1).eval()
    prompts = [image_prompt(seed=s) for s in range(2)]
    p = timing.plans(target, draft, prompts, TreeShape(6, 3, 2), 6, None, 3, flags.sampling(), 2, 2, compile=True,
                    chain_gamma=3)
    assert p["rows"] == 4 and p["plans"] == 1 and p["greedy_match"]
    arms = {evaluate.TARGET_ONLY, "speculative", timing.CHAIN_ARM, *timing.COMPILED, timing.COMPILED_CHAIN}
    assert set(p["greedy_match_per_row"]) == arms and all(len(v) == 4 for v in p["greedy_match_per_row"].values())
    assert set(p["arms"]) == arms and all(len(a["tau_per_row"]) == 4 and a["ms_per_plan"] > 0 and a["greedy_match"]
                                          for a in p["arms"].values())
    assert p["arms"][evaluate.TARGET_ONLY]["speedup"] == 1.0 and p["arms"][timing.COMPILED[0]]["speedup"] == 1.0
    bench.report({"mode": "plans", "plan": p, "device": "cpu", "hardware": "x", "dtype": "fp32", "threads": 1,
                  "decoder": timing.decoder_json(TreeShape(6, 3, 2)), "decoding": flags.sampling_json(flags.sampling())})
    assert "4 rows, decoded as one batch" in capsys.readouterr().out
    sampled = timing.plans(target, draft, prompts, 3, 6, None, 3, flags.sampling(0.6, top_p=0.98), 1, 3)
    assert sampled["plans"] == 2 and "greedy_match" not in sampled and sampled["arms"]["speculative"]["tau"] >= 1


def test_the_plans_choice_is_profiled_over_their_rows():
    """Plans of 2 prompts x 2 samples: the chooser's profile is over 4 rows and counts each val plan's rounds as its
    slowest row's; the choice is the best predicted of the timed candidates."""
    target = tiny_model(max_seq_len=128)
    draft = make_draft(target, n_layers=1).eval()
    val = timing.plan_batches([image_prompt(seed=s) for s in range(4)], 2)
    ranked, rec = choose.choice(target, draft, image_prompt(seed=0), val, 6, None, flags.sampling(0.6, top_p=0.98),
                                samples=2)
    pred = rec["predicted"]
    assert rec["rows"] == 4 and rec["chosen"] == choose.name(ranked[0]) == max(
        (n for n in pred if pred[n]["timed"]), key=lambda n: pred[n]["predicted_speedup"])


def test_the_toys_action_step_over_rows_is_each_rows_own():
    """bench.action_stage on the toy's head: rows of two prompts x two samples with CoCs of their own lengths, in one
    ragged step; each row's waypoints equal that row decoded alone (fp32)."""
    target = tiny_model()
    prompts = [image_prompt(seed=s) for s in range(2)]
    cocs = [[5, 6, 9], [7], [8, 8, 8, 8, 9], [9]]
    got = bench.action_stage(target, evaluate.stack_prompts(prompts), cocs, (9,))
    assert got["action_ms"] > 0
    for b, coc in enumerate(cocs):
        alone = evaluate.action_rows(target, prompts[b // 2], [coc], (9,))[0]
        torch.testing.assert_close(torch.tensor(got["waypoints"][b]), alone[0], atol=1e-5, rtol=1e-5)


def test_relaxed_bench_reports_what_it_cost(capsys, tmp_path):
    """--relaxed (LOSSY) on the toy: the report names the rule, gives the relaxed tau beside the exact one and what
    it cost in the plan; the greedy row and its identity check stay the exact decode's. At bound 1 every draft is
    accepted: the tau rises and the CoCs change. Refused with plans of several rows, and without a plan to price."""
    out = tmp_path / "r.json"
    bench.main(["--device", "cpu", "--prompts", "2", "--max-new", "12", "--tree", "0", "--gamma", "4", "--repeats", "3",
                "--relaxed", "typical:1", "--out", str(out), "--json"])
    captured, res = capsys.readouterr(), files.read_json(out)
    text = captured.err  # --json: stdout is the one JSON line; the report, the progress and "wrote" on stderr
    assert captured.out.count("\n") == 1 and json.loads(captured.out) == res and "] timing 2 arms" in text
    assert {"repeats", "max_new", "views", "prompts", "run", "draft", "compile", "relaxed"} <= set(res["what_ran"]["flags"])
    assert res["what_ran"]["wall_s"] > 0 and "max-new 12, repeats 3" in text
    assert "LOSSY: relaxed acceptance, rule typical, bound 1" in text and "LOSSY cost" in text
    # issue #52: the top level is the lossy decode that was timed, never a claim of identity; the exact one apart
    assert res["decoding"]["lossy"] and res["greedy_match"] is False and res["divergences"]
    assert res["exact"]["greedy_match"] is True and not res["exact"]["divergences"]
    assert "greedy outputs identical to target-only" not in text
    assert "LOSSY: outputs identical to target-only on" in text
    lossy = res["lossy"]
    assert res["tau"] == res["sampled"]["tau"] > lossy["tau_exact"] == res["exact"]["tau"] and lossy["cocs_changed"] > 0
    assert lossy["plan_moved_m"] > 0 and set(lossy) == {"tau_exact", "cocs_changed", "plan_moved_m", "ade_exact",
                                                         "ade_relaxed"}
    for argv, words in ((["--samples", "2", "--temperature", "1"], "one row per prompt"),
                        (["--relaxed", "typical:2"], "bound")):
        with pytest.raises(SystemExit):
            bench.main(["--device", "cpu", "--relaxed", "typical:0.5", *argv])
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a preset has no plan to price it in
        bench.main(["preset", "qwen3-vl-8b", "--relaxed", "typical:0.5"])
    assert "--relaxed is a flag of `bench.py toy` and `bench.py real`" in capsys.readouterr().err


def test_migrate_arms_moves_an_old_reports_numbers_into_the_arms_record(capsys):
    """experiments/migrate_arms.py: an old toy report's flattened keys (and its compiled ones) and an old plans report's
    per-arm objects become the arms record, numbers moved not recomputed; a second migration changes nothing; the
    migrated report prints through the one printer."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
    import migrate_arms
    chain = {"kind": "chain", "gamma": 3}
    old = {"mode": "toy", "decoder": {"kind": "tree", "nodes": 16, "depth": 8, "width": 3}, "tau": 4.5, "alpha": 0.8,
           "routine_fraction": 0.8, "greedy_match": True, "prompts": 2, "divergences": [], "dtype": "fp32",
           "decoding": flags.sampling_json(flags.sampling()), "ar_prefill_ms": 50.0, "spec_prefill_ms": 51.0,
           "ar_ms_per_token": 10.0, "spec_ms_per_token": 5.0, "speedup": 2.0, "speedup_range": [1.8, 2.2],
           "runner_up": {"decoder": chain, "ms_per_token": 6.0, "speedup": 1.7, "speedup_range": [1.5, 1.9],
                         "over_runner_up": 1.2},
           "t_target_1": 9.0, "t_draft_1": 0.5, "c": 0.05, "predicted_speedup": 2.1, "device": "cpu", "hardware": "x",
           "threads": 2}
    res = json.loads(json.dumps(old))
    assert migrate_arms.migrate(res) and not migrate_arms.migrate(res)
    a = res["arms"]
    assert a[evaluate.TARGET_ONLY] == {"decoder": None, "ms_per_token": 10.0, "prefill_ms": 50.0, "speedup": 1.0,
                                       "speedup_range": [1.0, 1.0], "tau": 1.0, "greedy_match": True}
    assert a["speculative"] == {"decoder": old["decoder"], "ms_per_token": 5.0, "prefill_ms": 51.0, "speedup": 2.0,
                                "speedup_range": [1.8, 2.2], "tau": 4.5, "greedy_match": True}
    assert a[timing.CHAIN_ARM]["decoder"] == chain and a[timing.CHAIN_ARM]["tau"] is None and res["speedup"] == 2.0
    assert not {"ar_ms_per_token", "spec_ms_per_token", "runner_up", "ar_prefill_ms"} & set(res)
    bench.report(res)
    out = capsys.readouterr().out
    assert "runner-up             chain 3           6.000 ms/token   speed-up 1.70x [1.50-1.90]\n" in out
    plans = {"mode": "plans", "decoder": chain, "plan": {
        "speculative": {"ms_per_plan": 40.0, "speedup": 1.5, "mean_tau": 2.5, "tau_per_row": [2.5]},
        "greedy_match_per_row": {"speculative": [True]}}}
    assert migrate_arms.migrate(plans) and not migrate_arms.migrate(plans)
    assert plans["plan"]["arms"] == {"speculative": {"decoder": chain, "ms_per_plan": 40.0, "speedup": 1.5,
                                                     "tau_per_row": [2.5], "tau": 2.5, "speedup_range": [1.5, 1.5],
                                                     "greedy_match": True}}
