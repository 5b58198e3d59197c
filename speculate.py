"""Lossless speculative decoding of the reasoning (chain-of-causation) step.

The routine reasoner (draft, q) proposes gamma tokens one at a time; the deliberative reasoner (the unmodified target
VLA, p) checks them in one forward over [x_last, d_1..d_gamma] and keeps the longest prefix it agrees with, plus one
token of its own (the correction, or a bonus when every draft was accepted). Greedy output is the target's (exact in
fp32; in bf16 the batched verify can flip near-tied argmaxes); sampled output is distributed exactly as the target's
(Leviathan et al. 2023, Algorithm 1; docs/background.md, "Speculative decoding"). Draft trees are tree.py. An opt-in
lossy rule (beyond/relaxed.py) enters through Sampling.relaxed; without one (the default) every claim here holds.

Cache invariant of every round: both caches hold the prompt and the emitted tokens except the *pending* suffix. The
target has seen all but the last emitted token x_last; the draft all but `pending`, [x_last] or, after a round that
accepted all gamma drafts, [d_gamma, x_last]; the next round's first draft forward feeds exactly `pending`. The
prompt's last token (<cot_start>) is held back from the prefill and plays x_last in the first round, so every emitted
token comes out of a verification round: tau = tokens / rounds exactly. Every round drafts and verifies its whole
gamma (or tree), the last one's block cut at max_new_tokens: one set of shapes, as a compiled step needs.

B rows at once (speculative_batch; Alpamayo-R1 samples six CoCs per plan): each row keeps its own committed length,
pending tokens, stop and max-new, and accepts its own prefix; every row is in every round, one draft forward per draft
step and one verify forward over all rows; each row samples from its own generator, so a row is the same in any batch.
Batch 1 is the same code with B = 1.

run: python -m pytest -q tests/test_speculate.py tests/test_batch.py    (demo: python experiments/speculate_demo.py)
"""
from dataclasses import dataclass, field, fields, replace
import math
import time

import torch

from checks import check_finite, check_inputs, config_of, nonfinite_named
from model import KVCache, feed  # feed: the step after the committed tokens, then committed

# ---- processed distributions ----
# prompt keys: the first group goes to target.embed, the grids also to forward (M-RoPE positions, inputs_embeds or not)
EMBED_KEYS = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
GRID_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def process_logits(logits, temperature, top_k=None, top_p=None):
    """Logits (..., V) -> the probabilities (..., V) a token is sampled from: the one function behind both p and q,
    so the verifier compares exactly the distributions that were sampled from (Leviathan's proof needs this). Order
    as in Hugging Face generate: temperature, top-k, top-p; temperature 0 is the point mass on the argmax."""
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Subtract the max before dividing: a tiny temperature then sends the others to -inf, never to inf - inf = NaN.
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, -math.inf)  # ties with the k-th survive, as in HF
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)  # (..., V)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # the smallest head reaching top_p; the top token stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs, generator):
    """One token per row: probs (..., V) -> (...). generator: one, or a list of one per leading row (probs[b] drawn
    from generator[b] alone: a row's draws do not depend on the batch it runs in)."""
    if isinstance(generator, list):
        return torch.stack([sample(p, g) for p, g in zip(probs, generator)])
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


@dataclass(frozen=True)
class Sampling:
    """How a decode draws its tokens, wherever a decoding's settings travel: the processed distribution
    (process_logits: temperature, top-k, top-p; temperature 0 is greedy) and the seeds (row r draws from its own
    generator, seeded seed + r or seed[r] from a tuple; None: one seed drawn from torch's global RNG; a
    torch.Generator: every row draws from it, one draw over all rows a step, as AARL's rollouts from their run's
    generator, which its checkpoints save)."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | tuple | torch.Generator | None = None
    relaxed: object = None  # opt-in lossy verification, a relaxed.Relaxed (None: the exact rule)

    def __post_init__(self):  # checked when made: the scripts make theirs from their flags before any work
        t, k, p = self.temperature, self.top_k, self.top_p
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {t!r}")
        if k is not None and (not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {k!r}")
        if p is not None and not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be None or in (0, 1], got {p!r}")
        if isinstance(self.seed, list):  # a list of seeds is kept as a tuple: the settings stay hashable
            object.__setattr__(self, "seed", tuple(self.seed))

    @property
    def greedy(self):
        return self.temperature == 0

    @property
    def lossy(self):  # a relaxed rule with a bound > 0: the output is no longer the target's
        return self.relaxed is not None and self.relaxed.bound > 0

    def probs(self, logits):  # (..., V) -> the distribution (..., V) sampled from and verified against
        return process_logits(logits, self.temperature, self.top_k, self.top_p)

    def also_accepts(self, logits_p, x):
        """logits_p (..., V) of p where the tokens x (...) were drafted -> bool (...): x accepted by the relaxed rule
        besides the exact one (None when lossless: the exact rule's code path, untouched)."""
        return self.relaxed.accepts(logits_p, x, self) if self.lossy else None

    def offset(self, i):
        """Prompt i's settings in a run of several: its rows seeded seed + i (+ r), the same draws in every pass."""
        return self if not isinstance(self.seed, int) else replace(self, seed=self.seed + i)

    def generators(self, device, rows=1):
        """One generator per row, seeded as the class says: a row draws the same numbers whatever batch it runs in."""
        if isinstance(self.seed, torch.Generator):
            return self.seed
        if isinstance(self.seed, tuple):
            if len(self.seed) != rows:
                raise ValueError(f"{len(self.seed)} seeds for {rows} rows: give one per row, or one int (row r: "
                                 "seed + r)")
            return [torch.Generator(device=device).manual_seed(s) for s in self.seed]
        seed = int(torch.randint(2**62, (1,))) if self.seed is None else self.seed  # torch.manual_seed governs
        return [torch.Generator(device=device).manual_seed(seed + r) for r in range(rows)]


GREEDY = Sampling()


# ---- decoders: what a round drafts ----
@dataclass(frozen=True)
class Chain:
    """Leviathan's draft: gamma tokens a round, one draft forward each, verified in one target forward over [x_last,
    d_1..d_gamma] (spec_round). A decoder (Chain, tree.TreeShape) is all speculative_batch knows of a round: `nodes`
    (drafts verified), `depth` (its longest path), `slack` (cache slots it writes beyond the committed length: target,
    draft), `steps` (the step lengths it runs: target, draft; what a compiled pair compiles), `round` and `kind`."""
    gamma: int
    kind, width = "chain", 1  # a chain is the tree of width 1 (tree.TreeShape(gamma, gamma, 1))

    def __post_init__(self):
        if not isinstance(self.gamma, int) or isinstance(self.gamma, bool) or self.gamma < 1:
            raise ValueError(f"gamma (draft length) must be an int >= 1, got {self.gamma!r}")

    nodes = depth = property(lambda self: self.gamma)
    slack = property(lambda self: (self.gamma, self.gamma))
    steps = property(lambda self: ((self.gamma + 1,), (1, 2)))  # the draft feeds pending (1 or 2), then 1 a step

    def round(self, target, draft, tcache, dcache, pending, sampling, generators, last=None):
        return spec_round(target, draft, tcache, dcache, pending, self.gamma, sampling, generators, last)


def decoder_of(d):
    """A decoder (Chain, tree.TreeShape: it has a round), or a draft length gamma: the Chain of gamma (checked)."""
    return d if hasattr(d, "round") else Chain(d)


# ---- verification ----
def verify_greedy(draft_tokens, target_logits, also=None):
    """draft_tokens (..., gamma), target_logits (..., gamma+1, V) -> (n_accepted, next_token) (...): d_1..d_n equal
    the argmaxes t_0..t_{n-1}, next is t_n (correction or bonus). Tensors: the loop syncs once per round. also (...,
    gamma): drafts a relaxed rule accepts besides (Sampling.also_accepts)."""
    t = target_logits.argmax(-1)  # (..., gamma+1)
    ok = draft_tokens == t[..., :-1]  # (..., gamma)
    n = (ok if also is None else ok | also).long().cumprod(-1).sum(-1)  # (...) length of the accepted prefix
    return n, t.gather(-1, n.unsqueeze(-1)).squeeze(-1)


def verify_sample(draft_tokens, q, p, generator=None, also=None):
    """Leviathan et al. 2023, Algorithm 1: draft_tokens (..., gamma) sampled from q (..., gamma, V); p (..., gamma+1,
    V). d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is drawn
    from normalise(max(0, p_i - q_i)), after gamma acceptances the bonus from p_gamma. -> (n_accepted, next) (...).
    generator: one, or a list of one per row of (B, gamma) draft_tokens (sample's); also: verify_greedy's."""
    idx = draft_tokens.unsqueeze(-1)  # (..., gamma, 1)
    p_d = p[..., :-1, :].gather(-1, idx).squeeze(-1)  # (..., gamma)
    q_d = q.gather(-1, idx).squeeze(-1)  # (..., gamma)
    if isinstance(generator, list):  # (B, gamma): row b's from generator[b], as sample's
        u = torch.stack([torch.rand(draft_tokens.shape[1:], generator=g, device=p.device) for g in generator])
    else:
        u = torch.rand(draft_tokens.shape, generator=generator, device=p.device)  # (..., gamma)
    ok = u * q_d < p_d  # (...); u < p/q without the division (q_d > 0: d came from q)
    n = (ok if also is None else ok | also).long().cumprod(-1).sum(-1)  # (...)
    residual = (p[..., :-1, :] - q).clamp_min(0.0)  # (..., gamma, V)
    mass = residual.sum(-1, keepdim=True)  # (..., gamma, 1)
    # mass ~ 0: p == q up to rounding, a rejection has probability ~mass, and p is the right law (multinomial defined)
    residual = torch.where(mass > torch.finfo(p.dtype).eps, residual, p[..., :-1, :])
    # A candidate for every outcome n = 0..gamma, picked on device: the draws are independent of u, so the picked one
    # has the right law, and the round needs no host sync before its end.
    candidates = sample(torch.cat([residual, p[..., -1:, :]], -2), generator)  # (..., gamma+1)
    return n, candidates.gather(-1, n.unsqueeze(-1)).squeeze(-1)


# ---- statistics ----
@dataclass
class SpecResult:
    tokens: list = field(default_factory=list)  # emitted token ids, the stop token included when produced
    # per token: True = an accepted draft (routine reasoner), False = the target's own (deliberative reasoner)
    from_draft: list = field(default_factory=list)
    blocks: list = field(default_factory=list)  # tokens emitted per round (accepted drafts + 1 target token)
    accepted: list = field(default_factory=list)  # draft tokens accepted per round (before a stop-token or max-new cut)
    depths: list = field(default_factory=list)  # the longest drafted path per round (gamma, or the tree's depth)
    rounds: int = 0  # target verification forwards (one per round; plain decoding: one per token)
    n_drafted: int = 0  # draft tokens proposed
    n_accepted: int = 0  # draft tokens the verifier accepted (before a stop-token or max-new cut)
    n_tested: int = 0  # draft tokens the verifier reached: accepted ones + the first rejected one per round
    prefill_s: float = 0.0  # wall time of embed + prefill (timing=True only)
    decode_s: float = 0.0  # wall time of the reasoning step after the prefill (timing=True only)

    @property
    def tau(self):  # tokens per target verification forward, bonus included (plain decoding: 1.0)
        return len(self.tokens) / max(self.rounds, 1)

    @property
    def alpha(self):  # Leviathan's alpha: acceptance of the draft tokens the verifier reached, not the untested ones
        return self.n_accepted / max(self.n_tested, 1)

    def alpha_by_depth(self):
        """[alpha_1, alpha_2, ...]: the share of rounds that reached depth d - 1 and drafted that deep which accepted
        a token at depth d (the chain's per-position acceptance; a tree's per-level)."""
        out = []
        for d in range(1, max(self.depths, default=0) + 1):
            reached = sum(a >= d - 1 and g >= d for a, g in zip(self.accepted, self.depths))
            out.append(sum(a >= d for a in self.accepted) / reached if reached else None)
        return out

    @property
    def routine_share(self):  # share of emitted tokens that were accepted drafts (the routine reasoner's)
        return sum(self.from_draft) / max(len(self.from_draft), 1)

    @staticmethod
    def pooled(results):
        """Many decodes as one: tau, alpha and alpha_by_depth over all their rounds, the tokens concatenated (the one
        way every report turns decodes into tau and alpha)."""
        out = SpecResult()
        for r in results:
            for f in fields(SpecResult):  # lists extended in place, counts and seconds summed
                vars(out)[f.name] += getattr(r, f.name)
        return out


# ---- caches and prefill ----
def new_cache(model, prompt, max_new_tokens, max_len, slack=0, batch=1):
    """A cache of `batch` rows for the whole decode, L - 1 + max_new_tokens (+ `slack` slots a round writes beyond
    the committed length), checked first."""
    need = prompt["input_ids"].shape[1] - 1 + max_new_tokens  # positions
    slots = prompt_slots(model, prompt["input_ids"][:, :-1]) + max_new_tokens  # the history-only draft's are fewer
    cfg = config_of(model)  # a Hugging Face config's max_position_embeddings, or our ModelConfig.max_seq_len
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "max_seq_len", None)
    what = f"prompt ({prompt['input_ids'].shape[1]}) + max_new_tokens ({max_new_tokens}) needs"
    if limit is not None and need > limit:
        raise ValueError(f"{what} {need} positions, the model has {limit}")
    if max_len is not None and slots + slack > max_len:
        raise ValueError(f"{what} a cache of {slots + slack}, max_len is {max_len}")
    return model.new_cache(batch=batch, max_len=max_len or slots + slack, device=prompt["input_ids"].device)


def prompt_slots(model, input_ids):
    """Cache slots a prefill of input_ids (B, T) fills (VLA.prompt_slots; a Hugging Face model's: T)."""
    return model.prompt_slots(input_ids) if hasattr(model, "prompt_slots") else input_ids.shape[1]


def embed_prompt(target, prompt):
    """The target's prompt embeddings (1, L, D) and DeepStack features (Qwen3-VL; [] without, or from an HF embed)."""
    out = target.embed(**{k: prompt[k] for k in EMBED_KEYS if prompt.get(k) is not None}, return_deepstack=True)
    return out if isinstance(out, tuple) else (out, [])


def prefill(model, prompt, embeds, cache, deepstack=None, name="model", samples=1):
    """Feed each prompt row but its last token, returned (B, 1) as the first x_last of each of its `samples` rows
    (B = rows x samples): the prefill runs once per prompt, its cache rows repeated (KVCache.take_rows). embeds (P,
    L, D), target.embed's, serve both models: the draft sees the target's image features, no second tower runs.
    deepstack: the target's only. Rows of different lengths come left-padded (attention_mask)."""
    ids, mask = prompt["input_ids"], prompt.get("attention_mask")  # (P, L)
    grids = {k: prompt[k] for k in GRID_KEYS if prompt.get(k) is not None}
    if deepstack:
        grids["deepstack"] = deepstack
    if mask is not None:
        grids["attention_mask"] = mask[:, :-1]
    into = cache
    if samples > 1:  # a cache of the P prompts alone, its rows then copied into the B rows
        k0 = cache.k[0]
        into = KVCache(len(cache.k), ids.shape[0], k0.shape[1], prompt_slots(model, ids[:, :-1]), k0.shape[3],
                       k0.dtype, k0.device)
    # logits_to_keep=1 skips an (L, V) LM-head product: the one row is only checked (NaN weights reach every row).
    logits = model(ids[:, :-1], inputs_embeds=embeds[:, :-1], cache=into, logits_to_keep=1, **grids)  # (P, 1, V)
    check_finite(logits, name, "after the prefill", model)
    if samples > 1:
        cache.take_rows(into, [r for r in range(ids.shape[0]) for _ in range(samples)])
    return ids[:, -1:].repeat_interleave(samples, 0)  # (B, 1)


# ---- the chain round ----
def feed_rows(model, cache, rows, return_hidden=False):
    """feed of rows of their own lengths (lists of ints) as one step, right-padded with each row's last token (written
    beyond the row's length, never read), each row committing its own tokens -> feed's output at each row's last
    token: logits (B, V) (and hidden (B, D))."""
    k = [len(r) for r in rows]
    x = torch.tensor([r + r[-1:] * (max(k) - len(r)) for r in rows], device=cache.device)  # (B, max k)
    at = torch.arange(len(rows), device=cache.device), torch.tensor(k, device=cache.device) - 1  # (B,) each
    out = feed(model, cache, x, k, return_hidden)
    return tuple(o[at] for o in out) if return_hidden else out[at]


def spec_round(target, draft, tcache, dcache, pending, gamma, sampling, generators, last=None):
    """One draft-then-verify round over the B rows of the caches. pending: per row the emitted tokens (a list of
    ints) its draft has not seen, the last (x_last) the only one its target has not. -> per row n_accepted, the gamma
    drafted ints and the next int, and the new pending. generators: one per row (sampling); last: latest logits."""
    B, dev, ell, k = len(pending), tcache.device, list(tcache.lengths), [len(p) for p in pending]
    L0, last = list(dcache.lengths), {} if last is None else last  # the draft's own lengths: never the target's
    logits_q = feed_rows(draft, dcache, pending)  # (B, V): q after each row's pending
    drafted, qs = [], []
    for i in range(gamma):
        if i:
            logits_q = feed(draft, dcache, drafted[-1][:, None])[:, -1]  # (B, V)
        last["draft"] = logits_q
        if sampling.greedy:
            drafted.append(logits_q.argmax(-1))  # (B,) a greedy draft: q is a point mass
        else:
            qs.append(sampling.probs(logits_q))  # (B, V)
            drafted.append(sample(qs[-1], generators))  # (B,) each row from its own generator
    d = torch.stack(drafted, 1)  # (B, gamma)
    x_last = torch.tensor([[p[-1]] for p in pending], device=dev)  # (B, 1)
    logits_p = last["target"] = feed(target, tcache, torch.cat([x_last, d], 1))  # (B, gamma+1, V)
    also = sampling.also_accepts(logits_p[:, :-1], d)  # (B, gamma), or None (exact)
    if sampling.greedy:
        n, nxt = verify_greedy(d, logits_p, also)  # (B,) each
    else:
        n, nxt = verify_sample(d, torch.stack(qs, 1), sampling.probs(logits_p), generators, also)
    flat = torch.cat([n, nxt, d.view(-1)]).tolist()  # the round's one host sync
    n, nxt, d = flat[:B], flat[B:2 * B], [flat[2 * B + b * gamma:2 * B + (b + 1) * gamma] for b in range(B)]
    # Keep the committed tokens: the target's ell + x_last + n accepted drafts (the new x_last stays out); the
    # draft's L0 + pending + the drafts it fed itself that were accepted, d_1..d_m, m = min(n, gamma - 1).
    m = [min(nb, gamma - 1) for nb in n]
    tcache.crop([ell[b] + 1 + n[b] for b in range(B)])
    dcache.crop([L0[b] + k[b] + m[b] for b in range(B)])
    # The new pending is what the draft lacks: [next] after a rejection, [d_gamma, next] after a full acceptance.
    return n, d, nxt, [d[b][m[b]:n[b]] + [nxt[b]] for b in range(B)]


# ---- decoding ----
def now(device, timing):
    """The wall clock for timing=True, read after the device has finished its queued work; 0 without timing."""
    if timing and torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() if timing else 0.0


def speculative(target, draft, prompt, decoder, max_new_tokens, sampling=GREEDY, stop_token=None, max_len=None,
                timing=False):
    """Decode one prompt row (input_ids (1, L)), q proposing and p verifying -> its SpecResult: speculative_batch's
    one row (its generator seeded sampling.seed)."""
    if prompt["input_ids"].shape[0] != 1:
        raise ValueError(f"speculative decodes one row, got input_ids {tuple(prompt['input_ids'].shape)}: "
                         "speculative_batch decodes several")
    return speculative_batch(target, draft, prompt, decoder, max_new_tokens, 1, sampling, stop_token, max_len,
                             timing)[0]


@torch.no_grad()
def speculative_batch(target, draft, prompt, decoder, max_new_tokens, samples=1, sampling=GREEDY, stop_token=None,
                      max_len=None, timing=False):
    """Decode B = P x samples rows at once, up to max_new_tokens each -> a SpecResult per row. prompt: forward kwargs
    of P rows (input_ids (P, L), left-padded under attention_mask if their lengths differ); row r continues prompt
    r // samples with its own generator (Sampling.generators). decoder: a round's draft, a Chain (or its gamma) or a
    tree.TreeShape. Every row is in every round (module docstring): a finished row's work is thrown away and its
    caches keep its length, so the shapes never change. max_len: cache size (None: what the decode needs)."""
    decoder = decoder_of(decoder)
    check_inputs(target, draft, prompt, max_new_tokens, sampling, stop_token, samples, EMBED_KEYS + GRID_KEYS,
                 Sampling)
    B, dev = prompt["input_ids"].shape[0] * samples, prompt["input_ids"].device
    # Slots a round writes beyond the committed length: the last round, drafting in full, may reach past the end.
    t_slack, d_slack = decoder.slack
    tcache = new_cache(target, prompt, max_new_tokens, max_len, t_slack, B)
    dcache = new_cache(draft, prompt, max_new_tokens, max_len, d_slack, B)
    generators = sampling.generators(dev, B)
    t0 = now(dev, timing)
    embeds, deepstack = embed_prompt(target, prompt)  # (P, L, D)
    pending = prefill(target, prompt, embeds, tcache, deepstack, "target", samples).tolist()  # per row: [x_last]
    prefill(draft, prompt, embeds, dcache, name="draft", samples=samples)
    t1 = now(dev, timing)
    out = [SpecResult(prefill_s=t1 - t0) for _ in range(B)]
    g, depth = decoder.nodes, decoder.depth  # drafted per round; its longest path
    live, last = set(range(B)), {}  # rows still decoding; the latest logits of each model, checked at the end
    with nonfinite_named(last, draft):
        while live:
            before = list(tcache.lengths), list(dcache.lengths), pending
            # Every round has the same shapes (a compiled step's graphs are fixed); the last one's block is cut.
            n, drafted, nxt, pending = decoder.round(target, draft, tcache, dcache, pending, sampling, generators,
                                                     last)
            t = now(dev, timing)
            for b in sorted(live):
                res = out[b]
                block = (drafted[b][:n[b]] + [nxt[b]])[:max_new_tokens - len(res.tokens)]
                if stop_token is not None and stop_token in block:
                    block = block[:block.index(stop_token) + 1]
                res.tokens += block
                res.from_draft += ([True] * n[b] + [False])[:len(block)]
                res.blocks.append(len(block))
                res.accepted.append(n[b])
                res.depths.append(depth)
                res.rounds += 1
                res.n_drafted += g
                res.n_accepted += n[b]
                res.n_tested += n[b] + (n[b] < depth)  # a tree level reached is one test, as a chain position
                if block[-1] == stop_token or len(res.tokens) == max_new_tokens:
                    live.discard(b)
                    res.decode_s = t - t1  # this row's reasoning step, until its last token
            # a finished row, now or before: its round undone (the lengths it accepted may reach past max_new, beyond
            # the caches' room), its caches kept at their lengths then
            tcache.crop([m if b in live else before[0][b] for b, m in enumerate(tcache.lengths)])
            dcache.crop([m if b in live else before[1][b] for b, m in enumerate(dcache.lengths)])
            pending = [p if b in live else before[2][b] for b, p in enumerate(pending)]
    return out


def autoregressive(target, prompt, max_new_tokens, sampling=GREEDY, stop_token=None, max_len=None, timing=False):
    """Plain decoding of one prompt row, the baseline arm: autoregressive_batch's one row -> its SpecResult."""
    if prompt["input_ids"].shape[0] != 1:
        raise ValueError(f"autoregressive decodes one row, got input_ids {tuple(prompt['input_ids'].shape)}: "
                         "autoregressive_batch decodes several")
    return autoregressive_batch(target, prompt, max_new_tokens, 1, sampling, stop_token, max_len, timing)[0]


@torch.no_grad()
def autoregressive_batch(target, prompt, max_new_tokens, samples=1, sampling=GREEDY, stop_token=None, max_len=None,
                         timing=False, embeds=None):
    """Plain decoding of B = P x samples rows (speculative_batch's rows, prefill, sampling and generators), one
    cached step per token (tau = 1): the baseline arm, the table's greedy CoCs, AARL's rollouts. As transformers'
    generate, a finished row keeps stepping until every row has finished (its tokens dropped). embeds: the prompt's
    embeddings (P, L, D) from another model (a draft writing on its own reads the target's, as when it drafts)."""
    check_inputs(target, None, prompt, max_new_tokens, sampling, stop_token, samples, EMBED_KEYS + GRID_KEYS,
                 Sampling)
    B, dev = prompt["input_ids"].shape[0] * samples, prompt["input_ids"].device
    cache = new_cache(target, prompt, max_new_tokens, max_len, batch=B)
    generators = sampling.generators(dev, B)
    t0 = now(dev, timing)
    embeds, deepstack = embed_prompt(target, prompt) if embeds is None else (embeds, [])  # (P, L, D)
    x = prefill(target, prompt, embeds, cache, deepstack, "target", samples)[:, 0]  # (B,)
    t1 = now(dev, timing)
    steps, ends, last = [], [None] * B, {}  # ends[b]: (tokens, seconds) when row b emitted its stop token
    with nonfinite_named(last):
        for i in range(max_new_tokens):
            logits = last["target"] = feed(target, cache, x[:, None])[:, -1]  # (B, V)
            x = logits.argmax(-1) if sampling.greedy else sample(sampling.probs(logits), generators)  # (B,)
            steps.append(x)
            # Without a stop token nothing needs the value now: no per-token host sync.
            if stop_token is not None:
                for b, t in enumerate(x.tolist()):
                    if t == stop_token and ends[b] is None:
                        ends[b] = (i + 1, now(dev, timing) - t1)
                if all(ends):
                    break
        tokens = torch.stack(steps, 1).tolist()  # (B, T): the host sync that ends the reasoning step
        decode_s = now(dev, timing) - t1
    out = []
    for b, row in enumerate(tokens):
        n, s = ends[b] or (len(row), decode_s)
        out.append(SpecResult(row[:n], [False] * n, [1] * n, rounds=n, prefill_s=t1 - t0, decode_s=s))
    return out
