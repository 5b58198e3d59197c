"""Reasoning-aware Speculative Decoding, end to end: the two-reasoner planner on the
synthetic driving world, and the paper's table on its held-out test split.

Paper: a driving VLA writes a chain-of-causation (CoC) before its trajectory. The routine
reasoner (a 1-layer draft on FlatRoPE positions, post-trained with AARL) proposes CoC
tokens; the deliberative reasoner (the unmodified target VLA, M-RoPE) verifies them
losslessly and writes the commitment tokens itself; the trajectory head then plans from
prompt + CoC. Rows of the table: target-only decoding, the replica draft of standard
speculative decoding (the target's M-RoPE), the FlatRoPE draft, FlatRoPE + AARL.

The first run trains everything into runs/toy (train.py: target + both drafts, then
aarl.py: AARL with the static anchor); later runs reuse the checkpoints.

rsd.py is the top of the layering: it may call the scripts train.py, aarl.py and bench.py;
they import only the library modules (rope, model, checkpoint, speculate, driving, evaluate).

run: python rsd.py [--json] [--plot] [--sweep 4,5,6,7,8]
"""
import argparse
import copy
import json
import os
import time

import torch

import aarl
import bench
import checkpoint
import driving
import evaluate
import train as T
from driving import Data
from evaluate import MAX_NEW_TOKENS, TARGET_ONLY

ROWS = (("replica", "draft_mrope"), ("flatrope", "draft_flat"), ("flatrope+aarl", "draft_aarl"))

# ---- checkpoints ----


def ensure_checkpoints(run, device="cpu", log=print):
    """Train what is missing in `run`: the target and both drafts (train.py), then the
    FlatRoPE draft's AARL post-training with the static anchor (aarl.py)."""
    if not all(os.path.isdir(os.path.join(run, d)) for d in ("target", "draft_flat", "draft_mrope")):
        log(f"no checkpoints in {run}: training the target and both drafts (train.py defaults)")
        T.run(T.TrainConfig(out=run, device=str(device)), log=log)
    if not os.path.isdir(os.path.join(run, "draft_aarl")):
        log("post-training the FlatRoPE draft with AARL (aarl.py defaults, static anchor)")
        tok = driving.Tokenizer()
        target = checkpoint.load(os.path.join(run, "target"), device=device).eval()
        sft = checkpoint.load(os.path.join(run, "draft_flat"), target=target).eval()
        cfg = aarl.AARLConfig()
        aarl.train_aarl(target, copy.deepcopy(sft), Data("train", cfg.n_train, cfg.seed, tok), cfg,
                        Data("val", cfg.n_val_log, 0, tok), out=os.path.join(run, "draft_aarl"), ref=sft)


# ---- display ----


def marked_coc(tokens, from_draft, tok):
    """'routine words [DELIBERATIVE] ...': the target's own tokens in brackets."""
    return " ".join(tok.vocab[t] if d else f"[{tok.vocab[t]}]" for t, d in zip(tokens, from_draft))


def show_scenes(target, draft, scenes, tok, gamma, device, log=print):
    """A few scenes planned by the two reasoners, next to target-only decoding."""
    for i, (scene, prompt) in enumerate(zip(scenes, evaluate.scene_prompts(scenes, tok, device))):
        spec = evaluate.decode(target, draft, prompt, gamma, MAX_NEW_TOKENS, tok.cot_end_id)
        base = evaluate.decode(target, None, prompt, gamma, MAX_NEW_TOKENS, tok.cot_end_id)
        batch = driving.to_device(driving.collate([driving.make_example(scene, tok)], tok.pad_id), device)
        ade_spec = traj_ade(target, batch, spec.tokens, tok)
        ade_base = traj_ade(target, batch, base.tokens, tok)
        log(f"scene {i} ({scene.f.road}, {scene.f.event}, history {scene.f.hist_class}):")
        log(f"  RSD    tau {spec.tau:.1f}: {marked_coc(spec.tokens, spec.from_draft, tok)}")
        log(f"  target-only: {tok.decode(base.tokens)}   identical: {spec.tokens == base.tokens}")
        log(f"  trajectory ADE vs ground truth: RSD {ade_spec:.2f} m, target-only {ade_base:.2f} m")


def traj_ade(target, batch, coc, tok):
    pred = evaluate.plan_trajectories(target, batch, [coc], tok)  # (1, traj_len, 2)
    return driving.ade_fde(pred, batch["traj"].cpu())[0]


# ---- the table ----


def paper_table(target, drafts, data: Data, gamma, n_time, repeats, device):
    """Rows target-only + one per draft: tau, routine share, the model's teacher-forced accuracy on
    commitment tokens, reasoning ms/token, speed-up, ADE of the trajectory after that arm's own
    CoC, and the model's attention split while writing the CoC (image vs history keys; the
    target-only row shows the target's own). Also the tau ceiling: what a never-rejected draft
    would reach on these CoCs (speculate.tau_ceiling)."""
    tok = data.tok
    prompts = evaluate.scene_prompts(data.scenes, tok, device)
    # Statistics on every test scene; timing on the first n_time (the same prompts for every arm).
    stats = evaluate.spec_stats(target, drafts, prompts, gamma, MAX_NEW_TOKENS, tok.cot_end_id)
    timing = bench.time_arms(target, drafts, prompts[:n_time], gamma, MAX_NEW_TOKENS, tok.cot_end_id, repeats)
    rows = []
    for name in stats:
        model = drafts.get(name, target)
        attn = evaluate.attention_split(model, target, data)
        rows.append({"name": name, "tau": stats[name]["tau"], "routine_fraction": stats[name]["routine_fraction"],
                     "commit_acc": evaluate.commitment_acc(model, target, data),
                     "ms_per_token": timing[name]["ms_per_token"], "speedup": timing[name]["speedup"],
                     "ade": evaluate.trajectory_ade(target, data, stats[name]["tokens"])[0],
                     "attn_history": attn["history"], "attn_image": attn["image"],
                     "greedy_match": stats[name]["greedy_match"]})
    return rows, stats[TARGET_ONLY]["tau_ceiling"]


def print_table(rows, log=print):
    log(f"{'':15s} {'tau':>5s} {'routine':>8s} {'commit':>7s} {'ms/token':>9s} {'speed-up':>9s} {'ADE m':>6s} "
        f"{'attn hist':>9s} {'attn img':>9s}")
    for r in rows:
        log(f"{r['name']:15s} {r['tau']:5.2f} {r['routine_fraction']:8.3f} {r['commit_acc']:7.3f} "
            f"{r['ms_per_token']:9.3f} {r['speedup']:8.2f}x {r['ade']:6.2f} {r['attn_history']:9.3f} "
            f"{r['attn_image']:9.3f}")


def gamma_sweep(target, drafts, splits, gammas, log=print):
    """tau of every draft and the tau ceiling per split and draft length gamma -> {split: {gamma: {...}}}.
    A round yields at most gamma + 1 tokens and its last one is always the target's, so whether a draft's miss
    costs a round depends on where the commitment falls against the round boundaries, hence on gamma."""
    out = {}
    for split, data in splits.items():
        out[split] = {}
        prompts = evaluate.scene_prompts(data.scenes, data.tok, next(target.parameters()).device)
        for g in gammas:
            row = evaluate.spec_stats(target, drafts, prompts, g, MAX_NEW_TOKENS, data.tok.cot_end_id,
                                      check_greedy=False)
            ceiling = next(iter(row.values()))["tau_ceiling"]  # the same for every draft: it depends on the CoCs
            out[split][g] = {"ceiling": ceiling, **{k: v["tau"] for k, v in row.items()}}
            log(f"{split:5s} gamma {g}: ceiling {out[split][g]['ceiling']:.2f}  "
                + "  ".join(f"{k} {v['tau']:.2f}" for k, v in row.items()))
    return out


# ---- figures ----


def plot(target, draft, scene, rows, tok, gamma, device, out="figures"):
    """figures/scene.png (raster, ground-truth and planned trajectories) and
    figures/attention.png (attention split per model)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install matplotlib")
        return

    os.makedirs(out, exist_ok=True)
    prompt = evaluate.scene_prompts([scene], tok, device)[0]
    spec = evaluate.decode(target, draft, prompt, gamma, MAX_NEW_TOKENS, tok.cot_end_id)
    batch = driving.to_device(driving.collate([driving.make_example(scene, tok)], tok.pad_id), device)
    pred = evaluate.plan_trajectories(target, batch, [spec.tokens], tok)[0].cpu()
    cfg = driving.WorldConfig()
    frame = scene.frames.max(0)  # (C, H, W): both frames overlaid (kinds are drawn at t = -0.5 s, objects at t = 0)
    fig, ax = plt.subplots(figsize=(5, 5))
    kinds = frame[:driving.CHANNELS.index("light_green") + 1]  # (C', H, W): stop line, ego, actors, lights
    ax.imshow((kinds.argmax(0) + 1) * (kinds.sum(0) > 0), cmap="tab10")
    for traj, style, label in ((scene.traj, "g-", "ground truth"), (pred.numpy(), "r--", "RSD plan")):
        # ego frame (x ahead, y left) -> pixel (row up, col left)
        ax.plot(cfg.ego_col - traj[:, 1] / cfg.res, cfg.ego_row - traj[:, 0] / cfg.res, style, label=label)
    ax.set_title(tok.decode(spec.tokens), fontsize=7, wrap=True)
    ax.legend(fontsize=7)
    fig.savefig(os.path.join(out, "scene.png"), dpi=120, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(6, 3))
    names = [r["name"] for r in rows]
    ax.bar(names, [r["attn_history"] for r in rows], label="trajectory history")
    ax.bar(names, [r["attn_image"] for r in rows], bottom=[r["attn_history"] for r in rows], label="image")
    ax.set_ylabel("attention mass while writing the CoC")
    ax.legend(fontsize=7)
    fig.savefig(os.path.join(out, "attention.png"), dpi=120, bbox_inches="tight")
    print(f"figures written to {out}/scene.png and {out}/attention.png")


# ---- main ----


def main(argv=None):
    ap = argparse.ArgumentParser(description="The two-reasoner planner (RSD) on the synthetic driving world.")
    ap.add_argument("--run", default="runs/toy", help="checkpoint folder (trained here if absent)")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--gamma", type=int, default=evaluate.GAMMA, help="draft length")
    ap.add_argument("--scenes", type=int, default=64, help="held-out test scenes for the table")
    ap.add_argument("--time-scenes", type=int, default=16, help="of those, scenes timed for ms/token")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (median)")
    ap.add_argument("--show", type=int, default=3, help="scenes printed with routine / [deliberative] tokens")
    ap.add_argument("--dtype", default="fp32", choices=sorted(checkpoint.DTYPES),
                    help="inference dtype (fp32: the exactness claims hold bit for bit)")
    ap.add_argument("--plot", action="store_true", help="write figures/ (needs matplotlib)")
    ap.add_argument("--sweep", default="", help="also tau per draft on val and test for these gammas, e.g. 4,5,6,7,8")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = ap.parse_args(argv)
    if a.gamma < 1 or a.scenes < 1 or a.time_scenes < 1 or a.repeats < 1 or a.show < 0:
        ap.error("--gamma, --scenes, --time-scenes and --repeats must be >= 1, --show >= 0")
    try:
        gammas = [int(g) for g in a.sweep.split(",") if g.strip()]
    except ValueError:
        ap.error(f"--sweep must be comma-separated integers, got {a.sweep!r}")
    if any(g < 1 for g in gammas):
        ap.error(f"--sweep gammas must be >= 1, got {a.sweep!r}")
    t0 = time.time()
    device = torch.device(a.device)
    ensure_checkpoints(a.run, device)
    dtype = checkpoint.DTYPES[a.dtype]
    tok = driving.Tokenizer()
    target = checkpoint.load(os.path.join(a.run, "target"), dtype=dtype, device=device).eval()
    drafts = {name: checkpoint.load(os.path.join(a.run, d), target=target).eval() for name, d in ROWS}
    test = Data("test", a.scenes, 0, tok)

    metrics = evaluate.evaluate_target(target, test)
    print(f"target on the held-out test split: CoC exact {metrics['coc_exact']:.3f}, "
          f"commitment accuracy {metrics['commitment_acc']:.3f}, ADE {metrics['ade']:.2f} m")
    show_scenes(target, drafts["flatrope+aarl"], test.scenes[:a.show], tok, a.gamma, device)
    rows, ceiling = paper_table(target, drafts, test, a.gamma, a.time_scenes, a.repeats, device)
    print(f"\nheld-out test split, {a.scenes} scenes, gamma {a.gamma}, {a.dtype} on {a.device} "
          f"({torch.get_num_threads()} threads); speed-up = reasoning-step ms/token vs target-only")
    print_table(rows)
    print(f"tau ceiling (a draft never rejected, these CoCs, gamma {a.gamma}): {ceiling:.2f}; "
          f"commit = teacher-forced accuracy on the commitment tokens")
    greedy_match = all(r["greedy_match"] for r in rows)
    print(f"greedy outputs identical to target-only on every scene and draft: {greedy_match}")
    sweep = None
    if gammas:
        print(f"\ntau by draft length ({a.scenes} scenes per split, greedy):")
        sweep = gamma_sweep(target, drafts, {"val": Data("val", a.scenes, 0, tok), "test": test}, gammas)
    print(f"wall time {time.time() - t0:.0f} s")
    if a.plot:
        plot(target, drafts["flatrope+aarl"], test.scenes[0], rows, tok, a.gamma, device)
    if a.json:
        print(json.dumps({"greedy_match": greedy_match, "tau_ceiling": ceiling, "sweep": sweep,
                          "target": {k: metrics[k] for k in ("coc_exact", "commitment_acc", "ade")},
                          "rows": [{k: r[k] for k in ("name", "tau", "routine_fraction", "commit_acc", "ms_per_token",
                                                      "speedup", "ade", "attn_history", "attn_image")}
                                   for r in rows]}))


if __name__ == "__main__":
    main()
