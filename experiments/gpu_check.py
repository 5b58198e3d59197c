"""The GPU run, ready: the CUDA-only tests and the reasoning-step benchmark at both real-shape presets (random
weights), eager and torch.compile'd in the same process, written to one JSON. Paper: the ~4x lower reasoning-step
latency is a GPU claim; this is the check a user with one GPU runs first (docs: README, "On a GPU").

Each preset is `python bench.py --device cuda --preset NAME --compile --json`: target-only and speculative decoding,
eager and compiled (CUDA graphs over the static cache, mode "reduce-overhead"), with the cost model of both and
the greedy check of the compiled arms (bf16: divergences are named with the target's top-2 margin). The draft is
random at these shapes, so tau is ~1 and the speed-up to read is the cost model's prediction at the toy's alpha
(printed when runs/bench_toy.json exists: run `python bench.py --device cpu` first) and the measured step times.
One failure does not lose the rest: it is recorded under its name.

run: python experiments/gpu_check.py [--out experiments/gpu_check.json] [--presets qwen2.5-vl-7b,qwen3-vl-8b]
     (plumbing on a CPU: python experiments/gpu_check.py --device cpu --layers 1 --images 1 --skip-tests
      --max-new 3 --presets qwen2.5-vl-7b --out /tmp/gpu_check.json)
"""
import argparse
import contextlib
import io
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import checkpoint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_tests():
    """The tests that only run on CUDA (the lower-right verify mask, CUDA-graph decoding), slow ones included."""
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests", "--slow", "-k", "cuda"], cwd=ROOT,
                       capture_output=True, text=True)
    lines = p.stdout.strip().splitlines()
    return {"returncode": p.returncode, "summary": lines[-1] if lines else "", "wall_s": time.time() - t0,
            "output_tail": "\n".join(lines[-30:])}


def preset_run(name, device, max_new, repeats, layers=None, images=16):
    t0 = time.time()
    out = io.StringIO()
    argv = ["--device", device, "--preset", name, "--compile", "--max-new", str(max_new), "--repeats", str(repeats),
            "--images", str(images)]
    try:
        with contextlib.redirect_stdout(out):
            res = bench.main(argv + (["--layers", str(layers)] if layers else []))
    except Exception:  # recorded, and the next preset still runs
        res = {"error": traceback.format_exc()}
    finally:
        torch._dynamo.reset()  # the next preset's graphs are its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    res["report"] = out.getvalue()
    res["wall_s"] = time.time() - t0
    print(res["report"] or res.get("error", ""), flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description="CUDA tests + bench.py --device cuda --compile at the real presets.")
    ap.add_argument("--out", default="experiments/gpu_check.json", help="the one JSON written (atomically)")
    ap.add_argument("--presets", default="qwen2.5-vl-7b,qwen3-vl-8b", help="comma-separated bench.py presets")
    ap.add_argument("--max-new", type=int, default=32, help="reasoning tokens per decode")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (median)")
    ap.add_argument("--skip-tests", action="store_true", help="only the benchmarks")
    ap.add_argument("--device", default="cuda", help="cuda; cpu (with --layers 1) only checks the script's plumbing")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers (plumbing checks)")
    ap.add_argument("--images", type=int, default=16, help="images per prompt (16: Alpamayo's ~2,900 visual tokens)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: this script is the GPU check (python bench.py --device cpu is the CPU one)")
    os.chdir(ROOT)  # bench.py reads the toy's alpha from runs/bench_toy.json, relative to the repo
    result = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else args.device,
              "torch": torch.__version__, "layers": args.layers, "presets": {}}
    if not args.skip_tests:
        result["tests"] = cuda_tests()
        print(f"CUDA tests: {result['tests']['summary']}", flush=True)
    for name in args.presets.split(","):
        result["presets"][name] = preset_run(name, args.device, args.max_new, args.repeats, args.layers, args.images)
    checkpoint.write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
