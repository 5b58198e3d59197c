"""Alpamayo-R1's prompt, built from a folder's own tokenizer and image processor.

Paper: Alpamayo-R1 is the deliberative reasoner (target) that RSD accelerates; this is the prompt its
reasoning step continues (bench.py --target times that step on it).

Layout (NVIDIA's public Alpamayo-R1 inference code; docs/background.md, "The Alpamayo-R1 prompt
layout"): a system turn; a user turn of 16 images (4 cameras x 4 frames, each
<|vision_start|> <|image_pad|> x n <|vision_end|>), then <|traj_history_start|>, 48 history ids,
<|traj_history_end|> and the instruction; the assistant turn opened with <|cot_start|>, which
the model continues with the chain of causation, <|cot_end|> and <|traj_future_start|>.

The text goes through the tokenizer's chat template and the images through the Qwen-VL image
processor, both loaded with transformers (an optional extra, imported only in build_prompt). They
are loaded one by one rather than through AutoProcessor: Qwen3-VL's processor also builds a video
processor, which needs torchvision, and this prompt has no video; Alpamayo's own preprocessing
likewise calls the image processor and expands each <|image_pad|> to its grid's token count.

History tokens: `HistoryTokenizer`, a delta tokenizer of the 16 past poses (10 Hz, ego frame at
the current pose): per-step (x, y, z) deltas, each binned uniformly over [xyz_min, xyz_max] into
num_bins bins, bin b of every axis being vocabulary id first_id + b, 3 ids per pose.

Config fields read from the Alpamayo config.json (a missing required one is an error naming it):
traj_token_start_idx, traj_tokenizer_cfg.num_bins (the history bins follow the future trajectory's
in the vocabulary), traj_token_ids.history and traj_token_ids.future_start (checked against the
tokenizer), hist_traj_tokenizer_cfg (optional inside: num_bins 1000, ego_xyz_min (-4, -4, -10),
ego_xyz_max (4, 4, 10), predict_yaw false: the upstream tokenizer's defaults).

run: python -m pytest -q tests/test_alpamayo.py       (used by: python bench.py --target ALPAMAYO_DIR)
"""
import os
from dataclasses import dataclass

import torch

from expert import config_field
from hf import CONFIG
from files import read_json

SYSTEM = "You are a driving assistant that generates safe and accurate actions."
INSTRUCTION = "output the chain-of-thought reasoning of the driving process, then output the future trajectory."
N_POSES = 16  # past poses at 10 Hz, the last one is now: 3 history ids each
MIN_PIXELS, MAX_PIXELS = 163840, 196608  # Alpamayo's image size bounds: 160-192 merged tokens per image
TOKENS = ("<|traj_history_start|>", "<|traj_history|>", "<|traj_history_end|>", "<|cot_start|>", "<|cot_end|>",
          "<|traj_future_start|>")  # Alpamayo's added tokens the prompt and the plan need


# ---- history tokens ----


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
        first = config_field(raw, "traj_token_start_idx", where) + config_field(raw, "traj_tokenizer_cfg.num_bins",
                                                                                  where)
        return cls(first_id=int(first), num_bins=int(hist.get("num_bins", cls.num_bins)),
                   xyz_min=tuple(hist.get("ego_xyz_min", cls.xyz_min)),
                   xyz_max=tuple(hist.get("ego_xyz_max", cls.xyz_max)))

    def encode(self, xyz):
        """Past poses xyz (B, 16, 3) -> vocabulary ids (B, 48) in (pose, axis) order. The first delta
        is the oldest pose itself (from the origin), as upstream; it saturates for histories > 4 m."""
        lo, hi = torch.tensor(self.xyz_min), torch.tensor(self.xyz_max)
        deltas = torch.diff(xyz.float(), dim=1, prepend=torch.zeros_like(xyz[:, :1]).float())  # (B, 16, 3)
        bins = ((deltas - lo) / (hi - lo) * (self.num_bins - 1)).round().long().clamp(0, self.num_bins - 1)
        return bins.flatten(1) + self.first_id  # (B, 16, 3) -> (B, 48)


# ---- the prompt ----


def build_prompt(folder, images, history_xyz, processor_dir=None, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
    """Alpamayo-R1's prompt for one scene -> {input_ids (1, L), pixel_values (N, C*tp*p*p),
    image_grid_thw (n_images, 3)}, the model's forward / speculate inputs.

    folder: the Alpamayo checkpoint (config.json); processor_dir: where the tokenizer (with
    Alpamayo's added tokens) and image processor are, default folder. images: (n_images, 3, H, W)
    uint8, cameras then frames as the model was trained; history_xyz: (16, 3) past poses."""
    from transformers import AutoImageProcessor, AutoTokenizer  # optional extra: only this function needs it

    where = os.path.join(folder, CONFIG)
    raw = read_json(where)
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
    slots = ids == vocab["<|traj_history|>"]
    ids[slots] = hist.encode(torch.as_tensor(history_xyz)[None]).flatten()  # placeholders -> history ids
    return {"input_ids": ids, "pixel_values": vis["pixel_values"], "image_grid_thw": vis["image_grid_thw"]}
