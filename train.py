"""Training on the synthetic driving world: SFT of the deliberative reasoner (the target VLA, Alpamayo-R1 style: CoC
next-token loss plus a trajectory loss) and distillation of the two routine-reasoner drafts, FlatRoPE (1D positions)
and the M-RoPE replica of standard speculative decoding (same data, steps and seed: only the position scheme differs),
in one loop: each step runs the frozen target once and updates each draft q with KL(p || q) on the CoC positions.
The SFT FlatRoPE draft is also AARL's static reference (aarl.py).

A draft for any target (section "a draft for any target"): a real target has no ground-truth CoCs, so it writes its
own on the user's scenes (scenes.distill_data) and the draft is distilled on them with the same KL(p || q), one
sequence per forward (prompt lengths differ) and batch_size sequences per update by gradient accumulation.

run: python train.py --device cpu                 (target + both drafts into runs/toy; --help lists the flags)
     torchrun --nproc_per_node 2 train.py         (the same with DistributedDataParallel)
     python train.py --target ALPAMAYO_DIR --scenes SCENES --out RUN --device cuda --dtype bf16 --amp
     torchrun --nproc_per_node 8 train.py --target ALPAMAYO_DIR --scenes SCENES --out RUN --device cuda --dtype bf16 \
         --amp                                    (eight GPUs: the scenes sharded over the ranks; docs/own-target.md)
"""
import argparse
import contextlib
import datetime
import hashlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import checkpoint
import cli
import driving
import files
import hf
import model as M
import scenes
import speculate
from driving import Data, grid_kwargs, vision_kwargs
from evaluate import MAX_VIEWS_RULE, autocast, check_values, evaluate_target

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
    draft_steps: int = 300  # distillation steps of both drafts
    draft_seed: int = 0  # seeds the drafts' initialisation and batch order (the target and the scenes stay)
    draft_lr: float = 3e-3  # peak learning rate of the drafts
    target_preset: str = "toy-target"  # target sizes (model.PRESETS)
    draft_preset: str = "toy-draft"  # sizes of both drafts (model.DRAFT_PRESETS)
    draft_vocab: int = 0  # K > 0: both drafts' heads cover only the K ids commonest in the training CoCs; 0 = all
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


def make_drafts(target, preset, vocab_ids=None):
    """The two drafts of equal size: FlatRoPE (routine reasoner) and the M-RoPE replica; vocab_ids (K,): both with
    the reduced-vocabulary head over those target ids (select_draft_vocab)."""
    return {mode: M.make_draft(target, rope_mode=mode, **dict(M.DRAFT_PRESETS[preset], vocab_ids=vocab_ids))
            for mode in ("flat", "mrope")}  # flat first: the order of their initialisation


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
def coc_targets(batch):
    """Next-token labels (B, L): the token at i + 1 where position i predicts a CoC token, else -100."""
    ids = batch["input_ids"]
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:].masked_fill(~batch["loss_mask"][:, :-1], -100)
    return labels


def target_loss(target, batch, traj_weight):
    """CoC cross-entropy + traj_weight * Huber(trajectory) -> (loss, coc_ce, traj_l1)."""
    logits, hidden = target(batch["input_ids"], return_hidden=True, **vision_kwargs(batch))  # (B, L, V), (B, L, D)
    ce = F.cross_entropy(logits.flatten(0, 1).float(), coc_targets(batch).flatten())
    h_traj = hidden[torch.arange(hidden.shape[0]), batch["traj_index"]]  # (B, D): the <traj_future_start> states
    pred = getattr(target, "module", target).traj(h_traj).float()  # (B, traj_len, 2); .module: under DDP
    return ce + traj_weight * F.smooth_l1_loss(pred, batch["traj"]), ce, (pred - batch["traj"]).abs().mean()


def distill_loss(draft, embeds, p_logp, batch):
    """Forward KL(p || q) averaged over CoC positions; p_logp (N, V) are the target's log-probs there. A reduced-
    vocabulary draft (K ids) has q = 0 elsewhere, where KL(p || q) is infinite: its loss is KL(p_S || q), p_S being p
    renormalised on the set, minimised by the q that minimises the finite part of KL(p || q) (the sum over the set)."""
    logits_q = draft(batch["input_ids"], inputs_embeds=embeds, **grid_kwargs(batch))  # (B, L, V)
    return kl_p_q(draft, logits_q[batch["loss_mask"]].float(), p_logp)  # (N, V) of q, (N, V) of log p


def kl_p_q(draft, logits_q, p_logp):
    """batchmean KL(p || q) of q's logits (N, V) against log p (N, V), on the reduced-vocabulary set if the draft has
    one (distill_loss says why)."""
    ids = getattr(getattr(draft, "module", draft), "vocab_ids", None)  # .module: under DDP
    if ids is not None:
        logits_q, p_logp = logits_q[:, ids], F.log_softmax(p_logp[:, ids], -1)  # (N, K) each; log p_S
    q_logp = F.log_softmax(logits_q, -1)  # (N, V) or (N, K)
    return F.kl_div(q_logp, p_logp, log_target=True, reduction="batchmean")


# ---- stages ----
def update(opt, loss, model, step, steps, lr, cfg):
    """One clipped AdamW step; lr: linear warm-up over cfg.warmup steps, then cosine decay to 10% of it at `steps`."""
    for grp in opt.param_groups:
        grp["lr"] = lr_at(step, steps, lr, cfg)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()


def lr_at(step, steps, lr, cfg):
    """Linear warm-up over cfg.warmup steps, then cosine decay to 10% of lr at `steps`."""
    frac = (step - cfg.warmup) / max(1, steps - cfg.warmup)
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
    return lr * (step + 1) / cfg.warmup if step < cfg.warmup else lr * cosine


def make_optimizer(params, cfg, lr):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


def train_target(cfg: TrainConfig, tok, train: Data, val: Data, rank=0, world=1, device="cpu", log=print):
    """SFT of the deliberative reasoner; saves out/target (checkpoint.save) and returns the model."""
    torch.manual_seed(cfg.seed)
    target = M.VLA(target_config(tok, cfg.target_preset)).to(device)
    # Frozen by default, as a pretrained encoder often is in VLA fine-tuning: trained with the LM, the video tokens of
    # a scene become nearly collinear (docs/toy-notes.md, "The frozen vision tower").
    target.visual.requires_grad_(cfg.train_vision)
    opt = make_optimizer([p for p in target.parameters() if p.requires_grad], cfg, cfg.target_lr)
    state_path = os.path.join(cfg.out, "target.state.pt")
    start = load_state(state_path, {"target": target}, {"target": opt}, cfg, device)
    ddp = wrap(target, world, device)
    bar = tqdm(range(start, cfg.target_steps), desc="target", disable=rank != 0, initial=start,
               total=cfg.target_steps)
    for step in bar:
        ddp.train()
        batch = train.batch(step, cfg.batch_size, rank, world, device)
        with autocast(device, cfg.amp):
            loss, ce, l1 = target_loss(ddp, batch, cfg.traj_weight)
        update(opt, loss, target, step, cfg.target_steps, cfg.target_lr, cfg)
        bar.set_postfix(ce=f"{ce.item():.3f}", traj_l1=f"{l1.item():.2f}")
        check_loss("target", loss.item(), step, state_path)  # a sync the line above already pays
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.target_steps:
            save_state(state_path, step + 1, {"target": target}, {"target": opt}, cfg, rank)
            if rank == 0 and step + 1 < cfg.target_steps:
                log(f"target step {step + 1}: val {fmt(evaluate_target(target, val))}")
    if rank == 0:
        checkpoint.save(target, os.path.join(cfg.out, "target"))
    return target


def train_drafts(cfg: TrainConfig, target, train: Data, rank=0, world=1, device="cpu"):
    """Distil both drafts from the frozen target in one loop; saves out/draft_{flat,mrope}_s<draft_seed>."""
    target.eval().requires_grad_(False)
    vocab_ids = (select_draft_vocab(train.coc_ids(), cfg.draft_vocab, train.tok.cot_end_id, target.cfg.vocab_size)
                 if cfg.draft_vocab else None)
    torch.manual_seed(cfg.seed + 1 + 1000 * cfg.draft_seed)
    drafts = make_drafts(target, cfg.draft_preset, vocab_ids)
    opts = {k: make_optimizer(d.parameters(), cfg, cfg.draft_lr) for k, d in drafts.items()}
    state_path = os.path.join(cfg.out, f"drafts_s{cfg.draft_seed}.state.pt")
    bound = checkpoint.fingerprint(target)  # the drafts' state is only valid with the target it was distilled from
    start = load_state(state_path, drafts, opts, cfg, device, bound)
    ddps = {k: wrap(d, world, device) for k, d in drafts.items()}
    bar = tqdm(range(start, cfg.draft_steps), desc="drafts", disable=rank != 0, initial=start,
               total=cfg.draft_steps)
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
                loss = distill_loss(d, embeds, p_logp, batch)
            update(opts[k], loss, drafts[k], step, cfg.draft_steps, cfg.draft_lr, cfg)
            losses[k] = loss.item()
            check_loss(f"{k} draft", losses[k], step, state_path)
        bar.set_postfix({f"kl_{k}": f"{v:.3f}" for k, v in losses.items()})
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.draft_steps:
            save_state(state_path, step + 1, drafts, opts, cfg, rank, bound)
    if rank == 0:
        for k, d in drafts.items():
            checkpoint.save(d, checkpoint.draft_dir(cfg.out, k, cfg.draft_seed), target=target)
    return drafts


def run(cfg: TrainConfig, stage="all", log=print):
    """Train what `stage` asks for; returns {"target", "drafts", "metrics"} on rank 0, which holds cfg.out's writer
    lock throughout (files.writer_lock) and first checks what would be replaced (check_outputs)."""
    cli.check_device(cfg.device)
    rank, world, device = setup_distributed(cfg.device)
    with files.writer_lock(cfg.out) if rank == 0 else contextlib.nullcontext():
        check_outputs(cfg, stage)
        if cfg.batch_size % world:
            raise ValueError(f"batch_size {cfg.batch_size} is not divisible by the {world} ranks")
        tok = driving.Tokenizer()
        t0 = time.time()
        train = Data("train", cfg.n_train, cfg.seed, tok, views=cfg.views)
        val = Data("val", cfg.n_val, cfg.seed, tok, views=cfg.views)
        out = {"target": train_target(cfg, tok, train.with_views(target_views(cfg)), val, rank, world, device, log)
               if stage in ("all", "target") else checkpoint.load(os.path.join(cfg.out, "target"), device=device)}
        if stage in ("all", "drafts"):
            out["drafts"] = train_drafts(cfg, out["target"], train, rank, world, device)
        if rank == 0:
            test = Data("test", cfg.n_test, cfg.seed, tok, views=cfg.views)
            metrics = {"val": evaluate_target(out["target"], val), "test": evaluate_target(out["target"], test),
                       "scenes": {"val": cfg.n_val, "test": cfg.n_test}, "wall_s": time.time() - t0}
            files.write_json(os.path.join(cfg.out, "train_metrics.json"), metrics)
            log(f"target val:  {fmt(metrics['val'])}")
            log(f"target test: {fmt(metrics['test'])}")
            log(f"wall time {metrics['wall_s']:.0f} s")
            out["metrics"] = metrics
        if dist.is_initialized():
            dist.destroy_process_group()
        return out


# ---- a draft for any target: distilled on the target's own CoCs ----
@dataclass
class DraftConfig:
    target: str = ""  # a Hugging Face Qwen2.5-VL / Qwen3-VL or Alpamayo-R1 folder (hf.load_pretrained), or our format
    scenes: str = ""  # the training scenes, scenes.py's folder format (or --toy-scenes)
    toy_scenes: int = 0  # N > 0: the prompts are the toy world's first N training scenes (for an exported toy target)
    out: str = "runs/draft"  # out/data: the target's CoCs (scenes.distill_data); out/draft_<kind>_s<seed>
    kind: str = "flat"  # flat: FlatRoPE, the routine reasoner; mrope: the replica of standard speculative decoding
    device: str = "cpu"  # torch device (cpu, cuda)
    dtype: str = "fp32"  # the frozen target's weights (bf16 on a GPU); the draft's own weights stay fp32
    amp: bool = False  # bf16 autocast for the matmuls of both models
    steps: int = 300  # draft updates
    batch_size: int = 16  # CoCs per update, one sequence at a time (gradient accumulation), batch_size / world per rank
    lr: float = 3e-3  # peak learning rate
    warmup: int = 20  # linear warm-up steps, then cosine decay to 10%
    weight_decay: float = 0.01  # AdamW weight decay
    grad_clip: float = 1.0  # gradient-norm clip
    seed: int = 0  # seeds the draft's initialisation and the record order (the data is one for every seed)
    init: str = "random"  # random, or last: the draft's layer starts as a copy of the target's last one (+ final norm)
    draft_vocab: int = 0  # K > 0: the head covers the K ids commonest in the target's own CoCs; 0 = all
    save_every: int = 100  # updates between resumable states
    workers: int = 0  # DataLoader processes building the prompts ahead (images read and resized on the CPU); 0: inline
    samples: int = 1  # CoCs per training scene (1 when greedy)
    temperature: float = 0.0  # the target's CoCs: 0 = greedy; Alpamayo-R1's release samples at 0.6 / top-p 0.98
    top_p: float = 0.98  # with temperature > 0
    max_new: int = 128  # CoC token limit per scene
    min_pixels: int = 163840  # the images' size bounds in the target's image processor (Alpamayo's: 160-192 tokens)
    max_pixels: int = 196608
    processor: str = ""  # the tokenizer + image processor folder (default: --target)
    views: int = driving.WorldConfig().views  # --toy-scenes: the surround views of the toy prompts
    overwrite: bool = False  # replace a finished draft of this kind and seed in out


def load_target(path, dtype=None, device=None):
    """A folder with config.json through hf.load_pretrained, else our format (checkpoint.load)."""
    load = hf.load_pretrained if os.path.exists(os.path.join(path, hf.CONFIG)) else checkpoint.load
    return load(path, dtype=dtype, device=device)


def prompt_source(cfg: DraftConfig):
    """([(scene_id, prompt or a function building it)], stop_ids): the toy world's scenes (--toy-scenes) or a scene
    folder (scenes.scene_prompts: Alpamayo-R1 or plain Qwen-VL); stop_ids end the reasoning, in order."""
    if cfg.toy_scenes:
        tok = driving.Tokenizer()
        world = driving.make_split("train", cfg.toy_scenes, 0)  # train.py's scenes (TrainConfig.seed 0)
        return [(f"toy{i}", lambda s=s: driving.build_prompt(s, tok, cfg.views)) for i, s in enumerate(world)], \
            [tok.cot_end_id]
    _, prompts, stop, _ = scenes.scene_prompts(cfg.target, cfg.scenes, cfg.processor or None,
                                               min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    return prompts, stop


def record_order(step, batch_size, n, seed):
    """The global record indices of update `step`: epochs of seeded permutations of range(n), read batch_size at a
    time, so that a resumed run, or one on other ranks, takes the same records in the same updates."""
    first = step * batch_size
    idx = []
    while len(idx) < batch_size:
        epoch, at = divmod(first + len(idx), n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        idx += perm[at:at + batch_size - len(idx)]
    return idx


def sequence_kl(target, draft, prompt, coc):
    """KL(p || q) averaged over the T positions that predict the CoC (coc: T ids): one teacher-forced forward of each
    model over prompt + coc, each LM head on those T rows only (152k columns at thousands of prompt rows would not
    fit in memory)."""
    ids = torch.cat([prompt["input_ids"], torch.tensor([coc], device=prompt["input_ids"].device)], 1)  # (1, L + T)
    T, grids = len(coc), {k: prompt[k] for k in speculate.GRID_KEYS if prompt.get(k) is not None}
    with torch.no_grad():
        embeds, deepstack = speculate.embed_prompt(target, dict(prompt, input_ids=ids))  # (1, L + T, D)
        logits_p = target(ids, inputs_embeds=embeds, deepstack=deepstack, logits_to_keep=T + 1, **grids)  # (1, T+1, V)
    # rows L - 1 .. L + T - 2: p and q after the prompt and coc[:t] (the last row predicts past the CoC)
    p_logp = F.log_softmax(logits_p[0, :-1].float(), -1)  # (T, V)
    logits_q = draft(ids, inputs_embeds=embeds, logits_to_keep=T + 1, **grids)[0, :-1].float()  # (T, V)
    return kl_p_q(draft, logits_q, p_logp)


class RankPrompts(torch.utils.data.Dataset):
    """(record index, its prompt) for this rank's share of every update from `start` on, in training order. Under a
    DataLoader with workers the prompts are built ahead in other processes: reading and resizing a scene's 16 camera
    images is CPU work that would otherwise stall the GPU between forwards."""

    def __init__(self, records, prompt_of, cfg, start, rank, world):
        self.records, self.prompt_of, self.cfg = records, prompt_of, cfg
        self.start, self.rank, self.world, self.per_rank = start, rank, world, cfg.batch_size // world

    def __len__(self):
        return (self.cfg.steps - self.start) * self.per_rank

    def __getitem__(self, k):
        step, i = divmod(k, self.per_rank)
        order = record_order(self.start + step, self.cfg.batch_size, len(self.records), self.cfg.seed)
        j = order[self.rank::self.world][i]
        prompt = self.prompt_of[self.records[j]["scene"]]
        return j, prompt() if callable(prompt) else prompt


def new_draft(target, kind, init="random", vocab_ids=None):
    """The routine reasoner's start: one decoder layer of the target's shape (model.make_draft: the target's embedding
    and LM head, shared and frozen), fp32 master weights; init "last": its layer a copy of the target's last one,
    which already maps the target's hidden states to what its final norm and LM head read."""
    draft = M.make_draft(target, n_layers=1, rope_mode=kind, vocab_ids=vocab_ids).float()
    if init == "last":
        draft.layers[0].load_state_dict({k: v.float() for k, v in target.layers[-1].state_dict().items()})
        draft.norm.load_state_dict({k: v.float() for k, v in target.norm.state_dict().items()})
    return draft


def distill_draft(cfg: DraftConfig, target, records, prompt_of, stop_id, rank=0, world=1, device="cpu"):
    """Distil a `cfg.kind` draft from the frozen target on its own CoCs (records: scenes.read_distill_data's), one
    sequence per forward, batch_size per update accumulated over the ranks' shares; resumable; saves
    out/draft_<kind>_s<seed> bound to the target. prompt_of: scene_id -> prompt or a function building it; stop_id:
    the id ending the reasoning (kept in a reduced vocabulary)."""
    target.eval().requires_grad_(False)
    vocab_ids = (select_draft_vocab([r["tokens"] for r in records], cfg.draft_vocab, stop_id, target.cfg.vocab_size)
                 if cfg.draft_vocab else None)
    torch.manual_seed(cfg.seed)
    draft = new_draft(target, cfg.kind, cfg.init, vocab_ids)
    opt = make_optimizer(draft.parameters(), cfg, cfg.lr)
    state_path = os.path.join(cfg.out, f"draft_{cfg.kind}_s{cfg.seed}.state.pt")
    bound = checkpoint.fingerprint(target)
    # the records the state's updates drew: a resume after the scenes changed would draw others at the same steps
    data = {"records": len(records), "sha256": hashlib.sha256(repr(
        [(r["scene"], r["sample"], r["tokens"]) for r in records]).encode()).hexdigest()[:16]}
    start = load_state(state_path, {cfg.kind: draft}, {cfg.kind: opt}, cfg, device, bound, DraftConfig, data)
    ddp = wrap(draft, world, device)
    per_rank, w = cfg.batch_size // world, next(target.parameters())
    stream = iter(torch.utils.data.DataLoader(RankPrompts(records, prompt_of, cfg, start, rank, world), batch_size=None,
                                              num_workers=cfg.workers))
    bar = tqdm(range(start, cfg.steps), desc=f"draft_{cfg.kind}", disable=rank != 0, initial=start, total=cfg.steps)
    for step in bar:
        ddp.train()
        loss_sum, n_tok, t0 = 0.0, 0, time.time()
        for i in range(per_rank):  # this rank's share of the update's records
            j, prompt = next(stream)
            prompt = speculate.on_model(prompt, target)
            last = i == per_rank - 1  # DDP averages the gradients across ranks at the last backward only
            with (contextlib.nullcontext() if last or world == 1 else ddp.no_sync()), autocast(device, cfg.amp):
                loss = sequence_kl(target, ddp, prompt, records[j]["tokens"]) / per_rank
                loss.backward()
            loss_sum, n_tok = loss_sum + loss.item(), n_tok + len(records[j]["tokens"])
        if world > 1:  # every rank sees a NaN on any rank: its gradients were already averaged into everyone's
            loss_sum = all_mean(loss_sum, device)
        check_loss(f"{cfg.kind} draft", loss_sum, step, state_path)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg)
        torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(kl=f"{loss_sum:.3f}", tok_s=f"{n_tok * world / (time.time() - t0):.0f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_state(state_path, step + 1, {cfg.kind: draft}, {cfg.kind: opt}, cfg, rank, bound, data)
    if rank == 0:
        checkpoint.save(draft.to(w.dtype), checkpoint.draft_dir(cfg.out, cfg.kind, cfg.seed), target=target)
    return draft


def run_draft(cfg: DraftConfig, stage="all", log=print):
    """The target's CoCs on the training scenes, each rank decoding its share into out/data/part<rank> (resumable,
    whatever the number of ranks before), then the draft, every rank reading every part."""
    cli.check_device(cfg.device)
    rank, world, device = setup_distributed(cfg.device)
    if cfg.batch_size % world:
        raise ValueError(f"batch_size {cfg.batch_size} is not divisible by the {world} ranks")
    target = load_target(cfg.target, cli.DTYPES[cfg.dtype], device)
    prompts, stop = prompt_source(cfg)
    root = os.path.join(cfg.out, "data")
    with files.writer_lock(cfg.out) if rank == 0 else contextlib.nullcontext():
        if rank == 0:
            checkpoint.check_output(checkpoint.draft_dir(cfg.out, cfg.kind, cfg.seed), f"{cfg.kind} draft",
                                    cfg.overwrite or os.path.exists(os.path.join(
                                        cfg.out, f"draft_{cfg.kind}_s{cfg.seed}.state.pt")),
                                    "rerun with --overwrite to retrain it, or give another --seed or --out")
        done = {r["scene"] for r in read_parts(root)}  # read by every rank before any writes
        barrier()
        sampled = dict(temperature=cfg.temperature, top_p=cfg.top_p, samples=cfg.samples) if cfg.temperature else {}
        scenes.distill_data(target, [p for p in prompts if p[0] not in done][rank::world],  # what is left, shared
                            os.path.join(root, f"part{rank}"), stop, cfg.max_new, log=log if rank == 0 else None,
                            **sampled)
        barrier()
        order = {scene_id: i for i, (scene_id, _) in enumerate(prompts)}  # the same records order for any world size
        # records of scenes no longer in the folder are left out
        out = {"data": sorted((r for r in read_parts(root) if r["scene"] in order),
                              key=lambda r: (order[r["scene"]], r["sample"]))}
        if stage == "all":
            out["draft"] = distill_draft(cfg, target, out["data"], dict(prompts), stop[-1], rank, world, device)
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


def read_parts(root):
    """The records of every part under root (scenes.read_distill_data of each), part by part."""
    parts = sorted(p for p in (os.listdir(root) if os.path.isdir(root) else ())
                   if os.path.exists(os.path.join(root, p, scenes.INDEX)))
    return [r for p in parts for r in scenes.read_distill_data(os.path.join(root, p))]


def barrier():
    if dist.is_initialized():
        dist.barrier()


def all_mean(value, device):
    t = torch.tensor(float(value), device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


# ---- operations: distributed ranks, resumable state, what a run may replace, the command line ----
def setup_distributed(device):
    """(rank, world_size, device). Under torchrun: gloo on CPU, nccl on CUDA, one GPU per rank."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device(device)
    cuda, local = device.startswith("cuda"), int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
    # one rank's share of the data decode, or of a slow save, can outlast the 10-minute default at a barrier
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=2))
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
            torch.device("cuda", local) if cuda else torch.device(device))


def wrap(m, world, device):
    return m if world == 1 else torch.nn.parallel.DistributedDataParallel(
        m, device_ids=[device.index] if device.type == "cuda" else None)


def save_state(path, step, models, opts, cfg, rank, target=None, data=None):
    """Rank 0 writes the resumable state (for the drafts with their target's checkpoint.fingerprint, and for a real
    target's draft its records' fingerprint `data`); all ranks wait."""
    if rank == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        files.torch_save({"step": step, "config": asdict(cfg), "target": target, "data": data,
                               "models": {k: m.state_dict() for k, m in models.items()},
                               "opts": {k: o.state_dict() for k, o in opts.items()}}, path)
    if dist.is_initialized():
        dist.barrier()


# Fields that cannot change what a run computes: resuming with other values is fine. A moved target or scene folder
# (target, scenes, processor) is fine too: the fingerprints of the target and of the records are checked instead.
RESUMABLE_CHANGES = ("out", "device", "eval_every", "save_every", "n_val", "n_test", "overwrite", "target", "scenes",
                     "processor", "workers")


def load_state(path, models, opts, cfg, device, target=None, config=TrainConfig, data=None):
    """Resume from path if it exists -> the step to continue from (0: fresh). A state of another config, or (drafts) of
    another target than the `target` fingerprint, is refused, naming what differs: resuming would mix two runs."""
    if not os.path.exists(path):
        return 0
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which, do not silently restart
        raise ValueError(f"cannot resume from {path}: {e}; delete it to start over") from e
    # a field added to TrainConfig after the state was saved counts as its default, which is what that run used
    saved, now = {**asdict(config()), **state.get("config", {})}, asdict(cfg)
    differ = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
    if differ:
        raise ValueError(f"{path} was written by a run with other settings: "
                         + ", ".join(f"{k} {saved.get(k)!r} there, {now.get(k)!r} now" for k in differ)
                         + "; delete it (and the checkpoints beside it) to start over, or pass --out NEW_FOLDER")
    # a state saved before states recorded their target has none: it resumes unchecked
    if target is not None and state.get("target") not in (None, target):
        raise ValueError(f"{path} holds drafts distilled from another target ({state['target']['weights']} there, "
                         f"{target['weights']} now): delete it to distil from the current target")
    if data is not None and state.get("data") != data:
        raise ValueError(f"{path} was distilled on other records ({state.get('data')} there, {data} now): the scenes "
                         "changed since; delete it to start over, or restore the scene folder")
    if set(state["models"]) != set(models):
        raise ValueError(f"{path} holds models {sorted(state['models'])}, expected {sorted(models)}")
    for k, m in models.items():
        try:
            m.load_state_dict(state["models"][k])
            opts[k].load_state_dict(state["opts"][k])
        except (RuntimeError, ValueError, KeyError) as e:  # e.g. a preset whose sizes changed in model.py
            raise ValueError(f"cannot resume {k!r} from {path}: it does not fit the model this code builds "
                             f"({str(e).splitlines()[0]}); delete it to start over") from None
    return int(state["step"])


def check_loss(name, value, step, state_path):
    """Stop at a non-finite loss before the update it caused is saved: the state on disk stays the last good one."""
    if not math.isfinite(value):
        kept = (f"the last good state is {state_path} (step "
                f"{torch.load(state_path, map_location='cpu', weights_only=True)['step']})"
                if os.path.exists(state_path) else "no state was saved yet")
        raise FloatingPointError(f"{name} loss is {value} at step {step}: stopped; {kept}")


def fmt(metrics):
    return " ".join(f"{k}={v:.3f}" for k, v in metrics.items())


def parse_args(argv=None, parser=False):
    ap = argparse.ArgumentParser(description="Train the toy target VLA and distil the FlatRoPE and M-RoPE drafts "
                                 "(a draft for a real target: python train.py --target DIR --help).")
    ap.add_argument("--stage", choices=["all", "target", "drafts"], default="all",
                    help="target: SFT only; drafts: distil from an existing out/target; all: both")
    cli.add_config_flags(ap, TrainConfig, choices={"target_preset": sorted(M.PRESETS),
                                                          "draft_preset": sorted(M.DRAFT_PRESETS)})
    a = ap.parse_args(argv)
    with cli.user_errors(ap):
        if a.draft_vocab > len(driving.Tokenizer()):  # here, not when the draft stage starts after the target's hour
            raise ValueError(f"--draft-vocab must be at most the toy vocabulary's {len(driving.Tokenizer())} ids, "
                             f"got {a.draft_vocab}")
        check_values(a, [(MAX_VIEWS_RULE, ("views", "max_views")), ("in 0..2**30-1", ("seed", "draft_seed")),
                         (">= 1", ("n_train", "n_val", "n_test", "batch_size", "target_steps", "draft_steps",
                                   "eval_every")), ("> 0", ("target_lr", "draft_lr", "grad_clip")),
                         ("a finite number >= 0", ("traj_weight", "weight_decay", "warmup", "views", "max_views",
                                                   "draft_vocab")), ("in [0, 1]", ("p_no_views",))], flags=True)
        cli.check_device(a.device)
    cfg = cli.config_from_args(TrainConfig, a)
    return (cfg, a.stage, ap) if parser else (cfg, a.stage)


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
        todo += [(checkpoint.draft_dir(cfg.out, kind, cfg.draft_seed), f"{kind} draft", f"drafts_s{cfg.draft_seed}"
                  ".state.pt", "rerun with --overwrite to retrain it, or give another --draft-seed or --out")
                 for kind in ("flat", "mrope")]
    for path, kind, state, how in todo:  # a *.state.pt beside it: a run to resume, not a checkpoint to protect
        checkpoint.check_output(path, kind, cfg.overwrite or os.path.exists(os.path.join(cfg.out, state)), how)


def parse_draft_args(argv):
    """`train.py --target DIR ...`: DraftConfig's flags, each checked before any work."""
    ap = argparse.ArgumentParser(description="Distil a routine reasoner for a real target (or an exported toy one) "
                                 "on the target's own CoCs over a folder of scenes.")
    ap.add_argument("--stage", choices=["all", "data"], default="all",
                    help="data: only write the target's CoCs (out/data); all: the data, then the draft")
    cli.add_config_flags(ap, DraftConfig, choices={"kind": ["flat", "mrope"], "init": ["random", "last"],
                                                   "dtype": sorted(cli.DTYPES)})
    a = ap.parse_args(argv)
    with cli.user_errors(ap):
        check_values(a, [("in 0..2**30-1", ("seed",)), (">= 1", ("steps", "batch_size", "save_every", "samples",
                                                                   "max_new", "min_pixels", "max_pixels")),
                         ("> 0", ("lr", "grad_clip", "top_p")), ("in [0, 1]", ("top_p",)),
                         ("a finite number >= 0", ("warmup", "weight_decay", "draft_vocab", "temperature", "views",
                                                   "toy_scenes", "workers"))], flags=True)
        if not os.path.isdir(a.target):
            raise FileNotFoundError(f"--target {a.target}: no such folder")
        if bool(a.scenes) == bool(a.toy_scenes):
            raise ValueError("give the training scenes: --scenes SCENES (a scene folder) or --toy-scenes N")
        if a.min_pixels > a.max_pixels:
            raise ValueError(f"--min-pixels {a.min_pixels} is above --max-pixels {a.max_pixels}")
        if a.dtype != "fp32" and not a.amp:  # fp32 master weights meet the target's bf16 ones under autocast
            raise ValueError(f"--dtype {a.dtype} needs --amp (the draft's own weights stay fp32)")
        if a.temperature == 0 and a.samples > 1:
            raise ValueError("--samples > 1 needs --temperature > 0 (greedy CoCs of a scene are all equal)")
        cli.check_device(a.device)
    return cli.config_from_args(DraftConfig, a), a.stage, ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--target" or a.startswith("--target=") for a in argv):  # a real target: the general path
        cfg, stage, ap = parse_draft_args(argv)
        with cli.user_errors(ap):
            return run_draft(cfg, stage)
    cfg, stage, ap = parse_args(argv, parser=True)
    with cli.user_errors(ap):  # a locked, read-only or existing --out, a full disk: one line
        return run(cfg, stage)


if __name__ == "__main__":
    main()
