"""Tests for draft trees (tree.TreeShape, grow, verify_tree, tree_round): greedy tree decoding equals
target-only decoding token for token (fp32), every node's verify logits equal a cache-free forward over its path,
both caches hold exactly the committed tokens after every round, and sampled tree decoding keeps the target's law.

Chi-square tests: level 1e-3 per check, so a correct implementation fails each with probability 1e-3 over the
random draws (about 3e-3 for the three checks of correct samplers here); each negative control (one random draw
reused at every node of a round, a known trap) fails its check with a p-value below 1e-20 at the same N. The seeds
are fixed, so a run is deterministic; the rates apply to a change of seed or draw order.

run: python -m pytest -q tests/test_tree.py
"""
import dataclasses
import os

import pytest
from test_speculate import (
    SIGNIFICANCE,
    assert_cache_matches_prefill,
    chi_square,
    drafts_for,
    joint_first3,
    markov_pair,
    o1_init,
    seeded_rows,
    tiny_target,
    vla_greedy_reference,
    vla_prompts
)
import torch

import model
from ops import compiled
import speculate
from speculate import Sampling, autoregressive, speculative
import tree as trees
from tree import Tree, TreeShape
from speculate import speculative as tree_speculative
from tree import tree_round, verify_tree

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = [TreeShape(4, 4, 1), TreeShape(8, 4, 2), TreeShape(16, 5, 3), TreeShape(3, 1, 3), TreeShape(12, 3, 4)]


# ---- greedy: exactness ----


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tree_greedy_equals_target(shape):
    target = tiny_target()
    for pname, prompt in vla_prompts().items():
        ref = autoregressive(target, prompt, 24).tokens
        for dname, draft in drafts_for(target).items():
            res = tree_speculative(target, draft, prompt, shape, 24)
            assert res.tokens == ref, (pname, dname, shape)
            if dname == "identical" and shape.width == 1:  # a chain of the target's own tokens: all accepted
                assert res.blocks[:-1] == [shape.depth + 1] * (len(res.blocks) - 1), (pname, res.blocks)


def test_width_one_tree_is_the_chain():
    """TreeShape(gamma, gamma, 1) proposes and accepts what the chain of gamma does, round for round."""
    target = tiny_target()
    for prompt in vla_prompts().values():
        for draft in drafts_for(target).values():
            for gamma in (1, 3, 6):
                chain = speculative(target, draft, prompt, gamma, 20)
                tree = tree_speculative(target, draft, prompt, TreeShape(gamma, gamma, 1), 20)
                assert (tree.tokens, tree.blocks, tree.accepted) == (chain.tokens, chain.blocks, chain.accepted)


def test_tree_stop_token_and_max_new_tokens_inside_an_accepted_path():
    target = tiny_target()
    prompt = vla_prompts()["text"]
    ref = autoregressive(target, prompt, 30).tokens
    shape = TreeShape(16, 6, 3)
    for n in (1, 2, 5, 7, 13):  # max_new_tokens ends inside a round of the identical draft (7 tokens per round)
        res = tree_speculative(target, target, prompt, shape, n)
        assert res.tokens == ref[:n] and len(res.tokens) == n, n
    stop = ref[9]  # a stop token the identical draft's round proposes in the middle of its path
    first = ref.index(stop)
    res = tree_speculative(target, target, prompt, shape, 30, stop_token=stop)
    assert res.tokens == ref[:first + 1]
    assert any(b < n + 1 for n, b in zip(res.accepted, res.blocks))  # the cut fell inside an accepted path


def test_tree_greedy_equals_target_toy_checkpoints():
    """Every shipped draft (replica, FlatRoPE, AARL; seeds 0-2) with a 32-node tree on held-out scenes."""
    if not os.path.isdir("checkpoints/toy/target"):
        pytest.skip("no shipped checkpoints")
    import driving
    import evaluate
    from ops import checkpoint
    tok = driving.Tokenizer()
    target = checkpoint.load("checkpoints/toy/target").eval()
    data = driving.Data("test", 3, 0, tok)
    prompts = evaluate.scene_prompts(data.scenes, tok, "cpu", views=data.views_at(0))
    refs = [autoregressive(target, p, evaluate.MAX_NEW_TOKENS, stop_token=tok.cot_end_id).tokens for p in prompts]
    for kind in ("mrope", "flat", "aarl"):
        for seed in (0, 1, 2):
            draft = checkpoint.load(checkpoint.draft_dir("checkpoints/toy", kind, seed), target=target).eval()
            for p, ref in zip(prompts, refs):
                res = tree_speculative(target, draft, p, TreeShape(32, 8, 3), evaluate.MAX_NEW_TOKENS,
                                  stop_token=tok.cot_end_id)
                assert res.tokens == ref, (kind, seed)


# ---- the verify forward and the caches ----


def test_tree_verify_logits_equal_a_cache_free_forward_over_each_path(monkeypatch):
    """In the first round's verify forward, node i's logits equal the target's cache-free forward over prompt +
    x_last's path to node i (max |diff| printed)."""
    target = tiny_target()
    draft = drafts_for(target)["perturbed"]
    seen = {}
    honest = trees.verify_tree

    def spy(tree, logits_p, *a, **kw):
        seen.setdefault("first", (tree, logits_p.clone()))
        return honest(tree, logits_p, *a, **kw)

    monkeypatch.setattr(trees, "verify_tree", spy)
    worst = 0.0
    for prompt in vla_prompts().values():
        seen.clear()
        tree_speculative(target, draft, prompt, TreeShape(16, 4, 3), 8)
        tree, logits_p = seen["first"]
        parent, tokens, logits_p = tree.parent[0].tolist(), tree.tokens[0].tolist(), logits_p[0]  # the one row
        assert len(tokens) == 16
        for v in range(len(parent)):
            path, u = [], v
            while u:
                path.append(tokens[u - 1])
                u = parent[u]
            p = dict(prompt, input_ids=torch.cat([prompt["input_ids"], torch.tensor([path[::-1]], dtype=torch.long)],
                                                 1))
            with torch.no_grad():
                ref = target(**p)[0, -1]  # (V,)
            worst = max(worst, float((logits_p[v] - ref).abs().max()))
    print(f"tree verify vs cache-free forward: max |diff| {worst:.2e}")
    assert worst < 1e-4


def test_tree_caches_hold_exactly_the_committed_tokens():
    """After every round of a tree decode, both caches equal fresh caches fed the committed tokens (target: all but
    x_last; draft: all but `pending`): with the model's steps, and with the compiled path's (compiled.CompiledSteps,
    eager here: its persistent caches and padded steps)."""
    target = tiny_target()
    prompt = vla_prompts()["image+video"]
    L = prompt["input_ids"].shape[1]
    kinds = set()
    shape = TreeShape(30, 4, 3)  # every candidate kept: the target as its own draft is then accepted in full
    for draft in (drafts_for(target)["random"], drafts_for(target)["perturbed"], target):
        t, d = target, draft
        for on_compiled_path in (False, True):
            if on_compiled_path:  # the draft's pending steps padded to its level's 3 tokens
                t, d = (compiled.CompiledSteps(target, 128, (shape.nodes + 1,), compile=False),
                        compiled.CompiledSteps(draft, 128, (shape.width,), compile=False))
            kinds |= tree_rounds_check(target, draft, t, d, prompt, shape, L)
    assert kinds == {"zero", "partial", "full"}, kinds  # every branch of the cache bookkeeping was checked


def tree_rounds_check(target, draft, t, d, prompt, shape, L):
    """5 tree rounds of t and d (target and draft, or their CompiledSteps), each cache checked after every round."""
    kinds = set()
    tcache = speculate.new_cache(t, prompt, 40, None, slack=shape.nodes)  # 5 rounds of at most 5 tokens
    dcache = speculate.new_cache(d, prompt, 40, None, slack=(shape.depth - 1) * shape.width)
    embeds, ds = speculate.embed_prompt(target, prompt)
    pending = speculate.prefill(t, prompt, embeds, tcache, ds).tolist()  # [[x_last]]: one row
    speculate.prefill(d, prompt, embeds, dcache)
    emitted = []
    with torch.no_grad():
        for _ in range(5):
            (n,), (acc,), (nxt,), pending = tree_round(t, d, tcache, dcache, pending, shape, Sampling(), None)
            kinds.add("zero" if n == 0 else "full" if n == shape.depth else "partial")
            emitted += acc + [nxt]
            committed = prompt["input_ids"][0, -1:].tolist() + emitted
            k = len(pending[0])
            assert pending[0] == committed[-k:]
            assert_cache_matches_prefill(target, tcache, prompt, emitted[:-1], target)
            if len(committed) > k:
                assert_cache_matches_prefill(draft, dcache, prompt, committed[1:len(committed) - k], target)
            else:
                assert dcache.length == L - 1
    assert emitted == vla_greedy_reference(target, prompt, len(emitted))
    return kinds


def test_tree_shape_errors():
    for bad in [(0, 1, 1), (4, 5, 1), (5, 2, 1), (2, 1, 1), ("4", 4, 1)]:
        with pytest.raises(ValueError, match="tree"):
            TreeShape(*bad)


# ---- sampling: the target's law ----


def reused_draw(probs, generator):
    """A known trap: one uniform for every row (every node of the round), not a fresh draw per node."""
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    u = torch.rand((), generator=generator, device=probs.device)
    idx = (flat.cumsum(-1) < u).sum(-1).clamp_max(flat.shape[-1] - 1)  # inverse CDF of each row at u
    return idx.view(probs.shape[:-1])


def markov_tree(Q, x0, k, depth):
    """The full k-ary tree of depth `depth` of a Markov draft Q (V, V) after x0, each node's children its top-k:
    (tree.Tree, token of every node incl. the root (N+1,))."""
    toks, parent, depth_of = [x0], [0], [0]
    frontier = [0]
    for d in range(1, depth + 1):
        new = []
        for f in frontier:
            for c in Q[toks[f]].topk(k).indices.tolist():
                toks.append(c), parent.append(f), depth_of.append(d), new.append(len(toks) - 1)
        frontier = new
    n = len(toks)
    anc = torch.eye(n, dtype=torch.bool)
    for v in range(n):
        u = v
        while u:
            u = parent[u]
            anc[v, u] = True
    tree = Tree(torch.tensor([toks[1:]]), torch.tensor([parent]), torch.tensor([depth_of]), anc[None],
                torch.full((1, n), -1))  # one row
    return tree, torch.tensor(toks)


def first3_by_rounds(trees, p_logits, x0, sampling, N, seed, pick=None):
    """N times, rounds of verify_tree over a Markov target (p_logits (V, V)) from x0, each round's tree the one of its
    last token (trees: token -> (tree.Tree, token of every node)), until 3 tokens are out -> the first 3 (N, 3).
    pick(last, generator) -> (tree, tokens): the round's tree chosen another way (tests/test_stream.py's control),
    each draw from one generator in turn. Without pick, trees of one size: the N decodes as rows of one batch, row i
    drawing from its own generator (seed + i), as a decode's rows do."""
    if pick is None and len({len(toks) for _, toks in trees.values()}) == 1:
        return first3_by_batched_rounds(trees, p_logits, x0, sampling, N, seed)
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(N, 3, dtype=torch.long)
    for i in range(N):
        seq, last = [], x0
        while len(seq) < 3:
            tree, toks = trees[last] if pick is None else pick(last, g)
            best, nxt = verify_tree(tree, p_logits[toks][None], sampling, [g])
            path, u = [], int(best[0])
            while u:
                path.append(int(toks[u]))
                u = int(tree.parent[0, u])
            seq += path[::-1] + [int(nxt)]
            last = seq[-1]
        out[i] = torch.tensor(seq[:3])
    return out


def first3_by_batched_rounds(trees, p_logits, x0, sampling, N, seed):
    """first3_by_rounds' N decodes as rows: each round, every row not done verifies the tree of its last token."""
    xs = sorted(trees)
    bank = Tree(*(torch.cat([getattr(trees[x][0], f.name) for x in xs]) for f in dataclasses.fields(Tree)))
    bank_toks = torch.stack([trees[x][1] for x in xs])  # (X, n): token of every node, the root's first
    row_of = {x: i for i, x in enumerate(xs)}
    gens = [torch.Generator().manual_seed(seed + i) for i in range(N)]
    seqs, last = [[] for _ in range(N)], [x0] * N
    while live := [i for i in range(N) if len(seqs[i]) < 3]:
        at = torch.tensor([row_of[last[i]] for i in live])  # (R,) each row's tree in the bank
        tree = Tree(*(getattr(bank, f.name)[at] for f in dataclasses.fields(Tree)))
        toks = bank_toks[at]  # (R, n)
        best, nxt = verify_tree(tree, p_logits[toks], sampling, [gens[i] for i in live])
        for r, i in enumerate(live):
            path, u = [], int(best[r])
            while u:
                path.append(int(toks[r, u]))
                u = int(tree.parent[r, u])
            seqs[i] += path[::-1] + [int(nxt[r])]
            last[i] = seqs[i][-1]
    return torch.tensor([q[:3] for q in seqs])  # (N, 3)


@pytest.mark.parametrize("temperature,top_p", [(1.0, None), (1.4, 0.9)])
def test_verify_tree_distribution(temperature, top_p, monkeypatch):
    """Rounds of verify_tree over a Markov target P and a top-k tree of a Markov draft Q until 3 tokens are out:
    the first 3 follow P exactly (chi-square, level 1e-3, N = 10,000); the reused-draw control is rejected."""
    V, x0, N, k = 5, 2, 10_000, 2
    p_logits, q_logits = markov_pair(V, seed=21)
    P = speculate.process_logits(p_logits, temperature, None, top_p)
    expected = joint_first3(P, x0)
    trees = {x: markov_tree(q_logits, x, k, 2) for x in range(V)}
    for name in ("correct", "reused draw"):
        if name == "reused draw":
            monkeypatch.setattr(speculate, "sample", reused_draw)
        out = first3_by_rounds(trees, p_logits, x0, Sampling(temperature, top_p=top_p), N, seed=22)
        stat, df, pval = chi_square(torch.bincount(out @ torch.tensor([V * V, V, 1]), minlength=V ** 3), expected)
        print(f"verify_tree T={temperature} top_p={top_p} {name}: N={N} chi2={stat:.1f} df={df} p={pval:.3g}")
        assert (pval > SIGNIFICANCE) == (name == "correct"), (name, stat, df, pval)


def small_vla(seed):
    cfg = model.ModelConfig(vocab_size=5, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=48,
                            rope_theta=100.0, mrope_section=(2, 3, 3), image_token_id=100, video_token_id=101,
                            vision_start_token_id=102, vision=None, traj_len=0)
    torch.manual_seed(seed)
    return o1_init(model.VLA(cfg).eval(), seed)


@pytest.mark.parametrize("path", ["eager", "compiled, dynamo",
                                  pytest.param("compiled, inductor", marks=pytest.mark.slow)])
def test_speculative_tree_distribution(path, monkeypatch):
    """The whole loop, a tree decode per sample with its own seed (seeded_rows), on a small VLA and a 1-layer draft:
    first 3 tokens ~ the target's law (computed exactly by cache-free forwards; chi-square, level 1e-3, N = 2000);
    the reused-draw control is rejected at the same N. Eagerly, and on the compiled path (compiled.CompiledSteps):
    dynamo's graphs run by its eager backend (the tracing, guards and padding at test speed), or inductor's (slow)."""
    target = small_vla(0)
    torch.manual_seed(3)
    draft = model.make_draft(target, n_layers=1).eval()
    o1_init(draft, 4)
    V, N, prompt, temperature = 5, 2000, dict(input_ids=torch.tensor([[0, 3]])), 0.8

    def probs(seq):
        with torch.no_grad():
            return speculate.process_logits(target(torch.tensor([[0, 3] + seq]))[0, -1], temperature)

    expected = torch.einsum("a,ab,abc->abc", probs([]), torch.stack([probs([a]) for a in range(V)]),
                            torch.stack([torch.stack([probs([a, b]) for b in range(V)]) for a in range(V)]))
    if path != "eager":
        torch._dynamo.reset()
        if path == "compiled, dynamo":
            compile_ = torch.compile
            monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", fullgraph=True,
                                                                            dynamic=False))
    steps = {}  # rows -> compiled steps of that batch

    def decode(target, draft, prompt, shape, n, samples, sampling):
        B = prompt["input_ids"].shape[0] * samples
        if path != "eager" and B not in steps:
            steps[B] = compiled.CompiledSteps(target, 16, (5,), B), compiled.CompiledSteps(draft, 16, (1, 2), B)
        return speculate.speculative_batch(*steps.get(B, (target, draft)), prompt, shape, n, samples, sampling)

    for name in ("correct", "reused draw"):
        if name == "reused draw":
            monkeypatch.setattr(speculate, "sample", reused_draw)
        toks = seeded_rows(decode, target, draft, prompt, TreeShape(4, 2, 2), 3, N, temperature=temperature)  # (N, 3)
        stat, df, pval = chi_square(torch.bincount(toks @ torch.tensor([V * V, V, 1]), minlength=V ** 3),
                                    expected.reshape(-1))
        print(f"speculative tree T={temperature} {name}: N={N} chi2={stat:.1f} df={df} p={pval:.3g}")
        assert (pval > SIGNIFICANCE) == (name == "correct"), (name, stat, df, pval)


def test_tree_on_padded_steps_equals_target():
    """Tree rounds through compiled.CompiledSteps (eager here: its persistent cache and step-length padding, what
    --compile compiles) emit target-only greedy tokens, max-new cutting inside an accepted path included."""
    target = tiny_target()
    prompt = vla_prompts()["image+video"]
    ref = autoregressive(target, prompt, 20).tokens
    shape = TreeShape(12, 4, 3)
    for draft in drafts_for(target).values():
        st = compiled.CompiledSteps(target, 160, (1, shape.nodes + 1), compile=False)
        sd = compiled.CompiledSteps(draft, 160, (1, 2, shape.width), compile=False)
        for n in (20, 7):
            assert tree_speculative(st, sd, prompt, shape, n).tokens == ref[:n]


def test_kv_cache_move():
    """KVCache.move copies the slots in every layer and row, sources read before any is overwritten."""
    g = torch.Generator().manual_seed(0)
    a = model.KVCache(3, 2, 2, 10, 4)
    for t in a.k + a.v:
        t.normal_(generator=g)
    before = torch.stack(a.k).clone()
    src, dst = [4, 6, 9], [2, 3, 4]  # dst 4 is also a source: it must be read first
    a.move(torch.tensor([src, src]), torch.tensor([dst, dst]))
    assert torch.equal(torch.stack(a.k)[..., dst, :], before[..., src, :])
    keep = [i for i in range(10) if i not in dst]
    assert torch.equal(torch.stack(a.k)[..., keep, :], before[..., keep, :])
    # rows with their own paths, one of them empty (its columns copy slots onto themselves): each row moves its own
    before = torch.stack(a.v).clone()  # (layers, B, Hk, S, hd)
    a.move(torch.tensor([[5, 8], [1, 2]]), torch.tensor([[1, 2], [1, 2]]))
    assert torch.equal(torch.stack(a.v)[:, 0, :, [1, 2]], before[:, 0, :, [5, 8]])
    assert torch.equal(torch.stack(a.v)[:, 0, :, [0, 3, 4, 5, 6, 7, 8, 9]], before[:, 0, :, [0, 3, 4, 5, 6, 7, 8, 9]])
    assert torch.equal(torch.stack(a.v)[:, 1], before[:, 1])
