"""Draft trees: EAGLE-2's dynamic tree (Li et al. 2024), verified in one target forward.

Instead of one chain the routine reasoner grows a tree of N candidates where it is unsure, the target verifies x_last
and all N nodes in one forward under a tree attention mask, and the round emits the longest path the target agrees
with plus its own next token; the chain of gamma is the tree of width 1. A TreeShape is a decoder beside
speculate.Chain: speculate.speculative(target, draft, prompt, TreeShape(...), ...) runs its rounds. The cache
invariant is speculate.py's: after a round the accepted path's keys / values sit in consecutive slots. Every tensor of
a round has a fixed shape for its (N, D, k) and B rows (each row its own tree, from its own committed length), so the
growth (grow) and the verify (tree_forward) each run as one compiled graph under ops/compiled.CompiledSteps.

run: python -m pytest -q tests/test_tree.py      (the tree rows: python rsd.py --device cpu)
"""
from dataclasses import dataclass

import torch

from model import causal_mask
import speculate  # speculate.sample, read at call time (tests replace it with a wrong sampler)

# ---- tree shape ----
@dataclass(frozen=True)
class TreeShape:
    """How a round's draft tree grows (EAGLE-2, Li et al. 2024): from the root x_last, `depth` levels; at each level
    the `width` nodes of highest cumulative log q get `width` children each (the draft's top-k, one batched draft
    forward per level); the `nodes` candidates of highest cumulative log q are what the target verifies."""
    nodes: int  # N: draft tokens verified per round, besides x_last (the node budget)
    depth: int  # D: the longest path, = draft forwards per round
    width: int  # k: nodes expanded per level, and children per expanded node
    kind = "tree"

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

    @property
    def steps(self):  # the verify's N + 1; the draft's pending (1 or 2: each accepted node but the last was fed), a level
        return (self.nodes + 1,), (1, 2, self.width)

    def round(self, target, draft, tcache, dcache, pending, sampling, generators, last=None):
        return tree_round(target, draft, tcache, dcache, pending, self, sampling, generators, last)


# ---- draft, verify, one round ----
@dataclass
class Tree:
    """Per row b, a draft tree of N nodes plus its root x_last (index 0); a parent precedes its children."""
    tokens: torch.Tensor  # (B, N) token of node i + 1
    parent: torch.Tensor  # (B, N+1) parent index (the root is its own)
    depth: torch.Tensor  # (B, N+1) depth (the root 0)
    anc: torch.Tensor  # (B, N+1, N+1) bool: anc[b, i, j] = node j is node i or one of its ancestors
    fed: torch.Tensor  # (B, N+1) the draft-cache slot of a node the draft was fed (an expanded node), else -1


def grow(draft, dcache, logits, root, shape):
    """The trees' levels, from q at the roots, logits (B, V), at fixed shapes for a given shape (N, D, k): one forward
    per level over every row's expanded nodes, each at a slot after its row's committed length root (B,), position
    root - 1 + depth, seeing the committed cache and its own ancestors -> (Tree's fields, the last level's logits (B,
    k, V)). EAGLE-2's: the level-wise growth, top-k expansion and final top-N by cumulative log q. Ours: ties go to
    the shallower node (a child never scores above its parent, so the kept set is a tree); expanded nodes stay in
    the draft's cache (no re-feed)."""
    dev, k, D, B = logits.device, shape.width, shape.depth, logits.shape[0]
    # the (D - 1) k expanded nodes' slots, positions (committed length + depth) and own-slot mask rows, level by level
    cols = torch.arange(dcache.max_len, device=dev)  # (S,)
    slots = root[:, None] + torch.arange((D - 1) * k, device=dev)  # (B, (D-1) k)
    pos = (root[:, None] + torch.arange(D - 1, device=dev)).repeat_interleave(k, 1)  # (B, (D-1) k): root - 1 + depth
    own = cols == slots[..., None]  # (B, (D-1) k, S)
    rows = (cols < root[:, None])[:, None]  # (B, F, S) what each expanded node sees; F = 1: the root
    if dcache.key_mask is not None:  # a padded prompt's padding is never seen
        rows = rows & dcache.key_mask[:, None]
    logits = logits[:, None]  # (B, F, V)
    f_idx, f_score = root.new_full((B, 1), -1), torch.zeros(B, 1, device=dev)  # expanded: candidate id, log q
    tok, score, parent, expanded, n = [], [], [], [], 0  # n: candidates before this level
    for level in range(1, D + 1):
        s, t = torch.log_softmax(logits.float(), -1).topk(k, -1)  # (B, F, k): each expanded node's k likeliest children
        tok.append(t.reshape(B, -1))
        score.append((f_score[..., None] + s).reshape(B, -1))  # (B, F*k) cumulative log q
        parent.append(f_idx.repeat_interleave(k, 1))
        if level == D:
            break
        top = score[-1].topk(k, -1).indices  # (B, k) this level's best, expanded next
        f_idx, f_score = n + top, score[-1].gather(1, top)
        expanded.append(f_idx)
        lv = slice((level - 1) * k, level * k)
        rows = rows.gather(1, (top // k)[..., None].expand(-1, -1, rows.shape[-1])) | own[:, lv]  # (B, k, S): the
        # parent's row plus the node's own slot
        logits = draft.step(tok[-1].gather(1, top), slots[:, lv], dcache, positions=pos[:, lv], mask=rows)  # (B, k, V)
        n += t.shape[1] * k
    tok, score, parent = (torch.cat(x, 1) for x in (tok, score, parent))  # (B, C) each
    depth = torch.tensor([1] * k + [d for d in range(2, D + 1) for _ in range(k * k)], device=dev)  # (C,)
    fed = torch.full_like(tok, -1)  # (B, C) the draft-cache slot of an expanded candidate
    if expanded:
        fed.scatter_(1, torch.cat(expanded, 1), slots)
    # Candidates lie in depth order, and a stable sort keeps it among equal scores: a parent precedes its children.
    keep = score.sort(dim=-1, descending=True, stable=True).indices[:, :shape.nodes]  # (B, N)
    N = keep.shape[1]
    new = torch.zeros(B, tok.shape[1] + 1, dtype=torch.long, device=dev)  # candidate id + 1 -> node index (root: 0)
    new.scatter_(1, keep + 1, torch.arange(1, N + 1, device=dev).expand(B, N))
    par = torch.cat([new.new_zeros(B, 1), new.gather(1, parent.gather(1, keep) + 1)], 1)  # (B, N+1)
    anc = torch.eye(N + 1, dtype=torch.bool, device=dev).repeat(B, 1, 1)  # (B, N+1, N+1)
    a = torch.arange(N + 1, device=dev).expand(B, N + 1)  # (B, N+1) each node's ancestor, walked up
    for _ in range(D):  # walk every node up to the root, marking what it passes
        a = par.gather(1, a)
        anc.scatter_(2, a[..., None], True)
    return (tok.gather(1, keep), par, torch.cat([depth.new_zeros(B, 1), depth[keep]], 1), anc,
            torch.cat([fed.new_full((B, 1), -1), fed.gather(1, keep)], 1), logits)


def merge(tree, stream, parents=None, levels=None):
    """Tree + per row a stream proposal merged as a trie -> a Tree of N + M nodes. stream (B, M): the proposal's
    tokens, -1 for none (padding: no node below it); parents (B, M): each proposal node's parent among the proposal's
    nodes (-1: the root), a parent before its children, siblings of distinct tokens (None: a path, node i below node
    i - 1); levels: the tree's depth (None: N). Each proposal node walks into the tree's child of its parent that
    holds its token, if there is one, else becomes node N + 1 + i below it; a node that walked in, or holds -1, leaves
    its slot dead (token -1: never drawn, so never accepted). A node never has two children of one token: with two,
    the deeper path below the drawn token would be kept, a choice made by later draws, and the sampled law would be
    broken (tests/test_stream.py's control). No host sync, and no loop over the proposal's nodes."""
    (B, N), M, dev = tree.tokens.shape, stream.shape[1], stream.device
    if parents is None:
        parents = (torch.arange(M, device=dev) - 1).expand(B, M)
    pj, ids = parents.clamp_min(0), torch.arange(1, N + 1, device=dev)  # (B, M), (N,)
    ok, same = stream >= 0, tree.tokens[:, None, :] == stream[..., None]  # (B, M), (B, M, N)
    # at: the tree node each proposal node walked into (-1: none). A sweep settles one more level of the proposal
    # (its parent's node is read from the sweep before), and no tree node lies deeper than `levels`.
    at = torch.full_like(stream, -1)
    for _ in range(N if levels is None else levels):
        up = torch.where(parents < 0, 0, at.gather(1, pj))  # (B, M) the parent's tree node (-1: not in the tree)
        v = ((same & (tree.parent[:, None, 1:] == up[..., None])) * ids).amax(-1)  # (B, M): the child, 0 if none
        at = torch.where(ok & (v > 0), v, -1)
    new = ok & (at < 0)  # (B, M): node N + 1 + i
    up = torch.where(parents < 0, 0, torch.where(at.gather(1, pj) >= 0, at.gather(1, pj), N + 1 + pj))  # (B, M)
    tokens = torch.cat([tree.tokens, torch.where(new, stream, -1)], 1)  # (B, N+M)
    parent = torch.cat([tree.parent, torch.where(new, up, 0)], 1)  # (B, N+1+M): a dead slot hangs below the root
    # anc: the closure of "is itself or its parent", squared until it spans the longest path (log2 of N + 1 + M)
    S = N + 1 + M
    anc = torch.eye(S, device=dev).repeat(B, 1, 1).scatter_(2, parent[..., None], 1.0)  # (B, S, S)
    for _ in range((S - 1).bit_length()):
        anc = (anc @ anc).clamp_max(1)
    anc = anc > 0
    return Tree(tokens, parent, anc.sum(-1) - 1, anc, torch.cat([tree.fed, torch.full_like(stream, -1)], 1))


def verify_tree(tree, logits_p, sampling, generators=None):
    """Which path of each row's tree the target keeps: logits_p (B, N+1, V), p at every node -> (the accepted path's
    last node, the token after it) (B,) each. At node v draw y_v from p(. | the path to v) (argmax when greedy); if a
    child of v holds y_v descend into it, else emit y_v and stop. Exact: every emitted token is one draw from p given
    the tokens before it, each draw is independent and used at most once, and the tree (q's alone) is fixed before
    any y is drawn. It is Leviathan's (and SpecInfer's multi-round) rule with q a point mass at each child in turn:
    child x is accepted with min(1, p(x) / 1) = p(x), the residual is p without x renormalised, so a node accepts
    with probability sum of p(child), the most any rule can from fixed candidates. No host sync: all drawn at once,
    row b from generators[b]."""
    if sampling.greedy:
        y = logits_p.argmax(-1)  # (B, N+1)
    else:
        p = sampling.probs(logits_p)  # (B, N+1, V)
        y = torch.stack([speculate.sample(p_b, g) for p_b, g in zip(p, generators)])  # (B, N+1)
    drawn = tree.tokens == y.gather(1, tree.parent[:, 1:])  # (B, N): node = its parent's draw
    if sampling.lossy:  # the opt-in lossy seam: one child per node, the drawn one or a relaxed one (beyond/relaxed.py)
        drawn = sampling.relaxed.tree_children(drawn, tree.parent, tree.tokens, logits_p, sampling)
    drawn = torch.cat([tree.anc.new_ones(y.shape[0], 1), drawn], 1)  # (B, N+1)
    on_path = ~(tree.anc & ~drawn[:, None]).any(-1)  # (B, N+1) drawn, and so is every ancestor: one path from the root
    best = (on_path * (tree.depth + 1)).argmax(-1)  # (B,) its deepest node
    return best, y.gather(1, best[:, None])[:, 0]


def tree_forward(target, tcache, x_last, tokens, depth, anc, ell):
    """The target's one forward over x_last (B, 1) and each row's N nodes -> p at every node (B, N+1, V): node i at
    slot ell + i (ell (B,): the committed lengths), position ell + depth, seeing the committed cache and its
    ancestors (causal_mask under anc)."""
    slots = ell[:, None] + torch.arange(tokens.shape[1] + 1, device=ell.device)  # (B, N+1)
    mask = causal_mask(slots, tcache, tcache.max_len, anc)  # (B, N+1, S)
    return target.step(torch.cat([x_last, tokens], 1), slots, tcache, positions=ell[:, None] + depth, mask=mask)


def tree_round(target, draft, tcache, dcache, pending, shape, sampling, generators, last=None, stream=None,
               parents=None):
    """One round with a draft tree per row, spec_round's contract. The caches then hold exactly the committed
    tokens: each row's accepted path's keys / values moved to consecutive slots (KVCache.move), rejected branches
    beyond its length. The path is found and moved on the device (EAGLE's gather through a path table): the round's
    one host sync reads its tokens. stream (B, M): a path from the root, or a trie of them (parents), merged into the
    tree (merge; stream.py; shape None: no model tree, the draft unused)."""
    dev, ell, B = tcache.device, torch.tensor(tcache.lengths, device=tcache.device), len(pending)  # ell (B,)
    last = {} if last is None else last
    if shape is not None:  # the routine reasoner's trees: feed `pending` (committed from then on), grow from q
        logits_q = speculate.feed_rows(draft, dcache, pending)  # (B, V)
        root = torch.tensor(dcache.lengths, device=dev)  # (B,) a tensor: a compiled growth never sees it change
        *tree, last["draft"] = getattr(draft, "fused", lambda fn: fn)(grow)(draft, dcache, logits_q, root, shape)
        tree = Tree(*tree)
    else:  # the root alone
        root, z = torch.tensor(dcache.lengths, device=dev), torch.zeros(B, 1, dtype=torch.long, device=dev)
        tree = Tree(z[:, :0], z, z, torch.ones(B, 1, 1, dtype=torch.bool, device=dev), z - 1)
    # D: the longest path a round can accept; Df: the longest the draft was fed (the model tree's levels but its last)
    D, Df = max(shape.depth if shape else 0, 0 if stream is None else stream.shape[1]), shape.depth - 1 if shape else 0
    if stream is not None:
        tree = merge(tree, stream, parents, shape.depth if shape else 0)
    N = tree.tokens.shape[1]
    tcache.check_room(N + 1)
    verify = getattr(target, "fused", lambda fn: fn)(tree_forward)  # compiled steps: one graph
    x_last = torch.tensor([[p[-1]] for p in pending], device=dev)  # (B, 1)
    logits_p = last["target"] = verify(target, tcache, x_last, tree.tokens.clamp_min(0), tree.depth, tree.anc, ell)
    best, nxt = verify_tree(tree, logits_p, sampling, generators)
    # The path table: row b's accepted nodes top-down are best's ancestors (a parent precedes its children), sorted
    # to the front; columns past the path (n = depth of best) are padding.
    idx = torch.arange(1, N + 1, device=dev)  # (N,) the nodes, root excluded
    on = tree.anc.gather(1, best[:, None, None].expand(-1, 1, N + 1))[:, 0, 1:]  # (B, N) on best's path
    path = torch.where(on, idx, N + idx).sort(-1).values[:, :D]  # (B, D): the path's nodes, then > N
    n = tree.depth.gather(1, best[:, None])[:, 0]  # (B,) accepted drafts
    col = torch.arange(D, device=dev)  # (D,)
    used = col < n[:, None]  # (B, D)
    path = torch.where(used, path, 0)  # padding -> the root, whose token is never read
    # target: node v sits at slot ell + v, goes to ell + 1 + i; a padding column copies slot ell + 1 + i onto itself
    tcache.move(torch.where(used, ell[:, None] + path, ell[:, None] + 1 + col), ell[:, None] + 1 + col)
    # draft: it was fed the accepted nodes it expanded, a prefix of the path (a node's parent was expanded), m of them
    fed = tree.fed.gather(1, path)  # (B, D) slot, or -1
    m = (used & (fed >= 0)).long().cumprod(-1).sum(-1)  # (B,)
    dst = root[:, None] + col[:Df]  # (B, Df): the nodes fed, above the model tree's last level
    dcache.move(torch.where(col[:Df] < m[:, None], fed[:, :Df], dst), dst)
    tokens = tree.tokens.gather(1, (path - 1).clamp_min(0))  # (B, D)
    flat = torch.cat([n[:, None], m[:, None], nxt[:, None], tokens], 1).tolist()  # the round's one host sync
    n, m, nxt, accepted = (list(x) for x in zip(*[(r[0], r[1], r[2], r[3:3 + r[0]]) for r in flat]))
    tcache.commit([1 + nb for nb in n])
    dcache.commit(m)
    return n, accepted, nxt, [a[mb:] + [x] for a, mb, x in zip(accepted, m, nxt)]  # new pending: the draft lacks it
