"""Scenes a user has, and the target's own chains of causation on them: the data a routine reasoner for a real
target is distilled from. Paper: the routine reasoner (draft q) is distilled from the deliberative reasoner (target
p); a real target has no ground-truth CoCs, so it writes its own (self-distillation, as EAGLE regenerates its data
with the target), and the draft learns the distribution it is verified against, <|cot_end|> included.

The scene folder, one folder per scene, named by its id (write_scene writes one, load_scenes checks them all):
    SCENES/<id>/cameras/        PNG or JPEG images (any size, read with PIL) whose sorted names are Alpamayo-R1's
                                order: 4 cameras x 4 frames, cameras then frames (write_scene: 00.png ... 15.png)
    SCENES/<id>/poses.json      {"past": 16 x [x, y, z], "future": 64 x [x, y, z]}: ego poses in metres, 10 Hz, in
                                the ego frame at the current pose (the last past one); "future" (optional) is what
                                the action reward and ADE score against
    SCENES/<id>/instruction.txt optional: a plain Qwen-VL prompt's instruction (such a folder, any image count and
                                no poses: load_scenes(root, n_images=None, poses=False))

The distillation data (distill_data writes it, read_distill_data reads it):
    OUT/index.json          the settings (temperature, top_k, top_p, samples, max_new, stop_ids, seed, the target's
                            fingerprint) and each shard's records (scene, sample, n ids, complete); rewritten
                            atomically after each shard, so a killed run loses at most the shard it was writing
    OUT/shard_00000.bin     the shard's token ids, uint32 little-endian, its records' ids one after another
Only token ids are stored, the CoC through stop_ids (<|cot_end|> <|traj_future_start|> for Alpamayo; <cot_end> for
the toy): the teacher's distributions are recomputed in training (one teacher-forced target forward per batch), cheaper
than reading V = 152k floats per id from disk. index.json sums the decodes' measured prefill_s and decode_s: their sum
/ records is the seconds per record on the user's machine (docs/own-target.md sizes disk and time).

run: python -m pytest -q tests/test_scenes.py
"""
from dataclasses import dataclass, replace
import hashlib
import json
import math
import os
import pathlib
import re

import numpy as np
import torch

from ops import checkpoint, cli, files
from measure import flags
from real import hf
import speculate

N_IMAGES, N_PAST, N_FUTURE = 16, 16, 64  # Alpamayo-R1: 4 cameras x 4 frames; 1.6 s of past, 6.4 s of future at 10 Hz
POSES, INSTRUCTION, INDEX = "poses.json", "instruction.txt", "index.json"
SHARD_SCENES = 64  # scenes per shard: what a killed run can lose
MAX_ASPECT = 200  # the Qwen-VL image processors' smart_resize refuses a longer side over 200 x the shorter
# poses are metres at 10 Hz in the ego frame of the last past pose: a world frame (UTM: kilometres away) or other units
# (centimetres: hundreds per step) fail these wide bounds, a real drive never does
ORIGIN_M, STEP_M = 5.0, 10.0  # the last past pose within 5 m of (0, 0); at most 10 m per 0.1 s step (360 km/h)
# the ego frame's heading is +x: the last 0.3 s of a car moving over 0.5 m in them (6 km/h) point within 30 degrees
# of it (a chord over 0.3 s turns half their yaw away from the heading: 9 degrees at a sharp 60 degrees/s); poses
# translated to the current pose but not rotated point anywhere, reversed ones to -x
HEADING_STEPS, MOVING_M, HEADING_DEG = 3, 0.5, 30.0
OWN_IMAGE = re.compile(r"\d{2,}\.png")  # write_scene's image names: the only images it ever removes


# ---- the scene folder ----
@dataclass
class Scene:
    scene_id: str
    image_paths: list  # the camera images in the model's order
    past: torch.Tensor | None  # (16, 3) x / y / z in metres, float32
    future: torch.Tensor | None  # (64, 3), or None
    instruction: str | None  # instruction.txt, or None
    time_s: float | None = None  # poses.json "time_s": the frame's time in seconds, for a clip's frames (stream)

    def images(self):
        """[(3, H, W) uint8] in the model's order, read now: a folder of scenes never sits in memory."""
        from PIL import Image  # optional extra: only reading and writing images needs it
        out = []
        for p in self.image_paths:
            try:
                with Image.open(p) as im:
                    out.append(torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1))  # (H, W, 3) -> (3, H, W)
            except OSError as e:
                raise ValueError(f"scene {self.scene_id}: {p} unreadable ({e})") from None
        return out


def _poses(raw, key, rows, problems):
    """raw[key] as a (rows, 3) float32 tensor, or None with its defect appended to problems."""
    try:
        xyz = torch.tensor(raw[key], dtype=torch.float32)
        bad = f"has shape {tuple(xyz.shape)}, expected ({rows}, 3)" if tuple(xyz.shape) != (rows, 3) else None
        bad = bad or (None if bool(torch.isfinite(xyz).all()) else "holds non-finite values")
    except (TypeError, ValueError):
        bad = "is not a list of [x, y, z] rows"
    problems += [f"{POSES} '{key}' {bad}"] if bad else []
    return None if bad else xyz


def _frame_and_units(past, future):
    """What says the poses are not metres at 10 Hz in the current pose's ego frame (docs/own-target.md): [problems]."""
    out, (x, y) = [], past[-1, :2].tolist()
    if (x * x + y * y) ** 0.5 > ORIGIN_M:
        out.append(f"{POSES} 'past' ends at (x, y) = ({x:.1f}, {y:.1f}) m, not at the origin: poses are in the ego "
                   "frame of the current (last past) pose")
    dx, dy = (past[-1, :2] - past[-1 - HEADING_STEPS, :2]).tolist()  # the last 0.3 s of motion
    angle = math.degrees(math.atan2(dy, dx))
    if math.hypot(dx, dy) >= MOVING_M and abs(angle) > HEADING_DEG:
        out.append(f"{POSES} 'past' moves at {angle:.0f} degrees from +x in its last 0.3 s" + (
            ": backwards; the ego frame's +x is the car's heading" if abs(angle) > 180 - HEADING_DEG else
            ": the ego frame's +x is the car's heading (translated to the current pose but not rotated into it?)"))
    xy = torch.cat([past, future if future is not None else past[:0]])[:, :2]  # (T, 2)
    step = float(xy.diff(dim=0).norm(dim=-1).max()) if len(xy) > 1 else 0.0
    if step > STEP_M:
        out.append(f"{POSES} moves {step:.1f} m in one 0.1 s step (more than {STEP_M:g} m): poses are metres at 10 Hz")
    return out


def _check_image(p):
    """None, or what is wrong with the image file p: unreadable, not decodable (verify checks PNG's checksums, load
    decodes: a truncated JPEG), or of an aspect ratio the target's image processor refuses."""
    from PIL import Image  # optional extra
    try:
        with Image.open(p) as im:
            im.verify()
        with Image.open(p) as im:
            im.load()
            w, h = im.size
    except Exception as e:  # PIL raises several kinds (OSError, SyntaxError, struct.error) for a bad file
        return f"cameras/{os.path.basename(p)} unreadable ({type(e).__name__}: {e})"
    if max(w, h) > MAX_ASPECT * min(w, h):
        return f"cameras/{os.path.basename(p)} is {w}x{h}: an aspect ratio over {MAX_ASPECT}, which Qwen-VL's " \
               "image processor refuses"


def _check_scene(d, scene_id, n_images, poses):
    """(Scene or None, [problems]) of one scene folder. Every image is decoded once here, before any work: a bad one
    found by the data stage would stop it hours in."""
    problems, paths, cams = [], [], os.path.join(d, "cameras")
    if not os.path.isdir(cams):
        problems.append("no cameras/ folder")
    else:
        paths = [os.path.join(cams, n) for n in sorted(os.listdir(cams))
                 if not n.startswith(".") and n.lower().endswith(files.IMAGE_SUFFIXES)]
        if not paths or (n_images is not None and len(paths) != n_images):
            problems.append(f"cameras/ holds {len(paths)} PNG / JPEG images, expected {n_images or 'at least 1'}")
        problems += [f"cameras/{os.path.basename(p)} is not a regular file" for p in paths if not os.path.isfile(p)]
        problems += [bad for bad in map(_check_image, filter(os.path.isfile, paths)) if bad]  # a FIFO would hang
    past = future = text = time_s = None
    # every file of a scene, used by this prompt or not, opened only if regular: a FIFO would wait for a writer forever
    pose_file, text_file = os.path.join(d, POSES), os.path.join(d, INSTRUCTION)
    problems += [f"{os.path.basename(p)} is not a regular file" for p in (pose_file, text_file)
                 if os.path.lexists(p) and not os.path.isfile(p)]
    if os.path.isfile(pose_file):
        try:
            raw = json.loads(pathlib.Path(pose_file).read_text())
            past = _poses(raw, "past", N_PAST, problems)
            future = _poses(raw, "future", N_FUTURE, problems) if raw.get("future") is not None else None
            time_s = raw.get("time_s")
            if time_s is not None and (isinstance(time_s, bool) or not isinstance(time_s, (int, float))
                                       or not math.isfinite(time_s)):
                problems.append(f"{POSES} 'time_s' must be a finite number of seconds, got {time_s!r}")
        except (OSError, ValueError, KeyError, AttributeError) as e:  # unreadable, not JSON, no "past", not a dict
            problems.append(f"{POSES} unreadable ({type(e).__name__}: {e})")
        if past is not None:
            problems += _frame_and_units(past, future)
    elif poses and not os.path.lexists(pose_file):
        problems.append(f"no {POSES}")
    try:  # not UTF-8 is a problem only where the prompt is made of it: an Alpamayo prompt (poses) reads no instruction
        text = pathlib.Path(text_file).read_bytes().decode("utf-8").strip() if os.path.isfile(text_file) else None
    except (OSError, UnicodeDecodeError) as e:
        problems += [] if poses else [f"{INSTRUCTION} unreadable as UTF-8 text ({e})"]
    return (None if problems else Scene(scene_id, paths, past, future, text, time_s)), problems


def load_scenes(root, n_images=N_IMAGES, poses=True):
    """Every scene of root (sorted by id), each checked before any work: one ValueError names each bad scene with
    every defect found. n_images: the camera count every scene must have (None: any); poses: poses.json required."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such scene folder")
    ids = sorted(n for n in os.listdir(root) if not n.startswith(".") and os.path.isdir(os.path.join(root, n)))
    if not ids:
        raise ValueError(f"{root} holds no scene folders (SCENES/<scene_id>/cameras, poses.json)")
    checked = [_check_scene(os.path.join(root, i), i, n_images, poses) for i in ids]  # [(Scene or None, problems)]
    if bad := [f"  {i}: {p}" for i, (_, problems) in zip(ids, checked) for p in problems]:
        n_bad = sum(scene is None for scene, _ in checked)
        raise ValueError(f"{root}: {n_bad} of {len(ids)} scenes are bad:\n" + "\n".join(bad))
    return [scene for scene, _ in checked]


def write_scene(root, scene_id, images, past, future=None, instruction=None, overwrite=False, time_s=None):
    """Write one scene folder: images uint8 (N, 3, H, W) in the model's order, past (16, 3), future (64, 3) or None
    (time_s: a clip frame's time in seconds, or None);
    each file atomically (files.atomic_write). An existing scene is refused unless overwrite; a rewrite then removes
    only the files of write_scene's naming it no longer has (NN.png, instruction.txt), never a user's own images."""
    from PIL import Image  # optional extra
    # a scene id is one path component that load_scenes lists: no separator, not '.', '..' or hidden
    if not isinstance(scene_id, str) or not scene_id or scene_id.startswith(".") \
            or os.path.basename(scene_id) != scene_id:
        raise ValueError(f"scene id {scene_id!r}: a scene id is one folder name (no '/', not empty, not starting "
                         "with '.')")
    d, cams = os.path.join(root, scene_id), os.path.join(root, scene_id, "cameras")
    if os.path.lexists(d) and not overwrite:
        raise FileExistsError(f"{d}: scene {scene_id} exists: refusing to replace it (overwrite=True replaces the "
                              "files write_scene names, and only those)")
    os.makedirs(cams, exist_ok=True)
    names = [f"{i:02d}.png" for i in range(len(images))]
    for img, n in zip(torch.as_tensor(images), names):
        png = Image.fromarray(img.permute(1, 2, 0).contiguous().numpy())  # (3, H, W) -> (H, W, 3)
        files.atomic_write(os.path.join(cams, n), lambda p: png.save(p, format="PNG"))
    for n in set(os.listdir(cams)) - set(names):
        if OWN_IMAGE.fullmatch(n):
            os.remove(os.path.join(cams, n))
    raw = {k: torch.as_tensor(v).tolist() for k, v in (("past", past), ("future", future)) if v is not None}
    raw |= {} if time_s is None else {"time_s": float(time_s)}
    files.write_json(os.path.join(d, POSES), raw)
    path = os.path.join(d, INSTRUCTION)
    if instruction is not None:
        files.atomic_write(path, lambda p: pathlib.Path(p).write_text(instruction, encoding="utf-8"))
    elif os.path.exists(path):
        os.remove(path)
    return d


JITTER = 0.25  # a clip's step may differ from its interval by this fraction (a camera clock's jitter), not more


def clip_interval(found, frames):
    """The first `frames` scenes of a folder (name order) as one clip's consecutive frames (plans in a stream,
    beyond/stream.py) -> the replanning interval in seconds. A ValueError names the first thing that makes them no
    clip: fewer scenes, a frame without its time_s, frames out of order, a gap (a frame missing between two)."""
    if frames > len(found):
        raise ValueError(f"--stream {frames}: the scene folder holds {len(found)} scenes")
    clip = found[:frames]
    if untimed := [s.scene_id for s in clip if s.time_s is None]:
        raise ValueError(f"scene {untimed[0]}: {POSES} has no 'time_s': a clip's frames need their times (seconds)")
    for a, b in zip(clip, clip[1:]):
        if b.time_s == a.time_s:
            raise ValueError(f"scenes {a.scene_id} and {b.scene_id} have the same time_s {a.time_s:g}: one frame "
                             "twice")
        if b.time_s < a.time_s:
            raise ValueError(f"scene {b.scene_id} (time_s {b.time_s:g}) follows {a.scene_id} ({a.time_s:g}) in name "
                             "order but not in time: a clip's frames are its scene folders in name order")
    # the interval: the median step, so that one gap (or a first step that is one) is blamed on its own pair; a
    # camera's clock jitters, so a step within JITTER of it is the interval
    gaps = [b.time_s - a.time_s for a, b in zip(clip, clip[1:])]
    dt = sorted(gaps)[len(gaps) // 2]
    for a, b, gap in zip(clip, clip[1:], gaps):
        if gap > (1 + JITTER) * dt:
            raise ValueError(f"scene {b.scene_id} is {gap:g} s after {a.scene_id}, the clip replans every {dt:g} s: "
                             f"a gap (about {round(gap / dt) - 1} frame(s) missing) between them")
        if gap < (1 - JITTER) * dt:
            raise ValueError(f"scene {b.scene_id} is {gap:g} s after {a.scene_id}, the clip replans every {dt:g} s: "
                             "frames closer than the clip's interval")
    return dt


def scene_prompts(folder, root, processor=None, **pixels):  # pixels: min_pixels, max_pixels
    """(scenes, [(scene_id, a function building its prompt)], stop_ids (alpamayo.reasoning_stop_ids), how) for the
    target `folder`'s scenes in root, each prompt built when asked (a resumed run builds none it has) by the folder's
    (or `processor`'s) tokenizer and image processor: alpamayo.build_prompt on 16 images and the past poses for
    Alpamayo-R1 (traj_token_ids in its config), else alpamayo.qwen_prompt on any images and instruction.txt."""
    from real import alpamayo  # needs transformers (optional extra)
    where, src = os.path.join(folder, "config.json"), processor or folder
    if not alpamayo.has_tokenizer(src):
        raise ValueError(f"{src} has no tokenizer: a scene's prompt is built with the target's tokenizer and image "
                         "processor (give the folder that has them)")
    raw = files.read_json(where)
    stop = alpamayo.reasoning_stop_ids(raw, alpamayo.tokenizer(src), where)
    if "traj_token_ids" in raw:
        found = load_scenes(root)
        return found, [(s.scene_id, lambda s=s: alpamayo.build_prompt(folder, s.images(), s.past, processor, **pixels))
                       for s in found], stop, "Alpamayo-R1 prompt (alpamayo.build_prompt)"
    found = load_scenes(root, n_images=None, poses=False)
    if missing := [s.scene_id for s in found if not s.instruction]:
        raise ValueError(f"{root}: scenes {missing} have no {INSTRUCTION}, which a plain Qwen-VL prompt is made of")
    return found, [(s.scene_id, lambda s=s: alpamayo.qwen_prompt(src, s.images(), s.instruction, **pixels))
                   for s in found], stop, "plain Qwen-VL prompt (alpamayo.qwen_prompt)"


def built(scene_id, prompt):
    """prompt, or prompt() for a builder (scene_prompts'), its error naming the scene (the processor's names none)."""
    try:
        return prompt() if callable(prompt) else prompt
    except (ValueError, OSError) as e:
        raise (OSError if isinstance(e, OSError) else ValueError)(f"scene {scene_id}: {e}") from None


# ---- self-distillation data ----
def sample_seed(seed, scene_id, k):
    """Sample k's generator seed: (seed, scene, k) alone, so that a resumed or reordered run draws the same records."""
    return int(hashlib.sha256(f"{seed}/{scene_id}/{k}".encode()).hexdigest()[:15], 16)  # < 2**60


def distill_data(target, prompts, out, stop_ids, max_new, sampling=speculate.GREEDY, samples=1, seed=0,
                 shard_scenes=SHARD_SCENES, log=None):
    """The target's own CoCs -> OUT (module docstring), resumably: scenes already in OUT are skipped; a rerun with
    another setting is refused, naming it. prompts: (scene_id, prompt) pairs, a prompt being speculate's batch-1 dict
    or a function returning it (scene_prompts; driving.build_prompt for the toy); stop_ids: the ids that end the
    reasoning, in order: decoding stops at the last one and keeps them all; a record is complete when its CoC ends
    with them. sampling: GREEDY, or `samples` draws per scene (Alpamayo-R1's release: temperature 0.6, top-p 0.98),
    sample k seeded sample_seed(seed, scene, k), not sampling.seed, as one batch sharing the scene's prefill
    (speculate.autoregressive_batch; each row its own generator's draws: the batch-1 records). Returns the index."""
    flags.sampling(sampling.temperature, sampling.top_k, sampling.top_p, seed)  # the settings checked before any work
    stop_ids = [int(t) for t in stop_ids]
    for bad, why in [(not isinstance(max_new, int) or max_new < 1, f"max_new must be an int >= 1, got {max_new!r}"),
                     (not isinstance(samples, int) or samples < 1 or (sampling.greedy and samples > 1),
                      f"samples must be an int >= 1, and 1 when greedy (greedy samples are equal), got {samples!r}"),
                     (sampling.relaxed is not None, "a relaxed rule verifies drafts: the target decodes alone here"),
                     (not stop_ids, "stop_ids is empty: give the ids that end the reasoning")]:
        if bad:
            raise ValueError(why)
    settings = {"temperature": float(sampling.temperature), "top_k": sampling.top_k, "top_p": sampling.top_p,
                "samples": samples, "max_new": max_new, "stop_ids": stop_ids, "seed": seed,
                "target": checkpoint.fingerprint(target)}
    path = os.path.join(out, INDEX)
    with files.writer_lock(out):
        index = {"settings": settings, "shards": [], "prefill_s": 0.0, "decode_s": 0.0}
        if os.path.exists(path):
            index = files.read_json(path)
            for k, v in settings.items():
                if index["settings"].get(k) != v:
                    raise ValueError(f"{out} holds data written with {k} = {index['settings'].get(k)!r}, this run "
                                     f"asks {v!r}: resuming would mix the two; write to another folder")
        done = {r["scene"] for s in index["shards"] for r in s["records"]}
        records, ids, n_scenes = [], [], 0

        def flush():
            name = f"shard_{len(index['shards']):05d}.bin"  # a shard a killed run left unindexed is overwritten
            files.atomic_write(os.path.join(out, name), np.asarray(ids, dtype="<u4").tofile)
            index["shards"].append({"file": name, "records": list(records)})
            files.write_json(path, index)
            if log:
                log(f"{out}/{name}: {len(records)} records, {len(ids)} ids ({n_scenes} scenes decoded this run)")
            del records[:], ids[:]

        try:
            for scene_id, prompt in prompts:
                if scene_id in done:
                    continue
                done.add(scene_id)
                cli.progress(f"{out}: decoding scene {scene_id} ({n_scenes} decoded this run)", 30)
                prompt = hf.on_model(built(scene_id, prompt), target)  # pixels in the target's dtype
                rows = speculate.autoregressive_batch(target, prompt, max_new, samples, replace(
                    sampling, seed=[sample_seed(seed, scene_id, k) for k in range(samples)]), stop_ids[-1], timing=True)
                index["prefill_s"] += rows[0].prefill_s  # one prefill for the scene's samples
                index["decode_s"] += max(r.decode_s for r in rows)  # until its last sample is done
                for k, res in enumerate(rows):
                    ids.extend(res.tokens)
                    records.append({"scene": scene_id, "sample": k, "n": len(res.tokens),
                                    "complete": res.tokens[-len(stop_ids):] == stop_ids})
                n_scenes += 1
                if n_scenes % shard_scenes == 0:
                    flush()
        except Exception:  # an error (a bad scene, a full disk) stops the run: what it decoded is kept
            if records:
                flush()
            raise
        if records:
            flush()
    return index


def read_distill_data(out, vocab_size=None):
    """[{scene, sample, n, complete, tokens}] of OUT in the order written; a shard whose size disagrees with its index
    entry, or holding an id outside vocab_size (the target's), is an error naming it."""
    index = files.read_json(path := os.path.join(out, INDEX))
    recs = []
    try:
        shards = [(s["file"], [dict(r, n=int(r["n"])) for r in s["records"]]) for s in index["shards"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not an index scenes.distill_data wrote ({type(e).__name__}: {e})") from None
    for file, records in shards:
        p = os.path.join(out, file)
        if os.path.lexists(p):
            files.check_regular(p)  # a FIFO would wait for a writer forever
        ids = np.fromfile(p, dtype="<u4") if os.path.isfile(p) else None
        if ids is None or len(ids) != sum(r["n"] for r in records):
            raise ValueError(f"{p}: {'missing' if ids is None else f'{len(ids)} ids'}, its index entry expects "
                             f"{sum(r['n'] for r in records)}: the folder is damaged")
        if vocab_size and len(ids) and int(ids.max()) >= vocab_size:
            raise ValueError(f"{p}: holds id {int(ids.max())}, outside the target's {vocab_size} ids: the data of "
                             "another target, or damaged; delete it to decode it again")
        offsets = np.cumsum([0] + [r["n"] for r in records])
        recs += [dict(r, tokens=ids[a:b].tolist()) for r, a, b in zip(records, offsets[:-1], offsets[1:])]
    return recs
