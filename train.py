"""Training on the synthetic driving world: SFT of the deliberative reasoner (the target
VLA) and distillation of the two routine-reasoner drafts from it.

Paper: the target is the unmodified VLA (Alpamayo-R1 style: CoC next-token loss plus a
trajectory loss); the drafts are the paper's routine reasoner (FlatRoPE, 1D positions)
and the baseline replica draft of standard speculative decoding (the target's M-RoPE),
trained with the same data, steps and seed so that only the position scheme differs.
The SFT FlatRoPE draft is also AARL's static reference (aarl.py).

Both drafts are distilled in one loop: every step runs the frozen target once (its
prompt embeddings, image features included, and its CoC distributions p) and updates
each draft q with the forward KL(p || q) on the CoC positions. Sharing the target's
forward halves the cost without coupling the drafts (separate weights, optimisers).

run: python train.py --device cpu                 (target + both drafts into runs/toy)
     torchrun --nproc_per_node 2 train.py         (the same with DistributedDataParallel)
"""
import argparse
import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import driving
import model as M

# ---- config ----


@dataclass
class TrainConfig:
    out: str = "runs/toy"  # checkpoints: out/target, out/draft_flat, out/draft_mrope (+ *.state.pt to resume)
    device: str = "cpu"
    seed: int = 0
    n_train: int = 32000  # pre-generated training scenes (the world is cheap; a fixed set keeps steps reproducible)
    n_val: int = 256  # validation scenes (same distribution as train)
    n_test: int = 256  # held-out test scenes (factor combinations never seen in training)
    batch_size: int = 16  # global batch; each DDP rank takes batch_size / world_size of it
    target_steps: int = 2600  # with the drafts, 290-306 s on 2 CPU cores (README has the accuracies)
    target_lr: float = 1.5e-3
    train_vision: bool = False  # False: the vision tower stays at its random init (train_target says why)
    traj_weight: float = 0.1  # weight of the trajectory Huber loss (metres) next to the CoC cross-entropy
    draft_steps: int = 150
    draft_lr: float = 3e-3
    target_preset: str = "toy-target"  # target sizes (model.PRESETS)
    draft_preset: str = "toy-draft"  # sizes of both drafts (model.DRAFT_PRESETS)
    warmup: int = 20  # linear warm-up steps, then cosine decay to 10%
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    amp: bool = True  # bf16 autocast for the matmuls (fp32 master weights); ~2.5x faster on a modern CPU
    eval_every: int = 650  # steps between validation passes (and resumable checkpoints)


# ---- distributed (torchrun) ----


def setup_distributed(device):
    """(rank, world_size, device). Under torchrun: gloo on CPU, nccl on CUDA, one GPU per rank."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device(device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return rank, world, torch.device("cuda", local)
    dist.init_process_group("gloo")
    return rank, world, torch.device(device)


def unwrap(m):
    return m.module if isinstance(m, torch.nn.parallel.DistributedDataParallel) else m


def wrap(m, world, device):
    if world == 1:
        return m
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(m, device_ids=ids)


# ---- model construction ----


def target_config(tok: driving.Tokenizer, preset="toy-target") -> M.ModelConfig:
    """The toy target: model.PRESETS[preset] with the world's vocabulary, token ids and raster channels."""
    base = M.PRESETS[preset]
    # The world's tokenisation (driving.PATCH, driving.MERGE). Every block is windowed, a window being one merged
    # token (PATCH * MERGE = 12 px): the frozen tower is random, and a random frame-wide attention block mixes every
    # token with the whole frame. With Qwen's one full-attention block, a linear probe read the off-lane decoy's
    # kind from the in-lane actor's token at 0.99 (0.59 with one-token windows, where no other token leaks in), and
    # with them the old 750-step target went from 0.938 to 0.961 CoC exact on val (a probe). A pretrained tower keeps
    # its tokens local; a random one has to be made to.
    vision = replace(base.vision, in_channels=len(driving.CHANNELS), patch_size=driving.PATCH, temporal_patch_size=1,
                     spatial_merge_size=driving.MERGE, window_size=driving.PATCH * driving.MERGE,
                     fullatt_block_indexes=())
    # One M-RoPE t id per frame: the world's two frames are consecutive video frames.
    return replace(base, vocab_size=len(tok), image_token_id=tok.image_token_id, video_token_id=tok.video_token_id,
                   vision_start_token_id=tok.vision_start_id, tokens_per_second=1.0, vision=vision,
                   spatial_merge_size=driving.MERGE,
                   traj_len=driving.WorldConfig().n_future, max_seq_len=256)


def make_drafts(target, preset):
    """The two drafts of equal size: FlatRoPE (routine reasoner) and the M-RoPE replica."""
    kw = M.DRAFT_PRESETS[preset]
    return {"flat": M.make_draft(target, rope_mode="flat", **kw),
            "mrope": M.make_draft(target, rope_mode="mrope", **kw)}


# ---- data ----


class Data:
    """Pre-generated examples of one split; batch indices are a pure function of (seed, step),
    so a resumed run sees exactly the batches it would have seen, on any number of ranks.
    Batches walk a seeded permutation per epoch, so no scene repeats before the split is used up
    (drawn with replacement, 37% of a default run's 12,000 draws would repeat an earlier scene)."""

    def __init__(self, split, n, seed, tok):
        self.scenes = driving.make_split(split, n, seed)
        self.examples = [driving.make_example(s, tok) for s in self.scenes]
        self.tok, self.seed = tok, seed

    def batch(self, step, size, rank=0, world=1, device="cpu"):
        if size > len(self.examples):
            raise ValueError(f"batch size {size} is larger than the {len(self.examples)} scenes of this split")
        epoch, k = divmod(step, len(self.examples) // size)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        idx = torch.randperm(len(self.examples), generator=g)[k * size:(k + 1) * size][rank::world]
        return to_device(driving.collate([self.examples[i] for i in idx], self.tok.pad_id), device)

    def batches(self, size, device="cpu"):
        """The whole split in order, for evaluation."""
        for i in range(0, len(self.examples), size):
            yield to_device(driving.collate(self.examples[i:i + size], self.tok.pad_id), device)


def to_device(batch, device):
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def vision_kwargs(batch):
    return {"pixel_values_videos": batch["pixel_values_videos"], "video_grid_thw": batch["video_grid_thw"]}


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
    pred = unwrap(target).traj(h_traj).float()  # (B, traj_len, 2)
    huber = F.smooth_l1_loss(pred, batch["traj"])
    return ce + traj_weight * huber, ce, (pred - batch["traj"]).abs().mean()


def distill_loss(draft, embeds, p_logp, batch):
    """Forward KL(p || q) averaged over CoC positions; p_logp (N, V) are the target's log-probs there."""
    logits_q = draft(batch["input_ids"], inputs_embeds=embeds, video_grid_thw=batch["video_grid_thw"])  # (B, L, V)
    q_logp = F.log_softmax(logits_q[batch["loss_mask"]].float(), -1)  # (N, V)
    return F.kl_div(q_logp, p_logp, log_target=True, reduction="batchmean")


# ---- evaluation ----


@torch.no_grad()
def greedy_coc(target, batch, stop, max_new=32, amp=False):
    """Batched greedy CoC decoding with the KV cache (all prompts have the same length)
    -> list of id lists, each ending with the stop token (<cot_end>) when the model wrote it."""
    P = int(batch["prompt_len"][0])
    assert bool((batch["prompt_len"] == P).all()), "greedy_coc needs equal prompt lengths"
    ids = batch["input_ids"][:, :P]  # (B, P)
    B = ids.shape[0]
    cache = target.new_cache(batch=B, max_len=P + max_new)
    with autocast(ids.device, amp):
        logits = target(ids, cache=cache, logits_to_keep=1, **vision_kwargs(batch))  # (B, 1, V)
        out = []
        for _ in range(max_new):
            nxt = logits[:, -1].argmax(-1)  # (B,)
            out.append(nxt)
            if bool((torch.stack(out, 1) == stop).any(1).all()):
                break
            logits = target(nxt[:, None], cache=cache)  # (B, 1, V)
    rows = torch.stack(out, 1).tolist()  # (B, n)
    return [r[:r.index(stop) + 1] if stop in r else r for r in rows]


@torch.no_grad()
def continue_prompts(target, batch, seqs, pad_id, amp=False):
    """Feed each row's prompt, then its own continuation seqs[b] (a list of ids), through the
    KV cache: the continuation is decoded as text whatever its ids (exactly as during
    generation), and a right-padded batch is fine because attention is causal.
    Returns logits (B, 1 + T, V), where row t predicts continuation token t (row 0 comes from
    the prompt's last position), and final hidden states (B, T, D) of the continuation."""
    P = int(batch["prompt_len"][0])
    ids = batch["input_ids"][:, :P]  # (B, P)
    T_ = max(map(len, seqs))
    cont = torch.full((len(seqs), T_), pad_id, dtype=torch.long, device=ids.device)
    for b, s in enumerate(seqs):
        cont[b, :len(s)] = torch.tensor(s)
    cache = target.new_cache(batch=len(seqs), max_len=P + T_)
    with autocast(ids.device, amp):
        first = target(ids, cache=cache, logits_to_keep=1, **vision_kwargs(batch))  # (B, 1, V)
        logits, hidden = target(cont, cache=cache, return_hidden=True)  # (B, T, V), (B, T, D)
    return torch.cat([first, logits], 1), hidden


@torch.no_grad()
def plan_trajectories(target, batch, cocs, tok, amp=False):
    """Trajectories (B, traj_len, 2) after prompt + the given CoCs + <traj_future_start>,
    read at each row's <traj_future_start>."""
    seqs = [[t for t in c if t != tok.cot_end_id] + [tok.cot_end_id, tok.traj_future_start_id] for c in cocs]
    _, hidden = continue_prompts(target, batch, seqs, tok.pad_id, amp)
    last = torch.tensor([len(s) - 1 for s in seqs], device=hidden.device)
    return target.traj(hidden[torch.arange(len(seqs)), last]).float()  # (B, traj_len, 2)


@torch.no_grad()
def evaluate_target(target, data: Data, batch_size=64, amp=False):
    """coc_exact (greedy), commitment_acc (teacher-forced argmax on commitment tokens),
    ade / fde (trajectory after the model's own greedy CoC), in metres."""
    target.eval()
    tok = data.tok
    exact = hits = n_commit = 0
    ades, fdes, n = [], [], 0
    for batch in data.batches(batch_size, next(target.parameters()).device):
        with autocast(batch["input_ids"].device, amp):
            logits = target(batch["input_ids"], **vision_kwargs(batch))  # (B, L, V)
        m = batch["commit_mask"][:, :-1]
        hits += ((logits.argmax(-1)[:, :-1] == batch["input_ids"][:, 1:]) & m).sum().item()
        n_commit += m.sum().item()
        cocs = greedy_coc(target, batch, tok.cot_end_id, amp=amp)
        exact += sum(c == t for c, t in zip(cocs, batch["coc_ids"]))
        ade, fde = driving.ade_fde(plan_trajectories(target, batch, cocs, tok, amp), batch["traj"].cpu())
        B = len(cocs)
        ades.append(ade * B)
        fdes.append(fde * B)
        n += B
    return {"coc_exact": exact / n, "commitment_acc": hits / max(n_commit, 1), "ade": sum(ades) / n,
            "fde": sum(fdes) / n}


@torch.no_grad()
def commitment_acc(model, target, data: Data, batch_size=64):
    """Teacher-forced argmax accuracy on the commitment tokens, for the target (model is target) or
    a draft (reading the target's prompt embeddings, image features included, as when it drafts):
    can this model supply the tokens that need the image?"""
    hits = n = 0
    for batch in data.batches(batch_size, next(target.parameters()).device):
        if model is target:
            logits = target(batch["input_ids"], **vision_kwargs(batch))  # (B, L, V)
        else:
            embeds = target.embed(batch["input_ids"], **vision_kwargs(batch))  # (B, L, D)
            logits = model(batch["input_ids"], inputs_embeds=embeds, video_grid_thw=batch["video_grid_thw"])
        n_b = batch["commit_mask"][:, :-1].sum().item()
        hits += driving.commitment_accuracy(logits.argmax(-1), batch["input_ids"], batch["commit_mask"]) * n_b
        n += n_b
    return hits / max(n, 1)


def key_groups(input_ids, tok):
    """Which key tokens are image (video placeholders), trajectory history (bins and their two
    markers) or other text -> three bool masks (B, L)."""
    image = (input_ids == tok.video_token_id) | (input_ids == tok.image_token_id)
    start = (input_ids == tok.hist_start_id).cumsum(-1)
    end = (input_ids == tok.hist_end_id).cumsum(-1)
    history = (start > end) | (input_ids == tok.hist_end_id)  # from <traj_history_start> to <traj_history_end>
    return {"image": image, "history": history, "text": ~image & ~history}


@torch.no_grad()
def attention_probs(model, input_ids, **forward_kwargs):
    """Per-layer attention probabilities [(B, H, L, L)] of a cache-free forward, recomputed from
    each layer's own q/k projections and the rope tables the model passed it (the slow, obvious
    path: softmax(q k^T / sqrt(hd)) under the causal mask). tests/test_train.py checks that
    probs @ v through o_proj reproduces the layer's real output."""
    captured = []

    def grab(module, args):
        captured.append((module, args[0], args[1], args[2]))  # (attention, x, cos, sin)

    hooks = [layer.self_attn.register_forward_pre_hook(grab) for layer in model.layers]
    try:
        model(input_ids, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for attn, x, cos, sin in captured:
        q, k, _ = attn.project(x, cos, sin)  # (B, H, L, hd), (B, Hk, L, hd)
        k = k.repeat_interleave(attn.H // attn.Hk, dim=1)  # (B, H, L, hd)
        scores = (q.float() @ k.float().transpose(-2, -1)) / attn.hd ** 0.5  # (B, H, L, L)
        L = scores.shape[-1]
        causal = torch.ones(L, L, dtype=torch.bool, device=scores.device).tril()
        out.append(scores.masked_fill(~causal, float("-inf")).softmax(-1))
    return out


@torch.no_grad()
def attention_split(draft, target, data: Data, n=64):
    """The draft's attention mass on image / history / other-text keys while it predicts the CoC
    (query rows = CoC positions, teacher-forced), averaged over rows, heads and layers: the
    paper's claim is that FlatRoPE moves mass from the image to the trajectory history."""
    batch = next(data.batches(n, next(draft.parameters()).device))
    embeds = target.embed(batch["input_ids"], **vision_kwargs(batch))  # (B, L, D)
    probs = attention_probs(draft, batch["input_ids"], inputs_embeds=embeds, video_grid_thw=batch["video_grid_thw"])
    groups = key_groups(batch["input_ids"], data.tok)
    rows = batch["loss_mask"]  # (B, L) query positions that predict CoC tokens
    split = {}
    for name, keys in groups.items():
        mass = [(p * keys[:, None, None, :]).sum(-1).mean(1)[rows].mean().item() for p in probs]  # per layer
        split[name] = sum(mass) / len(mass)
    return split


def autocast(device, enabled):
    device = torch.device(device)
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


# ---- checkpoints (resumable training state) ----


def atomic_torch_save(obj, path):
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous file intact


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def make_optimizer(params, cfg, lr):
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)


# ---- stages ----


def train_target(cfg: TrainConfig, tok, train: Data, val: Data, rank=0, world=1, device="cpu", log=print):
    """SFT of the deliberative reasoner; saves out/target (model.save) and returns the model."""
    torch.manual_seed(cfg.seed)
    target = M.VLA(target_config(tok, cfg.target_preset)).to(device)
    if not cfg.train_vision:
        # Frozen, as a pretrained encoder often is in VLA fine-tuning. Trained along with the LM under Adam, the
        # merger's output grew from norm 5.5 to ~1500 (text embeddings: 0.5; the previous world's 600-step target),
        # and the 8 video tokens of a scene became collinear (cosine 0.9995 against 0.04 at init): the LM could
        # then tell which features were somewhere in the video, not which token held them. Untrained features
        # already separated the previous world's scenes (a linear probe: 98%). README, Limitations.
        target.visual.requires_grad_(False)
    opt = make_optimizer([p for p in target.parameters() if p.requires_grad], cfg, cfg.target_lr)
    state_path = os.path.join(cfg.out, "target.state.pt")
    start = load_state(state_path, {"target": target}, {"target": opt}, cfg, device)
    ddp = wrap(target, world, device)
    bar = tqdm(range(start, cfg.target_steps), desc="target", disable=rank != 0, initial=start,
               total=cfg.target_steps)
    for step in bar:
        ddp.train()
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, cfg.target_steps, cfg.target_lr, cfg.warmup)
        batch = train.batch(step, cfg.batch_size, rank, world, device)
        with autocast(device, cfg.amp):
            loss, ce, l1 = target_loss(ddp, batch, cfg.traj_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), cfg.grad_clip)
        opt.step()
        bar.set_postfix(ce=f"{ce.item():.3f}", traj_l1=f"{l1.item():.2f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.target_steps:
            save_state(state_path, step + 1, {"target": target}, {"target": opt}, cfg, rank)
            if rank == 0 and step + 1 < cfg.target_steps:
                log(f"target step {step + 1}: val {fmt(evaluate_target(target, val))}")
    if rank == 0:
        M.save(target, os.path.join(cfg.out, "target"))
    return target


def train_drafts(cfg: TrainConfig, target, train: Data, rank=0, world=1, device="cpu"):
    """Distil both drafts from the frozen target in one loop; saves out/draft_flat, out/draft_mrope."""
    target.eval().requires_grad_(False)
    torch.manual_seed(cfg.seed + 1)
    drafts = make_drafts(target, cfg.draft_preset)
    opts = {k: make_optimizer(d.parameters(), cfg, cfg.draft_lr) for k, d in drafts.items()}
    state_path = os.path.join(cfg.out, "drafts.state.pt")
    start = load_state(state_path, drafts, opts, cfg, device)
    ddps = {k: wrap(d, world, device) for k, d in drafts.items()}
    bar = tqdm(range(start, cfg.draft_steps), desc="drafts", disable=rank != 0, initial=start,
               total=cfg.draft_steps)
    for step in bar:
        batch = train.batch(step, cfg.batch_size, rank, world, device)
        with torch.no_grad(), autocast(device, cfg.amp):
            embeds = target.embed(batch["input_ids"], **vision_kwargs(batch))  # (B, L, D) image features included
            logits_p = target(batch["input_ids"], inputs_embeds=embeds, video_grid_thw=batch["video_grid_thw"])
        p_logp = F.log_softmax(logits_p[batch["loss_mask"]].float(), -1)  # (N, V) p on the CoC positions
        losses = {}
        for k, d in ddps.items():
            d.train()
            for grp in opts[k].param_groups:
                grp["lr"] = lr_at(step, cfg.draft_steps, cfg.draft_lr, cfg.warmup)
            with autocast(device, cfg.amp):
                loss = distill_loss(d, embeds, p_logp, batch)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafts[k].parameters(), cfg.grad_clip)
            opts[k].step()
            losses[k] = loss.item()
        bar.set_postfix({f"kl_{k}": f"{v:.3f}" for k, v in losses.items()})
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.draft_steps:
            save_state(state_path, step + 1, drafts, opts, cfg, rank)
    if rank == 0:
        for k, d in drafts.items():
            M.save(d, os.path.join(cfg.out, f"draft_{k}"))
    return drafts


def save_state(path, step, models, opts, cfg, rank):
    """Resumable state: weights, optimiser moments, step, config. Rank 0 writes; all ranks wait."""
    if rank == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        atomic_torch_save({"step": step, "config": asdict(cfg),
                           "models": {k: m.state_dict() for k, m in models.items()},
                           "opts": {k: o.state_dict() for k, o in opts.items()}}, path)
    if dist.is_initialized():
        dist.barrier()


def load_state(path, models, opts, cfg, device):
    """Resume from path if it exists -> the step to continue from (0 for a fresh start)."""
    if not os.path.exists(path):
        return 0
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which, do not silently restart
        raise ValueError(f"cannot resume from {path}: {e}; delete it to start over") from e
    if set(state["models"]) != set(models):
        raise ValueError(f"{path} holds models {sorted(state['models'])}, expected {sorted(models)}")
    for k, m in models.items():
        m.load_state_dict(state["models"][k])
        opts[k].load_state_dict(state["opts"][k])
    return int(state["step"])


def fmt(metrics):
    return " ".join(f"{k}={v:.3f}" for k, v in metrics.items())


# ---- main ----


def parse_args(argv=None):
    d = TrainConfig()
    ap = argparse.ArgumentParser(description="Train the toy target VLA and distil the FlatRoPE and M-RoPE drafts.")
    ap.add_argument("--out", default=d.out, help="output folder for checkpoints")
    ap.add_argument("--device", default=d.device, help="torch device (cpu, cuda)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--stage", choices=["all", "target", "drafts"], default="all",
                    help="target: SFT only; drafts: distil from an existing out/target; all: both")
    ap.add_argument("--n-train", type=int, default=d.n_train, help="training scenes")
    ap.add_argument("--n-val", type=int, default=d.n_val, help="validation scenes")
    ap.add_argument("--n-test", type=int, default=d.n_test, help="held-out test scenes")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch size")
    ap.add_argument("--target-steps", type=int, default=d.target_steps)
    ap.add_argument("--draft-steps", type=int, default=d.draft_steps)
    ap.add_argument("--target-lr", type=float, default=d.target_lr)
    ap.add_argument("--draft-lr", type=float, default=d.draft_lr)
    ap.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between validation/checkpoints")
    ap.add_argument("--no-amp", action="store_true", help="train in fp32 instead of bf16 autocast")
    ap.add_argument("--train-vision", action="store_true",
                    help="also train the target's vision tower (default: frozen)")
    a = ap.parse_args(argv)
    for name in ("n_train", "n_val", "n_test", "batch_size", "target_steps", "draft_steps", "eval_every"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("target_lr", "draft_lr"):
        if not getattr(a, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    cfg = TrainConfig(out=a.out, device=a.device, seed=a.seed, n_train=a.n_train, n_val=a.n_val, n_test=a.n_test,
                      batch_size=a.batch_size, target_steps=a.target_steps, draft_steps=a.draft_steps,
                      target_lr=a.target_lr, draft_lr=a.draft_lr, eval_every=a.eval_every, amp=not a.no_amp,
                      train_vision=a.train_vision)
    return cfg, a.stage


def run(cfg: TrainConfig, stage="all", log=print):
    """Train what `stage` asks for; returns {"target", "drafts", "metrics"} on rank 0."""
    rank, world, device = setup_distributed(cfg.device)
    if cfg.batch_size % world:
        raise ValueError(f"batch_size {cfg.batch_size} is not divisible by the {world} ranks")
    tok = driving.Tokenizer()
    t0 = time.time()
    train = Data("train", cfg.n_train, cfg.seed, tok)
    val = Data("val", cfg.n_val, cfg.seed, tok)
    out = {}
    if stage in ("all", "target"):
        out["target"] = train_target(cfg, tok, train, val, rank, world, device, log)
    else:
        path = os.path.join(cfg.out, "target")
        out["target"] = M.load(path, device=device)
    if stage in ("all", "drafts"):
        out["drafts"] = train_drafts(cfg, out["target"], train, rank, world, device)
    if rank == 0:
        test = Data("test", cfg.n_test, cfg.seed, tok)
        metrics = {"val": evaluate_target(out["target"], val),
                   "test": evaluate_target(out["target"], test), "wall_s": time.time() - t0}
        with open(os.path.join(cfg.out, "train_metrics.json"), "w") as f:
            json.dump(metrics, f, indent=1)
        log(f"target val:  {fmt(metrics['val'])}")
        log(f"target test: {fmt(metrics['test'])}")
        log(f"wall time {metrics['wall_s']:.0f} s")
        out["metrics"] = metrics
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    run(*parse_args())
