"""AARL for a real target (the paper's AARL, Alpamayo-R1's action expert scoring the reward): p is Alpamayo-R1
(hf.load_pretrained) and traj_p its flow-matching action expert (noise seeded 0: r_i is a deterministic function of
c_i); traj_gt is the scene's logged future, or, without one, p's plan after p's own greedy CoC. The update is aarl.py's
(group advantages, exact KL to the static reference). Batch 1 per scene (prompt lengths differ): p embeds the prompt
once, for q's rollouts and for p's action step over the G CoCs (evaluate.action_rows, G rows); S scenes per update are
accumulated gradients. Reference: static only (the --draft checkpoint, frozen); the pure action reward.

run: python -m real.aarl_real --target ALPAMAYO_DIR --draft SFT_DRAFT --scenes SCENES --out OUT [--steps --group ...]
     (writes OUT/draft_aarl_s<seed>; tests: tests/test_aarl_real.py)
"""
import argparse
from dataclasses import asdict, dataclass
import json
import os
import time

import torch
from tqdm import tqdm

from aarl import aarl_loss, coc_logprobs, group_advantages, rollout, training_summary
import evaluate
from ops import checkpoint, cli, files, runs
from measure import timing
from real import alpamayo, hf, scenes
from real.expert import speed_from_history
import speculate


# ---- config ----
@dataclass
class RealConfig:
    steps: int = 50  # policy updates
    per_update: int = 4  # S: scenes per update, accumulated one batch-1 scene at a time (prompt lengths differ)
    group: int = 8  # G: CoCs sampled per scene
    temperature: float = 1.0  # rollout temperature of q
    lr: float = 1e-5  # AdamW learning rate of the draft
    beta: float = 0.2  # KL weight
    max_new: int = 128  # CoC token limit per rollout
    seed: int = 0  # rollouts and scene order
    min_pixels: int = alpamayo.MIN_PIXELS  # image size bounds of the prompt (alpamayo.build_prompt)
    max_pixels: int = alpamayo.MAX_PIXELS
    processor: str = ""  # the tokenizer + image processor folder (default: --target)
    save_every: int = 10  # updates between resumable states (OUT/draft_aarl_s<seed>.state.pt)


def real_rewards(target, prompt, cocs, v0, traj_ref, ids):
    """r_i = -ADE(expert plan after prompt + c_i, traj_ref (N, 2)) for the id lists cocs -> (G,): the G plans in one
    action step (evaluate.action_rows, closed by ids = (cot_end, future_start)); v0 (1,) m/s."""
    plans = evaluate.action_rows(target, prompt, cocs, ids, v0.expand(len(cocs)))[0]  # (G, N, 2)
    return -evaluate.ade_fde(plans, traj_ref.to(plans)[None].expand_as(plans), per_scene=True)[0]


@torch.no_grad()
def reference_plan(target, prompt, scene, v0, cfg, ids):
    """The reward's reference (N, 2): the scene's future (x, y) when it has one, else p's plan after p's own greedy CoC
    (what the draft should reproduce when no logged future exists)."""
    if scene.future is not None:
        return scene.future[:, :2]  # (N, 3) -> (N, 2)
    coc = speculate.autoregressive(target, prompt, cfg.max_new, stop_token=ids[1]).tokens
    return evaluate.action_rows(target, prompt, [coc], ids, v0)[0][0].float().cpu()


def real_scene_loss(target, draft, ref, prompt, v0, traj_ref, cfg, ids, gen):
    """One scene's AARL loss (batch 1, G rollouts): the prompt embedded by p once, G CoCs from q, their rewards from
    p's expert, group advantages, exact KL(q || q_ref) -> (loss, kl, rewards (G,))."""
    with torch.no_grad():
        embeds, deepstack = speculate.embed_prompt(target, prompt)  # (1, L, D)
    draft.eval()
    sampling = speculate.Sampling(cfg.temperature, seed=gen)  # the run's generator, saved with its checkpoints
    toks, mask = rollout(draft, embeds, prompt, cfg.group, sampling, cfg.max_new, ids[1])  # (G, T) each
    r = real_rewards(target, dict(prompt, inputs_embeds=embeds, deepstack=deepstack),  # p's embeddings, computed once
                     [t[m].tolist() for t, m in zip(toks, mask)], v0, traj_ref, ids)  # (G,)
    with torch.no_grad():
        logr = coc_logprobs(ref, embeds, prompt, toks, cfg.group)  # (G, T, V)
    draft.train()
    logq = coc_logprobs(draft, embeds, prompt, toks, cfg.group)  # (G, T, V)
    loss, kl = aarl_loss(logq, logr, toks, mask.float(), group_advantages(r, cfg.group), cfg.beta)
    return loss, kl, r


def train_real(target, draft, ref, clips, prompts, cfg: RealConfig, ids, log=None, state_path=None):
    """Post-train `draft` in place against the frozen static reference `ref` (the SFT draft); returns it. prompts:
    scenes.scene_prompts' (scene_id, fn) pairs of clips; ids: (cot_end, future_start); state_path: resumable state
    written every cfg.save_every updates (the draft, AdamW, the rollouts' generator), resumed from when it exists."""
    device, dtype = target.embed_tokens.weight.device, target.embed_tokens.weight.dtype
    target.eval().requires_grad_(False)
    ref.eval().requires_grad_(False)
    draft.float()  # fp32 master weights: AdamW at lr 1e-5 on bf16 weights would lose most updates to rounding
    amp = evaluate.autocast(device, dtype != torch.float32)  # the fp32 policy meets p's bf16 weights under autocast
    opt = runs.make_optimizer(draft.parameters(), cfg.lr)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    order = torch.randperm(len(clips), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    refs = {}  # scene_id -> (v0, reference plan): p's greedy plan is computed once per scene, not once per update
    bound = {"target": checkpoint.fingerprint(target), "reference": checkpoint.fingerprint(ref)}
    start, extra = runs.load_state(state_path or "", {"draft": draft}, {"draft": opt}, cfg, bound)  # "": fresh
    if extra is not None:
        gen.set_state(extra["generator"])
    for step in (bar := tqdm(range(start, cfg.steps), desc="aarl[real]", initial=start, total=cfg.steps)):
        stats = []
        for j in range(cfg.per_update):
            k = order[(step * cfg.per_update + j) % len(clips)]
            scene, prompt = clips[k], hf.on_model(scenes.built(*prompts[k]), target)
            if scene.scene_id not in refs:
                v0 = speed_from_history(scene.past[None]).to(device)  # (1,) m/s, from the scene's own past
                refs[scene.scene_id] = v0, reference_plan(target, prompt, scene, v0, cfg, ids)
            with amp:
                loss, kl, r = real_scene_loss(target, draft, ref, prompt, *refs[scene.scene_id], cfg, ids, gen)
            runs.check_loss(f"AARL (scene {scene.scene_id})", loss.item(), step, state_path or "")
            (loss / cfg.per_update).backward()  # gradient accumulation: the mean over the S scenes
            stats.append({"reward": r.mean().item(), "kl": kl.item(), "reward_std_in_group": r.std().item()})
        runs.update(opt, draft, cfg.lr, 1.0)
        runs.check_loss("AARL", None, step, state_path, draft)  # the weights after it
        stats = {key: sum(s[key] for s in stats) / len(stats) for key in stats[0]}
        bar.set_postfix({key: f"{v:.3f}" for key, v in stats.items()})
        if log is not None:
            log({"step": step, **stats})
        if state_path and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps):
            runs.save_state(state_path, step + 1, {"draft": draft}, {"draft": opt}, cfg, 0, bound,
                            extra={"generator": gen.get_state()})
    return draft.eval()


def load_real(target_dir, draft_dir, scenes_dir, cfg, device, dtype):
    """p (an Alpamayo folder; one without an action expert is refused), q and the frozen q_ref (the SFT draft, twice),
    the scenes (checked first) and their prompts, and the ids (cot_end, future_start)."""
    checkpoint.header(draft_dir)  # the draft's weights (a regular file, our header) read before the target loads
    if "expert_cfg" not in files.read_json(os.path.join(target_dir, hf.CONFIG)):  # what hf.load_pretrained reads
        raise ValueError(f"{target_dir} has no action expert: AARL's reward scores the expert's plan after each CoC "
                         "(an Alpamayo-R1 folder); the toy's AARL (python aarl.py) uses its own head")
    clips, prompts, ids, _ = scenes.scene_prompts(target_dir, scenes_dir, cfg.processor or None,  # checked first
                                                  min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    target = hf.load_pretrained(target_dir, dtype=dtype, device=device).eval()
    if (n := target.expert.cfg.n_waypoints) != scenes.N_FUTURE and any(s.future is not None for s in clips):
        raise ValueError(f"{target_dir}: the expert plans {n} waypoints, a scene's future has {scenes.N_FUTURE}")
    draft, ref = (checkpoint.load(draft_dir, target=target).eval() for _ in range(2))  # ref: q_ref, static
    return target, draft, ref, clips, prompts, tuple(ids)


# ---- the command line ----
@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m real.aarl_real", description="AARL post-training of a draft "
                                 "(distilled for --target) with the reward of the target's action expert on scene "
                                 "folders (real/scenes.py)")
    ap.add_argument("--target", required=True, help="Alpamayo-R1 folder (hf.load_pretrained, with its tokenizer)")
    ap.add_argument("--draft", required=True, help="the SFT draft of --target (checkpoint.load): the policy's start "
                    "and the static KL reference")
    ap.add_argument("--scenes", required=True, help="scene folder (scenes.load_scenes: SCENES/<id>/cameras, "
                    "poses.json)")
    ap.add_argument("--out", required=True, help="output folder: the draft goes to OUT/draft_aarl_s<seed>")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--dtype", default="fp32", choices=sorted(cli.DTYPES), help="p's weights (bf16 on a GPU: then "
                    "under autocast); the draft trains on fp32 master weights and is saved in this dtype")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    cli.add_config_flags(ap, RealConfig)
    a = ap.parse_args(argv)
    cfg = cli.config_from_args(RealConfig, a)
    with cli.user_errors(ap):
        cli.check_values(cfg, [(">= 1", ("steps", "per_update", "max_new", "min_pixels", "max_pixels", "save_every")),
                               ("a finite number > 0", ("lr", "temperature")), ("in 0..2**30-1", ("seed",)),
                               ("a finite number >= 0", ("beta",))], flags=True)
        if cfg.min_pixels > cfg.max_pixels:
            raise ValueError(f"--min-pixels {cfg.min_pixels} is above --max-pixels {cfg.max_pixels}")
        if cfg.group < 2:
            raise ValueError(f"--group must be >= 2 for group-relative advantages, got {cfg.group}")
        device = cli.check_device(a.device)
        inputs = {"--target": a.target, "--draft": a.draft, "--scenes": a.scenes}
        for flag, path in inputs.items():
            if not os.path.isdir(path):
                raise FileNotFoundError(f"{flag} {path}: no such folder")
        files.check_out_dir(a.out, inputs | {"--processor": cfg.processor}, ("--draft",))  # RUN/draft_flat_s0
        out = checkpoint.draft_dir(a.out, "aarl", cfg.seed)
        with cli.json_stdout(a.json), files.writer_lock(a.out):  # --json: the work's lines on stderr too
            checkpoint.check_output(out, checkpoint.existing_kind(a.draft),  # AARL keeps the draft's kind
                                    how="refusing to replace it; give another --out or --seed")
            cli.progress(f"AARL on {a.scenes}: the models and scenes, then {cfg.steps} updates")
            t0 = time.time()
            target, draft, ref, clips, prompts, ids = load_real(a.target, a.draft, a.scenes, cfg, device,
                                                                cli.DTYPES[a.dtype])
            updates = []
            train_real(target, draft, ref, clips, prompts, cfg, ids, log=updates.append, state_path=out + ".state.pt")
            checkpoint.save(draft.to(target.embed_tokens.weight.dtype), out, target=target)
    res = {"out": out, "scenes": len(clips), "config": asdict(cfg), "wall_s": time.time() - t0,
           "environment": timing.environment(a.device) | {"threads": torch.get_num_threads(), "dtype": a.dtype},
           "training": training_summary(updates)}
    first, last = res["training"]["first"], res["training"]["last"]
    with cli.json_stdout(a.json):
        print("updates, first -> last 20: " + "  ".join(f"{k} {first[k]:.3f}->{last[k]:.3f}" for k in first))
        print(f"AARL (real target, {len(clips)} scenes) wall time {res['wall_s']:.0f} s; draft saved to {out}")
    if a.json:
        print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
