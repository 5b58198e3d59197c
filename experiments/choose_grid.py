"""Is the chooser's pick the fastest on this machine? Every candidate of measure/choose.py (target-only, the chains of
gamma 1-8, the tree family) timed in the same interleaved passes over the toy's held-out test plans, beside what the
chooser predicted for each from its profile and the val rounds: the chosen decoder's measured speed-up against the
best of the grid, and its prediction against its measurement.

Paper: none; the machine-dependent choice of decoder (docs/results.md, "Chosen for the machine").

run: python experiments/choose_grid.py --out experiments/choose_grid_eager.json
     python experiments/choose_grid.py --compile --out experiments/choose_grid_compiled.json
     python experiments/choose_grid.py --batch 6 --out experiments/choose_grid_batch6.json
     python experiments/choose_grid.py --samples 6 --temperature 0.6 --top-p 0.98 --out ...samples6.json
     python experiments/choose_grid.py --split val --test-seed 201 --out experiments/choose_grid_val_eager_s201.json
        (a design check on fresh val scenes: the prediction without the shift from val to the held-out test split)
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import checkpoint, cli, files  # noqa: E402
from measure import choose, flags, timing  # noqa: E402
import speculate  # noqa: E402



@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description="Every candidate decoder timed in the same passes, beside the chooser.")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", *sorted(cli.DTYPES)])
    ap.add_argument("--prompts", type=int, default=32, help="held-out test scenes (a multiple of --batch)")
    ap.add_argument("--batch", type=int, default=1, help="prompts per plan")
    ap.add_argument("--samples", type=int, default=1, help="rows per prompt (sampled: give --temperature)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (median)")
    ap.add_argument("--compile", action="store_true", help="every arm on compiled steps (the compiled profile)")
    ap.add_argument("--reprofile", action="store_true", help="measure the machine's profile again")
    ap.add_argument("--run", default=checkpoint.SHIPPED, help="toy checkpoints: its target and FlatRoPE + AARL seed 0")
    ap.add_argument("--test-seed", type=int, default=0, help="the held-out plans' scenes (driving.make_split's seed): "
                    "a grid measured once for a claim is spent, the next claim draws another")
    ap.add_argument("--split", choices=("test", "val"), default="test", help="the grid's plans: held-out test scenes "
                    "(a claim), or fresh scenes of val's distribution (--test-seed > 0; seed 0 is the chooser's own): "
                    "a design check, the prediction without the shift from val to test")
    ap.add_argument("--out", required=True, help="the JSON record")
    flags.add_decoding_flags(ap, "every arm sampling (Alpamayo-R1: 0.6, --top-p 0.98)")
    a = ap.parse_args(argv)
    with cli.user_errors(ap):
        cli.check_out(a.out)
        for folder in (checkpoint.SHIPPED, a.run):  # never a checkpoint this run reads or the repo ships
            if os.path.commonpath([os.path.abspath(a.out), os.path.abspath(folder)]) == os.path.abspath(folder):
                raise ValueError(f"--out {a.out} is inside the checkpoints folder {folder}: write the record elsewhere")
        cli.check_values(a, [("in 0..2**30-1", ("test_seed",))], flags=True)  # the repo's rule for a seed
        if a.split == "val" and a.test_seed == 0:
            raise ValueError("--split val --test-seed 0 would time the chooser's own val plans: give a seed > 0")
        if min(a.prompts, a.batch, a.samples) < 1 or a.prompts % a.batch or a.repeats < 1:
            raise ValueError("--prompts, --batch, --samples and --repeats must be >= 1; --prompts a multiple of "
                             "--batch")
        sampling = flags.sampling(a.temperature, a.top_k, a.top_p, a.sampling_seed)
        if a.samples > 1 and sampling.greedy:
            raise ValueError("--samples > 1 needs --temperature > 0 (greedy rows would be identical)")
    t0 = time.time()
    device = torch.device(a.device)
    dtype_name, why = choose.auto_dtype(device) if a.dtype == "auto" else (a.dtype, "as given")
    with cli.user_errors(ap):  # a folder without the checkpoints: one line
        target = checkpoint.load(os.path.join(a.run, "target"), dtype=cli.DTYPES[dtype_name], device=device).eval()
        draft = checkpoint.load(checkpoint.draft_dir(a.run, "aarl", 0), target=target).eval()
    tok, views = driving.Tokenizer(), driving.WorldConfig().views
    split = lambda name, n, seed: evaluate.scene_prompts(driving.make_split(name, n, seed=seed), tok,  # noqa: E731
                                                         device, cli.DTYPES[dtype_name], views)
    val = split("val", choose.val_prompts(a.batch, a.samples), 0)  # the chooser's val plans, as bench.py draws them
    plans = timing.plan_batches(split(a.split, a.prompts, a.test_seed), a.batch)
    rows, stop, max_new = a.batch * a.samples, tok.cot_end_id, evaluate.MAX_NEW_TOKENS
    decoders = [c for c in choose.candidates() if c]
    t, d = target, draft
    if a.compile:
        cli.progress("compiling every candidate's steps (minutes on a CPU)")
        t, d = timing.compiled_pair(target, draft, val + plans, decoders, max_new, rows, choose.COMPILED_LENGTHS)
    ranked, rec = choose.choice(t, d, val[0], timing.plan_batches(val, a.batch), max_new, stop, sampling, a.samples,
                                mode="compiled" if a.compile else "eager", reprofile=a.reprofile)

    def run(c, j):  # plan j's rows seeded as timing.plans seeds them: the same draws in every pass
        kw = dict(samples=a.samples, stop_token=stop, sampling=sampling.offset(rows * j), timing=True)
        if c is None:
            return speculate.autoregressive_batch(t, plans[j], max_new, **kw)
        return speculate.speculative_batch(t, d, plans[j], c, max_new, **kw)

    cli.progress(f"timing {len(decoders) + 1} arms: a warm-up and {a.repeats} passes over {len(plans)} plans")
    runs = timing.interleaved({choose.name(c): lambda j, c=c: run(c, j) for c in choose.candidates()}, len(plans),
                              a.repeats, device)
    grid = timing.summary(timing.plan_cost(runs), runs, a.repeats, len(plans), 1, "ms_per_plan")
    for n, g in grid.items():
        results = [r for x in runs[n][0] for r in x.result]
        rounds = sum(max(r.rounds for r in x.result) for x in runs[n][0]) / len(plans)  # a plan's: its slowest row's
        # the prediction's two factors apart: rounds (val's against these held-out plans') and a round's time
        g |= {"tau": speculate.SpecResult.pooled(results).tau, "rounds_per_plan": rounds,
              "round_ms": g["ms_per_plan"] / rounds, "predicted_round_ms": rec["predicted"][n]["round_ms"],
              "predicted_speedup": rec["predicted"][n]["predicted_speedup"]}
    best = max(grid, key=lambda n: grid[n]["speedup"])
    chosen, pred, to = grid[rec["chosen"]], rec["predicted"][rec["chosen"]], grid[evaluate.TARGET_ONLY]
    # the chosen's prediction over its measurement (their product), as two factors: the rounds it saves (target-only's
    # rounds over its; predicted: the prediction at equal round times, the harder val plans') over on these held-out
    # plans, and its round's time over target-only's, measured here over predicted
    time_pred = pred["round_ms"] / rec["predicted"][evaluate.TARGET_ONLY]["round_ms"]
    factors = {"rounds": pred["predicted_speedup"] * time_pred / (to["rounds_per_plan"] / chosen["rounds_per_plan"]),
               "round_time": chosen["round_ms"] / to["round_ms"] / time_pred}
    out = {"what": "every candidate timed in the same passes (ms per plan, until every row is done; median of the "
                   "passes), the chooser's prediction beside it", "command": "python experiments/choose_grid.py "
           + " ".join(argv if argv is not None else sys.argv[1:]),
           "hardware": choose.hardware(device), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": dtype_name, "dtype_why": why,
           "mode": rec["mode"], "rows": rows, "plans": len(plans), "split": a.split,
           "test_seed": a.test_seed,
           "decoding": flags.sampling_json(sampling),
           "choice": rec, "grid": grid, "best": best,
           "chosen_over_best": chosen["speedup"] / grid[best]["speedup"],
           "prediction_error": chosen["predicted_speedup"] / chosen["speedup"] - 1,
           "prediction_over_measurement": factors, "wall_s": time.time() - t0}
    for n, g in grid.items():
        print(f"{n:<14} predicted {g['predicted_speedup']:.2f}x   measured {g['speedup']:.2f}x "
              f"[{g['speedup_range'][0]:.2f}-{g['speedup_range'][1]:.2f}]   {g['ms_per_plan']:.1f} ms/plan   "
              f"tau {g['tau']:.2f}   round {g['round_ms']:.1f} ms (predicted {g['predicted_round_ms']:.1f})"
              + ("   <- chosen" if n == rec["chosen"] else ""))
    print(f"{out['hardware']}, {dtype_name} ({why}), {rec['mode']}, {rows} row(s): chosen {rec['chosen']} measured "
          f"{chosen['speedup']:.2f}x = {out['chosen_over_best']:.2f} of the grid's best ({best}, "
          f"{grid[best]['speedup']:.2f}x); predicted {chosen['predicted_speedup']:.2f}x "
          f"({100 * out['prediction_error']:+.0f}%; the rounds saved x{factors['rounds']:.2f}, the round's time "
          f"x{factors['round_time']:.2f})")
    files.write_json(a.out, out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
