"""Tests for aarl_real.py's real-target path on the tiny Alpamayo-shaped folder of tests/test_alpamayo.py and 3 written
scenes (two with a logged future, one without): the reward is -ADE of the expert's plan of each CoC planned alone,
and a deterministic function of the CoC; the reference of a scene without a future is p's plan after p's greedy CoC;
one update moves the draft and neither p nor q_ref, with KL 0 at the first update (q == q_ref); a NaN loss names its
update; the command line writes a draft checkpoint.load reads, refuses to replace it, and names bad inputs.

run: python -m pytest -q tests/test_aarl_real.py
"""
import copy
import dataclasses
import os

import pytest
import torch

import evaluate
import model as M
from ops import checkpoint, files
from real import aarl_real, alpamayo, scenes
import speculate

try:  # the tiny Alpamayo-shaped folder of tests/test_alpamayo.py, a fixture
    from test_alpamayo import SPECIAL, folder  # noqa: F401
except (ImportError, pytest.skip.Exception):  # no transformers: that test module skips itself
    pytest.skip("needs transformers (requirements-test.txt)", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = (SPECIAL["<|cot_end|>"], SPECIAL["<|traj_future_start|>"])
CFG = aarl_real.RealConfig(steps=1, per_update=1, group=3, max_new=5, min_pixels=64, max_pixels=256)
FLAGS = ["--min-pixels", "64", "--max-pixels", "256", "--max-new", "4", "--group", "2", "--steps", "1"]


@pytest.fixture(scope="module")
def setup(folder, tmp_path_factory):
    """(target, SFT draft folder, scene folder, scenes, prompts): s0 and s2 drive at alpamayo.history_poses' 8 m/s
    (alpamayo.plan's speed), s1 slower; s2 has no future."""
    from real.hf import load_pretrained
    d, root = folder[2], tmp_path_factory.mktemp("aarl_real")
    target = load_pretrained(d).eval()
    g = torch.Generator().manual_seed(0)
    for i, (past, future) in enumerate([(alpamayo.history_poses(), torch.randn(64, 3, generator=g)),
                                        (alpamayo.history_poses(speed=3.0), torch.randn(64, 3, generator=g)),
                                        (alpamayo.history_poses(), None)]):
        pixels = torch.randint(0, 256, (16, 3, 24, 40), dtype=torch.uint8, generator=g)
        scenes.write_scene(root / "scenes", f"s{i}", pixels, past, future)
    torch.manual_seed(0)
    checkpoint.save(M.make_draft(target, n_layers=1), str(root / "sft"), target=target)
    clips, prompts, _, _ = scenes.scene_prompts(d, root / "scenes", min_pixels=64, max_pixels=256)
    return target, str(root / "sft"), str(root / "scenes"), clips, prompts


def test_reward_is_minus_ade_of_the_experts_plan(setup):
    target, sft, _, clips, prompts = setup
    draft, scene, prompt = checkpoint.load(sft, target=target), clips[0], prompts[0][1]()
    embeds, deepstack = speculate.embed_prompt(target, prompt)  # (1, L, D)
    toks, mask = aarl_real.rollout(draft, embeds, prompt, 3, speculate.Sampling(1.0, seed=0), 5, IDS[1])
    cocs = [t[m].tolist() for t, m in zip(toks, mask)]
    v0 = torch.tensor([8.0])  # alpamayo.plan's speed; s0's own past gives the same
    assert torch.allclose(aarl_real.speed_from_history(scene.past[None]), v0)
    shared = dict(prompt, inputs_embeds=embeds, deepstack=deepstack)  # p's embeddings, as real_scene_loss passes them
    r = aarl_real.real_rewards(target, shared, cocs, v0, scene.future[:, :2], IDS)  # (3,)
    for c, ri in zip(cocs, r):  # an independent plan: each CoC alone, its own prefill from pixels
        plan = evaluate.action_rows(target, prompt, [c], IDS, v0)[0][0]  # (64, 2)
        assert torch.allclose(ri, -(plan - scene.future[:, :2]).norm(dim=-1).mean(), atol=1e-5)
    again = aarl_real.real_rewards(target, shared, cocs[::-1], v0, scene.future[:, :2], IDS)  # the rows reordered
    assert torch.equal(again, r.flip(0)) and len(set(r.tolist())) > 1, r  # deterministic, and CoCs differ


def test_reference_without_future_is_ps_own_plan(setup):
    target, _, _, clips, prompts = setup
    scene, prompt = clips[2], prompts[2][1]()
    assert scene.future is None
    ref = aarl_real.reference_plan(target, prompt, scene, torch.tensor([8.0]), CFG, IDS)  # (64, 2)
    coc = speculate.autoregressive(target, prompt, CFG.max_new, stop_token=IDS[1]).tokens
    plan = evaluate.action_rows(target, prompt, [coc], IDS, torch.tensor([8.0]))[0][0]
    assert ref.shape == (64, 2) and torch.allclose(ref, plan, atol=1e-5)


def test_one_update_moves_the_draft_only(setup):
    target, sft, _, clips, prompts = setup
    draft, ref = checkpoint.load(sft, target=target), checkpoint.load(sft, target=target)
    before = {n: copy.deepcopy(m.state_dict()) for n, m in (("draft", draft), ("ref", ref), ("target", target))}
    log = []
    aarl_real.train_real(target, draft, ref, clips[:1], prompts[:1], CFG, IDS, log=log.append)
    assert log[0]["kl"] == 0.0 and log[0]["reward_std_in_group"] > 0, log  # q == q_ref; a nonzero advantage
    moved = {n: any(not torch.equal(v, m.state_dict()[k]) for k, v in before[n].items())
             for n, m in (("draft", draft), ("ref", ref), ("target", target))}
    assert moved == {"draft": True, "ref": False, "target": False}
    with pytest.raises(FloatingPointError, match="loss is nan at step 0"):
        aarl_real.train_real(target, draft, ref, clips[:1], prompts[:1], dataclasses.replace(CFG, beta=float("nan")), IDS)


def test_command_line_end_to_end(setup, folder, tmp_path, capsys):
    target, sft, root, _, _ = setup
    argv = ["--target", str(folder[2]), "--draft", sft, "--scenes", root, "--out", str(tmp_path), "--per-update", "3"]
    res = aarl_real.main(argv + FLAGS)
    draft = checkpoint.load(res["out"], target=target)
    assert res["out"] == str(tmp_path / "draft_aarl_s0") and res["scenes"] == 3
    sd = checkpoint.load(sft, target=target).state_dict()
    assert any(not torch.equal(v, sd[k]) for k, v in draft.state_dict().items())
    with pytest.raises(SystemExit):  # an existing checkpoint is never replaced
        aarl_real.main(argv + FLAGS)
    assert "refusing to replace it" in capsys.readouterr().err


def test_a_diverged_update_saves_no_draft(setup, folder, tmp_path, capsys):
    """An infinite update: stopped after it, no draft (issue #33: "draft saved" with a NaN draft); --lr 1e39 (finite,
    past float32 in AdamW): one line, no draft."""
    target, sft, root, clips, prompts = setup
    draft, ref = checkpoint.load(sft, target=target), checkpoint.load(sft, target=target)
    with pytest.raises(FloatingPointError, match="is NaN / inf after the update at step 0"):
        aarl_real.train_real(target, draft, ref, clips[:1], prompts[:1], dataclasses.replace(CFG, lr=float("inf")), IDS)
    with pytest.raises(SystemExit) as e:
        aarl_real.main(["--target", str(folder[2]), "--draft", sft, "--scenes", root, "--out", str(tmp_path / "o"),
                        "--per-update", "1", "--lr", "1e39"] + FLAGS)
    assert e.value.code == 2 and "overflows float32" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o" / "draft_aarl_s0")


def test_a_stale_draft_of_an_own_target_gets_the_own_target_advice(setup, folder, tmp_path):
    """A draft of another Alpamayo target: the error names real.distill, not train.py / rsd.py (issue #33)."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    target, sft, _, _, _ = setup
    shutil.copytree(sft, tmp_path / "d")
    path = str(tmp_path / "d" / checkpoint.WEIGHTS)
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()[checkpoint.KEY])
    meta["target"]["weights"] = "0" * 16  # distilled from another target
    save_file(load_file(path), path, metadata={checkpoint.KEY: json.dumps(meta)})
    with pytest.raises(ValueError, match=rf"stale draft: .*python -m real.distill --target {folder[2]} --scenes"):
        checkpoint.load(str(tmp_path / "d"), target=target)


def test_bad_inputs_are_named(setup, folder, tmp_path, capsys):
    target, sft, root, _, _ = setup
    folder[0].save_pretrained(tmp_path / "plain")  # a Qwen3-VL folder: no action expert
    cases = [(["--target", str(folder[2]), "--scenes", root, "--out", str(tmp_path)], "--draft"),
             (["--target", str(folder[2]), "--draft", str(tmp_path / "nope"), "--scenes", root, "--out", str(tmp_path)],
              "no such folder"),
             (["--target", str(tmp_path / "plain"), "--draft", sft, "--scenes", root, "--out", str(tmp_path / "o")],
              "no action expert"),
             (["--target", str(folder[2]), "--draft", sft, "--scenes", root, "--out", str(tmp_path), "--group", "1"],
              "--group must be >= 2")]
    for argv, words in cases:
        with pytest.raises(SystemExit):
            aarl_real.main(argv)
        assert words in capsys.readouterr().err, argv
    assert not os.path.exists(tmp_path / "o")  # the refused run left no --out behind (issue #33)
    with pytest.raises(SystemExit):  # writing into its inputs
        aarl_real.main(["--target", str(folder[2]), "--draft", sft, "--scenes", root, "--out", root + "/run"])
    assert "lies inside --scenes" in capsys.readouterr().err


def test_a_killed_run_resumes_exactly(setup, tmp_path, monkeypatch):
    """2 updates straight == a run killed right after its state at update 1, resumed in a fresh call (the draft,
    AdamW and the rollouts' generator restored); a resume with another lr is refused by name."""
    target, sft, _, clips, prompts = setup
    cfg = dataclasses.replace(CFG, steps=2, save_every=1, group=2)
    state = str(tmp_path / "draft_aarl_s0.state.pt")

    def run(state_path, c=cfg):
        draft, ref = checkpoint.load(sft, target=target), checkpoint.load(sft, target=target)
        return aarl_real.train_real(target, draft, ref, clips, prompts, c, IDS, state_path=state_path)

    straight = run(None)
    save = files.torch_save

    class Killed(Exception):
        pass

    def save_then_die(obj, path):
        save(obj, path)
        raise Killed

    monkeypatch.setattr(files, "torch_save", save_then_die)
    with pytest.raises(Killed):
        run(state)
    monkeypatch.setattr(files, "torch_save", save)
    assert torch.load(state, weights_only=True)["step"] == 1
    resumed = run(state)
    sft_draft = checkpoint.load(sft, target=target)
    for (name, a), b, c in zip(straight.named_parameters(), resumed.parameters(), sft_draft.parameters()):
        assert torch.equal(a, b), name
        assert not torch.equal(a, c.float()), f"{name} never moved"
    with pytest.raises(ValueError, match="other settings: lr"):
        run(state, dataclasses.replace(cfg, lr=1e-3))
