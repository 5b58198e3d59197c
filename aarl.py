"""AARL: Action-aware RL post-training of the routine reasoner (the FlatRoPE draft). Paper: an action-quality reward
(how good the trajectory that follows from the drafted reasoning is) plus a KL penalty to a *static* reference, the
frozen SFT draft, rather than a moving one (docs/background.md). Per scene s, with G CoCs c_1..c_G sampled from q:

    r_i   = -ADE(traj_p(s, c_i), traj_gt)  +  w_agree * agree(c_i)
    A_i   = (r_i - mean_j r_j) / (std_j r_j + eps)                  (group-relative, GRPO)
    loss  = -mean_i A_i * mean_t log q(c_i,t)  +  beta * mean_t KL(q || q_ref)

traj_p is the *target's* trajectory head after prompt + c_i: the draft proposes the reasoning, the unmodified VLA turns
it into the action the reward scores. agree(c_i) is the share of c_i's tokens equal to the target's greedy choice after
the same prefix (what tau measures; w_agree = 0: the pure action reward). KL(q || q_ref) is exact over the vocabulary.
Ablations of the reference: "moving" (reset to the policy every `refresh` >= 10 updates) and "none" (beta = 0).

AARL for a real target, with Alpamayo-R1's action expert as the reward, is real/aarl_real.py.

run: python aarl.py --reference static|moving|none --seed S [--json]   (needs a run folder from train.py; writes
     runs/aarl/draft_aarl[_REFERENCE]_s<S> by default, never over the shipped checkpoints)
"""
import argparse
import copy
from dataclasses import asdict, dataclass
import json
import os
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import driving
from driving import Data, grid_kwargs, vision_kwargs
import evaluate
import model as M
import speculate
from ops import checkpoint, cli, files, runs
from measure import choose as chooser, timing

REFERENCES = ("static", "moving", "none")
DEFAULT_OUT = "runs/aarl"  # a fresh folder: a default run never replaces the shipped FlatRoPE + AARL drafts

# ---- config ----
@dataclass
class AARLConfig:
    kind: str = "flat"  # the SFT draft post-trained (and its static reference): --run's draft_<kind>_s<seed>
    steps: int = 120  # policy updates
    n_train: int = 4000  # training scenes the update batches are drawn from
    scenes: int = 4  # S: scenes per update
    group: int = 8  # G: CoCs sampled per scene
    temperature: float = 1.0  # rollout temperature of q
    lr: float = 1e-4  # AdamW learning rate of the draft
    beta: float = 0.2  # KL weight
    reference: str = "static"  # KL anchor: static (frozen SFT draft, the paper's), moving, none
    refresh: int = 20  # moving: updates between resets of the reference to the current policy (>= 10)
    agree_weight: float = 2.0  # weight of the agreement term in the reward (0: the pure action reward)
    max_new: int = evaluate.MAX_NEW_TOKENS  # CoC token limit per rollout
    seed: int = 0  # the SFT draft's seed, and the seed of the rollouts and batch order
    views: int = driving.WorldConfig().views  # surround views of the training scenes


# ---- rollouts ----
def rollout(draft, embeds, batch, G, sampling, max_new, stop):
    """G CoCs per scene sampled from q after the target's prompt embeddings embeds (S, P, D)
    (speculate.autoregressive_batch: each scene's prefill shared by its G rows) -> tokens (S*G, T), stop-padded, and
    a mask (S*G, T), True up to and including each row's stop. sampling: the run's, its seed the run's generator."""
    prompt = {k: batch[k] for k in speculate.GRID_KEYS if batch.get(k) is not None}  # the positions' grids
    prompt["input_ids"] = batch["input_ids"][:, :embeds.shape[1]]  # (S, P)
    rows = [r.tokens for r in speculate.autoregressive_batch(draft, prompt, max_new, G, sampling, stop, embeds=embeds)]
    T, dev = max(map(len, rows)), embeds.device
    toks = torch.tensor([r + [stop] * (T - len(r)) for r in rows], device=dev)  # (S*G, T)
    return toks, torch.arange(T, device=dev) < torch.tensor([len(r) for r in rows], device=dev)[:, None]


def coc_logprobs(draft, embeds, batch, toks, G):
    """log q of every vocabulary entry at the positions that generated toks: (S*G, T, V)."""
    S, P = embeds.shape[:2]
    ids = torch.cat([batch["input_ids"][:, :P].repeat_interleave(G, 0), toks[:, :-1]], 1)  # (S*G, P+T-1)
    x = torch.cat([embeds.repeat_interleave(G, 0), draft.embed_tokens(toks[:, :-1])], 1)  # (S*G, P+T-1, D)
    # the LM head on the T rows that generated toks only (the prompt's rows would be G x 3,000 x 152k at Alpamayo's)
    logits = draft(ids, inputs_embeds=x, logits_to_keep=toks.shape[1],
                   **evaluate.repeat_scenes(grid_kwargs(batch), S, G))  # (S*G, T, V)
    return F.log_softmax(logits.float(), -1)  # (S*G, T, V)


# ---- reward ----
@torch.no_grad()
def reward(target, batch, toks, mask, G, tok, agree_weight):
    """Action quality (-ADE in metres of the target's trajectory after the drafted CoC) plus agree_weight * the share
    of the CoC's tokens equal to the target's greedy choice after the same prefix -> reward, ade, agree (S*G,) each."""
    cocs = [t[m].tolist() for t, m in zip(toks, mask)]  # <cot_end> is added where a rollout hit max_new first
    prompt = {"input_ids": batch["input_ids"][:, :int(batch["prompt_len"][0])], **vision_kwargs(batch)}
    traj, logits, _ = evaluate.action_rows(target, prompt, cocs, (tok.cot_end_id, tok.traj_future_start_id))
    ade = evaluate.ade_fde(traj, batch["traj"].repeat_interleave(G, 0), per_scene=True)[0]  # (N,)
    # agreement: row t of logits (N, 1+T', V) is p after the prompt and the rollout's first t tokens
    agree = ((logits[:, :toks.shape[1]].argmax(-1) == toks) & mask).sum(1) / mask.sum(1).clamp(min=1)  # (N,)
    return -ade + agree_weight * agree.float(), ade, agree.float()


# ---- the update ----
def group_advantages(r, G, eps=1e-6):
    """(S*G,) rewards -> group-relative advantages; an all-equal group gives zeros, not NaN."""
    g = r.view(-1, G)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True, unbiased=False) + eps)).flatten()


def exact_kl(logq, logr, mask):
    """mean over valid positions of KL(q || r) = sum_v q (log q - log r); logq, logr (N, T, V)."""
    return (evaluate.exact_kl_terms(logq, logr) * mask).sum() / mask.sum().clamp(min=1)  # terms (N, T)


def aarl_loss(logq, logr, toks, mask, adv, beta):
    """Policy-gradient loss with group advantages plus beta * exact KL -> (loss, kl)."""
    tok_logq = logq.gather(-1, toks[..., None])[..., 0]  # (N, T) log q of the sampled tokens
    per_seq = (tok_logq * mask).sum(1) / mask.sum(1).clamp(min=1)  # (N,) mean log q per CoC
    kl = exact_kl(logq, logr, mask) if logr is not None else logq.new_zeros(())
    return -(adv * per_seq).mean() + beta * kl, kl  # the policy gradient's surrogate + beta * KL


# ---- training loop ----
def train_aarl(target, draft, data: Data, cfg: AARLConfig, ref=None, log=None):
    """Post-train `draft` in place with AARL; returns it. The reference starts as `ref` (default: a frozen copy of the
    draft taken now, the SFT draft); the target and a static reference never change; log gets each update's stats."""
    check_config(cfg)
    device = next(target.parameters()).device
    target.eval().requires_grad_(False)
    ref = copy.deepcopy(draft) if ref is None else ref  # a copied draft keeps sharing the target's embedding / head
    ref.eval().requires_grad_(False)
    opt = runs.make_optimizer(draft.parameters(), cfg.lr)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    sampling = speculate.Sampling(cfg.temperature, seed=gen)  # every rollout draws from the run's one generator
    data = data.with_views(cfg.views)
    bar = tqdm(range(cfg.steps), desc=f"aarl[{cfg.reference}]")
    for step in bar:
        if cfg.reference == "moving" and step > 0 and step % cfg.refresh == 0:
            ref.load_state_dict(draft.state_dict())  # the anchor catches up with the policy
        batch = data.batch(step, cfg.scenes, device=device, order=1000 + cfg.seed)
        P = int(batch["prompt_len"][0])
        with torch.no_grad():
            embeds = target.embed(batch["input_ids"][:, :P], **vision_kwargs(batch))  # (S, P, D)
        draft.eval()
        toks, mask = rollout(draft, embeds, batch, cfg.group, sampling, cfg.max_new, data.tok.cot_end_id)
        r, ade, agree = reward(target, batch, toks, mask, cfg.group, data.tok, cfg.agree_weight)
        adv = group_advantages(r, cfg.group)
        with torch.no_grad():  # "none": no reference, no KL term
            logr = coc_logprobs(ref, embeds, batch, toks, cfg.group) if cfg.reference != "none" else None
        draft.train()
        logq = coc_logprobs(draft, embeds, batch, toks, cfg.group)
        loss, kl = aarl_loss(logq, logr, toks, mask.float(), adv, cfg.beta)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"AARL loss is {loss.item()} at update {step}: the draft is left as it was "
                                     "before this update and nothing was saved")
        runs.update(opt, draft, cfg.lr, 1.0, loss)
        runs.check_loss("AARL", loss.item(), step, None, draft)  # nothing saved: the caller gets the error
        stats = {"reward": r.mean().item(), "ade": ade.mean().item(), "agree": agree.mean().item(),
                 "kl": kl.item(), "reward_std_in_group": r.view(-1, cfg.group).std(1).mean().item()}
        bar.set_postfix({k: f"{v:.3f}" for k, v in stats.items()})
        if log is not None:
            log({"step": step, **stats})
    return draft.eval()


# ---- report ----
@torch.no_grad()
def report(target, draft, sft, splits, prof, outputs, gamma=None):
    """{split: stats} of `draft`: tau at every gamma of evaluate.GAMMAS (an exact replay of one teacher-forced pass on
    the target's greedy outputs) and the rest at the speed-optimal gamma (chosen on "val" at this machine's round
    times, prof: measure.choose.profile's, as bench.py and rsd.py choose; or `gamma`); greedy_match: real speculative
    decoding emits the target's greedy output on every scene."""
    taus = {name: evaluate.tau_by_gamma(evaluate.draft_matches({"q": draft}, target, data, outputs[name])["q"],
                                        evaluate.GAMMAS) for name, data in splits.items()}
    # One gamma for the before / after comparison: the SFT draft's speed-optimal one (on val), where it is deployed.
    gamma = gamma or max(taus["val"], key=lambda g: chooser.speedup(prof, speculate.Chain(g), taus["val"][g]["tau"]))
    out = {}
    for name, data in splits.items():
        prompts = evaluate.scene_prompts(data.scenes, data.tok, next(target.parameters()).device,
                                         views=data.views_at(0))
        spec = evaluate.spec_stats(target, {"q": draft}, prompts, gamma, stop_token=data.tok.cot_end_id,
                                   check_greedy=False)["q"]
        out[name] = {"gamma": gamma, "tau": taus[name][gamma]["tau"],
                     "tau_ceiling": evaluate.tau_ceiling([len(o) for o in outputs[name]], gamma),
                     "tau_by_gamma": {g: t["tau"] for g, t in taus[name].items()},
                     "routine_fraction": taus[name][gamma]["routine_fraction"],
                     "drafted_ade": evaluate.drafted_ade(target, draft, data),
                     "kl_to_sft": evaluate.kl_to(draft, sft, target, data),
                     "greedy_match": spec["tokens"] == outputs[name], "tau_spec": spec["tau"]}
    return out


def load_run(run, seed, device, kind="flat"):
    """The target and the SFT draft of `kind` and `seed` from a run folder, with a clear error if one is missing."""
    paths = {"target": os.path.join(run, "target"), "draft": checkpoint.draft_dir(run, kind, seed)}
    # the hint's command trains only what is missing: with a target there, --stage drafts (the default stage, all,
    # would retrain the target, and train.py refuses to replace one it cannot resume)
    kinds = "" if kind == "flat" else f" --kinds {kind}"
    how = (f"python train.py --out {run} --stage drafts --draft-seed {seed}{kinds}" if os.path.isdir(paths["target"])
           else f"python train.py --out {run}" + (f" --draft-seed {seed}" if seed else "") + kinds)
    for path in paths.values():
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path} not found: train it with `{how}` (or use the shipped checkpoints/toy)")
    target = checkpoint.load(paths["target"], device=device).eval()
    return target, checkpoint.load(paths["draft"], target=target, device=device).eval()


def out_dir(run, reference, seed, kind="flat"):
    """Where a run's draft goes in a run folder: the static anchor's on FlatRoPE is the table's "FlatRoPE + AARL"."""
    name = "aarl" if reference == "static" else f"aarl_{reference}"
    return checkpoint.draft_dir(run, name if kind == "flat" else f"{kind}_{name}", seed)


def run(cfg: AARLConfig, run_dir, n_report=64, device="cpu", out=None, overwrite=False):
    """One AARL run from the SFT FlatRoPE draft of seed cfg.seed in run_dir -> the JSON-able before / after report on
    val and test; the draft goes to `out` (default out_dir(DEFAULT_OUT, ...)): new, or a FlatRoPE draft + overwrite."""
    check_config(cfg)
    out = out or out_dir(DEFAULT_OUT, cfg.reference, cfg.seed, cfg.kind)
    files.check_out_dir(out, {"--run's target": os.path.join(run_dir, "target"),  # what the run reads: never replaced
                              "--run's SFT reference draft": checkpoint.draft_dir(run_dir, cfg.kind, cfg.seed)})
    with files.writer_lock(os.path.dirname(os.path.abspath(out))):
        checkpoint.check_output(out, f"{cfg.kind} draft", overwrite,
                                how="rerun with --overwrite to replace it, or give another --out")
        return _run(cfg, run_dir, n_report, device, out)


def _run(cfg, run_dir, n_report, device, out):
    cli.progress(f"AARL ({cfg.reference}, seed {cfg.seed}): the before report on {n_report} val / test scenes, "
                 f"{cfg.steps} updates, the after report")
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    target, sft = load_run(run_dir, cfg.seed, device, cfg.kind)
    tok = driving.Tokenizer()
    train = Data("train", cfg.n_train, 0, tok, views=cfg.views)
    splits = {name: Data(name, n_report, 0, tok, views=cfg.views) for name in ("val", "test")}
    prompt = evaluate.scene_prompts(splits["val"].scenes[:1], tok, device, views=cfg.views)[0]
    if prompt["input_ids"].shape[1] + cfg.max_new > target.cfg.max_seq_len:  # else the first rollout fails, minutes in
        raise ValueError(f"max_new {cfg.max_new}: a prompt of {prompt['input_ids'].shape[1]} tokens and its CoC need "
                         f"more than the target's {target.cfg.max_seq_len} positions")
    outputs = {name: evaluate.greedy_outputs(target, data) for name, data in splits.items()}
    prof = chooser.profile(target, sft, prompt, stop_token=tok.cot_end_id)[0]  # this machine's, cached
    before = report(target, sft, sft, splits, prof, outputs)
    updates = []  # every update's statistics: what the reward, its spread within a group and the KL did
    draft = train_aarl(target, copy.deepcopy(sft), train, cfg, ref=sft, log=updates.append)
    after = report(target, draft, sft, splits, prof, outputs, before["val"]["gamma"])
    checkpoint.save(draft, out, target=target)
    res = {"reference": cfg.reference, "seed": cfg.seed, "config": asdict(cfg), "wall_s": time.time() - t0,
           "environment": timing.environment(device) | {"threads": torch.get_num_threads(), "device": str(device)},
           "out": out, "before": before, "after": after, "training": training_summary(updates)}
    files.write_json(out.rstrip("/\\") + ".metrics.json", res)  # what AARL learned, beside the draft it saved
    return res


def training_summary(updates, k=20):
    """Means of each update statistic over the first and the last k updates."""
    mean = lambda rows: {key: sum(u[key] for u in rows) / len(rows) for key in rows[0] if key != "step"}  # noqa: E731
    return {"first": mean(updates[:k]), "last": mean(updates[-k:]), "updates": len(updates)}


# ---- the command line and argument checks ----
def print_result(res):
    for name in ("val", "test"):
        b, f = res["before"][name], res["after"][name]
        shown = "  ".join(f"g{g} {b['tau_by_gamma'][g]:.2f}->{f['tau_by_gamma'][g]:.2f}" for g in (4, 6, 8))
        print(f"{name:4s} tau@{f['gamma']} {b['tau']:.2f}->{f['tau']:.2f}  {shown}  routine "
              f"{b['routine_fraction']:.3f}->{f['routine_fraction']:.3f}  drafted-CoC ADE {b['drafted_ade']:.2f}->"
              f"{f['drafted_ade']:.2f} m  KL to SFT {f['kl_to_sft']:.4f}  greedy identical {f['greedy_match']}")
    first, last = res["training"]["first"], res["training"]["last"]
    print("updates, first -> last 20: " + "  ".join(f"{k} {first[k]:.3f}->{last[k]:.3f}" for k in first))
    print(f"AARL ({res['reference']}, seed {res['seed']}) wall time {res['wall_s']:.0f} s; draft saved to {res['out']}")


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description="AARL post-training of the FlatRoPE draft (needs train.py's checkpoints; "
                                 "a real target: python -m real.aarl_real --help)")
    ap.add_argument("--run", default=checkpoint.SHIPPED, help="folder with target/ and draft_flat_s<seed>/ "
                    "(default: the shipped checkpoints/toy)")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--n-report", type=int, default=64, help="validation / held-out scenes of the before / after report")
    ap.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT}/draft_aarl[_REFERENCE]_s<seed>; "
                    "RUN/draft_aarl_s<seed> is the draft rsd.py reports as FlatRoPE + AARL)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing draft at --out (only a FlatRoPE "
                    "draft is ever replaced)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    cli.add_config_flags(ap, AARLConfig, choices={"reference": list(REFERENCES), "kind": list(M.DRAFT_KINDS)})
    a = ap.parse_args(argv)
    cfg = cli.config_from_args(AARLConfig, a)
    with cli.json_stdout(a.json), cli.user_errors(ap):
        check_config(cfg)
        cli.check_values(a, [(">= 1", ("n_report",))], flags=True)
        cli.check_device(a.device)
        res = run(cfg, a.run, a.n_report, a.device, a.out, a.overwrite)
        print_result(res)
    if a.json:
        print(json.dumps(res))
    return res


def check_config(cfg: AARLConfig):
    """Clear errors before any work."""
    if cfg.reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, got {cfg.reference!r}")
    if cfg.group < 2:
        raise ValueError(f"group must be >= 2 for group-relative advantages, got {cfg.group}")
    if cfg.reference == "moving" and cfg.refresh < 10:
        raise ValueError(f"refresh must be >= 10 updates (a reference reset every update has zero KL), "
                         f"got {cfg.refresh}")
    cli.check_values(cfg, [(">= 1", ("steps", "scenes", "n_train", "max_new")),
                           ("a finite number > 0", ("lr", "temperature")), ("in 0..2**30-1", ("seed",)),
                           (cli.VIEWS_RULE, ("views",)), ("a finite number >= 0", ("beta", "agree_weight"))])


if __name__ == "__main__":
    main()
