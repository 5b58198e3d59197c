"""Tests for train.py: a few steps lower the loss, resume is exact, DDP keeps ranks identical,
the flags are the config's, and bad arguments fail clearly.

Tiny model sizes (registered as presets for the test) keep the file fast on 2 CPU cores.

run: python -m pytest -q tests/test_train.py
"""
import contextlib
import dataclasses
import fcntl
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import driving
from driving import Data, vision_kwargs
import evaluate
import model as M
from ops import checkpoint, files, runs
import train as T

TINY_VISION = M.VisionConfig(hidden=32, heads=2, intermediate=64, depth=2, window_size=8, fullatt_block_indexes=(1,))
TINY = M.ModelConfig(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                     mrope_section=(2, 3, 3), vision=TINY_VISION)
TINY_DRAFT = dict(n_layers=1, hidden_size=32, n_heads=2, n_kv_heads=1, intermediate_size=64)


@pytest.fixture(autouse=True)
def tiny_presets(monkeypatch):
    monkeypatch.setitem(M.PRESETS, "test-tiny", TINY)
    monkeypatch.setitem(M.DRAFT_PRESETS, "test-tiny-draft", TINY_DRAFT)
    torch.set_num_threads(1)


def tiny_cfg(out, **kw):
    base = dict(out=str(out), n_train=64, n_val=16, n_test=16, batch_size=8, target_steps=6, draft_steps=4,
                eval_every=100, warmup=2, target_preset="test-tiny", draft_preset="test-tiny-draft", amp=False)
    base.update(kw)
    return T.TrainConfig(**base)


@pytest.fixture(scope="module")
def tok():
    return driving.Tokenizer()


def test_few_steps_lower_the_loss(tmp_path, tok):
    cfg = tiny_cfg(tmp_path, target_steps=30, target_lr=3e-3)
    data = Data("train", cfg.n_train, 0, tok)
    batch = data.batch(0, 16)
    torch.manual_seed(0)
    fresh = M.VLA(T.target_config(tok, "test-tiny"))
    before = T.target_loss(fresh, batch, cfg.traj_weight)[0].item()
    trained = T.train_target(cfg, tok, data, data, log=lambda *_: None)
    after = T.target_loss(trained, batch, cfg.traj_weight)[0].item()
    assert after < 0.7 * before, (before, after)


def test_distillation_lowers_the_kl(tmp_path, tok):
    cfg = tiny_cfg(tmp_path, target_steps=10)
    data = Data("train", cfg.n_train, 0, tok)
    target = T.train_target(cfg, tok, data, data, log=lambda *_: None).eval()
    batch = data.batch(0, 16)
    with torch.no_grad():
        embeds = target.embed(batch["input_ids"], **vision_kwargs(batch))
        p = torch.log_softmax(target(batch["input_ids"], **vision_kwargs(batch))[batch["loss_mask"]], -1)
    torch.manual_seed(cfg.seed + 1)
    fresh = T.make_drafts(target, T.draft_shape(cfg))
    before = {k: T.distill_loss(d, embeds, p, batch).item() for k, d in fresh.items()}
    drafts = T.train_drafts(dataclasses.replace(cfg, draft_steps=20), target, data)
    for k, d in drafts.items():
        assert T.distill_loss(d, embeds, p, batch).item() < 0.7 * before[k], k
        assert os.path.exists(os.path.join(checkpoint.draft_dir(str(tmp_path), k, 0), "model.safetensors"))


def test_logs_name_the_loss_trained_and_validation_keeps_its_measures(tmp_path, tok, monkeypatch, capsys):
    """--loss tvd (issue #42): the progress bar and every evaluation name the loss trained (tvd_flat, train_tvd; no kl
    key), and validation does not reuse the training loss: val_kl is the exact KL(p || q) of evaluate.kl_to, beside
    val_tau, whatever the loss; distill_loss runs only in the training steps."""
    cfg, _ = T.parse_args(["--loss", "tvd"])
    assert cfg.loss == "tvd"
    with pytest.raises(SystemExit):
        T.parse_args(["--loss", "js"])
    torch.manual_seed(0)
    target = M.VLA(T.target_config(tok, "test-tiny")).eval()
    data = Data("train", 16, 0, tok)
    calls, loss = [], T.distill_loss
    monkeypatch.setattr(T, "distill_loss", lambda *args: calls.append(args[-1]) or loss(*args))
    cfg = tiny_cfg(tmp_path, batch_size=4, draft_steps=2, eval_every=2, kinds="flat", loss="tvd")
    capsys.readouterr()
    (draft,) = T.train_drafts(cfg, target, data, data).values()
    assert calls == ["tvd", "tvd"] and "tvd_flat=" in capsys.readouterr().err
    rec = files.read_json(tmp_path / "draft_flat_s0.metrics.json")
    (e,) = rec["evaluations"]
    assert rec["config"]["loss"] == "tvd" and "train_tvd" in e and not any("train_kl" in k for k in e)
    assert e["val_kl"] == pytest.approx(evaluate.kl_to(target, draft, target, data)) and e["val_kl"] != e["train_tvd"]
    assert set(e["val_tau"]) == {str(g) for g in evaluate.GAMMAS}


def test_reduced_vocab_drafts_train_save_and_resume(tmp_path, tok):
    """--draft-vocab K: both drafts' heads cover select_draft_vocab's K ids of the training CoCs (<cot_end> in), the
    loss stays finite and falls, the saved drafts load with their ids, and a state saved before TrainConfig had the
    field resumes as the default (full head) it was."""
    cfg, stage = T.parse_args(["--draft-vocab", "20", "--stage", "drafts"])
    assert (cfg.draft_vocab, stage) == (20, "drafts")
    cfg = tiny_cfg(tmp_path, target_steps=10, draft_vocab=20)
    data = Data("train", cfg.n_train, 0, tok)
    target = T.train_target(cfg, tok, data, data, log=lambda *_: None).eval()
    want = T.select_draft_vocab(data.coc_ids(), 20, tok.cot_end_id, len(tok))
    assert tok.cot_end_id in want.tolist()
    batch = data.batch(0, 16)
    with torch.no_grad():
        embeds = target.embed(batch["input_ids"], **vision_kwargs(batch))
        p = torch.log_softmax(target(batch["input_ids"], **vision_kwargs(batch))[batch["loss_mask"]], -1)
    torch.manual_seed(cfg.seed + 1)
    fresh = T.make_drafts(target, T.draft_shape(cfg), vocab_ids=want)
    before = {k: T.distill_loss(d, embeds, p, batch).item() for k, d in fresh.items()}
    drafts = T.train_drafts(dataclasses.replace(cfg, draft_steps=20), target, data)
    for k, d in drafts.items():
        assert torch.equal(d.vocab_ids, want), k
        assert T.distill_loss(d, embeds, p, batch).item() < 0.7 * before[k], k
        back = checkpoint.load(checkpoint.draft_dir(str(tmp_path), k, 0), target=target)
        assert torch.equal(back.vocab_ids, want) and back.cfg.draft_vocab == 20, k
    # a state written before the field existed: its config lacks draft_vocab, and it resumes with the default 0
    full = T.make_drafts(target, T.draft_shape(cfg))
    opts = {k: runs.make_optimizer(d.parameters(), cfg.draft_lr) for k, d in full.items()}
    old = dataclasses.replace(cfg, draft_vocab=0)
    runs.save_state(tmp_path / "old.state.pt", 3, full, opts, old, 0)
    state = torch.load(tmp_path / "old.state.pt", weights_only=True)
    del state["config"]["draft_vocab"]
    torch.save(state, tmp_path / "old.state.pt")
    assert runs.load_state(tmp_path / "old.state.pt", full, opts, old)[0] == 3
    with pytest.raises(ValueError, match=r"draft_vocab 0 there, 20 now"):
        runs.load_state(tmp_path / "old.state.pt", full, opts, cfg)


def test_vision_tower_frozen_unless_asked(tmp_path, tok):
    data = Data("train", 64, 0, tok)
    torch.manual_seed(0)
    fresh = M.VLA(T.target_config(tok, "test-tiny")).state_dict()
    for train_vision in (False, True):
        trained = T.train_target(tiny_cfg(tmp_path / str(train_vision), target_steps=3, train_vision=train_vision),
                                 tok, data, data, log=lambda *_: None).state_dict()
        vision_moved = [not torch.equal(trained[k], fresh[k]) for k in fresh if k.startswith("visual.")]
        lm_moved = [not torch.equal(trained[k], fresh[k]) for k in fresh if k.startswith("layers.")]
        assert any(lm_moved) and (all(vision_moved) if train_vision else not any(vision_moved))


def test_toy_video_tokens_hold_only_their_own_patches(tok):
    """The toy target's vision tower (train.target_config) is windowed to one merged token: perturbing the
    patches of one merged token changes that token's features and no other's (a frame-wide block would leak)."""
    torch.manual_seed(0)
    vis = M.VLA(T.target_config(tok)).visual.eval()
    prompt = driving.build_prompt(driving.make_split("train", 1, 0)[0], tok)
    pixels, grid = prompt["pixel_values_videos"], prompt["video_grid_thw"]
    per_token = driving.MERGE ** 2  # patches of one merged token, contiguous in patchify order
    with torch.no_grad():
        base = vis(pixels, grid)  # (8, D)
        poked = vis(torch.cat([pixels[:per_token] + 1, pixels[per_token:]]), grid)
    assert not torch.allclose(poked[0], base[0])
    torch.testing.assert_close(poked[1:], base[1:], rtol=0, atol=0)


def test_resume_is_exact(tmp_path, tok, kill_after_save):
    """4 steps straight == a run killed right after its checkpoint at step 2, resumed to 4 in a fresh call."""
    data = Data("train", 64, 0, tok)
    straight = T.train_target(tiny_cfg(tmp_path / "a", target_steps=4), tok, data, data)
    cfg = tiny_cfg(tmp_path / "c", target_steps=4, eval_every=2)
    with kill_after_save():
        T.train_target(cfg, tok, data, data)
    assert torch.load(tmp_path / "c" / "target.state.pt", weights_only=True)["step"] == 2
    resumed = T.train_target(cfg, tok, data, data)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    # the saved model equals the trained one
    loaded = checkpoint.load(tmp_path / "c" / "target")
    for (name, a), b in zip(resumed.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_resume_with_other_settings_is_refused(tmp_path, tok):
    """A state written with another seed (or batch size, learning rate, ...) is not resumed: the error names the
    fields; settings that cannot change the result (the output folder, the evaluation cadence) may change."""
    data = Data("train", 64, 0, tok)
    T.train_target(tiny_cfg(tmp_path, target_steps=2, eval_every=2), tok, data, data)
    with pytest.raises(ValueError, match=r"seed 0 there, 1 now.*target_lr"):
        T.train_target(tiny_cfg(tmp_path, target_steps=2, seed=1, target_lr=1e-2), tok, data, data)
    T.train_target(tiny_cfg(tmp_path, target_steps=2, eval_every=1), tok, data, data)  # eval cadence: fine


def test_resume_from_a_corrupt_state_names_the_file(tmp_path, tok):
    (tmp_path / "target.state.pt").write_bytes(b"not a checkpoint")
    data = Data("train", 16, 0, tok)
    with pytest.raises(ValueError, match="target.state.pt"):
        T.train_target(tiny_cfg(tmp_path), tok, data, data)


def _ddp_worker(rank, world, out, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import model as M_
    import train as T_
    M_.PRESETS["test-tiny"] = TINY
    M_.DRAFT_PRESETS["test-tiny-draft"] = TINY_DRAFT
    tok_ = driving.Tokenizer()
    r, w, device = runs.setup_distributed("cpu")
    data = T_.Data("train", 64, 0, tok_)
    target = T_.train_target(tiny_cfg(out, target_steps=3), tok_, data, data, r, w, device)
    torch.save(target.state_dict(), os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_ddp_two_ranks_end_identical(tmp_path):
    """torchrun-style DDP with gloo on 2 CPU processes: after 3 steps both ranks hold the same weights."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, str(tmp_path), port), nprocs=2, join=True)
    a = torch.load(tmp_path / "rank0.pt", weights_only=True)
    b = torch.load(tmp_path / "rank1.pt", weights_only=True)
    fresh = M.VLA(T.target_config(driving.Tokenizer(), "test-tiny")).state_dict()
    moved = False
    for k in a:
        assert torch.equal(a[k], b[k]), k
        moved |= not torch.equal(a[k], fresh[k])
    assert moved


def test_bad_arguments_fail_clearly(capsys):
    for argv, msg in ((["--batch-size", "0"], "--batch-size must be >= 1"), (["--target-lr", "-1"], "--target-lr"),
                      (["--traj-weight", "nan"], "--traj-weight must be a finite number >= 0, got nan"),
                      (["--grad-clip", "nan"], "--grad-clip must be a finite number > 0"), (["--p-no-views", "2"], "--p-no-views"),
                      (["--device", "tpu"], "unknown device 'tpu'"),
                      (["--draft-vocab", "-2"], "--draft-vocab must be a finite number >= 0, got -2")):
        with pytest.raises(SystemExit):
            T.parse_args(argv)
        assert msg in capsys.readouterr().err


@contextlib.contextmanager
def held_lock(folder, pid=4242, command="python train.py --seed 0"):
    """folder's writer lock held through another open file, with a holder's record, as another process holds it."""
    fd = os.open(os.path.join(folder, files.LOCK), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"pid {pid} on elsewhere (`{command}`, since 08:00)".encode())
    try:
        yield
    finally:
        os.close(fd)


def test_run_checks_its_folder_and_device_before_any_work(tmp_path, monkeypatch):
    """A second run into a folder that a run is writing stops at once, naming it; so does an unknown device or an
    output folder that cannot be written: all before a single scene is generated."""
    monkeypatch.setattr(T, "Data", lambda *a, **k: pytest.fail("generated scenes before checking the run folder"))
    with held_lock(tmp_path):
        with pytest.raises(files.FolderLocked, match=r"being written by pid 4242 on elsewhere \(`python train"):
            T.run(tiny_cfg(tmp_path))
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        T.run(tiny_cfg(tmp_path, device="tpu"))
    (tmp_path / "file").write_text("")
    with pytest.raises(PermissionError, match="file/run: output folder is not writable"):
        T.run(tiny_cfg(tmp_path / "file" / "run"))


def test_nonfinite_loss_stops_and_keeps_the_last_good_state(tmp_path, tok, monkeypatch):
    data = Data("train", 16, 0, tok, views=0)
    losses, calls = T.target_loss, []

    def nan_from_the_second_step(*args):
        calls.append(1)
        loss, ce, l1 = losses(*args)
        return (loss * float("nan") if len(calls) > 1 else loss), ce, l1

    monkeypatch.setattr(T, "target_loss", nan_from_the_second_step)
    cfg = tiny_cfg(tmp_path, batch_size=2, target_steps=3, eval_every=1, max_views=0)
    with pytest.raises(FloatingPointError, match=r"target loss is nan at step 1: stopped; the last good state is "
                                                 r".*target.state.pt \(step 1\)"):
        T.train_target(cfg, tok, data, data, log=lambda *_: None)
    assert torch.load(tmp_path / "target.state.pt", weights_only=True)["step"] == 1
    assert not os.path.exists(tmp_path / "target")
    torch.manual_seed(0)
    target = M.VLA(T.target_config(tok, "test-tiny"))
    monkeypatch.setattr(T, "distill_loss", lambda *args: torch.tensor(float("inf"), requires_grad=True))
    with pytest.raises(FloatingPointError, match="flat draft loss is inf at step 0: stopped; no state was saved yet"):
        T.train_drafts(tiny_cfg(tmp_path / "d", batch_size=2), target, data)
    assert not os.path.exists(tmp_path / "d")


def test_drafts_state_is_bound_to_its_target(tmp_path, tok, monkeypatch):
    """The drafts' resumable state records the target it was distilled from: another target (retrained, or replaced)
    is refused; a model of other sizes under the same settings (a preset edited in model.py) is named, not dumped."""
    torch.manual_seed(0)
    target = M.VLA(T.target_config(tok, "test-tiny"))
    cfg = tiny_cfg(tmp_path)
    drafts = T.make_drafts(target, T.draft_shape(cfg))
    opts = {k: runs.make_optimizer(d.parameters(), cfg.draft_lr) for k, d in drafts.items()}
    path, bound = tmp_path / "drafts_s0.state.pt", {"target": checkpoint.fingerprint(target)}
    runs.save_state(path, 2, drafts, opts, cfg, 0, bound)
    assert runs.load_state(path, drafts, opts, cfg, bound)[0] == 2
    with pytest.raises(ValueError, match=r"drafts_s0.state.pt was trained against another target"):
        runs.load_state(path, drafts, opts, cfg, {"target": dict(bound["target"], weights="0" * 16)})
    monkeypatch.setitem(M.DRAFT_PRESETS, "test-tiny-draft", dict(TINY_DRAFT, hidden_size=64, n_heads=4))
    wide = T.make_drafts(target, T.draft_shape(cfg))
    wide_opts = {k: runs.make_optimizer(d.parameters(), cfg.draft_lr) for k, d in wide.items()}
    with pytest.raises(ValueError, match=r"cannot resume 'flat' from .*drafts_s0.state.pt: it does not fit"):
        runs.load_state(path, wide, wide_opts, cfg, bound)


def test_flags_are_the_config_fields(capsys):
    """No flags give the dataclass defaults; every field has a flag whose help is the field's comment."""
    assert T.parse_args([]) == (T.TrainConfig(), "all")
    cfg, stage = T.parse_args(["--no-amp", "--train-vision", "--n-train", "64", "--target-lr", "0.01",
                               "--stage", "drafts", "--out", "x"])
    assert (cfg.amp, cfg.train_vision, cfg.n_train, cfg.target_lr, cfg.out, stage) == (False, True, 64, 0.01, "x",
                                                                                     "drafts")
    with pytest.raises(SystemExit):
        T.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--weight-decay" in text and "AdamW weight decay (default: 0.01)" in text
    assert "warm-up steps, then cosine decay to 10% (default: 20)" in text


def test_ctrl_c_is_one_line_and_the_rerun_resumes_and_says_where_it_wrote(tmp_path, monkeypatch, capsys):
    """Issue #43: a Ctrl-C ends train.py with one line naming the saved state and its step (no traceback), exit 130;
    the same command resumes, and its end names every folder and metrics file it wrote."""
    argv = ["--out", str(tmp_path), "--n-train", "16", "--n-val", "4", "--n-test", "4", "--batch-size", "4",
            "--target-steps", "2", "--draft-steps", "3", "--eval-every", "1", "--warmup", "1", "--target-preset",
            "test-tiny", "--draft-preset", "test-tiny-draft", "--no-amp"]
    update, calls = runs.update, []

    def interrupted(*a, **k):  # the 2 target updates, 2 draft steps of 2 kinds, then Ctrl-C in the third
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return update(*a, **k)

    monkeypatch.setattr(runs, "update", interrupted)
    with pytest.raises(SystemExit) as e:
        T.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 130 and "Traceback" not in err
    assert err.splitlines()[-1].endswith(f": interrupted: the state in {tmp_path}/drafts_s0.state.pt was "
                                    "saved at step 2; rerun the same command to resume from there")
    monkeypatch.setattr(runs, "update", update)
    T.main(argv)
    out = capsys.readouterr().out
    for k in ("flat", "mrope"):
        line = f"{k} draft (seed 0) saved to {tmp_path}/draft_{k}_s0, its metrics to {tmp_path}/draft_{k}_s0.metrics.json"
        assert line in out and os.path.isdir(tmp_path / f"draft_{k}_s0")
        assert os.path.isfile(tmp_path / f"draft_{k}_s0.metrics.json")
    assert f"target saved to {tmp_path}/target, its metrics to {tmp_path}/train_metrics.json" in out
