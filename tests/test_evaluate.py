"""Tests for evaluate.py: the batched greedy CoCs agree with batch-1 KV-cached decoding, the
statistics of speculative decoding with a perfect draft sit at the ceiling, batch size does not move
the metrics, and the attention diagnostic is exact.

Tiny model sizes (test_train's presets) keep the file fast on 2 CPU cores.

run: python -m pytest -q tests/test_evaluate.py
"""
import pytest
from test_train import TINY, TINY_DRAFT
import torch

import aarl
import driving
from driving import Data, grid_kwargs, vision_kwargs
import evaluate
import model as M
import speculate
import train as T


@pytest.fixture(autouse=True)
def tiny_presets(monkeypatch):
    monkeypatch.setitem(M.PRESETS, "test-tiny", TINY)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return driving.Tokenizer()


def tiny_target(tok, seed=0):
    torch.manual_seed(seed)
    return M.VLA(T.target_config(tok, "test-tiny")).eval()


def test_greedy_generation_equals_batch_one_decoding(tok):
    """evaluate.generate on a batch (greedy) == speculate.autoregressive on each prompt alone, up to <cot_end>."""
    target = tiny_target(tok)
    data = Data("val", 4, 0, tok)
    batch = next(data.batches(4))
    cocs = evaluate.greedy_coc(target, batch, tok.cot_end_id, max_new=10)
    for coc, prompt in zip(cocs, evaluate.scene_prompts(data.scenes, tok, "cpu")):
        alone = speculate.autoregressive(target, prompt, 10, stop_token=tok.cot_end_id)
        assert coc == alone.tokens


def test_rollout_mask_ends_at_the_first_stop(tok):
    """AARL's sampled rollouts: the mask is True up to and including each row's first stop token, False after it
    (the rows stop-padded), the tokens those of a decode without a stop token from the same seeds."""
    target = tiny_target(tok)
    draft = M.make_draft(target)
    batch = next(Data("val", 3, 0, tok, views=0).batches(3))
    P = int(batch["prompt_len"][0])
    ids = batch["input_ids"][:, :P]  # (S, P)
    embeds = target.embed(ids, **vision_kwargs(batch))  # (S, P, D)
    sampling = speculate.Sampling(2.0, seed=0)
    free = [r.tokens for r in speculate.autoregressive_batch(  # 12 tokens per row, no stop
        draft, {"input_ids": ids, **grid_kwargs(batch)}, 12, 2, sampling, embeds=embeds)]
    stop = free[0][3]                         # a token row 0 samples at step 3: its first stop is at step <= 3
    toks, mask = aarl.rollout(draft, embeds, batch, 2, sampling, 12, stop)
    assert toks.shape[0] == 6 and not bool(mask.all()) and bool(mask.any(1).all())
    for row, m, f in zip(toks.tolist(), mask.tolist(), free):
        first = f.index(stop) if stop in f else len(f) - 1
        assert row[:first + 1] == f[:first + 1] and all(t == stop for t in row[first + 1:])
        assert m == [True] * (first + 1) + [False] * (len(row) - first - 1)


def test_spec_stats_with_the_target_as_its_own_draft(tok):
    """A draft that is the target is never rejected: tau = the ceiling, alpha = 1, greedy match, and the
    routine share is everything but the target's one token per round."""
    target = tiny_target(tok)
    prompts = evaluate.scene_prompts(driving.make_split("val", 3, 0), tok, "cpu")
    stats = evaluate.spec_stats(target, {"self": target}, prompts, gamma=3, max_new=10, stop_token=tok.cot_end_id)
    s, base = stats["self"], stats[evaluate.TARGET_ONLY]
    assert s["greedy_match"] is True and s["tokens"] == base["tokens"]
    assert s["tau"] == pytest.approx(s["tau_ceiling"]) and s["alpha"] == 1.0
    rounds = s["n_tokens"] / s["tau"]
    # one target token per round, but where max_new cut a last round inside its accepted drafts (one per scene)
    assert 1 - rounds / s["n_tokens"] - 1e-9 <= s["routine_fraction"] <= 1 - (rounds - 3) / s["n_tokens"] + 1e-9
    assert base["tau"] == 1.0 and base["routine_fraction"] == 0.0
    assert evaluate.spec_stats(target, {"self": target}, prompts, 3, 10, tok.cot_end_id,
                               check_greedy=False)["self"]["greedy_match"] is None


def test_metrics_do_not_depend_on_the_batch_size(tok):
    target = tiny_target(tok)
    draft = M.make_draft(target, **TINY_DRAFT).eval()
    data = Data("val", 5, 0, tok)
    for model in (target, draft):
        assert evaluate.commitment_acc(model, target, data, 2) == evaluate.commitment_acc(model, target, data, 5)
    a = evaluate.evaluate_target(target, data, batch_size=2)
    b = evaluate.evaluate_target(target, data, batch_size=5)
    assert a["coc_exact"] == b["coc_exact"] and a["commitment_acc"] == b["commitment_acc"]
    assert a["ade"] == pytest.approx(b["ade"], rel=1e-5) and a["fde"] == pytest.approx(b["fde"], rel=1e-5)


def test_attention_probs_are_exact(tok):
    """The diagnostic's recomputed weights, applied to v and o_proj, give the layer's real output."""
    torch.manual_seed(0)
    target = M.VLA(T.target_config(tok, "test-tiny")).eval()
    draft = M.make_draft(target, **TINY_DRAFT).eval()
    data = Data("val", 4, 0, tok)
    batch = next(data.batches(4))
    embeds = target.embed(batch["input_ids"], **vision_kwargs(batch))
    history = M.make_draft(target, **{**TINY_DRAFT, "kind": "history"}).eval()  # its own mask: no image key
    for m, kw in ((target, vision_kwargs(batch)), (draft, dict(inputs_embeds=embeds)),
                  (history, dict(inputs_embeds=embeds, **grid_kwargs(batch)))):
        real = []
        hook = m.layers[0].self_attn.register_forward_hook(lambda mod, args, out: real.append((args, out)))
        probs = list(evaluate.attention_probs(m, batch["input_ids"], **kw))  # [(B, H, L, L)] per layer
        hook.remove()
        (x, cos, sin, *_), out = real[0]
        attn = m.layers[0].self_attn
        _, _, v = attn.project(x, cos, sin)
        v = v.repeat_interleave(attn.H // attn.Hk, 1)  # (B, H, L, hd)
        y = (probs[0] @ v.float()).transpose(1, 2).flatten(2)  # (B, L, H*hd)
        torch.testing.assert_close(attn.o_proj(y.to(out.dtype)), out, atol=1e-5, rtol=1e-4)
        assert torch.allclose(probs[0].sum(-1), torch.ones(()))
    image = evaluate.key_groups(batch["input_ids"], tok)["image"]  # (B, L)
    mass = (probs[0] * image[:, None, None, :]).sum(-1)  # (B, H, L): the history-only draft's image mass per query
    assert float(mass.transpose(1, 2)[~image].max()) == 0.0  # no text query reads an image key


def test_key_groups_partition_the_prompt(tok):
    batch = next(Data("val", 2, 0, tok).batches(2))
    g = evaluate.key_groups(batch["input_ids"], tok)
    total = g["image"].long() + g["history"].long() + g["text"].long()
    assert bool((total == 1).all())
    assert int(g["image"][0].sum()) == 12 + 24 * driving.WorldConfig().views and int(g["history"][0].sum()) == 48 + 2



def test_simulate_rounds_by_hand():
    """Rounds of greedy speculative decoding replayed from a match vector: each round emits the run of matches (at
    most gamma) plus the target's token, cut at the end of the output."""
    T, F = True, False
    assert evaluate.simulate_rounds([T, T, F, T, T], gamma=4) == (2, 4)      # [d d t] [d d]: the stop was drafted
    assert evaluate.simulate_rounds([T, T, F, T, T], gamma=1) == (3, 2)      # [d t] [t] [d t]
    assert evaluate.simulate_rounds([F, F, F], gamma=3) == (3, 0)            # the target writes every token
    assert evaluate.simulate_rounds([T] * 8, gamma=3) == (2, 6)              # [d d d t] [d d d t]: bonus tokens
    # an output of 5 tokens cut by max_new: the 2nd round's block is its first draft alone
    assert evaluate.simulate_rounds([T] * 5, gamma=3) == (2, 4)
    taus = evaluate.tau_by_gamma([[T, T, F, T, T], [F, F, F]], [1, 4])
    assert taus[4] == {"tau": 8 / 5, "routine_fraction": 4 / 8} and taus[1]["tau"] == 8 / 6


def test_k_continuations_sharing_a_prefill_equal_each_alone(tok):
    """action_rows with k = 2 CoCs of one scene (its prefill copied into both rows, KVCache.take_rows) gives each row
    the trajectory and logits of that CoC planned alone (k = 1)."""
    target = tiny_target(tok)
    batch = next(Data("val", 1, 0, tok).batches(1))
    prompt = {"input_ids": batch["input_ids"][:, :int(batch["prompt_len"][0])], **vision_kwargs(batch)}
    cocs, end = [[5, 6, tok.cot_end_id], [7, tok.cot_end_id]], (tok.cot_end_id, tok.traj_future_start_id)
    traj, logits, _ = evaluate.action_rows(target, prompt, cocs, end)
    for j, coc in enumerate(cocs):
        t1, l1, _ = evaluate.action_rows(target, prompt, [coc], end)
        torch.testing.assert_close(traj[j:j + 1], t1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[j:j + 1, :l1.shape[1]], l1, atol=1e-4, rtol=1e-4)


def test_a_shared_prefill_decodes_as_a_fresh_one():
    """evaluate.SharedPrefill (rsd.py's untimed decodes of every scene): a prompt's embedding and prefill computed once
    and copied, then every decoder (chain, tree, target-only, several rows of one prompt) gives the same SpecResult as
    with its own prefill, and the shared forward ran once per prompt."""
    from tiny_models import image_prompt, tiny_model
    from tree import TreeShape
    target = tiny_model()
    draft = M.make_draft(target, n_layers=1).eval()
    shared, calls = evaluate.SharedPrefill(target), []
    forward = target.forward
    target.forward = lambda *a, cache=None, **kw: calls.append(cache is not None and not any(cache.lengths)) or forward(
        *a, cache=cache, **kw)
    prompts = [image_prompt(seed=s) for s in range(2)]
    for p in prompts * 2:
        for decoder in (3, TreeShape(6, 3, 2)):
            assert evaluate.decode(shared, draft, p, decoder, 8, None) == evaluate.decode(target, draft, p, decoder, 8,
                                                                                          None)
        assert evaluate.decode(shared, None, p, 3, 8, None) == evaluate.decode(target, None, p, 3, 8, None)
        rows = speculate.speculative_batch(shared, draft, p, 3, 8, samples=2, sampling=speculate.Sampling(1.0, seed=3))
        assert rows == speculate.speculative_batch(target, draft, p, 3, 8, 2, speculate.Sampling(1.0, seed=3))
    # prefills run: the shared ones once per prompt, the plain ones every time (4 decodes, 2 passes, 2 prompts)
    assert sum(calls) == len(prompts) + 4 * 2 * 2
