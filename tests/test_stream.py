"""Tests for plans in a stream (beyond/stream.py, tree.merge, driving.make_clips): the lookup, the trie merge, greedy
stream decoding equal to target-only token for token (fp32: the stream alone, with a chain, with a tree, B rows of
their own earlier plans), the sampled law kept with the stream merged into the tree, and toy clips whose every frame
is distributed as a single scene.

Chi-square tests: level 1e-3 per check (SIGNIFICANCE), so a correct implementation fails each with probability 1e-3
over the random draws; the negative control (the stream hung below the root without the trie merge, so a node can
have two children of one token) fails its check with a p-value far below the level at the same N. Seeds are fixed, so
a run is deterministic; the rates apply to a change of seed or draw order.

run: python -m pytest -q tests/test_stream.py
"""
from collections import Counter
import dataclasses

import numpy as np
import pytest
from test_speculate import SIGNIFICANCE, chi_square, drafts_for, joint_first3, markov_pair, tiny_target, vla_prompts
from test_tree import first3_by_rounds, markov_tree, small_vla
import torch

from beyond.relaxed import Relaxed
from beyond.stream import Stream, decode_clip, lookup, plan_tokens, propose
import driving
import model
import speculate
from speculate import Sampling, autoregressive, speculative, speculative_batch
import tree as trees
from tree import TreeShape

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the lookup and the merge ----
def test_lookup_takes_the_longest_suffix_match_alpha_per_matched_token():
    s = 0
    assert lookup([s], [[s, 1, 2, 3]], 16, 4) == [1, 2, 3]  # <cot_start> matched: the plan from its start
    assert lookup([s, 1, 2], [[s, 1, 2, 3, 4, 5]], 16, 4) == [3, 4, 5]  # the whole context matched
    assert lookup([s, 1, 2], [[s, 1, 2, 3, 4, 5]], 2, 4) == [3, 4]  # at most M
    assert lookup([s, 9, 2], [[s, 1, 2, 3, 4, 5, 6]], 16, 2) == [3, 4]  # one token matched: alpha of them
    assert lookup([s, 7], [[s, 1, 2]], 16, 4) == []  # no match, no proposal
    assert lookup([s, 2], [[s, 2, 8], [s, 2, 9]], 16, 4) == [8]  # a tie: the most recent plan
    assert lookup([s, 4, 2], [[s, 2, 8], [s, 4, 2, 9]], 16, 4) == [9]  # a longer match in an older plan wins
    assert lookup([s, 2], [[s, 2, 5, 2, 6]], 16, 4) == [5, 2, 6]  # a tie in one plan: its earliest place
    assert lookup([s, 1], [[s, 1, 2, 3, 4, 5, 6]], 16, 2) == [2, 3, 4, 5]  # alpha per matched token
    assert lookup([s, 1], [[s, 1, 2, 3, 4, 5, 6]], 16, 2, whole=True) == [2, 3, 4, 5, 6]  # the whole plan so far
    assert lookup([s, 1], [[s, 1, 2, 3, 4, 5, 6]], 3, 2, whole=True) == [2, 3, 4]  # matched: the rest, at most M
    assert lookup([s, 7, 1], [[s, 1, 2, 3, 4, 5, 6]], 16, 1, whole=True) == [2]  # a suffix only: alpha per token


def test_lookup_swap_steps_over_one_rewritten_token():
    s = 0
    assert lookup([s, 1, 7], [[s, 1, 2, 3, 4]], 16, 1) == []  # 7 is new: no suffix of the plan matches
    assert lookup([s, 1, 7], [[s, 1, 2, 3, 4]], 16, 1, swap=True) == [3, 4]  # 7 took 2's place, 2 matched: alpha 1
    assert lookup([s, 7, 2], [[s, 1, 2, 3, 4, 5]], 16, 1) == [3]  # one token matched
    assert lookup([s, 7, 2], [[s, 1, 2, 3, 4, 5]], 16, 1, swap=True) == [3, 4]  # two matched, 7 for 1
    assert lookup([s, 7, 2], [[s, 1, 2, 3, 4, 5]], 16, 1, swap=True, whole=True) == [3, 4, 5]  # the whole plan so far
    assert lookup([s, 7, 8, 2], [[s, 1, 2, 3]], 16, 1, swap=True) == [3]  # two tokens differ: a one-token match


def is_trie(t):
    """No node of any row has two live children holding one token (dead nodes, token -1, are never accepted)."""
    for b in range(t.tokens.shape[0]):
        kids = Counter((int(p), int(x)) for p, x in zip(t.parent[b, 1:], t.tokens[b]) if x >= 0)
        if max(kids.values(), default=1) > 1:
            return False
    return True


def test_merge_walks_the_tree_then_hangs_the_rest_below():
    q = torch.randn(6, 6, generator=torch.Generator().manual_seed(0))
    tree, toks = markov_tree(q, 2, 2, 2)  # the root (token 2), 2 children, 4 grandchildren: N = 6
    a = int(tree.tokens[0, 0])  # node 1, a child of the root
    b = [int(x) for v, x in enumerate(tree.tokens[0], 1) if int(tree.parent[0, v]) == 1][0]  # a child of node 1
    fresh = ({*range(6)} - {int(x) for x in tree.tokens[0]}).pop()
    cases = {"along a branch, then off it": [a, b, fresh, -1, -1], "off the root": [fresh, a, -1, -1, -1],
             "inside the tree": [a, b, -1, -1, -1], "nothing": [-1] * 5}
    for name, path in cases.items():
        m = trees.merge(tree, torch.tensor([path]))
        N, M = 6, 5
        assert m.tokens.shape == (1, N + M) and m.anc.shape == (1, N + M + 1, N + M + 1) and is_trie(m), name
        # the path's tokens are found top-down from the root, one node per token, each the next's parent
        u = 0
        for x in [x for x in path if x >= 0]:
            kids = [v for v in range(1, N + M + 1) if int(m.parent[0, v]) == u and int(m.tokens[0, v - 1]) == x]
            assert len(kids) == 1, (name, x)
            u = kids[0]
        live = [x for x in m.tokens[0, N:].tolist() if x >= 0]
        assert live == {"along a branch, then off it": [fresh], "off the root": [fresh, a]}.get(name, []), name
        for v in range(N + M + 1):  # anc is the walk up the parents, depth its length
            chain, w = {v}, v
            while w:
                w = int(m.parent[0, w])
                chain.add(w)
            assert set(torch.nonzero(m.anc[0, v]).flatten().tolist()) == chain, (name, v)
            assert int(m.depth[0, v]) == len(chain) - 1, (name, v)
        assert (m.fed[0, N + 1:] == -1).all()  # the draft was never fed a stream node


# ---- greedy: exactness ----
@pytest.mark.parametrize("shape", [None, TreeShape(4, 4, 1), TreeShape(8, 4, 2)], ids=str)
def test_stream_greedy_equals_target(shape):
    """Every earlier plan (the answer itself, the answer with tokens changed, another prompt's answer, two plans,
    a steady pair), alone or merged with the chain / tree of every test draft, with and without swap and skipping
    rounds: the target's greedy tokens; the answer itself as the earlier plan needs fewer rounds than the tree."""
    target = tiny_target()
    prompts = vla_prompts()
    refs = {name: autoregressive(target, p, 24) for name, p in prompts.items()}
    for pname, prompt in prompts.items():
        ref = refs[pname]
        right = plan_tokens(prompt, ref)
        changed = [x if i % 5 else (x + 1) % 80 for i, x in enumerate(right)]  # every 5th token after <cot_start>
        other = plan_tokens(prompt, refs["text" if pname != "text" else "two tokens"])
        for dname, draft in drafts_for(target).items():
            for ename, earlier in {"right": [right], "changed": [changed], "other": [other],
                                   "two plans": [other, right], "steady": [right, right],
                                   "steady, changed": [changed, changed]}.items():
                first = Stream(shape, [earlier], M=8, alpha=4, swap=False, skip=None, steady=False)  # as first built
                res = speculative(target, draft, prompt, first, 24)
                assert res.tokens == ref.tokens, (pname, dname, ename)
                assert speculative(target, draft, prompt, Stream(shape, [earlier], M=8, skip=3), 24).tokens == \
                    ref.tokens, (pname, dname, ename, "the defaults: swap, steady")
                if ename == "right" and shape is not None and dname == "random":
                    assert res.rounds < speculative(target, draft, prompt, shape, 24).rounds, (pname, shape)


def test_stream_rows_of_their_own_earlier_plans_equal_target(monkeypatch):
    """B rows (a prompt's samples), each with its own earlier plan, in one verify forward: each row's greedy tokens
    are the target's, and the row with the right plan needs fewer rounds. Skipping: rounds without the tree happen
    only where every row's proposal is long, and the tokens stay the target's."""
    target = tiny_target()
    draft = drafts_for(target)["random"]
    prompt = vla_prompts()["image+video"]
    ref = autoregressive(target, prompt, 24)
    right, wrong = plan_tokens(prompt, ref), plan_tokens(prompt, autoregressive(target, vla_prompts()["text"], 24))
    out = speculative_batch(target, draft, prompt, Stream(TreeShape(8, 4, 2), [[right], [wrong], []], M=8), 24,
                            samples=3)
    assert all(r.tokens == ref.tokens for r in out) and out[0].rounds < out[1].rounds
    # a round skips the tree only where every row's proposal is long: rows of one plan skip, then feed the draft
    shapes, tree_round = [], trees.tree_round
    monkeypatch.setattr(trees, "tree_round", lambda *a, **k: shapes.append(a[5]) or tree_round(*a, **k))
    steady = [right, right]  # the two plans before agree: a whole match may skip the tree
    for earlier, skipped in (([steady, [wrong], []], False), ([steady, [right, wrong], steady], False),
                             ([steady, steady, steady], True)):
        shapes.clear()
        decoder = Stream(TreeShape(8, 4, 2), earlier, M=8, skip=2, steady=True)
        out = speculative_batch(target, draft, prompt, decoder, 24, samples=3)
        assert all(r.tokens == ref.tokens for r in out)
        assert (None in shapes) == skipped and TreeShape(8, 4, 2) in shapes, shapes


def test_compiled_stream_keeps_to_its_shapes_and_equals_target(eager_dynamo, monkeypatch):
    """On compiled steps (dynamo's graphs, its eager backend) the stream's width is padded to its few widths and the
    draft's pending to its step lengths (a longer step is refused by CompiledSteps), every length compiled before the
    decodes (warm): 3 rows of their own earlier plans, the steady rows' skipped rounds among them, each the target's
    greedy tokens."""
    from measure import timing
    target = tiny_target()
    draft = drafts_for(target)["random"]
    prompt = vla_prompts()["image+video"]
    ref = autoregressive(target, prompt, 24)
    right, wrong = plan_tokens(prompt, ref), plan_tokens(prompt, autoregressive(target, vla_prompts()["text"], 24))
    like = Stream(TreeShape(8, 4, 2), [[]] * 3, M=8, skip=2)
    assert like.widths == [0, 2, 4, 8] and like.steps == ((9, 11, 13, 17, 9), (1, 2, 4, 8, 16, 18))
    ct, cd = timing.compiled_pair(target, draft, [prompt], [like], 24, batch=3)
    ct.warm(), cd.warm()
    widths, merge = [], trees.merge
    monkeypatch.setattr(trees, "merge", lambda t, s, *a: widths.append(s.shape[1]) or merge(t, s, *a))
    for earlier in ([[right, right], [wrong], []], [[right, right]] * 3):
        decoder = Stream(TreeShape(8, 4, 2), earlier, M=8, skip=2)
        out = speculative_batch(ct, cd, prompt, decoder, 24, samples=3)
        assert all(r.tokens == ref.tokens for r in out), earlier
    assert set(widths) <= set(like.widths) and len(set(widths)) > 1, widths


def test_stream_errors():
    target = tiny_target()
    draft, prompt = drafts_for(target)["random"], vla_prompts()["text"]
    for bad in ({"M": 0}, {"alpha": 0}, {"M": 2.5}, {"skip": 0}, {"skip": True}):
        with pytest.raises(ValueError, match="M, alpha and skip must be ints >= 1"):
            Stream(None, [[]], **bad)
    with pytest.raises(ValueError, match="earlier plans for 2 rows, the decode has 1"):
        speculative(target, draft, prompt, Stream(None, [[], []]), 8)
    with pytest.raises(ValueError, match="lossless only"):
        speculative(target, draft, prompt, Stream(None, [[]]), 8, Sampling(relaxed=Relaxed("typical", 1.0)))
    # issue #59: the public API checks what it is given, before any round
    with pytest.raises(ValueError, match="per row, a list of plans"):
        Stream(None, [[5, 6, 7]])  # a flat plan where rows of plans go
    V = target.cfg.vocab_size
    with pytest.raises(ValueError, match=f"token ids outside the target's {V}: \\[{V}\\]"):
        speculative(target, draft, prompt, Stream(None, [[[1, V, 2]]]), 8)
    once = Stream(None, [[[1, 2, 3]]])
    speculative(target, draft, prompt, once, 4)
    with pytest.raises(ValueError, match="make one per decode"):
        speculative_batch(target, draft, prompt, once, 4, samples=2)
    with pytest.raises(ValueError, match="unknown arm 'treee'"):
        decode_clip(target, draft, [prompt], "treee", None, 4)


# ---- sampling: the target's law ----
def duplicate_children(real):
    """The control: the stream hung below the root as new nodes, never walked into the tree, so a node may get two
    children of one token."""
    def merge(t, path):
        out = real(dataclasses.replace(t, tokens=torch.full_like(t.tokens, -2)), path)
        out.tokens[:, :t.tokens.shape[1]] = t.tokens
        return out
    return merge


@pytest.mark.parametrize("temperature,top_p", [(1.0, None), (0.6, 0.98)])
def test_verify_merged_tree_distribution(temperature, top_p, monkeypatch):
    """Rounds of verify_tree over a Markov target P and a merged tree (a Markov draft's top-2 tree of depth 2, the
    stream's path of 3 merged into it) until 3 tokens are out: the first 3 follow P exactly (chi-square, level 1e-3,
    N = 5,000); the duplicate-children control is rejected. The draft proposes P's least likely tokens but for its
    first child, P's likeliest, where the path starts and goes on with P's likeliest: a duplicate then decides
    often."""
    V, x0, N = 5, 2, 5_000
    p_logits, _ = markov_pair(V, seed=21)
    P = speculate.process_logits(p_logits, temperature, None, top_p)
    expected = joint_first3(P, x0)
    for name in ("correct", "duplicate children"):
        merge = trees.merge if name == "correct" else duplicate_children(trees.merge)
        rounds = {}
        for x in range(V):  # per last token: the merged tree and the token of every node
            t, toks = markov_tree(-p_logits, x, 2, 2)  # the draft's top-2 tree: P's least likely tokens
            a = int(p_logits[x].argmax())  # node 1 made P's likeliest, its children kept: the root stays a trie
            t.tokens[0, 0], toks[1] = a, a
            path = [a, int(p_logits[a].argmax()), int(p_logits[int(p_logits[a].argmax())].argmax())]
            m = merge(t, torch.tensor([path]))
            rounds[x] = m, torch.cat([toks, m.tokens[0, t.tokens.shape[1]:].clamp_min(0)])
        assert is_trie(rounds[x0][0]) == (name == "correct")
        out = first3_by_rounds(rounds, p_logits, x0, Sampling(temperature, top_p=top_p), N, seed=22)
        stat, df, pval = chi_square(torch.bincount(out @ torch.tensor([V * V, V, 1]), minlength=V ** 3), expected)
        print(f"merged tree T={temperature} top_p={top_p} {name}: N={N} chi2={stat:.1f} df={df} p={pval:.3g}")
        assert (pval > SIGNIFICANCE) == (name == "correct"), (name, stat, df, pval)


@pytest.mark.parametrize("kw", [{"swap": False, "skip": None, "steady": False}, {"skip": 2}],
                         ids=["merged", "skipping"])
def test_stream_sampling_keeps_the_target_law(kw):
    """The whole loop, speculative() with the stream merged into a tree (or, skipping, the first round's long
    proposal verified alone and the tree after it), a seed per sample: the first 3 tokens ~ the target's law
    (computed exactly by cache-free forwards; chi-square, level 1e-3, N = 1000)."""
    target = small_vla(0)
    torch.manual_seed(3)
    draft = model.make_draft(target, n_layers=1).eval()
    V, N, prompt, temperature = 5, 1000, dict(input_ids=torch.tensor([[0, 3]])), 0.8

    def probs(seq):
        with torch.no_grad():
            return speculate.process_logits(target(torch.tensor([[0, 3] + seq]))[0, -1], temperature)

    expected = torch.einsum("a,ab,abc->abc", probs([]), torch.stack([probs([a]) for a in range(V)]),
                            torch.stack([torch.stack([probs([a, b]) for b in range(V)]) for a in range(V)]))
    x1 = int(expected.sum((1, 2)).argmax())  # the likeliest first token and its likeliest successor, then any
    earlier = [[3, x1, int(expected[x1].sum(1).argmax()), 1, 2, 4]] * 2  # steady: the first round may skip the tree
    toks = torch.tensor([speculative(target, draft, prompt, Stream(TreeShape(4, 2, 2), [earlier], M=4, **kw), 3,
                                     Sampling(temperature, seed=s)).tokens for s in range(N)])  # (N, 3)
    stat, df, pval = chi_square(torch.bincount(toks @ torch.tensor([V * V, V, 1]), minlength=V ** 3),
                                expected.reshape(-1))
    print(f"stream + tree T={temperature}: N={N} chi2={stat:.1f} df={df} p={pval:.3g}")
    assert pval > SIGNIFICANCE, (stat, df, pval)


def peeking(live, dead, p_logits, sampling):
    """first3_by_rounds' pick for a proposal that reads the round's draws: each last token's merged tree (live: token
    -> (tree, node tokens, the proposal's first node)), unless a peek at the draws (a clone of the row's generator,
    verify_tree's sample) shows the target will not draw P's likeliest token below the proposal's first node; then
    the same layout with the proposal dead (dead: token -> (tree, node tokens)), every other node's draw the same."""
    def pick(last, g):
        tree, toks, node = live[last]
        peek = torch.Generator()
        peek.set_state(g.get_state())
        y = speculate.sample(sampling.probs(p_logits[toks][None])[0], peek)  # (N+1,) every node's draw
        return (tree, toks) if int(y[node]) == int(p_logits[toks[node]].argmax()) else dead[last]
    return pick


@pytest.mark.parametrize("temperature,top_p", [(1.0, None), (0.6, 0.98)])
def test_a_multi_path_trie_keeps_the_target_law_and_a_peeking_proposal_does_not(temperature, top_p):
    """Issue #60's exactness, per position: rounds of verify_tree over a Markov target P, the draft's top-2 tree of
    depth 2 with a trie of the sampled stream merged into it (propose: two earlier samples that part after their
    first token, and a token of one recurs: the trie has a node with two children), until 3 tokens are out: the first 3 follow P (chi-square,
    level 1e-3, N = 5,000). The negative control reads the round's draws (it keeps the proposal only where the target
    will draw P's likeliest token below it): rejected."""
    V, x0, N = 5, 2, 5_000
    p_logits, _ = markov_pair(V, seed=21)
    P = speculate.process_logits(p_logits, temperature, None, top_p)
    expected = joint_first3(P, x0)
    live, dead = {}, {}
    for x in range(V):
        t, toks = markov_tree(-p_logits, x, 2, 2)  # the draft's top-2 tree: P's least likely tokens
        a = int(p_logits[x].argmax())
        b, c = p_logits[a].topk(2).indices.tolist()
        tokens, parents = propose([x], [[x, a, b, 1], [x, a, c, 3], [x, a, b, 4]], 4, 4)
        assert tokens[0] == a and max(Counter(parents).values()) >= 2  # a node of the trie with two children
        m = trees.merge(t, torch.tensor([tokens]), torch.tensor([parents]))
        first = [v for v in range(1, m.tokens.shape[1] + 1) if int(m.tokens[0, v - 1]) == a and m.parent[0, v] == 0]
        node_toks = torch.cat([toks, m.tokens[0, t.tokens.shape[1]:].clamp_min(0)])
        live[x] = (m, node_toks, first[0])
        off = trees.merge(t, torch.full((1, len(tokens)), -1), torch.tensor([parents]))  # the same layout, dead
        dead[x] = (off, torch.cat([toks, off.tokens[0, t.tokens.shape[1]:].clamp_min(0)]))
        assert is_trie(m) and off.tokens.shape == m.tokens.shape
    for name in ("correct", "peeks at the draws"):
        sampling = Sampling(temperature, top_p=top_p)
        out = first3_by_rounds({x: v[:2] for x, v in live.items()}, p_logits, x0, sampling, N, 22,
                               None if name == "correct" else peeking(live, dead, p_logits, sampling))
        stat, df, pval = chi_square(torch.bincount(out @ torch.tensor([V * V, V, 1]), minlength=V ** 3), expected)
        print(f"sampled-stream trie T={temperature} top_p={top_p} {name}: N={N} chi2={stat:.1f} df={df} p={pval:.3g}")
        assert (pval > SIGNIFICANCE) == (name == "correct"), (name, stat, df, pval)


def test_sampled_rows_with_siblings_keep_the_target_law():
    """The whole loop for a sampled plan: 3 rows of one prompt decoded as one batch, each with its own generator, the
    stream's trie read from two earlier plans that part and from the siblings' committed tokens (Stream siblings),
    merged into the draft's tree: every row's first 3 tokens follow the target's law (computed exactly by cache-free
    forwards; chi-square over the rows pooled, level 1e-3, N = 600 plans x 3 rows)."""
    target = small_vla(0)
    torch.manual_seed(3)
    draft = model.make_draft(target, n_layers=1).eval()
    V, N, rows, prompt, temperature = 5, 600, 3, dict(input_ids=torch.tensor([[0, 3]])), 0.8

    def probs(seq):
        with torch.no_grad():
            return speculate.process_logits(target(torch.tensor([[0, 3] + seq]))[0, -1], temperature)

    expected = torch.einsum("a,ab,abc->abc", probs([]), torch.stack([probs([a]) for a in range(V)]),
                            torch.stack([torch.stack([probs([a, b]) for b in range(V)]) for a in range(V)]))
    x1 = int(expected.sum((1, 2)).argmax())
    second = expected[x1].sum(1).topk(2).indices.tolist()
    earlier = [[3, x1, second[0], 1, 2], [3, x1, second[1], 4, 2]]  # two samples of the frame before, parting
    toks = []
    for s in range(N):
        stream = Stream(TreeShape(4, 2, 2), [earlier] * rows, M=6, alpha=4, siblings=rows)
        toks += [r.tokens for r in speculative_batch(target, draft, prompt, stream, 3, samples=rows,
                                                     sampling=Sampling(temperature, seed=rows * s))]
    toks = torch.tensor(toks)  # (N rows, 3)
    stat, df, pval = chi_square(torch.bincount(toks @ torch.tensor([V * V, V, 1]), minlength=V ** 3),
                                expected.reshape(-1))
    print(f"sampled stream, siblings, T={temperature}: N={len(toks)} chi2={stat:.1f} df={df} p={pval:.3g}")
    assert pval > SIGNIFICANCE, (stat, df, pval)


# ---- toy clips ----
def exact_marginals(split):
    """The split's exact law of (decision, in-lane ring) and of the left roadside actor, from the world's tables."""
    main, left = Counter(), Counter()
    for f, p in driving.main_distribution(split):
        main[f.decision, f.bucket] += p
        for (lft, _), q in driving.roadside_distribution(f.road, f.event, split):
            left[lft] += p * q
    return main, left


@pytest.mark.parametrize("split,interval,rate", [("train", 2.0, 0.05), ("test", 0.5, None)])
def test_clip_frames_are_distributed_as_single_scenes(split, interval, rate):
    """The last frame of each of 400 independent clips (its factors moved by every kind of step: at 2 s each ring
    moves every frame) against the split's exact law: chi-square, level 1e-3, on (decision, in-lane ring) and on the
    left actor. Held-out clips keep a held-out combination in every frame."""
    clips = driving.make_clips(split, 400, 4, interval, rate, seed=5)
    for i, key in enumerate(exact_marginals(split)):
        law = exact_marginals(split)[i]
        cells = sorted(law, key=str)
        got = Counter((c[-1].f.decision, c[-1].f.bucket) if i == 0 else c[-1].f.left for c in clips)
        assert set(got) <= set(cells)
        stat, df, pval = chi_square(torch.tensor([got[c] for c in cells]), torch.tensor([law[c] for c in cells]))
        assert pval > SIGNIFICANCE, (split, i, stat, df, pval)
    for c in clips if split == "test" else ():
        for s in c:
            held = [(s.f.event, a[0], s.f.road) in driving.HELD_OUT for a in (s.f.left, s.f.right) if a is not None]
            assert any(held), s.f


def test_clip_events_and_rings():
    """Rate 0: the road, the event and the history class never change within a clip, the rings do; rate 1: every
    frame a new draw. The factors carry over; the continuous state (speed, poses, history) is drawn again."""
    still = driving.make_clips("train", 40, 6, 1.0, 0.0, seed=1)
    keys = lambda s: (s.f.road, s.f.event, s.f.hist_class)  # noqa: E731
    assert all(keys(s) == keys(c[0]) for c in still for s in c)
    assert any(s.f.bucket != c[0].f.bucket or s.f.left != c[0].f.left for c in still for s in c)
    assert any(not np.array_equal(c[0].hist, c[1].hist) for c in still)
    new = driving.make_clips("train", 40, 6, 1.0, 1.0, seed=1)
    assert sum(keys(a) != keys(b) for c in new for a, b in zip(c, c[1:])) > 100  # of 200 pairs
    assert driving.event_rate(0.5) == pytest.approx(1 - np.exp(-0.05)) and driving.event_rate(0.1) < 0.011


@pytest.mark.parametrize("kw,message", [({"frames": 1}, "2..1000 frames"), ({"interval": 0}, "seconds > 0"),
                                        ({"frames": 10**8}, "2..1000 frames"), ({"n": 10**8}, "0..10000 clips"),
                                        ({"interval": float("inf")}, "a finite number of seconds"),
                                        ({"rate": 1.5}, "per-frame probability"), ({"split": "nope"}, "unknown split")])
def test_clip_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        driving.make_clips(**{"split": "train", "n": 1, **kw})


def test_reword_paraphrases_and_swaps_clauses_at_its_rate():
    """The rewording figure's rule: r 0 leaves a plan as it was; r 1 swaps every paraphrase word for its pair and two
    adjacent clauses, keeping <cot_start>, <cot_end> and the clauses' words; in between, about r of the words."""
    from beyond.stream import PARAPHRASES, reword
    tok = driving.Tokenizer()
    plan = [tok.cot_start_id] + tok.encode("cruising in a gentle left curve at 30 km/h , keep speed , car 15 m left "
                                           "and vehicle 20 m right") + [tok.cot_end_id]
    rng = np.random.default_rng(0)
    assert reword(plan, 0.0, rng, tok) == plan
    pair = dict(PARAPHRASES) | {b: a for a, b in PARAPHRASES}
    out = tok.decode(reword(plan, 1.0, rng, tok)).split()
    assert out[0] == "<cot_start>" and out[-1] == "<cot_end>"
    clauses = [c.split() for c in " ".join(out[1:-1]).split(" , ")]
    want = [[pair.get(w, w) for w in c.split()] for c in tok.decode(plan[1:-1]).split(" , ")]
    assert clauses != want and sorted(map(tuple, clauses)) == sorted(map(tuple, want))  # two clauses traded places
    # r 0.3, no clause swap drawn: each paraphrase word swapped with probability 0.3 (2,000 plans: the share within
    # 5 standard errors of 0.3, a false failure about once in 3 million runs)
    n = swapped = 0
    for s in range(2000):
        out = reword(plan, 0.3, np.random.default_rng(s), tok)
        if len(out) == len(plan) and all(a == b or pair.get(tok.vocab[a]) == tok.vocab[b] for a, b in zip(plan, out)):
            n += sum(tok.vocab[t] in pair for t in plan)
            swapped += sum(a != b for a, b in zip(plan, out))
    assert abs(swapped / n - 0.3) < 5 * (0.3 * 0.7 / n) ** 0.5, swapped / n
