"""Expected time, memory and disk of `python -m real.distill --target DIR --scenes SCENES` per 1,000 scenes at the real shape
(Alpamayo-R1: Qwen3-VL-8B + its vision tower), estimated from measured per-part costs: an estimate, not a timed run.

Paper: the routine reasoner q (one decoder layer, the target's frozen embedding and LM head) distilled on the
deliberative reasoner p's own CoCs (train.py, "a draft for any target"). Per scene the data stage (scenes.distill_data)
runs p's vision tower, one prefill over the prompt and one KV-cached decode step per CoC token; per record the training
stage (distill.sequence_kl) runs p teacher-forced over prompt + CoC (no grad, LM head on the T CoC rows), then q forward +
backward over the same sequence (its LM head on the same T rows), and every batch_size records one AdamW step of q's own
fp32 parameters.

What is measured (random weights, the preset's real widths, heads and 151,936-token vocabulary, the real Alpamayo
prompt of alpamayo.real_prompt: 16 images x 180 merged tokens; median of --reps after a warm-up):
  - the vision tower built with 2 of its 27 blocks (and 1 of 3 DeepStack mergers), timed whole, plus one block and one
    DeepStack merger timed directly: the full tower = tower_2 + 25 x block + 2 x merger (blocks all have one shape);
  - one decoder layer (model.Block, called directly) over the L-token prompt, writing its K/V into a cache as the
    prefill does, and its KV-cached one-token decode step at context L. Timed directly rather than as the difference
    of a 2-layer and a 1-layer forward: on a shared CPU that difference subtracts two multi-second timings whose noise
    is the size of one layer, and it would carry the embedding and LM-head costs, measured apart here. The positions'
    values (FlatRoPE ids here, M-RoPE in p) do not change a layer's cost. The model is still built with 2 layers;
  - the LM head for 1 row (a decode step) and for T rows (the teacher-forced p);
  - q forward + backward, fp32 master weights (bf16 autocast unless --dtype fp32), as distill.sequence_kl runs it: q over
    prompt + CoC with logits_to_keep=T + 1, rows [:-1], train.kl_p_q against p's log-probs, backward;
  - clip_grad_norm_ + AdamW step of q (ops.runs.make_optimizer).
Then extrapolated to the full model: 36 layers, 27 vision blocks. Memory: p's parameters counted exactly from the
config (the preset built on the meta device: nothing allocated), KV cache and q's weights / grads / AdamW state
analytically, q's backward activations measured as the bytes autograd saves (saved_tensors_hooks, distinct storages,
parameters excluded) on any device, and on CUDA also the peak of torch.cuda.max_memory_allocated. CPU clocks are
process CPU time (one thread); CUDA clocks are wall time with a sync before each reading.

run: python experiments/cost_per_1000_scenes.py --device cuda --dtype bf16 [--preset qwen3-vl-8b] [--images 16]
         [--coc-tokens 40] [--samples 1] [--epochs 1] [--reps 3]
     OMP_NUM_THREADS=1 python experiments/cost_per_1000_scenes.py --device cpu --dtype fp32 --reps 1 \
         --out experiments/cost_per_1000_scenes_cpu.json                          (about 2.5 min on one CPU thread)
"""
import argparse
import dataclasses
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from real import alpamayo  # noqa: E402
from ops import cli  # noqa: E402
from ops import files  # noqa: E402
import model as M  # noqa: E402
from measure import timing  # noqa: E402
import train as T  # noqa: E402
from ops import runs  # noqa: E402
from real import distill  # noqa: E402
import vision  # noqa: E402
from evaluate import autocast  # noqa: E402
from rope import rope_cos_sin  # noqa: E402

BUILT_LAYERS, BUILT_BLOCKS = 2, 2  # decoder layers and vision blocks actually allocated
INDEX_BYTES = 80  # distill_data's index.json per record: {"scene": ..., "sample": k, "n": T, "complete": true}
FORMULAS = {
    "vision_s": "vision_tower_2 + (vision_depth - 2) * vision_block + (deepstack_mergers - 1) * deepstack_merger",
    "data_s_per_scene": "samples * (vision + n_layers * prefill_layer "
                        "+ coc_tokens * (n_layers * decode_layer + head_1))",
    "train_s_per_record": "vision + n_layers * prefill_layer + head_T + draft_fwd_bwd",
    "train_s": "1000 * samples * epochs * train_s_per_record + updates * adamw_step, "
               "updates = ceil(1000 * samples * epochs / batch_size)",
    "disk_bytes": "1000 * samples * (4 * coc_tokens + 80)   (uint32 ids + index.json per record)",
    "kv_cache_bytes": "2 * n_layers * n_kv_heads * head_dim * (L + coc_tokens) * dtype_bytes",
    "draft_state_bytes": "draft_params * 4 * (1 weights + 1 grads + 2 AdamW moments)",
    "logits_bytes": "p: coc_tokens * vocab * 4 (fp32 log-probs); q: 2 * coc_tokens * vocab * 4 (fp32 logits + grad)",
}


# ---- the full model's size, from its config alone ----
def param_counts(cfg):
    """Parameters of the full preset by part, built on the meta device (no memory, exact by construction)."""
    with torch.device("meta"):
        m = M.VLA(cfg)
    parts = {"embedding": m.embed_tokens, "decoder_layers": m.layers, "final_norm": m.norm, "lm_head": m.lm_head,
             "vision": m.visual, "traj_head": m.traj_head}
    out = {k: sum(p.numel() for p in v.parameters()) if v is not None else 0 for k, v in parts.items()}
    out["total"] = sum(p.numel() for p in m.parameters())  # == the parts' sum unless embedding and head are tied
    return out


# ---- building the measured model ----
def build(cfg, device, dtype):
    """p with BUILT_LAYERS decoder layers and a BUILT_BLOCKS-block tower (its 1 DeepStack merger after the last
    block), random weights at dtype, frozen; q as distill_draft makes it (one layer, fp32 master weights)."""
    v = dataclasses.replace(cfg.vision, depth=BUILT_BLOCKS, deepstack_visual_indexes=(BUILT_BLOCKS - 1,))
    small = dataclasses.replace(cfg, n_layers=BUILT_LAYERS, vision=v)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised at dtype: no fp32 copy of a 152k-row head first
    try:
        with torch.device(device):
            target = M.VLA(small).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)
    torch.manual_seed(0)
    draft = M.make_draft(target, n_layers=1, kind="flat").float()  # distill.distill_draft's q
    return target, draft


def saved_bytes(fn, exclude):
    """Run fn(); -> bytes of the distinct storages autograd saved for backward meanwhile, parameters excluded."""
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


# ---- the measurements ----
def measure(target, draft, prompt, coc, device, amp, reps):
    """{part: seconds} of one call each, and {what: bytes} of q's training step."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time  # CPU: this thread's CPU time
    t = lambda fn: timing.median_time(fn, device, reps, clock)  # noqa: E731  warm-up call, then the median
    cfg, sec, mem = target.cfg, {}, {}
    w = target.lm_head.weight
    dt = w.dtype
    ids = prompt["input_ids"]  # (1, L)
    L, Tn, D = ids.shape[1], len(coc), cfg.hidden_size
    grid = prompt["image_grid_thw"]
    with torch.no_grad():
        # vision: the 2-block tower whole, one block and one DeepStack merger alone
        tower, pv = target.visual, prompt["pixel_values"].to(dt)  # (N, C*tp*p*p)
        sec["vision_tower_2"] = t(lambda: tower(pv, grid))
        g = grid.tolist()
        x = tower.patch_embed.proj(pv) + tower.position_embedding(g).to(device, dt)  # (N, C)
        cos_v, sin_v = vision.rotary_2d(vision.patch_positions(g, tower.vc.spatial_merge_size).to(device),
                                        tower.inv_freq)  # (N, 1, hd_v)
        frames = vision.frame_segments(g, device)
        sec["vision_block"] = t(lambda: tower.blocks[0](x, cos_v, sin_v, frames))
        sec["deepstack_merger"] = t(lambda: tower.deepstack_merger_list[0](x))
        # one decoder layer: the prefill over L tokens into a cache, then a decode step at context L
        layer = target.layers[0]
        cache = M.KVCache(1, 1, cfg.n_kv_heads, L + 1, cfg.head_dim, dt, device)  # (1, 1, Hk, L + 1, hd)
        cos, sin = (c.to(dt).unsqueeze(2) for c in rope_cos_sin(torch.arange(L + 1, device=device)[None],
                                                               target.inv_freq))  # (1, L + 1, 1, hd)
        h = torch.randn(1, L, D, device=device, dtype=dt)  # (1, L, D)
        sec["prefill_layer"] = t(lambda: layer(h, cos[:, :L], sin[:, :L], cache, 0))  # a full forward: writes [0, L)
        h1, slot = h[:, -1:], torch.tensor([[L]], device=device)  # (1, 1, D), (1, 1): the step writes slot L
        sees = M.grouped_mask(torch.ones(1, 1, L + 1, dtype=torch.bool, device=device), cfg.n_heads // cfg.n_kv_heads,
                              dt)  # (1, 1, g, L + 1): the new token sees every slot
        sec["decode_layer"] = t(lambda: layer(h1, cos[:, L:], sin[:, L:], cache, 0, sees, slot))  # as VLA.step runs it
        sec["head_1"] = t(lambda: target.head(h1))  # (1, 1, V)
        sec["head_T"] = t(lambda: target.head(h[:, :Tn]))  # (1, T, V)
    # q forward + backward over prompt + CoC, on p's embeddings (random: only shapes matter) and p's log-probs
    seq = torch.cat([ids, torch.tensor([coc], device=device)], 1)  # (1, L + T)
    embeds = torch.randn(1, L + Tn, D, device=device, dtype=dt) * 0.02  # (1, L + T, D)
    p_logp = F.log_softmax(torch.randn(Tn, cfg.vocab_size, device=device), -1)  # (T, V)

    def step():  # distill.sequence_kl's draft lines, then the backward distill_draft runs under the same autocast
        with autocast(device, amp):  # rows L - 1 .. L + T - 2 predict the CoC: the last kept row is dropped
            logits_q = draft(seq, inputs_embeds=embeds, logits_to_keep=Tn + 1,
                             image_grid_thw=grid)[0, :-1].float()  # (T, V)
            T.kl_p_q(draft, logits_q, p_logp).backward()

    params = {p.untyped_storage().data_ptr() for m in (target, draft) for p in m.parameters()}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    first = [step]  # median_time's warm-up call counts the saved bytes; the timed calls run bare

    def call():
        if first:
            mem["draft_fwd_bwd_saved_activations"] = saved_bytes(first.pop(), params)
        else:
            step()
    sec["draft_fwd_bwd"] = t(call)
    if device.type == "cuda":
        mem["draft_fwd_bwd_cuda_peak_above_weights"] = torch.cuda.max_memory_allocated(device) - base
    opt = runs.make_optimizer(draft.parameters(), 1e-3, distill.DraftConfig().weight_decay)

    def adamw():  # the per-update work of distill_draft: clip, step (the grads are kept: the next step needs them)
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()

    sec["adamw_step"] = t(adamw)
    return sec, mem


# ---- extrapolation to the full model ----
def extrapolate(cfg, sec, mem, counts, draft_params, L, a, dtype_bytes):
    n, v = cfg.n_layers, cfg.vision
    vis = (sec["vision_tower_2"] + (v.depth - BUILT_BLOCKS) * sec["vision_block"]
           + (len(v.deepstack_visual_indexes) - 1) * sec["deepstack_merger"])
    data = a.samples * (vis + n * sec["prefill_layer"] + a.coc_tokens * (n * sec["decode_layer"] + sec["head_1"]))
    target_fwd = vis + n * sec["prefill_layer"] + sec["head_T"]
    per_record = target_fwd + sec["draft_fwd_bwd"]
    records = 1000 * a.samples * a.epochs
    updates = math.ceil(records / a.batch_size)
    train = records * per_record + updates * sec["adamw_step"]
    Tn, V = a.coc_tokens, cfg.vocab_size
    kv = 2 * n * cfg.n_kv_heads * cfg.head_dim * (L + Tn) * dtype_bytes
    # sequence_kl takes q's T rows to fp32 (.float()) before kl_p_q: (T, V) fp32 and its gradient, at any --dtype
    logits = {"p_T_rows_fp32": Tn * V * 4, "q_T_rows_fp32_and_grad": 2 * Tn * V * 4}
    weights = counts["total"] * dtype_bytes
    state = draft_params * 4 * 4
    act = mem.get("draft_fwd_bwd_cuda_peak_above_weights")  # measured on CUDA: activations + logits + temporaries
    act_src = "CUDA max_memory_allocated during q's step, less q's fp32 grads (first allocated there)"
    if act is not None:
        act -= draft_params * 4
    else:  # CPU: the saved activations (measured) + the logits and their gradient (analytic)
        act, act_src = mem["draft_fwd_bwd_saved_activations"] + logits["q_T_rows_fp32_and_grad"], \
            "saved activations (measured) + q's T x V fp32 logits and gradient (analytic)"
    return {
        "vision_s": vis, "target_forward_s": target_fwd,
        "data_s_per_scene": data, "data_s_per_1000_scenes": 1000 * data,
        "train_s_per_record": per_record, "train_s_per_1000_scenes": train,
        "records": records, "updates": updates,
        "disk_bytes_per_1000_scenes": 1000 * a.samples * (4 * Tn + INDEX_BYTES),
        "memory_bytes": {"target_weights": weights, "kv_cache_one_scene": kv, "draft_weights_grads_adamw": state,
                         "logits": logits, "draft_step_activations": act, "draft_step_activations_source": act_src,
                         "data_stage_total": weights + kv,
                         "train_stage_total": weights + state + act + logits["p_T_rows_fp32"]},
    }


# ---- report ----
def table(sec, est, a):
    gib, h = 2 ** 30, 3600
    mb = est["memory_bytes"]
    rows = [("measured (one call)", "")] + [(f"  {k}", f"{1e3 * s:,.1f} ms") for k, s in sec.items()] + [
        ("per 1,000 scenes (estimate)", ""),
        ("  vision tower, 27 blocks", f"{est['vision_s']:.2f} s per scene"),
        ("  data: s per scene", f"{est['data_s_per_scene']:.2f} s"),
        ("  data: total", f"{est['data_s_per_1000_scenes'] / h:.2f} h"),
        ("  training: s per record", f"{est['train_s_per_record']:.2f} s"),
        (f"  training: total ({a.epochs} epoch, {est['updates']} updates)",
         f"{est['train_s_per_1000_scenes'] / h:.2f} h"),
        ("  disk (CoC ids + index)", f"{est['disk_bytes_per_1000_scenes'] / 1e3:.0f} kB"),
        ("memory", ""),
        ("  p's weights (full preset)", f"{mb['target_weights'] / gib:.2f} GiB"),
        ("  KV cache, one scene", f"{mb['kv_cache_one_scene'] / gib:.3f} GiB"),
        ("  q's weights + grads + AdamW (fp32)", f"{mb['draft_weights_grads_adamw'] / gib:.2f} GiB"),
        ("  q's step: activations + logits", f"{mb['draft_step_activations'] / gib:.2f} GiB"),
        ("  data stage, total", f"{mb['data_stage_total'] / gib:.2f} GiB"),
        ("  training stage, total", f"{mb['train_stage_total'] / gib:.2f} GiB")]
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def hardware(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="fp32", choices=sorted(cli.DTYPES), help="p's weights (bf16 on a GPU)")
    ap.add_argument("--preset", default="qwen3-vl-8b", choices=[k for k, c in M.PRESETS.items() if c.vision])
    ap.add_argument("--images", type=int, default=16, help="images per prompt, 180 merged tokens each")
    ap.add_argument("--coc-tokens", type=int, default=40, help="T: tokens per CoC")
    ap.add_argument("--samples", type=int, default=1, help="CoCs per scene (train.py --samples)")
    ap.add_argument("--epochs", type=int, default=1, help="passes over the records")
    ap.add_argument("--batch-size", type=int, default=16, help="records per update (train.py --batch-size)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per part after one warm-up; the median")
    ap.add_argument("--out", default="runs/cost_per_1000_scenes.json", help="the JSON (the docs': "
                    "experiments/cost_per_1000_scenes_cpu.json)")
    a = cli.checked(ap, ap.parse_args(argv), counts=("images", "coc_tokens", "samples", "epochs", "batch_size", "reps"),
                    out="runs/cost_per_1000_scenes.json")
    cli.check_device(a.device)
    device, dtype = torch.device(a.device), cli.DTYPES[a.dtype]
    if device.type == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    cli.progress(f"{a.preset}: building it at {BUILT_LAYERS} layers, then timing each part")
    t0 = time.time()
    cfg = M.PRESETS[a.preset]
    counts = param_counts(cfg)
    target, draft = build(cfg, device, dtype)
    draft_params = sum(p.numel() for p in draft.parameters())  # its own: the shared embedding / head are not
    prompt = alpamayo.real_prompt(target.cfg, device, n_images=a.images)
    L = prompt["input_ids"].shape[1]
    g = torch.Generator().manual_seed(1)
    coc = torch.randint(1000, 100_000, (a.coc_tokens,), generator=g).tolist()  # ordinary ids
    print(f"{a.preset}: L = {L} prompt tokens, T = {a.coc_tokens}, {hardware(device)}, {a.dtype}, "
          f"{torch.get_num_threads()} threads", flush=True)
    sec, mem = measure(target, draft, prompt, coc, device, a.dtype != "fp32", a.reps)
    est = extrapolate(cfg, sec, mem, counts, draft_params, L, a, torch.finfo(dtype).bits // 8)
    print(table(sec, est, a), flush=True)
    out = {"what": "estimate from measured per-part costs (random weights, real shapes), not a timed train.py run",
           "preset": a.preset, "prompt_tokens": L, "images": a.images, "coc_tokens": a.coc_tokens,
           "samples": a.samples, "epochs": a.epochs, "batch_size": a.batch_size, "reps": a.reps,
           "built": {"decoder_layers": BUILT_LAYERS, "vision_blocks": BUILT_BLOCKS, "deepstack_mergers": 1},
           "full": {"decoder_layers": cfg.n_layers, "vision_blocks": cfg.vision.depth,
                    "deepstack_mergers": len(cfg.vision.deepstack_visual_indexes)},
           "params": counts, "draft_params": draft_params,
           "measured_s": sec, "measured_bytes": mem, "estimate": est, "formulas": FORMULAS,
           "notes": ["CPU times are process CPU time of one thread; CUDA times wall time with a sync per reading",
                     "the training forward covers L + T rows, the formula charges the prompt's L (1.3% fewer)",
                     "distill_data's KV cache holds L - 1 + max_new slots (128 by default), the estimate L + T",
                     "the Alpamayo action expert is not in the preset: not counted (real/distill.py never runs it)"],
           "environment": {"device": str(device), "hardware": hardware(device), "dtype": a.dtype,
                           "threads": torch.get_num_threads(), **timing.environment(device)},
           "wall_s": time.time() - t0}
    files.write_json(a.out, out)
    print(f"wrote {a.out} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
