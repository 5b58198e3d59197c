"""Copy a trained toy run into checkpoints/toy, the checkpoints that ship with the repo, and record beside them what a
test re-measures: the target's accuracy and every draft's tau on a small validation sample, so that a code change
that silently changes what the shipped weights compute fails CI (tests/test_shipped.py).

Paper: the shipped models are the toy's deliberative reasoner (target) and routine reasoners (replica, FlatRoPE,
history-only, FlatRoPE + AARL drafts) behind the README's version of the paper's table (rsd.py).

run: python experiments/ship_toy.py --run runs/toy --out checkpoints/toy   (after train.py and aarl.py filled runs/toy)
     python experiments/ship_toy.py --run RUN --out checkpoints/toy --kinds history   (adds one kind's drafts)
"""
import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ops import checkpoint  # noqa: E402
import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import cli, files  # noqa: E402
from driving import Data  # noqa: E402

KINDS = ("mrope", "flat", "history", "aarl")
CHECK_SCENES = 16  # validation scenes of the recorded check
CHECK_GAMMA = 4


def check_metrics(run, seeds, kinds=KINDS):
    """What tests/test_shipped.py recomputes: the target's greedy CoC exact match and commitment accuracy, and each
    draft's exact greedy tau at CHECK_GAMMA, on the first CHECK_SCENES validation scenes (fp32, default geometry)."""
    tok = driving.Tokenizer()
    target = checkpoint.load(os.path.join(run, "target")).eval()
    data = Data("val", CHECK_SCENES, 0, tok)
    outputs = evaluate.greedy_outputs(target, data)
    drafts = {f"{k}_s{s}": checkpoint.load(checkpoint.draft_dir(run, k, s), target=target).eval()
              for k in kinds for s in seeds}
    matches = evaluate.draft_matches(drafts, target, data, outputs)
    return {"scenes": CHECK_SCENES, "gamma": CHECK_GAMMA,
            "coc_exact": evaluate.coc_exact_match(outputs, data.coc_ids()),
            "commitment_acc": evaluate.commitment_acc(target, target, data),
            "tau": {name: evaluate.tau_by_gamma(m, [CHECK_GAMMA])[CHECK_GAMMA]["tau"] for name, m in matches.items()}}


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="runs/toy")
    ap.add_argument("--out", required=True, help="where the checkpoints ship (the repo's: checkpoints/toy): no "
                    "default, as shipping replaces what is there")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the draft kinds shipped; a subset adds them (the target "
                    "and the other kinds' record stay as shipped)")
    a = cli.checked(ap, ap.parse_args(argv), lists=("seeds",))
    seeds, kinds = a.seeds, a.kinds.split(",")
    if set(kinds) - set(KINDS):
        ap.error(f"--kinds takes kinds of {', '.join(KINDS)}, got {a.kinds!r}")
    adding = set(kinds) != set(KINDS)
    parts = ["target"] * (not adding) + [os.path.basename(checkpoint.draft_dir(a.run, k, s)) for k in kinds
                                         for s in seeds]
    with cli.user_errors(ap):  # every part there and every destination replaceable before the first copy
        if os.path.lexists(a.out) and not os.path.isdir(a.out):
            raise ValueError(f"--out {a.out} exists and is not a folder")
        if (kind := checkpoint.existing_kind(a.out) or "").endswith(("target", " draft")):
            raise ValueError(f"--out {a.out} holds a {kind} checkpoint itself: give the folder the checkpoints ship "
                             "into (the repo's: checkpoints/toy)")
        if os.path.realpath(a.out) == os.path.realpath(a.run):
            raise ValueError(f"--out {a.out} is --run: shipping copies the run into another folder")
        for part in parts:
            checkpoint.header(os.path.join(a.run, part))  # the run's checkpoint: there, a regular file, ours
            # shipping replaces the shipped checkpoints, never anything else that sits at their names
            checkpoint.check_output(os.path.join(a.out, part), checkpoint.existing_kind(os.path.join(a.run, part)),
                                    overwrite=True)
    cli.progress(f"shipping {len(parts)} checkpoints of {a.run} to {a.out}, then their check")
    os.makedirs(a.out, exist_ok=True)
    for part in parts:
        dst = os.path.join(a.out, part)
        if os.path.exists(dst):
            shutil.rmtree(dst)
        shutil.copytree(os.path.join(a.run, part), dst)
    if adding:
        metrics = files.read_json(os.path.join(a.out, "metrics.json"))
        metrics["check"]["tau"] |= check_metrics(a.out, seeds, kinds)["tau"]
    else:
        metrics = {"train_metrics": files.read_json(os.path.join(a.run, "train_metrics.json")),
                   "check": check_metrics(a.out, seeds)}
    files.write_json(os.path.join(a.out, "metrics.json"), metrics)
    print(f"shipped {len(parts)} checkpoints to {a.out}; check: {metrics['check']}")


if __name__ == "__main__":
    main()
