"""A routine reasoner for a real target (the paper's draft for Alpamayo-R1, or any Qwen-VL folder): the target writes
its own CoCs on the user's scenes (real/scenes.py's format, self-distillation as EAGLE-3 and ViSpec do) and a draft is
distilled on them with train.py's KL(p || q) on the CoC positions, one sequence per forward (prompt lengths differ) and
batch_size sequences per update by gradient accumulation; resumable, DDP under torchrun. docs/own-target.md.

run: python -m real.distill --target ALPAMAYO_DIR --scenes SCENES --out RUN --device cuda --dtype bf16 --amp
     torchrun --nproc_per_node 8 -m real.distill --target ALPAMAYO_DIR --scenes SCENES --out RUN --device cuda \
         --dtype bf16 --amp                       (eight GPUs: the scenes sharded over the ranks)
"""
import argparse
import contextlib
from dataclasses import asdict, dataclass
import hashlib
import os
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import driving
from evaluate import autocast
import model as M
from ops import checkpoint, cli, files, runs
from real import hf, scenes
import speculate
from train import kl_p_q, select_draft_vocab


# ---- config ----
@dataclass
class DraftConfig:
    target: str = ""  # a Hugging Face Qwen2.5-VL / Qwen3-VL or Alpamayo-R1 folder (hf.load_pretrained), or our format
    scenes: str = ""  # the training scenes, scenes.py's folder format (or --toy-scenes)
    toy_scenes: int = 0  # N > 0: the prompts are the toy world's first N training scenes (for an exported toy target)
    out: str = "runs/draft"  # out/data: the target's CoCs (scenes.distill_data); out/draft_<kind>_s<seed>
    kind: str = "flat"  # model.DRAFT_KINDS: flat (FlatRoPE, the routine reasoner), mrope (the replica), history
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
    layers: int = 1  # the draft's decoder layers
    width: int = 0  # the draft's hidden size (0: the target's; narrower keeps head_dim, with projections)
    heads: int = 0  # the draft's attention heads (0: width / head_dim)
    kv_heads: int = 0  # the draft's KV heads (0: as many as the target, dividing the heads)
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
    allow_truncated: bool = False  # distil even when most CoCs were cut at --max-new (else refused: raise --max-new)


def load_target(path, dtype=None, device=None):
    """A folder with config.json through hf.load_pretrained, else our format (checkpoint.load)."""
    load = hf.load_pretrained if os.path.exists(os.path.join(path, hf.CONFIG)) else checkpoint.load
    return load(path, dtype=dtype, device=device)


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
        scene_id = self.records[j]["scene"]
        return j, scenes.built(scene_id, self.prompt_of[scene_id])


def new_draft(target, kind, init="random", vocab_ids=None, layers=1, width=0, heads=0, kv_heads=0):
    """The routine reasoner's start (model.make_draft: the target's embedding and LM head, shared and frozen): `layers`
    decoder layers, of the target's shape unless width / heads / kv_heads say otherwise (0: the target's), fp32 master
    weights; init "last": every layer a copy of the target's last one, which already maps the target's hidden states
    to what its final norm and LM head read (so only at the target's shape)."""
    draft = M.make_draft(target, n_layers=layers, hidden_size=width or None, kind=kind, n_heads=heads or None,
                         n_kv_heads=kv_heads or None, vocab_ids=vocab_ids).float()
    if init == "last":
        if draft.layers[0].self_attn.qkv.weight.shape != target.layers[-1].self_attn.qkv.weight.shape:
            raise ValueError("--init last copies the target's last layer: give no --width / --heads / --kv-heads")
        for layer in draft.layers:
            layer.load_state_dict({k: v.float() for k, v in target.layers[-1].state_dict().items()})
        draft.norm.load_state_dict({k: v.float() for k, v in target.norm.state_dict().items()})
    return draft


def distill_draft(cfg: DraftConfig, target, records, prompt_of, stop_id, rank=0, world=1, device="cpu"):
    """Distil a `cfg.kind` draft from the frozen target on its own CoCs (records: scenes.read_distill_data's), as the
    module docstring says, into out/draft_<kind>_s<seed> bound to the target. prompt_of: scene_id -> prompt or a
    function building it; stop_id: the id ending the reasoning (kept in a reduced vocabulary)."""
    target.eval().requires_grad_(False)
    vocab_ids = (select_draft_vocab([r["tokens"] for r in records], cfg.draft_vocab, stop_id, target.cfg.vocab_size)
                 if cfg.draft_vocab else None)
    torch.manual_seed(cfg.seed)
    draft = new_draft(target, cfg.kind, cfg.init, vocab_ids, cfg.layers, cfg.width, cfg.heads, cfg.kv_heads)
    opt = runs.make_optimizer(draft.parameters(), cfg.lr, cfg.weight_decay)
    dest = checkpoint.draft_dir(cfg.out, cfg.kind, cfg.seed)
    state_path = dest + ".state.pt"
    bound = {"target": checkpoint.fingerprint(target)}
    # the records the state's updates drew: a resume after the scenes changed would draw others at the same steps
    data = {"records": len(records), "sha256": hashlib.sha256(repr(
        [(r["scene"], r["sample"], r["tokens"]) for r in records]).encode()).hexdigest()[:16]}
    start, history = runs.load_state(state_path, {cfg.kind: draft}, {cfg.kind: opt}, cfg, bound, data)
    history = history or []  # KL(p || q) of the updates so far, kept in the state and beside the draft
    ddp = runs.wrap(draft, world, device)
    per_rank, w = cfg.batch_size // world, next(target.parameters())
    stream = iter(torch.utils.data.DataLoader(RankPrompts(records, prompt_of, cfg, start, rank, world), batch_size=None,
                                              num_workers=cfg.workers))
    bar = tqdm(range(start, cfg.steps), desc=f"draft_{cfg.kind}", disable=rank != 0, initial=start, total=cfg.steps)
    for step in bar:
        ddp.train()
        loss_sum, n_tok, t0 = 0.0, 0, time.time()
        for i in range(per_rank):  # this rank's share of the update's records
            j, prompt = next(stream)
            last = i == per_rank - 1  # DDP averages the gradients across ranks at the last backward only
            with (contextlib.nullcontext() if last or world == 1 else ddp.no_sync()), autocast(device, cfg.amp):
                loss = sequence_kl(target, ddp, hf.on_model(prompt, target), records[j]["tokens"]) / per_rank
                loss.backward()
            loss_sum, n_tok = loss_sum + loss.item(), n_tok + len(records[j]["tokens"])
        if world > 1:  # every rank sees a NaN on any rank: its gradients were already averaged into everyone's
            loss_sum = runs.all_mean(loss_sum, device)
        runs.update(opt, draft, runs.lr_at(step, cfg.steps, cfg.lr, cfg.warmup), cfg.grad_clip)  # accumulated above
        runs.check_loss(f"{cfg.kind} draft", loss_sum, step, state_path, draft)
        bar.set_postfix(kl=f"{loss_sum:.3f}", tok_s=f"{n_tok * world / (time.time() - t0):.0f}")
        history.append({"step": step + 1, "train_kl": loss_sum})
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            if rank == 0:
                files.write_json(dest + ".metrics.json", {"kind": cfg.kind, "seed": cfg.seed, "config": asdict(cfg),
                                                          "updates": history})
            runs.save_state(state_path, step + 1, {cfg.kind: draft}, {cfg.kind: opt}, cfg, rank, bound, data,
                            extra=history)
    if rank == 0:
        checkpoint.save(draft.to(w.dtype), dest, target=target)
    return draft


def run_draft(cfg: DraftConfig, stage="all", log=print):
    """The target's CoCs on the training scenes, each rank decoding its share into out/data/part<rank> (resumable,
    whatever the number of ranks before), then the draft, every rank reading every part."""
    cli.check_device(cfg.device)
    cli.progress(f"the target's CoCs into {cfg.out}/data, then the {cfg.kind} draft")
    rank, world, device = runs.setup_distributed(cfg.device)
    if cfg.batch_size % world:
        raise ValueError(f"batch_size {cfg.batch_size} is not divisible by the {world} ranks")
    if cfg.toy_scenes:
        tok = driving.Tokenizer()
        toy = driving.make_split("train", cfg.toy_scenes, 0)  # train.py's scenes (TrainConfig.seed 0)
        prompts = [(f"toy{i}", lambda s=s: driving.build_prompt(s, tok, cfg.views)) for i, s in enumerate(toy)]
        stop = [tok.cot_end_id]
    else:  # Alpamayo-R1 or plain Qwen-VL; every scene checked before the target is loaded
        _, prompts, stop, _ = scenes.scene_prompts(cfg.target, cfg.scenes, cfg.processor or None,
                                                   min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    target = load_target(cfg.target, cli.DTYPES[cfg.dtype], device)
    if cfg.draft_vocab > (vocab := target.cfg.vocab_size):  # known now: not after hours of decoding
        raise ValueError(f"--draft-vocab {cfg.draft_vocab} is above the target's vocabulary of {vocab} ids")
    root = os.path.join(cfg.out, "data")
    with files.writer_lock(cfg.out) if rank == 0 else contextlib.nullcontext():
        if rank == 0:
            dest = checkpoint.draft_dir(cfg.out, cfg.kind, cfg.seed)  # a resumable state beside it: not a refusal
            checkpoint.check_output(dest, f"{cfg.kind} draft", cfg.overwrite or os.path.exists(dest + ".state.pt"),
                                    "rerun with --overwrite to retrain it, or give another --seed or --out")
        done = {r["scene"] for r in read_parts(root, vocab)}  # read by every rank before any writes
        runs.barrier()
        sampling = speculate.Sampling(cfg.temperature, top_p=cfg.top_p) if cfg.temperature else speculate.GREEDY
        scenes.distill_data(target, [p for p in prompts if p[0] not in done][rank::world],  # what is left, shared
                            os.path.join(root, f"part{rank}"), stop, cfg.max_new, sampling,
                            cfg.samples if cfg.temperature else 1, log=log if rank == 0 else None)
        runs.barrier()
        order = {scene_id: i for i, (scene_id, _) in enumerate(prompts)}  # the same records order for any world size
        # records of scenes no longer in the folder are left out
        out = {"data": sorted((r for r in read_parts(root, vocab) if r["scene"] in order),
                              key=lambda r: (order[r["scene"]], r["sample"]))}
        check_truncated(out["data"], cfg, stage, log if rank == 0 else None)
        if stage == "all":
            out["draft"] = distill_draft(cfg, target, out["data"], dict(prompts), stop[-1], rank, world, device)
    runs.finish()
    return out


def read_parts(root, vocab_size=None):
    """The records of every part under root (scenes.read_distill_data of each), part by part."""
    parts = sorted(p for p in (os.listdir(root) if os.path.isdir(root) else ())
                   if os.path.exists(os.path.join(root, p, scenes.INDEX)))
    return [r for p in parts for r in scenes.read_distill_data(os.path.join(root, p), vocab_size)]


def check_truncated(records, cfg, stage, log):
    """Say how many CoCs --max-new cut before the reasoning's end; refuse to distil on mostly cut ones (the draft
    would never learn to end its reasoning) unless --allow-truncated."""
    cut = sum(not r["complete"] for r in records)
    if log and cut:
        log(f"{cut} of {len(records)} CoCs were cut at --max-new {cfg.max_new} before the reasoning's end")
    if stage == "all" and 2 * cut > len(records) and not cfg.allow_truncated:
        raise ValueError(f"{cut} of {len(records)} CoCs were cut at --max-new {cfg.max_new} before the reasoning's "
                         f"end: raise --max-new (with another --out: this one's data was decoded at {cfg.max_new}), "
                         "or pass --allow-truncated to distil on them")


# ---- the command line ----
def parse_args(argv=None):
    """DraftConfig's flags, each checked before any work (--device: run_draft's first step)."""
    ap = argparse.ArgumentParser(prog="python -m real.distill", description="Distil a routine reasoner for a real "
                                 "target (or an exported toy one) on the target's own CoCs over a folder of scenes.")
    ap.add_argument("--stage", choices=["all", "data"], default="all",
                    help="data: only write the target's CoCs (out/data); all: the data, then the draft")
    cli.add_config_flags(ap, DraftConfig, choices={"kind": list(M.DRAFT_KINDS), "init": ["random", "last"],
                                                   "dtype": sorted(cli.DTYPES)})
    a = ap.parse_args(argv, argparse.Namespace(top_p=None))  # None: --top-p not given (its default is set below)
    with cli.user_errors(ap):
        cli.check_out(a.out, folder=True)
        top_p_given, a.top_p = a.top_p is not None, DraftConfig.top_p if a.top_p is None else a.top_p
        cli.check_values(a, [("in 0..2**30-1", ("seed",)), ("a finite number > 0", ("lr", "grad_clip", "top_p")),
                             (">= 1", ("steps", "batch_size", "save_every", "samples", "max_new", "min_pixels",
                                       "max_pixels", "layers")), ("in [0, 1]", ("top_p",)),
                             ("a finite number >= 0", ("warmup", "weight_decay", "draft_vocab", "temperature", "views",
                                                       "toy_scenes", "workers", "width", "heads", "kv_heads"))],
                         flags=True)
        if not os.path.isdir(a.target):
            raise FileNotFoundError(f"--target {a.target}: no such folder")
        files.check_out_dir(a.out, {"--target": a.target, "--scenes": a.scenes, "--processor": a.processor})
        if bool(a.scenes) == bool(a.toy_scenes):
            raise ValueError("give the training scenes: --scenes SCENES (a scene folder) or --toy-scenes N")
        if a.min_pixels > a.max_pixels:
            raise ValueError(f"--min-pixels {a.min_pixels} is above --max-pixels {a.max_pixels}")
        if a.dtype != "fp32" and not a.amp:  # fp32 master weights meet the target's bf16 ones under autocast
            raise ValueError(f"--dtype {a.dtype} needs --amp (the draft's own weights stay fp32)")
        if a.temperature == 0 and top_p_given:  # greedy CoCs read only the argmax: it would be ignored
            raise ValueError("--top-p filters sampled CoCs: give a --temperature > 0 with it (0 = greedy)")
        if a.temperature == 0 and a.samples > 1:
            raise ValueError("--samples > 1 needs --temperature > 0 (greedy CoCs of a scene are all equal)")
    return cli.config_from_args(DraftConfig, a), a.stage, ap


@cli.program
def main(argv=None):
    cfg, stage, ap = parse_args(argv)
    with cli.user_errors(ap):  # a locked, read-only or existing --out, a full disk, a bad scene: one line
        return run_draft(cfg, stage)


if __name__ == "__main__":
    main()
