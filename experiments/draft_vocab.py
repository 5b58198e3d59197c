"""The reduced-vocabulary draft head (model.VLA.head, EAGLE-3's reduced draft vocabulary): what it costs the toy
draft's tau, and what it saves a draft step on the toy and at the real shape.

Paper: the routine reasoner (a 1-layer draft q) shares the target p's LM head, and the measured cost model
(docs/background.md, "Speculative decoding") is speed-up = tau * T_target(1) / (gamma * T_draft(1) +
T_target(gamma + 1)). At the real shape the shared 151,936 x 4,096 head is most of the draft's step; a head over the
K tokens a CoC uses makes T_draft(1) smaller, and costs tau only where the target writes a token outside the set
(verification stays lossless: such a token always comes from the target).

--toy: FlatRoPE (and replica) drafts distilled from the shipped target checkpoints/toy/target with the full head and
with reduced heads of K ids (train.select_draft_vocab: <cot_end> + the commonest ids of the training CoCs; by default
the smallest K covering all of the training CoC tokens and the smallest covering 90% of them), the same seed,
batches and steps in every arm (--steps: half the shipped drafts' 300, so that each arm trains in about 4 min of one
core's time on a machine shared with other training; the shipped 300-step drafts are evaluated beside them for
scale). Held-out tau by gamma from the exact greedy replay (evaluate.draft_matches, tau_by_gamma), and T_draft(1),
T_target(1), T_target(gamma + 1) (timing.step_times, medians over interleaved passes) in fp32 and bf16. Drafts are
trained into --work (skipped when there), one arm per run with --arms, so that no single training run is long.

Clocks: the steps are timed by this process's CPU time (time.process_time, on --threads 1), which on a CPU shared
with other work counts the step's own cost where the wall clock adds the time spent waiting for a core; the toy also
records wall-clock times. Memory-bandwidth contention from other work still slows both heads alike.

--real: bench.build_preset's random-weight qwen3-vl-8b (bf16, the real 151,936-token vocabulary and width) with 1
and 2 decoder layers: T_draft(1) with the full head, with reduced heads of --real-ks ids (the first K ids: random
weights, so which ids does not change the time) and with the K rows gathered per step instead of kept (the
alternative VLA.head_rows avoids); T_target(1) and T_target(gamma + 1) at 1 and 2 layers give the per-layer cost,
from which the 36-layer step is extrapolated (an extrapolation, not a measurement). Text-only prompt (--prompt-len
random ids): the vision tower's cost is not the point. With both parts in the JSON, "prediction" is the cost model's
speed-up for each head at one tau (predict).

run: python experiments/draft_vocab.py --toy --real    (writes experiments/draft_vocab.json; about 15 min on one
     free core: each toy arm's training about 4 min (its "train_cpu_s"), the toy evaluation 2 min, the real part
     1 min; each part records its command, threads, wall and CPU time there)
"""
import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench  # noqa: E402
from ops import checkpoint  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import cli, files  # noqa: E402
import model as M  # noqa: E402
import train as T  # noqa: E402
from driving import Data  # noqa: E402
from measure.timing import step_times  # noqa: E402
from evaluate import measured_speedup  # noqa: E402

GAMMAS = tuple(range(2, 9))
KINDS = ("flat", "mrope")

# ---- toy ----
OUT = "runs/draft_vocab.json"  # git-ignored: a quick run never replaces the committed JSON


def coverage_k(counts, share):
    """The smallest K whose K commonest ids hold `share` of the counted tokens."""
    c = counts.sort(descending=True).values.double().cumsum(0) / counts.sum()  # (V,)
    return int((c < share - 1e-12).sum()) + 1


def train_arm(work, arm, k, steps, target, train):
    """Distil both drafts (FlatRoPE, replica) with the full head (k 0) or k ids into work/arm; skipped when there."""
    out = os.path.join(work, arm)
    if all(os.path.isdir(checkpoint.draft_dir(out, kind, 0)) for kind in KINDS):
        return
    cfg = T.TrainConfig(out=out, draft_steps=steps, draft_vocab=k, eval_every=10 ** 9)
    t0, c0 = time.time(), time.process_time()
    with files.writer_lock(out):
        T.train_drafts(cfg, target, train)
    files.write_json(os.path.join(out, "wall.json"), {"train_s": time.time() - t0, "steps": steps,
                                                           "train_cpu_s": time.process_time() - c0,
                                                           "threads": torch.get_num_threads()})


def toy_times(run, drafts_by_arm, prompt, dtype, passes, reps, gamma, timer):
    """{arm: {t_draft_1, t_target_1, t_target_gamma1} in ms}: medians over `passes` interleaved passes of
    timing.step_times (each a median of reps steps, read by timer) with the target and the arm's FlatRoPE draft
    in dtype."""
    target = checkpoint.load(os.path.join(run, "target"), dtype=dtype).eval()
    drafts = {arm: checkpoint.load(path, target=target).eval() for arm, path in drafts_by_arm.items()}
    p = {k: v.to(dtype) if v.is_floating_point() else v for k, v in prompt.items()}
    got = {arm: [] for arm in drafts}
    for _ in range(passes):
        for arm, d in drafts.items():
            got[arm].append(step_times(target, d, p, (1, gamma + 1), reps, timer))
    return {arm: {"t_draft_1": 1e3 * statistics.median(t["draft"] for t in ts),
                  "t_target_1": 1e3 * statistics.median(t["target"][1] for t in ts),
                  "t_target_gamma1": 1e3 * statistics.median(t["target"][gamma + 1] for t in ts)}
            for arm, ts in got.items()}


def toy(a):
    target = checkpoint.load(os.path.join(a.run, "target")).eval()  # read before the scenes are built
    tok = driving.Tokenizer()
    train = Data("train", T.TrainConfig().n_train, 0, tok)
    counts = torch.bincount(torch.tensor([t for c in train.coc_ids() for t in c]), minlength=len(tok))  # (V,)
    ks = [int(k) for k in a.ks.split(",")] if a.ks else [coverage_k(counts, s) for s in (1.0, 0.9)]
    arms = {"full": 0, **{f"k{k}": k for k in ks}}
    for arm in (a.arms.split(",") if a.arms else arms):
        train_arm(a.work, arm, arms[arm], a.steps, target, train)
    if a.arms:  # training only: evaluate when every arm is there
        return None
    test = Data("test", a.scenes, 0, tok)
    outputs = evaluate.greedy_outputs(target, test)
    paths = {(arm, kind): checkpoint.draft_dir(os.path.join(a.work, arm), kind, 0) for arm in arms for kind in KINDS}
    paths.update({("shipped", kind): checkpoint.draft_dir(a.run, kind, 0) for kind in KINDS})
    drafts = {key: checkpoint.load(p, target=target).eval() for key, p in paths.items()}
    matches = evaluate.draft_matches(drafts, target, test, outputs)
    result = {}
    out_tokens = [t for o in outputs for t in o]
    for arm, k in {**arms, "shipped": 0}.items():
        ids = getattr(drafts[(arm, "flat")], "vocab_ids", None)
        inside = set(range(len(tok))) if ids is None else set(ids.tolist())
        wall = os.path.join(a.work, arm, "wall.json")
        result[arm] = {
            "K": k or len(tok),
            "steps": a.steps if arm != "shipped" else T.TrainConfig().draft_steps,
            "train_coc_coverage": float(counts[list(inside)].sum() / counts.sum()),
            "test_output_coverage": sum(t in inside for t in out_tokens) / len(out_tokens),
            **{f"tau_{kind}": {g: v["tau"] for g, v in evaluate.tau_by_gamma(matches[(arm, kind)], GAMMAS).items()}
               for kind in KINDS},
            **({k: files.read_json(wall)[k] for k in ("train_s", "train_cpu_s")} if os.path.exists(wall) else {})}
    prompt = evaluate.scene_prompts(test.scenes[:1], tok, "cpu")[0]
    flat = {arm: paths[(arm, "flat")] for arm in arms}
    for clock, timer in (("cpu", time.process_time), ("wall", time.perf_counter)):
        times = {name: toy_times(a.run, flat, prompt, dtype, a.passes, a.reps, a.gamma, timer)
                 for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
        for arm in arms:
            result[arm][f"{clock}_times_ms"] = {name: t[arm] for name, t in times.items()}
    for arm, r in result.items():
        t = r.get("cpu_times_ms", {})
        print(f"{arm:8s} K {r['K']:3d}  coverage train {r['train_coc_coverage']:.3f} "
              f"test {r['test_output_coverage']:.3f}"
              f"  held-out tau at gamma 4 / {a.gamma}: FlatRoPE {r['tau_flat'][4]:.2f} / {r['tau_flat'][a.gamma]:.2f}"
              f"  replica {r['tau_mrope'][4]:.2f} / {r['tau_mrope'][a.gamma]:.2f}"
              + (f"  T_draft(1) (CPU time) fp32 {t['fp32']['t_draft_1']:.3f} ms bf16 {t['bf16']['t_draft_1']:.3f} ms"
                 if t else ""))
    return {"scenes": a.scenes, "steps": a.steps, "ks": ks, "gamma": a.gamma, "arms": result,
            "timing": {"prompt_tokens": int(prompt["input_ids"].shape[1]), "passes": a.passes, "reps": a.reps}}


# ---- real shape ----


def real(a):
    """Step times (ms, CPU time) of the qwen3-vl-8b preset, bf16, random weights, 1 and 2 decoder layers; the
    36-layer target step extrapolated from the per-layer difference."""
    g = torch.Generator().manual_seed(0)
    prompt = {"input_ids": torch.randint(1000, 100_000, (1, a.prompt_len), generator=g)}  # ordinary Qwen ids
    ks = [int(k) for k in a.real_ks.split(",")]
    ms = lambda t, d, lengths: step_times(t, d, prompt, lengths, a.real_reps, time.process_time)  # noqa: E731
    target_ms, draft_ms = {}, {}
    for layers in (1, 2):
        target, draft = bench.build_preset(a.preset, "cpu", torch.bfloat16, layers=layers)
        t = ms(target, draft, (1, a.gamma + 1))
        target_ms[layers] = {"t_target_1": 1e3 * t["target"][1], "t_target_gamma1": 1e3 * t["target"][a.gamma + 1]}
        print(f"{a.preset} {layers} layer(s): T_target(1) {target_ms[layers]['t_target_1']:.1f} ms, "
              f"T_target({a.gamma + 1}) {target_ms[layers]['t_target_gamma1']:.1f} ms", flush=True)
        if layers == 1:
            draft_ms["full"] = 1e3 * t["draft"]
            for k in ks:
                d = M.make_draft(target, **M.DRAFT_PRESETS[f"{a.preset}-draft"], vocab_ids=torch.arange(k)).eval()
                draft_ms[f"k{k}"] = 1e3 * ms(target, d, ())["draft"]
                if k == ks[0]:  # the alternative to the kept rows: gather them from the (V, D) head every step
                    d.head_rows = lambda d=d: d.lm_head.weight.index_select(0, d.vocab_ids)  # noqa: E731
                    draft_ms[f"k{k}_gather_per_step"] = 1e3 * ms(target, d, ())["draft"]
                del d
            for name, v in draft_ms.items():
                print(f"  T_draft(1) {name}: {v:.1f} ms", flush=True)
        del target, draft, t
        gc.collect()
    n = M.PRESETS[a.preset].n_layers
    per_layer = {key: target_ms[2][key] - target_ms[1][key] for key in target_ms[1]}
    full = {key: target_ms[1][key] + (n - 1) * per_layer[key] for key in per_layer}  # extrapolated
    ratios = {name: v / full["t_target_1"] for name, v in draft_ms.items()}
    print(f"per layer: T_target(1) {per_layer['t_target_1']:.1f} ms; extrapolated {n} layers: T_target(1) "
          f"{full['t_target_1']:.0f} ms, T_target({a.gamma + 1}) {full['t_target_gamma1']:.0f} ms; "
          + ", ".join(f"c {name} {c:.3f}" for name, c in ratios.items()))
    return {"preset": a.preset, "dtype": "bf16", "clock": "process CPU time", "prompt_tokens": a.prompt_len,
            "reps": a.real_reps, "gamma": a.gamma, "t_draft_1_ms": draft_ms, "t_target_ms_by_layers": target_ms,
            "per_layer_ms": per_layer, f"extrapolated_{n}_layers_ms": full, "c_extrapolated": ratios}


def predict(res):
    """Leviathan's measured cost model at the real shape (the extrapolated 36-layer target steps, each head's
    T_draft(1)) at one tau for every head: the shipped FlatRoPE draft's held-out toy tau at the real part's gamma.
    Equal tau isolates the head's cost; the toy part measures what a reduced head does to tau."""
    real, g = res["real"], res["real"]["gamma"]
    taus = res["toy"]["arms"]["shipped"]["tau_flat"]
    tau = taus.get(g, taus.get(str(g)))  # int keys in memory, str keys once read back from the JSON
    t = next(v for k, v in real.items() if k.startswith("extrapolated_"))
    return {"tau": tau, "gamma": g, "tau_from": "toy shipped FlatRoPE draft, held-out",
            "speedup": {head: measured_speedup(tau, t["t_target_1"], ms, t["t_target_gamma1"], g)
                        for head, ms in real["t_draft_1_ms"].items()}}


# ---- main ----


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toy", action="store_true", help="distil and evaluate the toy's reduced-head drafts")
    ap.add_argument("--real", action="store_true", help="time the real-shape draft and target steps")
    ap.add_argument("--device", default="cpu", help="torch device (this experiment is written for cpu)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the machine is shared)")
    ap.add_argument("--run", default="checkpoints/toy", help="toy: folder with target/ and the shipped drafts")
    ap.add_argument("--work", default="runs/draft_vocab", help="toy: where the arms' drafts are trained")
    ap.add_argument("--ks", default=None, help="toy: reduced sizes K, comma-separated (default: the smallest K "
                    "covering 100%% and 90%% of the training CoC tokens)")
    ap.add_argument("--arms", default=None, help="toy: train only these arms (full, k<K>), comma-separated, and stop")
    ap.add_argument("--steps", type=int, default=150, help="toy: distillation steps of every arm")
    ap.add_argument("--scenes", type=int, default=64, help="toy: held-out test scenes for tau")
    ap.add_argument("--passes", type=int, default=3, help="toy: interleaved timing passes (median)")
    ap.add_argument("--reps", type=int, default=20, help="toy: steps per timing (median)")
    ap.add_argument("--real-reps", type=int, default=10, help="real: steps per timing (median)")
    ap.add_argument("--gamma", type=int, default=evaluate.GAMMA, help="draft length of T_target(gamma + 1)")
    ap.add_argument("--preset", default="qwen3-vl-8b", help="real: model.PRESETS shape")
    ap.add_argument("--real-ks", default="32768,4096", help="real: reduced sizes K, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=128, help="real: text-only prompt tokens")
    ap.add_argument("--out", default=OUT, help="the JSON (the README's: experiments/draft_vocab.json)")
    a = cli.checked(ap, ap.parse_args(argv), counts=("threads", "steps", "scenes", "passes", "reps", "real_reps",
                                                     "gamma", "prompt_len"), out=OUT)
    with cli.user_errors(ap):
        for flag in ("ks", "real_ks"):
            if getattr(a, flag) is not None:
                cli.number_list(getattr(a, flag), "--" + flag.replace("_", "-"), rule=">= 1")
    if not (a.toy or a.real):
        ap.error("give --toy, --real or both")
    if a.device != "cpu":
        ap.error("this experiment times the CPU (bench.py preset ... --device cuda --draft-vocab K on a GPU)")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cli.progress("draft vocab: " + " and ".join(p for p in ("toy", "real") if getattr(a, p)))
    command = "python experiments/draft_vocab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    res = files.read_json(a.out) if os.path.exists(a.out) else {}
    for part, fn in (("toy", toy), ("real", real)):
        if getattr(a, part):
            t0, c0 = time.time(), time.process_time()
            load = os.getloadavg()[0]
            out = fn(a)
            if out is not None:
                res[part] = {"command": command, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                             "load_average_at_start": load, "torch": torch.__version__, **out,
                             "wall_s": time.time() - t0, "cpu_s": time.process_time() - c0}
                if "toy" in res and "real" in res:
                    res["prediction"] = predict(res)
                files.write_json(a.out, res)
                print(f"wrote {a.out} [{part}] ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
