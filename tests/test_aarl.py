"""Tests for aarl.py: the reward on a hand-made case, the exact KL, one policy-gradient step on
a bandit, the static reference never moving, the moving one resetting every `refresh` updates,
a finite loss on an all-equal-reward group, and the run folder's lock and argument checks.

run: python -m pytest -q tests/test_aarl.py
"""
import copy

import pytest
from test_train import TINY, TINY_DRAFT, held_lock  # noqa: F401  (tiny sizes shared with the train tests)
import torch

import aarl
import driving
import model as M
from ops import files
import train as T


@pytest.fixture(autouse=True)
def tiny_presets(monkeypatch):
    monkeypatch.setitem(M.PRESETS, "test-tiny", TINY)
    torch.set_num_threads(1)


class StubCache:
    def take_rows(self, src, rows):
        pass


class StubTarget(torch.nn.Module):
    """A 'target' whose argmax at every position is token 7 and whose trajectory is all zeros."""

    def __init__(self, V=16, traj_len=4):
        super().__init__()
        self.V, self.traj_len = V, traj_len
        self.w = torch.nn.Parameter(torch.zeros(()))

    def new_cache(self, batch, max_len):
        return StubCache()

    def forward(self, ids, return_hidden=False, cache=None, logits_to_keep=0, **_):
        logits = torch.zeros(*ids.shape, self.V)
        logits[..., 7] = 1.0
        logits = logits[:, -logits_to_keep:] if logits_to_keep else logits
        return (logits, torch.zeros(*ids.shape, 3)) if return_hidden else logits

    def traj(self, h):
        return torch.zeros(h.shape[0], self.traj_len, 2)


def test_reward_by_hand():
    tok = driving.Tokenizer()
    G, P = 2, 3  # one scene, two drafted CoCs, a 3-token prompt
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "prompt_len": torch.tensor([P]),
             "pixel_values_videos": torch.zeros(4, 5), "video_grid_thw": torch.tensor([[1, 2, 2]]),
             "traj": torch.tensor([[[3.0, 4.0]] * 4])}  # every waypoint 5 m from the stub's zeros
    end = tok.cot_end_id
    toks = torch.tensor([[7, 7, 7, end], [7, 5, 7, end]])  # row 1 disagrees at its 2nd token
    mask = torch.ones_like(toks, dtype=torch.bool)
    r, ade, agree = aarl.reward(StubTarget(V=len(tok)), batch, toks, mask, G, tok, agree_weight=0.5)
    assert torch.allclose(ade, torch.tensor([5.0, 5.0]))
    # agree = tokens equal to the stub's argmax (7) over the CoC length (4 incl. <cot_end>)
    assert torch.allclose(agree, torch.tensor([3 / 4, 2 / 4]))
    assert torch.allclose(r, -ade + 0.5 * agree)


def test_kl_is_zero_for_the_reference_itself_and_positive_otherwise():
    logq = torch.log_softmax(torch.randn(3, 5, 11), -1)
    mask = torch.ones(3, 5)
    assert aarl.exact_kl(logq, logq, mask).abs().item() < 1e-7
    other = torch.log_softmax(torch.randn(3, 5, 11), -1)
    assert aarl.exact_kl(logq, other, mask).item() > 0


def test_kl_of_reduced_vocabulary_drafts_is_the_kl_over_their_set():
    """Two drafts over the same reduced set (-inf elsewhere, model.VLA.head): KL(q || r) is the KL of their K
    columns, with finite gradients (0 log 0 = 0, not -inf - (-inf))."""
    ids = torch.tensor([0, 3, 4, 9])
    small = torch.randn(3, 5, 4, requires_grad=True)  # (N, T, K)
    ref = torch.randn(3, 5, 4)
    full = lambda x: torch.full((3, 5, 11), float("-inf")).index_copy(-1, ids, x)  # noqa: E731  (N, T, V)
    logq, logr = torch.log_softmax(full(small), -1), torch.log_softmax(full(ref), -1)
    mask = torch.ones(3, 5)
    kl = aarl.exact_kl(logq, logr, mask)
    q, r = torch.log_softmax(small, -1), torch.log_softmax(ref, -1)
    torch.testing.assert_close(kl, (q.exp() * (q - r)).sum(-1).mean())
    kl.backward()
    assert torch.isfinite(small.grad).all() and small.grad.abs().sum() > 0


def test_one_update_moves_the_bandit_toward_the_rewarded_action():
    """A 4-armed bandit policy, G samples, reward 1 for arm 2: one step raises q(arm 2)."""
    torch.manual_seed(0)
    logits = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([logits], lr=0.5)
    G = 16
    toks = torch.multinomial(torch.softmax(logits.detach(), -1), G, replacement=True)  # (G,)
    r = (toks == 2).float()
    adv = aarl.group_advantages(r, G)
    logq = torch.log_softmax(logits, -1).expand(G, 1, 4)  # (N=G, T=1, V)
    loss, _ = aarl.aarl_loss(logq, logq.detach(), toks[:, None], torch.ones(G, 1), adv, beta=0.1)
    before = torch.softmax(logits.detach(), -1)[2].item()
    loss.backward()
    opt.step()
    assert torch.softmax(logits.detach(), -1)[2].item() > before + 0.05


def test_all_equal_rewards_give_a_finite_zero_gradient_loss():
    adv = aarl.group_advantages(torch.full((8,), 3.0), 4)
    assert torch.equal(adv, torch.zeros(8))
    logq = torch.log_softmax(torch.randn(8, 3, 5, requires_grad=True), -1)
    loss, kl = aarl.aarl_loss(logq, logq.detach(), torch.zeros(8, 3, dtype=torch.long), torch.ones(8, 3), adv, 0.1)
    assert torch.isfinite(loss) and torch.isfinite(kl)


def tiny_setup(tok):
    torch.manual_seed(0)
    target = M.VLA(T.target_config(tok, "test-tiny")).eval()
    return target, M.make_draft(target, **TINY_DRAFT), driving.Data("train", 16, 0, tok, views=0)


def state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_static_reference_never_changes_and_policy_does():
    tok = driving.Tokenizer()
    target, draft, data = tiny_setup(tok)
    ref = copy.deepcopy(draft)
    ref_before, draft_before, target_before = state(ref), state(draft), state(target)
    cfg = aarl.AARLConfig(steps=2, scenes=2, group=3, max_new=6, lr=1e-2, views=0)
    aarl.train_aarl(target, draft, data, cfg, ref=ref)
    assert all(torch.equal(ref.state_dict()[k], v) for k, v in ref_before.items())
    assert all(torch.equal(target.state_dict()[k], v) for k, v in target_before.items())
    assert any(not torch.equal(draft.state_dict()[k], v) for k, v in draft_before.items())


def test_moving_reference_moves_every_refresh_updates():
    """Its KL grows from 0 while the policy moves away, is 0 again right after a reset, and the reset reference is
    the policy of that moment: unlike a reset every update, it anchors between resets."""
    tok = driving.Tokenizer()
    target, draft, data = tiny_setup(tok)
    ref = copy.deepcopy(draft)
    logs = []
    cfg = aarl.AARLConfig(steps=12, scenes=2, group=3, max_new=6, lr=1e-2, reference="moving", refresh=10, views=0)
    aarl.train_aarl(target, draft, data, cfg, ref=ref, log=logs.append)
    kl = [s["kl"] for s in logs]
    assert kl[0] == pytest.approx(0, abs=1e-6) and kl[9] > 1e-4          # drifted from the SFT draft by update 10
    assert kl[10] == pytest.approx(0, abs=1e-6) and kl[11] > 0            # reset at update 11, then drifting again
    assert any(not torch.equal(ref.state_dict()[k], v) for k, v in state(copy.deepcopy(draft)).items())
    with pytest.raises(ValueError, match="refresh"):
        aarl.train_aarl(target, draft, data, aarl.AARLConfig(reference="moving", refresh=1))


def test_bad_reference_is_rejected():
    with pytest.raises(ValueError, match="reference"):
        aarl.train_aarl(None, None, None, aarl.AARLConfig(reference="frozen"))


def test_run_locks_its_folder_and_checks_its_arguments_before_any_work(tmp_path, capsys):
    """A second writer into the folder of the draft it would save stops at once, naming the first; a NaN weight or an
    unknown device stops at parse time."""
    with held_lock(tmp_path, command="python aarl.py --seed 0"):
        with pytest.raises(files.FolderLocked, match=r"pid 4242 on elsewhere \(`python aarl.py --seed 0`"):
            aarl.run(aarl.AARLConfig(), str(tmp_path), out=str(tmp_path / "draft_aarl_s0"))
    for argv, msg in ((["--agree-weight", "nan"], "agree_weight must be a finite number >= 0, got nan"),
                      (["--device", "tpu"], "unknown device 'tpu'")):
        with pytest.raises(SystemExit):
            aarl.main(["--run", str(tmp_path)] + argv)
        assert msg in capsys.readouterr().err
