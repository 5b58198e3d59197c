"""Latency of the reasoning step: target-only decoding vs speculative decoding (draft q proposes, target p verifies),
both arms in one process on the same prompts, beside the cost model that predicts their ratio (Leviathan et al.;
docs/background.md, "Speculative decoding"): speed-up = tau T_target(1) / (gamma T_draft(1) + T_target(gamma + 1)).

Paper: RSD accelerates the reasoning step; the prefill, shared by both arms, is reported apart. Fairness: the same
KV-cached forward and dtype in both arms, every shape warmed up, the device synchronised before each clock reading,
the arms alternating within each repeat, medians reported; greedy outputs compared token by token. With no --tree
or --gamma the toy's decoder (and with --dtype auto every mode's dtype) is chosen for the machine that runs
(measure/choose.py: target-only, chains, trees), its runner-up timed beside it. Random weights (`preset`, or `real`
without --draft): read the cost model (experiments/gpu_check.py predicts the speed-up at the real shape from the
toy's recorded acceptance). The mode is a subcommand with its own flags (`bench.py MODE -h`); with none, the toy.

run: python bench.py [toy] --device cpu [--compile]                    (the toy, from the shipped checkpoints/toy)
     python bench.py preset qwen3-vl-8b --device cuda [--draft-vocab 32768]  (real shapes, random weights)
     python bench.py real --device cuda --target PATH [--draft PATH]   (a Hugging Face / Alpamayo folder: alpamayo.py)
     python bench.py real --device cuda --target PATH --draft PATH --scenes SCENES --tree 0     (held out: heldout)
"""
import argparse
import contextlib
from dataclasses import replace
import importlib.util
import json
import os
import re
import sys
import time

import torch

from beyond import stream
import driving
import evaluate
from evaluate import TARGET_ONLY, tree_speedup
import model as M
from ops import checkpoint, cli, files
from measure import choose as chooser, flags, timing
from real import alpamayo, hf, scenes
from real.expert import speed_from_history
from speculate import GREEDY, decoder_of
from tree import TreeShape

TOY_DRAFT = ("aarl", 0)  # the toy mode's default draft: FlatRoPE + AARL (static anchor), seed 0
TOY_JSON = "runs/bench_toy.json"  # the toy mode's default --out (whatever settings that run had); never a shipped file
ROOT = os.path.dirname(os.path.abspath(__file__))
SHIPPED_DIR = os.path.join(ROOT, "checkpoints")  # what the repo ships: no report is written there
# a tree's most candidates a round (TreeShape.candidates: k + (D - 1) k^2): 15x evaluate.TREES' largest (66),
# and its verify's (N + 1, V) logits stay under 1 GB at Qwen's 152k vocabulary, the (N + 1)^2 mask 1M bools a row
MAX_TREE_CANDIDATES = 1024


def benchmark(target, draft, prompts, gamma, max_new, stop_token=None, repeats=3, sampling=GREEDY, compile=False,
              chain_gamma=evaluate.GAMMA, choose=None, reprofile=False):
    """One draft's record: statistics, divergences, both arms timed, the cost model; compile: all that, compiled.
    gamma: the decoder (speculate.Chain or gamma, tree.TreeShape); beside it the runner-up chain_gamma (a decoder, or
    the chain of that gamma), the same draft, timed in the same passes, compiled or not.
    choose: val prompts: both are the chooser's instead (measure.choose: the machine's profile of the steps that run,
    eager or compiled, and each candidate's rounds on these prompts); reprofile: its profile measured anew."""
    comp, chosen = {}, None
    if compile:
        decoders = [c for c in chooser.candidates() if c] if choose else [gamma, chain_gamma]
        cli.progress(f"compiling every step shape of {len(decoders)} decoder(s) and target-only: minutes on a CPU, "
                     "seconds to a minute on a GPU")
        ct, cd = timing.compiled_pair(target, draft, prompts + (choose or []), decoders, max_new,
                                      lengths=chooser.COMPILED_LENGTHS if choose else None)
        clock = timing.Clock(prompts[0]["input_ids"].device, enabled=True)
    if choose:  # compiled: the profile's first calls compile the steps, outside compile_s
        ranked, chosen = chooser.choice(ct if compile else target, cd if compile else draft, choose[0], choose,
                                        max_new, stop_token, sampling, mode="compiled" if compile else "eager",
                                        reprofile=reprofile)
        gamma, chain_gamma = [c for c in ranked if c is not None][:2]  # target-only chosen: the best two decoders
        if compile:
            clock.lap()
    cli.progress(f"greedy decodes of {len(prompts)} prompts, target-only and speculative (the identity check)")
    gamma, chain_gamma = decoder_of(gamma), decoder_of(chain_gamma)
    beside = gamma != chain_gamma  # the runner-up arm, timed beside the decoder
    greedy = evaluate.spec_stats(target, {"speculative": draft}, prompts, gamma, max_new, stop_token)
    spec, reference = greedy["speculative"], greedy[TARGET_ONLY]["tokens"]
    if compile:
        # the compiled arms' greedy outputs; the first decodes compile every step shape, and the clock says how long
        cs = evaluate.spec_stats(ct, {"speculative": cd}, prompts, gamma, max_new, stop_token)
        outputs = {timing.COMPILED[0]: cs[TARGET_ONLY], timing.COMPILED[1]: cs["speculative"]}
        if beside:
            outputs[timing.COMPILED_CHAIN] = evaluate.spec_stats(ct, {"c": cd}, prompts, chain_gamma, max_new,
                                                                 stop_token, check_greedy=False)["c"]
        compile_s = clock.lap()
        div = {arm: timing.divergences(target, prompts, reference, o["tokens"]) for arm, o in outputs.items()}
        comp.update(compile_s=compile_s, divergences=div, greedy_match=not any(div.values()))
    arms = timing.arm_table({"": (target, draft)} | ({" compiled": (ct, cd)} if compile else {}), gamma, chain_gamma)
    cli.progress(f"timing {len({TARGET_ONLY, *arms})} arms: {repeats} passes over {len(prompts)} prompts, then the "
                 "cost model")
    t = timing.time_arms(target, {}, prompts, gamma, max_new, stop_token, repeats, sampling, arms)[0]
    res = {"decoder": timing.decoder_json(gamma), "decoding": flags.sampling_json(sampling),
           **{k: spec[k] for k in ("greedy_match", "tau", "alpha", "routine_fraction")}, "tokens": spec["n_tokens"],
           "prompts": len(prompts), "divergences": timing.divergences(target, prompts, reference, spec["tokens"]),
           "arms": t, "speedup": t["speculative"]["speedup"]}
    timed = spec
    if not sampling.greedy or sampling.lossy:  # then the timed runs' own statistics: the same seeds, the same tokens
        timed = evaluate.spec_stats(target, {"speculative": draft}, prompts, gamma, max_new, stop_token,
                                    sampling=sampling)["speculative"]
        res["sampled"] = {k: timed[k] for k in ("tau", "alpha", "routine_fraction")} | {"tokens": timed["n_tokens"]}
    if sampling.lossy:  # the exact decode with the same draws beside it: what the relaxed rule changed
        exact = spec if sampling.greedy else evaluate.spec_stats(
            target, {"s": draft}, prompts, gamma, max_new, stop_token, sampling=replace(sampling, relaxed=None))["s"]
        res["lossy"] = {"tau_exact": exact["tau"], "cocs": timed["tokens"], "exact_cocs": exact["tokens"]}
        # the top level is the timed (lossy) decode, as its speed-up is; the exact greedy decode under its own key
        res["exact"] = {k: res[k] for k in ("greedy_match", "tau", "alpha", "routine_fraction", "divergences")}
        res.update({k: timed[k] for k in ("tau", "alpha", "routine_fraction")}, greedy_match=None, divergences=[])
        if sampling.greedy:
            res.update(greedy_match=timed["tokens"] == reference,
                       divergences=timing.divergences(target, prompts, reference, timed["tokens"]))
    # every round drafts and verifies the whole shape (the last one's block is cut): the cost model's
    res["ran"] = dict(timing.decoder_json(gamma), nodes_per_round=timed["nodes_per_round"],
                      depth_per_round=timed["depth_per_round"])
    res.update(cost_model(target, draft, prompts[0], gamma, timed["tau"]))
    res["c"] = res["t_draft_1"] / res["t_target_1"]
    if gamma.kind == "chain":  # Leviathan's closed form is the chain's
        res["leviathan_speedup"] = evaluate.expected_speedup(timed["alpha"], gamma.gamma, res["c"])
    if compile:  # the compiled speed-up over compiled target-only; over eager target-only (the arms' medians)
        ms = {arm: t[arm]["ms_per_token"] for arm in (TARGET_ONLY, *timing.COMPILED)}
        comp.update(speedup=t[timing.COMPILED[1]]["speedup"], speedup_vs_eager=ms[TARGET_ONLY] / ms[timing.COMPILED[1]],
                    target_only_vs_eager=ms[TARGET_ONLY] / ms[timing.COMPILED[0]])
        res["compiled"] = comp | cost_model(ct, cd, prompts[0], gamma, timed["tau"])
    if chosen:  # the chooser's record, and what the candidates timed here measured (target-only: 1)
        sfx = " compiled" if compile else ""
        res["choice"] = chosen | {"measured": {TARGET_ONLY: 1.0, chooser.name(gamma): t["speculative" + sfx]["speedup"],
                                               chooser.name(chain_gamma): t[timing.CHAIN_ARM + sfx]["speedup"]}}
    return res


def action_stage(target, prompt, cocs, end, v0=None, repeats=3):
    """The plan's action step over all its rows (evaluate.action_rows: the shared prefill, the rows' CoCs closed by
    end, the expert or the toy's head), timed: {action_ms (median of repeats), waypoints}."""
    run = lambda: evaluate.action_rows(target, prompt, cocs, end, v0)[0]  # noqa: E731
    ms = 1e3 * timing.median_time(run, prompt["input_ids"].device, repeats)
    return {"action_ms": ms, "waypoints": run().tolist()}


def cost_model(target, draft, prompt, gamma, tau, reps=20):
    """Step times (ms): T_target(1), T_draft(1), T_target(gamma + 1) or a tree's verify and level; speed-up at tau."""
    gamma = decoder_of(gamma)
    g = gamma.gamma if gamma.kind == "chain" else None  # a chain's verify is the target's step of gamma + 1
    t = timing.step_times(target, draft, prompt, (1, g + 1) if g else (1,), reps)
    t1, td = t["target"][1], t["draft"]
    if g:
        return {"t_target_1": 1e3 * t1, "t_target_gamma1": 1e3 * t["target"][g + 1], "t_draft_1": 1e3 * td,
                "predicted_speedup": evaluate.measured_speedup(tau, t1, td, t["target"][g + 1], g)}
    tt = timing.tree_step_times(target, draft, prompt, (gamma.nodes,), gamma.width, reps)
    tv, tl, tg = tt["target"][gamma.nodes], tt["draft_level"], timing.grow_time(target, draft, prompt, gamma, reps)
    return {"t_target_1": 1e3 * t1, "t_target_verify": 1e3 * tv, "t_draft_1": 1e3 * td, "t_draft_level": 1e3 * tl,
            "t_draft_grow": 1e3 * tg, "predicted_speedup": tree_speedup(tau, t1, td, tl, tv, gamma, t_grow=tg),
            "predicted_speedup_by_steps": tree_speedup(tau, t1, td, tl, tv, gamma)}


# ---- the modes: the toy, a real shape (random weights), a real checkpoint ----
def toy(args, device, dtype, sampling):
    target_dir, draft_dir = os.path.join(args.run, "target"), args.draft or checkpoint.draft_dir(args.run, *TOY_DRAFT)
    target = checkpoint.load(target_dir, dtype=dtype, device=device).eval()
    draft = checkpoint.load(draft_dir, target=target).eval()  # in the target's dtype: they share embedding and head
    tok = driving.Tokenizer()

    def split(name, n):  # the toy's scenes of a split as prompts
        return evaluate.scene_prompts(driving.make_split(name, n, seed=0), tok, device, dtype, args.views)

    if args.stream:  # held-out toy clips of --stream frames
        rate = driving.event_rate(args.stream_interval)
        clips = [evaluate.scene_prompts(c, tok, device, dtype, args.views)
                 for c in driving.make_clips("test", args.prompts, args.stream, args.stream_interval, rate)]
        chosen = None
        if args.choose:  # the tree the stream runs: the chooser's for one frame's plan on this machine
            val = split("val", chooser.val_prompts(1, args.samples))
            args.decoder, chosen = chooser.stream_tree(target, draft, val, args.max_new, tok.cot_end_id, sampling,
                                                       args.samples, args.reprofile)
        return stream_mode(args, target, draft, clips, args.stream_interval, rate, tok.cot_end_id, sampling,
                           chosen) | {"draft": draft_dir, "target": target_dir}
    prompts = split("test", args.prompts)
    if args.batch > 1 or args.samples > 1:  # plans of several rows, decoded as one batch
        decoder, beside, chosen = args.decoder, args.gamma, None
        if args.choose:  # a verify over B rows costs more: the chooser's profile over B rows, the val plans' rounds
            val = split("val", chooser.val_prompts(args.batch, args.samples))
            ranked, chosen = chooser.choice(target, draft, val[0], timing.plan_batches(val, args.batch), args.max_new,
                                            tok.cot_end_id, sampling, args.samples, reprofile=args.reprofile)
            decoder, beside = [c for c in ranked if c is not None][:2]
        p = timing.plans(target, draft, prompts, decoder, args.max_new, tok.cot_end_id, args.repeats, sampling,
                         args.batch, args.samples, args.compile, beside)
        p |= action_stage(target, evaluate.stack_prompts(prompts[:args.batch]), p["cocs"],
                          (tok.cot_end_id, tok.traj_future_start_id), repeats=args.repeats)  # the first plan's rows
        if chosen:  # the chooser's record, and what the candidates timed here measured (per plan; target-only: 1)
            arms = p["arms"]
            p["choice"] = chosen | {"measured": {TARGET_ONLY: 1.0,
                                                 chooser.name(decoder): arms["speculative"]["speedup"],
                                                 chooser.name(beside): arms[timing.CHAIN_ARM]["speedup"]}}
        return {"mode": "plans", "draft": draft_dir, "target": target_dir, "decoding": flags.sampling_json(sampling),
                "decoder": timing.decoder_json(decoder), "plan": p}
    # no --tree: the decoder and its runner-up are the chooser's, for the steps that run (eager or compiled)
    choose = split("val", chooser.val_prompts()) if args.choose else None
    res = benchmark(target, draft, prompts, args.decoder, args.max_new, tok.cot_end_id, args.repeats, sampling,
                    args.compile, args.gamma, choose, args.reprofile) | {"mode": "toy", "draft": draft_dir,
                                                                         "target": target_dir}
    if "lossy" in res:  # the price of the relaxed rule: the toy's plans after the relaxed and the exact CoCs
        data, lossy = driving.Data("test", args.prompts, 0, tok, views=args.views), res["lossy"]
        lossy.update(evaluate.relaxed_cost(target, data, lossy.pop("exact_cocs"), lossy.pop("cocs")))
    return res


def stream_mode(args, target, draft, clips, interval, rate, stop, sampling=GREEDY, choice=None):
    """Plans in a stream: clips (each its frames' prompts in order), the four arms of measure.timing.stream_arms (the
    tree of --tree or the chooser's, or the chain of --gamma as the tree of width 1); rate: the toy's events a frame
    (None: real); choice: the chooser's record, where it chose the tree (the tree arm: what it measured here)."""
    g = args.decoder
    shape = g if isinstance(g, TreeShape) else TreeShape(g, g, 1)
    cli.progress(f"timing 4 arms: {args.repeats} passes over {len(clips)} clip(s) of {args.stream} frames, "
                 f"{args.samples} row(s) a frame")
    arms, _ = timing.stream_arms(target, draft, clips, shape, args.max_new, stop, args.repeats, samples=args.samples,
                                 sampling=sampling, compile=args.compile)
    greedy = None if not sampling.greedy else not any(a["frames_differing"] for a in arms.values())
    sib = {"siblings": args.samples, "frames_back": stream.K_FRAMES} if args.samples > 1 else {}
    measured = {"measured": {TARGET_ONLY: 1.0, chooser.name(shape): arms["tree"]["speedup"]}}
    return {"mode": "stream", "decoding": flags.sampling_json(sampling), "decoder": timing.decoder_json(args.decoder),
            **flags.identity(greedy), "stream": {"clips": len(clips), "frames": args.stream, "interval_s": interval,
                                               "compiled": args.compile, "event_rate": rate, "samples": args.samples,
                                               **stream.settings(**sib), "arms": arms},
            **({"choice": choice | measured} if choice else {})}


def build_preset(name, device, dtype, layers=None, draft_vocab=0):
    cfg = replace(M.PRESETS[name], n_layers=layers) if layers else M.PRESETS[name]
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            target = M.VLA(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    return target, M.make_draft(target, **M.DRAFT_PRESETS.get(f"{name}-draft", {"n_layers": 1}),
                                vocab_ids=torch.arange(draft_vocab) if draft_vocab else None).eval()


def real(args, device, dtype, sampling):
    """A real checkpoint (--target: the whole plan on pixels, alpamayo.py), or a real shape with random weights."""
    cli.progress(f"reading --target {args.target}" if args.target else f"building {args.preset} with random weights")
    if args.target:  # its config read, before any weights or decoding
        check_fits(args, hf.read_config(args.target)[0], args.draft and checkpoint.header(args.draft)[1].draft_vocab)
    extra, past = {}, alpamayo.history_poses()  # a plan's history: the generated prompt's straight 8 m/s
    if args.scenes:  # tau, alpha, identity, stage latencies and ADE over a scene folder (alpamayo.heldout)
        found, prompts, stop, how = scenes.scene_prompts(args.target, args.scenes, args.processor,
                                                         min_pixels=args.min_pixels, max_pixels=args.max_pixels)
        if args.stream:  # the first --stream scenes as one clip's frames, checked before the weights load
            interval = scenes.clip_interval(found, args.stream)
            target, draft = alpamayo.load_pair(args.target, args.draft, device, dtype)
            clip = [hf.on_model(scenes.built(i, p), target) for i, p in prompts[:args.stream]]
            return stream_mode(args, target, draft, [clip], interval, None, stop[-1], sampling) | {
                "model": args.target, "scenes_dir": args.scenes, "prompt_source": how,
                "trained_draft": bool(args.draft)}
        if args.samples == 1:
            return alpamayo.heldout_bench(args.target, args.draft, args.scenes, found, prompts, stop[-1], how,
                                          args.decoder, args.max_new, args.repeats, device, dtype, args.processor,
                                          sampling)
        target, draft = alpamayo.load_pair(args.target, args.draft, device, dtype)
        ps, stop, past = [hf.on_model(scenes.built(i, p), target) for i, p in prompts], stop[-1], found[0].past
        extra = {"scenes_dir": args.scenes, "prompt_source": how}
    elif args.target:
        images = alpamayo.scene_images(args.images_dir, args.images, args.image_size)
        target, draft, prompt, stop, tok, how = alpamayo.load(args.target, args.draft, images, device, dtype,
                                                              args.processor, args.min_pixels, args.max_pixels)
        ps = [prompt]
    else:
        (target, draft), stop = build_preset(args.preset, device, dtype, args.layers, args.draft_vocab), None
        prompt = alpamayo.real_prompt(target.cfg, device, n_images=args.images)
        if "pixel_values" in prompt:
            prompt["pixel_values"] = prompt["pixel_values"].to(dtype)
        ps = [prompt]
    name = args.target or (args.preset + (f" ({args.layers} layers)" if args.layers else "")
                           + (f", draft head over {args.draft_vocab} ids" if args.draft_vocab else ""))
    if args.samples > 1:  # each scene's plan as the release runs it: `samples` CoCs as one batch, the expert over all
        p = timing.plans(target, draft, ps, args.decoder, args.max_new, stop, args.repeats, sampling, 1, args.samples,
                         args.compile, args.gamma)
        if getattr(target, "expert", None) is not None:  # the first scene's plan, at its own speed
            v0 = speed_from_history(past[None]).to(device).expand(args.samples)  # (B,)
            p.update(action_stage(target, ps[0], p["cocs"], (stop,), v0, args.repeats))
        return {"mode": "plans", "model": name, **extra, "decoding": flags.sampling_json(sampling), "plan": p,
                "trained_draft": bool(args.draft)}
    res = benchmark(target, draft, [prompt], args.decoder, args.max_new, stop, args.repeats, sampling, args.compile,
                    args.gamma)
    res.update(mode="real", model=name, prompt_tokens=prompt["input_ids"].shape[1], trained_draft=bool(args.draft))
    if args.target:
        res.update(alpamayo.plan(target, draft, prompt, stop, tok, how, args.decoder, args.max_new, args.repeats,
                                 sampling))
    return res


# ---- the report ----
def run_line(res):
    rows, f = res["plan"]["rows"] if res["mode"] == "plans" else None, res.get("what_ran", {}).get("flags", {})
    why = f" ({res['dtype_why']})" if "dtype_why" in res else ""
    return (f"device {res['device']} ({res['hardware']}), dtype {res['dtype']}{why}, threads {res['threads']}, torch "
            f"{res.get('torch', torch.__version__)}, decoder {timing.decoder_name(res['decoder'])}, decoding "
            f"{flags.decoding_text(res['decoding'], rows)}"
            + (f", max-new {f['max_new']}, repeats {f['repeats']}" if f else "")
            + (f", {res['what_ran']['wall_s']:.0f} s in all" if "what_ran" in res else ""))


def report(res):
    """The report of any mode: its run line, the arms record through the one printer (measure.timing.arms_lines), the
    mode's own lines (acceptance, cost model, the chooser's, identity)."""
    if res["mode"] == "heldout":
        return print("\n".join([run_line(res)] + alpamayo.heldout_lines(res)))
    ch = [f"{k:<15}{t}" for k, t in choice_lines(res["choice"])] if "choice" in res else []
    if res["mode"] == "stream":
        st = res["stream"]
        return print("\n".join([run_line(res), f"stream         {st['clips']} clip(s) of {st['frames']} frames, "
                                 f"replanned every {st['interval_s']:g} s, {st['samples']} row(s) a plan"
                                 + ("" if st["event_rate"] is None else f", event rate {st['event_rate']:.3f} a frame")
                                 + "; greedy: every frame's plan against target-only's"]
                                + timing.arms_lines(st["arms"], "ms_per_plan") + ([] if res["greedy_match"] is not None
                                else ["sampled        plans not compared token by token (each draws its own CoCs; the "
                                      "law is kept: tests/test_stream.py)"]) + ch))
    if res["mode"] == "plans":
        p = res["plan"]
        action = [f"action step    {p['action_ms']:.1f} ms: the prompt's prefill, the first plan's {p['rows']} CoCs "
                  "teacher-forced, the action expert (toy: trajectory head) over all rows"] if "action_ms" in p else []
        seeds = [f"seeds          row r of plan j draws from its own generator, seeded {p['decoding']['seed']} + "
                 f"{p['rows']} j + r"] if p["decoding"]["mode"] == "sampling" else []
        return print("\n".join([run_line(res), f"plans          {p['plans']} plans of {p['batch']} prompt(s) x "
                                 f"{p['samples']} sample(s) = {p['rows']} rows, decoded as one batch; ms: one plan's "
                                 "reasoning step, until every row is done; tau: a row's; greedy: each row against its "
                                 "own batch-1 target-only decode"] + timing.arms_lines(p["arms"], "ms_per_plan")
                                + ch + seeds + action))
    s, c, arms = "sampled " if res["decoding"]["mode"] == "sampling" else "", res.get("compiled"), res["arms"]
    steps = lambda d: "   ".join(f"{k} {v:.3f} ms" for k, v in d.items() if k.startswith("t_"))  # noqa: E731
    acceptance = "tau {tau:.2f}   alpha {alpha:.3f}   routine fraction {routine_fraction:.3f}".format
    rows = [("prefill", f"target-only {arms[TARGET_ONLY]['prefill_ms']:.2f} ms   speculative "
             f"{arms['speculative']['prefill_ms']:.2f} ms"),
            ("LOSSY decode", acceptance(**res) + f"   (the timed runs; exact tau {res['exact']['tau']:.2f})")
            if "lossy" in res else ("greedy", acceptance(**res))]
    rows += [("sampled", acceptance(**res["sampled"]) + ("   (the timed runs, LOSSY)" if "lossy" in res else
              "   (the timed runs; lossless in distribution, so not compared token by token)"))] if s else []
    rows += [("LOSSY cost", "tau {} (exact {tau_exact:.2f}); CoCs changed {cocs_changed:.0%}; plan moved "
              "{plan_moved_m:.3f} m from the exact plan (ADE {ade_relaxed:.3f} m to the ground truth, exact "
              "{ade_exact:.3f} m)".format(f"{res['sampled']['tau']:.2f}", **res["lossy"]))] if "lossy" in res else []
    rows += [("compiled", f"{c['speedup_vs_eager']:.2f}x over eager target-only, greedy "
              f"{'identical' if c['greedy_match'] else 'DIFFERS'}   compile + first decodes {c['compile_s']:.0f} s"),
             ("compiled cost", steps(c) + f"   predicted speed-up {c['predicted_speedup']:.2f}x")] if c else []
    rows += choice_lines(res["choice"]) if "choice" in res else []
    rows += [("verified", "{nodes_per_round:.1f} draft tokens, depth {depth_per_round:.1f} per round (mean); the cost "
              "model at what ran: {}".format(timing.decoder_name(res["ran"]), **res["ran"]))] if "ran" in res else []
    rows += [("cost model", steps(res) + f"   c {res['c']:.3f}"),
             ("predicted", f"speed-up {res['predicted_speedup']:.2f}x (measured {s}tau)" + (
                 f"   {res['leviathan_speedup']:.2f}x (Leviathan, measured {s}alpha)" if "leviathan_speedup" in res
                 else ""))]
    lines = ["NOTE: untrained draft -> acceptance (tau, alpha, speed-up) is not meaningful; read the cost model "
             "(experiments/gpu_check.py: the speed-up it predicts at the toy's acceptance)."] \
        if res["mode"] == "real" and not res["trained_draft"] else []
    same = "not compared (sampled)" if res["greedy_match"] is None else \
        f"{res['prompts'] - len(res['divergences'])} of {res['prompts']} prompts"
    lines += [run_line(res), f"reasoning step (decode, prefill apart; {s or 'greedy '}arms" + (
        "; a compiled arm's speed-up over compiled target-only" if c else "") + "):"] + timing.arms_lines(arms)
    lines += [f"{k:<15}{t}" for k, t in rows] + (
        [f"LOSSY: outputs identical to target-only on {same}"] if "lossy" in res else timing.divergence_lines(res))
    lines += alpamayo.report_lines(res) if "coc" in res else []
    print("\n".join(lines))


def choice_lines(ch):
    """The chooser's record as report rows: its profile, each candidate's prediction, what was measured."""
    pred, meas = ch["predicted"], ch["measured"]
    said = lambda n: f"{n} (predicted {pred[n]['predicted_speedup']:.2f}x" + (  # noqa: E731
        f", measured {meas[n]:.2f}x)" if n in meas else ")")
    steep = f"; a verify of {', '.join(map(str, ch['steep']))} tokens costs more than 2 one-token steps here" \
        if ch["steep"] else ""
    return [("chosen", f"{said(ch['chosen'])}, runner-up {said(ch['runner_up'])}: {ch['mode']} steps, {ch['rows']} "
             f"row(s) (measure.choose)"),
            ("profile", f"one-token step {ch['steps_ms']['1']:.2f} ms, verify of " + ", ".join(
                f"{int(n) + 1} {v:.2f}" for n, v in ch["verify_ms"].items()) + f" ms, draft step "
             f"{ch['draft_ms']['1']:.3f} ms{steep} ({ch['profile']}; {ch['profile_s']:.1f} s this run)"),
            ("candidates", ", ".join(f"{n}{'*' * v.get('timed', False)} {v['predicted_speedup']:.2f}x"
                                     for n, v in pred.items())
             + f" (*: a real decode's round; rounds on val: {ch['acceptance']})")]


# ---- the flags: one subcommand a mode, each with its own flags ----
MODES = {"toy": "the shipped toy checkpoints on held-out scenes of the synthetic world (the default mode)",
         "preset": "a real model's shape with random weights (read the cost model)",
         "real": "a real checkpoint: a Hugging Face Qwen-VL or Alpamayo folder"}


def flag_groups():
    """Parent parsers: every mode's flags, the toy's and a real checkpoint's (plans of rows, clips), the toy's own."""
    common = argparse.ArgumentParser(add_help=False)  # every mode's flags
    common.add_argument("--dtype", default="auto", choices=["auto", *sorted(cli.DTYPES)], help="weights, activations "
                        "and KV cache; auto: bf16 where the hardware runs it natively (CUDA, a CPU with AVX-512 BF16 "
                        "or AMX), else fp32 (measure.choose.auto_dtype)")
    common.add_argument("--device", default="cpu", help="cpu or cuda")
    common.add_argument("--out", default=None, help=f"write the report's JSON here (toy default {TOY_JSON}; none for "
                        "a real model)")
    for flag, default, rule, text in (
            ("--gamma", None, ">= 1", "the chain's draft length: alone, the chain of gamma runs (as --tree 0); "
                                      f"beside a --tree, the chain timed with it (default {evaluate.GAMMA})"),
            ("--max-new", evaluate.MAX_NEW_TOKENS, ">= 1", "reasoning tokens per prompt at most"),
            ("--repeats", 3, ">= 3", "timed passes (median reported), >= 3"),
            ("--threads", None, ">= 1", "CPU threads (default: torch's)")):
        common.add_argument(flag, type=cli.typed(rule), default=default, help=text)
    common.add_argument("--tree", type=flags.tree_arg(), help="N/D/k: a draft tree of N nodes, depth D, k nodes "
                        "expanded per level and children per node; 0: the chain of --gamma (default: the toy's decoder "
                        "is chosen for this machine, measure.choose: target-only, the chains of gamma 1-8 or a tree of "
                        "its family, the runner-up timed beside it; a real model's "
                        f"{chooser.shape_key(evaluate.TREE)})")
    common.add_argument("--compile", action="store_true", help="also every arm through torch.compile'd steps")
    common.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    decoding = "> 0 times both arms sampling (Alpamayo-R1 samples its CoC at 0.6, top-p 0.98)"
    flags.add_decoding_flags(common, decoding, relaxed=False)
    plans = argparse.ArgumentParser(add_help=False)  # the toy's and a real checkpoint's: plans of rows, clips
    plans.add_argument("--samples", type=cli.typed(">= 1"), default=1, help="rows per prompt (toy) or scene (real "
                       "--scenes), each its own sampled CoC, decoded as one batch (Alpamayo-R1 runs 6 at "
                       "--temperature 0.6 --top-p 0.98)")
    plans.add_argument("--stream", type=int, default=0, help="plans in a stream (beyond/stream.py): --prompts held-out "
                       "toy clips of this many frames, or the first this many --scenes (name order) as one clip, each "
                       "frame drafted from the plan before; target-only, the tree (or chain) alone, the stream alone "
                       "and both timed interleaved (0: off)")
    flags.add_relaxed_flags(plans)  # not a preset's: relaxed acceptance is priced in a plan's trajectory
    toy = argparse.ArgumentParser(add_help=False)
    toy.add_argument("--run", default=checkpoint.SHIPPED, help="toy checkpoints folder (default: the shipped ones)")
    toy.add_argument("--draft", default=None, help="draft folder (checkpoint.save format) trained for the target "
                     f"(default {TOY_DRAFT[0]} seed {TOY_DRAFT[1]} of --run)")
    for flag, default, rule, text in (
            ("--prompts", 32, ">= 1", "held-out test scenes benchmarked"),
            ("--views", driving.WorldConfig().views, cli.VIEWS_RULE, "surround views per prompt"),
            ("--batch", 1, ">= 1", "prompts per batch (with --samples: batch x samples rows per plan)")):
        toy.add_argument(flag, type=cli.typed(rule), default=default, help=text)
    toy.add_argument("--stream-interval", type=cli.typed("a finite number > 0", float), default=0.5, help="with "
                     "--stream: seconds between frames (the per-frame event rate follows: driving.event_rate)")
    toy.add_argument("--reprofile", action="store_true", help="measure the machine's cost profile again (it is cached "
                     "under runs/choose/ by hardware, threads, torch, dtype, mode and the models' configs)")
    return common, plans, toy


def parser():
    """(the toy's parser, {mode: its subparser}): the modes as subcommands, each refusing another's flags; their shared
    flags default to nothing (argparse.SUPPRESS), so what the top-level parser took before the mode word stays."""
    ap = argparse.ArgumentParser(description="Reasoning-step latency: target-only vs speculative (RSD). The mode is a "
                                 "subcommand; with none, the toy.", parents=flag_groups())
    common, plans, toy = flag_groups()
    for a in common._actions + plans._actions + toy._actions:
        a.default = argparse.SUPPRESS
    sub = ap.add_subparsers(dest="mode", metavar="{toy,preset,real}")
    modes = {m: sub.add_parser(m, parents=parents, help=MODES[m], description=f"bench.py {m}: {MODES[m]}")
             for m, parents in (("toy", [common, plans, toy]), ("preset", [common]), ("real", [common, plans]))}
    preset, real_ = modes["preset"], modes["real"]
    preset.add_argument("preset", choices=[k for k in sorted(M.PRESETS) if "toy" not in k], help="the shape")
    preset.add_argument("--layers", type=cli.typed(">= 1"), default=None, help="keep only this many decoder layers")
    preset.add_argument("--draft-vocab", type=int, default=0, help="the draft's head covers only the first K token "
                        "ids (0: all)")
    real_.add_argument("--target", required=True, help="Hugging Face Qwen2.5-VL / Qwen3-VL / Alpamayo folder")
    real_.add_argument("--draft", default=None, help="a draft folder trained for --target (none: random weights)")
    real_.add_argument("--images-dir", default=None, help="a folder of camera images (name order)")
    real_.add_argument("--image-size", default="288x512", help="HxW of the generated images")
    real_.add_argument("--processor", default=None, help="tokenizer + image processor folder (default: --target)")
    real_.add_argument("--scenes", default=None, help="a scene folder (scenes.py) measured held out: tau, alpha per "
                       "draft position, routine share, greedy identity, latency per stage, ADE")
    for flag, default in (("--min-pixels", alpamayo.MIN_PIXELS), ("--max-pixels", alpamayo.MAX_PIXELS)):
        real_.add_argument(flag, type=cli.typed(">= 1"), default=default, help="image size bounds")
    for m in (preset, real_):
        m.add_argument("--images", type=cli.typed(">= 1"), default=16, help="images in the generated prompt (real: "
                       "without --images-dir or --scenes)")
    for flag, action in {**real_._option_string_actions, **preset._option_string_actions, "--preset": None}.items():
        if flag not in ap._option_string_actions:  # another mode's flag before any mode word: parse() names its mode
            ap.add_argument(flag, dest=action.dest if action else "preset", nargs="?", help=argparse.SUPPRESS)
    return ap, modes


def parse(argv):
    """(the mode's parser, the flags); a flag of another mode (the toy's before another mode's word) is one line."""
    ap, modes = parser()
    args, rest = ap.parse_known_args(argv)
    args.mode = args.mode or "toy"
    p = modes[args.mode]
    own = {a.dest for a in p._actions} | {"mode"}
    rest += ["--" + n.replace("_", "-") for n, v in vars(args).items() if n not in own and v != ap.get_default(n)]
    for flag in rest:
        owners = [f"`bench.py {m}`" for m, q in modes.items() if flag.partition("=")[0] in q._option_string_actions]
        if owners := owners or (["`bench.py preset NAME`"] if flag == "--preset" else []):
            p.error(f"{flag.partition('=')[0]} is a flag of {' and '.join(owners)}, not of `bench.py {args.mode}` (the "
                    "mode is the first word; none: toy)")
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    defaults = {a.dest: a.default for q in (ap, *modes.values()) for a in q._actions if a.default != argparse.SUPPRESS}
    vars(args).update({n: v for n, v in defaults.items() if n not in own})  # another mode's flags: their defaults
    p.set_defaults(**defaults)  # its shared flags' too (check_flags compares with them)
    return p, args


@cli.program
def main(argv=None):
    ap, args = parse(argv)
    t0, cpu0 = time.time(), time.process_time()
    sampling = check_flags(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    args.dtype, dtype_why = chooser.auto_dtype(device) if args.dtype == "auto" else (args.dtype, "as given (--dtype)")
    dtype = cli.DTYPES[args.dtype]
    timing.reset_peak_memory(device)
    torch.manual_seed(0)
    with cli.json_stdout(args.json), cli.user_errors(ap):  # a bad folder or file, a gamma too long: one line
        res = toy(args, device, dtype, sampling) if args.mode == "toy" else real(args, device, dtype, sampling)
    res.update(device=str(device), hardware=chooser.hardware(device), dtype=args.dtype,
               cpu_capability=torch.backends.cpu.get_cpu_capability(), dtype_why=dtype_why,
               gamma=None if args.tree else args.gamma, threads=torch.get_num_threads(), torch=torch.__version__,
               environment=timing.environment(device), peak_memory=timing.peak_memory(device))
    res.setdefault("decoder", timing.decoder_json(args.decoder))  # benchmark's own where it chose the tree
    res["what_ran"] = cli.ran(args, t0, cpu0)
    d = res["decoder"]  # the decoder that ran (a tree chosen on val included), not the flags' default
    res["what_ran"]["flags"]["tree"] = f"{d['nodes']}/{d['depth']}/{d['width']}" if d["kind"] == "tree" else 0
    with cli.json_stdout(args.json):
        report(res)  # printed first: a failing write below loses no measurement
    if args.json:
        print(json.dumps(res))
    if args.out:
        with cli.user_errors(ap):
            files.write_json(args.out, res)
    print(f"wrote {args.out}" if args.out else "no report file (--out FILE writes one)", file=sys.stderr)
    return res


def check_flags(ap, args):
    """Every bad flag is one line at parse time, before any work (ap: the mode's parser, which has already refused
    another mode's flags); returns the Sampling."""
    toy_mode, real_mode = args.mode == "toy", args.mode == "real"
    plan = args.samples > 1 or args.batch > 1
    # no decoder named: the toy's is measure.choose's; --gamma alone names the chain
    # (the compiled stream: its tree is --tree's; the chooser's compiled profile is not run for it)
    args.choose = args.tree is None and args.gamma is None and toy_mode and not args.relaxed and not (
        args.stream and args.compile)
    args.tree = 0 if args.tree is None and args.gamma is not None else args.tree
    args.gamma = evaluate.GAMMA if args.gamma is None else args.gamma
    args.tree = evaluate.TREE if args.tree is None else args.tree
    src, no_hf, plans_ = args.processor or args.target, not importlib.util.find_spec("transformers"), args.samples > 1
    size = re.fullmatch(r"(\d+)x(\d+)", args.image_size) if real_mode else True
    for bad, msg in ((args.gamma > args.max_new, f"--gamma {args.gamma} is more than --max-new {args.max_new}: the "
                      "chain would draft tokens that can never be emitted"),
                     (args.tree and args.tree.depth > args.max_new, f"--tree {chooser.shape_key(args.tree)}'s depth is "
                      f"more than --max-new {args.max_new}: the tree would draft tokens that can never be emitted"),
                     (args.relaxed and plan, "--relaxed is measured on one row per prompt (not --samples / --batch)"),
                     (args.relaxed and real_mode and not args.scenes, "--relaxed is priced in the plan: the toy, or "
                      "real --scenes (the action expert)"),
                     (args.samples > 1 and args.temperature == 0, f"--samples {args.samples} at --temperature 0 "
                      "decodes identical greedy rows: give --temperature > 0 (Alpamayo-R1: 0.6 --top-p 0.98)"),
                     (toy_mode and args.prompts % args.batch, f"--prompts {getattr(args, 'prompts', 0)} is not a "
                      f"multiple of --batch {args.batch}: every plan has --batch prompts (a partial last plan would "
                      "be dropped)"),
                     (args.reprofile and not args.choose, "--reprofile measures the chooser's profile again: it goes "
                      "with the toy's chosen decoder (no --tree, --gamma or --relaxed, no --compile --stream)"),
                     (args.stream < 0 or args.stream == 1, f"--stream takes the frames of a clip, >= 2 (0: off), got "
                      f"{args.stream}"),
                     (args.stream and real_mode and not args.scenes, "--stream runs clips: the toy's, or real "
                      "--scenes (its scene folders in name order, each with its time_s)"),
                     (args.stream and (args.batch > 1 or args.relaxed),
                      "--stream times decodes of one prompt per frame (its --samples rows, sampled with "
                      "--temperature): it takes no --batch or --relaxed"),
                     (args.stream and (args.samples > 1) != (args.temperature > 0), "--stream's plan of --samples "
                      "rows is sampled (--temperature > 0), a greedy one is one row"),
                     (not 0 <= args.stream <= driving.MAX_CLIP_FRAMES, f"--stream takes 0..{driving.MAX_CLIP_FRAMES} "
                      f"frames a clip (a stream reads the frames before it), got {args.stream}"),
                     (toy_mode and args.stream_interval != ap.get_default("stream_interval") and not args.stream,
                      "--stream-interval goes with --stream"),
                     *((getattr(args, f) is not None and not os.path.isdir(getattr(args, f)),
                        f"--{f.replace('_', '-')} {getattr(args, f)}: folder not found")
                       for f in ("target", "draft", "images_dir", "processor", "scenes")),
                     (not size or real_mode and not all(1 <= int(n) <= 8192 for n in size.groups()),  # a camera frame
                      f"--image-size must be HxW in pixels, each in 1..8192 (e.g. 288x512), got "
                      f"{getattr(args, 'image_size', None)!r}"),
                     (real_mode and args.min_pixels > args.max_pixels, "--min-pixels and --max-pixels must satisfy "
                      f"min <= max, got {getattr(args, 'min_pixels', 0)} and {getattr(args, 'max_pixels', 0)}"),
                     (args.scenes and args.images_dir, "--scenes takes no --images-dir (the scenes hold the images)"),
                     (args.scenes and args.temperature > 0 and not plans_, "--scenes takes no --temperature (greedy "
                      "only: its outputs are compared token by token; sampled rows: --samples N)"),
                     (args.scenes and args.compile and not plans_, "--scenes takes no --compile (the eager decoders "
                      "are timed)"),
                     (args.scenes and no_hf, "--scenes builds prompts with the folder's tokenizer, which needs "
                      "transformers: pip install -r requirements-test.txt"),
                     (args.images_dir and importlib.util.find_spec("PIL") is None,
                      "--images-dir needs Pillow to read the images: pip install pillow"),
                     (src and no_hf and alpamayo.has_tokenizer(src),
                      f"{src} has a tokenizer, which needs transformers: pip install -r requirements-test.txt"),
                     (real_mode and args.image_size != ap.get_default("image_size") and (args.scenes or
                                                                                         args.images_dir),
                      "--image-size shapes generated images: a prompt of --scenes or --images-dir ignores it")):
        if bad:
            ap.error(msg)
    for flag, what, field in (("layers", "keeps 1..n_layers decoder layers", "n_layers"),
                              ("draft_vocab", "takes 1..vocab_size token ids", "vocab_size")):
        v, hi = getattr(args, flag, None), args.preset and getattr(M.PRESETS[args.preset], field)
        if args.preset and v != ap.get_default(flag) and not 1 <= v <= hi:
            ap.error(f"--{flag.replace('_', '-')} {what} of the preset ({args.preset}: 1..{hi}), got {v}")
    with cli.user_errors(ap):  # below: the chain of --gamma (--tree 0), or a tree (a ValueError if it is impossible)
        args.decoder = args.tree or args.gamma
        if args.tree and (n := args.tree.candidates(args.tree.depth)) > MAX_TREE_CANDIDATES:
            raise ValueError(f"--tree {chooser.shape_key(args.tree)} grows {n} candidates a round, more than "
                             f"{MAX_TREE_CANDIDATES}")
        cli.check_device(args.device)
        if args.images_dir:  # every image a regular file, before the target loads: a FIFO among them would hang
            files.listed(args.images_dir, files.IMAGE_SUFFIXES)
        if args.draft and checkpoint.existing_kind(args.draft) == "target":
            raise ValueError(f"--draft {args.draft} holds a target model, not a draft (it would accept every token)")
        toy_ids, vocab, expert = (), None, None
        if toy_mode:  # the model's shape, known before loading: the toy's from its header
            needed = [os.path.join(args.run, "target"), args.draft or checkpoint.draft_dir(args.run, *TOY_DRAFT)]
            if missing := [d for d in needed if not os.path.isdir(d)]:
                raise ValueError(f"no toy checkpoints (missing {', '.join(missing)}): use the shipped checkpoints/toy, "
                                 f"or train them with `python rsd.py --retrain --run {args.run}`")
            cfg = checkpoint.header(needed[0])[1]
            check_fits(args, cfg, checkpoint.header(needed[1])[1].draft_vocab)
            toy_ids, vocab, expert = driving.Tokenizer().encode(driving.commitment_words()), cfg.vocab_size, True
        elif args.preset:
            check_fits(args, M.PRESETS[args.preset], args.draft_vocab)
        if args.relaxed and args.target:  # the target's vocabulary checks --commitments; its expert prices the plan
            cfg, _, alpamayo_raw = hf.read_config(args.target)
            vocab, expert = cfg.vocab_size, alpamayo_raw is not None
        if args.relaxed and expert is False:
            raise ValueError(f"--relaxed is priced by how far the action expert's plan moves: --target {args.target} "
                             "is a plain Qwen-VL with no action expert, where nothing prices it")
        sampling = flags.sampling(args.temperature, args.top_k, args.top_p, args.sampling_seed,
                                flags.relaxed_rule(args.relaxed, args.commitments, toy_ids, vocab))
        args.out = (TOY_JSON if toy_mode else None) if args.out is None else args.out or None  # "": no report file
        if args.out:
            check_out(args, toy_mode)
    return sampling


def check_out(args, toy_mode):
    """A ValueError unless --out may take the report: outside the shipped checkpoints and every input folder, and
    nothing there but a bench report (a JSON object with a "mode"); its folder writable, all before any work."""
    if os.path.commonpath([os.path.abspath(args.out), SHIPPED_DIR]) == SHIPPED_DIR:
        raise ValueError(f"--out {args.out} is inside the shipped {SHIPPED_DIR}: write the report elsewhere")
    files.check_out_dir(args.out, {"--run": args.run if toy_mode else None, "--target": args.target,
                                   "--draft": args.draft, "--scenes": args.scenes, "--processor": args.processor,
                                   "--images-dir": args.images_dir})
    if os.path.lexists(args.out):
        try:  # a regular file only: opening a FIFO would wait for a writer forever
            with open(args.out, "rb") if os.path.isfile(args.out) else contextlib.nullcontext() as f:
                ok = f is not None and f.read(1) == b"{" and "mode" in files.read_json(args.out)  # a bench report
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"--out {args.out} exists and is not a bench.py report (a JSON object with a \"mode\"): "
                             "refusing to replace it; give another --out")
    cli.check_out(args.out, default=TOY_JSON)


def check_fits(args, cfg, draft_vocab=0):
    """A ValueError unless the decoders fit the model cfg: a tree's k children per node among the draft's token ids,
    --max-new and a round's block (--gamma, or --tree's nodes) within its positions (a prompt's own: at decoding)."""
    nodes = args.tree.nodes if args.tree else 0
    vocab, block = draft_vocab or cfg.vocab_size, max(args.gamma, nodes)  # the chain of --gamma beside a tree
    if args.tree and args.tree.width > vocab:
        raise ValueError(f"--tree {chooser.shape_key(args.tree)}'s width is more than the draft's {vocab} token ids (a "
                         "node's children are distinct tokens)")
    if args.max_new + block > cfg.max_seq_len:
        flag = f"--tree {chooser.shape_key(args.tree)}" if nodes > args.gamma else f"--gamma {args.gamma}"
        raise ValueError(f"--max-new {args.max_new} and {flag} need {args.max_new + block} positions beyond the "
                         f"prompt, more than the model's {cfg.max_seq_len}")


if __name__ == "__main__":
    main()
