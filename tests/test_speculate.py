"""Tests for speculate.py: verification rules, exactness, cache rollback, statistics.

Toy models implement the part of model.VLA's interface speculate.py relies on:
model(ids (B, T), cache=...) -> logits (B, T, V), step, cache.crop, cache.lengths,
new_cache, embed. Tests with the real model.VLA follow at the end.

Chi-square tests: significance level 1e-3 per check, i.e. a correct
implementation fails each check with probability 1e-3 over the random draws,
about 7e-3 for the 7 checks of correct samplers together (Pearson's asymptotic
law; cells expected below 5 are pooled). Every negative control fails its
check with p-values below 1e-25 at the same N. The seeds are fixed, so a run
is deterministic; the rates apply to a change of seed or of the draw order.

run: python -m pytest -q tests/test_speculate.py
"""
import math
from types import SimpleNamespace

import pytest
import torch

from evaluate import expected_speedup, expected_tau, measured_speedup, tau_ceiling
from experiments import probes
import model
from ops import compiled
from measure import timing
import speculate
from speculate import Sampling, autoregressive, process_logits, speculative, verify_greedy, verify_sample
from tree import TreeShape
import vision

SIGNIFICANCE = 1e-3

pytestmark = pytest.mark.usefixtures("one_thread")

# ---- toy models ----


class ToyCache(model.KVCache):
    """KVCache's committed lengths of B rows with no layers: the committed tokens (B, max_len) stand in for keys and
    values."""

    def __init__(self, batch, max_len):
        super().__init__(0, batch, 1, max_len, 1)
        self.tokens = torch.full((batch, max_len), -1, dtype=torch.long)  # (B, max_len)

    def move(self, src, dst):  # KVCache.move's contract on the tokens: row b's slots src[b] to dst[b] (B, m)
        rows = torch.arange(len(src))[:, None]  # (B, 1)
        self.tokens[rows, dst] = self.tokens[rows, src]


class ToyLM(torch.nn.Module):
    """logits_i = A[x_i] + B[h_i], h_i = sum_{j <= i} (j + 1) x_j mod V.

    B = 0 gives a Markov chain (exact distributions by enumeration); B != 0
    makes every logit depend on the whole prefix and its order, so a token the
    cache skipped or saw twice changes the output.
    """

    def __init__(self, A, B=None, image_token_id=None):
        super().__init__()
        V = A.shape[0]
        self.A, self.B = A, B  # (V, V) each; B None: a Markov chain
        self.config = SimpleNamespace(vocab_size=V, image_token_id=image_token_id)
        self.calls = 0

    def new_cache(self, batch=1, max_len=64, dtype=None, device=None):
        return ToyCache(batch, max_len)

    def embed(self, input_ids, **kw):
        return torch.nn.functional.one_hot(input_ids, self.A.shape[0]).float()  # (B, L, V)

    def logits(self, seq):
        """No-cache reference: logits at every position of seq (L,) -> (L, V)."""
        if self.B is None:
            return self.A[seq]
        V = self.A.shape[0]
        h = ((torch.arange(len(seq)) + 1) * seq).cumsum(0) % V  # (L,)
        return self.A[seq] + self.B[h]

    def step(self, input_ids, input_pos, cache, mask=None, positions=None):
        """VLA.step's contract: tokens (B, T) written at slots input_pos (B, T), the lengths not advanced."""
        self.calls += 1
        cache.tokens[torch.arange(len(input_ids))[:, None], input_pos] = input_ids
        if self.B is None:  # Markov: no need to look back
            return self.A[input_ids]  # (B, T, V)
        return torch.stack([self.logits(toks[:int(pos[-1]) + 1])[pos]
                            for toks, pos in zip(cache.tokens, input_pos)])  # (B, T, V)

    def forward(self, input_ids, inputs_embeds=None, cache=None, **kw):  # the prefill
        logits = self.step(input_ids, cache.slots(input_ids.shape[1]), cache)
        cache.commit(input_ids.shape[1])
        return logits


def seeded_rows(decode, target, draft, prompt, decoder, n, N, chunk=1000, samples=1, **sampling):
    """(N, n) tokens: row s is `decode`'s row of seed s (Sampling(**sampling, seed=s)), run `chunk` rows at a time as
    one batch of chunk / samples copies of the 1-row prompt, `samples` rows each: a row draws the same numbers
    whatever batch it runs in (Sampling.generators), so these are the N one-row decodes' tokens at a fraction of
    their Python overhead. The first rows are checked against one-row decodes."""
    out = []
    for start in range(0, N, chunk):
        copies = {k: v.repeat(chunk // samples, *[1] * (v.dim() - 1)) for k, v in prompt.items()}
        rows = decode(target, draft, copies, decoder, n, samples=samples, sampling=Sampling(**sampling, seed=start))
        out += [r.tokens for r in rows]
    for s in range(0, 2 * samples, samples):  # the first two prompts' rows, decoded as their own batch
        alone = decode(target, draft, prompt, decoder, n, samples=samples, sampling=Sampling(**sampling, seed=s))
        assert [r.tokens for r in alone] == out[s:s + samples], "a row's draws depend on its batch"
    return torch.tensor(out[:N])


def toy(V, seed, scale=2.0, prefix=True):
    g = torch.Generator().manual_seed(seed)
    A = scale * torch.randn(V, V, generator=g)
    B = scale * torch.randn(V, V, generator=g) if prefix else None
    return ToyLM(A, B)


def perturbed(model, eps, seed):
    g = torch.Generator().manual_seed(seed)
    return ToyLM(model.A + eps * torch.randn(model.A.shape, generator=g),
                 None if model.B is None else model.B + eps * torch.randn(model.B.shape, generator=g))


def greedy_reference(model, ids, n):
    """Target-only greedy without any cache: recompute the whole sequence per token."""
    seq = ids[0].clone()
    for _ in range(n):
        seq = torch.cat([seq, model.logits(seq)[-1].argmax().view(1)])
    return seq[ids.shape[1]:].tolist()


def prompt_of(*tokens):
    return dict(input_ids=torch.tensor([tokens]))


# ---- processed distributions ----


def test_process_logits_by_hand():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).log_softmax(-1)  # any shift of the logits is the same
    probs = torch.tensor([2.0, 1.0, 0.0, -1.0]).softmax(-1)  # about [0.64, 0.24, 0.09, 0.03]
    assert torch.equal(process_logits(logits, 0.0), torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(process_logits(logits, 1.0), probs)
    torch.testing.assert_close(process_logits(logits, 2.0), (torch.tensor([2.0, 1.0, 0.0, -1.0]) / 2).softmax(-1))
    top2 = torch.cat([probs[:2] / probs[:2].sum(), torch.zeros(2)])
    torch.testing.assert_close(process_logits(logits, 1.0, top_k=2), top2)
    # top_p keeps the smallest head with mass >= top_p: 0.64 < 0.7 needs the second token, 0.6 does not.
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=0.7), top2)
    torch.testing.assert_close(process_logits(logits, 1.0, top_p=0.6), torch.tensor([1.0, 0, 0, 0]))
    # Tiny temperatures and -inf logits stay finite (a known trap: inf - inf = NaN).
    masked = torch.tensor([3.0, -math.inf, 2.9, 1.0])
    for t in (1e-6, 1e-30, 1e-45):
        torch.testing.assert_close(process_logits(masked, t), torch.tensor([1.0, 0, 0, 0]))


def test_process_logits_matches_hugging_face():
    tr = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, 50, generator=g)
    for t, k, p in [(0.7, None, None), (1.0, 5, None), (1.3, None, 0.8), (0.8, 10, 0.9), (1.0, 50, 0.3)]:
        scores = tr.TemperatureLogitsWarper(t)(None, logits.clone())
        if k is not None:
            scores = tr.TopKLogitsWarper(k)(None, scores)
        if p is not None:
            scores = tr.TopPLogitsWarper(p)(None, scores)
        torch.testing.assert_close(process_logits(logits, t, k, p), scores.softmax(-1), atol=1e-6, rtol=1e-5)


# ---- verification on hand-built logits ----


def onehot_logits(tokens, V=8):
    return 10 * torch.nn.functional.one_hot(torch.tensor(tokens), V).float()  # (len, V)


def test_verify_greedy_by_hand():
    d = torch.tensor([3, 1, 4])
    n, nxt = verify_greedy(d, onehot_logits([3, 1, 4, 5]))  # perfect match: all accepted + bonus
    assert (int(n), int(nxt)) == (3, 5)
    n, nxt = verify_greedy(d, onehot_logits([3, 2, 4, 5]))  # mismatch at d_2: correction t_1; d_3 ignored
    assert (int(n), int(nxt)) == (1, 2)
    n, nxt = verify_greedy(d, onehot_logits([7, 1, 4, 5]))  # first token wrong
    assert (int(n), int(nxt)) == (0, 7)
    assert [int(x) for x in verify_greedy(torch.tensor([6]), onehot_logits([6, 2]))] == [1, 2]  # gamma = 1
    assert [int(x) for x in verify_greedy(torch.tensor([6]), onehot_logits([5, 2]))] == [0, 5]
    # batched: leading dims broadcast
    n, nxt = verify_greedy(torch.stack([d, d]), torch.stack([onehot_logits([3, 1, 4, 5]), onehot_logits([3, 2, 4, 5])]))
    assert n.tolist() == [3, 1] and nxt.tolist() == [5, 2]


def test_verify_sample_by_hand():
    g = torch.Generator().manual_seed(0)
    V = 6
    onehot = lambda toks: torch.nn.functional.one_hot(torch.tensor(toks), V).float()
    d = torch.tensor([2, 4, 1])
    # p == q on the drafts' own point masses: every draft accepted, bonus from p[gamma].
    n, nxt = verify_sample(d, onehot([2, 4, 1]), onehot([2, 4, 1, 5]), g)
    assert (int(n), int(nxt)) == (3, 5)
    # p gives d_2 probability 0: rejected there, next token from max(0, p - q) = point mass on 3.
    n, nxt = verify_sample(d, onehot([2, 4, 1]), onehot([2, 3, 1, 5]), g)
    assert (int(n), int(nxt)) == (1, 3)
    # first token rejected
    n, nxt = verify_sample(d, onehot([2, 4, 1]), onehot([0, 4, 1, 5]), g)
    assert (int(n), int(nxt)) == (0, 0)
    # gamma = 1, accepted and rejected
    assert [int(x) for x in verify_sample(torch.tensor([2]), onehot([2]), onehot([2, 0]), g)] == [1, 0]
    assert [int(x) for x in verify_sample(torch.tensor([2]), onehot([2]), onehot([1, 0]), g)] == [0, 1]
    # residual: p = (.5,.5,0..), q = (1,0,..), d = 0 accepted w.p. 1/2, else the residual is the point mass on 1.
    p = torch.zeros(2, V); p[0, :2] = 0.5; p[1, 5] = 1.0
    q = torch.zeros(1, V); q[0, 0] = 1.0
    outs = [tuple(int(x) for x in verify_sample(torch.tensor([0]), q, p, g)) for _ in range(400)]
    assert set(outs) == {(1, 5), (0, 1)}
    assert 140 < outs.count((1, 5)) < 260  # Binomial(400, 1/2): 6 standard deviations


def test_verify_sample_residual_guard():
    # p == q exactly: the residual is all zeros; the guard must keep multinomial defined.
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 7, generator=g), -1)
    d = torch.multinomial(p[:4], 1, generator=g).squeeze(-1)
    n, nxt = verify_sample(d, p[:4], p, g)
    assert int(n) == 4 and 0 <= int(nxt) < 7


# ---- exactness ----


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_greedy_equals_target_toy(gamma):
    V = 11
    target = toy(V, seed=0)
    drafts = {"random": toy(V, seed=1), "identical": target, "perturbed": perturbed(target, 0.5, seed=2)}
    for prompt in [(2, 3), (1, 4, 1, 5, 9, 2, 6)]:
        ids = prompt_of(*prompt)
        ref = greedy_reference(target, ids["input_ids"], 40)
        assert autoregressive(target, ids, 40).tokens == ref
        for name, draft in drafts.items():
            res = speculative(target, draft, ids, gamma, 40)
            assert res.tokens == ref, (name, gamma, prompt)
            assert sum(res.blocks) == 40 and res.rounds == len(res.blocks)


def test_draft_equal_target_gives_gamma_plus_one():
    target = toy(13, seed=3)
    ids = prompt_of(2, 7, 1)
    for gamma in (1, 3, 5):
        for temperature in (0.0, 1.0):
            res = speculative(target, target, ids, gamma, 50, Sampling(temperature, seed=0))
            # every round but the last is full; the last drafts only what is still needed
            assert res.blocks[:-1] == [gamma + 1] * (len(res.blocks) - 1)
            assert res.blocks[-1] == 50 - (gamma + 1) * (len(res.blocks) - 1)
            assert res.alpha == 1.0 and res.n_accepted == res.n_drafted
            assert res.tau == 50 / math.ceil(50 / (gamma + 1)) == tau_ceiling([50], gamma)
    # over several outputs of different lengths, tau is tokens / rounds summed: exactly the ceiling
    runs = [speculative(target, target, prompt_of(1, 2, 3), 4, m) for m in (3, 5, 11, 12)]
    assert sum(len(r.tokens) for r in runs) / sum(r.rounds for r in runs) == tau_ceiling([3, 5, 11, 12], 4)


def test_stop_token_inside_accepted_block():
    target = toy(13, seed=3)
    ids = prompt_of(0, 5)
    ref = autoregressive(target, ids, 30).tokens
    # first token whose first occurrence is at index 2 or later: it ends inside block 1 when gamma = 6
    i, stop = next((i, t) for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])
    res = speculative(target, target, ids, 6, 30, stop_token=stop)
    assert res.tokens == ref[:i + 1] == autoregressive(target, ids, 30, stop_token=stop).tokens
    if i < 6:
        assert res.from_draft[-1], "the stop token came from an accepted draft"
    assert res.rounds == i // 7 + 1


def test_max_new_tokens_inside_block():
    target = toy(13, seed=4)
    ids = prompt_of(1, 2)
    ref = autoregressive(target, ids, 23).tokens
    for m in range(1, 24):
        res = speculative(target, target, ids, 4, m)
        assert res.tokens == ref[:m] and sum(res.blocks) == m


def test_same_seed_same_output():
    target, draft = toy(9, seed=5), perturbed(toy(9, seed=5), 1.0, seed=6)
    ids = prompt_of(4, 4)
    kw = dict(temperature=0.9, top_k=6, top_p=0.95)
    a = speculative(target, draft, ids, 3, 40, Sampling(**kw, seed=123))
    b = speculative(target, draft, ids, 3, 40, Sampling(**kw, seed=123))
    assert a == b
    assert len({tuple(speculative(target, draft, ids, 3, 40, Sampling(**kw, seed=s)).tokens) for s in range(5)}) > 1
    assert autoregressive(target, ids, 40, Sampling(**kw, seed=7)) == autoregressive(target, ids, 40,
                                                                                     Sampling(**kw, seed=7))
    torch.manual_seed(0)  # seed=None draws from torch's global RNG
    c = speculative(target, draft, ids, 3, 40, Sampling(**kw))
    torch.manual_seed(0)
    assert speculative(target, draft, ids, 3, 40, Sampling(**kw)) == c


# ---- cache rollback ----


def run_rounds(target, draft, ids, gamma, n_rounds, temperature=0.0, check=None):
    """Drive speculate's own prefill + spec_round and call check after every round."""
    L = ids["input_ids"].shape[1]
    tcache = target.new_cache(max_len=L + n_rounds * (gamma + 1))
    dcache = draft.new_cache(max_len=L + n_rounds * (gamma + 1))
    embeds = target.embed(**{k: v for k, v in ids.items() if k in speculate.EMBED_KEYS})
    pending = speculate.prefill(target, ids, embeds, tcache).tolist()  # [[x_last]]: one row
    speculate.prefill(draft, ids, embeds, dcache)
    gen = torch.Generator().manual_seed(0)
    emitted, kinds = [], set()
    with torch.no_grad():
        for _ in range(n_rounds):
            (n,), (drafted,), (nxt,), pending = speculate.spec_round(target, draft, tcache, dcache, pending, gamma,
                                                                     Sampling(temperature), [gen])
            emitted += drafted[:n] + [nxt]
            kinds.add("zero" if n == 0 else "full" if n == gamma else "partial")
            check(tcache, dcache, pending, emitted)
    return kinds


def test_cache_rollback_toy():
    """After full, partial and zero acceptance: the target cache holds exactly prompt + emitted
    minus x_last; the draft cache the same minus `pending`, which is the emitted tail."""
    V, gamma = 7, 3
    target = toy(V, seed=8)
    draft = perturbed(target, 1.5, seed=9)
    ids = prompt_of(1, 2, 3)

    def check(tcache, dcache, pending, emitted):
        seq = ids["input_ids"][0].tolist() + emitted
        assert tcache.tokens[0, :tcache.length].tolist() == seq[:-1]
        k = len(pending[0])
        assert dcache.tokens[0, :dcache.length].tolist() == seq[:-k]
        assert pending[0] == seq[-k:] and k in (1, 2)

    for temperature in (0.0, 1.0):
        assert run_rounds(target, draft, ids, gamma, 40, temperature, check) == {"zero", "partial", "full"}


def test_errors_before_any_work():
    target, draft = toy(5, seed=0), toy(5, seed=1)
    ids = prompt_of(1, 2, 3)
    bad = [dict(decoder=0), dict(decoder=-1), dict(decoder=1.5), dict(max_new_tokens=0), dict(max_len=10),  # 22 > 10
           dict(sampling=dict(temperature=1.0))]  # settings travel as a Sampling
    for kw in bad:
        args = dict(decoder=2, max_new_tokens=20) | kw
        with pytest.raises(ValueError):
            speculative(target, draft, ids, **args)
    for kw in (dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
               dict(top_p=0.0), dict(top_p=1.5), dict(top_k=0)):
        with pytest.raises(ValueError, match="temperature must|top_p must|top_k must"):
            Sampling(**kw)
    with pytest.raises(ValueError, match="decodes one row.*_batch decodes several"):
        speculative(target, draft, dict(input_ids=torch.zeros(2, 3, dtype=torch.long)), 2, 5)
    with pytest.raises(ValueError, match="decodes one row.*_batch decodes several"):
        autoregressive(target, dict(input_ids=torch.zeros(2, 3, dtype=torch.long)), 5)
    right_padded = dict(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 0]] * 2))
    with pytest.raises(ValueError, match="pad on the left"):
        speculate.speculative_batch(target, draft, right_padded, 2, 5)
    with pytest.raises(ValueError, match="samples"):
        speculate.speculative_batch(target, draft, ids, 2, 5, samples=0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        speculative(target, draft, prompt_of(3), 2, 5)
    target.config.max_position_embeddings = 21
    with pytest.raises(ValueError, match="positions"):
        speculative(target, draft, ids, 2, 20)
    with pytest.raises(ValueError, match="positions"):
        autoregressive(target, ids, 20)
    del target.config.max_position_embeddings
    target.config.image_token_id = 3
    with pytest.raises(ValueError, match="text token"):
        speculative(target, draft, ids, 2, 5)
    target.config.image_token_id = None
    with pytest.raises(ValueError, match=r"token id 9, outside the target's vocabulary 0\.\.4"):
        speculative(target, draft, prompt_of(1, 2, 9), 2, 5)
    with pytest.raises(ValueError, match="token id -1"):
        autoregressive(target, prompt_of(-1, 2), 5)
    with pytest.raises(ValueError, match="stop_token 5 is not a token id of the target's vocabulary"):
        speculative(target, draft, ids, 2, 5, stop_token=5)
    with pytest.raises(ValueError, match=r"the draft's vocabulary \(6 tokens\) is not the target's \(5\)"):
        speculative(target, toy(6, seed=1), ids, 2, 5)
    assert target.calls == draft.calls == 0
    # the exact need fits: 3 - 1 + 20 slots, and gamma more that the last round may write past the end
    assert len(speculative(target, draft, ids, 2, 20, max_len=24).tokens) == 20
    with pytest.raises(ValueError, match="needs a cache of 24, max_len is 23"):
        speculative(target, draft, ids, 2, 20, max_len=23)


class LateNaN(ToyLM):
    """Finite logits at the first positions, NaN from position `at` on: an overflow that appears mid-decode."""

    def __init__(self, model, at):
        super().__init__(model.A, model.B)
        self.at = at

    def step(self, input_ids, input_pos, cache, mask=None, positions=None):
        logits = super().step(input_ids, input_pos, cache).clone()  # (1, T, V)
        logits[0, input_pos[0] >= self.at] = float("nan")
        return logits


def test_nonfinite_logits_are_an_error_naming_the_model():
    """NaN weights: an error after the prefill, naming the target or the draft; NaN that appears mid-decode: an
    error at the end of the decode (greedy) or where sampling meets it, not tokens emitted from NaN."""
    V = 7
    good = toy(V, seed=0)
    nan = ToyLM(torch.full((V, V), float("nan")), None)
    ids = prompt_of(1, 2, 3)
    for target, draft, name in ((nan, good, "target"), (good, nan, "draft")):
        with pytest.raises(FloatingPointError, match=f"{name}: NaN or inf logits after the prefill"):
            speculative(target, draft, ids, 2, 10)
    with pytest.raises(FloatingPointError, match="target: NaN or inf logits after the prefill"):
        autoregressive(nan, ids, 10)
    late = LateNaN(good, at=6)
    for temperature, when in ((0.0, "at the end of the decode"), (1.0, "during the decode")):
        with pytest.raises(FloatingPointError, match=f"target: NaN or inf logits {when}"):
            speculative(late, good, ids, 2, 10, Sampling(temperature, seed=0))
        with pytest.raises(FloatingPointError, match=f"target: NaN or inf logits {when}"):
            autoregressive(late, ids, 10, Sampling(temperature, seed=0))
    with pytest.raises(FloatingPointError, match="draft: NaN or inf logits at the end of the decode"):
        speculative(good, late, ids, 2, 10)


# ---- statistics and cost model ----


def test_expected_speedup_by_hand():
    # alpha 0.8, gamma 4, c 0.1: (1 - 0.8^5) / (0.2 * 1.4) = 0.67232 / 0.28
    assert expected_speedup(0.8, 4, 0.1) == pytest.approx(0.67232 / 0.28)
    assert expected_tau(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_speedup(1.0, 4, 0.1) == pytest.approx(5 / 1.4)
    assert expected_speedup(1 - 1e-9, 4, 0.1) == pytest.approx(5 / 1.4, rel=1e-6)  # continuous at alpha -> 1
    assert expected_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)  # every draft rejected
    assert expected_speedup(0.5, 3, 0.0) == pytest.approx(1.875)  # free draft: speedup = tau
    assert measured_speedup(3.0, 10.0, 1.0, 12.0, 4) == pytest.approx(30 / 16)


def test_alpha_and_tau_match_leviathan():
    """i.i.d. toy (rows independent of the state): the acceptance rate is the constant
    a = sum_x min(p(x), q(x)), so mean tokens per full round -> expected_tau(a, gamma)
    and SpecResult.alpha -> a. Tolerance: 5 standard errors (false failure < 1e-6)."""
    V, gamma = 6, 4
    g = torch.Generator().manual_seed(10)
    p_row, q_row = torch.randn(V, generator=g), torch.randn(V, generator=g)
    target, draft = ToyLM(p_row.expand(V, V).clone()), ToyLM(q_row.expand(V, V).clone())
    a = float(torch.minimum(p_row.softmax(-1), q_row.softmax(-1)).sum())
    res = speculative(target, draft, prompt_of(0, 0), gamma, 6000, Sampling(1.0, seed=1))
    full = torch.tensor(res.blocks[:-1], dtype=torch.float64)
    assert abs(full.mean() - expected_tau(a, gamma)) < 5 * full.std() / len(full) ** 0.5
    se = (a * (1 - a) / res.n_tested) ** 0.5
    assert abs(res.alpha - a) < 5 * se
    assert res.tau == pytest.approx(6000 / res.rounds)  # one target forward per round, one draft forward per token
    assert draft.calls == res.n_drafted + 1 and target.calls == res.rounds + 1  # (+ the prefills)
    assert sum(res.from_draft) == res.n_accepted  # no stop token: every accepted draft is emitted


# ---- distribution: chi-square against the exact target law ----


def chi_square(counts, probs):
    """Pearson chi-square of counts (K,) against probs (K,) -> (stat, df, p_value).

    An outcome of probability 0 that occurs fails outright; cells expected
    below 5 are pooled into one. p_value = Q(df/2, stat/2), the chi-square survival function.
    """
    counts, probs = counts.double(), probs.double()
    assert counts[probs == 0].sum() == 0, "a sample landed on an outcome of probability 0"
    expected = counts.sum() * probs
    big, small = expected >= 5, (expected < 5) & (probs > 0)
    obs = torch.cat([counts[big], counts[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return stat, df, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_chi_square_survival_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 7, 63, 124):
        for x in (0.5, df, 2.0 * df + 10):
            ours = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2)))
            assert ours == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-300)


def markov_pair(V, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g), torch.randn(V, V, generator=g)  # p, q logits (V, V)


def joint_first3(P, x0):
    """Exact law of the first 3 tokens of the chain P (V, V) started after x0, flattened (V^3,)."""
    return torch.einsum("a,ab,bc->abc", P[x0], P, P).reshape(-1)


def wrong_q(q):
    # A known trap (docs/background.md): verifying against a q other than the one sampled
    # from (here q at twice the temperature).
    return q.sqrt() / q.sqrt().sum(-1, keepdim=True)


def simulate(P, Q, x0, gamma, k, N, gen, q_seen_by_verifier=lambda q: q):
    """N independent speculative decodes of k tokens from chains P (target) and Q
    (draft), vectorised over N with a batched verify_sample -> (N, k)."""
    out = torch.empty(N, k, dtype=torch.long)
    count = torch.zeros(N, dtype=torch.long)  # tokens emitted per chain
    last = torch.full((N,), x0)
    rows = torch.arange(N)
    while bool((count < k).any()):
        prev, ds, qs = last, [], []
        for _ in range(gamma):
            qs.append(Q[prev])  # (N, V)
            prev = speculate.sample(qs[-1], gen)  # (N,)
            ds.append(prev)
        d, q = torch.stack(ds, 1), torch.stack(qs, 1)  # (N, gamma), (N, gamma, V)
        p = P[torch.cat([last[:, None], d], 1)]  # (N, gamma+1, V)
        n, nxt = verify_sample(d, q_seen_by_verifier(q), p, gen)  # (N,), (N,)
        block = torch.cat([d, nxt[:, None]], 1).scatter(1, n[:, None], nxt[:, None])  # (N, gamma+1)
        for j in range(gamma + 1):
            pos = count + j
            ok = (j <= n) & (pos < k)
            out[rows[ok], pos[ok]] = block[ok, j]
        count, last = count + n + 1, nxt
    return out


SAMPLING_CONFIGS = [  # (temperature, top_k, top_p, gamma)
    (1.0, None, None, 3),
    (0.6, 3, None, 2),
    (1.4, None, 0.8, 4),
    (1.0, 4, 0.95, 1),
]


@pytest.mark.parametrize("temperature,top_k,top_p,gamma", SAMPLING_CONFIGS)
def test_verify_sample_distribution(temperature, top_k, top_p, gamma):
    """Batched verify_sample over N = 200k simulated decodes: the first 3 emitted
    tokens follow the target chain exactly (chi-square, level 1e-3), and the same
    test rejects a verifier that sees the wrong q."""
    V, x0, N = 5, 2, 200_000
    p_logits, q_logits = markov_pair(V, seed=11)
    P, Q = (process_logits(x, temperature, top_k, top_p) for x in (p_logits, q_logits))
    expected = joint_first3(P, x0)
    for name, seen in [("correct", lambda q: q), ("wrong q", wrong_q)]:
        out = simulate(P, Q, x0, gamma, 3, N, torch.Generator().manual_seed(12), seen)
        stat, df, pval = chi_square(torch.bincount(out @ torch.tensor([V * V, V, 1]), minlength=V ** 3), expected)
        print(f"verify_sample T={temperature} top_k={top_k} top_p={top_p} gamma={gamma} {name}: "
              f"N={N} chi2={stat:.1f} df={df} p={pval:.3g}")
        assert (pval > SIGNIFICANCE) == (name == "correct"), (name, stat, df, pval)


@pytest.mark.parametrize("temperature,top_k,top_p,gamma", SAMPLING_CONFIGS[1:3])
def test_speculative_distribution(temperature, top_k, top_p, gamma, monkeypatch):
    """The whole loop, a decode per sample with its own seed (seeded_rows): first 3 tokens ~
    the target chain (chi-square, level 1e-3, N = 6000); the negative control
    (verifier handed the wrong q) is rejected by the same test at the same N."""
    V, x0, N = 4, 1, 6000
    p_logits, q_logits = markov_pair(V, seed=13)
    target, draft = ToyLM(p_logits), ToyLM(q_logits)
    expected = joint_first3(process_logits(p_logits, temperature, top_k, top_p), x0)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    honest = speculate.verify_sample
    for name in ("correct", "wrong q"):
        if name == "wrong q":
            monkeypatch.setattr(speculate, "verify_sample",
                                lambda d, q, p, g, also=None: honest(d, wrong_q(q), p, g, also))
        toks = seeded_rows(speculate.speculative_batch, target, draft, prompt_of(0, x0), gamma, 3, N, **kw)  # (N, 3)
        stat, df, pval = chi_square(torch.bincount(toks @ torch.tensor([V * V, V, 1]), minlength=V ** 3), expected)
        print(f"speculative T={temperature} top_k={top_k} top_p={top_p} gamma={gamma} {name}: "
              f"N={N} chi2={stat:.1f} df={df} p={pval:.3g}")
        assert (pval > SIGNIFICANCE) == (name == "correct"), (name, stat, df, pval)


def test_speculative_long_run_transitions():
    """Long sampled decodes, 20 rows of 1,500 tokens at once (many rounds, every cache branch): the counts of
    transitions a -> b match the target chain row by row (Anderson-Goodman chi-square for a Markov chain, df = sum of
    (support - 1), level 1e-3)."""
    V, x0, M, R = 5, 0, 1500, 20
    p_logits, q_logits = markov_pair(V, seed=14)
    temperature, top_p = 0.9, 0.95
    P = process_logits(p_logits, temperature, None, top_p)
    rows = speculate.speculative_batch(ToyLM(p_logits), ToyLM(q_logits), dict(input_ids=torch.tensor([[0, x0]] * R)),
                                       3, M, sampling=Sampling(temperature, top_p=top_p, seed=5))
    seqs = torch.tensor([[x0] + r.tokens for r in rows])  # (R, M + 1)
    pairs = torch.bincount((seqs[:, :-1] * V + seqs[:, 1:]).flatten(), minlength=V * V).view(V, V).double()  # (V, V)
    assert pairs[P == 0].sum() == 0
    visits = pairs.sum(1, keepdim=True)  # (V, 1)
    expected = visits * P  # (V, V)
    ok = (P > 0) & (visits > 0)
    stat = float(((pairs - expected)[ok] ** 2 / expected[ok]).sum())
    df = int(ok.sum()) - int((visits > 0).sum())
    pval = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    print(f"speculative long runs: {R} x {M} tokens, {rows[0].rounds} rounds, tau={rows[0].tau:.2f}: "
          f"chi2={stat:.1f} df={df} p={pval:.3g}")
    assert pval > SIGNIFICANCE


# ---- the real model: model.VLA targets, model.make_draft drafts (fp32) ----

IMG, VID, VS, VE = 90, 91, 88, 89  # image / video placeholder, vision start / end ids of the tiny config


def tiny_target(seed=0):
    vision = model.VisionConfig(patch_size=2, temporal_patch_size=1, spatial_merge_size=2, depth=2, hidden=32,
                                heads=2, intermediate=48, window_size=8, fullatt_block_indexes=(1,))
    cfg = model.ModelConfig(vocab_size=97, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                            rope_theta=10000.0, mrope_section=(2, 3, 3), image_token_id=IMG, video_token_id=VID,
                            vision_start_token_id=VS, tokens_per_second=1.0, vision=vision, traj_len=4)
    torch.manual_seed(seed)
    target = model.VLA(cfg).eval()
    o1_init(target, seed)
    return target


@torch.no_grad()
def o1_init(net, seed):
    """Weights of O(1) effect: peaked logits, so greedy argmaxes are far from ties (exactness in fp32)."""
    g = torch.Generator().manual_seed(seed)
    for name, w in net.named_parameters():
        r = torch.randn(w.shape, generator=g)
        w.copy_((1 + 0.2 * r if "norm" in name else 0.3 * r) if w.dim() == 1 else r / w.shape[-1] ** 0.5)
    return net


def drafts_for(target):
    """Random-init FlatRoPE draft, the target itself, a perturbed full-depth copy (M-RoPE), a random history-only
    draft (its prefill skips the image / video tokens: a cache shorter than the target's)."""
    torch.manual_seed(1)
    random = model.make_draft(target, n_layers=1, hidden_size=32).eval()
    copy = model.make_draft(target, n_layers=target.cfg.n_layers, kind="mrope").eval()
    copy.layers.load_state_dict(target.layers.state_dict())
    copy.norm.load_state_dict(target.norm.state_dict())
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for w in copy.parameters():
            w.add_(0.1 * w.std() * torch.randn(w.shape, generator=g).to(w.device))  # CPU noise: the same on any device
    torch.manual_seed(3)
    history = model.make_draft(target, n_layers=1, hidden_size=32, kind="history").eval()  # never reads an image
    return {"random": random, "identical": target, "perturbed": copy, "history-only": history}


def test_drafts_for_builds_on_the_targets_device():
    """drafts_for's noise goes to the parameters' device (the CUDA-graph test passes a CUDA target); the meta device
    stands in for CUDA on a CPU: it refuses a CPU operand just as CUDA does."""
    drafts = drafts_for(tiny_target().to("meta"))
    assert {p.device.type for d in drafts.values() for p in d.parameters()} == {"meta"}


def vla_prompts():
    g = torch.Generator().manual_seed(0)
    pv, ig = vision.patchify(torch.randn(1, 3, 8, 8, generator=g), 2, 1, 2)  # one image -> 4 merged tokens
    vv, vg = vision.patchify(torch.randn(2, 3, 8, 12, generator=g), 2, 1, 2)  # 2-frame video -> 12 tokens
    ids = [5, 6, VS] + [IMG] * 4 + [VE, 10, 11, VS] + [VID] * 12 + [VE, 7, 8, 9]
    return {
        "text": dict(input_ids=torch.tensor([[12, 40, 7, 33, 61]])),
        "two tokens": dict(input_ids=torch.tensor([[17, 95]])),
        "image+video": dict(input_ids=torch.tensor([ids]), pixel_values=pv, image_grid_thw=ig[None],
                            pixel_values_videos=vv, video_grid_thw=vg[None]),
    }


@torch.no_grad()
def vla_greedy_reference(target, prompt, n):
    """Greedy without any cache: a full forward over prompt + generated for every token."""
    p, out = dict(prompt), []
    for _ in range(n):
        out.append(int(target(**p)[0, -1].argmax()))
        p["input_ids"] = torch.cat([p["input_ids"], torch.tensor([[out[-1]]])], 1)
    return out


def test_vla_autoregressive_equals_no_cache_greedy():
    target = tiny_target()
    for name, prompt in vla_prompts().items():
        assert autoregressive(target, prompt, 12).tokens == vla_greedy_reference(target, prompt, 12), name


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_vla_greedy_equals_target(gamma):
    target = tiny_target()
    drafts = drafts_for(target)
    for pname, prompt in vla_prompts().items():
        ref = autoregressive(target, prompt, 24)
        for dname, draft in drafts.items():
            res = speculative(target, draft, prompt, gamma, 24)
            assert res.tokens == ref.tokens, (pname, dname, gamma)
            if dname == "identical":
                assert res.blocks[:-1] == [gamma + 1] * (len(res.blocks) - 1), (pname, res.blocks)


def test_vla_draft_equal_target_temperature_one():
    target = tiny_target()
    for name, prompt in vla_prompts().items():
        res = speculative(target, target, prompt, 4, 30, Sampling(1.0, seed=3))
        # p and q agree up to fp32 rounding of batched vs single-token forwards: a rejection
        # has probability ~1e-6 per token
        assert res.blocks == [5] * 6 and res.alpha == 1.0, (name, res.blocks)


def assert_cache_matches_prefill(model, cache, prompt, seq, embed_with):
    """cache == a fresh cache fed the whole prompt (one prefill) and then seq in one forward.

    seq goes in as a separate forward because generated ids are text: a second
    prefill would read a generated placeholder id as an image block."""
    fresh = model.new_cache(max_len=cache.max_len)
    embeds = embed_with.embed(**{k: v for k, v in prompt.items() if k in speculate.EMBED_KEYS})
    grids = {k: v for k, v in prompt.items() if k in speculate.GRID_KEYS}
    with torch.no_grad():
        model(prompt["input_ids"], inputs_embeds=embeds, cache=fresh, **grids)
        if seq:
            model(torch.tensor([seq]), cache=fresh)
    n = fresh.length
    assert cache.length == n
    for got, want in ((cache.k, fresh.k), (cache.v, fresh.v)):
        torch.testing.assert_close(torch.stack(got)[..., :n, :], torch.stack(want)[..., :n, :], atol=2e-5, rtol=1e-4)
    assert torch.equal(cache.rope_delta, fresh.rope_delta)


def test_vla_cache_rollback():
    """After full, partial and zero acceptance rounds, both KV caches equal a fresh prefill of
    the committed tokens (target: all but x_last; draft: all but `pending`, which it is fed next)."""
    target = tiny_target()
    drafts = drafts_for(target)
    prompt = vla_prompts()["image+video"]
    L = prompt["input_ids"].shape[1]

    def check_for(draft):
        def check(tcache, dcache, pending, emitted):
            k = len(pending[0])
            committed = prompt["input_ids"][0, -1:].tolist() + emitted  # the held-back prompt token + output
            assert pending[0] == committed[-k:]
            # the fresh prefill sees the whole prompt, then what the cache should hold after it
            assert_cache_matches_prefill(target, tcache, prompt, emitted[:-1], target)
            if len(committed) > k:
                assert_cache_matches_prefill(draft, dcache, prompt, committed[1:len(committed) - k], target)
            else:  # the draft has not seen the prompt's last token yet
                assert dcache.length == L - 1
        return check

    kinds = set()
    for draft in (drafts["random"], drafts["perturbed"]):  # FlatRoPE narrow draft, M-RoPE full-width copy
        # the model's steps, and the compiled path's (eager here): its persistent caches, drafts padded to 3 tokens
        for t, d in ((target, draft), (compiled.CompiledSteps(target, 80, (4,), compile=False),
                                       compiled.CompiledSteps(draft, 80, (3,), compile=False))):
            for temperature in (0.0, 1.0):
                kinds |= run_rounds(t, d, prompt, 3, 12, temperature, check_for(draft))
    assert kinds == {"zero", "partial", "full"}, kinds


def test_vla_errors():
    target = tiny_target()
    prompt = vla_prompts()["image+video"]
    bad = dict(prompt, input_ids=torch.cat([prompt["input_ids"][:, :-4], torch.tensor([[VID]])], 1))
    with pytest.raises(ValueError, match="text token"):
        speculative(target, target, bad, 2, 4)
    batch2 = dict(input_ids=torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match="decodes one row"):
        speculative(target, target, batch2, 2, 4)
    with pytest.raises(ValueError, match="max_len"):
        speculative(target, target, prompt, 2, 40, max_len=40)
    # a prompt longer than the model's positions (ModelConfig.max_seq_len), before any work and in any forward
    target.cfg.max_seq_len = 30
    with pytest.raises(ValueError, match=r"prompt \(27\) \+ max_new_tokens \(5\) needs 31 positions, the model has 30"):
        autoregressive(target, prompt, 5)
    with pytest.raises(ValueError, match="sequence of 31 tokens is longer than the model's max_seq_len 30"):
        target(torch.randint(10, 80, (1, 31)))


def test_step_times_read_the_clock_they_are_given():
    """timer: step_times reads that clock around each step (here a fake one that advances 1 s per reading)."""
    target = tiny_target()
    draft = drafts_for(target)["random"]
    ticks = iter(range(10 ** 6))
    times = timing.step_times(target, draft, vla_prompts()["text"], (1, 3), reps=3, timer=lambda: next(ticks))
    assert times == {"target": {1: 1, 3: 1}, "draft": 1}


def test_timing_does_not_change_the_output():
    """timing=True only reads the clock: same tokens and statistics, and both phases were timed."""
    target = tiny_target()
    draft = drafts_for(target)["random"]
    prompt = vla_prompts()["image+video"]
    plain = speculative(target, draft, prompt, 4, 12)
    timed = speculative(target, draft, prompt, 4, 12, timing=True)
    assert timed.tokens == plain.tokens and timed.rounds == plain.rounds
    assert timed.prefill_s > 0 and timed.decode_s > 0 and plain.prefill_s == plain.decode_s == 0
    base = autoregressive(target, prompt, 12, timing=True)
    assert base.tokens == autoregressive(target, prompt, 12).tokens and base.decode_s > 0


# ---- the compiled path (compiled.CompiledSteps): eager, and compiled (slow) ----


def compiled_pair(target, draft, gammas=(1, 4), compile=False, max_len=64):
    """CompiledSteps of target and draft for chains of these gammas: target steps 1 and gamma + 1, draft 1 and 2."""
    return (compiled.CompiledSteps(target, max_len, (1, *(g + 1 for g in gammas)), compile=compile),
            compiled.CompiledSteps(draft, max_len, (1, 2), compile=compile))


def test_vla_compiled_path_greedy_equals_target():
    """The compiled path's steps (eager here: its persistent cache, the path torch.compile and CUDA graphs take) emit
    exactly the target's greedy tokens: target-only, and speculative with every draft; the 'identical' draft's full
    acceptances exercise the draft's 2-token step and the rollback of the persistent cache."""
    target = tiny_target()
    for pname, prompt in vla_prompts().items():
        ref = autoregressive(target, prompt, 24)
        assert autoregressive(compiled_pair(target, target)[0], prompt, 24).tokens == ref.tokens, pname
        for dname, draft in drafts_for(target).items():
            for gamma in (1, 4):
                res = speculative(*compiled_pair(target, draft), prompt, gamma, 24)
                assert res.tokens == ref.tokens, (pname, dname, gamma)
                if dname == "identical":
                    assert res.blocks[:-1] == [gamma + 1] * (len(res.blocks) - 1), (pname, res.blocks)


def test_vla_compiled_path_errors():
    target = tiny_target()
    prompt = vla_prompts()["image+video"]  # 27 tokens
    st, sd = compiled_pair(target, target, max_len=32)
    with pytest.raises(ValueError, match="the compiled cache holds 32"):
        speculative(st, sd, prompt, 4, 24)  # needs 26 + 24 positions
    with pytest.raises(ValueError, match="max_seq_len"):
        compiled.CompiledSteps(target, target.cfg.max_seq_len + 1, (1,))
    with pytest.raises(ValueError, match="these compiled steps decode batch 1"):
        st.new_cache(batch=2)
    with pytest.raises(ValueError, match="CompiledSteps steps only its own cache"):
        st.step(prompt["input_ids"][:, :1], torch.zeros(1, 1, dtype=torch.long), target.new_cache(max_len=8),
                torch.ones(1, 1, 1, dtype=torch.bool))


@pytest.mark.slow
def test_vla_compiled_decoding_greedy_equals_target():
    """torch.compile'd steps (inductor on the CPU) emit the same greedy tokens as eager target-only decoding (fp32),
    target-only, the chain and the tree; a second decode reuses the compiled graphs (no recompilation per prompt)."""
    target = tiny_target()
    draft = drafts_for(target)["perturbed"]
    shape = TreeShape(8, 3, 3)
    ct = compiled.CompiledSteps(target, 64, (1, 4, shape.nodes + 1))
    cd = compiled.CompiledSteps(draft, 64, (1, 2, shape.width))
    for pname, prompt in vla_prompts().items():
        ref = autoregressive(target, prompt, 16)
        assert autoregressive(ct, prompt, 16).tokens == ref.tokens, pname
        assert speculative(ct, cd, prompt, 3, 16).tokens == ref.tokens, pname
        assert speculate.speculative(ct, cd, prompt, shape, 16).tokens == ref.tokens, pname


def test_vla_compiled_path_with_padded_steps():
    """Steps shorter than every step length run padded (draft steps of 1 and 2 tokens as 3, the target's 1-token
    steps as 5), max_new_tokens cutting the last round, and the output is still the target's greedy output."""
    target = tiny_target()
    draft = drafts_for(target)["perturbed"]
    run = []  # the padded lengths VLA.step ran
    for pname, prompt in vla_prompts().items():
        ref = autoregressive(target, prompt, 13)
        st = compiled.CompiledSteps(target, 64, (5,), compile=False)
        sd = compiled.CompiledSteps(draft, 64, (3,), compile=False)
        for dec in (st, sd):
            dec._step = lambda ids, *a, step=dec._step: run.append(ids.shape[1]) or step(ids, *a)
        assert speculative(st, sd, prompt, 4, 13).tokens == ref.tokens, pname
        assert autoregressive(st, prompt, 13).tokens == ref.tokens, pname
    assert set(run) == {3, 5}, set(run)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs (mode reduce-overhead) need CUDA")
def test_vla_compiled_decoding_on_cuda_equals_target():
    """On CUDA, --compile's steps are CUDA graphs over the persistent static cache (mode "reduce-overhead"): greedy
    outputs equal eager target-only decoding (fp32), twice over (the second decode replays the graphs); graphs were
    captured and replayed and none skipped (a skipped one would run as plain inductor and pass the token check)."""
    target = tiny_target().cuda()
    draft = drafts_for(target)["perturbed"]
    shape = TreeShape(8, 3, 3)
    ct = compiled.CompiledSteps(target, 64, (1, 4, shape.nodes + 1))
    cd = compiled.CompiledSteps(draft, 64, (1, 2, shape.width))
    watch = probes.CompileWatch({"target": ct, "draft": cd})
    try:
        for _ in range(2):
            for pname, prompt in vla_prompts().items():
                prompt = {k: v.cuda() for k, v in prompt.items()}
                ref = autoregressive(target, prompt, 16)
                assert autoregressive(ct, prompt, 16).tokens == ref.tokens, pname
                assert speculative(ct, cd, prompt, 3, 16).tokens == ref.tokens, pname
                assert speculate.speculative(ct, cd, prompt, shape, 16).tokens == ref.tokens, pname
    finally:
        watch.close()
    graphs = watch.report()["cuda_graphs"]
    assert graphs["skips"] == 0 and graphs["captured"] and graphs["replayed"], graphs
