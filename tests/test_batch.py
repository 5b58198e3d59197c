"""Tests for speculative decoding of B rows at once (speculate.speculative_batch, Chain and tree decoders,
speculate.autoregressive_batch): greedy rows of different prompt lengths equal their own target-only decodes token for
token (fp32), chain and tree, eager and on the compiled path's steps; sampled rows are each the row a batch-1 decode
with that row's seed gives, follow the target's law, and draw independently of each other.

Chi-square tests: level 1e-3 per check, so a correct implementation fails each with probability 1e-3 over the random
draws (about 6e-3 for the six checks of correct samplers here); each negative control (the verifier handed the wrong
q; one draw reused at every node of a tree; every row given the same seed) must fail its check at the same N. The
seeds are fixed, so a run is deterministic; the rates apply to a change of seed or draw order.

run: python -m pytest -q tests/test_batch.py
"""
import pytest
from test_speculate import (
    SIGNIFICANCE,
    chi_square,
    drafts_for,
    o1_init,
    seeded_rows,
    tiny_target,
    vla_greedy_reference,
    vla_prompts,
    wrong_q
)
from test_tree import reused_draw, small_vla
import torch

import model
from ops import compiled
import speculate
from evaluate import stack_prompts
from speculate import Sampling, autoregressive_batch, speculative_batch
from tree import TreeShape

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = TreeShape(12, 4, 3)


def decoders(target, draft, B, path):
    """The models as each path runs them: as they are, or compiled.CompiledSteps of B rows (eager: its persistent caches
    and padded steps, what torch.compile compiles)."""
    if path == "eager":
        return target, draft
    return (compiled.CompiledSteps(target, 96, (1, 5, SHAPE.nodes + 1), batch=B, compile=False),
            compiled.CompiledSteps(draft, 96, (1, 2, SHAPE.width), batch=B, compile=False))


@pytest.mark.parametrize("path", ["eager", "compiled steps"])
def test_greedy_rows_of_different_lengths_equal_their_own_decodes(path):
    """Rows of 2, 5 and 27 tokens (the last with an image and a video), left-padded into one batch; B = 2 and B = 6
    (three prompts x two samples): every row's tokens equal its prompt's cache-free greedy decode, chain (gamma 4) and
    tree, with every draft, a stop token that ends rows at different rounds, and max-new inside an accepted path."""
    target = tiny_target()
    prompts = list(vla_prompts().values())  # 5, 2 and 27 tokens
    refs = [vla_greedy_reference(target, p, 20) for p in prompts]
    stop = refs[1][6]  # ends the second row early (and any other row where it comes up)

    def cut(ref, n):
        ref = ref[:n]
        return ref[:ref.index(stop) + 1] if stop in ref else ref

    for rows, samples in (([0, 2], 1), ([0, 1, 2], 2)):
        batch, B = stack_prompts([prompts[r] for r in rows]), len(rows) * samples
        for name, draft in drafts_for(target).items():
            t, d = decoders(target, draft, B, path)
            for n in (20, 7):
                want = [cut(refs[r], n) for r in rows for _ in range(samples)]
                chain = speculative_batch(t, d, batch, 4, n, samples=samples, stop_token=stop)
                assert [r.tokens for r in chain] == want, (name, rows, n, "chain")
                tree = speculative_batch(t, d, batch, SHAPE, n, samples=samples, stop_token=stop)
                assert [r.tokens for r in tree] == want, (name, rows, n, "tree")
        plain = autoregressive_batch(t, batch, 20, samples=samples, stop_token=stop)
        assert [r.tokens for r in plain] == [cut(refs[r], 20) for r in rows for _ in range(samples)], rows


def test_compiled_rows_equal_their_own_decodes(monkeypatch):
    """The compiled path (dynamo's graphs run by its eager backend: tracing, guards and padding at test speed) on
    three rows of different lengths, chain and tree: each row equals its own target-only decode."""
    torch._dynamo.reset()
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", fullgraph=True,
                                                                    dynamic=False))
    target = tiny_target()
    draft = drafts_for(target)["perturbed"]
    prompts = list(vla_prompts().values())
    batch = stack_prompts(prompts)
    t = compiled.CompiledSteps(target, 96, (1, 5, SHAPE.nodes + 1), batch=3)
    d = compiled.CompiledSteps(draft, 96, (1, 2, SHAPE.width), batch=3)
    want = [vla_greedy_reference(target, p, 16) for p in prompts]
    assert [r.tokens for r in speculative_batch(t, d, batch, 4, 16)] == want
    assert [r.tokens for r in speculative_batch(t, d, batch, SHAPE, 16)] == want


def test_a_row_does_not_change_with_its_batch():
    """Sampled rows (T = 0.6, top-p 0.98, Alpamayo's defaults): row r of a batch seeded s is, token for token and
    round for round, the batch-1 decode seeded s + r, for the chain, the tree and target-only decoding; rows sharing
    a prompt are distinct samples. Bit for bit here (fp32): each row draws from its own generator, in the batch-1
    order, and its logits equal the batch-1 ones to rounding (a token could differ only where a draw lands within
    rounding of a boundary)."""
    target = tiny_target()
    draft = drafts_for(target)["perturbed"]
    prompt = vla_prompts()["image+video"]
    kw = dict(temperature=0.6, top_p=0.98)  # Alpamayo-R1's
    for one, many, g in ((speculate.speculative, speculative_batch, 4),
                         (speculate.speculative, speculative_batch, SHAPE)):
        rows = many(target, draft, prompt, g, 20, samples=4, sampling=Sampling(**kw, seed=7))
        alone = [one(target, draft, prompt, g, 20, sampling=Sampling(**kw, seed=7 + r)) for r in range(4)]
        assert [(r.tokens, r.accepted) for r in rows] == [(r.tokens, r.accepted) for r in alone], g
        assert len({tuple(r.tokens) for r in rows}) > 1  # the samples differ
    rows = autoregressive_batch(target, prompt, 20, samples=4, sampling=Sampling(**kw, seed=7))
    assert [r.tokens for r in rows] == [speculate.autoregressive(target, prompt, 20, Sampling(**kw, seed=7 + r)).tokens
                                        for r in range(4)]


def exact_first3(target, prompt_ids, temperature):
    """The target's exact law of its first 3 sampled tokens after prompt_ids (cache-free forwards) -> (V^3,)."""
    V = target.cfg.vocab_size

    def probs(seq):
        with torch.no_grad():
            return speculate.process_logits(target(torch.tensor([prompt_ids + seq]))[0, -1], temperature)

    return torch.einsum("a,ab,abc->abc", probs([]), torch.stack([probs([a]) for a in range(V)]),
                        torch.stack([torch.stack([probs([a, b]) for b in range(V)]) for a in range(V)])).reshape(-1)


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_sampled_rows_follow_the_target_law_independently(kind, monkeypatch):
    """N = 1000 batches of two rows (one prompt, samples=2, batch b seeded 2b: every row its own seed; run as one batch
    by seeded_rows) on a small VLA and a 1-layer draft: each row's first 3 tokens ~ the target's law (chi-square,
    level 1e-3), and the pair of the two rows' first tokens ~ the product of their laws (independence). Negative
    controls at the same N: the chain's verifier handed the wrong q, the tree's one reused draw per round (the law),
    a prompt's two rows given one seed (independence)."""
    target = small_vla(0)
    torch.manual_seed(3)
    draft = model.make_draft(target, n_layers=1).eval()
    o1_init(draft, 4)
    V, N, ids, temperature = 5, 1000, [0, 3], 0.8
    expected = exact_first3(target, ids, temperature)
    first = expected.view(V, V * V).sum(-1)  # (V,) the first token's law
    g = 2 if kind == "chain" else TreeShape(4, 2, 2)

    def run():
        toks = seeded_rows(speculative_batch, target, draft, dict(input_ids=torch.tensor([ids])), g, 3, 2 * N,
                           samples=2, temperature=temperature)  # (2N, 3): batch b's rows are 2b and 2b + 1
        return toks.view(N, 2, 3)

    def law(toks):  # each row's chi-square p-value for its first 3 tokens
        return [chi_square(torch.bincount(toks[:, r] @ torch.tensor([V * V, V, 1]), minlength=V ** 3), expected)[2]
                for r in range(2)]

    def pair(toks):  # the two rows' first tokens against the product of their laws
        return chi_square(torch.bincount(toks[:, 0, 0] * V + toks[:, 1, 0], minlength=V * V),
                          torch.outer(first, first).reshape(-1))[2]

    toks = run()
    p_law, p_pair = law(toks), pair(toks)
    print(f"{kind} rows: law p = {p_law}, independence p = {p_pair:.3g}")
    assert min(p_law) > SIGNIFICANCE and p_pair > SIGNIFICANCE
    with monkeypatch.context() as m:  # the law's control
        if kind == "chain":
            honest = speculate.verify_sample
            m.setattr(speculate, "verify_sample", lambda d, q, p, g, also=None: honest(d, wrong_q(q), p, g, also))
        else:
            m.setattr(speculate, "sample", reused_draw)
        bad = law(run())
    print(f"{kind} law control: p = {bad}")
    assert max(bad) < SIGNIFICANCE
    monkeypatch.setattr(speculate.Sampling, "generators", lambda self, dev, rows=1: [  # a prompt's 2 rows: one seed
        torch.Generator(device=dev).manual_seed(self.seed + r - r % 2) for r in range(rows)])
    same = run()
    print(f"{kind} independence control: p = {pair(same):.3g}")
    assert pair(same) < SIGNIFICANCE


def test_batch_errors():
    """Rows that cannot be batched are refused, naming the problem."""
    target = tiny_target()
    prompts = vla_prompts()
    with pytest.raises(ValueError, match=r"stacks batch-1 prompts .* prompts \[1\] are not"):
        stack_prompts([prompts["text"], stack_prompts([prompts["text"], prompts["two tokens"]])])
    st = compiled.CompiledSteps(target, 96, (1, 5), batch=2, compile=False)
    with pytest.raises(ValueError, match="these compiled steps decode batch 2, asked for batch 3"):
        speculative_batch(st, st, prompts["text"], 4, 8, samples=3)
