"""Where `python rsd.py`'s wall time goes: rsd.main run once under cProfile, its stages' cumulative seconds (each the
time inside that function, calls below it included; stages can nest, so they do not sum to the wall time), beside
the wall time. Paper: the table (rsd.py); the measuring-room issue asks the main job to take at most 120 s on 2 CPU
cores, and this says which stage to shorten.

run: python experiments/profile_rsd.py [--out runs/profile_rsd.json] [rsd.py's flags]
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from ops import cli, files  # noqa: E402
from measure import timing  # noqa: E402
import rsd  # noqa: E402

OUT = "runs/profile_rsd.json"
# stage: (file, function) as cProfile names them, in the order rsd.run reaches them
STAGES = {"greedy and real decoding of the test scenes (the target's CoCs, then every row's)": ("rsd.py", "real"),
          "the target's commitment accuracy": ("evaluate.py", "commitment_acc"),
          "the target's ADE": ("evaluate.py", "trajectory_ade"),
          "the decoders' search record and this machine's profile": ("rsd.py", "find_search"),
          "the val sweep (none where the search record holds it)": ("rsd.py", "val_sweep"),
          "the table": ("rsd.py", "paper_table"),
          "  every draft's teacher-forced replay": ("evaluate.py", "draft_matches"),
          "  every draft's commitment accuracy": ("evaluate.py", "commitment_accs"),
          "  the attention split": ("evaluate.py", "attention_split"),
          "  the timed pass": ("timing.py", "time_arms"),
          "the printed scenes": ("rsd.py", "show_scenes"),
          "the world's routine share": ("driving.py", "routine_share"),
          "the stream section": ("rsd.py", "stream_rows"),
          "the relaxed section": ("rsd.py", "relaxed_rows")}


def stage_seconds(stats):
    """{stage: cumulative seconds} of the stages that ran (pstats keys: (path, line, function))."""
    out = {}
    for (path, _, fn), (_, _, _, cum, _) in stats.stats.items():
        for stage, (file, name) in STAGES.items():
            if fn == name and path.endswith(os.sep + file):
                out[stage] = out.get(stage, 0.0) + cum
    return {s: round(out[s], 2) for s in STAGES if s in out}


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=OUT, help="the JSON")
    a, rest = ap.parse_known_args(argv)
    a = cli.checked(ap, a, out=OUT, program="experiments/profile_rsd.py")
    if "--json" in rest:
        ap.error("rsd.py's --json is this probe's own output: give --out")
    rsd.parse_args(rest)  # rsd.py's flags checked before the run (its own one-line errors)
    cli.progress(f"python rsd.py {' '.join(rest)} under cProfile")
    prof, t0 = cProfile.Profile(), time.time()
    prof.runcall(rsd.main, rest)
    wall = time.time() - t0
    stages = stage_seconds(pstats.Stats(prof))
    res = {"command": "python experiments/profile_rsd.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "rsd_flags": rest, "wall_s": round(wall, 1), "stages_s": stages, "threads": torch.get_num_threads(),
           "environment": timing.environment("cpu")}
    files.write_json(a.out, res)
    print(f"\nrsd.py under cProfile: {wall:.0f} s wall (the profiler adds a few percent)")
    for stage, s in stages.items():
        print(f"  {stage:44s} {s:7.1f} s")
    print(f"wrote {a.out}")
    return res


if __name__ == "__main__":
    main()
