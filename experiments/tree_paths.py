"""Where a draft tree's accepted paths leave the draft's first choice: every CoC token of the held-out split, by
who supplied it (an accepted draft token that was the draft's argmax, an accepted one from a lower-ranked branch, or
the target's own) and by what it is (a routine word or a commitment, driving.commitment_positions).

Paper: the routine reasoner supplies the routine tokens, the deliberative reasoner the commitments; a tree lets the
draft hedge between its top candidates where it is unsure (EAGLE-2's dynamic tree, tree.grow).

run: python experiments/tree_paths.py [--tree 32/8/3] [--scenes 64] [--out experiments/tree_paths.json]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from ops import checkpoint  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import cli, files  # noqa: E402
from measure import flags  # noqa: E402
import speculate  # noqa: E402

KINDS = {"replica": "mrope", "flatrope": "flat", "flatrope+aarl": "aarl"}


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default="checkpoints/toy")
    ap.add_argument("--tree", default="32/8/3", help="N/D/k")
    ap.add_argument("--scenes", type=int, default=64)
    ap.add_argument("--out", default="runs/tree_paths.json",  # git-ignored: never the committed JSON
                    help="the JSON (the README's: experiments/tree_paths.json)")
    a = cli.checked(ap, ap.parse_args(argv), counts=("scenes",), lists=(),
                    out="runs/tree_paths.json")
    cli.progress(f"tree paths: {a.scenes} test scenes")
    torch.set_num_threads(1)
    with cli.user_errors(ap):
        shape = flags.tree_shape(a.tree)
    tok = driving.Tokenizer()
    target = checkpoint.load(os.path.join(a.run, "target")).eval()
    data = driving.Data("test", a.scenes, 0, tok)
    prompts = evaluate.scene_prompts(data.scenes, tok, "cpu", views=data.views_at(0))
    outputs = evaluate.greedy_outputs(target, data)
    refs = data.coc_ids()
    same = [i for i, (o, r) in enumerate(zip(outputs, refs)) if list(o) == list(r)]  # commitment masks align there
    out = {"tree": [shape.nodes, shape.depth, shape.width], "scenes": a.scenes, "scenes_used": len(same), "rows": {}}
    for row, kind in KINDS.items():
        draft = checkpoint.load(checkpoint.draft_dir(a.run, kind, 0), target=target).eval()
        match = evaluate.draft_matches({row: draft}, target, data, outputs)[row]  # draft argmax == target's token
        counts = {c: {"first_choice": 0, "lower_branch": 0, "target": 0} for c in ("routine", "commitment")}
        for i in same:
            res = speculate.speculative(target, draft, prompts[i], shape, evaluate.MAX_NEW_TOKENS,
                                        stop_token=tok.cot_end_id)
            assert res.tokens == list(outputs[i])
            for k, (fd, m, c) in enumerate(zip(res.from_draft, match[i], data.scenes[i].commit)):
                who = "target" if not fd else "first_choice" if m else "lower_branch"
                counts["commitment" if c else "routine"][who] += 1
        out["rows"][row] = counts
        print(row, json.dumps(counts), flush=True)
    files.write_json(a.out, out)  # atomic


if __name__ == "__main__":
    main()
