"""The README's figures, drawn from committed runs (needs matplotlib): docs/figures/tree_budget.png and tree_paths.png
from experiments/tree_sweep.py's and experiments/tree_paths.py's JSON (draft trees, EAGLE-2), attention.png from
`python rsd.py --json`'s output experiments/rsd_toy.json (the paper's attention shift to the trajectory history),
views_sweep.png from experiments/views_sweep.py's JSON (FlatRoPE against the prompt's visual-token count).

run: python experiments/figures.py --out docs/figures [--rsd-json RUN.json: a run of your own, its last line]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ops import cli, files  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def plot_trees(plt, save, out, tree_json, paths_json):
    """figures/tree_budget.png: held-out tau against the draft tokens verified per round (the chain's gamma, the
    tree's node budget N), each draft kind (experiments/tree_sweep.json); figures/tree_paths.png: who supplied each
    held-out CoC token, routine words and commitments apart (experiments/tree_paths.json)."""
    sweep, paths = files.read_json(tree_json), files.read_json(paths_json)
    fig, ax = plt.subplots(figsize=(5, 3))
    for (row, r), color in zip(sweep["test"].items(), ("C0", "C1", "C2")):
        for kind, style in (("chain", "--o"), ("tree", "-s")):
            x = sorted(r[kind], key=int)
            ax.plot([int(n) for n in x], [r[kind][n] for n in x], style, color=color, label=f"{row} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft tokens verified per round (gamma, or the tree's N)")
    ax.set_ylabel("held-out tau (draft seed 0)")
    ax.legend(fontsize=6)
    save(fig, "tree_budget.png")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3), sharey=True)
    for ax, part in zip(axes, ("routine", "commitment")):
        names = list(paths["rows"])
        bottom = [0.0] * len(names)
        for who, label in (("first_choice", "accepted, the draft's first choice"),
                           ("lower_branch", "accepted from a lower branch"), ("target", "the target's own")):
            share = [paths["rows"][n][part][who] / max(1, sum(paths["rows"][n][part].values())) for n in names]
            ax.bar(names, share, bottom=bottom, label=label)
            bottom = [b + s for b, s in zip(bottom, share)]
        ax.set_title(f"{part} tokens (tree {'/'.join(map(str, paths['tree']))})", fontsize=9)
    axes[0].set_ylabel("share of held-out CoC tokens")
    axes[0].legend(fontsize=7, loc="lower center", bbox_to_anchor=(1.0, -0.35), ncol=3)
    save(fig, "tree_paths.png")
    return [f"{out}/tree_budget.png", f"{out}/tree_paths.png"]


def plot_attention(plt, save, out, rsd_json):
    """attention.png: where each model's attention goes while it writes the CoC (image tokens, trajectory history,
    text), the target and each draft kind's chain row of rsd.py's table (mean over its seeds)."""
    with open(rsd_json) as f:  # a committed JSON, or a run's `python rsd.py --json` output (its last line)
        rows = [r for r in json.loads(f.read().strip().splitlines()[-1])["rows"] if not r.get("tree")]
    fig, ax = plt.subplots(figsize=(6, 3))
    names, bottom = [r["name"] for r in rows], [0.0] * len(rows)
    for key, label in (("attn_image", "image tokens"), ("attn_history", "trajectory history"), ("attn_text", "text")):
        ax.bar(names, [r[key] for r in rows], bottom=bottom, label=label)
        bottom = [b + r[key] for b, r in zip(bottom, rows)]
    ax.set_ylabel("attention mass while writing the CoC")
    ax.legend(fontsize=7, loc="lower right")
    save(fig, "attention.png")
    return [f"{out}/attention.png"]


def plot_views(plt, save, out, views_json):
    """views_sweep.png: held-out tau of both drafts and their attention on the history against the visual tokens in
    the prompt (experiments/views_sweep.py), the seed spread as error bars."""
    sweep = files.read_json(views_json)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    for ax, (key, label) in zip(axes, (("tau", "held-out tau at gamma 6"), ("attn_history", "attention on history"))):
        for kind, style in (("mrope", "o-"), ("flat", "s-")):
            pts = sorted((p["visual_tokens"], p[kind][key]["mean"], p[kind][key]["spread"]) for p in sweep["points"])
            x, y, e = zip(*pts)
            ax.errorbar(x, y, yerr=[s / 2 for s in e], fmt=style, capsize=3,
                        label={"mrope": "replica (M-RoPE)", "flat": "FlatRoPE"}[kind])
        ax.set(xscale="log", xlabel="visual tokens in the prompt", ylabel=label)
        ax.legend(fontsize=7)
    save(fig, "views_sweep.png")
    return [f"{out}/views_sweep.png"]


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/figures", help="folder of the figures (default runs/figures, git-ignored; "
                    "the README's: docs/figures)")
    ap.add_argument("--tree-json", default=os.path.join(HERE, "tree_sweep.json"))
    ap.add_argument("--paths-json", default=os.path.join(HERE, "tree_paths.json"))
    ap.add_argument("--rsd-json", default=os.path.join(HERE, "rsd_toy.json"))
    ap.add_argument("--views-json", default=os.path.join(HERE, "views_sweep.json"))
    a = ap.parse_args(argv)
    with cli.user_errors(ap):
        for flag in ("tree_json", "paths_json", "rsd_json", "views_json"):
            files.check_regular(getattr(a, flag), f"--{flag.replace('_', '-')} {getattr(a, flag)}")
        cli.check_out(a.out, default="runs/figures", folder=True)
    cli.progress(f"drawing the figures into {a.out}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(a.out, exist_ok=True)

    def save(fig, name):
        files.atomic_write(os.path.join(a.out, name), lambda p: fig.savefig(p, format="png", dpi=100,
                                                                             bbox_inches="tight"))
    written = (plot_trees(plt, save, a.out, a.tree_json, a.paths_json) + plot_attention(plt, save, a.out, a.rsd_json)
               + plot_views(plt, save, a.out, a.views_json))
    print("figures written: " + ", ".join(written))


if __name__ == "__main__":
    main()
