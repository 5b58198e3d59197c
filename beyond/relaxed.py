"""Relaxed (lossy) acceptance, opt-in and off by default: the paper's premise made a knob. Routine CoC tokens follow
from the trajectory history and commitments need fresh evidence; a relaxed rule accepts a drafted token the exact
rule (speculate.verify_greedy / verify_sample, tree.verify_tree) rejects when the target finds it likely enough,
either at every position (token-level, Medusa's typical acceptance) or at routine positions only, every commitment
still verified exactly (reasoning-aware). The output is then no longer the target's: what it costs is priced in tau
against how far the plan moves (experiments/relaxed_acceptance.py, the README's "Relaxed acceptance").

Where it enters: speculate.Sampling(relaxed=Relaxed(...)); the chain verifiers OR the exact rule with
Sampling.also_accepts, tree.verify_tree picks its path through Relaxed.tree_children, both only when lossy.

run: python -m pytest -q tests/test_relaxed.py     (python bench.py --relaxed routine:0.999999 ...)
"""
from dataclasses import dataclass
import functools
import math
import numbers

import torch


@dataclass(frozen=True)
class Relaxed:
    """Relaxed (lossy) acceptance, opt-in: a drafted token x the exact rule rejects is also accepted when p(x) >=
    min(eps, delta exp(-H(p))), Medusa's typical acceptance (Cai et al. 2024), with eps = 1 - bound and delta =
    sqrt(eps) (Medusa's defaults, eps 0.09 and delta 0.3, are bound 0.91). Greedy decoding judges p at temperature 1,
    sampling the processed p it samples from. Bound 0 adds nothing (exact); a bound just above 0 already accepts tokens
    near p's top (the threshold tends to exp(-H), which is at most max p), and bound 1 accepts every draft.
    rule "typical" relaxes every position; "routine" (the paper's premise made a knob) only positions that commit to
    nothing: neither the drafted token nor p's argmax is in `commitments` (token ids: on the toy the words its CoC
    grammar leaves open, driving.commitment_words; on a real target the user's list). A commitment position is verified
    exactly, so its token's law given the prefix is p's."""
    rule: str  # "typical" or "routine"
    bound: float  # in [0, 1]: 0 = exact verification
    commitments: frozenset = frozenset()  # token ids the routine rule keeps exact

    def __post_init__(self):
        if self.rule not in ("typical", "routine"):
            raise ValueError(f"relaxed rule must be 'typical' or 'routine', got {self.rule!r}")
        if not (isinstance(self.bound, (int, float)) and 0 <= self.bound <= 1):
            raise ValueError(f"relaxed bound must be in [0, 1] (0 = exact), got {self.bound!r}")
        # a bool is an int to Python, a negative id the last tokens to torch's indexing, a fraction rounds down
        if bad := [i for i in self.commitments if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0]:
            raise ValueError(f"commitment token ids must be ints >= 0, got {bad[0]!r}")
        object.__setattr__(self, "commitments", frozenset(int(i) for i in self.commitments))
        if self.rule == "routine" and not self.commitments:
            raise ValueError("the routine rule needs the commitment token ids it keeps exact")

    def check_vocab(self, V):
        """A ValueError naming a commitment id outside a vocabulary of V ids: called once the target is known, before
        any decoding (accepts checks again at the first relaxed verify)."""
        if self.rule == "routine" and (hi := max(self.commitments)) >= V:
            raise ValueError(f"commitment token id {hi} is outside the target's vocabulary 0..{V - 1}")
        return self

    def accepts(self, logits_p, x, sampling):
        """logits_p (..., V) of p where the tokens x (...) were drafted, and the decode's speculate.Sampling -> bool
        (...): x passes."""
        p = torch.softmax(logits_p.float(), -1) if sampling.greedy else sampling.probs(logits_p)  # (..., V)
        top = logits_p.argmax(-1)  # (...) p's likeliest token
        eps = 1.0 - self.bound
        h = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (...) entropy H(p)
        ok = p.gather(-1, x[..., None])[..., 0] >= torch.clamp(math.sqrt(eps) * torch.exp(-h), max=eps)  # (...)
        if self.rule == "routine":
            self.check_vocab(p.shape[-1])
            commit = vocab_mask(self.commitments, p.shape[-1], p.device)  # (V,)
            ok &= ~commit[x] & ~commit[top]
        return ok

    def tree_children(self, drawn, parent, tokens, logits_p, sampling):
        """tree.verify_tree's lossy seam: drawn (B, N) the nodes that hold their parent's draw y_v, parent (B, N+1),
        tokens (B, N), logits_p (B, N+1, V) -> (B, N) the nodes descended into. The rule also accepts a child its
        parent's p passes. Each node picks one child, top-down: the one holding y_v, else the relaxed child of highest
        q (the lowest index); the path then never depends on a draw below it, so a commitment node (exact) still
        emits y_v ~ p."""
        at_parent = parent[:, 1:, None].expand(-1, -1, logits_p.shape[-1])  # (B, N, V)
        also = self.accepts(logits_p.gather(1, at_parent), tokens, sampling)  # (B, N)
        N = drawn.shape[1]
        pri = torch.where(drawn | also, 2 * N * drawn + N - torch.arange(N, device=drawn.device), -1)  # (B, N) unique
        best = torch.full_like(parent, -1).scatter_reduce(1, parent[:, 1:], pri, "amax")  # (B, N+1) per parent
        return (pri >= 0) & (pri == best.gather(1, parent[:, 1:]))


@functools.lru_cache(maxsize=8)
def vocab_mask(ids, V, device):
    """(V,) bool, True at the token ids in `ids` (a frozenset): built once per vocabulary and device, not per round."""
    mask = torch.zeros(V, dtype=torch.bool, device=device)
    mask[torch.tensor(sorted(ids), device=device)] = True
    return mask
