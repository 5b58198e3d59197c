"""Alpamayo-R1's prompt, built from a folder's own tokenizer and image processor, and the whole plan on pixels that
`bench.py --target` times. Paper: Alpamayo-R1 is the deliberative reasoner (target) that RSD accelerates. The layout
(NVIDIA's public inference code; docs/background.md, "The Alpamayo-R1 prompt layout"): a system turn; a user turn of
16 images (4 cameras x 4 frames, each <|vision_start|> <|image_pad|> x n <|vision_end|>), 48 history ids between
<|traj_history_start|> and <|traj_history_end|> (HistoryTokenizer), the instruction; the assistant turn opened with
<|cot_start|>. Images: the Qwen-VL image processor (not AutoProcessor: Qwen3-VL's also needs torchvision).

run: python bench.py --device cuda --target ALPAMAYO_DIR [--images-dir CAMERAS]   (tests: tests/test_alpamayo.py)
"""
import importlib.util
import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import checkpoint
import evaluate
import files
import hf
import model as M
import speculate
import timing
from expert import config_field, speed_from_history
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


def build_prompt(folder, images, history_xyz, processor_dir=None, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
    """One scene's prompt -> {input_ids (1, L), pixel_values (N, C*tp*p*p), image_grid_thw (n_images, 3)}. images
    (n_images, 3, H, W) uint8, cameras then frames; history_xyz (16, 3) past poses; processor_dir: default folder."""
    from transformers import AutoImageProcessor, AutoTokenizer  # optional extra: only this function needs it

    where = os.path.join(folder, hf.CONFIG)
    raw = files.read_json(where)
    hist = HistoryTokenizer.from_config(raw, where)
    src = processor_dir or folder
    tok = AutoTokenizer.from_pretrained(src)
    vocab = tok.get_vocab()
    missing = [t for t in TOKENS if t not in vocab]
    if missing:
        raise ValueError(f"{src}: the tokenizer lacks Alpamayo's tokens {missing}: save the Alpamayo tokenizer "
                         "(the Qwen3-VL one with Alpamayo's added tokens) there")
    for key, token in (("history", "<|traj_history|>"), ("future_start", "<|traj_future_start|>")):
        if config_field(raw, f"traj_token_ids.{key}", where) != vocab[token]:
            raise ValueError(f"{where}: traj_token_ids.{key} = {raw['traj_token_ids'][key]} but the tokenizer in {src} "
                             f"has {token} = {vocab[token]}")
    history = "<|traj_history_start|>" + "<|traj_history|>" * (3 * N_POSES) + "<|traj_history_end|>"
    messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {"role": "user", "content": [{"type": "image"} for _ in images]
                 + [{"type": "text", "text": history + INSTRUCTION}]},
                {"role": "assistant", "content": [{"type": "text", "text": "<|cot_start|>"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    proc = AutoImageProcessor.from_pretrained(src, min_pixels=min_pixels, max_pixels=max_pixels)
    vis = proc(images=list(images), return_tensors="pt")
    pieces = text.split("<|image_pad|>")
    if len(pieces) != len(images) + 1:
        raise ValueError(f"the chat template wrote {len(pieces) - 1} image placeholders for {len(images)} images")
    counts = (vis["image_grid_thw"].prod(-1) // proc.merge_size ** 2).tolist()  # merged tokens per image
    text = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]  # (1, L)
    ids[ids == vocab["<|traj_history|>"]] = hist.encode(torch.as_tensor(history_xyz)[None]).flatten()  # (48,)
    return {"input_ids": ids, "pixel_values": vis["pixel_values"], "image_grid_thw": vis["image_grid_thw"]}


# ---- a real checkpoint's plan on pixels (bench.py --target) ----


def history_poses(speed=8.0, dt=0.1):
    """16 past poses (16, 3) of a car driving straight at `speed` m/s, ego frame at the last one."""
    t = torch.arange(-(N_POSES - 1), 1) * dt  # (16,) seconds, 0 = now
    return torch.stack([speed * t, torch.zeros_like(t), torch.zeros_like(t)], -1)


def scene_images(args):
    """(3, H, W) uint8 images: --images-dir's files in name order (PIL), or --images generated ones (seeded noise)."""
    if args.images_dir:
        from PIL import Image  # optional extra: only a folder of images needs it
        names = sorted(n for n in os.listdir(args.images_dir) if n.lower().endswith((".jpg", ".jpeg", ".png")))
        if not names:
            raise FileNotFoundError(f"{args.images_dir}: no .jpg / .png images")
        images = [Image.open(os.path.join(args.images_dir, n)).convert("RGB") for n in names]
        # (H * W * 3,) bytes -> (H, W, 3) -> (3, H, W)
        return [torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(im.height, im.width, 3)
                .permute(2, 0, 1) for im in images]
    H, W = (int(s) for s in args.image_size.split("x"))
    g = torch.Generator().manual_seed(0)
    base = 255 * torch.rand(args.images, 3, 1, 1, generator=g)
    ramp = torch.linspace(0.4, 1.0, W)  # (W,): a left-to-right brightness ramp
    x = base * ramp + 20 * torch.randn(args.images, 3, H, W, generator=g)  # (n, 3, H, W)
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


def load(args, device, dtype):
    """--target's model, the draft (--draft, else an untrained 1-layer one), the prompt on pixels (build_prompt with a
    tokenizer, else pixel_prompt), the id ending the reasoning step (Alpamayo's <|traj_future_start|>), tok, how."""
    target = hf.load_pretrained(args.target, dtype=dtype, device=device).eval()
    draft = (checkpoint.load(args.draft, target=target, dtype=dtype, device=device) if args.draft
             else M.make_draft(target, n_layers=1)).eval()
    raw = files.read_json(os.path.join(args.target, hf.CONFIG))
    src = args.processor or args.target
    stop = tok = None
    if getattr(target, "expert", None) is not None:  # the reasoning step ends where the expert takes over
        stop = config_field(raw, "traj_token_ids.future_start", args.target)
    images = scene_images(args)
    if has_tokenizer(src) and "traj_token_ids" in raw:
        from transformers import AutoTokenizer  # optional extra, as in build_prompt
        tok = AutoTokenizer.from_pretrained(src)
        prompt = build_prompt(args.target, images, history_poses(), args.processor, args.min_pixels, args.max_pixels)
        how = "Alpamayo-R1 prompt (alpamayo.build_prompt)"
    else:
        prompt = pixel_prompt(target.cfg, images, args.max_pixels, device)
        why = (f"no tokenizer in {src}" if not has_tokenizer(src) else
               f"{os.path.join(args.target, hf.CONFIG)} has no traj_token_ids (not an Alpamayo-R1 config)")
        how = f"placeholder text ids around real pixels ({why})"
    prompt = {k: v.to(device, dtype) if k == "pixel_values" else v.to(device) for k, v in prompt.items()}
    return target, draft, prompt, stop, tok, how


@torch.inference_mode()
def trajectory(target, prompt, coc, future_start, repeats):
    """The expert's waypoints (1, N, 2) after prompt + CoC + <|traj_future_start|> (appended when the
    CoC did not end with it), and the median time (s) of the expert alone over `repeats` runs."""
    exp = target.expert
    seq = coc + ([] if coc[-1:] == [future_start] else [future_start])
    cache = target.new_cache(max_len=prompt["input_ids"].shape[1] + len(seq) + exp.cfg.n_waypoints)
    embeds, deepstack = speculate.embed_prompt(target, prompt)  # (1, L, D)
    grids = {k: prompt[k] for k in speculate.GRID_KEYS if prompt.get(k) is not None}
    target(prompt["input_ids"], inputs_embeds=embeds, deepstack=deepstack, cache=cache, logits_to_keep=1, **grids)
    target(torch.tensor([seq], device=cache.k.device), cache=cache, logits_to_keep=1)  # the CoC, teacher-forced
    v0 = speed_from_history(history_poses()[None]).to(cache.k.device)  # (1,)
    g = torch.Generator(device=cache.k.device)
    run = lambda: exp(cache, v0, generator=g.manual_seed(0))  # noqa: E731
    return run(), timing.median_time(run, cache.k.device, repeats)


def plan(target, draft, prompt, stop, tok, how, args, decoding):
    """After the timed reasoning step: the CoC once more (marked), and with an action expert the trajectory, timed."""
    spec = evaluate.decode(target, draft, prompt, args.decoder, args.max_new, stop,
                           **evaluate.sampling_kwargs(decoding, 0))
    words = [tok.decode([t]) if tok is not None else str(t) for t in spec.tokens]
    res = {"prompt_source": how, "images": int(prompt["image_grid_thw"].shape[0]),
           "visual_tokens": int((prompt["input_ids"] == target.cfg.image_token_id).sum()),
           "coc_tokens": spec.tokens, "coc": evaluate.marked_coc(words, spec.from_draft)}
    if getattr(target, "expert", None) is not None:
        waypoints, t = trajectory(target, prompt, spec.tokens, stop, args.repeats)
        res.update(trajectory_ms=1e3 * t, waypoints=waypoints[0].float().tolist())
    return res


def report_lines(res):
    n, w = len(res["coc_tokens"]), res.get("waypoints")
    at = lambda i: f"({w[min(i, len(w) - 1)][0]:.1f}, {w[min(i, len(w) - 1)][1]:.1f})"  # noqa: E731
    return [f"prompt         {res['prompt_tokens']} tokens, {res['images']} images, {res['visual_tokens']} visual "
            f"tokens: {res['prompt_source']}",
            f"plan timings   prefill (vision tower + prompt) {res['ar_prefill_ms']:.2f} ms   reasoning step ({n} "
            f"tokens) target-only {n * res['ar_ms_per_token']:.2f} ms, speculative {n * res['spec_ms_per_token']:.2f} "
            "ms   trajectory (action expert) " + (f"{res['trajectory_ms']:.2f} ms" if w else "none: no action expert"),
            f"CoC (routine, [deliberative]): {res['coc']}"] + ([] if not w else [
            f"trajectory     {len(w)} waypoints (x, y) m, 10 Hz: 1 s {at(9)}, 3 s {at(29)}, last {at(-1)}"])


def add_flags(ap):
    ap.add_argument("--images-dir", default=None, help="with --target: a folder of camera images (name order)")
    ap.add_argument("--image-size", default="288x512", help="with --target: HxW of the generated images")
    ap.add_argument("--processor", help="with --target: tokenizer + image processor folder (default: --target)")
    ap.add_argument("--min-pixels", type=int, default=MIN_PIXELS, help="with --target: image size bounds")
    ap.add_argument("--max-pixels", type=int, default=MAX_PIXELS, help="with --target: image size bounds")


def check_flags(ap, args):
    """Parse-time checks of the pixels' geometry and of what reading them needs: each bad value is one line."""
    size = re.fullmatch(r"(\d+)x(\d+)", args.image_size)
    if not size or not all(1 <= int(n) <= 8192 for n in size.groups()):  # 8192: a camera frame, not all of memory
        ap.error(f"--image-size must be HxW in pixels, each in 1..8192 (e.g. 288x512), got {args.image_size!r}")
    if not 1 <= args.min_pixels <= args.max_pixels:
        ap.error(f"--min-pixels and --max-pixels must satisfy 1 <= min <= max, got {args.min_pixels} and "
                 f"{args.max_pixels}")
    for flag in ("images_dir", "processor"):
        if getattr(args, flag) and not args.target:
            ap.error(f"--{flag.replace('_', '-')} goes with --target")
    if args.images_dir and importlib.util.find_spec("PIL") is None:
        ap.error("--images-dir needs Pillow to read the images: pip install pillow")
    src = args.processor or args.target
    if src and importlib.util.find_spec("transformers") is None and has_tokenizer(src):
        ap.error(f"{src} has a tokenizer, which needs transformers: pip install -r requirements-test.txt")
