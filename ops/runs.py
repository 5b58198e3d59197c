"""What every training program shares (train.py, aarl.py, real/distill.py, real/aarl_real.py): AdamW and its learning
rate schedule, one clipped update, the resumable state with its checks, a non-finite loss stopping a run, and the
ranks of a `torchrun` launch. None of it is the paper's; all of it decides whether a run can be trusted and resumed.

run: python -m pytest -q tests/test_train.py       (exact resume, DDP ranks identical, a NaN stops the run)
"""
from dataclasses import asdict
import datetime
import math
import os

import torch
import torch.distributed as dist

from ops import checkpoint, files

# ---- the optimizer, its schedule, one update ----
def make_optimizer(params, lr, weight_decay=0.0):
    """AdamW as every program here uses it (betas (0.9, 0.95), as in GPT-style training)."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)


def lr_at(step, steps, lr, warmup):
    """Linear warm-up over `warmup` steps, then cosine decay to 10% of lr at `steps`."""
    frac = (step - warmup) / max(1, steps - warmup)
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
    return lr * (step + 1) / warmup if step < warmup else lr * cosine


def update(opt, model, lr, grad_clip, loss=None):
    """One AdamW step at learning rate lr with the gradient norm clipped; loss: its backward first (None: the
    gradients were accumulated by the caller). The gradients are cleared after the step, ready for the next."""
    if loss is not None:
        loss.backward()
    for grp in opt.param_groups:
        grp["lr"] = lr
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    try:
        opt.step()
    except RuntimeError as e:  # a finite lr past float32's range: torch cannot form the step ("without overflow")
        if "overflow" not in str(e):
            raise
        raise FloatingPointError(f"an update at lr {lr:g} overflows float32: use a smaller learning rate") from None
    opt.zero_grad(set_to_none=True)


def check_loss(name, value, step, state_path, model=None):
    """Stop at a non-finite loss, or (model given: after its update) a non-finite weight, before it is saved: the
    state on disk stays the last good one. An infinite step (lr, clip) can leave a finite loss and NaN weights."""
    bad = None if value is None or math.isfinite(value) else f"loss is {value}"  # None: the weights only
    trained = ((k, p) for k, p in (model.named_parameters() if model is not None else ()) if p.requires_grad)
    if bad is None and (w := checkpoint.first_nonfinite(trained)):
        bad = f"weight {w!r} is NaN / inf after the update"
    if bad:
        kept = (f"the last good state is {state_path} (step "
                f"{torch.load(state_path, map_location='cpu', weights_only=True)['step']})"
                if state_path and os.path.exists(state_path) else "no state was saved yet")
        raise FloatingPointError(f"{name} {bad} at step {step}: stopped; {kept}")


# ---- the resumable state ----
# Fields that cannot change what a run computes: resuming with other values is fine. A moved target or scene folder
# (target, scenes, processor) is fine too: the fingerprints of the target and of the records are checked instead.
RESUMABLE_CHANGES = ("out", "device", "eval_every", "save_every", "n_val", "n_test", "overwrite", "target", "scenes",
                     "processor", "workers", "draft", "allow_truncated")
LAST_STATE = {}  # the resumable state this process last loaded or saved, {"path", "step"}: what a Ctrl-C line says


def interrupted_note():
    """The one line a Ctrl-C ends a run with (cli.user_errors): where the training state stands, how to resume."""
    path, step = LAST_STATE.get("path"), LAST_STATE.get("step", 0)
    if not path:
        return "interrupted before any training state was saved: rerun the same command to start again"
    if not step:
        return f"interrupted before {path} was first saved: rerun the same command to start that training again"
    return f"interrupted: the state in {path} was saved at step {step}; rerun the same command to resume from there"


def save_state(path, step, models, opts, cfg, rank, bound=None, data=None, extra=None):
    """Rank 0 writes the resumable state atomically; all ranks wait. bound: {name: checkpoint.fingerprint} of the
    frozen models the state is only valid with (the target, a static reference); data: the training records'
    fingerprint; extra: anything else a resume must restore exactly (e.g. a rollout generator's state)."""
    if rank == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        files.torch_save({"step": step, "config": asdict(cfg), "bound": bound, "data": data, "extra": extra,
                          "models": {k: m.state_dict() for k, m in models.items()},
                          "opts": {k: o.state_dict() for k, o in opts.items()}}, path)
    barrier()
    LAST_STATE.update(path=path, step=step)


def load_state(path, models, opts, cfg, bound=None, data=None):
    """Resume from path if it exists -> (the step to continue from (0: fresh), the state's `extra`). A state of another
    config, of other frozen models than `bound`'s fingerprints, or of other records than `data`, is refused, naming
    what differs: resuming would mix two runs."""
    LAST_STATE.update(path=path, step=0)
    if not os.path.exists(path):
        return 0, None
    try:
        # on the CPU: load_state_dict copies to each parameter's device, and a generator's state must stay there
        state = torch.load(path, map_location="cpu", weights_only=True)
        state["models"], state["opts"]
    except Exception as e:  # a truncated, foreign or older file: say which, do not silently restart
        raise ValueError(f"cannot resume from {path}: {e!r}; delete it to start over") from e
    # a field added to the config after the state was saved counts as its default, which is what that run used
    saved, now = {**asdict(type(cfg)()), **state.get("config", {})}, asdict(cfg)
    differ = sorted(k for k in set(saved) | set(now) if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k))
    if differ:
        raise ValueError(f"{path} was written by a run with other settings: "
                         + ", ".join(f"{k} {saved.get(k)!r} there, {now.get(k)!r} now" for k in differ)
                         + "; delete it (and the checkpoints beside it) to start over, or pass --out NEW_FOLDER")
    for name, fp in (bound or {}).items():
        there = (state.get("bound") or {}).get(name)
        if there is not None and there != fp:
            raise ValueError(f"{path} was trained against another {name} ({there['weights']} there, {fp['weights']} "
                             f"now): delete it to start over from the current {name}")
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
    LAST_STATE.update(step=int(state["step"]))
    return int(state["step"]), state.get("extra")


# ---- distributed ranks (torchrun) ----
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
    """DistributedDataParallel over the ranks (the module itself on one)."""
    return m if world == 1 else torch.nn.parallel.DistributedDataParallel(
        m, device_ids=[device.index] if device.type == "cuda" else None)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def all_mean(value, device):
    """The mean of a float over the ranks."""
    t = torch.tensor(float(value), device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def finish():
    if dist.is_initialized():
        dist.destroy_process_group()
