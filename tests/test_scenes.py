"""Tests for scenes.py: every kind of bad scene named before any work, a scene folder's round trip, and the
self-distillation data: greedy records equal to speculate.autoregressive and to the target's teacher-forced argmax,
a killed run resumed without duplicates, a changed setting refused by name, sampled records reproducible from the
seed whatever the order, and the two prompt sources (the toy's driving.build_prompt, a tiny Alpamayo folder's
alpamayo.build_prompt on a scene folder).

run: python -m pytest -q tests/test_scenes.py
"""
import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

import driving
import model as M
from real import scenes
import speculate
from tiny_models import image_prompt, tiny_model

try:  # the tiny Alpamayo-shaped folder of tests/test_alpamayo.py, a fixture
    from test_alpamayo import SPECIAL, folder
except (ImportError, pytest.skip.Exception):  # no transformers: that test module skips itself
    SPECIAL = folder = None

pytestmark = pytest.mark.usefixtures("one_thread")
STOP = [29, 48]  # two ids the tiny target writes in a row in 3 of the 4 prompts (within 12 tokens), never in one
MAX_NEW = 12


def pixels(n=16, h=6, w=8, seed=0):
    return torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def poses(rows, seed=0):
    """A drive in the ego frame at the current pose: 16 past poses along +x ending at the origin at 8 m/s (or 64
    future ones ahead), with 0.1 m of noise."""
    t = torch.arange(-15, 1.0) if rows == 16 else torch.arange(1, rows + 1.0)  # (rows,) steps, 0 = now
    return torch.stack([0.8 * t, 0 * t, 0 * t], -1) + 0.1 * torch.randn(rows, 3, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def target():
    return tiny_model()


def prompts(n=4):
    # prompts whose 12 greedy ids hold no image / video placeholder id, which a cache-free forward cannot take as text
    return [(f"s{i}", image_prompt(seed=s, text_after=(7, 8, 9 + s))) for i, s in enumerate([0, 1, 4, 5][:n])]


# ---- the scene folder ----


def test_round_trip_write_then_load(tmp_path):
    imgs, past, future = pixels(), poses(16), poses(64, seed=1)
    scenes.write_scene(tmp_path, "b", imgs, past, future)
    scenes.write_scene(tmp_path, "a", pixels(seed=2), past)
    a, b = scenes.load_scenes(tmp_path)
    assert (a.scene_id, b.scene_id) == ("a", "b") and a.future is None and a.instruction is None
    assert torch.equal(torch.stack(b.images()), imgs)  # (16, 3, 6, 8), PNG: lossless
    assert torch.equal(b.past, past) and torch.equal(b.future, future)
    # a rewrite with fewer images and no future leaves nothing of the old scene
    scenes.write_scene(tmp_path, "b", imgs[:4], past, instruction="keep lane", overwrite=True)
    (b,) = scenes.load_scenes(tmp_path, n_images=None)[1:]
    assert len(b.images()) == 4 and b.future is None and b.instruction == "keep lane"
    # a plain Qwen-VL folder: images and an instruction, no poses
    os.remove(tmp_path / "b" / "poses.json")
    assert scenes.load_scenes(tmp_path, n_images=None, poses=False)[1].past is None


def test_every_bad_scene_is_named_with_its_defects(tmp_path):
    good = dict(images=pixels(), past=poses(16), future=poses(64))
    for name in ["good", "missing", "unreadable", "no_poses", "short_past", "nan_future", "long_future", "bad_json",
                 "world_frame", "centimetres"]:
        scenes.write_scene(tmp_path, name, **good)
    scenes.write_scene(tmp_path, "world_frame", pixels(), poses(16) + torch.tensor([4e5, 5.4e6, 0.0]), overwrite=True)
    scenes.write_scene(tmp_path, "centimetres", pixels(), poses(16), 100 * poses(64), overwrite=True)
    for name in ("fifo_poses", "fifo_image", "fifo_instruction", "dir_instruction"):  # a FIFO would hang a reader
        scenes.write_scene(tmp_path, name, **good)
    os.mkfifo(tmp_path / "fifo_instruction" / "instruction.txt")  # an Alpamayo prompt does not read it: named anyway
    os.mkdir(tmp_path / "dir_instruction" / "instruction.txt")
    heading = math.radians(70)  # a world heading of 70 degrees: poses translated to the current pose, not rotated
    turned = poses(16) @ torch.tensor([[math.cos(heading), math.sin(heading), 0], [-math.sin(heading),
                                                                                     math.cos(heading), 0], [0, 0, 1.0]])
    for name, past in (("not_rotated", turned), ("backwards", poses(16) * torch.tensor([-1.0, 1, 1]))):
        scenes.write_scene(tmp_path, name, pixels(), past, overwrite=True)
    os.remove(tmp_path / "fifo_poses" / "poses.json")
    os.mkfifo(tmp_path / "fifo_poses" / "poses.json")
    os.remove(tmp_path / "fifo_image" / "cameras" / "05.png")
    os.mkfifo(tmp_path / "fifo_image" / "cameras" / "05.png")
    os.remove(tmp_path / "missing" / "cameras" / "07.png")
    (tmp_path / "unreadable" / "cameras" / "03.png").write_bytes(b"not a png")
    os.remove(tmp_path / "no_poses" / "poses.json")
    scenes.write_scene(tmp_path, "short_past", pixels(), poses(15), overwrite=True)
    scenes.write_scene(tmp_path, "nan_future", pixels(), poses(16), torch.full((64, 3), float("nan")), overwrite=True)
    scenes.write_scene(tmp_path, "long_future", pixels(), poses(16), poses(65), overwrite=True)
    (tmp_path / "bad_json" / "poses.json").write_text("{past: ")
    os.makedirs(tmp_path / "no_cameras")
    with pytest.raises(ValueError) as e:
        scenes.load_scenes(tmp_path)
    msg = str(e.value)
    assert "16 of 17 scenes are bad" in msg and "good:" not in msg
    for line in ["missing: cameras/ holds 15 PNG / JPEG images, expected 16", "unreadable: cameras/03.png unreadable",
                 "no_poses: no poses.json", "short_past: poses.json 'past' has shape (15, 3), expected (16, 3)",
                 "nan_future: poses.json 'future' holds non-finite values",
                 "long_future: poses.json 'future' has shape (65, 3), expected (64, 3)",
                 "bad_json: poses.json unreadable", "no_cameras: no cameras/ folder", "no_cameras: no poses.json",
                 "world_frame: poses.json 'past' ends at (x, y) = (4000",
                 "centimetres: poses.json moves", "fifo_poses: poses.json is not a regular file",
                 "fifo_image: cameras/05.png is not a regular file",
                 "fifo_instruction: instruction.txt is not a regular file",
                 "dir_instruction: instruction.txt is not a regular file",
                 "not_rotated: poses.json 'past' moves at ",  # 70 degrees, give or take the noise
                 "backwards: poses.json 'past' moves at "]:
        assert "  " + line in msg, (line, msg)
    assert "degrees from +x in its last 0.3 s: the ego frame's +x is the car's heading (translated to the current " \
        "pose but not rotated into it?)" in msg.split("not_rotated: ")[1].splitlines()[0]
    assert "degrees from +x in its last 0.3 s: backwards" in msg.split("backwards: ")[1].splitlines()[0]


def test_write_scene_never_replaces_what_it_did_not_write(tmp_path):
    """A user's scene of 16 cam_a_*.jpg: refused, and with overwrite the user's images stay; an id is one folder name
    (issue #33: they were deleted, and `../../x` wrote outside the root)."""
    from PIL import Image
    cams = tmp_path / "root" / "user" / "cameras"
    cams.mkdir(parents=True)
    for i in range(16):
        Image.new("RGB", (8, 6)).save(cams / f"cam_a_{i:02d}.jpg")
    with pytest.raises(FileExistsError, match="scene user exists: refusing to replace it"):
        scenes.write_scene(tmp_path / "root", "user", pixels(), poses(16))
    scenes.write_scene(tmp_path / "root", "user", pixels(n=2), poses(16), overwrite=True)
    assert sorted(os.listdir(cams)) == ["00.png", "01.png"] + [f"cam_a_{i:02d}.jpg" for i in range(16)]
    for bad in ["../../x", "a/b", "", ".hidden", ".."]:
        with pytest.raises(ValueError, match="a scene id is one folder name"):
            scenes.write_scene(tmp_path / "root", bad, pixels(), poses(16))
    assert sorted(os.listdir(tmp_path)) == ["root"] and os.listdir(tmp_path / "root") == ["user"]


def test_images_and_text_are_decoded_and_sized_before_any_work(tmp_path):
    """A truncated JPEG, an image of an aspect ratio the processor refuses, and (where the prompt reads it) a
    non-UTF-8 instruction.txt are named with their scene by load_scenes, not found mid data stage; an Alpamayo
    prompt reads no instruction: its bytes do not matter."""
    from PIL import Image
    for name in ["jpeg", "wide", "latin1"]:
        scenes.write_scene(tmp_path, name, pixels(n=2), poses(16), instruction="keep lane")
    Image.new("RGB", (64, 48), "red").save(tmp_path / "jpeg" / "cameras" / "01.png", format="JPEG")
    data = (tmp_path / "jpeg" / "cameras" / "01.png").read_bytes()
    (tmp_path / "jpeg" / "cameras" / "01.png").write_bytes(data[:len(data) // 2])
    Image.new("RGB", (402, 2)).save(tmp_path / "wide" / "cameras" / "00.png")
    (tmp_path / "latin1" / "instruction.txt").write_bytes(b"gar\xe7on \xff")
    with pytest.raises(ValueError) as e:
        scenes.load_scenes(tmp_path, n_images=None, poses=False)
    msg = str(e.value)
    assert "3 of 3 scenes are bad" in msg, msg
    for line in ["jpeg: cameras/01.png unreadable", "wide: cameras/00.png is 402x2: an aspect ratio over 200",
                 "latin1: instruction.txt unreadable as UTF-8 text"]:
        assert "  " + line in msg, (line, msg)
    os.remove(tmp_path / "wide" / "cameras" / "00.png")
    (tmp_path / "jpeg" / "cameras" / "01.png").write_bytes(data)
    assert [s.instruction for s in scenes.load_scenes(tmp_path, n_images=None)] == ["keep lane", None, "keep lane"]


# ---- self-distillation data ----


@torch.no_grad()
def test_greedy_records_are_the_targets_own_decoding(target, tmp_path):
    index = scenes.distill_data(target, prompts(), tmp_path, STOP, MAX_NEW)
    recs = scenes.read_distill_data(tmp_path)
    assert [(r["scene"], r["sample"]) for r in recs] == [(f"s{i}", 0) for i in range(4)]
    assert [r["complete"] for r in recs] == [True, False, True, True]
    for (sid, p), r in zip(prompts(), recs):
        assert r["tokens"] == speculate.autoregressive(target, p, MAX_NEW, stop_token=STOP[-1]).tokens
        # the slow, obvious path: each id is the argmax of one cache-free forward over prompt + the ids before it
        ids = torch.cat([p["input_ids"], torch.tensor([r["tokens"][:-1]])], 1)
        logits = target(**dict(p, input_ids=ids))[0, -len(r["tokens"]):]  # (T, V)
        assert logits.argmax(-1).tolist() == r["tokens"]
    assert recs[0]["tokens"][-2:] == STOP and len(recs[1]["tokens"]) == MAX_NEW
    assert index["decode_s"] > 0 and os.path.getsize(tmp_path / "shard_00000.bin") == 4 * sum(
        len(r["tokens"]) for r in recs)  # 4 bytes per id


def test_a_killed_run_resumes_without_duplicates(target, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    scenes.distill_data(target, prompts(), whole, STOP, MAX_NEW, shard_scenes=2)
    run, calls, real = tmp_path / "run", [], speculate.autoregressive_batch  # one call per scene

    def dies_at_the_4th(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(speculate, "autoregressive_batch", dies_at_the_4th)
    with pytest.raises(KeyboardInterrupt):
        scenes.distill_data(target, prompts(), run, STOP, MAX_NEW, shard_scenes=2)
    assert [r["scene"] for r in scenes.read_distill_data(run)] == ["s0", "s1"]  # the first shard only
    monkeypatch.setattr(speculate, "autoregressive_batch", real)
    # killed between a shard and its index entry: the unindexed shard is overwritten by the rerun
    (run / "shard_00001.bin").write_bytes(b"\0" * 12)
    scenes.distill_data(target, prompts(), run, STOP, MAX_NEW, shard_scenes=2)
    assert scenes.read_distill_data(run) == scenes.read_distill_data(whole)
    scenes.distill_data(target, prompts(), run, STOP, MAX_NEW, shard_scenes=2)  # all done: nothing added
    assert len(json.load(open(run / "index.json"))["shards"]) == 2
    (run / "shard_00001.bin").write_bytes(b"\0" * 12)
    with pytest.raises(ValueError, match=r"shard_00001.bin: 3 ids, its index entry expects"):
        scenes.read_distill_data(run)


def test_a_bad_scene_mid_run_is_named_and_keeps_what_was_decoded(target, tmp_path):
    """A prompt that fails (the processor's error) names its scene; the records decoded before it are flushed, not
    the shard's worth lost (issue #33); a shard holding an id past the target's vocabulary is named on reading."""
    def refused():
        raise ValueError("absolute aspect ratio must be smaller than 200, got 201.0")
    source = prompts(2) + [("s_wide", refused)]
    with pytest.raises(ValueError, match="scene s_wide: absolute aspect ratio"):
        scenes.distill_data(target, source, tmp_path, STOP, MAX_NEW)
    assert [r["scene"] for r in scenes.read_distill_data(tmp_path)] == ["s0", "s1"]
    ids = np.fromfile(tmp_path / "shard_00000.bin", dtype="<u4")
    ids[3] = 500
    ids.tofile(tmp_path / "shard_00000.bin")
    with pytest.raises(ValueError, match=r"shard_00000.bin: holds id 500, outside the target's 97 ids"):
        scenes.read_distill_data(tmp_path, vocab_size=target.cfg.vocab_size)


def test_a_full_disk_at_the_data_stage_names_the_file(target, full_disk, tmp_path, monkeypatch):
    """A full disk (a real one where a tmpfs can be mounted) is an OSError naming the file (issue #33: a bare
    [Errno 28] from the writer lock), and leaves no folder it made."""
    if full_disk is None:
        monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        full_disk = tmp_path
    else:
        with pytest.raises(OSError), open(full_disk / "fill", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    with pytest.raises(OSError, match=r"data/part0/.lock: cannot write the writer lock \(No space left on device\)"):
        scenes.distill_data(target, prompts(1), full_disk / "data" / "part0", STOP, MAX_NEW)
    assert not os.path.exists(full_disk / "data")


def test_a_changed_setting_is_refused_by_name(target, tmp_path):
    scenes.distill_data(target, prompts(1), tmp_path, STOP, MAX_NEW)
    for field, kw in [("temperature", dict(sampling=speculate.Sampling(0.6))), ("max_new", dict(max_new=8)),
                      ("stop_ids", dict(stop_ids=[48]))]:
        args = dict(dict(target=target, prompts=prompts(2), out=tmp_path, stop_ids=STOP, max_new=MAX_NEW), **kw)
        with pytest.raises(ValueError, match=rf"written with {field} = .*, this run asks"):
            scenes.distill_data(**args)
    with pytest.raises(ValueError, match=r"written with target = "):
        scenes.distill_data(tiny_model(seed=1), prompts(2), tmp_path, STOP, MAX_NEW)
    with pytest.raises(ValueError, match=r"1 when greedy"):
        scenes.distill_data(target, prompts(2), tmp_path / "x", STOP, MAX_NEW, samples=2)
    assert len(scenes.read_distill_data(tmp_path)) == 1  # nothing written by the refused runs


def test_sampled_records_are_reproducible_from_the_seed_in_any_order(target, tmp_path):
    kw = dict(stop_ids=STOP, max_new=MAX_NEW, sampling=speculate.Sampling(0.6, top_p=0.98), samples=3)
    scenes.distill_data(target, prompts(), tmp_path / "a", seed=5, **kw)
    scenes.distill_data(target, prompts()[::-1], tmp_path / "b", seed=5, **kw)
    scenes.distill_data(target, prompts(), tmp_path / "c", seed=6, **kw)
    a, b, c = (sorted(scenes.read_distill_data(tmp_path / d), key=lambda r: (r["scene"], r["sample"])) for d in "abc")
    assert a == b and len(a) == 12 and a != c
    assert len({tuple(r["tokens"]) for r in a}) > 4  # the samples differ from each other
    p = dict(prompts())["s2"]
    assert a[7]["tokens"] == speculate.autoregressive(target, p, MAX_NEW, speculate.Sampling(
        0.6, top_p=0.98, seed=scenes.sample_seed(5, "s2", 1)), STOP[-1]).tokens


# ---- the prompt sources ----


def test_the_toy_world_is_a_prompt_source(tmp_path):
    tok = driving.Tokenizer()
    import train  # the toy target's config
    cfg = dataclasses.replace(train.target_config(tok), hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1,
                              intermediate_size=48, head_dim=16, mrope_section=(2, 3, 3))
    torch.manual_seed(0)
    toy = M.VLA(cfg).eval()
    world = driving.make_split("train", 2)
    source = [(f"toy{i}", lambda s=s: driving.build_prompt(s, tok, views=1)) for i, s in enumerate(world)]
    scenes.distill_data(toy, source, tmp_path, [tok.cot_end_id], 6)
    recs = scenes.read_distill_data(tmp_path)
    assert [r["tokens"] for r in recs] == [speculate.autoregressive(toy, driving.build_prompt(s, tok, views=1), 6,
                                                                   stop_token=tok.cot_end_id).tokens for s in world]


@pytest.mark.skipif(folder is None, reason="needs transformers (optional extra)")
@torch.no_grad()
def test_a_scene_folder_through_alpamayos_prompt(folder, tmp_path):
    from real.alpamayo import build_prompt
    from real.hf import load_pretrained
    d = folder[2]
    alp = load_pretrained(d)
    for i in range(2):
        scenes.write_scene(tmp_path / "scenes", f"clip{i}", pixels(h=24, w=40, seed=i), poses(16, seed=i) * 0.1)
    kw = dict(min_pixels=64, max_pixels=256)
    clips, prompts, stop, _ = scenes.scene_prompts(d, tmp_path / "scenes", **kw)
    assert stop == [SPECIAL["<|cot_end|>"], SPECIAL["<|traj_future_start|>"]]
    scenes.distill_data(alp, prompts, tmp_path / "out", stop, 5)
    recs = scenes.read_distill_data(tmp_path / "out")
    assert [r["scene"] for r in recs] == ["clip0", "clip1"]
    for s, r in zip(clips, recs):
        p = build_prompt(d, s.images(), s.past, **kw)
        assert r["tokens"] == speculate.autoregressive(alp, p, 5, stop_token=stop[-1]).tokens
