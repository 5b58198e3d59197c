#!/usr/bin/env bash
# Training numerics unchanged by a refactor: distil both drafts for a few steps from the shipped target with this
# checkout and with an earlier commit (one thread each, same settings), and compare the saved draft weights bit for bit.
# run: bash experiments/compare_training.sh [REV]          (default 3aef757, the last commit before issue #23's clean-up)
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:-3aef757}
work=$(mktemp -d)
git worktree add -q "$work/old" "$rev"
trap 'git worktree remove --force "$work/old"; rm -rf "$work"' EXIT
for side in old new; do
  src=$([ "$side" = old ] && echo "$work/old" || pwd)
  mkdir -p "$work/$side-run" && cp -r "$src/checkpoints/toy/target" "$work/$side-run/target"
  (cd "$src" && OMP_NUM_THREADS=1 python3 train.py --stage drafts --out "$work/$side-run" --n-train 200 \
     --draft-steps 12 --eval-every 1000 > "$work/$side.log" 2>&1)
done
python3 - "$work" <<'PY'
import sys
from safetensors.torch import load_file
w = sys.argv[1]
for kind in ("flat", "mrope"):
    a, b = (load_file(f"{w}/{s}-run/draft_{kind}_s0/model.safetensors") for s in ("old", "new"))
    same = sorted(a) == sorted(b) and all(bool((a[k] == b[k]).all()) for k in a)
    print(f"draft_{kind}_s0: {len(a)} tensors, {'bit-identical' if same else 'DIFFERENT'}")
PY
