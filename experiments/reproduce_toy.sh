#!/usr/bin/env bash
# The exact commands that produced the shipped toy checkpoints (checkpoints/toy) and the experiment JSONs the README
# cites, in order. On 2 CPU cores this takes hours (docs/toy-notes.md has each step's wall time); every step resumes
# or skips what is already in runs/.
# run: bash experiments/reproduce_toy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python train.py --stage target --out runs/toy                                  # the target (deliberative reasoner)
for s in 0 1 2; do
  python train.py --stage drafts --out runs/toy --draft-seed "$s"               # replica + FlatRoPE drafts, seed s
done
python train.py --stage drafts --out runs/toy --kinds history --draft-seeds 0,1,2  # the history-only drafts (shipped)
python experiments/aarl_ablation.py --run runs/toy --work runs/toy_aarl --overwrite --out experiments/aarl_ablation.json  # static / moving / none x 3 seeds (a rerun redoes them)
for s in 0 1 2; do                                                              # the static anchor's drafts ship
  rm -rf "runs/toy/draft_aarl_s$s" && cp -r "runs/toy_aarl/draft_aarl_static_s$s" "runs/toy/draft_aarl_s$s"
done
python experiments/ship_toy.py --run runs/toy --out checkpoints/toy              # + metrics.json
python experiments/views_sweep.py --run runs/toy --out experiments/views_sweep.json
python train.py --stage target --out runs/toy_seed1 --seed 1                    # a second target seed -> experiments/target_seed1_metrics.json (its train_metrics.json)
pids=()                                                                         # the seed-robust schedule, both seeds at once
for s in 0 1; do
  OMP_NUM_THREADS=1 python train.py --stage target --out "runs/toy_s${s}_7500" --seed "$s" --target-steps 7500 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done                                      # a plain `wait` would hide a failure
for s in 0 1; do cp "runs/toy_s${s}_7500/train_metrics.json" "experiments/target_7500_s${s}_metrics.json"; done
python experiments/rope_base.py --run runs/toy --out experiments/rope_base.json
python experiments/peer_hf.py --device cpu --prompts 16 --repeats 5 --out experiments/peer_hf.json  # ours beside HF
                                                                                # generate and assisted generation
python bench.py --device cpu --json --tree 0 | tail -n 1 > experiments/bench_cpu.json  # the chain (before trees)
python bench.py --device cpu --json --tree 0 --draft checkpoints/toy/draft_flat_s0 --gamma 7 | tail -n 1 > experiments/bench_cpu_flat_g7.json
python experiments/tree_sweep.py --out experiments/tree_sweep.json
python experiments/tree_paths.py --out experiments/tree_paths.json
python experiments/tree_real.py --out experiments/tree_real.json
python bench.py --device cpu --json | tail -n 1 > experiments/bench_cpu_tree.json        # the default tree + chain arm
python bench.py --device cpu --json | tail -n 1 > experiments/bench_cpu_tree_run2.json   # the same, a second run
python bench.py --device cpu --json --draft checkpoints/toy/draft_flat_s0 | tail -n 1 > experiments/bench_cpu_tree_flat.json
python rsd.py --json | tail -n 1 > experiments/rsd_toy.json                     # the README's table, tree rows included
