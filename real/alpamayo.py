"""Alpamayo-R1's prompt, built from a folder's own tokenizer and image processor, and the whole plan on pixels that
`bench.py real` times. Paper: Alpamayo-R1 is the deliberative reasoner (target) that RSD accelerates. The layout
(NVIDIA's; docs/background.md, "The Alpamayo-R1 prompt layout"): a system turn; a user turn of 16 images (4 cameras x 4
frames), 48 history ids (HistoryTokenizer) and the instruction; the assistant turn opened with <|cot_start|>. Images
go through the Qwen-VL image processor (not AutoProcessor: Qwen3-VL's also needs torchvision).

Held out (bench.py --scenes, heldout): over a scene folder, tau, alpha per draft position, the routine share, greedy
identity with p alone, each plan stage's latency, and the ADE of the expert's plan after the speculative CoC.

run: python bench.py real --device cuda --target ALPAMAYO_DIR [--images-dir CAMERAS]   (tests: tests/test_alpamayo.py)
     python bench.py real --device cuda --target ALPAMAYO_DIR --draft DRAFT --scenes SCENES --tree 0
                                                                                    (tests: tests/test_heldout.py)
"""
from dataclasses import dataclass, replace
import functools
import os
from statistics import median

import torch
import torch.nn.functional as F

import evaluate
import model as M
from ops import checkpoint, cli, files
from measure import flags, timing
from real import hf
from real.expert import config_field, speed_from_history
import speculate
from vision import patchify

SYSTEM = "You are a driving assistant that generates safe and accurate actions."
INSTRUCTION = "output the chain-of-thought reasoning of the driving process, then output the future trajectory."
N_POSES = 16  # past poses at 10 Hz, the last one is now: 3 history ids each
MIN_PIXELS, MAX_PIXELS = 163840, 196608  # Alpamayo's image size bounds: 160-192 merged tokens per image
TOKENS = ("<|traj_history_start|>", "<|traj_history|>", "<|traj_history_end|>", "<|cot_start|>", "<|cot_end|>",
          "<|traj_future_start|>")  # Alpamayo's added tokens the prompt and the plan need


@dataclass
class HistoryTokenizer:
    first_id: int  # vocabulary id of bin 0
    num_bins: int = 1000
    xyz_min: tuple = (-4.0, -4.0, -10.0)  # metres per 0.1 s step
    xyz_max: tuple = (4.0, 4.0, 10.0)

    @classmethod
    def from_config(cls, raw, where="config.json"):
        hist = config_field(raw, "hist_traj_tokenizer_cfg", where) or {}
        if not str(hist.get("_target_", "DeltaTrajectoryTokenizer")).endswith("DeltaTrajectoryTokenizer"):
            raise ValueError(f"{where}: hist_traj_tokenizer_cfg is {hist['_target_']!r}; only the delta tokenizer")
        if hist.get("predict_yaw", False):
            raise ValueError(f"{where}: hist_traj_tokenizer_cfg.predict_yaw (4 ids per pose) is not implemented")
        first = sum(config_field(raw, f, where) for f in ("traj_token_start_idx", "traj_tokenizer_cfg.num_bins"))
        return cls(first_id=int(first), num_bins=int(hist.get("num_bins", cls.num_bins)),
                   xyz_min=tuple(hist.get("ego_xyz_min", cls.xyz_min)),
                   xyz_max=tuple(hist.get("ego_xyz_max", cls.xyz_max)))

    def encode(self, xyz):
        """Past poses (B, 16, 3) -> ids (B, 48), (pose, axis) order; the first delta is the oldest pose, as upstream."""
        lo, hi = torch.tensor(self.xyz_min), torch.tensor(self.xyz_max)
        deltas = torch.diff(xyz.float(), dim=1, prepend=torch.zeros_like(xyz[:, :1]).float())  # (B, 16, 3)
        bins = ((deltas - lo) / (hi - lo) * (self.num_bins - 1)).round().long().clamp(0, self.num_bins - 1)
        return bins.flatten(1) + self.first_id  # (B, 16, 3) -> (B, 48)


@functools.lru_cache(maxsize=8)
def tokenizer(src):
    """src's tokenizer, read once per process: a prompt is built per scene, again in every training step drawing it."""
    from transformers import AutoTokenizer  # optional extra: only the prompt builders need it
    return AutoTokenizer.from_pretrained(src)


@functools.lru_cache(maxsize=8)
def image_processor(src, min_pixels, max_pixels):
    from transformers import AutoImageProcessor  # optional extra, as tokenizer()
    return AutoImageProcessor.from_pretrained(src, min_pixels=min_pixels, max_pixels=max_pixels)


def build_prompt(folder, images, history_xyz, processor_dir=None, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
    """One scene's prompt -> {input_ids (1, L), pixel_values (N, C*tp*p*p), image_grid_thw (n_images, 3)}. images
    (n_images, 3, H, W) uint8, cameras then frames; history_xyz (16, 3) past poses; processor_dir: default folder."""
    where = os.path.join(folder, hf.CONFIG)
    raw = files.read_json(where)
    hist = HistoryTokenizer.from_config(raw, where)
    src = processor_dir or folder
    tok = tokenizer(src)
    vocab = tok.get_vocab()
    if missing := [t for t in TOKENS if t not in vocab]:
        raise ValueError(f"{src}: the tokenizer lacks Alpamayo's tokens {missing}: save the Alpamayo tokenizer "
                         "(the Qwen3-VL one with Alpamayo's added tokens) there")
    for key, token in (("history", "<|traj_history|>"), ("future_start", "<|traj_future_start|>")):
        if config_field(raw, f"traj_token_ids.{key}", where) != vocab[token]:
            raise ValueError(f"{where}: traj_token_ids.{key} = {raw['traj_token_ids'][key]} but the tokenizer in {src} "
                             f"has {token} = {vocab[token]}")
    history = "<|traj_history_start|>" + "<|traj_history|>" * (3 * N_POSES) + "<|traj_history_end|>"
    prompt = chat_prompt(src, [("system", SYSTEM), ("user", history + INSTRUCTION), ("assistant", "<|cot_start|>")],
                         images, min_pixels, max_pixels)
    ids = prompt["input_ids"]  # (1, L)
    ids[ids == vocab["<|traj_history|>"]] = hist.encode(torch.as_tensor(history_xyz)[None]).flatten()  # (48,)
    return prompt


def chat_prompt(src, turns, images, min_pixels, max_pixels):
    """The prompt dict of the chat turns [(role, text)] through src's chat template, the images opening the user turn,
    each image's <|image_pad|> widened to its merged-token count; a last assistant turn is continued, else opened."""
    tok, proc = tokenizer(src), image_processor(src, min_pixels, max_pixels)
    chat = [{"role": role, "content": [{"type": "image"} for _ in (images if role == "user" else ())]
             + [{"type": "text", "text": text}]} for role, text in turns]
    cont = turns[-1][0] == "assistant"
    text = tok.apply_chat_template(chat, tokenize=False, continue_final_message=cont, add_generation_prompt=not cont)
    vis = proc(images=list(images), return_tensors="pt")
    pieces = text.split("<|image_pad|>")
    if len(pieces) != len(images) + 1:
        raise ValueError(f"the chat template wrote {len(pieces) - 1} image placeholders for {len(images)} images")
    counts = (vis["image_grid_thw"].prod(-1) // proc.merge_size ** 2).tolist()  # merged tokens per image
    text = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]  # (1, L)
    return {"input_ids": ids, "pixel_values": vis["pixel_values"], "image_grid_thw": vis["image_grid_thw"]}


def qwen_prompt(src, images, instruction, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
    """A plain Qwen-VL prompt (no Alpamayo tokens): a user turn of images and instruction, the assistant's opened."""
    return chat_prompt(src, [("user", instruction)], images, min_pixels, max_pixels)


# ---- a real checkpoint's plan on pixels (bench.py real --target) ----
def history_poses(speed=8.0, dt=0.1):
    """16 past poses (16, 3) of a car driving straight at `speed` m/s, ego frame at the last one."""
    t = torch.arange(-(N_POSES - 1), 1) * dt  # (16,) seconds, 0 = now
    return torch.stack([speed * t, torch.zeros_like(t), torch.zeros_like(t)], -1)


def scene_images(images_dir=None, n=16, size="288x512"):
    """(3, H, W) uint8 images: images_dir's files in name order, or n generated ones of size "HxW" (seeded noise)."""
    if images_dir:
        from PIL import Image  # optional extra: only a folder of images needs it
        paths = files.listed(images_dir, files.IMAGE_SUFFIXES)  # each a regular file: a FIFO would hang
        if not paths:
            raise FileNotFoundError(f"{images_dir}: no .jpg / .png images")
        images = [Image.open(p).convert("RGB") for p in paths]
        # (H * W * 3,) bytes -> (H, W, 3) -> (3, H, W)
        return [torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(im.height, im.width, 3)
                .permute(2, 0, 1) for im in images]
    H, W = (int(s) for s in size.split("x"))
    g = torch.Generator().manual_seed(0)
    base = 255 * torch.rand(n, 3, 1, 1, generator=g)
    ramp = torch.linspace(0.4, 1.0, W)  # (W,): a left-to-right brightness ramp
    x = base * ramp + 20 * torch.randn(n, 3, H, W, generator=g)  # (n, 3, H, W)
    return list(x.clamp(0, 255).to(torch.uint8))


def real_prompt(cfg: M.ModelConfig, device, n_images=16, grid=(1, 20, 36), n_history=48, seed=0):
    """An Alpamayo-shaped prompt for a Qwen-VL config: text, n_images images of `grid` patches (180 merged tokens
    each at merge 2), 48 history tokens, text; random ids and pixels (only shapes matter), none without a tower."""
    g, m = torch.Generator().manual_seed(seed), cfg.spatial_merge_size
    n_tok = grid[0] * (grid[1] // m) * (grid[2] // m)
    V, special = cfg.vocab_size, (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id)
    ordinary = torch.tensor([i for i in range(min(1000, V // 2), min(100_000, V)) if i not in special])
    text = lambda n: ordinary[torch.randint(len(ordinary), (n,), generator=g)].tolist()  # noqa: E731
    ids = text(24)
    for _ in range(n_images):
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n_tok + text(1)  # text(1): <|vision_end|>
    ids += text(n_history + 2) + text(16)
    prompt = {"input_ids": torch.tensor([ids], device=device),
              "image_grid_thw": torch.tensor([grid] * n_images, device=device)}
    if (v := cfg.vision) is not None:
        dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
        prompt["pixel_values"] = torch.randn(n_images * grid[0] * grid[1] * grid[2], dim, generator=g).to(device)
    return prompt


def pixel_prompt(cfg: M.ModelConfig, images, max_pixels, device):
    """Without a tokenizer: real_prompt's placeholder ids around the images, resized to one grid under max_pixels,
    scaled to [-1, 1] and flattened by vision.patchify (real shapes and pixels, not real ids: a timing prompt)."""
    v = cfg.vision
    f = v.patch_size * v.spatial_merge_size
    H, W = images[0].shape[-2:]
    s = min(1.0, (max_pixels / (H * W)) ** 0.5)
    h, w = max(f, round(H * s / f) * f), max(f, round(W * s / f) * f)
    x = torch.stack([F.interpolate(im[None].float(), size=(h, w), mode="bicubic")[0] for im in images])
    x = (x / 255 - 0.5) / 0.5  # (n, 3, h, w)
    prompt = real_prompt(cfg, device, n_images=len(images), grid=(1, h // v.patch_size, w // v.patch_size))
    prompt["pixel_values"] = torch.cat([patchify(im[None], v.patch_size, v.temporal_patch_size,
                                                 v.spatial_merge_size)[0] for im in x]).to(device)
    return prompt


def has_tokenizer(folder):
    return any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.json", "tokenizer_config.json"))


def load_pair(target_dir, draft_dir, device, dtype):
    """The target and its draft: draft_dir (checkpoint.load refuses another target's), else an untrained 1-layer one."""
    target = hf.load_pretrained(target_dir, dtype=dtype, device=device).eval()
    return target, (checkpoint.load(draft_dir, target=target, dtype=dtype, device=device) if draft_dir
                    else M.make_draft(target, n_layers=1)).eval()


def load(target_dir, draft_dir, images, device, dtype, processor=None, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
    """The target's model, the draft (draft_dir, else an untrained 1-layer one), the prompt on the images (build_prompt
    with a tokenizer, else pixel_prompt), the id ending the reasoning step (Alpamayo's <|traj_future_start|>), tok,
    how the prompt was built."""
    target, draft = load_pair(target_dir, draft_dir, device, dtype)
    where, src = os.path.join(target_dir, hf.CONFIG), processor or target_dir
    raw = files.read_json(where)
    stop = (config_field(raw, "traj_token_ids.future_start", where)  # where the expert takes over
            if getattr(target, "expert", None) is not None else None)
    why = (f"no tokenizer in {src}" if not has_tokenizer(src) else None if "traj_token_ids" in raw else
           f"{where} has no traj_token_ids (not an Alpamayo-R1 config)")
    if why is None:
        tok, how = tokenizer(src), "Alpamayo-R1 prompt (alpamayo.build_prompt)"
        prompt = build_prompt(target_dir, images, history_poses(), processor, min_pixels, max_pixels)
    else:
        tok, how = None, f"placeholder text ids around real pixels ({why})"
        prompt = pixel_prompt(target.cfg, images, max_pixels, device)
    return target, draft, hf.on_model(prompt, target), stop, tok, how


@torch.inference_mode()
def plan(target, draft, prompt, stop, tok, how, decoder, max_new, repeats, sampling):
    """After the timed reasoning step: the CoC once more (marked), and with an action expert the trajectory, timed
    (median of `repeats`). decoder: the chain's gamma or a tree.TreeShape."""
    spec = evaluate.decode(target, draft, prompt, decoder, max_new, stop, sampling)
    words = [tok.decode([t]) if tok is not None else str(t) for t in spec.tokens]
    res = {"prompt_source": how, "images": int(prompt["image_grid_thw"].shape[0]),
           "visual_tokens": int((prompt["input_ids"] == target.cfg.image_token_id).sum()),
           "coc_tokens": spec.tokens, "coc": evaluate.marked_coc(words, spec.from_draft)}
    if getattr(target, "expert", None) is not None:
        v0 = speed_from_history(history_poses()[None]).to(prompt["input_ids"].device)  # (1,)
        waypoints, _, cache = evaluate.action_rows(target, prompt, [spec.tokens], (stop,), v0)  # (1, N, 2)
        g = torch.Generator(device=v0.device)  # the expert alone timed, on the cache of prompt + CoC it read
        t = timing.median_time(lambda: target.expert(cache, v0, generator=g.manual_seed(0)), v0.device, repeats)
        res.update(trajectory_ms=1e3 * t, waypoints=waypoints[0].float().tolist())
    return res


def report_lines(res):
    n, w = len(res["coc_tokens"]), res.get("waypoints")
    ar, sp = (res["arms"][a] for a in ("target-only", "speculative"))
    at = lambda i: f"({w[min(i, len(w) - 1)][0]:.1f}, {w[min(i, len(w) - 1)][1]:.1f})"  # noqa: E731
    return [f"prompt         {res['prompt_tokens']} tokens, {res['images']} images, {res['visual_tokens']} visual "
            f"tokens: {res['prompt_source']}",
            f"plan timings   prefill (vision tower + prompt) {ar['prefill_ms']:.2f} ms   reasoning step ({n} "
            f"tokens) target-only {n * ar['ms_per_token']:.2f} ms, speculative {n * sp['ms_per_token']:.2f} "
            "ms   trajectory (action expert) " + (f"{res['trajectory_ms']:.2f} ms" if w else "none: no action expert"),
            f"CoC (routine, [deliberative]): {res['coc']}"] + ([] if not w else [
            f"trajectory     {len(w)} waypoints (x, y) m, 10 Hz: 1 s {at(9)}, 3 s {at(29)}, last {at(-1)}"])


# ---- held-out scenes: acceptance, greedy identity, latency per stage, ADE (bench.py --scenes) ----
FUTURE_DT = 0.1  # s between scenes.py's future poses (10 Hz)
STAGES = ("vision", "prefill", "draft_prefill", "reasoning_target_only", "reasoning_speculative", "action_expert")


def reasoning_stop_ids(raw, tok, where):
    """The ids ending the reasoning step, the last one where decoding stops: Alpamayo's <|cot_end|>
    <|traj_future_start|> (the expert takes over after it), else a plain Qwen-VL's turn end <|im_end|> (or eos)."""
    if "traj_token_ids" in raw:
        return [tok.get_vocab()["<|cot_end|>"], config_field(raw, "traj_token_ids.future_start", where)]
    stop = tok.get_vocab().get("<|im_end|>", tok.eos_token_id)
    if stop is None:
        raise ValueError(f"{where}: not an Alpamayo config (no traj_token_ids) and its tokenizer has neither "
                         "<|im_end|> nor an eos token: nothing ends the reasoning step")
    return [stop]


@torch.inference_mode()
def heldout(target, draft, scenes, prompts, stop, max_new, gamma, repeats, words=str, sampling=speculate.GREEDY):
    """{rows: one per scene, and the aggregate}: greedy target-only (p alone) vs speculative (q drafts, p verifies)
    decoding of each scene's prompt, and the plan's stages timed, medians of `repeats` after a warm-up. scenes:
    scenes.Scene (past / future poses); prompts: their (scene_id, batch-1 prompt dict or a function returning it);
    gamma: the chain's draft length or a tree.TreeShape; words: token id -> text, for the marked CoC. sampling: greedy,
    or greedy with a relaxed rule (LOSSY: each row then gives how far the expert's plan moved, plan_moved_m)."""
    w, rows, specs, exact_specs = next(target.parameters()), [], [], []
    for i, (scene, (scene_id, prompt)) in enumerate(zip(scenes, prompts)):
        cli.progress(f"held-out scene {i + 1} of {len(scenes)} ({scene_id}): both arms, the stages timed", 10)
        p = hf.on_model(prompt() if callable(prompt) else prompt, target)
        dev, L = w.device, p["input_ids"].shape[1]
        runs = timing.interleaved({arm: lambda i, d=d: evaluate.decode(target, d, p, gamma, max_new, stop, sampling,
                                                                      timing=True)
                                   for arm, d in (("ar", None), ("spec", draft))}, 1, repeats, dev)  # after a warm-up
        ar, spec = (runs[arm][0][0].result for arm in ("ar", "spec"))
        if sampling.lossy:  # the exact decode's tau beside the relaxed one (docs/own-target.md)
            exact_specs.append(evaluate.decode(target, draft, p, gamma, max_new, stop, replace(sampling, relaxed=None)))
        ar_s, spec_s = ([x[0].result.decode_s for x in runs[arm]] for arm in ("ar", "spec"))
        embeds, deepstack = speculate.embed_prompt(target, p)  # (1, L, D)

        def prefill_time(m, ds):  # one prompt forward into a cache reset to empty: the decode's own prefill
            cache = m.new_cache(batch=1, max_len=L)
            return timing.median_time(lambda: (cache.crop(0), speculate.prefill(m, p, embeds, cache, ds)), dev, repeats)

        s = {"vision": timing.median_time(lambda: target.visual(p["pixel_values"], p["image_grid_thw"]), dev, repeats),
             "prefill": prefill_time(target, deepstack), "draft_prefill": prefill_time(draft, None),
             "reasoning_target_only": median(ar_s), "reasoning_speculative": median(spec_s), "action_expert": None}
        n, n_vis = len(spec.tokens), int((p["input_ids"] == target.cfg.image_token_id).sum())
        row = {"scene": scene_id, "prompt_tokens": L, "visual_tokens": n_vis, "tokens": n, "rounds": spec.rounds,
               **{k: getattr(spec, k) for k in ("tau", "alpha", "accepted", "depths", "n_accepted", "n_tested")},
               "alpha_by_position": spec.alpha_by_depth(), "routine_tokens": sum(spec.from_draft),
               "routine_share": sum(spec.from_draft) / n, "identical": spec.tokens == ar.tokens,
               "divergence": (timing.divergences(target, [p], [ar.tokens], [spec.tokens]) or [None])[0],
               "coc_tokens": spec.tokens, "coc": evaluate.marked_coc([words(t) for t in spec.tokens], spec.from_draft),
               "ade_m": None, "fde_m": None, "plan_moved_m": None}
        if getattr(target, "expert", None) is not None:  # the plan's last stage, after the speculative CoC
            v0 = speed_from_history(scene.past[None]).to(dev)  # (1,)
            waypoints, _, cache = evaluate.action_rows(target, p, [spec.tokens], (stop,), v0)  # (1, N, 2)
            if sampling.lossy:  # the price: the plan after the exact CoC (target-only's) beside it
                exact = evaluate.action_rows(target, p, [ar.tokens], (stop,), v0)[0]  # (1, N, 2)
                row["plan_moved_m"] = evaluate.ade_fde(waypoints.float().cpu(), exact.float().cpu())[0]
            g = torch.Generator(device=dev)  # the expert alone timed, on the cache of prompt + CoC it read
            s["action_expert"] = timing.median_time(lambda: target.expert(cache, v0, generator=g.manual_seed(0)), dev,
                                                    repeats)
            row["waypoints"] = waypoints[0].float().tolist()  # (N, 2) x, y in metres
            if scene.future is not None:
                if target.expert.cfg.dt != FUTURE_DT:
                    raise ValueError(f"the expert's waypoints are {target.expert.cfg.dt} s apart, scene {scene_id}'s "
                                     f"future poses {FUTURE_DT} s: no ADE between them")
                k = min(waypoints.shape[1], len(scene.future))
                ade, fde = evaluate.ade_fde(waypoints[:, :k].float().cpu(), scene.future[None, :k, :2])  # x, y
                row.update(ade_m=ade, fde_m=fde)
        row["ms"] = {k: None if v is None else 1e3 * v for k, v in s.items()}
        rows.append(row)
        specs.append(spec)
    res = dict(heldout_aggregate(rows, speculate.SpecResult.pooled(specs), gamma), rows=rows)
    return res | ({"tau_exact": speculate.SpecResult.pooled(exact_specs).tau} if exact_specs else {})


def heldout_aggregate(rows, pooled, gamma):
    """The scenes pooled (pooled: their speculative decodes as one SpecResult): tau and alpha over all rounds, alpha
    per draft position, the routine share of all tokens, each stage's mean over scenes of its medians, the whole plan
    in both arms, ADE over the scenes with futures."""
    ms = {k: None if any(r["ms"][k] is None for r in rows) else sum(r["ms"][k] for r in rows) / len(rows)
          for k in STAGES}
    shared = sum(ms[k] or 0 for k in ("vision", "prefill", "action_expert"))
    plan = {"target_only": shared + ms["reasoning_target_only"],
            "speculative": shared + ms["draft_prefill"] + ms["reasoning_speculative"]}
    ade = [r["ade_m"] for r in rows if r["ade_m"] is not None]
    return {"scenes": len(rows), "identical": sum(r["identical"] for r in rows), "tokens": len(pooled.tokens),
            "tau": pooled.tau, "tau_ceiling": evaluate.tau_ceiling([r["tokens"] for r in rows], gamma),
            "alpha": pooled.alpha, "alpha_by_position": pooled.alpha_by_depth(), "routine_share": pooled.routine_share,
            "ms": ms, "plan_ms": plan,
            "reasoning_speedup": ms["reasoning_target_only"] / ms["reasoning_speculative"],
            "plan_speedup": plan["target_only"] / plan["speculative"],
            "ade_m": sum(ade) / len(ade) if ade else None, "ade_scenes": len(ade),
            "plan_moved_m": None if any(r.get("plan_moved_m") is None for r in rows) else
            sum(r["plan_moved_m"] for r in rows) / len(rows)}


def heldout_bench(target_dir, draft_dir, scenes_dir, found, prompts, stop, how, decoder, max_new, repeats, device,
                  dtype, processor=None, sampling=speculate.GREEDY):
    """bench.py --scenes: the models, then heldout() over scenes.scene_prompts' scenes (found), prompts and stop id."""
    target, draft = load_pair(target_dir, draft_dir, device, dtype)
    tok = tokenizer(processor or target_dir)
    res = heldout(target, draft, found, prompts, stop, max_new, decoder, repeats, lambda t: tok.decode([t]), sampling)
    return dict(res, mode="heldout", decoding=flags.sampling_json(sampling), model=target_dir, draft=draft_dir,
                trained_draft=bool(draft_dir), scenes_dir=scenes_dir, stop=stop, prompt_source=how)


def heldout_lines(res):
    """bench.py --scenes' table: the aggregate, then one row per scene."""
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    ms, plan, ade = res["ms"], res["plan_ms"], res["ade_m"]
    lines = ["NOTE: untrained draft (no --draft) -> tau, alpha and the routine share say nothing about RSD; only the "
             "stage latencies do."] if not res["trained_draft"] else []
    lines += [f"held-out       {res['scenes']} scenes of {res['scenes_dir']}: {res['prompt_source']}, {res['tokens']} "
              f"CoC tokens, stop id {res['stop']}",
              f"greedy         speculative identical to target-only on {res['identical']} of {res['scenes']} scenes"
              + ("" if res["identical"] == res["scenes"] else "   DIFFERS: see the rows' divergence"
                 if not res["decoding"]["lossy"] else "   (LOSSY: a relaxed rule)"),
              f"acceptance     tau {res['tau']:.2f}" + (f" (LOSSY; exact {res['tau_exact']:.2f})" if "tau_exact"
                                                     in res else "") + f" (ceiling {res['tau_ceiling']:.2f})   "
              f"alpha {res['alpha']:.3f}   by {'level' if res['decoder']['kind'] == 'tree' else 'position'} "
              f"{' '.join(f(a, 2) for a in res['alpha_by_position'])}   routine share {res['routine_share']:.3f}",
              f"stages (ms)    vision {f(ms['vision'])}   prefill {f(ms['prefill'])}   draft prefill "
              f"{f(ms['draft_prefill'])}   reasoning target-only {f(ms['reasoning_target_only'])}, speculative "
              f"{f(ms['reasoning_speculative'])} ({res['reasoning_speedup']:.2f}x)   action expert "
              + (f(ms["action_expert"]) if ms["action_expert"] is not None else "none"),
              f"plan (ms)      target-only {plan['target_only']:.2f}   speculative {plan['speculative']:.2f} "
              f"({res['plan_speedup']:.2f}x)   (mean over scenes of per-scene medians)"]
    lines += [f"LOSSY          the relaxed rule moved the expert's plan {res['plan_moved_m']:.3f} m (ADE to the plan "
              "after target-only's CoC), mean over scenes"] if res["plan_moved_m"] is not None else []
    lines += [f"ADE            {ade:.3f} m over {res['ade_scenes']} scenes (the expert after the speculative CoC vs "
              "poses.json's future, x / y)"] if ade is not None else []
    lines += [f"{'scene':<16}{'tokens':>7}{'tau':>6}{'alpha':>7}{'routine':>8}  same{'vision':>8}{'prefill':>8}"
              f"{'AR':>9}{'spec':>9}{'expert':>8}{'ADE m':>7}"]
    lines += [f"{r['scene'][:15]:<16}{r['tokens']:>7}{r['tau']:>6.2f}{r['alpha']:>7.3f}{r['routine_share']:>8.3f}  "
              f"{'yes' if r['identical'] else 'NO':<4}" + "".join(
                  f"{f(r['ms'][k]):>{n}}" for k, n in (("vision", 8), ("prefill", 8), ("reasoning_target_only", 9),
                                                       ("reasoning_speculative", 9), ("action_expert", 8)))
              + f"{f(r['ade_m'], 3):>7}" for r in res["rows"]]
    return lines
