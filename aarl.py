"""AARL: Action-aware RL post-training of the routine reasoner (the FlatRoPE draft).

Paper: AARL post-trains the draft with an action-quality reward (how good is the
trajectory that follows from the drafted reasoning) plus a KL penalty to a *static*
reference, the frozen SFT draft, rather than a moving one (docs/background.md).

The objective per scene s, with G CoCs c_1..c_G sampled from the draft q:

    r_i   = -ADE(traj_p(s, c_i), traj_gt)  +  w_agree * accept(c_i)
    A_i   = (r_i - mean_j r_j) / (std_j r_j + eps)                  (group-relative, GRPO)
    loss  = -mean_i A_i * mean_t log q(c_i,t)  +  beta * mean_t KL(q || q_ref)

- traj_p is the *target's* trajectory head read after prompt + c_i: the draft proposes the
  reasoning, the unmodified VLA turns it into an action, so the reward scores the reasoning by
  the action it leads to.
- accept(c_i) is the fraction of c_i the target would accept under greedy verification (the
  longest prefix equal to the target's argmax), the quantity speculative decoding pays for.
  Default weight 0.5: the action reward alone is flat across rollouts that differ only in
  routine words (the trajectory does not change), while acceptance is what tau measures; 0
  gives the paper's pure action reward (a flag).
- Group-relative advantages rather than REINFORCE with a learned baseline: G rollouts of the
  same scene give an unbiased per-scene baseline for free, with no value network to train,
  and normalising by the group's spread keeps the step size independent of the reward scale.
- KL(q || q_ref) is computed exactly over the vocabulary at every generated position (the toy
  vocabulary is small), not by a sampled estimator. reference "static" is the frozen SFT draft;
  the ablations are "moving" (the policy before this step) and "none" (beta = 0). With one
  gradient step per batch, as here, the moving anchor's KL and its gradient are exactly zero
  at the step, so "moving" trains like "none": a moving reference does not anchor at all,
  which is the paper's argument for the static one.

run: python aarl.py --device cpu      (needs runs/toy from train.py; writes runs/toy/draft_aarl; --help for flags)
"""
import argparse
import copy
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

import checkpoint
import driving
import evaluate
from driving import Data, grid_kwargs, vision_kwargs

# ---- config ----


@dataclass
class AARLConfig:
    steps: int = 200  # policy updates (about a minute and a half on 2 CPU cores with the before / after report)
    n_train: int = 4000  # training scenes the update batches are drawn from
    scenes: int = 8  # scenes per update
    group: int = 8  # G: CoCs sampled per scene
    temperature: float = 1.0  # rollout temperature of q
    lr: float = 1e-4  # AdamW learning rate of the draft
    beta: float = 0.2  # KL weight
    reference: str = "static"  # KL anchor: static (frozen SFT draft, the paper's), moving (policy before a step), none
    agree_weight: float = 0.5  # weight of the greedy-acceptance term in the reward (0: the paper's pure action reward)
    max_new: int = evaluate.MAX_NEW_TOKENS  # CoC token limit per rollout
    seed: int = 0  # seeds the rollouts
    eval_every: int = 20  # steps between the validation-tau passes logged during training
    n_val_log: int = 32  # validation scenes of the tau logged during training
    gamma: int = evaluate.GAMMA  # draft length of the logged and reported tau


# ---- rollouts ----


def rollout(draft, embeds, batch, G, temperature, max_new, stop, generator):
    """Sample G CoCs per scene from q with the KV cache (evaluate.generate, the loop that also
    decodes greedily). embeds (S, P, D) are the target's prompt embeddings. Returns tokens
    (S*G, T) and a mask (S*G, T) that is True up to and including each row's <cot_end>."""
    P = embeds.shape[1]
    ids = batch["input_ids"][:, :P].repeat_interleave(G, 0)  # (S*G, P)
    return evaluate.generate(draft, ids, max_new, stop, temperature, generator,
                             inputs_embeds=embeds.repeat_interleave(G, 0),  # (S*G, P, D)
                             **evaluate.repeat_scenes(grid_kwargs(batch), embeds.shape[0], G))


def coc_logprobs(draft, embeds, batch, toks, G):
    """log q of every vocabulary entry at the positions that generated toks: (S*G, T, V)."""
    P = embeds.shape[1]
    ids = torch.cat([batch["input_ids"][:, :P].repeat_interleave(G, 0), toks[:, :-1]], 1)  # (S*G, P+T-1)
    x = torch.cat([embeds.repeat_interleave(G, 0), draft.embed_tokens(toks[:, :-1])], 1)  # (S*G, P+T-1, D)
    logits = draft(ids, inputs_embeds=x, **evaluate.repeat_scenes(grid_kwargs(batch), embeds.shape[0], G))
    return F.log_softmax(logits[:, P - 1:].float(), -1)  # (S*G, T, V)


# ---- reward ----


@torch.no_grad()
def reward(target, batch, toks, mask, G, tok, agree_weight):
    """Action quality (-ADE in metres of the target's trajectory after the drafted CoC) plus
    agree_weight * the fraction of the CoC the target's greedy verification would accept.
    Returns (reward (S*G,), ade (S*G,), accept (S*G,))."""
    S = batch["input_ids"].shape[0]
    # the CoC up to <cot_end> (added if the rollout hit max_new first), then <traj_future_start>
    seqs = [[t for t in toks[r][mask[r]].tolist() if t != tok.cot_end_id] + [tok.cot_end_id, tok.traj_future_start_id]
            for r in range(S * G)]
    rep = {"input_ids": batch["input_ids"].repeat_interleave(G, 0), "prompt_len": batch["prompt_len"],
           **evaluate.repeat_scenes(vision_kwargs(batch), S, G)}
    logits, hidden = evaluate.continue_prompts(target, rep, seqs, tok.pad_id)  # (S*G, 1+T', V), (S*G, T', D)
    last = torch.tensor([len(s) - 1 for s in seqs], device=toks.device)
    traj = target.traj(hidden[torch.arange(S * G), last]).float()  # (S*G, traj_len, 2)
    ade = driving.ade_fde(traj, batch["traj"].repeat_interleave(G, 0), per_scene=True)[0]  # (S*G,)
    # greedy acceptance: the drafted token at step t is accepted while it equals p's argmax there
    n = toks.shape[1]
    argmax_p = logits[:, :n].argmax(-1)  # (S*G, n): p's choice for each CoC position
    match = (argmax_p == toks) & mask
    accepted = match.long().cumprod(1).sum(1).float()  # longest agreeing prefix
    accept = accepted / mask.sum(1).clamp(min=1)
    return -ade + agree_weight * accept, ade, accept


# ---- the update ----


def group_advantages(r, G, eps=1e-6):
    """(S*G,) rewards -> group-relative advantages; an all-equal group gives zeros, not NaN."""
    g = r.view(-1, G)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True, unbiased=False) + eps)).flatten()


def exact_kl(logq, logr, mask):
    """mean over valid positions of KL(q || r) = sum_v q (log q - log r); logq, logr (N, T, V)."""
    kl = (logq.exp() * (logq - logr)).sum(-1)  # (N, T)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def aarl_loss(logq, logr, toks, mask, adv, beta):
    """Policy-gradient loss with group advantages plus beta * exact KL -> (loss, kl)."""
    tok_logq = logq.gather(-1, toks[..., None])[..., 0]  # (N, T) log q of the sampled tokens
    per_seq = (tok_logq * mask).sum(1) / mask.sum(1).clamp(min=1)  # (N,) mean log q per CoC
    pg = -(adv * per_seq).mean()
    kl = exact_kl(logq, logr, mask) if beta > 0 else logq.new_zeros(())
    return pg + beta * kl, kl


# ---- training loop ----


def logged_tau(target, draft, prompts, gamma, stop):
    return evaluate.spec_stats(target, {"q": draft}, prompts, gamma, stop_token=stop, check_greedy=False)["q"]["tau"]


def train_aarl(target, draft, data: Data, cfg: AARLConfig, val: Data | None = None, out=None, ref=None):
    """Post-train `draft` in place with AARL; returns it. The reference is `ref` or a frozen copy
    of the draft taken now (static), the policy before each step (moving), or absent (none).
    With val, the tau on its first cfg.n_val_log scenes is logged every cfg.eval_every steps."""
    if cfg.reference not in ("static", "moving", "none"):
        raise ValueError(f"reference must be static, moving or none, got {cfg.reference!r}")
    if cfg.group < 2:
        raise ValueError(f"group must be >= 2 for group-relative advantages, got {cfg.group}")
    device = next(target.parameters()).device
    target.eval().requires_grad_(False)
    if ref is None:
        ref = copy.deepcopy(draft)  # shares the target's embedding / head, as the draft does
    ref.eval().requires_grad_(False)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    beta = 0.0 if cfg.reference == "none" else cfg.beta
    val_prompts = evaluate.scene_prompts(val.scenes[:cfg.n_val_log], val.tok, device) if val is not None else None
    bar = tqdm(range(cfg.steps), desc=f"aarl[{cfg.reference}]")
    for step in bar:
        batch = data.batch(10_000 + step, cfg.scenes, device=device)
        P = int(batch["prompt_len"][0])
        with torch.no_grad():
            embeds = target.embed(batch["input_ids"][:, :P], **vision_kwargs(batch))  # (S, P, D)
        draft.eval()
        toks, mask = rollout(draft, embeds, batch, cfg.group, cfg.temperature, cfg.max_new,
                             data.tok.cot_end_id, gen)
        r, ade, accept = reward(target, batch, toks, mask, cfg.group, data.tok, cfg.agree_weight)
        adv = group_advantages(r, cfg.group)
        if cfg.reference == "moving":
            ref.load_state_dict(draft.state_dict())  # the policy before this update
        with torch.no_grad():
            logr = coc_logprobs(ref, embeds, batch, toks, cfg.group)
        draft.train()
        logq = coc_logprobs(draft, embeds, batch, toks, cfg.group)
        loss, kl = aarl_loss(logq, logr, toks, mask.float(), adv, beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        post = {"reward": f"{r.mean().item():.3f}", "ade": f"{ade.mean().item():.2f}",
                "accept": f"{accept.mean().item():.2f}", "kl": f"{kl.item():.4f}"}
        if val is not None and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            draft.eval()
            post["val_tau"] = f"{logged_tau(target, draft, val_prompts, cfg.gamma, data.tok.cot_end_id):.2f}"
        bar.set_postfix(post)
    draft.eval()
    if out is not None:
        checkpoint.save(draft, out)
    return draft


# ---- main ----


def report_stats(target, draft, data: Data, gamma, device):
    """tau, tau ceiling, routine share and greedy match of `draft` on every scene of data (evaluate.spec_stats)."""
    prompts = evaluate.scene_prompts(data.scenes, data.tok, device)
    return evaluate.spec_stats(target, {"q": draft}, prompts, gamma, stop_token=data.tok.cot_end_id)["q"]


def main(argv=None):
    ap = argparse.ArgumentParser(description="AARL post-training of the FlatRoPE draft (needs train.py's checkpoints)")
    ap.add_argument("--run", default="runs/toy", help="folder with target/ and draft_flat/ from train.py")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--n-report", type=int, default=128, help="validation / test scenes of the before / after report")
    ap.add_argument("--out", default=None, help="output folder (default RUN/draft_aarl[_REFERENCE])")
    checkpoint.add_config_flags(ap, AARLConfig, choices={"reference": ["static", "moving", "none"]})
    a = ap.parse_args(argv)
    if a.steps < 1 or a.scenes < 1 or a.group < 2 or a.beta < 0 or a.lr <= 0:
        ap.error("need steps >= 1, scenes >= 1, group >= 2, beta >= 0, lr > 0")
    cfg = checkpoint.config_from_args(AARLConfig, a)
    for sub in ("target", "draft_flat"):
        if not os.path.isdir(os.path.join(a.run, sub)):
            ap.error(f"{os.path.join(a.run, sub)} not found: run `python train.py --out {a.run}` first")
    torch.manual_seed(cfg.seed)
    target = checkpoint.load(os.path.join(a.run, "target"), device=a.device).eval()
    sft = checkpoint.load(os.path.join(a.run, "draft_flat"), target=target, device=a.device).eval()
    tok = driving.Tokenizer()
    train = Data("train", cfg.n_train, 0, tok)
    val, test = Data("val", a.n_report, 0, tok), Data("test", a.n_report, 0, tok)
    out = a.out or os.path.join(a.run, "draft_aarl" + ("" if cfg.reference == "static" else f"_{cfg.reference}"))
    t0 = time.time()
    splits = {"val": val, "test": test}
    before = {name: report_stats(target, sft, data, cfg.gamma, a.device) for name, data in splits.items()}
    draft = train_aarl(target, copy.deepcopy(sft), train, cfg, val, out)
    after = {name: report_stats(target, draft, data, cfg.gamma, a.device) for name, data in splits.items()}
    for name in ("val", "test"):
        b, f = before[name], after[name]
        print(f"{name:4s} tau {b['tau']:.2f} -> {f['tau']:.2f} (ceiling {b['tau_ceiling']:.2f})   "
              f"routine share {b['routine_fraction']:.3f} -> "
              f"{f['routine_fraction']:.3f}   greedy match {b['greedy_match']} / {f['greedy_match']}")
    print(f"AARL ({cfg.reference}) wall time {time.time() - t0:.0f} s; draft saved to {out}")


if __name__ == "__main__":
    main()
