"""Training on the synthetic driving world: SFT of the deliberative reasoner (the target VLA, Alpamayo-R1 style: CoC
next-token loss plus a trajectory loss) and distillation of the two routine-reasoner drafts, FlatRoPE (1D positions)
and the M-RoPE replica of standard speculative decoding (same data, steps and seed: only the position scheme differs),
in one loop: each step runs the frozen target once and updates each draft q with KL(p || q) on the CoC positions
(--loss tvd: the total variation). The SFT FlatRoPE draft is also AARL's static reference (aarl.py).

A draft for a real target, distilled on the target's own CoCs over the user's scenes, is real/distill.py.

run: python train.py --device cpu                 (target + both drafts into runs/toy; --help lists the flags)
     torchrun --nproc_per_node 2 train.py         (the same with DistributedDataParallel)
"""
import argparse
import contextlib
from dataclasses import asdict, dataclass, replace
import os
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import driving
from driving import Data, grid_kwargs, vision_kwargs
import evaluate
from evaluate import autocast, evaluate_target
import model as M
from ops import checkpoint, cli, files, runs


# ---- config ----
from measure import timing


# ---- config ----
@dataclass
class TrainConfig:
    out: str = "runs/toy"  # checkpoints: out/target, out/draft_{flat,mrope}_s<draft_seed> (+ *.state.pt to resume)
    device: str = "cpu"  # torch device (cpu, cuda)
    seed: int = 0  # seeds the scenes of every split, the initialisation and the batch order
    n_train: int = 32000  # pre-generated training scenes (the world is cheap; a fixed set keeps steps reproducible)
    n_val: int = 256  # validation scenes (same distribution as train)
    n_test: int = 256  # held-out test scenes (factor combinations never seen in training)
    batch_size: int = 16  # global batch; each DDP rank takes batch_size / world_size of it
    target_steps: int = 5000  # SFT steps of the target (the shipped one's; 7,500 is seed-robust: docs/toy-notes.md)
    target_lr: float = 1.5e-3  # peak learning rate of the target
    train_vision: bool = False  # also train the vision tower (default: frozen at random init; train_target says why)
    traj_weight: float = 0.1  # weight of the trajectory Huber loss (metres) next to the CoC cross-entropy
    draft_steps: int = 300  # distillation steps of the drafts
    draft_seed: int = 0  # seeds the drafts' initialisation and batch order (the target and the scenes stay)
    draft_seeds: str = ""  # several draft seeds in one call, one after another (e.g. 0,1,2); default: --draft-seed
    draft_lr: float = 3e-3  # peak learning rate of the drafts
    kinds: str = "flat,mrope"  # the drafts distilled, model.DRAFT_KINDS: flat (FlatRoPE), mrope (the replica), history
    loss: str = "kl"  # the drafts' distillation loss: kl, KL(p || q); tvd, the total variation (distill_loss)
    target_dir: str = ""  # --stage drafts: distil from this target folder instead of OUT/target (nothing is copied)
    target_preset: str = "toy-target"  # target sizes (model.PRESETS)
    draft_preset: str = "toy-draft"  # the drafts' sizes (model.DRAFT_PRESETS); the four flags below override it
    draft_layers: int = 0  # decoder layers of each draft (0: the preset's)
    draft_width: int = 0  # hidden size of each draft (0: the target's; narrower keeps head_dim, with projections)
    draft_heads: int = 0  # attention heads of each draft (0: width / head_dim)
    draft_kv_heads: int = 0  # KV heads of each draft (0: as many as the target, dividing the heads)
    draft_vocab: int = 0  # K > 0: the drafts' heads cover only the K ids commonest in the training CoCs; 0 = all
    warmup: int = 20  # linear warm-up steps, then cosine decay to 10%
    weight_decay: float = 0.01  # AdamW weight decay
    grad_clip: float = 1.0  # gradient-norm clip
    amp: bool = True  # bf16 autocast for the matmuls (fp32 master weights): faster on a CPU with bf16 support
    eval_every: int = 1000  # steps between validation passes (and resumable checkpoints)
    views: int = driving.WorldConfig().views  # surround views of the drafts' training and of every evaluation
    max_views: int = driving.MAX_VIEWS  # the target trains on every view count 0..max_views (one per batch)
    p_no_views: float = 0.8  # ... this share of its batches at 0 views, where it learns to read cheaply (toy-notes)
    overwrite: bool = False  # retrain and replace checkpoints in out that have no resumable *.state.pt beside them


# ---- model construction ----
def target_config(tok: driving.Tokenizer, preset="toy-target") -> M.ModelConfig:
    """The toy target: model.PRESETS[preset] with the world's vocabulary, token ids and raster channels."""
    base = M.PRESETS[preset]
    # Every block windowed to one merged token (12 px): a random frame-wide block would mix the off-lane decoy's kind
    # into the in-lane actor's token (a pretrained tower keeps tokens local); one 32-wide block: docs/toy-notes.md.
    vision = replace(base.vision, in_channels=len(driving.CHANNELS), patch_size=driving.PATCH, temporal_patch_size=1,
                     spatial_merge_size=driving.MERGE, window_size=driving.PATCH * driving.MERGE,
                     fullatt_block_indexes=(), depth=1, hidden=32, heads=2, intermediate=64)
    # One M-RoPE t id per frame: the front camera's two frames are consecutive video frames.
    return replace(base, vocab_size=len(tok), image_token_id=tok.image_token_id, video_token_id=tok.video_token_id,
                   vision_start_token_id=tok.vision_start_id, tokens_per_second=1.0, vision=vision,
                   spatial_merge_size=driving.MERGE, traj_len=driving.WorldConfig().n_future, max_seq_len=1024)


def target_views(cfg: TrainConfig):
    """step -> its batch's views: 0 at probability p_no_views, else uniform in 1..max_views, seeded by (seed, step)."""
    def views(step):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        if cfg.max_views == 0 or float(torch.rand((), generator=g)) < cfg.p_no_views:
            return 0
        return int(torch.randint(1, cfg.max_views + 1, (), generator=g))
    return views


def draft_shape(cfg: TrainConfig):
    """make_draft's size arguments: the preset's, each --draft-* flag given (non-zero) in its place."""
    shape = dict(M.DRAFT_PRESETS[cfg.draft_preset])
    for flag, arg in (("draft_layers", "n_layers"), ("draft_width", "hidden_size"), ("draft_heads", "n_heads"),
                      ("draft_kv_heads", "n_kv_heads")):
        shape[arg] = getattr(cfg, flag) or shape.get(arg)
    return shape


def make_drafts(target, shape, kinds=("flat", "mrope"), vocab_ids=None):
    """Drafts of equal size (shape: make_draft's sizes, draft_shape), one per kind of model.DRAFT_KINDS (same data,
    steps and seed: only the kind differs); vocab_ids (K,): each with the reduced-vocabulary head over those ids."""
    return {kind: M.make_draft(target, kind=kind, vocab_ids=vocab_ids, **shape)
            for kind in M.DRAFT_KINDS if kind in kinds}  # the table's order: the order of their initialisation


def select_draft_vocab(cocs, k, stop_id, vocab_size):
    """EAGLE-3's reduced draft vocabulary (K,), most frequent first: the stop token (<cot_end>: without it a draft could
    never propose the end) and the K - 1 other ids commonest in `cocs` (training CoCs), ties and unseen ids by id."""
    if not isinstance(k, int) or not 1 <= k <= vocab_size:
        raise ValueError(f"draft vocabulary K must be an int in 1..{vocab_size} (the target's vocabulary), got {k!r}")
    if not 0 <= stop_id < vocab_size:
        raise ValueError(f"stop token {stop_id} is not an id of the vocabulary 0..{vocab_size - 1}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for c in cocs:
        counts += torch.bincount(torch.as_tensor(c, dtype=torch.long), minlength=vocab_size)
    # a stable sort of -count keeps ids of equal count in id order
    order = torch.sort(-counts, stable=True).indices  # (V,) most frequent first
    keep = torch.cat([order[order != stop_id][:k - 1], torch.tensor([stop_id])]).sort().values  # (K,) by id
    return keep[torch.sort(-counts[keep], stable=True).indices]  # (K,) back in frequency order, ties by id


# ---- losses ----
def target_loss(target, batch, traj_weight):
    """CoC cross-entropy + traj_weight * Huber(trajectory) -> (loss, coc_ce, traj_l1)."""
    ids = batch["input_ids"]
    logits, hidden = target(ids, return_hidden=True, **vision_kwargs(batch))  # (B, L, V), (B, L, D)
    labels = torch.full_like(ids, -100)  # (B, L): the token at i + 1 where position i predicts a CoC token
    labels[:, :-1] = ids[:, 1:].masked_fill(~batch["loss_mask"][:, :-1], -100)
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    h_traj = hidden[torch.arange(hidden.shape[0]), batch["traj_index"]]  # (B, D): the <traj_future_start> states
    pred = getattr(target, "module", target).traj(h_traj).float()  # (B, traj_len, 2); .module: under DDP
    return ce + traj_weight * F.smooth_l1_loss(pred, batch["traj"]), ce, (pred - batch["traj"]).abs().mean()


def distill_loss(draft, embeds, p_logp, batch, loss="kl"):
    """Forward KL(p || q) (loss kl, kl_p_q) averaged over CoC positions, p_logp (N, V) the target's log-probs there;
    tvd: TV(p, q) = 1/2 sum |p - q|, 1 - the acceptance rate of sampled speculative decoding (DistillSpec)."""
    logits_q = draft(batch["input_ids"], inputs_embeds=embeds, **grid_kwargs(batch))[batch["loss_mask"]].float()
    return (0.5 * (logits_q.softmax(-1) - p_logp.exp()).abs().sum(-1).mean() if loss == "tvd"
            else kl_p_q(draft, logits_q, p_logp))  # (N, V) of q, (N, V) of log p


def kl_p_q(draft, logits_q, p_logp):
    """batchmean KL(p || q) of q's logits (N, V) against log p (N, V). A reduced-vocabulary draft (K ids) has q = 0
    elsewhere, where KL(p || q) is infinite: its loss is KL(p_S || q), p_S being p renormalised on the set, minimised by
    the q that minimises the finite part of KL(p || q) (the sum over the set)."""
    ids = getattr(getattr(draft, "module", draft), "vocab_ids", None)  # .module: under DDP
    if ids is not None:
        logits_q, p_logp = logits_q[:, ids], F.log_softmax(p_logp[:, ids], -1)  # (N, K) each; log p_S
    q_logp = F.log_softmax(logits_q, -1)  # (N, V) or (N, K)
    return F.kl_div(q_logp, p_logp, log_target=True, reduction="batchmean")


# ---- stages ----
def train_target(cfg: TrainConfig, tok, train: Data, val: Data, rank=0, world=1, device="cpu", log=print):
    """SFT of the deliberative reasoner; saves out/target (checkpoint.save) and returns the model."""
    torch.manual_seed(cfg.seed)
    target = M.VLA(target_config(tok, cfg.target_preset)).to(device)
    # Frozen by default, as a pretrained encoder often is in VLA fine-tuning: trained with the LM, the video tokens of
    # a scene become nearly collinear (docs/toy-notes.md, "The frozen vision tower").
    target.visual.requires_grad_(cfg.train_vision)
    opt = runs.make_optimizer([p for p in target.parameters() if p.requires_grad], cfg.target_lr, cfg.weight_decay)
    state_path = os.path.join(cfg.out, "target.state.pt")
    start, _ = runs.load_state(state_path, {"target": target}, {"target": opt}, cfg)
    ddp = runs.wrap(target, world, device)
    bar = tqdm(range(start, cfg.target_steps), desc="target", disable=rank != 0, initial=start, total=cfg.target_steps)
    for step in bar:
        ddp.train()
        batch = train.batch(step, cfg.batch_size, rank, world, device)
        with autocast(device, cfg.amp):
            loss, ce, l1 = target_loss(ddp, batch, cfg.traj_weight)
        runs.update(opt, target, runs.lr_at(step, cfg.target_steps, cfg.target_lr, cfg.warmup), cfg.grad_clip, loss)
        bar.set_postfix(ce=f"{ce.item():.3f}", traj_l1=f"{l1.item():.2f}")
        runs.check_loss("target", loss.item(), step, state_path, target)  # a sync the line above already pays
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.target_steps:
            runs.save_state(state_path, step + 1, {"target": target}, {"target": opt}, cfg, rank)
            if rank == 0 and step + 1 < cfg.target_steps:
                log(f"target step {step + 1}: val {fmt(evaluate_target(target, val))}")
    if rank == 0:
        checkpoint.save(target, os.path.join(cfg.out, "target"))
    return target


def train_drafts(cfg: TrainConfig, target, train: Data, val: Data = None, rank=0, world=1, device="cpu"):
    """Distil the drafts of cfg.kinds from the frozen target in one loop; saves out/draft_<kind>_s<draft_seed> and,
    with val, what each learned at every evaluation in out/draft_<kind>_s<draft_seed>.metrics.json: the loss trained
    (train_<loss>) and, whatever it is, the exact KL(p || q) on val (val_kl) and tau at every gamma (val_tau)."""
    target.eval().requires_grad_(False)
    vocab_ids = (select_draft_vocab(train.coc_ids(), cfg.draft_vocab, train.tok.cot_end_id, target.cfg.vocab_size)
                 if cfg.draft_vocab else None)
    torch.manual_seed(cfg.seed + 1 + 1000 * cfg.draft_seed)
    drafts = make_drafts(target, draft_shape(cfg), cfg.kinds.split(","), vocab_ids)
    opts = {k: runs.make_optimizer(d.parameters(), cfg.draft_lr, cfg.weight_decay) for k, d in drafts.items()}
    state_path = os.path.join(cfg.out, f"drafts_s{cfg.draft_seed}.state.pt")
    bound = {"target": checkpoint.fingerprint(target)}  # the drafts' state is only valid with their target
    start, history = runs.load_state(state_path, drafts, opts, cfg, bound)
    history = history or {k: [] for k in drafts}  # each draft's evaluations so far (kept in the resumable state)
    outputs = None  # the target's greedy CoCs of val, which rank 0 evaluates the drafts on
    if val is not None and rank == 0:
        cli.progress(f"the target's greedy CoCs of {len(val.scenes)} val scenes (the drafts' evaluations)")
        outputs = evaluate.greedy_outputs(target, val)
    ddps = {k: runs.wrap(d, world, device) for k, d in drafts.items()}
    bar = tqdm(range(start, cfg.draft_steps), desc="drafts", disable=rank != 0, initial=start, total=cfg.draft_steps)
    for step in bar:
        batch = train.batch(step, cfg.batch_size, rank, world, device, order=cfg.draft_seed)
        with torch.no_grad(), autocast(device, cfg.amp):
            embeds = target.embed(batch["input_ids"], **vision_kwargs(batch))  # (B, L, D) image features included
            logits_p = target(batch["input_ids"], inputs_embeds=embeds, **grid_kwargs(batch))
        p_logp = F.log_softmax(logits_p[batch["loss_mask"]].float(), -1)  # (N, V) p on the CoC positions
        losses = {}
        for k, d in ddps.items():
            d.train()
            with autocast(device, cfg.amp):
                loss = distill_loss(d, embeds, p_logp, batch, cfg.loss)
            runs.update(opts[k], drafts[k], runs.lr_at(step, cfg.draft_steps, cfg.draft_lr, cfg.warmup), cfg.grad_clip,
                        loss)
            losses[k] = loss.item()
            runs.check_loss(f"{k} draft", losses[k], step, state_path, drafts[k])
        bar.set_postfix({f"{cfg.loss}_{k}": f"{v:.3f}" for k, v in losses.items()})  # named by the loss trained
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.draft_steps:
            if outputs is not None:  # beside the loss trained, evaluate's measures: the same whatever the loss
                matches = evaluate.draft_matches({k: d.eval() for k, d in drafts.items()}, target, val, outputs)
                for k, d in drafts.items():  # the exact KL(p || q) on val, tau at every gamma (the replay)
                    taus = evaluate.tau_by_gamma(matches[k], evaluate.GAMMAS)
                    history[k].append({"step": step + 1, f"train_{cfg.loss}": losses[k],
                                       "val_kl": evaluate.kl_to(target, d, target, val),
                                       "val_tau": {g: v["tau"] for g, v in taus.items()}})
                    files.write_json(checkpoint.draft_dir(cfg.out, k, cfg.draft_seed) + ".metrics.json",
                                     {"kind": k, "draft_seed": cfg.draft_seed, "config": asdict(cfg),
                                      "evaluations": history[k]})
            runs.save_state(state_path, step + 1, drafts, opts, cfg, rank, bound, extra=history)
    if rank == 0:
        for k, d in drafts.items():
            checkpoint.save(d, checkpoint.draft_dir(cfg.out, k, cfg.draft_seed), target=target)
    return drafts


def run(cfg: TrainConfig, stage="all", log=print):
    """Train what `stage` asks for; returns {"target", "drafts", "metrics"} on rank 0, which holds cfg.out's writer
    lock throughout (files.writer_lock) and first checks what would be replaced (check_outputs)."""
    cli.check_device(cfg.device)
    if stage == "drafts" and checkpoint.existing_kind(target_dir(cfg)) != "target":  # before the scenes are built
        if os.path.lexists(os.path.join(target_dir(cfg), checkpoint.WEIGHTS)):
            checkpoint.header(target_dir(cfg))  # weights there, not a target's: named (a FIFO, a foreign file)
        raise ValueError(f"--stage drafts distils from a target: {target_dir(cfg)} holds none; train one (--stage "
                         "target) or give --target-dir")
    if cfg.target_dir:  # the draft stage's target: drafts and their state never go into it
        files.check_out_dir(cfg.out, {"--target-dir": cfg.target_dir}, may_contain=("--target-dir",))
    rank, world, device = runs.setup_distributed(cfg.device)
    with files.writer_lock(cfg.out) if rank == 0 else contextlib.nullcontext():
        check_outputs(cfg, stage)
        cli.progress(f"train.py: stage {stage} into {cfg.out}")
        if cfg.batch_size % world:
            raise ValueError(f"batch_size {cfg.batch_size} is not divisible by the {world} ranks")
        tok = driving.Tokenizer()
        t0 = time.time()
        cli.progress(f"the world's scenes: {cfg.n_train} train, {cfg.n_val} val (seed {cfg.seed})")
        train = Data("train", cfg.n_train, cfg.seed, tok, views=cfg.views)
        val = Data("val", cfg.n_val, cfg.seed, tok, views=cfg.views)
        out = {"target": train_target(cfg, tok, train.with_views(target_views(cfg)), val, rank, world, device, log)
               if stage in ("all", "target") else checkpoint.load(target_dir(cfg), device=device)}
        if stage in ("all", "drafts"):
            for seed in draft_seeds(cfg):  # one after another, each its own resumable state
                out["drafts"] = train_drafts(replace(cfg, draft_seed=seed, draft_seeds=""), out["target"], train, val,
                                             rank, world, device)
                for k in cfg.kinds.split(",") if rank == 0 else ():  # where they went, after the progress bar
                    log(f"{k} draft (seed {seed}) saved to {checkpoint.draft_dir(cfg.out, k, seed)}, its metrics to "
                        f"{checkpoint.draft_dir(cfg.out, k, seed)}.metrics.json")
        if rank == 0 and stage != "drafts":  # a draft stage never rewrites (nor re-measures) the target's metrics
            test = Data("test", cfg.n_test, cfg.seed, tok, views=cfg.views)
            metrics = {"val": evaluate_target(out["target"], val), "test": evaluate_target(out["target"], test),
                       "scenes": {"val": cfg.n_val, "test": cfg.n_test}, "wall_s": time.time() - t0,
                       "environment": timing.environment(cfg.device) | {"threads": torch.get_num_threads()}}
            files.write_json(os.path.join(cfg.out, "train_metrics.json"), metrics)
            log(f"target val:  {fmt(metrics['val'])}")
            log(f"target test: {fmt(metrics['test'])}")
            log(f"wall time {metrics['wall_s']:.0f} s; target saved to {target_dir(cfg)}, its metrics to "
                f"{os.path.join(cfg.out, 'train_metrics.json')}")
            out["metrics"] = metrics
        runs.finish()
        return out


# ---- the command line ----
def fmt(metrics):
    return " ".join(f"{k}={v:.3f}" for k, v in metrics.items())


def parse_args(argv=None, parser=False):
    ap = argparse.ArgumentParser(description="Train the toy target VLA and distil the FlatRoPE and M-RoPE drafts "
                                 "(a draft for a real target: python -m real.distill --help).")
    ap.add_argument("--stage", choices=["all", "target", "drafts"], default="all",
                    help="target: SFT only; drafts: distil from an existing out/target; all: both")
    cli.add_config_flags(ap, TrainConfig, choices={"target_preset": sorted(M.PRESETS), "loss": ["kl", "tvd"],
                                                          "draft_preset": sorted(M.DRAFT_PRESETS)})
    a = ap.parse_args(argv)
    with cli.user_errors(ap):
        cli.check_out(a.out, folder=True)
        if a.draft_vocab > len(driving.Tokenizer()):  # here, not when the draft stage starts after the target's hour
            raise ValueError(f"--draft-vocab must be at most the toy vocabulary's {len(driving.Tokenizer())} ids, "
                             f"got {a.draft_vocab}")
        kinds = a.kinds.split(",")
        if set(kinds) - set(M.DRAFT_KINDS) or len(set(kinds)) < len(kinds):  # "" splits into [""]: unknown
            raise ValueError(f"--kinds takes distinct kinds of {', '.join(M.DRAFT_KINDS)} joined by commas, got "
                             f"{a.kinds!r}")
        draft_seeds(a)  # a ValueError naming --draft-seeds
        if a.target_dir and a.stage != "drafts":
            raise ValueError(f"--target-dir is the draft stage's target: add --stage drafts (got --stage {a.stage})")
        if a.target_dir and checkpoint.existing_kind(a.target_dir) != "target":
            raise ValueError(f"--target-dir {a.target_dir}: not a target checkpoint folder (checkpoint.save's)")
        cli.check_values(a, [(cli.MAX_VIEWS_RULE, ("views", "max_views")), ("in 0..2**30-1", ("seed", "draft_seed")),
                             (">= 1", ("n_train", "n_val", "n_test", "batch_size", "target_steps", "draft_steps",
                                       "eval_every")), ("a finite number > 0", ("target_lr", "draft_lr", "grad_clip")),
                             ("a finite number >= 0", ("traj_weight", "weight_decay", "warmup", "views", "max_views",
                                                       "draft_vocab", "draft_layers", "draft_width", "draft_heads",
                                                       "draft_kv_heads")), ("in [0, 1]", ("p_no_views",))], flags=True)
        check_draft_shape(a)
        cli.check_device(a.device)
    cfg = cli.config_from_args(TrainConfig, a)
    return (cfg, a.stage, ap) if parser else (cfg, a.stage)


def check_draft_shape(a):
    """A ValueError naming the --draft-* flag unless the drafts' shape fits the target's (--target-dir's or OUT/target's
    for --stage drafts, else --target-preset's): no wider, more heads or deeper than it, KV heads dividing the heads."""
    src = a.target_dir or os.path.join(a.out, "target")
    t = checkpoint.header(src)[1] if a.stage == "drafts" and checkpoint.existing_kind(src) == "target" else \
        M.PRESETS[a.target_preset]
    shape = draft_shape(a)
    D = shape["hidden_size"] or t.hidden_size
    H = shape["n_heads"] or (t.n_heads if D == t.hidden_size else D // t.head_dim)  # make_draft's
    for bad, flag, v, rule in ((not t.head_dim <= D <= t.hidden_size, "width", D,
                                f"in {t.head_dim}..{t.hidden_size} (the target's head_dim..hidden_size)"),
                               (H > t.n_heads, "heads", H, f"at most the target's {t.n_heads}"),
                               (shape["n_layers"] > t.n_layers, "layers", shape["n_layers"],
                                f"at most the target's {t.n_layers}"),
                               (shape["n_kv_heads"] and H % shape["n_kv_heads"], "kv-heads", shape["n_kv_heads"],
                                f"a divisor of the draft's {H} heads")):
        if bad:
            raise ValueError(f"--draft-{flag} must be {rule}, got {v}")


def target_dir(cfg: TrainConfig):
    return cfg.target_dir or os.path.join(cfg.out, "target")


def draft_seeds(cfg: TrainConfig):
    """--draft-seeds in the order given (each a seed, in 0..2**30-1), else [--draft-seed]."""
    return (cli.number_list(cfg.draft_seeds, "--draft-seeds", rule="in 0..2**30-1", unique=False) if cfg.draft_seeds
            else [cfg.draft_seed])


def check_outputs(cfg: TrainConfig, stage):
    """Unless cfg.overwrite, refuse before any work to replace a target (or this seed's drafts) with no *.state.pt
    beside it, a finished or shipped one (a new target makes its drafts stale); never what is not such a checkpoint."""
    todo = []
    if stage in ("all", "target"):
        todo.append((os.path.join(cfg.out, "target"), "target", "target.state.pt",
                     f"rerun with --overwrite to retrain it (every draft in {cfg.out} then becomes stale), or "
                     f"`python train.py --out {cfg.out} --stage drafts --draft-seed N` to distil a new draft seed "
                     "from it"))
    if stage in ("all", "drafts"):
        todo += [(checkpoint.draft_dir(cfg.out, kind, seed), f"{kind} draft", f"drafts_s{seed}.state.pt",
                  "rerun with --overwrite to retrain it, or give another --draft-seed or --out")
                 for seed in draft_seeds(cfg) for kind in cfg.kinds.split(",")]
    for path, kind, state, how in todo:  # a *.state.pt beside it: a run to resume, not a checkpoint to protect
        checkpoint.check_output(path, kind, cfg.overwrite or os.path.exists(os.path.join(cfg.out, state)), how)


@cli.program
def main(argv=None):
    cfg, stage, ap = parse_args(argv, parser=True)
    with cli.user_errors(ap):  # a locked, read-only or existing --out, a full disk: one line
        return run(cfg, stage)


if __name__ == "__main__":
    main()
