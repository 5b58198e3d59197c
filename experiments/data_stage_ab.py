"""The own-target data stage, before and after it decoded a scene's samples as one batch: the toy target exported as
a Qwen2.5-VL folder and loaded back (the path a real target takes), N toy training scenes, `--samples` CoCs per scene
at Alpamayo-R1's release settings (temperature 0.6, top-p 0.98), each sample seeded by scenes.sample_seed. "one at a
time": speculate.autoregressive per sample (the data stage before); "batched": scenes.distill_data as it is (one
autoregressive_batch per scene, its prefill shared). Both in one process, alternating, wall time of the whole stage
(prefill included); the records are compared token for token. Paper: the routine reasoner is distilled on the
deliberative reasoner's own CoCs; this is what producing them costs.

run: python experiments/data_stage_ab.py [--scenes 16] [--samples 6] [--pairs 3] [--out experiments/data_stage_ab.json]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ops import checkpoint, cli, files  # noqa: E402

OUT = "runs/data_stage_ab.json"  # git-ignored: a quick run never replaces the committed JSON
import driving  # noqa: E402
from real import distill, hf, scenes  # noqa: E402
import speculate  # noqa: E402
from hf_export import export_pretrained  # noqa: E402


def one_at_a_time(target, prompts, stop, max_new, samples, seed):
    """The data stage's decoding before: each sample its own batch-1 decode -> [token lists]."""
    out = []
    for scene_id, prompt in prompts:
        prompt = hf.on_model(scenes.built(scene_id, prompt), target)
        for k in range(samples):
            sampling = speculate.Sampling(0.6, top_p=0.98, seed=scenes.sample_seed(seed, scene_id, k))
            out.append(speculate.autoregressive(target, prompt, max_new, sampling, stop).tokens)
    return out


def batched(target, prompts, stop, max_new, samples, seed, work):
    """The data stage as it is (scenes.distill_data, a fresh folder) -> [token lists] in the order written."""
    out = tempfile.mkdtemp(dir=work)
    scenes.distill_data(target, prompts, out, [stop], max_new, speculate.Sampling(0.6, top_p=0.98), samples, seed)
    return [r["tokens"] for r in scenes.read_distill_data(out)]


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenes", type=int, default=16)
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--work", default="runs/data_stage_ab")
    ap.add_argument("--out", default=OUT, help="the JSON (the README's: experiments/data_stage_ab.json)")
    args = cli.checked(ap, ap.parse_args(argv), counts=("scenes", "samples", "pairs", "max_new"), out=OUT)
    cli.progress(f"data stage A/B: {args.pairs} pairs over {args.scenes} scenes x {args.samples} samples")
    torch.set_num_threads(2)
    os.makedirs(args.work, exist_ok=True)
    folder = os.path.join(args.work, "hf_target")
    if not os.path.exists(os.path.join(folder, hf.CONFIG)):
        export_pretrained(checkpoint.load(os.path.join(checkpoint.SHIPPED, "target")).eval(), folder)
    target = distill.load_target(folder).eval()
    tok = driving.Tokenizer()
    world = driving.make_split("train", args.scenes, 0)
    prompts = [(f"toy{i}", driving.build_prompt(s, tok, driving.WorldConfig().views)) for i, s in enumerate(world)]
    times, records = {"one at a time": [], "batched": []}, {}
    for _ in range(args.pairs):
        for name in times:
            t = time.perf_counter()
            records[name] = (one_at_a_time(target, prompts, tok.cot_end_id, args.max_new, args.samples, 0)
                             if name == "one at a time" else
                             batched(target, prompts, tok.cot_end_id, args.max_new, args.samples, 0, args.work))
            times[name].append(time.perf_counter() - t)
    res = {"scenes": args.scenes, "samples": args.samples, "temperature": 0.6, "top_p": 0.98, "dtype": "fp32",
           "threads": torch.get_num_threads(), "wall_s": times,
           "median_s": {k: statistics.median(v) for k, v in times.items()},
           "records_identical": records["one at a time"] == records["batched"],
           "distinct_cocs_per_scene": statistics.mean(
               len({tuple(c) for c in records["batched"][i:i + args.samples]})
               for i in range(0, len(records["batched"]), args.samples))}
    res["speedup"] = res["median_s"]["one at a time"] / res["median_s"]["batched"]
    print(res)
    files.write_json(args.out, res)


if __name__ == "__main__":
    main()
