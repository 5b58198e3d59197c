"""Tests for the reduced-vocabulary draft head (model.VLA.head, ModelConfig.draft_vocab, train.select_draft_vocab):
the kept rows equal the slow gather and follow the target's head, speculative decoding with such a draft stays
lossless (greedy: token for token in fp32, with the target emitting tokens outside the draft's set; sampling: the
chi-square harness of tests/test_speculate.py), checkpoints round-trip the ids, distillation stays finite, and bad
sizes are refused by name.

Chi-square tests: level 1e-3 per check, as in tests/test_speculate.py, so a correct implementation fails each of
the 2 checks here with probability 1e-3 over the random draws (about 2e-3 together); each negative control (a
verifier that takes the draft's set for the whole vocabulary) fails its check with a p-value below 1e-25 at the
same N. The seeds are fixed, so a run is deterministic.

run: python -m pytest -q tests/test_draft_vocab.py
"""
import copy
import json

import pytest
from safetensors.torch import load_file, save_file
from test_speculate import (SIGNIFICANCE, ToyLM, chi_square, joint_first3, markov_pair, prompt_of, seeded_rows,
                            vla_prompts)
import torch

import model as M
from ops import checkpoint, compiled
import speculate
from speculate import Sampling, autoregressive, process_logits, speculative
from tiny_models import tiny_model
import train as T

pytestmark = pytest.mark.usefixtures("one_thread")

EVEN = torch.arange(0, 97, 2)  # the reduced set of the tests: 49 of the tiny vocabulary's 97 ids


def full_copy_draft(target, vocab_ids):
    """A draft with the target's own decoder weights (full depth, M-RoPE) and a reduced head: wherever the target's
    argmax is in the set the draft proposes it, and wherever it is not the draft cannot."""
    draft = M.make_draft(target, n_layers=target.cfg.n_layers, kind="mrope", vocab_ids=vocab_ids).eval()
    draft.layers.load_state_dict(target.layers.state_dict())
    draft.norm.load_state_dict(target.norm.state_dict())
    return draft


# ---- the head ----


@torch.no_grad()
def test_reduced_head_is_the_full_heads_columns():
    """Logits at the K ids equal a full-head draft's with the same weights, -inf elsewhere; the kept rows (fast path)
    equal a fresh gather (the slow path, taken when the target's head takes gradients)."""
    target = tiny_model()
    torch.manual_seed(1)
    reduced = M.make_draft(target, n_layers=1, hidden_size=32, vocab_ids=EVEN).eval()
    full = M.make_draft(target, n_layers=1, hidden_size=32).eval()
    full.load_state_dict({k: v for k, v in reduced.state_dict().items() if k != "vocab_ids"})
    x = torch.randint(10, 80, (2, 7))
    embeds = target.embed(x)  # (2, 7, D)
    a, b = reduced(x, inputs_embeds=embeds), full(x, inputs_embeds=embeds)  # (2, 7, V) each
    odd = torch.ones(97, dtype=torch.bool)
    odd[EVEN] = False
    torch.testing.assert_close(a[..., EVEN], b[..., EVEN], rtol=0, atol=1e-5)
    assert bool((a[..., odd] == float("-inf")).all())
    h = torch.randn(3, 64)
    slow = torch.nn.functional.linear(h, target.lm_head.weight[EVEN])  # (3, K)
    torch.testing.assert_close(reduced.head(h)[:, EVEN], slow, rtol=0, atol=0)


def test_gradient_path_reaches_only_the_sets_rows():
    target = tiny_model()
    draft = M.make_draft(target, n_layers=1, vocab_ids=EVEN)
    h = torch.randn(4, 64)
    draft.head(h)[:, EVEN].sum().backward()  # the target's head takes gradients: the gather path
    g = target.lm_head.weight.grad  # (V, D)
    assert bool(g[EVEN].abs().sum(-1).gt(0).all()) and int(g.abs().sum(-1).gt(0).sum()) == len(EVEN)


@torch.no_grad()
def test_kept_rows_follow_the_targets_head():
    """The kept copy is gathered again after the target's head is written in place, after a dtype change of target
    and draft, for a deepcopy, and after set_vocab."""
    target = tiny_model()
    draft = M.make_draft(target, n_layers=1, vocab_ids=EVEN).eval()
    h = torch.randn(2, 64)
    ref = lambda: torch.nn.functional.linear(h.to(target.lm_head.weight.dtype), target.lm_head.weight[EVEN])  # noqa
    torch.testing.assert_close(draft.head(h)[:, EVEN], ref(), rtol=0, atol=0)
    target.lm_head.weight.mul_(2.0)
    torch.testing.assert_close(draft.head(h)[:, EVEN], ref(), rtol=0, atol=0)
    target.to(torch.float64), draft.to(torch.float64)
    out = draft.head(h.double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out[:, EVEN], ref(), rtol=0, atol=0)
    twin = copy.deepcopy(draft)
    assert twin.lm_head is target.lm_head and torch.equal(twin.head(h.double()), out)
    other = torch.arange(48, 97)  # as many ids (set_vocab keeps K), another set
    draft.set_vocab(other)
    torch.testing.assert_close(draft.head(h.double())[:, other],
                               torch.nn.functional.linear(h.double(), target.lm_head.weight[other]), rtol=0, atol=0)


def test_process_logits_with_minus_inf_outside_the_set():
    """A reduced draft's row: the probabilities over the set are those of its K logits alone (temperature, top-k with
    k below and above K, top-p), 0 outside it, never NaN."""
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([1, 4, 5, 8])
    small = 2 * torch.randn(3, 4, generator=g)  # (rows, K)
    full = torch.full((3, 10), float("-inf")).index_copy(-1, ids, small)  # (rows, V)
    for t, k, p, k_small in ((1.0, None, None, None), (0.5, 2, None, 2), (1.3, 7, None, None),
                             (0.8, None, 0.7, None), (1e-30, 3, 0.9, 3), (0.0, None, None, None)):
        got = process_logits(full, t, k, p)
        assert not bool(got.isnan().any())
        torch.testing.assert_close(got[:, ids], process_logits(small, t, k_small, p))
        assert float(got.sum(-1).sub(1).abs().max()) < 1e-6 and int((got > 0).sum()) == int((got[:, ids] > 0).sum())


# ---- speculative decoding stays lossless ----


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_with_a_reduced_draft_equals_target_only(gamma):
    """fp32 greedy: speculative decoding with a reduced-head draft emits target-only decoding's tokens, on prompts
    whose output holds tokens outside the draft's set (the target's own corrections); the draft never proposes one."""
    target = tiny_model()
    torch.manual_seed(1)
    drafts = {"random": M.make_draft(target, n_layers=1, hidden_size=32, vocab_ids=EVEN).eval(),
              "copy": full_copy_draft(target, EVEN)}
    outside = 0
    for pname, prompt in vla_prompts().items():
        ref = autoregressive(target, prompt, 24).tokens
        outside += sum(t % 2 for t in ref)
        for dname, draft in drafts.items():
            res = speculative(target, draft, prompt, gamma, 24)
            assert res.tokens == ref, (pname, dname, gamma)
            assert all(t % 2 == 0 for t, d in zip(res.tokens, res.from_draft) if d), (pname, dname)
            if dname == "copy":  # the target's own decoder: a round stops short only at a token outside the set
                pos = 0
                for n in res.blocks:
                    if n - 1 < min(gamma, 24 - pos - 1):
                        assert res.tokens[pos + n - 1] % 2 == 1, (pname, gamma, pos, n)
                    pos += n
    assert outside >= 3  # the prompts do exercise tokens outside the set


def test_sampling_with_a_reduced_draft_runs_on_the_vla():
    """Sampled decoding (temperature 1, top-k, top-p) with a reduced VLA draft: the draft's accepted tokens are in its
    set, the target supplies the others, and no -inf logit is taken for an overflow."""
    target = tiny_model()
    draft = full_copy_draft(target, EVEN)
    res = speculative(target, draft, vla_prompts()["text"], 4, 40, Sampling(1.0, top_k=30, top_p=0.95, seed=0))
    assert len(res.tokens) == 40 and res.n_accepted > 0
    assert all(t % 2 == 0 for t, d in zip(res.tokens, res.from_draft) if d)
    assert any(t % 2 for t in res.tokens)


def reduced_toy(q_logits, ids):
    """A toy Markov draft whose head covers only `ids`: -inf logits elsewhere, as VLA.head writes them."""
    masked = torch.full_like(q_logits, float("-inf"))
    masked[:, ids] = q_logits[:, ids]
    draft = ToyLM(masked)
    draft.vocab_ids = ids  # speculate.check_finite: the -inf outside the set are by construction
    return draft


@pytest.mark.parametrize("temperature,top_k,top_p,gamma", [(1.0, None, None, 3), (0.7, 3, 0.9, 2)])
def test_sampling_with_a_reduced_draft_is_lossless(temperature, top_k, top_p, gamma, monkeypatch):
    """The whole loop, a decode per sample with its own seed (seeded_rows): with a draft that covers 2 of the 4 ids,
    the first 3 tokens still follow the target chain (chi-square, level 1e-3, N = 6000): the residual max(0, p - q)
    supplies the ids outside the set. Negative control: a verifier that restricts p to the draft's set is rejected."""
    V, x0, N = 4, 1, 6000
    ids = torch.tensor([0, 2])
    p_logits, q_logits = markov_pair(V, seed=13)
    target, draft = ToyLM(p_logits), reduced_toy(q_logits, ids)
    P = process_logits(p_logits, temperature, top_k, top_p)
    assert float(P[:, [1, 3]].sum(-1).min()) > 0.05  # the target does emit ids outside the set
    expected = joint_first3(P, x0)
    honest = speculate.verify_sample

    def restricted(d, q, p, g, also=None):  # the bug: p renormalised on the draft's set, as if it were the vocabulary
        p_s = torch.zeros_like(p)
        p_s[..., ids] = p[..., ids]
        return honest(d, q, p_s / p_s.sum(-1, keepdim=True), g, also)

    for name in ("correct", "p restricted to the set"):
        if name != "correct":
            monkeypatch.setattr(speculate, "verify_sample", restricted)
        toks = seeded_rows(speculate.speculative_batch, target, draft, prompt_of(0, x0), gamma, 3, N,
                           temperature=temperature, top_k=top_k, top_p=top_p)  # (N, 3)
        counts = torch.bincount(toks @ torch.tensor([V * V, V, 1]), minlength=V ** 3)
        stat, df, pval = chi_square(counts, expected)
        print(f"reduced draft T={temperature} top_k={top_k} top_p={top_p} gamma={gamma} {name}: N={N} "
              f"chi2={stat:.1f} df={df} p={pval:.3g}")
        assert (pval > SIGNIFICANCE) == (name == "correct"), (name, stat, df, pval)
        if name != "correct":
            assert pval < 1e-25


# ---- checkpoints ----


def test_checkpoint_round_trip_keeps_the_ids(tmp_path):
    target = tiny_model()
    torch.manual_seed(1)
    ids = torch.tensor([5, 40, 3, 77, 12, 60])
    draft = M.make_draft(target, n_layers=1, hidden_size=32, vocab_ids=ids).eval()
    checkpoint.save(draft, tmp_path / "d", target=target)
    meta = checkpoint.header(tmp_path / "d")[0]
    assert meta["config"]["draft_vocab"] == 6
    back = checkpoint.load(tmp_path / "d", target=target).eval()
    assert torch.equal(back.vocab_ids, ids) and back.lm_head is target.lm_head
    assert checkpoint.fingerprint(back) == checkpoint.fingerprint(draft)
    x = torch.randint(10, 80, (1, 5))
    with torch.no_grad():
        assert torch.equal(back(x, inputs_embeds=target.embed(x)), draft(x, inputs_embeds=target.embed(x)))
    full = M.make_draft(target, n_layers=1)  # the full head stores no ids: its folders are as before
    assert "vocab_ids" not in full.state_dict() and full.cfg.draft_vocab == 0
    # ids that cannot be a head's (a repeat) in a folder without a fingerprint: named, not used
    sd = load_file(tmp_path / "d" / "model.safetensors")
    sd["vocab_ids"] = torch.tensor([5, 40, 3, 77, 12, 5])
    save_file(sd, tmp_path / "d" / "model.safetensors", metadata={"rsd-vla": json.dumps(meta)})
    with pytest.raises(ValueError, match=r"model.safetensors: vocab_ids repeat token ids"):
        checkpoint.load(tmp_path / "d", target=target)


# ---- choosing the set, distilling, bad sizes ----


def test_select_draft_vocab():
    cocs = [[7, 7, 7, 2, 9], [9, 7, 4, 2], [4, 9, 7]]  # counts: 7 x5, 9 x3, 2 x2, 4 x2; stop token 1 never
    assert T.select_draft_vocab(cocs, 3, 1, 10).tolist() == [7, 9, 1]  # the stop token always in
    assert T.select_draft_vocab(cocs, 4, 2, 10).tolist() == [7, 9, 2, 4]  # stop frequent: the top 4 as they are
    assert T.select_draft_vocab(cocs, 5, 1, 10).tolist() == [7, 9, 2, 4, 1]  # ties by id
    assert T.select_draft_vocab(cocs, 1, 1, 10).tolist() == [1]
    assert sorted(T.select_draft_vocab(cocs, 10, 1, 10).tolist()) == list(range(10))  # K = V: every id
    assert T.select_draft_vocab(cocs, 6, 1, 10).tolist() == [7, 9, 2, 4, 0, 1]  # never-seen ids by id
    for k in (0, -3, 11):
        with pytest.raises(ValueError, match=f"draft vocabulary K must be an int in 1..10 .*, got {k}"):
            T.select_draft_vocab(cocs, k, 1, 10)


def test_distill_loss_of_a_reduced_draft_is_kl_to_p_on_the_set():
    """q is 0 outside the set, so the loss is KL(p_S || q) with p_S = p restricted and renormalised: finite, with
    finite gradients, and equal to that formula written out."""
    target = tiny_model()
    torch.manual_seed(1)
    draft = M.make_draft(target, n_layers=1, hidden_size=32, vocab_ids=EVEN)
    ids = torch.randint(10, 80, (2, 9))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[:, 4:] = True
    batch = {"input_ids": ids, "loss_mask": mask}
    with torch.no_grad():
        embeds = target.embed(ids)
        p_logp = torch.log_softmax(target(ids)[mask], -1)  # (N, V): mass outside the set too
    loss = T.distill_loss(draft, embeds, p_logp, batch)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in draft.parameters())
    p_s = p_logp[:, EVEN].softmax(-1)  # (N, K)
    q_s = draft(ids, inputs_embeds=embeds)[mask][:, EVEN].log_softmax(-1)  # (N, K)
    manual = (p_s * (p_s.log() - q_s)).sum(-1).mean()
    torch.testing.assert_close(loss, manual)


def test_bad_sizes_are_refused_by_name():
    target = tiny_model()
    for k, msg in ((-1, r"draft_vocab must be 0 \(the full head\) or .* 1..vocab_size 97, got -1"),
                   (98, r"1..vocab_size 97, got 98")):
        with pytest.raises(ValueError, match=msg):
            M.ModelConfig(vocab_size=97, shared_width=64, draft_vocab=k, vision=None)
    with pytest.raises(ValueError, match=r"draft_vocab 8: a reduced-vocabulary head is for drafts only"):
        M.ModelConfig(vocab_size=97, draft_vocab=8, vision=None)
    for ids, msg in ((torch.tensor([], dtype=torch.long), r"covers 1..97 token ids .*, got 0"),
                     (torch.arange(98), r"covers 1..97 token ids .*, got 98"),
                     (torch.tensor([3, 97]), r"token id 97, outside the vocabulary 0..96"),
                     (torch.tensor([3, 5, 3]), r"repeat token ids \(1 duplicates\)")):
        with pytest.raises(ValueError, match=msg):
            M.make_draft(target, n_layers=1, vocab_ids=ids)
    with pytest.raises(ValueError, match="this model has the full head"):
        M.make_draft(target, n_layers=1).set_vocab(EVEN)


def reduced_pair(target, compile):
    """A reduced-head full-depth copy of the target, both as compiled.CompiledSteps (steps of 1, 2, 4 tokens)."""
    draft = full_copy_draft(target, EVEN)
    return (compiled.CompiledSteps(target, 64, (1, 2, 4), compile=compile),
            compiled.CompiledSteps(draft, 64, (1, 2, 4), compile=compile))


def test_compiled_path_with_a_reduced_draft_equals_target_only():
    """The compiled path's steps (eager here: CompiledSteps, the path --compile takes) with a reduced-head draft:
    target-only decoding's tokens, the draft proposing only ids of its set."""
    target = tiny_model()
    st, sd = reduced_pair(target, compile=False)
    for pname, prompt in vla_prompts().items():
        res = speculative(st, sd, prompt, 3, 24)
        assert res.tokens == autoregressive(target, prompt, 24).tokens, pname
        assert all(t % 2 == 0 for t, d in zip(res.tokens, res.from_draft) if d), pname


@pytest.mark.slow
def test_compiled_decoding_with_a_reduced_draft_equals_target_only():
    """torch.compile'd steps with a reduced-head draft (its kept rows gathered outside the graph): the same."""
    target = tiny_model()
    st, sd = reduced_pair(target, compile=True)
    for pname, prompt in vla_prompts().items():
        assert speculative(st, sd, prompt, 3, 16).tokens == autoregressive(target, prompt, 16).tokens, pname
