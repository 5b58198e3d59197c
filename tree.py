"""Draft trees: EAGLE-2's dynamic tree (Li et al. 2024), verified in one target forward.

Instead of one chain the routine reasoner grows a tree of N candidates where it is unsure, the target verifies x_last
and all N nodes in one forward under a tree attention mask, and the round emits the longest path the target agrees
with plus its own next token; the chain of gamma is the tree of width 1. tree.speculative is speculate.speculative's
decode with these rounds in place of the chain's. The cache invariant is speculate.py's: after a round the accepted
path's keys / values sit in consecutive slots. Every tensor of a round has a fixed shape for its (N, D, k), so the
growth (grow) and the verify (tree_forward) each run as one compiled graph under model.CompiledSteps (--compile).

run: python -m pytest -q tests/test_tree.py      (the tree rows: python rsd.py --device cpu)
"""
from dataclasses import dataclass

import torch

import speculate  # speculate.sample, read at call time (tests replace it with a wrong sampler)

# ---- tree shape ----


@dataclass(frozen=True)
class TreeShape:
    """How a round's draft tree grows (EAGLE-2, Li et al. 2024): from the root x_last, `depth` levels; at each level
    the `width` nodes of highest cumulative log q get `width` children each (the draft's top-k, one batched draft
    forward per level); the `nodes` candidates of highest cumulative log q are what the target verifies. The chain
    of gamma tokens is TreeShape(gamma, gamma, 1)."""
    nodes: int  # N: draft tokens verified per round, besides x_last (the node budget)
    depth: int  # D: the longest path, = draft forwards per round
    width: int  # k: nodes expanded per level, and children per expanded node

    def __post_init__(self):
        for name in ("nodes", "depth", "width"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"tree {name} must be an int >= 1, got {v!r}")
        if not self.depth <= self.nodes <= self.candidates(self.depth):
            raise ValueError(f"a tree of depth {self.depth} and width {self.width} has {self.candidates(self.depth)} "
                             f"candidates and needs at least {self.depth} nodes to reach its depth; got {self.nodes}")

    def candidates(self, depth):
        """Candidates a tree of this width grows to `depth`: width at level 1, width^2 at each level after it."""
        return 0 if depth == 0 else self.width + (depth - 1) * self.width ** 2

    @property
    def slack(self):
        """Cache slots beyond the committed length a round writes: (target: the N nodes, draft: (D - 1) k)."""
        return self.nodes, (self.depth - 1) * self.width


# ---- draft, verify, one round ----


@dataclass
class Tree:
    """A draft tree of N nodes plus its root x_last (index 0); a parent precedes its children."""
    tokens: torch.Tensor  # (N,) token of node i + 1
    parent: torch.Tensor  # (N+1,) parent index (the root is its own)
    depth: torch.Tensor  # (N+1,) depth (the root 0)
    anc: torch.Tensor  # (N+1, N+1) bool: anc[i, j] = node j is node i or one of its ancestors
    fed: torch.Tensor  # (N+1,) the draft-cache slot of a node the draft was fed (an expanded node), else -1


def grow(draft, dcache, logits, root, shape):
    """The tree's levels, from q at the root logits (1, V), at fixed shapes for a given shape (N, D, k): one forward
    per level over the expanded nodes, each at a slot after the committed length `root` (0-d), position root - 1 +
    depth, seeing the committed cache and its own ancestors -> (Tree's fields, the last level's logits (k, V)).
    EAGLE-2's: the level-wise growth, top-k expansion and final top-N by cumulative log q. Ours: ties go to the
    shallower node (a child never scores above its parent, so the kept set is a tree); expanded nodes stay in the
    draft's cache (no re-feed)."""
    dev, k, D = logits.device, shape.width, shape.depth
    # the (D - 1) k expanded nodes' slots, positions (committed length + depth) and own-slot mask rows, level by level
    cols = torch.arange(dcache.max_len, device=dev)  # (S,)
    slots = root + torch.arange((D - 1) * k, device=dev)  # ((D-1) k,)
    pos = (root + torch.arange(D - 1, device=dev)).repeat_interleave(k)  # ((D-1) k,): root - 1 + depth
    own = cols[None] == slots[:, None]  # ((D-1) k, S)
    rows = (cols < root)[None]  # (F, S) what each expanded node sees; F = 1: the root
    f_idx, f_score = torch.full((1,), -1, device=dev), torch.zeros(1, device=dev)  # expanded: candidate id, log q
    tok, score, parent, expanded, n = [], [], [], [], 0  # n: candidates before this level
    for level in range(1, D + 1):
        s, t = torch.log_softmax(logits.float(), -1).topk(k, -1)  # (F, k): each expanded node's k likeliest children
        tok.append(t.reshape(-1))
        score.append((f_score[:, None] + s).reshape(-1))  # (F*k,) cumulative log q
        parent.append(f_idx.repeat_interleave(k))
        if level == D:
            break
        top = score[-1].topk(k).indices  # (k,) this level's best, expanded next
        f_idx, f_score = n + top, score[-1][top]
        expanded.append(f_idx)
        lv = slice((level - 1) * k, level * k)
        rows = rows[top // k] | own[lv]  # (k, S) the parent's row plus the node's own slot
        logits = draft.step(tok[-1][top][None], slots[None, lv], dcache, positions=pos[None, lv], mask=rows[None])[0]
        n += t.numel()
    tok, score, parent = (torch.cat(x) for x in (tok, score, parent))  # (C,) each
    depth = torch.tensor([1] * k + [d for d in range(2, D + 1) for _ in range(k * k)], device=dev)  # (C,)
    fed = torch.full_like(tok, -1)  # (C,) the draft-cache slot of an expanded candidate
    if expanded:
        fed[torch.cat(expanded)] = slots
    # Candidates lie in depth order, and a stable sort keeps it among equal scores: a parent precedes its children.
    keep = score.sort(descending=True, stable=True).indices[:shape.nodes]  # (N,)
    new = torch.zeros(len(tok) + 1, dtype=torch.long, device=dev)  # candidate id + 1 -> node index (root: 0)
    new[keep + 1] = torch.arange(1, len(keep) + 1, device=dev)
    par = torch.cat([new.new_zeros(1), new[parent[keep] + 1]])  # (N+1,)
    anc, a = torch.eye(len(keep) + 1, dtype=torch.bool, device=dev), torch.arange(len(keep) + 1, device=dev)
    nodes = a.clone()  # (N+1,) each node's own index
    for _ in range(D):  # walk every node up to the root, marking what it passes
        a = par[a]
        anc[nodes, a] = True
    return (tok[keep], par, torch.cat([depth.new_zeros(1), depth[keep]]), anc,
            torch.cat([fed.new_full((1,), -1), fed[keep]]), logits)


def verify_tree(tree, logits_p, temperature, top_k=None, top_p=None, generator=None):
    """Which path of the tree the target keeps: logits_p (N+1, V), p at every node -> (the accepted path's last
    node, the token after it), 0-d tensors. At node v draw y_v from p(. | the path to v) (argmax when greedy); if a
    child of v holds y_v descend into it, else emit y_v and stop. Exact: every emitted token is one draw from p given
    the tokens before it, each draw is independent and used at most once, and the tree (q's alone) is fixed before
    any y is drawn. It is Leviathan's (and SpecInfer's multi-round) rule with q a point mass at each child in turn:
    child x is accepted with min(1, p(x) / 1) = p(x), the residual is p without x renormalised, so a node accepts
    with probability sum of p(child), the most any rule can from fixed candidates. No host sync: all drawn at once."""
    if temperature == 0:
        y = logits_p.argmax(-1)  # (N+1,)
    else:
        y = speculate.sample(speculate.process_logits(logits_p, temperature, top_k, top_p), generator)  # (N+1,)
    drawn = torch.cat([tree.anc.new_ones(1), tree.tokens == y[tree.parent[1:]]])  # (N+1,) node = its parent's draw
    on_path = ~(tree.anc & ~drawn[None]).any(-1)  # (N+1,) drawn, and so is every ancestor: one path from the root
    best = (on_path * (tree.depth + 1)).argmax()  # its deepest node
    return best, y[best]


def tree_forward(target, tcache, x_last, tokens, depth, anc, ell):
    """The target's one forward over x_last (1, 1) and the tree's N nodes -> p at every node (N+1, V): node i at slot
    ell + i (ell: the committed length, 0-d), position ell + depth, seeing the committed cache and its ancestors."""
    N, cols = tokens.shape[0], torch.arange(tcache.max_len, device=ell.device)  # (S,)
    rel = cols - ell  # (S,) slot c holds node c - ell of the tree, if any
    mask = (cols < ell)[None] | ((rel >= 0) & (rel <= N))[None] & anc[:, rel.clamp(0, N)]  # (N+1, S)
    x = torch.cat([x_last, tokens[None]], 1)  # (1, N+1): x_last, then the nodes
    slots = ell + torch.arange(N + 1, device=ell.device)  # (N+1,)
    return target.step(x, slots[None], tcache, positions=(ell + depth)[None], mask=mask[None])[0]


def tree_round(target, draft, tcache, dcache, pending, shape, temperature, top_k, top_p, generator, last=None):
    """One round with a draft tree, spec_round's contract. The caches then hold exactly the committed tokens: the
    accepted path's keys / values moved to consecutive slots (KVCache.move), rejected branches beyond the length."""
    ell, dev = tcache.length, pending.device
    last = {} if last is None else last
    # the routine reasoner's tree: feed `pending` (committed from then on), grow from q at the root
    logits_q = speculate.feed(draft, dcache, pending)[0, -1:]  # (1, V)
    root = torch.tensor(dcache.length, device=dev)  # a tensor: a compiled growth never sees it change
    *tree, last["draft"] = getattr(draft, "fused", lambda fn: fn)(grow)(draft, dcache, logits_q, root, shape)
    tree = Tree(*tree)
    N = len(tree.tokens)
    if ell + N + 1 > tcache.max_len:
        raise ValueError(f"KV cache overflow: {ell} + {N + 1} tokens > max_len {tcache.max_len}")
    verify = getattr(target, "fused", lambda fn: fn)(tree_forward)  # compiled steps: one graph
    logits_p = last["target"] = verify(target, tcache, pending[:, -1:], tree.tokens, tree.depth, tree.anc,
                                       torch.tensor(ell, device=dev))  # (N+1, V)
    best, nxt = verify_tree(tree, logits_p, temperature, top_k, top_p, generator)
    best, nxt, *rest = torch.cat([best.view(1), nxt.view(1), tree.parent, tree.tokens, tree.fed]).tolist()
    parent, tokens, fed = rest[:N + 1], rest[N + 1:2 * N + 1], rest[2 * N + 1:]  # split from the round's one host sync
    path = []  # accepted nodes, root excluded, top-down
    while best:
        path.append(best)
        best = parent[best]
    path.reverse()
    n = len(path)
    tcache.move([ell + v for v in path], list(range(ell + 1, ell + 1 + n)))  # node v sits at slot ell + v
    tcache.length = ell + 1 + n
    # the draft was fed the accepted nodes it expanded: a prefix of the path (a node's parent was expanded)
    m = next((i for i, v in enumerate(path) if fed[v] < 0), n)
    dcache.move([fed[v] for v in path[:m]], list(range(dcache.length, dcache.length + m)))
    dcache.length += m
    accepted = [tokens[v - 1] for v in path]
    pending = torch.tensor([accepted[m:] + [nxt]], device=dev)  # (1, n - m + 1) the draft has not seen these yet
    return n, accepted, nxt, pending


def speculative(target, draft, prompt, shape: TreeShape, max_new_tokens, **kwargs):
    """speculate.speculative with a draft tree of `shape` per round (tree_round) in place of the chain."""
    return speculate.speculative(target, draft, prompt, shape, max_new_tokens, tree_round=tree_round, **kwargs)
