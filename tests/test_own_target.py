"""A routine reasoner for the user's own target (train.py --target): on a tiny random Alpamayo-shaped folder with
generated scene folders, and on an exported toy target, the whole distillation path: the target's own CoCs
(scenes.distill_data), the draft distilled on them one sequence at a time, a killed run resumed exactly, 2 gloo ranks
equal to 1, the loss equal to KL(p || q) computed independently, and bad arguments named before any work.

2 ranks vs 1: the ranks' gradients are summed by all-reduce in another order than one process accumulates them, so
the weights agree to float32 rounding, not bit for bit: max |diff| <= 1e-5 after 4 updates (measured 1.6e-6).
run: python -m pytest -q tests/test_own_target.py
"""
import dataclasses
import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import bench
import driving
import model as M
from experiments.hf_export import export_pretrained
from ops import checkpoint
from real import aarl_real, distill, scenes
import train as T
from test_user_errors import error_line

try:  # the tiny Alpamayo-shaped folder of tests/test_alpamayo.py, a fixture
    from test_alpamayo import SPECIAL, folder
except (ImportError, pytest.skip.Exception):  # no transformers: that test module skips itself
    SPECIAL = folder = None

pytestmark = pytest.mark.usefixtures("one_thread")
needs_tf = pytest.mark.skipif(folder is None, reason="needs transformers (optional extra)")
RANK_TOL = 1e-5


def write_scenes(root, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        images = torch.randint(0, 256, (16, 3, 24, 40), dtype=torch.uint8, generator=g)
        past = 0.1 * torch.randn(16, 3, generator=g)
        scenes.write_scene(root, f"clip{i}", images, past, torch.randn(64, 3, generator=g) if i % 2 else None)
    return str(root)


def alpamayo_cfg(d, root, out, **kw):
    return distill.DraftConfig(**dict(dict(target=d, scenes=root, out=str(out), steps=4, batch_size=4, save_every=2,
                                           warmup=1, lr=1e-2, max_new=6, min_pixels=64, max_pixels=256,
                                           allow_truncated=True), **kw))  # 6 ids: most CoCs are cut


@pytest.fixture(scope="module")
def alpamayo_run(folder, tmp_path_factory):
    """(folder, scenes root, straight 4-update run's output) on 4 generated scenes, on one thread as the tests that
    compare runs against it (a module fixture is set up before their one_thread; other thread counts sum in other
    orders)."""
    d, tmp = str(folder[2]), tmp_path_factory.mktemp("own")
    root = write_scenes(tmp / "scenes")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return d, root, distill.run_draft(alpamayo_cfg(d, root, tmp / "straight"), log=lambda *_: None)
    finally:
        torch.set_num_threads(n)


@needs_tf
def test_the_data_is_the_targets_own_cocs_through_cot_end(alpamayo_run):
    d, root, out = alpamayo_run
    assert [r["scene"] for r in out["data"]] == [f"clip{i}" for i in range(4)]
    target = distill.load_target(d)
    stop = [SPECIAL["<|cot_end|>"], SPECIAL["<|traj_future_start|>"]]
    from real import alpamayo
    import speculate
    for s, r in zip(scenes.load_scenes(root), out["data"]):
        p = alpamayo.build_prompt(d, s.images(), s.past, min_pixels=64, max_pixels=256)
        assert r["tokens"] == speculate.autoregressive(target, p, 6, stop_token=stop[-1]).tokens
        assert r["complete"] == (r["tokens"][-2:] == stop)


@needs_tf
def test_a_killed_run_resumes_exactly_and_its_draft_loads(alpamayo_run, tmp_path, kill_after_save):
    d, root, out = alpamayo_run
    cfg = alpamayo_cfg(d, root, tmp_path)
    with kill_after_save():
        distill.run_draft(cfg, log=lambda *_: None)
    assert torch.load(tmp_path / "draft_flat_s0.state.pt", weights_only=True)["step"] == 2
    resumed = distill.run_draft(dataclasses.replace(cfg, workers=2), log=lambda *_: None)["draft"]  # prompts built ahead
    fresh = dict(M.make_draft(distill.load_target(d), n_layers=1).named_parameters())
    for (name, a), b in zip(out["draft"].named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
        assert not torch.equal(a, fresh[name]), f"{name} never moved"
    target = distill.load_target(d)
    loaded = checkpoint.load(checkpoint.draft_dir(tmp_path, "flat", 0), target=target)
    for (name, a), b in zip(resumed.named_parameters(), loaded.parameters()):
        assert torch.equal(a, b), name
    os.remove(os.path.join(checkpoint.draft_dir(tmp_path, "flat", 0), checkpoint.WEIGHTS))  # a run to resume again
    with pytest.raises(ValueError, match="other settings: lr"):  # a resume with another lr is refused by name
        distill.run_draft(dataclasses.replace(cfg, lr=1e-3), log=lambda *_: None)
    write_scenes(root + "_more", n=5)  # one more scene: the records differ, and so would the updates' draws
    with pytest.raises(ValueError, match="distilled on other records"):
        distill.run_draft(dataclasses.replace(cfg, scenes=root + "_more"), log=lambda *_: None)


def _rank_worker(rank, world, d, root, out, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    draft = distill.run_draft(alpamayo_cfg(d, root, out), log=lambda *_: None)["draft"]
    torch.save(draft.state_dict(), os.path.join(out, f"rank{rank}.pt"))


@needs_tf
def test_two_gloo_ranks_equal_one(alpamayo_run, tmp_path):
    d, root, out = alpamayo_run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_worker, args=(2, d, root, str(tmp_path), port), nprocs=2, join=True)
    assert sorted(os.listdir(tmp_path / "data")) == ["part0", "part1"]  # each rank decoded its share of the scenes
    key = lambda r: r["scene"]  # noqa: E731
    assert sorted(distill.read_parts(tmp_path / "data"), key=key) == sorted(out["data"], key=key)
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for k, v in out["draft"].state_dict().items():
        assert torch.equal(a[k], b[k]), k  # DDP keeps the ranks identical
        assert (a[k] - v).abs().max().item() <= RANK_TOL, k


@needs_tf
def test_a_diverged_last_update_saves_nothing_and_is_one_line(alpamayo_run, tmp_path, capsys):
    """An infinite step leaves the loss finite and the weights NaN: the run stops after that (last) update and saves
    no draft (issue #33: the loss was checked before each update only, and the NaN draft saved); --lr 1e39, finite,
    overflows float32 in AdamW: one line (it was a traceback)."""
    d, root, _ = alpamayo_run
    shutil.copytree(os.path.join(os.path.dirname(root), "straight", "data"), tmp_path / "data")  # its CoCs: no decode
    with pytest.raises(FloatingPointError, match="is NaN / inf after the update at step 0: stopped; no state"):
        distill.run_draft(alpamayo_cfg(d, root, tmp_path, steps=1, batch_size=1, lr=float("inf"), warmup=0),
                          log=lambda *_: None)
    assert not os.path.exists(checkpoint.draft_dir(tmp_path, "flat", 0))
    with pytest.raises(SystemExit) as e:
        distill.main(["--target", d, "--scenes", root, "--out", str(tmp_path), "--steps", "1", "--batch-size", "1",
                      "--lr", "1e39", "--warmup", "0", "--min-pixels", "64", "--max-pixels", "256", "--max-new", "6",
                      "--allow-truncated"])
    assert e.value.code == 2 and "an update at lr 1e+39 overflows float32" in error_line(capsys)
    assert not os.path.exists(checkpoint.draft_dir(tmp_path, "flat", 0))


@needs_tf
def test_what_can_be_known_before_the_data_stage_is_checked_before_it(alpamayo_run, tmp_path):
    """--draft-vocab past the target's 97 ids is refused before any decoding (issue #33: after the data stage)."""
    d, root, _ = alpamayo_run
    with pytest.raises(ValueError, match="--draft-vocab 1000 is above the target's vocabulary of 97 ids"):
        distill.run_draft(alpamayo_cfg(d, root, tmp_path, draft_vocab=1000), log=lambda *_: None)
    assert not os.path.exists(tmp_path / "data")


@needs_tf
def test_truncated_cocs_are_counted_and_mostly_truncated_data_refused(alpamayo_run, tmp_path):
    """At --max-new 6 every CoC is cut before <|cot_end|>: said, and refused without --allow-truncated (issue #33:
    stored complete: false and trained on without a word); --stage data keeps the data and says the count."""
    d, root, _ = alpamayo_run
    shutil.copytree(os.path.join(os.path.dirname(root), "straight", "data"), tmp_path / "data")  # its CoCs: no decode
    said = []
    with pytest.raises(ValueError, match="4 of 4 CoCs were cut at --max-new 6 .* or pass --allow-truncated"):
        distill.run_draft(alpamayo_cfg(d, root, tmp_path, allow_truncated=False), log=said.append)
    assert said[-1] == "4 of 4 CoCs were cut at --max-new 6 before the reasoning's end"
    assert not os.path.exists(checkpoint.draft_dir(tmp_path, "flat", 0))
    assert len(distill.run_draft(alpamayo_cfg(d, root, tmp_path, allow_truncated=False), "data")["data"]) == 4


@needs_tf
def test_a_reduced_vocabulary_head_covers_the_targets_own_cocs(alpamayo_run, tmp_path):
    """--draft-vocab K: the head's ids are the K commonest in the target's own CoCs, the reasoning's stop id kept."""
    d, root, out = alpamayo_run
    cfg = alpamayo_cfg(d, root, tmp_path, steps=1, draft_vocab=4)
    draft = distill.run_draft(cfg, log=lambda *_: None)["draft"]
    want = T.select_draft_vocab([r["tokens"] for r in out["data"]], 4, SPECIAL["<|traj_future_start|>"],
                                draft.cfg.vocab_size)
    assert torch.equal(draft.vocab_ids.cpu(), want) and SPECIAL["<|traj_future_start|>"] in want.tolist()
    loaded = checkpoint.load(checkpoint.draft_dir(tmp_path, "flat", 0), target=distill.load_target(d))
    assert torch.equal(loaded.vocab_ids.cpu(), want)


@needs_tf
def test_a_draft_can_start_from_the_targets_last_layer(alpamayo_run):
    target = distill.load_target(alpamayo_run[0])
    draft = distill.new_draft(target, "flat", init="last")
    want = dict(target.layers[-1].state_dict(), **{"norm." + k: v for k, v in target.norm.state_dict().items()})
    got = dict(draft.layers[0].state_dict(), **{"norm." + k: v for k, v in draft.norm.state_dict().items()})
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert not torch.equal(distill.new_draft(target, "flat").layers[0].mlp.down_proj.weight, want["mlp.down_proj.weight"])


@needs_tf
@torch.no_grad()
def test_the_loss_is_kl_p_q_on_the_coc_positions(alpamayo_run):
    """sequence_kl against full-vocabulary, full-length forwards of both models (no logits_to_keep)."""
    d, root, out = alpamayo_run
    from real import alpamayo
    import speculate
    target, rec = distill.load_target(d), out["data"][1]
    draft = M.make_draft(target, n_layers=1)
    s = scenes.load_scenes(root)[1]
    prompt = alpamayo.build_prompt(d, s.images(), s.past, min_pixels=64, max_pixels=256)
    ids = torch.cat([prompt["input_ids"], torch.tensor([rec["tokens"]])], 1)  # (1, L + T)
    embeds, deepstack = speculate.embed_prompt(target, dict(prompt, input_ids=ids))
    L, T_ = prompt["input_ids"].shape[1], len(rec["tokens"])
    p = F.log_softmax(target(ids, inputs_embeds=embeds, deepstack=deepstack,
                             image_grid_thw=prompt["image_grid_thw"])[0, L - 1:L + T_ - 1], -1)  # (T, V)
    q = F.log_softmax(draft(ids, inputs_embeds=embeds, image_grid_thw=prompt["image_grid_thw"])[0, L - 1:L + T_ - 1],
                      -1)
    want = (p.exp() * (p - q)).sum(-1).mean()
    got = distill.sequence_kl(target, draft, prompt, rec["tokens"])
    assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, want.item()), (got.item(), want.item())


@needs_tf
def test_the_whole_path_on_the_command_line(alpamayo_run, tmp_path):
    """real.distill, then real.aarl_real on its draft, then bench.py --scenes on held-out scenes with the
    post-trained draft: the commands a user runs, in order, each reading what the one before wrote."""
    d, root, _ = alpamayo_run
    held, run, px = write_scenes(tmp_path / "held", n=2, seed=1), str(tmp_path / "run"), [
        "--min-pixels", "64", "--max-pixels", "256", "--max-new", "6"]
    distill.main(["--target", d, "--scenes", root, "--out", run, "--steps", "2", "--batch-size", "2", *px,
                  "--allow-truncated"])
    aarl_real.main(["--target", d, "--draft", checkpoint.draft_dir(run, "flat", 0), "--scenes", root, "--out", run,
               "--steps", "1", "--per-update", "2", "--group", "2", *px])
    res = bench.main(["real", "--target", d, "--draft", checkpoint.draft_dir(run, "aarl", 0), "--scenes", held, "--tree",
                      "0", "--repeats", "3", "--dtype", "fp32", *px])
    assert res["identical"] == res["scenes"] == 2 and res["trained_draft"] and res["ms"]["action_expert"] > 0


@needs_tf
def test_a_plain_qwen3_vl_folder_takes_the_same_path(folder, tmp_path):
    """No Alpamayo tokens: each scene's images and instruction.txt, the CoC ending at <|im_end|>."""
    from test_heldout import plain_qwen3_vl

    from real import alpamayo
    import speculate
    d = plain_qwen3_vl(folder, tmp_path)
    cfg = distill.DraftConfig(target=str(d), scenes=str(tmp_path / "s"), out=str(tmp_path / "run"), steps=2, batch_size=2,
                        max_new=4, min_pixels=64, max_pixels=256, allow_truncated=True)
    out = distill.run_draft(cfg, log=lambda *_: None)
    target = distill.load_target(str(d))
    for s, r in zip(scenes.load_scenes(tmp_path / "s", n_images=None, poses=False), out["data"]):
        p = alpamayo.qwen_prompt(str(d), s.images(), s.instruction, min_pixels=64, max_pixels=256)
        assert r["tokens"] == speculate.autoregressive(target, p, 4, stop_token=SPECIAL["<|im_end|>"]).tokens
    checkpoint.load(checkpoint.draft_dir(cfg.out, "flat", 0), target=target)


def test_an_exported_toy_target_takes_the_same_path(tmp_path):
    """A tiny random toy target exported as a Qwen2.5-VL folder and loaded back: the toy world's scenes as prompts,
    its greedy CoCs as data, a draft distilled and saved bound to the loaded target."""
    tok = driving.Tokenizer()
    cfg = dataclasses.replace(T.target_config(tok), hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1,
                              intermediate_size=48, head_dim=16, mrope_section=(2, 3, 3))
    torch.manual_seed(0)
    export_pretrained(M.VLA(cfg).eval(), tmp_path / "hf")
    run = distill.DraftConfig(target=str(tmp_path / "hf"), toy_scenes=3, out=str(tmp_path / "run"), steps=2,
                        batch_size=2, max_new=6, views=1, allow_truncated=True)
    out = distill.run_draft(run, log=lambda *_: None)
    target = distill.load_target(run.target)
    world = driving.make_split("train", 3, 0)
    import speculate
    assert [r["tokens"] for r in out["data"]] == [speculate.autoregressive(
        target, driving.build_prompt(s, tok, 1), 6, stop_token=tok.cot_end_id).tokens for s in world]
    checkpoint.load(checkpoint.draft_dir(run.out, "flat", 0), target=target)


@pytest.mark.parametrize("argv, msg", [
    (["--toy-scenes", "2"], "no such folder"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--top-p", "0"], "--top-p must be a finite number > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),  # issue #33: inf passed "> 0"
    (["--grad-clip", "inf"], "--grad-clip must be a finite number > 0, got inf"),
    (["--dtype", "bf16"], "--dtype bf16 needs --amp"),
    (["--samples", "2"], "--samples > 1 needs --temperature > 0"),
    (["--device", "tpu"], "unknown device 'tpu'"),
])
def test_bad_arguments_are_named_before_any_work(argv, msg, tmp_path, capsys):
    base = ["--target", str(tmp_path if argv[0] != "--toy-scenes" else tmp_path / "missing")]
    if argv[0] != "--toy-scenes":
        base += ["--toy-scenes", "2"]
    with pytest.raises(SystemExit):
        distill.main(base + argv)
    assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit):  # no training scenes, or both kinds
        distill.main(["--target", str(tmp_path)])
    assert "give the training scenes" in capsys.readouterr().err
