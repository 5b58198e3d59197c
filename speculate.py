"""Lossless speculative decoding of the reasoning (chain-of-causation) step.

The routine reasoner (draft, q) proposes gamma tokens one at a time; the deliberative reasoner (the unmodified target
VLA, p) checks them in one forward over [x_last, d_1..d_gamma] and keeps the longest prefix it agrees with, plus one
token of its own (the correction, or a bonus when every draft was accepted). Greedy output is the target's (exact in
fp32; in bf16 the batched verify can flip near-tied argmaxes); sampled output is distributed exactly as the target's
(Leviathan et al. 2023, Algorithm 1; docs/background.md, "Speculative decoding"). Draft trees are tree.py.

Cache invariant of every round: both caches hold the prompt and the emitted tokens except the *pending* suffix. The
target has seen all but the last emitted token x_last; the draft all but `pending`, [x_last] or, after a round that
accepted all gamma drafts, [d_gamma, x_last]; the next round's first draft forward feeds exactly `pending`. The
prompt's last token (<cot_start>) is held back from the prefill and plays x_last in the first round, so every emitted
token comes out of a verification round: tau = tokens / rounds exactly. Every round drafts and verifies its whole
gamma (or tree), the last one's block cut at max_new_tokens: one set of shapes, as a compiled step needs.

run: python -m pytest -q tests/test_speculate.py        (demo: python experiments/speculate_demo.py --device cpu)
"""
import contextlib
from dataclasses import dataclass, field
import math
import time

import torch

from model import feed  # the step after the committed tokens, then committed (speculate.feed to callers)

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


def sample(probs, generator):  # one token per row: probs (..., V) -> (...)
    flat = probs.reshape(-1, probs.shape[-1])  # (N, V)
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


# ---- verification ----


def verify_greedy(draft_tokens, target_logits):
    """draft_tokens (..., gamma), target_logits (..., gamma+1, V) -> (n_accepted, next_token) (...): d_1..d_n equal
    the argmaxes t_0..t_{n-1}, next is t_n (correction or bonus). Tensors: the loop syncs once per round."""
    t = target_logits.argmax(-1)  # (..., gamma+1)
    n = (draft_tokens == t[..., :-1]).long().cumprod(-1).sum(-1)  # (...) length of the agreeing prefix
    return n, t.gather(-1, n.unsqueeze(-1)).squeeze(-1)


def verify_sample(draft_tokens, q, p, generator=None):
    """Leviathan et al. 2023, Algorithm 1: draft_tokens (..., gamma) sampled from q (..., gamma, V); p (..., gamma+1,
    V). d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is drawn
    from normalise(max(0, p_i - q_i)), after gamma acceptances the bonus from p_gamma. -> (n_accepted, next) (...)."""
    idx = draft_tokens.unsqueeze(-1)  # (..., gamma, 1)
    p_d = p[..., :-1, :].gather(-1, idx).squeeze(-1)  # (..., gamma)
    q_d = q.gather(-1, idx).squeeze(-1)  # (..., gamma)
    u = torch.rand(draft_tokens.shape, generator=generator, device=p.device)  # (..., gamma)
    n = (u * q_d < p_d).long().cumprod(-1).sum(-1)  # (...); u < p/q without the division (q_d > 0: d came from q)
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
    target_forwards: int = 0  # all target forwards, the prompt prefill included
    draft_forwards: int = 0  # all draft forwards, the prompt prefill included
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
            for f in ("tokens", "from_draft", "blocks", "accepted", "depths"):
                getattr(out, f).extend(getattr(r, f))
            for f in ("rounds", "target_forwards", "draft_forwards", "n_drafted", "n_accepted", "n_tested",
                      "prefill_s", "decode_s"):
                setattr(out, f, getattr(out, f) + getattr(r, f))
        return out



# ---- caches and prefill ----


def new_cache(model, prompt, max_new_tokens, max_len, slack=0):
    """A cache for the whole decode, L - 1 + max_new_tokens (+ `slack` slots for a tree's branches), checked first."""
    need = prompt["input_ids"].shape[1] - 1 + max_new_tokens
    cfg = config_of(model)  # a Hugging Face config's max_position_embeddings, or our ModelConfig.max_seq_len
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "max_seq_len", None)
    what = f"prompt ({prompt['input_ids'].shape[1]}) + max_new_tokens ({max_new_tokens}) needs"
    if limit is not None and need > limit:
        raise ValueError(f"{what} {need} positions, the model has {limit}")
    if max_len is not None and need + slack > max_len:
        raise ValueError(f"{what} a cache of {need + slack}, max_len is {max_len}")
    return model.new_cache(batch=1, max_len=max_len or need + slack, device=prompt["input_ids"].device)


def on_model(prompt, model):
    """A prompt dict's tensors on the model's device, its pixels in the model's dtype (ids stay integers)."""
    w = next(model.parameters())
    return {k: v.to(w.device, w.dtype if v.is_floating_point() else None) for k, v in prompt.items()}


def embed_prompt(target, prompt):
    """The target's prompt embeddings (1, L, D) and DeepStack features (Qwen3-VL; [] without, or from an HF embed)."""
    out = target.embed(**{k: prompt[k] for k in EMBED_KEYS if prompt.get(k) is not None}, return_deepstack=True)
    return out if isinstance(out, tuple) else (out, [])


def prefill(model, prompt, embeds, cache, deepstack=None, name="model"):
    """Feed the prompt but its last token, returned (1, 1) as the first x_last. embeds (1, L, D), target.embed's, serve
    both models: the draft sees the target's image features, no second tower runs. deepstack: the target's only."""
    ids = prompt["input_ids"]  # (1, L)
    grids = {k: prompt[k] for k in GRID_KEYS if prompt.get(k) is not None}
    if deepstack:
        grids["deepstack"] = deepstack
    # logits_to_keep=1 skips an (L, V) LM-head product: the one row is only checked (NaN weights reach every row).
    logits = model(ids[:, :-1], inputs_embeds=embeds[:, :-1], cache=cache, logits_to_keep=1, **grids)  # (1, 1, V)
    check_finite(logits, name, "after the prefill", model)
    return ids[:, -1:]


def make_generator(device, seed):
    # seed None: draw one from torch's global RNG, so torch.manual_seed still governs the run.
    return torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,))) if seed is None else seed)


# ---- the chain round ----


def spec_round(target, draft, tcache, dcache, pending, gamma, temperature, top_k, top_p, generator, last=None):
    """One draft-then-verify round. pending (1, k): emitted tokens the draft has not seen, the last (x_last) the only
    one the target has not. -> (n_accepted, drafted ints, next int, new pending); last: latest logits (NaN guard)."""
    ell = tcache.length  # committed tokens in the target cache, x_last excluded
    x, drafted, qs = pending, [], []
    last = {} if last is None else last
    for _ in range(gamma):
        logits_q = last["draft"] = feed(draft, dcache, x)[0, -1]  # (V,) q for the next position
        if temperature == 0:
            d = logits_q.argmax(-1, keepdim=True)  # (1,) a greedy draft: q is a point mass
        else:
            qs.append(process_logits(logits_q, temperature, top_k, top_p))
            d = sample(qs[-1], generator).view(1)  # (1,)
        drafted.append(d)
        x = d.view(1, 1)
    d = torch.cat(drafted)  # (gamma,)
    logits_p = last["target"] = feed(target, tcache, torch.cat([pending[:, -1:], d.view(1, -1)], 1))[0]  # (gamma+1, V)
    if temperature == 0:
        n, nxt = verify_greedy(d, logits_p)
    else:
        n, nxt = verify_sample(d, torch.stack(qs), process_logits(logits_p, temperature, top_k, top_p), generator)
    n_int, nxt_int, *d_list = torch.cat([n.view(1), nxt.view(1), d]).tolist()  # the round's one host sync
    # Keep the committed tokens: ell + x_last + n accepted drafts; the new x_last stays out.
    tcache.crop(ell + 1 + n_int)
    dcache.crop(min(dcache.length, ell + 1 + n_int))
    # The new pending is what the draft's cache lacks of [old pending, d_1..d_n, next]: [next] after a rejection,
    # [d_gamma, next] after a full acceptance (the draft fed itself d_1..d_{gamma-1}).
    tail = torch.cat([pending, d[:n_int].view(1, -1), nxt.view(1, 1)], 1)  # (1, k + n + 1)
    pending = tail[:, dcache.length - (ell + 1 - pending.shape[1]):]
    return n_int, d_list, nxt_int, pending


# ---- decoding ----


def now(device, timing):
    """The wall clock for timing=True, read after the device has finished its queued work; 0 without timing."""
    if timing and torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() if timing else 0.0


@torch.no_grad()
def speculative(target, draft, prompt, gamma, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                seed=None, stop_token=None, max_len=None, timing=False, tree_round=None):
    """Decode up to max_new_tokens, q proposing and p verifying. gamma: the chain's draft length; or, with tree_round
    (tree.speculative passes tree.tree_round), a tree.TreeShape whose rounds draft and verify a tree. prompt: forward
    kwargs, batch 1; max_len: cache size (None: what the decode needs)."""
    check_inputs(target, draft, prompt, max_new_tokens, temperature, top_k, top_p, stop_token, gamma, tree_round)
    chain = tree_round is None
    # Slots a round writes beyond the committed length: the last round, drafting in full, may reach past the end.
    t_slack, d_slack = (gamma, gamma) if chain else gamma.slack
    tcache = new_cache(target, prompt, max_new_tokens, max_len, t_slack)
    dcache = new_cache(draft, prompt, max_new_tokens, max_len, d_slack)
    sampling = (temperature, top_k, top_p, make_generator(prompt["input_ids"].device, seed))
    t0 = now(prompt["input_ids"].device, timing)
    embeds, deepstack = embed_prompt(target, prompt)  # (1, L, D)
    pending = prefill(target, prompt, embeds, tcache, deepstack, name="target")
    prefill(draft, prompt, embeds, dcache, name="draft")
    t1 = now(prompt["input_ids"].device, timing)
    res = SpecResult(target_forwards=1, draft_forwards=1, prefill_s=t1 - t0)  # the prefills
    g, depth = (gamma, gamma) if chain else (gamma.nodes, gamma.depth)  # drafted per round; its longest path
    one_round = spec_round if chain else tree_round
    last = {}  # the latest logits of each model, checked once at the end
    with nonfinite_named(last, draft):
        while len(res.tokens) < max_new_tokens:
            # Every round has the same shapes (a compiled step's graphs are fixed); the last one's block is cut.
            n, drafted, nxt, pending = one_round(target, draft, tcache, dcache, pending, gamma, *sampling, last)
            block = (drafted[:n] + [nxt])[:max_new_tokens - len(res.tokens)]
            if stop_token is not None and stop_token in block:
                block = block[:block.index(stop_token) + 1]
            res.tokens += block
            res.from_draft += ([True] * n + [False])[:len(block)]
            res.blocks.append(len(block))
            res.accepted.append(n)
            res.depths.append(depth)
            res.rounds += 1
            res.target_forwards += 1
            res.draft_forwards += depth
            res.n_drafted += g
            res.n_accepted += n
            res.n_tested += n + (n < depth)  # the tree: each level reached is one test, as each chain position
            if stop_token is not None and block[-1] == stop_token:
                break
        res.decode_s = now(prompt["input_ids"].device, timing) - t1
    return res


@torch.no_grad()
def autoregressive(target, prompt, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                   seed=None, stop_token=None, max_len=None, timing=False):
    """Plain decoding, the baseline arm: the same prefill, cached one-token target steps and sampling (tau = 1)."""
    check_inputs(target, None, prompt, max_new_tokens, temperature, top_k, top_p, stop_token)
    cache = new_cache(target, prompt, max_new_tokens, max_len)
    generator = make_generator(prompt["input_ids"].device, seed)
    t0 = now(prompt["input_ids"].device, timing)
    embeds, deepstack = embed_prompt(target, prompt)  # (1, L, D)
    x = prefill(target, prompt, embeds, cache, deepstack, name="target")  # (1, 1)
    t1 = now(prompt["input_ids"].device, timing)
    out, last = [], {}
    with nonfinite_named(last):
        for _ in range(max_new_tokens):
            logits = last["target"] = feed(target, cache, x)[0, -1]  # (V,)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)  # (1,)
            else:
                nxt = sample(process_logits(logits, temperature, top_k, top_p), generator).view(1)  # (1,)
            out.append(nxt)
            x = nxt.view(1, 1)
            # Without a stop token nothing needs the value now: no per-token host sync.
            if stop_token is not None and int(nxt) == stop_token:
                break
        tokens = torch.cat(out).tolist()  # the host sync that ends the reasoning step
        decode_s = now(prompt["input_ids"].device, timing) - t1
    return SpecResult(tokens=tokens, from_draft=[False] * len(tokens), blocks=[1] * len(tokens), rounds=len(tokens),
                      target_forwards=len(tokens) + 1, prefill_s=t1 - t0, decode_s=decode_s)


# ---- input checks and NaN guards ----


def config_of(model):
    return getattr(model, "cfg", None) or getattr(model, "config", None)


def check_inputs(target, draft, prompt, max_new_tokens, temperature, top_k, top_p, stop_token, gamma=1,
                 tree_round=None):
    """A bad prompt or setting would fail deep in a forward, or silently (a stop token out of range never stops)."""
    if unknown := set(prompt) - set(EMBED_KEYS) - set(GRID_KEYS) - {"attention_mask"}:
        raise ValueError(f"prompt has keys speculate does not understand: {sorted(unknown)}")
    ids, mask = prompt["input_ids"], prompt.get("attention_mask")
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"speculative decoding here is batch size 1: input_ids must be (1, L), got {tuple(ids.shape)}")
    if mask is not None and not bool(mask.all()):
        raise ValueError("padded prompts are not supported (batch size 1, attention_mask must be all ones)")
    if ids.shape[1] < 2:  # an empty cache would make the model read the first decoded token as a prompt
        raise ValueError("the prompt needs at least 2 tokens: all but the last are prefilled, the last is decoded")
    if tree_round is None and (not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1):
        raise ValueError(f"gamma (draft length) must be an int >= 1, got {gamma!r} (a tree.TreeShape decodes through "
                         "tree.speculative)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    cfg = config_of(target)
    # the held-back last token is decoded as text; an image placeholder there would split features from slots
    if int(ids[0, -1]) in (getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None)):
        raise ValueError("the prompt must end with a text token (e.g. <cot_start>), not an image/video placeholder")
    V = getattr(cfg, "vocab_size", None)
    if V is None:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= V:
        raise ValueError(f"input_ids hold token id {lo if lo < 0 else hi}, outside the target's vocabulary 0..{V - 1}")
    if stop_token is not None and not (isinstance(stop_token, int) and 0 <= stop_token < V):
        raise ValueError(f"stop_token {stop_token!r} is not a token id of the target's vocabulary 0..{V - 1}")
    Vq = getattr(config_of(draft), "vocab_size", V) if draft is not None else V
    if Vq != V:
        raise ValueError(f"the draft's vocabulary ({Vq} tokens) is not the target's ({V}): it cannot be verified")


def check_sampling(temperature, top_k, top_p):
    """The sampling settings alone (the scripts check their flags with it before any work)."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")


def check_finite(logits, name, when, model=None):
    """Greedy decoding would emit argmax(NaN) silently. A reduced draft head is checked at its vocab_ids only."""
    ids = getattr(model, "vocab_ids", None)
    if not bool(torch.isfinite(logits if ids is None else logits.index_select(-1, ids)).all()):
        raise FloatingPointError(f"{name}: NaN or inf logits {when} (NaN / inf weights, or an overflow in "
                                 f"{logits.dtype})")


@contextlib.contextmanager
def nonfinite_named(last, draft=None):
    """last = {name: that model's latest logits}: a NaN in a KV cache reaches every later row, so they tell, checked
    on leaving (no cost inside the timed decode), or at a sampling error mid-decode (multinomial refuses NaN)."""
    try:
        yield
    except RuntimeError as e:
        for name, logits in last.items():
            try:
                check_finite(logits, name, "during the decode", draft if name == "draft" else None)
            except FloatingPointError as nan:
                raise nan from e
        raise
    for name, logits in last.items():
        check_finite(logits, name, "at the end of the decode", draft if name == "draft" else None)
