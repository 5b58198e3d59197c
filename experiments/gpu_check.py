"""The first GPU run, in stages: what a user with one GPU runs first, sized for one command of at most ten minutes.
Paper: the ~4x lower reasoning-step latency is a GPU claim; this measures the step times behind it at the real shape
(qwen3-vl-8b, random weights) and checks the CUDA-only paths (CUDA-graph decoding, chain and tree).

The stages run in the order of what they teach. Each writes DIR/<stage>.json (atomically) the moment it ends, so a
run cut short keeps every stage it finished; a stage that fails records its traceback and the next one still runs.

  a_env          the machine (GPU, torch / CUDA / cuDNN / triton / transformers versions) and the attention kernel
                 of the target's prefill, decode and verify steps (the same steps --compile compiles), at
                 the preset's shapes (probes.sdpa_steps: the dispatcher's choice and which backends run alone)
  b_cuda_tests   only the CUDA tests (pytest -k cuda --slow), CUDA-graph skips made errors
                 (TORCHINDUCTOR_CUDAGRAPH_OR_ERROR=1, and the CUDA-graph test asserts inductor's skip counter stayed
                 at zero and graphs were captured and replayed)
  c_eager        the eager cost model at full depth: T_target(n) for every n in --steps (1 to 64: a gamma + 1 verify),
                 a draft tree's verify over x_last + 8 / 16 / 32 / 64 nodes and one tree level of the draft
                 (VLA.step under a tree mask, timing.tree_step_times), T_draft(1) with the full head and with a
                 --draft-vocab head, the prefill (vision tower + prompt), and the speed-up these predict at gamma
                 1..8 at the toy's recorded acceptance and for the default tree at the toy's recorded tree tau
  d_compiled     the compiled cost model (CUDA graphs, mode "reduce-overhead"; inductor on a CPU) at a few depths
                 (--compiled-layers): compile time of each step shape, T_target(1), T_target(gamma+1), T_draft(1),
                 the default tree's verify and fused growth (tree.grow) and the speed-up they predict at the toy's
                 tree tau, and probes.CompileWatch's count of compilations after the compile pass (must be none) and of the
                 CUDA graphs captured, replayed and skipped
  e_full         the same at full depth, if the budget still allows it by the compile time per layer that (d)
                 measured; otherwise written with skipped: true, the estimate and the reason

Estimate on one H200 (from the operations each stage runs, not yet measured; a cold inductor cache): start and
imports 15 s; (a) 20 s; (b) 120 s (the CUDA-graph test compiles six graphs of a tiny model); (c) 60 s (one 8B model
built on the GPU, 64 step lengths x 11 steps, 3 prefills of ~2,900 tokens); (d) 150 s at 1 and 2 layers (three
step shapes each, the 1-layer draft at each depth); (e) about 36 x (d)'s compile time per layer, so it runs only if
(d) leaves the budget enough. Default run without (e): about 6 minutes, under the default --budget of 450 s.

run: python experiments/gpu_check.py --out DIR [--budget 450]        (on the GPU machine: --out "$OUT")
     python experiments/gpu_check.py --device cpu --layers 1 --out DIR  (the plumbing on a CPU; about 2-3 minutes)
"""
import argparse
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from real import alpamayo  # noqa: E402
import bench  # noqa: E402
from ops import cli, compiled  # noqa: E402
import evaluate  # noqa: E402
from experiments import probes  # noqa: E402
from ops import files  # noqa: E402
import model as M  # noqa: E402
import speculate  # noqa: E402
from measure import timing  # noqa: E402
from evaluate import tree_speedup  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the recorded toy acceptances (relative to ROOT) the real shape's predictions are made at: the chain's (gamma 6), the
# default tree's
TOY_ACCEPTANCE, TOY_TREE_ACCEPTANCE = "experiments/bench_cpu.json", "experiments/bench_cpu_tree.json"
STAGES = ("a_env", "b_cuda_tests", "c_eager", "d_compiled", "e_full")
GAMMAS = range(1, 9)
TREE_NODES = (8, 16, 32, 64)  # tree verifies timed in stage c: x_last + N nodes


def toy_acceptance(path, want=None):
    """A toy bench.py report's acceptance for a real-shape prediction; a ValueError if it has none worth predicting
    at."""
    full = path if os.path.isabs(path) or os.path.exists(path) else os.path.join(ROOT, path)
    if not os.path.lexists(full):
        raise ValueError(f"--toy-json {path}: no such file (the committed default is {TOY_ACCEPTANCE})")
    d = files.read_json(full)
    if not isinstance(d, dict) or d.get("mode") != "toy" or not isinstance(d.get("alpha"), (int, float)):
        raise ValueError(f"--toy-json {path}: not a toy bench.py report (needs mode 'toy' and an alpha)")
    draft = d.get("draft", "")
    if os.path.basename(os.path.normpath(draft)) == "target" or draft == d.get("target"):
        raise ValueError(f"--toy-json {path}: its draft {draft} is the target itself (its alpha says nothing)")
    recorded = d.get("decoder") or {"kind": "chain", "gamma": d.get("gamma")}  # reports before trees: a chain
    if want is not None and want["kind"] == "tree" and recorded != want:
        raise ValueError(f"--toy-json {path} ran {timing.decoder_name(recorded)}, this run {timing.decoder_name(want)}: "
                         "a tree's prediction needs the toy's tau with the same tree (bench.py --device cpu --json "
                         "writes one)")
    return {"source": path, "alpha": d["alpha"], "decoder": recorded, "draft": draft,
            **{k: d.get(k) for k in ("tau", "gamma", "prompts", "dtype", "decoding", "torch", "hardware")}}


def parse_steps(text):
    """'1-64' or '1,2,4' -> a sorted list of step lengths."""
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out or min(out) < 1:
        raise ValueError(f"--steps takes step lengths >= 1 ('1-64' or '1,2,4'), got {text!r}")
    return sorted(out)


class Run:
    """The run's clock, budget and output folder: each stage's JSON written the moment it ends."""

    def __init__(self, args):
        self.args, self.t0 = args, time.time()
        self.device = torch.device(args.device)
        self.models = {}

    def elapsed(self):
        return time.time() - self.t0

    def left(self):
        return self.args.budget - self.elapsed()

    def write(self, stage, res):
        path = os.path.join(self.args.out, stage + ".json")
        files.write_json(path, res)
        print(f"[{self.elapsed():6.0f} s] {stage}: {res.get('status')} -> {path}", flush=True)

    def stage(self, name, fn):
        t = time.time()
        try:
            res = {"status": "ok", **fn(self)}
        except Exception:  # recorded; the next stage still runs
            res = {"status": "error", "error": traceback.format_exc()}
        finally:
            torch._dynamo.reset()  # the next stage's graphs are its own
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        res.update(stage=name, wall_s=time.time() - t, run_elapsed_s=self.elapsed(), budget_s=self.args.budget,
                   preset=self.args.preset, device=str(self.device))
        self.write(name, res)
        return res

    def build(self, layers):
        """The preset at `layers` decoder layers (random weights, seed 0) and its 1-layer draft, built once per depth
        and kept for the later stages (random init of the 151,936 x 4,096 embedding and head is most of a build)."""
        if layers not in self.models:
            torch.manual_seed(0)
            full = M.PRESETS[self.args.preset].n_layers
            self.models[layers] = bench.build_preset(self.args.preset, self.device, cli.DTYPES[self.args.dtype],
                                                     None if layers == full else layers)
        return self.models[layers]

    def prompt(self, target):
        p = alpamayo.real_prompt(target.cfg, self.device, n_images=self.args.images, grid=self.args.image_grid)
        if "pixel_values" in p:
            p["pixel_values"] = p["pixel_values"].to(cli.DTYPES[self.args.dtype])
        return p

    def depth(self):
        return self.args.layers or M.PRESETS[self.args.preset].n_layers


# ---- the stages ----


def env_stage(run):
    """(a) The machine and the attention kernels, on a 1-layer model of the preset (every layer's attention has the
    same shapes)."""
    target, _ = run.build(1)
    prompt = run.prompt(target)
    return {"environment": timing.environment(run.device), "prompt_tokens": prompt["input_ids"].shape[1],
            "gamma": run.args.gamma,
            "threads": torch.get_num_threads(),
            "sdpa": probes.sdpa_steps(target, prompt, run.args.gamma)}


def tests_stage(run):
    """(b) The CUDA tests only, slow ones included, in a subprocess (its own dynamo state), with CUDA-graph skips
    made errors; bounded by what is left of the budget."""
    env = dict(os.environ, TORCHINDUCTOR_CUDAGRAPH_OR_ERROR="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "tests", "--slow", "-k", "cuda", "-p", "no:cacheprovider"]
    timeout = max(30.0, min(run.args.tests_timeout, run.left() - 60))
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        lines = (p.stdout + p.stderr).strip().splitlines()
        out = {"returncode": p.returncode, "summary": lines[-1] if lines else ""}
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        lines = text.strip().splitlines()
        out = {"returncode": None, "summary": f"timed out after {timeout:.0f} s"}
    out.update(command=" ".join(cmd[1:]), env="TORCHINDUCTOR_CUDAGRAPH_OR_ERROR=1", output_tail="\n".join(lines[-40:]),
               ok=out["returncode"] == 0, ran=" passed" in out["summary"] or " failed" in out["summary"])
    return out


def step_costs(model, prompt, lengths, reps, embeds=None, deepstack=None):
    """{n: T(n) in ms} for every step length n: the prompt (but its last token) prefilled once into a cache with room
    for the longest step, then each n-token forward timed (timing.median_time, after one warm-up) and cropped
    back (the verifier's rollback), as timing.step_times does for each n with one prefill per n."""
    L = prompt["input_ids"].shape[1]
    if embeds is None:
        embeds, deepstack = speculate.embed_prompt(model, prompt)  # (1, L, D)
    cache = model.new_cache(batch=1, max_len=L + max(lengths))
    speculate.prefill(model, prompt, embeds, cache, deepstack)
    base, x = cache.length, prompt["input_ids"][:, -1:]
    out = {}
    for n in lengths:
        xs = x.repeat(1, n)  # (1, n): token values do not change a step's time

        def step():
            speculate.feed(model, cache, xs)
            cache.crop(base)
        out[n] = 1e3 * timing.median_time(step, prompt["input_ids"].device, reps)
    return out


def predictions(t_target, t_draft, toy):
    """The speed-up the cost model predicts at gamma 1..8 at the toy's alpha (gamma + 1 <= the longest timed step)."""
    out = {}
    for g in GAMMAS:
        if g + 1 in t_target:
            tau = evaluate.expected_tau(toy["alpha"], g)
            out[g] = evaluate.measured_speedup(tau, t_target[1], t_draft, t_target[g + 1], g)
    return out


@torch.no_grad()
def eager_stage(run):
    """(c) The eager real-shape cost model at the run's depth."""
    a = run.args
    target, draft = run.build(run.depth())
    prompt = run.prompt(target)
    clock = timing.Clock(run.device, enabled=True)

    def prefill():
        cache = target.new_cache(batch=1, max_len=prompt["input_ids"].shape[1])
        e, ds = speculate.embed_prompt(target, prompt)
        speculate.prefill(target, prompt, e, cache, ds)
    prefill_ms = 1e3 * timing.median_time(prefill, run.device, 3)
    embeds, deepstack = speculate.embed_prompt(target, prompt)
    t_target = step_costs(target, prompt, a.steps, a.reps, embeds, deepstack)
    t_draft = step_costs(draft, prompt, [1], a.reps, embeds)[1]
    # the tree's own steps (VLA.step under a mask, as tree.tree_round runs them): the verify over x_last + N
    # nodes and one draft level of k nodes, with the full and the reduced head
    tree = evaluate.TREE
    tt = timing.tree_step_times(target, draft, prompt, TREE_NODES, tree.width, a.reps)
    del draft
    reduced = M.make_draft(target, n_layers=1, vocab_ids=torch.arange(a.draft_vocab)).eval()
    t_reduced = step_costs(reduced, prompt, [1], a.reps, embeds)[1]
    level_reduced = timing.tree_step_times(target, reduced, prompt, (), tree.width, a.reps)["draft_level"]
    toy = toy_acceptance(a.toy_json)
    toy_tree = toy_acceptance(TOY_TREE_ACCEPTANCE, timing.decoder_json(tree))
    t_verify = {n + 1: 1e3 * v for n, v in tt["target"].items()}  # (ms) keyed by tokens verified, x_last included
    tree_pred = {head: tree_speedup(toy_tree["tau"], t_target[1], td, 1e3 * lv, t_verify[tree.nodes + 1], tree)
                 for head, td, lv in (("full", t_draft, tt["draft_level"]), ("reduced", t_reduced, level_reduced))}
    return {"what": "eager steps (no_grad), median of --reps after one warm-up, each on a cache holding the prompt "
                    "and cropped back; the tree's verify and draft level as tree.tree_round runs them",
            "layers": run.depth(), "dtype": a.dtype, "images": a.images, "image_grid": a.image_grid,
            "prompt_tokens": prompt["input_ids"].shape[1],
            "reps": a.reps, "prefill_ms": prefill_ms, "t_target_ms": t_target, "t_draft_1_ms": t_draft,
            "draft_vocab": a.draft_vocab, "t_draft_1_reduced_ms": t_reduced,
            "c": t_draft / t_target[1], "c_reduced": t_reduced / t_target[1], "toy_acceptance": toy,
            "predicted_speedup": predictions(t_target, t_draft, toy),
            "predicted_speedup_reduced": predictions(t_target, t_reduced, toy),
            "tree": timing.decoder_json(tree), "t_tree_verify_ms": t_verify,
            "tree_verify_ratio": {n: v / t_target[1] for n, v in t_verify.items()},
            "t_draft_level_ms": {"full": 1e3 * tt["draft_level"], "reduced": 1e3 * level_reduced},
            "toy_tree_acceptance": toy_tree, "predicted_speedup_tree": tree_pred,
            "peak_memory": timing.peak_memory(run.device), "setup_and_timing_s": clock.lap()}


@torch.no_grad()
def compiled_costs(run, layers):
    """Compiled steps at `layers` decoder layers: each shape's first calls timed (compile, and on CUDA the graph's
    warm-up run and recording), then the step times, with what CompileWatch saw."""
    a, g = run.args, run.args.gamma
    target, draft = run.build(layers)
    prompt = run.prompt(target)
    L, tree = prompt["input_ids"].shape[1], evaluate.TREE
    # every step a compiled chain of gamma and a compiled tree take: target-only 1, the verifies gamma + 1 and N + 1
    # (the tree's under its mask), the draft's pending 1 and 2 tokens and a tree level of k (under its mask)
    shapes = (("target", 1, False), ("target", g + 1, False), ("target", tree.nodes + 1, True), ("draft", 1, False),
              ("draft", 2, False), ("draft", tree.width, True))
    t_lengths, d_lengths = (1, g + 1, tree.nodes + 1), (1, 2, tree.width)
    max_len = L + max(g, tree.nodes) + max(t_lengths)
    ct, cd = compiled.CompiledSteps(target, max_len, t_lengths), compiled.CompiledSteps(draft, max_len, d_lengths)
    watch = probes.CompileWatch({"target": ct, "draft": cd})
    embeds, deepstack = speculate.embed_prompt(target, prompt)
    x = prompt["input_ids"][:, -1:]
    compile_s = {}
    try:
        for name, n, masked in shapes:
            dec = ct if name == "target" else cd
            cache = dec.new_cache()
            speculate.prefill(dec, prompt, embeds, cache, deepstack if name == "target" else None)
            base, slots = cache.length, cache.slots(n)  # (1, n)
            mask = M.causal_mask(slots, cache, cache.max_len)  # (1, n, S)
            clock = timing.Clock(run.device, enabled=True)
            for _ in range(3):  # compile; on CUDA the graph's warm-up run, then its recording
                if masked:  # as tree.tree_round calls it
                    dec.step(x.repeat(1, n), slots, cache, positions=slots, mask=mask)
                else:
                    speculate.feed(dec, cache, x.repeat(1, n))
                    cache.crop(base)
            compile_s[f"{name} T={n}" + (" tree" if masked else "")] = clock.lap()
        clock = timing.Clock(run.device, enabled=True)
        timing.grow_time(ct, cd, prompt, tree, reps=2)  # the tree's levels fused into one graph (tree.grow)
        compile_s["draft grow"] = clock.lap()
        watch.next_phase("timed")
        t_target = step_costs(ct, prompt, [1, g + 1], a.reps, embeds, deepstack)
        t_draft = step_costs(cd, prompt, [1], a.reps, embeds)[1]
        tt = timing.tree_step_times(ct, cd, prompt, (tree.nodes,), tree.width, a.reps)
        t_grow = 1e3 * timing.grow_time(ct, cd, prompt, tree, a.reps)
    finally:
        watch.close()
    toy = toy_acceptance(a.toy_json)
    toy_tree = toy_acceptance(TOY_TREE_ACCEPTANCE, timing.decoder_json(tree))
    tau = evaluate.expected_tau(toy["alpha"], g)
    t_verify, t_level = 1e3 * tt["target"][tree.nodes], 1e3 * tt["draft_level"]
    return {"layers": layers, "compile_s": compile_s, "compile_s_total": sum(compile_s.values()),
            "t_target_ms": t_target, "t_draft_1_ms": t_draft, "gamma": g,
            "predicted_speedup_at_toy_alpha": evaluate.measured_speedup(tau, t_target[1], t_draft, t_target[g + 1], g),
            "tree": timing.decoder_json(tree), "t_tree_verify_ms": t_verify, "t_draft_level_ms": t_level,
            "t_draft_grow_ms": t_grow, "predicted_tree_speedup_at_toy_tau": tree_speedup(
                toy_tree["tau"], t_target[1], t_draft, t_level, t_verify, tree, t_grow),
            "compilations": watch.report(), "peak_memory": timing.peak_memory(run.device)}


def compiled_stage(run):
    """(d) The compiled cost model at a few depths, and the compile time per added layer."""
    depths = [k for k in run.args.compiled_layers if k <= run.depth()]
    out = {"what": "torch.compile'd steps (compiled.CompiledSteps; mode reduce-overhead on CUDA: CUDA graphs; inductor "
                   "with freezing on a CPU): the chain's (target 1 and gamma + 1, draft 1 and 2) and the default "
                   "tree's (its verify of N + 1 and a draft level of k, under their masks, and its whole growth "
                   "fused, tree.grow); compile_s: the first three calls of each shape; timings as in c_eager",
           "depths": {}}
    for i, k in enumerate(depths):
        if i:  # a deeper model compiles longer: stop before a depth that the last one's time says would not fit
            last = out["depths"][depths[i - 1]]
            estimate = last["compile_s_total"] * k / depths[i - 1] + 30
            if estimate > run.left():
                out["skipped_depths"] = {"layers": depths[i:], "estimate_s": estimate, "left_s": run.left()}
                break
        out["depths"][k] = compiled_costs(run, k)
        torch._dynamo.reset()
        print(f"[{run.elapsed():6.0f} s]   compiled at {k} layers: {out['depths'][k]['compile_s_total']:.0f} s "
              f"to compile", flush=True)
    depths = sorted(out["depths"])
    if len(depths) >= 2:
        lo, hi = depths[0], depths[-1]
        d = out["depths"]
        out["compile_s_per_layer"] = (d[hi]["compile_s_total"] - d[lo]["compile_s_total"]) / (hi - lo)
        full, g = M.PRESETS[run.args.preset].n_layers, run.args.gamma
        per = {n: (d[hi]["t_target_ms"][n] - d[lo]["t_target_ms"][n]) / (hi - lo) for n in (1, g + 1)}
        out["extrapolated_full_depth"] = {
            "what": f"compiled T_target(n) at {full} layers, extrapolated linearly from these depths (a "
                    "prediction: e_full measures it when the budget allows)",
            "t_target_ms": {n: d[hi]["t_target_ms"][n] + per[n] * (full - hi) for n in (1, g + 1)}}
    return out


def full_stage(run, compiled):
    """(e) The compiled cost model at full depth, if (d)'s compile times say it fits in what is left of the budget."""
    full = run.depth()
    depths = (compiled or {}).get("depths", {})
    if not depths:
        return {"skipped": True, "why": "stage d measured no depth, so there is no compile-time estimate"}
    if full in depths:
        return {"skipped": True, "layers": full, "why": f"the full depth here ({full} layers) is one of stage d's "
                "depths: its numbers are in d_compiled.json", "same_as": depths[full]}
    top = max(depths)
    # floored: a slope between two small depths can be noise, and an estimate too low would overrun the command
    per_layer = max(compiled.get("compile_s_per_layer") or 0.0, depths[top]["compile_s_total"] / top / 4)
    estimate = depths[top]["compile_s_total"] + max(0.0, per_layer) * (full - top) + 30  # + build and timing
    left = run.left()
    if estimate > left:
        return {"skipped": True, "layers": full, "estimate_s": estimate, "left_s": left,
                "why": f"compiling {full} layers would take about {estimate:.0f} s by stage d's compile times, "
                       f"{left:.0f} s of the --budget are left"}
    return {"skipped": False, "estimate_s": estimate, **compiled_costs(run, full)}


# ---- main ----


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description="The staged GPU check: environment, CUDA tests, eager and compiled "
                                             "cost models at a real shape; one JSON per stage.")
    ap.add_argument("--out", required=True, help="folder for the stages' JSON (on the GPU machine: $OUT)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds the whole run may take; stage e runs only "
                    "if its estimate fits (default 450)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu (with --layers 1) checks the plumbing")
    ap.add_argument("--preset", default="qwen3-vl-8b", choices=sorted(k for k in M.PRESETS if not k.startswith("toy")))
    ap.add_argument("--layers", type=int, default=None, help="the depth of stages c and e (default: the preset's)")
    ap.add_argument("--compiled-layers", default="1,2", help="stage d's depths (comma-separated)")
    ap.add_argument("--steps", default=None, help="stage c's step lengths (default 1-64 on CUDA, "
                    "1,2,4,7,8,16,32,64 on a CPU)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per step (median; default 10 on CUDA, 3 on "
                    "a CPU)")
    ap.add_argument("--images", type=int, default=None, help="images per prompt (default 16 on CUDA, Alpamayo's "
                    "~2,900 visual tokens; 1 on a CPU)")
    ap.add_argument("--image-grid", default=None, help="patches per image, TxHxW (default 1x20x36 on CUDA: 180 "
                    "merged tokens, Alpamayo's; 1x4x8 on a CPU, where the 27-layer vision tower would take seconds)")
    ap.add_argument("--gamma", type=int, default=6, help="draft length of the compiled verify step")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="stage c's reduced draft head (token ids)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(cli.DTYPES))
    ap.add_argument("--toy-json", default=TOY_ACCEPTANCE, help="the toy acceptance of the predictions")
    ap.add_argument("--tests-timeout", type=float, default=240.0, help="stage b's limit in seconds")
    ap.add_argument("--stages", default=",".join(STAGES), help="the stages to run (comma-separated names)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (--device cpu --layers 1 checks the plumbing)")
    try:
        cli.check_device(args.device)
        args.steps = parse_steps(args.steps or ("1-64" if cuda else "1,2,4,7,8,16,32,64"))
        args.compiled_layers = sorted({int(k) for k in args.compiled_layers.split(",")})
        args.image_grid = tuple(int(k) for k in (args.image_grid or ("1x20x36" if cuda else "1x4x8")).split("x"))
        if len(args.image_grid) != 3 or min(args.image_grid) < 1:
            raise ValueError(f"--image-grid takes TxHxW patches, got {args.image_grid}")
        toy_acceptance(args.toy_json)
    except ValueError as e:
        ap.error(str(e))
    full = M.PRESETS[args.preset].n_layers
    if args.layers is not None and not 1 <= args.layers <= full:
        ap.error(f"--layers takes 1..{full} for {args.preset}, got {args.layers}")
    if min(args.compiled_layers) < 1:
        ap.error(f"--compiled-layers takes depths >= 1, got {args.compiled_layers}")
    if args.gamma + 1 > max(args.steps) or 1 not in args.steps:
        ap.error(f"--steps must hold 1 and gamma + 1 = {args.gamma + 1}")
    stages = args.stages.split(",")
    if set(stages) - set(STAGES):
        ap.error(f"--stages takes names among {', '.join(STAGES)}, got {args.stages}")
    args.reps = args.reps or (10 if cuda else 3)
    args.images = args.images or (16 if cuda else 1)
    with cli.user_errors(ap):
        cli.check_values(args, [(">= 1", ("reps", "images", "gamma", "draft_vocab")),
                                ("a finite number > 0", ("budget", "tests_timeout"))], flags=True)
        files.check_writable(cli.check_out(args.out, folder=True))  # made here, before any work
    cli.progress(f"gpu check: stages {', '.join(stages)} on {args.device}")
    run = Run(args)
    timing.reset_peak_memory(run.device)
    results = {}
    for name, fn in (("a_env", env_stage), ("b_cuda_tests", tests_stage), ("c_eager", eager_stage),
                     ("d_compiled", compiled_stage),
                     ("e_full", lambda r: full_stage(r, results.get("d_compiled")))):
        if name in stages:
            results[name] = run.stage(name, fn)
    print(f"done in {run.elapsed():.0f} s: " + ", ".join(f"{k} {v['status']}" for k, v in results.items()))
    return results


if __name__ == "__main__":
    main()
