"""Tests for relaxed (lossy, opt-in) acceptance, speculate.Relaxed: bound 0 is today's exact verification (greedy
output = target-only, chain and tree); bound 1 accepts every draft; the routine rule keeps every commitment position
exact, greedy (each such token is the target's argmax given the emitted prefix) and sampled (the first token's law,
at a commitment position, is p's: chi-square, level 1e-3, so a correct rule fails each of the two checks with
probability 1e-3; the token-level rule at the same bound, the negative control, fails with p < 1e-30).

run: python -m pytest -q tests/test_relaxed.py
"""
import pytest
from test_speculate import (SIGNIFICANCE, ToyLM, chi_square, drafts_for, markov_pair, prompt_of, seeded_rows,
                            tiny_target, vla_prompts)
from test_tree import markov_tree
import torch

import driving
import speculate
from beyond.relaxed import Relaxed
from speculate import Sampling, autoregressive, speculative
from tree import TreeShape, verify_tree

pytestmark = pytest.mark.usefixtures("one_thread")

COMMIT = frozenset(range(0, 97, 2))  # the tiny target's even ids stand for commitments


def decoders():
    return {"chain": lambda t, d, p, s: speculative(t, d, p, 4, 20, s),
            "tree": lambda t, d, p, s: speculate.speculative(t, d, p, TreeShape(8, 4, 2), 20, s)}


def test_relaxed_settings_are_checked():
    for bad in [dict(rule="fuzzy", bound=0.5), dict(rule="typical", bound=1.5), dict(rule="typical", bound=-0.1),
                dict(rule="routine", bound=0.5)]:
        with pytest.raises(ValueError):
            Relaxed(**bad)
    assert not Sampling(relaxed=Relaxed("typical", 0.0)).lossy and Sampling(relaxed=Relaxed("typical", 0.5)).lossy
    with pytest.raises(ValueError, match="commitment token id 99 is outside the target's vocabulary 0..4"):
        Relaxed("routine", 0.5, {1, 99}).accepts(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), Sampling())


@pytest.mark.parametrize("rule", ["typical", "routine"])
def test_bound_zero_is_exact(rule):
    """Bound 0 is the exact rule: greedy output equals target-only decoding token for token, chain and tree."""
    target = tiny_target()
    s = Sampling(relaxed=Relaxed(rule, 0.0, COMMIT))
    for pname, prompt in vla_prompts().items():
        ref = autoregressive(target, prompt, 20).tokens
        for dname, draft in drafts_for(target).items():
            for name, decode in decoders().items():
                assert decode(target, draft, prompt, s).tokens == ref, (pname, dname, name)


def test_bound_one_accepts_every_chain_draft():
    target = tiny_target()
    draft = drafts_for(target)["random"]
    res = speculative(target, draft, vla_prompts()["text"], 4, 20, Sampling(relaxed=Relaxed("typical", 1.0)))
    assert res.accepted == [4] * res.rounds and res.tokens != autoregressive(target, vla_prompts()["text"], 20).tokens


@torch.no_grad()
def teacher_forced_argmax(target, prompt, tokens):
    """The target's argmax at each emitted position given the prompt and the tokens before it: the prompt prefilled,
    the tokens fed as one cached step, read as text as the decode reads them (a draft may propose a placeholder id)."""
    cache = target.new_cache(max_len=prompt["input_ids"].shape[1] + len(tokens))
    first = target(**prompt, cache=cache)[0, -1:]  # (1, V)
    return torch.cat([first, target(torch.tensor([tokens[:-1]]), cache=cache)[0]]).argmax(-1).tolist()


def test_routine_rule_keeps_commitments_exact_greedy():
    """Routine rule at bound 1 (every other draft accepted): wherever the target's argmax given the emitted prefix is a
    commitment, or the emitted token is one, the emitted token is that argmax. The token-level rule breaks it."""
    target = tiny_target()
    relaxed_somewhere, broken = False, False
    for pname, prompt in vla_prompts().items():
        for dname, draft in drafts_for(target).items():
            for name, decode in decoders().items():
                for rule in ("routine", "typical"):
                    out = decode(target, draft, prompt, Sampling(relaxed=Relaxed(rule, 1.0, COMMIT))).tokens
                    top = teacher_forced_argmax(target, prompt, out)
                    kept = all(x == t for x, t in zip(out, top) if x in COMMIT or t in COMMIT)
                    if rule == "routine":
                        assert kept, (pname, dname, name, out, top)
                        relaxed_somewhere |= out != top
                    else:
                        broken |= not kept
    assert relaxed_somewhere and broken  # the rule did relax, and the control shows the check can fail


def first_token_law_pvalue(draw, P, x0, N):
    counts = torch.bincount(torch.tensor([draw(s) for s in range(N)]), minlength=P.shape[0])
    return chi_square(counts, P[x0])[2]


def test_routine_rule_commitment_law_sampled():
    """Sampling (T = 1), routine rule at bound 1 with p's argmax after x0 a commitment: the first token, chain and
    tree, follows p exactly (chi-square, level 1e-3, N = 4000); the typical rule at bound 1 is rejected."""
    V, x0, N = 5, 2, 4000
    p_logits, q_logits = markov_pair(V, seed=31)
    P = speculate.process_logits(p_logits, 1.0)
    commit = frozenset([int(P[x0].argmax())])
    target, draft = ToyLM(p_logits), ToyLM(q_logits)
    trees = {x: markov_tree(q_logits, x, 2, 2) for x in range(V)}
    for rule in ("routine", "typical"):
        relaxed = Relaxed(rule, 1.0, commit)

        firsts = seeded_rows(speculate.speculative_batch, target, draft, prompt_of(0, x0), 2, 1, N, temperature=1.0,
                             relaxed=relaxed)[:, 0]  # (N,)

        def chain(s):
            return int(firsts[s])

        def tree_first(s):
            t, toks = trees[x0]
            best, nxt = verify_tree(t, p_logits[toks][None], Sampling(1.0, relaxed=relaxed),
                                    [torch.Generator().manual_seed(s)])
            u = int(best[0])
            while u and int(t.parent[0, u]):  # the first node below the root on the path, or the next token
                u = int(t.parent[0, u])
            return int(toks[u]) if u else int(nxt)

        for name, draw in (("chain", chain), ("tree", tree_first)):
            pval = first_token_law_pvalue(draw, P, x0, N)
            print(f"relaxed {rule} {name}: N={N} p={pval:.3g}")
            assert (pval > SIGNIFICANCE) == (rule == "routine"), (rule, name, pval)


def test_commitment_words_are_the_grammars_open_choices():
    words = driving.commitment_words()
    assert {"stop", "follow", "nudge", "keep", "slow", "<cot_end>"} <= set(words)
    assert not {"km/h", "the", "curve", ","} & set(words)
    tok = driving.Tokenizer()
    scenes = driving.make_split("test", 64)
    # every position the answer's mask calls a commitment holds one of these words (the proxy misses none)
    for s in scenes:
        for w, c in zip(s.coc + ["<cot_end>"], s.commit):
            assert not c or w in words, (w, s.coc)
    assert tok.encode(words)


def test_relaxed_flags_are_one_line_errors(tmp_path):
    """flags.relaxed_rule, the --relaxed / --commitments flags of bench.py and rsd.py: every bad value a ValueError
    naming the flag, before any work."""
    from measure import flags
    bad_file, good = tmp_path / "bad.json", tmp_path / "ids.json"
    bad_file.write_text('{"stop": 5}')
    good.write_text("[3, 5]")
    cases = [(("typical",), "RULE:BOUND"), (("typical:x",), "RULE:BOUND"), (("typical:1.5",), "bound"),
             (("fuzzy:0.5",), "rule"), ((None, str(good)), "--commitments"), (("routine:0.5",), "--commitments"),
             (("routine:0.5", str(bad_file)), "JSON list"), (("routine:0.5", str(tmp_path / "none.json")), "not found")]
    for args, words in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=words):
            flags.relaxed_rule(*args)
    assert flags.relaxed_rule(None) is None
    r = flags.relaxed_rule("routine:0.5", str(good))
    assert (r.rule, r.bound, r.commitments) == ("routine", 0.5, {3, 5})
    assert flags.relaxed_rule("routine:0.5", default=[7]).commitments == {7}
    report = flags.sampling_json(flags.sampling(relaxed=r))
    assert report["lossy"] and report["verification"] == {"rule": "routine", "bound": 0.5, "commitments": 2}
    assert flags.sampling_json(flags.sampling())["verification"] == "exact"
