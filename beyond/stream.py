"""Plans in a stream (beyond the paper, lossless): the previous frame's chain of causation drafts the next one.

A driving planner replans every frame, and consecutive plans share most of their reasoning: the same lead vehicle,
the same curve, one range ring closer. The routine reasoner (q) writes the routine words as well as the history
allows, but a commitment (the decision, the lead's state, a range ring) needs the images, so q cannot guess it; one
frame ago the target usually wrote the same one. The stream draft costs no forward: at each round the longest suffix
of this plan's committed tokens (from <cot_start>) that occurs in an earlier plan proposes what followed it there, as
prompt lookup and SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) do, alpha tokens per matched token and at
most M. The proposal joins the routine reasoner's tree as a trie (tree.merge) and the target verifies both in its one
forward, so greedy output is the target's and sampled output keeps p's law, as for any fixed tree (tree.verify_tree).
Where the two plans before agree (a steady row), the stream proposes the rest of a plan matched from its start, and
a long proposal is verified alone, without the tree (Stream).

A sampled plan (Alpamayo-R1 samples six CoCs a frame, T 0.6, top-p 0.98) departs from its earlier samples where the
target is unsure, so one path misses the words it may take. There the index holds every row of the frames before
and the committed tokens of the frame's other rows (its siblings, decoded in the same batch), and proposes
SuffixDecoding's tree: every continuation of the longest match, merged as a trie and ranked by how many continuations
pass through each node (propose). The exactness conditions (tests/test_stream.py tests each):
- siblings in the merged tree hold distinct tokens (tree.merge walks into a child of the same token);
- the tree is fixed before the round's draws: it reads earlier plans and every row's committed tokens, never a draw
  of this round (the control that peeks at the draws breaks the law);
- each row draws from its own generator (speculate.Sampling.generators).

run: python experiments/stream.py        (tests: python -m pytest -q tests/test_stream.py)
"""
import weakref

import torch

import speculate
import tree

# the lookup's settings, chosen on validation clips (experiments/stream_lookup.py; the README says how)
M, ALPHA = 32, 2  # the stream's most nodes a round (a fixed shape), tokens proposed per matched token
SWAP = True  # lookup's swap (step over one differing token)
SKIP = 8  # a steady round whose proposals all reach SKIP tokens runs no model tree (None: never)
K_FRAMES = 2  # sampled rows: the frames before whose every row the index holds
# sampled rows' alpha, chosen on validation clips (python experiments/stream.py --split val ...; the README says how);
# the tree merged with the trie is the machine's (measure.choose.stream_tree)
SAMPLED_ALPHA = 4
STEADY = True  # read steady rows (the two plans before agree); False: the one plan before, as first measured


def lookup(context, earlier, max_len, alpha, swap=False, whole=False):
    """The stream's proposal for one row: context, this plan's tokens so far (from <cot_start>); earlier, earlier plans'
    token lists (most recent first, each from <cot_start>) -> the tokens (a list, at most max_len) that followed the
    longest match of context's suffix, alpha per matched token (a long match is a safe bet, SuffixDecoding's rule);
    [] without a match. whole: where the whole plan so far matched (from <cot_start>), up to max_len (Stream: when
    the earlier plans agree, a plan that has kept to them from its start usually keeps to them). Ties go to the most
    recent plan, then the earliest place in it. swap: a match may step over one token that differs (a range ring
    crossed rewrites one word and keeps the rest), scored by the tokens it matched, so the plan's tail is proposed
    again right after the new word."""
    best, out = 0, []
    for plan in earlier:
        for end in range(1, len(plan)):  # a match ending at plan[end - 1] proposes plan[end:]
            k = reach = run(plan, end - 1, context, len(context) - 1)  # reach: k and the token stepped over
            if swap and k < min(end, len(context)):  # plan[end-1-k] != context[-1-k]: step over it
                k += run(plan, end - 2 - k, context, len(context) - 2 - k)
                reach = k + 1
            if k > best:
                best, out = k, plan[end:end + (max_len if whole and reach == len(context) else min(max_len, alpha * k))]
    return out


def propose(context, sequences, budget, alpha):
    """The sampled stream's proposal for one row, SuffixDecoding's tree (Oliaro et al. 2024): every place in the
    sequences (earlier frames' plans, six samples each, and the siblings' committed tokens) where context's longest
    suffix match ends, the continuation after it (alpha tokens per matched token), all merged as a trie whose node
    counts how many continuations pass through it; the `budget` nodes most passed through (ties: the shallower, then
    the first made) -> (tokens, parents) in a parent-first order (parents: index among them, -1 the root). A child
    never counts more than its parent, so what is kept is a tree; the trie's siblings hold distinct tokens."""
    best, ends = 0, []
    for s, seq in enumerate(sequences):
        for end in range(1, len(seq)):
            k = run(seq, end - 1, context, len(context) - 1)
            if k and k >= best:
                best, ends = k, (ends if k == best else []) + [(s, end)]
    child, tok, par, depth, count = {}, [], [], [], []  # the trie: (parent, token) -> node
    for s, end in ends:
        u = -1
        for t in sequences[s][end:end + min(budget, alpha * best)]:
            if (u, t) not in child:
                child[u, t] = len(tok)
                tok.append(t), par.append(u), depth.append(depth[u] + 1 if u >= 0 else 1), count.append(0)
            u = child[u, t]
            count[u] += 1
    keep = sorted(sorted(range(len(tok)), key=lambda v: (-count[v], depth[v], v))[:budget])  # creation order
    at = {v: i for i, v in enumerate(keep)}
    return [tok[v] for v in keep], [at.get(par[v], -1) for v in keep]


def run(a, i, b, j):
    """How many tokens a[..i] and b[..j] share going back from a[i] and b[j] (0 where an index is < 0)."""
    k = 0
    while min(i, j) - k >= 0 and a[i - k] == b[j - k]:
        k += 1
    return k


class Stream:
    """A decoder (speculate.Chain's interface): per round the routine reasoner's tree of `shape` (None: the stream
    alone, the draft model unused) plus up to M tokens looked up in the earlier plans, merged as a trie and verified
    in one target forward (tree.tree_round). earlier: per row, the earlier plans' tokens (most recent first, each from
    <cot_start>, as plan_tokens gives them). One decode: it keeps each row's committed tokens, so make one per plan.
    On compiled steps (ops/compiled.CompiledSteps) a round keeps to a few shapes: the proposal's width is padded to
    the next of `widths` (0, M/4, M/2, M) and the draft's pending (as long as the path the stream accepted) to the
    next power of two (steps), so each shape compiles once and a GPU can capture it; eager, the width is the longest
    proposal's.
    A row is steady when its two most recent earlier plans are the same: then the whole plan so far matched proposes
    the earlier plan's rest (lookup's whole), and with skip, a round where every row is steady and proposes at least
    `skip` tokens verifies the stream alone, the draft unused (the tree's levels cost more than they add there); the
    draft is fed what it missed at its next tree, its pending kept to at most 2 (depth + 1) tokens. Both choices read
    only earlier plans and committed tokens, so the round's tree is fixed before the target's draws: exact, greedy
    and sampled. siblings g > 0 (sampled plans: rows b // g are one prompt's samples): each row's proposal is
    propose()'s trie over its earlier plans and its g - 1 siblings' committed tokens (no swap, steady or skip)."""
    kind = "stream"

    def __init__(self, shape, earlier, M=M, alpha=None, swap=SWAP, skip=SKIP, steady=STEADY, siblings=0):
        alpha = (SAMPLED_ALPHA if siblings else ALPHA) if alpha is None else alpha
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (M, alpha)) or \
                skip is not None and (not isinstance(skip, int) or isinstance(skip, bool) or skip < 1):
            raise ValueError(f"the stream's M, alpha and skip must be ints >= 1, got M {M!r}, alpha {alpha!r}, "
                             f"skip {skip!r}")
        # earlier: per row a list of plans, each a list of token ids (a flat list of ids is one row's plan, not rows)
        if not isinstance(earlier, (list, tuple)) or not all(
                isinstance(e, (list, tuple)) and all(isinstance(q, (list, tuple)) and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in q) for q in e) for e in earlier):
            raise ValueError("a Stream's earlier plans are, per row, a list of plans, each a list of token ids "
                             "([[plan, ...] for each row]; plan_tokens gives one)")
        self.shape, self.earlier, self.M, self.alpha, self.context = shape, earlier, M, alpha, None
        self.swap, self.skip, self.cache, self.siblings = swap, skip, None, siblings
        if siblings:  # sampled rows: the tree of propose() from the earlier plans and the siblings' committed tokens
            self.swap, self.skip, steady = False, None, False
        self.steady = [steady and len(e) > 1 and e[0] == e[1] for e in earlier]  # per row

    nodes = property(lambda self: (self.shape.nodes if self.shape else 0) + self.M)
    widths = property(lambda self: sorted({0, self.M // 4, self.M // 2, self.M}))  # a compiled round's stream widths
    depth = property(lambda self: max(self.shape.depth if self.shape else 0, self.M))
    width = property(lambda self: self.shape.width if self.shape else 1)
    # the draft's slots: the tree's levels, or a pending as long as the longest accepted path (the stream's nodes were
    # never fed to the draft), or two (skipped rounds), padded to the longest row's
    slack = property(lambda self: (self.nodes, max(self.shape.slack[1] if self.shape else 0,
                                                   (2 if self.skip else 1) * (self.depth + 1))))

    @property
    def steps(self):  # the verify's lengths (each width; a skipped round's); the draft's pending, padded; a level
        n, pend = self.shape.nodes + 1 if self.shape else 1, self.slack[1]
        return (tuple(n + w for w in self.widths) + ((self.M + 1,) if self.skip else ()),
                tuple(sorted({*(2 ** i for i in range(pend.bit_length()) if 2 ** i < pend), pend, self.width})))

    def pad(self, rows, target, device):
        """Per row a list -> (B, M') tensor, -1 past a row's end: M' the longest row (eager: a round without a match
        verifies no stream node), or on compiled steps the next of `widths` (a fixed shape)."""
        width = max(map(len, rows))
        if getattr(target, "compiled", False):
            width = next(w for w in self.widths if w >= width)
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], device=device, dtype=torch.long)

    def round(self, target, draft, tcache, dcache, pending, sampling, generators, last=None):
        if sampling.lossy:
            raise ValueError("the stream draft is lossless only: relaxed acceptance does not run with it")
        if self.cache is not None and self.cache() is not tcache:  # a second decode: its rows' committed tokens differ
            raise ValueError("a Stream decodes one plan (it keeps its rows' committed tokens): make one per decode")
        if self.context is None:  # the first round: each row's x_last is its <cot_start>
            if len(self.earlier) != len(pending):
                raise ValueError(f"the stream has earlier plans for {len(self.earlier)} rows, the decode has "
                                 f"{len(pending)}")
            V = target.cfg.vocab_size  # a proposed id outside the vocabulary would index past the embedding
            if bad := sorted({t for e in self.earlier for q in e for t in q if not 0 <= t < V}):
                raise ValueError(f"the stream's earlier plans hold token ids outside the target's {V}: {bad[:5]}")
            self.context, self.cache = [[p[-1]] for p in pending], weakref.ref(tcache)
        if self.siblings:  # each row's trie; its siblings: the other rows of its group of `siblings` (one prompt's)
            g = self.siblings
            props = [propose(c, self.earlier[b] + [self.context[o] for o in range(b - b % g, b - b % g + g) if o != b],
                             self.M, self.alpha) for b, c in enumerate(self.context)]
            path = self.pad([t for t, _ in props], target, tcache.device)  # (B, M')
            parents = self.pad([q for _, q in props], target, tcache.device)  # (B, M')
            n, accepted, nxt, new = tree.tree_round(target, draft, tcache, dcache, pending, self.shape, sampling,
                                                    generators, last, stream=path, parents=parents)
            for c, a, x in zip(self.context, accepted, nxt):
                c += a + [x]
            return n, accepted, nxt, new
        paths = [lookup(c, e, self.M, self.alpha, self.swap, s) for c, e, s in zip(self.context, self.earlier,
                                                                                    self.steady)]
        skip = self.shape is not None and self.skip is not None and all(self.steady) and \
            min(map(len, paths)) >= self.skip and max(map(len, pending)) <= self.depth + 1  # then pending <= 2 (D + 1)
        path = self.pad(paths, target, tcache.device)  # (B, M')
        n, accepted, nxt, new = tree.tree_round(target, draft, tcache, dcache, pending, None if skip else self.shape,
                                                sampling, generators, last, stream=path)
        if skip:  # the draft saw none of the round: it lacks its pending, the accepted path and the next token
            new = [p + a + [x] for p, a, x in zip(pending, accepted, nxt)]
        for c, a, x in zip(self.context, accepted, nxt):
            c += a + [x]
        return n, accepted, nxt, new


ARMS = ("target-only", "tree", "stream", "tree+stream")  # a clip's arms: the stream's two decoders and their baselines


def settings(**stream_kw):
    """The lookup's settings a report records, as Stream runs them (the module's, or those given; alpha None: the
    module's): M, alpha, swap, skip, steady."""
    out = {"M": M, "alpha": None, "swap": SWAP, "skip": SKIP, "steady": STEADY} | stream_kw
    sampled = out.get("siblings", 0) > 0  # sampled rows: their own alpha, and no swap, steady or skip (Stream)
    out["alpha"] = (SAMPLED_ALPHA if sampled else ALPHA) if out["alpha"] is None else out["alpha"]
    return out | ({"swap": False, "skip": None, "steady": False} if sampled else {})


def decode_clip(target, draft, prompts, arm, shape, max_new, stop_token=None, timing=False, samples=1,
                sampling=speculate.GREEDY, frames_back=K_FRAMES, merged=None, reword=None, **stream_kw):
    """One arm over a clip's frames in order (prompts: batch-1 prompts) -> per frame a speculate.SpecResult, or with
    samples > 1 a list of them (the frame's plan: `samples` rows decoded as one batch, frame i's rows seeded
    sampling.offset(i x samples)). arm: "target-only"; "tree", the decoder `shape` alone (a tree.TreeShape, or a chain
    as TreeShape(gamma, gamma, 1)), every frame planned as if it were the first; "stream", the plans before alone (no
    draft model); "tree+stream", the decoder `merged` (None: shape) and the stream merged. Each frame's stream reads
    the plans this arm wrote before it: one row, the two most recent (steady, Stream's steady rows) or the one (steady
    False); sampled rows, every row of the last frames_back frames and its siblings (Stream's siblings). reword:
    plan -> plan, applied to each plan as the stream keeps it (the rewording figure: a target that says the same
    another way)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}: one of {', '.join(ARMS)}")
    out, earlier = [], []
    for i, p in enumerate(prompts):
        kw = dict(stop_token=stop_token, timing=timing, samples=samples, sampling=sampling.offset(i * samples))
        if arm == "target-only":
            rows = speculate.autoregressive_batch(target, p, max_new, **kw)
        else:
            if samples > 1:
                recent = [[q for plans in earlier[::-1][:frames_back] for q in plans]] * samples
                sib = dict(siblings=samples)
            else:
                frames = earlier[:-3:-1] if stream_kw.get("steady", STEADY) else earlier[-1:]  # most recent first
                recent, sib = [[f[0] for f in frames]], {}
            decoder = shape if arm == "tree" else Stream(None if arm == "stream" else merged or shape, recent,
                                                         **stream_kw, **sib)
            rows = speculate.speculative_batch(target, draft, p, decoder, max_new, **kw)
        out.append(rows if samples > 1 else rows[0])
        earlier.append([(reword or (lambda q: q))(plan_tokens(p, r)) for r in rows])
    return out


# the rewording figure's paraphrase rule: pairs of the toy's words that say the same, swapped either way
PARAPHRASES = (("car", "vehicle"), ("braking", "slowing"), ("standing", "stopped"), ("cruising", "moving"),
               ("keep", "maintain"), ("proceed", "resume"))


def reword(plan, r, rng, tok):
    """An earlier plan as a target that rewords itself from frame to frame might have written it (the toy's target
    never does: its CoC is a fixed function of the scene): each word of PARAPHRASES swapped for its pair with
    probability r, then, with probability r, two adjacent clauses (split at ",") trading places. plan: plan_tokens'
    ids (<cot_start> first); rng: a numpy Generator; tok: the toy's driving.Tokenizer."""
    pair = {tok.id[a]: tok.id[b] for a, b in PARAPHRASES} | {tok.id[b]: tok.id[a] for a, b in PARAPHRASES}
    body = [pair[t] if t in pair and rng.random() < r else t for t in plan[1:]]
    end = body[-1:] if body[-1:] == [tok.cot_end_id] else []
    clauses, comma = [[]], tok.id[","]
    for t in body[:len(body) - len(end)]:
        if t == comma:
            clauses.append([])
        else:
            clauses[-1].append(t)
    if len(clauses) > 1 and rng.random() < r:
        i = int(rng.integers(len(clauses) - 1))
        clauses[i], clauses[i + 1] = clauses[i + 1], clauses[i]
    return plan[:1] + [t for i, c in enumerate(clauses) for t in ([comma] if i else []) + c] + end


def plan_tokens(prompt, res):
    """An earlier plan as the stream reads it: the prompt's last token (<cot_start>) and the plan's CoC tokens."""
    return [int(prompt["input_ids"][0, -1])] + list(res.tokens)
