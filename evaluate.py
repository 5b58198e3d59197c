"""Evaluation on the synthetic driving world, the columns of the paper's table: batched CoC generation (greedy or
sampled), the action step (every CoC -> trajectory path: the toy's head, Alpamayo's expert) and its ADE,
teacher-forced commitment accuracy, the attention split (FlatRoPE's claim, docs/background.md) and speculative
decoding's statistics over a set of prompts (tau, alpha, routine share).

Letters: B batch, P prompt length, L sequence, T generated tokens, V vocab, H heads.

run: python -m pytest -q tests/test_evaluate.py
"""
import contextlib
import math

import torch

import driving
from driving import Data, grid_kwargs, vision_kwargs
import speculate
from speculate import GREEDY
from tree import TreeShape

MAX_NEW_TOKENS = 32  # CoC token limit per decode: the toy's CoCs are 12-28 tokens with <cot_end>
GAMMA = 6  # draft length of the table, the benchmark and AARL's logged tau
GAMMAS = tuple(range(2, 9))  # the draft lengths tau is replayed at (a speed-optimal gamma is chosen among them)
# the benchmark's default draft tree (N nodes, depth D, width k): chosen on the validation split by the measured cost
# model (experiments/tree_sweep.py); bench.py --tree 0 runs the chain of GAMMA instead
TREE = TreeShape(32, 8, 3)
# the shapes rsd.py and bench.py --compile choose from (on val, by the cost model of the mode that runs them)
TREES = tuple(TreeShape(n, d, 3) for n in (16, 32) for d in (6, 8))
EVAL_BATCH = 64  # scenes per batched evaluation forward
TARGET_ONLY = "target-only"  # the baseline arm: plain KV-cached decoding by the target

# ---- batched generation ----
def autocast(device, enabled):
    """bf16 autocast for the matmuls when enabled (weights stay fp32)."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def greedy_coc(target, batch, stop, max_new=MAX_NEW_TOKENS, amp=False, draft=None):
    """Greedy CoCs of a batch of equal-length prompts (speculate.autoregressive_batch): id lists, ending with the stop
    token when the model wrote it. draft: the draft's own instead, unverified, reading the target's prompt embeddings
    (as when it drafts)."""
    P = int(batch["prompt_len"][0])
    assert bool((batch["prompt_len"] == P).all()), "greedy_coc needs equal prompt lengths"
    prompt = {"input_ids": batch["input_ids"][:, :P], **vision_kwargs(batch)}  # ids (B, P)
    with autocast(prompt["input_ids"].device, amp):
        embeds = None if draft is None else target.embed(**prompt)  # (B, P, D)
        rows = speculate.autoregressive_batch(target if draft is None else draft, prompt, max_new, stop_token=stop,
                                              embeds=embeds)
    return [r.tokens for r in rows]


@torch.no_grad()
def action_rows(target, prompt, cocs, end, v0=None):
    """The action step, the one way from CoCs to trajectories (the toy's head, Alpamayo's expert; one row or a plan's
    B = P x samples): row b reads prompt row b // samples, then its CoC closed by `end` (the ids between a CoC and its
    trajectory, as (<cot_end>, <traj_future_start>): those after the last of them the CoC ends with). Each prompt row
    is prefilled once (its cache rows repeated), the B CoCs teacher-forced in one right-padded step (attention is
    causal), then the toy's trajectory head at each row's last token, or an Alpamayo target's action expert over all
    rows, each reading its cache up to its own <traj_future_start> (v0 (B,) m/s; every row's noise seeded 0: a row's
    plan is a function of its CoC whatever its batch, so AARL's advantages compare CoCs, not noise draws). prompt:
    forward kwargs of P rows (input_ids (P, L), left-padded under attention_mask), with pixels or with target.embed's
    inputs_embeds and deepstack. -> waypoints (B, N, 2), logits (B, 1 + T, V) (row t predicts token t of the closed
    CoC: AARL's agreement) and the cache (the expert alone is timed on it)."""
    seqs = [c + list(end[max((i + 1 for i, t in enumerate(end) if c[-1:] == [t]), default=0):]) for c in cocs]
    ids, T, expert = prompt["input_ids"], max(map(len, seqs)), getattr(target, "expert", None)  # ids (P, L)
    B, P = len(seqs), ids.shape[0]
    room = ids.shape[1] + T + (expert.cfg.n_waypoints if expert is not None else 0)  # and the expert's action tokens
    cache = target.new_cache(batch=P, max_len=room)
    first = target(ids, cache=cache, logits_to_keep=1, **{k: v for k, v in prompt.items() if k != "input_ids"})
    if B > P:  # each prompt row's samples share its prefill
        cache, shared = target.new_cache(batch=B, max_len=room), cache
        cache.take_rows(shared, [p for p in range(P) for _ in range(B // P)])
    x = torch.tensor([s + s[-1:] * (T - len(s)) for s in seqs], device=ids.device)  # (B, T)
    logits, h = target(x, cache=cache, return_hidden=True)  # (B, T, V), (B, T, D)
    logits = torch.cat([first.repeat_interleave(B // P, 0), logits], 1)  # (P, 1, V) + (B, T, V) -> (B, 1 + T, V)
    if expert is None:
        return target.traj(h[torch.arange(B), [len(s) - 1 for s in seqs]]).float(), logits, cache  # (B, N, 2)
    cache.crop([n - T + len(s) for n, s in zip(cache.lengths, seqs)])  # each row up to its <traj_future_start>
    gens = [torch.Generator(device=ids.device).manual_seed(0) for _ in seqs]
    return expert(cache, v0, generator=gens), logits, cache


def repeat_scenes(inputs, n_scenes, G):
    """Camera inputs of a batch of n_scenes (pixels and grids, scene-major rows) with each scene repeated G times in
    a row, as for G rollouts per scene. Every scene of a batch has the same number of rows (one geometry)."""
    return {k: v.view(n_scenes, -1, *v.shape[1:]).repeat_interleave(G, 0).flatten(0, 1) for k, v in inputs.items()}


# ---- metrics: ADE, commitment accuracy, CoC exact match ----
def ade_fde(pred, true, per_scene=False):
    """(B, 32, 2) waypoints -> (average, final) displacement error in metres: floats averaged over the batch, or
    (B,) tensors with per_scene."""
    d = torch.linalg.vector_norm(torch.as_tensor(pred) - torch.as_tensor(true), dim=-1)   # (B, 32)
    return (d.mean(-1), d[:, -1]) if per_scene else (d.mean().item(), d[:, -1].mean().item())


def coc_exact_match(pred, true):
    """Fraction of CoCs (id lists up to and including <cot_end>) generated exactly."""
    return sum(list(p) == list(t) for p, t in zip(pred, true)) / len(true)


def commitment_hits(pred_next, input_ids, commit_mask):
    """Teacher-forced argmax pred_next (B, L) against input_ids shifted by one -> (right, total) commitment tokens
    (integers: exact over batches). Teacher forcing scores each on the reference prefix: no miss hides later ones."""
    hit = pred_next[:, :-1] == input_ids[:, 1:]                    # (B, L-1)
    m = commit_mask[:, :-1]
    return (hit & m).sum().item(), m.sum().item()


@torch.no_grad()
def plans(target, data: Data, cocs, batch_size=EVAL_BATCH, amp=False):
    """The target's trajectories (S, N, 2) after one CoC per scene of data (action_rows, a batch of scenes at once)."""
    out, end = [], (data.tok.cot_end_id, data.tok.traj_future_start_id)  # what follows a toy CoC
    for i, batch in enumerate(data.batches(batch_size, next(target.parameters()).device)):
        ids = batch["input_ids"][:, :int(batch["prompt_len"][0])]  # (B, P)
        with autocast(ids.device, amp):
            out.append(action_rows(target, {"input_ids": ids, **vision_kwargs(batch)},
                                   cocs[i * batch_size:(i + 1) * batch_size], end)[0].float().cpu())  # (B, N, 2)
    return torch.cat(out)


def ground_truth(data: Data):
    """The scenes' true future waypoints (S, N, 2)."""
    return torch.stack([torch.as_tensor(s.traj) for s in data.scenes]).float()


def trajectory_ade(target, data: Data, cocs, batch_size=EVAL_BATCH, amp=False):
    """(ADE, FDE) in metres over the scenes of data of the target's trajectories after cocs (one per scene)."""
    return ade_fde(plans(target, data, cocs, batch_size, amp), ground_truth(data))


def relaxed_cost(target, data: Data, exact, relaxed):
    """What a relaxed (lossy) decode cost on the scenes of data, against the exact decode's CoCs (id lists): the
    share of CoCs it changed, how far it moved the plan (the ADE between the plans after both, m) and both plans'
    ADE to the ground truth."""
    truth = ground_truth(data)  # (S, N, 2)
    p_exact, p_relaxed = plans(target, data, [list(c) for c in exact]), plans(target, data, [list(c) for c in relaxed])
    return {"cocs_changed": sum(list(a) != list(b) for a, b in zip(exact, relaxed)) / len(exact),
            "plan_moved_m": ade_fde(p_relaxed, p_exact)[0], "ade_exact": ade_fde(p_exact, truth)[0],
            "ade_relaxed": ade_fde(p_relaxed, truth)[0]}


@torch.no_grad()
def commitment_acc(model, target, data: Data, batch_size=EVAL_BATCH, amp=False):
    """Teacher-forced argmax accuracy on the commitment tokens of the target (model is target) or a draft (reading
    the target's prompt embeddings, as when it drafts): can this model supply the tokens that need the image?"""
    return commitment_accs({None: model}, target, data, batch_size, amp)[None]


@torch.no_grad()
def commitment_accs(models, target, data: Data, batch_size=EVAL_BATCH, amp=False):
    """{name: commitment_acc} of models (name -> the target or a draft); the drafts share one target.embed per batch
    (the vision tower's work, the same tensors each draft would compute alone)."""
    hits, n = dict.fromkeys(models, 0), dict.fromkeys(models, 0)
    device = next(target.parameters()).device
    for batch in data.batches(batch_size, device):
        embeds = None
        for name, model in models.items():
            with autocast(device, amp):
                if model is target:
                    logits = target(batch["input_ids"], **vision_kwargs(batch))  # (B, L, V)
                else:
                    if embeds is None:
                        embeds = target.embed(batch["input_ids"], **vision_kwargs(batch))  # (B, L, D)
                    logits = model(batch["input_ids"], inputs_embeds=embeds, **grid_kwargs(batch))
            h, m = commitment_hits(logits.argmax(-1), batch["input_ids"], batch["commit_mask"])
            hits[name], n[name] = hits[name] + h, n[name] + m
    return {name: hits[name] / max(n[name], 1) for name in models}


@torch.no_grad()
def evaluate_target(target, data: Data, batch_size=EVAL_BATCH, amp=False):
    """coc_exact (greedy), commitment_acc, ade / fde (m) of the trajectory after the model's own greedy CoC."""
    target.eval()
    cocs = greedy_outputs(target, data, batch_size=batch_size, amp=amp)
    ade, fde = trajectory_ade(target, data, cocs, batch_size, amp)
    return {"coc_exact": coc_exact_match(cocs, data.coc_ids()),
            "commitment_acc": commitment_acc(target, target, data, batch_size, amp), "ade": ade, "fde": fde}


# ---- attention split ----
def key_groups(input_ids, tok):
    """Which key tokens are image (video placeholders), trajectory history (bins and their two
    markers) or other text -> three bool masks (B, L)."""
    image = (input_ids == tok.video_token_id) | (input_ids == tok.image_token_id)
    end = input_ids == tok.hist_end_id
    history = ((input_ids == tok.hist_start_id).cumsum(-1) > end.cumsum(-1)) | end  # from <traj_history_start> to end
    return {"image": image, "history": history, "text": ~image & ~history}


@torch.no_grad()
def attention_probs(model, input_ids, **forward_kwargs):
    """Per-layer attention probabilities (B, H, L, L) of a cache-free forward, one layer at a time, recomputed from
    each layer's own q/k projections and rope tables (the slow, obvious path: softmax(q k^T / sqrt(hd)) under the
    mask the forward used: causal, or the model's own (padding; the history-only draft's hidden visual keys));
    tests/test_evaluate.py checks that probs @ v through o_proj reproduces the layer's output."""
    captured = []

    def grab(module, args):  # Attention.forward(x, cos, sin, cache, layer, mask, ...), as Block calls it
        captured.append((module, args[0], args[1], args[2], args[5]))  # (attention, x, cos, sin, mask)

    hooks = [layer.self_attn.register_forward_pre_hook(grab) for layer in model.layers]
    try:
        model(input_ids, **forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    for attn, x, cos, sin, mask in captured:
        q, k, _ = attn.project(x, cos, sin)  # (B, H, L, hd), (B, Hk, L, hd)
        k = k.repeat_interleave(attn.H // attn.Hk, dim=1)  # (B, H, L, hd)
        # (B, H, L, hd) x (B, H, hd, L) -> (B, H, L, L)
        scores = (q.float() @ k.float().transpose(-2, -1)) / attn.hd ** 0.5
        L = scores.shape[-1]
        if mask is None:  # the forward's is_causal
            mask = torch.ones(L, L, dtype=torch.bool, device=scores.device).tril()
        yield scores.masked_fill(~mask, float("-inf")).softmax(-1)  # mask (L, L) or (B, 1, L, L) bool


@torch.no_grad()
def attention_split(model, target, data: Data, n=16):
    """The model's attention mass on image / history / other-text keys while it predicts the CoC (teacher-forced),
    averaged over CoC rows, heads and layers, on the first n scenes, reading the target's prompt embeddings as a
    draft does when it drafts."""
    batch = next(data.batches(n, next(model.parameters()).device))
    embeds = target.embed(batch["input_ids"], **vision_kwargs(batch))  # (B, L, D)
    groups = key_groups(batch["input_ids"], data.tok)
    rows = batch["loss_mask"]  # (B, L) query positions that predict CoC tokens
    mass = {name: [] for name in groups}
    for p in attention_probs(model, batch["input_ids"], inputs_embeds=embeds, **grid_kwargs(batch)):
        for name, keys in groups.items():
            # (B, H, L, L) * (B, 1, 1, L) -> mass per query row (B, H, L) -> mean over heads (B, L) -> CoC rows
            mass[name].append((p * keys[:, None, None, :]).sum(-1).mean(1)[rows].mean().item())
    return {name: sum(m) / len(m) for name, m in mass.items()}


# ---- speculative decoding over a set of prompts ----
def stack_prompts(prompts, pad_id=0):
    """Batch-1 prompt dicts -> one prompt of P rows, left-padded to the longest (attention_mask), the vision inputs
    of the rows that have them concatenated in row order (transformers' layout: row-major over the batch)."""
    if bad := [i for i, p in enumerate(prompts) if p["input_ids"].dim() != 2 or p["input_ids"].shape[0] != 1]:
        raise ValueError(f"stack_prompts stacks batch-1 prompts (input_ids (1, L)); prompts {bad} are not")
    L = max(p["input_ids"].shape[1] for p in prompts)
    ids = torch.cat([torch.nn.functional.pad(p["input_ids"], (L - p["input_ids"].shape[1], 0), value=pad_id)
                     for p in prompts])  # (P, L)
    out = {"input_ids": ids, "attention_mask": (torch.arange(L, device=ids.device) >= torch.tensor(
        [L - p["input_ids"].shape[1] for p in prompts], device=ids.device)[:, None]).long()}  # (P, L)
    for k in set().union(*prompts) - {"input_ids", "attention_mask"}:
        out[k] = torch.cat([p[k] for p in prompts if p.get(k) is not None])
    return out


def scene_prompts(scenes, tok, device, dtype=None, views=driving.WorldConfig().views):
    """Batch-1 prompts (driving.build_prompt) on device, floating inputs cast to dtype when given."""
    return [{k: v.to(device).to(dtype) if dtype is not None and v.is_floating_point() else v.to(device)
             for k, v in driving.build_prompt(s, tok, views).items()} for s in scenes]


def decode(target, draft, prompt, decoder, max_new, stop_token, sampling=GREEDY, timing=False):
    """One arm on one prompt: speculative decoding with `draft` and `decoder` (speculate.Chain or gamma,
    tree.TreeShape), or target-only decoding when draft is None."""
    if draft is None:
        return speculate.autoregressive(target, prompt, max_new, sampling, stop_token, timing=timing)
    return speculate.speculative(target, draft, prompt, decoder, max_new, sampling, stop_token, timing=timing)


class SharedPrefill:
    """The model with each prompt's embedding and prefill computed once, then copied (KVCache.take_rows): a table
    decodes every scene with many drafts, and the scene's prefill is the same in each (the same forward, into a cache
    of the prompt's rows: the copied keys are those a fresh prefill writes). Keyed on the prompt's tensors, kept alive
    here; everything else is the model's own. For decodes whose prefill is not what is timed (rsd.py's table)."""

    def __init__(self, model):
        self.model, self.memo = model, {}

    def __getattr__(self, name):  # cfg, step, new_cache, vocab_ids, ...: the model's
        return getattr(self.model, name)

    def shared(self, what, input_ids, kw, run):
        key = (what, input_ids.data_ptr(), tuple(input_ids.shape), kw.get("return_deepstack"))
        if key not in self.memo:
            self.memo[key] = run(), input_ids
        return self.memo[key][0]

    def embed(self, input_ids, **kw):
        return self.shared("embed", input_ids, kw, lambda: self.model.embed(input_ids, **kw))

    def __call__(self, input_ids, cache=None, **kw):  # a prefill (an empty cache) shared; anything else the model's
        if cache is None or any(cache.lengths):
            return self.model(input_ids, cache=cache, **kw)
        own = lambda: (c := self.model.new_cache(len(input_ids), input_ids.shape[1]), self.model(  # noqa: E731
            input_ids, cache=c, **kw))
        src, logits = self.shared("prefill", input_ids, kw, own)
        cache.take_rows(src, list(range(len(input_ids))))
        return logits


@torch.no_grad()
def spec_stats(target, drafts, prompts, gamma, max_new=MAX_NEW_TOKENS, stop_token=None, check_greedy=True,
               sampling=GREEDY):
    """{arm: stats} of every prompt (batch 1) decoded with each draft of `drafts` (name -> draft) and, when
    check_greedy, by the target alone (arm TARGET_ONLY, first). Greedy unless `sampling` samples (prompt i's seeds:
    sampling.offset(i)); then check_greedy is off: lossless verification keeps the sampled distribution, not the
    tokens. alpha is Leviathan's; tau_ceiling is the tau of a draft the verifier never rejects, on these outputs."""
    check_greedy = check_greedy and sampling.greedy
    arms = {TARGET_ONLY: None, **drafts} if check_greedy else dict(drafts)
    out = {}
    for name, draft in arms.items():
        res = [decode(target, draft, p, gamma, max_new, stop_token, sampling.offset(i)) for i, p in enumerate(prompts)]
        if name == TARGET_ONLY:
            reference = [r.tokens for r in res]
        out[name] = result_stats(res, gamma, reference if check_greedy else None)
    return out


def result_stats(res, gamma, reference=None):
    """spec_stats' statistics of one arm's results (speculate.SpecResult per prompt, pooled); greedy_match: every
    output equals its reference (id lists), None without one."""
    all_ = speculate.SpecResult.pooled(res)
    return {"tokens": [r.tokens for r in res], "n_tokens": len(all_.tokens), "tau": all_.tau, "alpha": all_.alpha,
            "routine_fraction": all_.routine_share,
            "tau_ceiling": tau_ceiling([len(r.tokens) for r in res], gamma),
            "nodes_per_round": all_.n_drafted / all_.rounds, "alpha_by_depth": all_.alpha_by_depth(),
            "depth_per_round": sum(all_.depths) / all_.rounds,  # the rounds near max_new draft less
            "greedy_match": None if reference is None else all(r.tokens == t for r, t in zip(res, reference))}


def marked_coc(words, from_draft):
    """'routine words [DELIBERATIVE] ...': the words the routine reasoner supplied, the target's own in brackets."""
    return " ".join(w if d else f"[{w}]" for w, d in zip(words, from_draft))


# ---- greedy speculative decoding, simulated exactly from one teacher-forced pass ----
@torch.no_grad()
def greedy_outputs(target, data: Data, max_new=MAX_NEW_TOKENS, batch_size=EVAL_BATCH, amp=False, draft=None):
    """The target's greedy CoC of every scene of data (ids up to and including <cot_end> when written): what greedy
    speculative decoding must emit, whatever the draft (draft: that draft's own, greedy_coc's)."""
    return [c for batch in data.batches(batch_size, next(target.parameters()).device)
            for c in greedy_coc(target, batch, data.tok.cot_end_id, max_new, amp, draft)]


@torch.no_grad()
def draft_matches(drafts, target, data: Data, outputs, batch_size=EVAL_BATCH):
    """{name: match} for drafts (name -> draft): match[s][k] says whether the draft's argmax after prompt +
    outputs[s][:k] equals outputs[s][k]. One cache-free forward per draft and batch, teacher-forced on the target's
    own output, reading the target's embeddings (computed once per batch) as a draft does when it drafts."""
    device = next(target.parameters()).device
    out = {name: [] for name in drafts}
    for i, batch in enumerate(data.batches(batch_size, device)):
        seqs = outputs[i * batch_size:(i + 1) * batch_size]
        P, T = int(batch["prompt_len"][0]), max(map(len, seqs))
        outs = torch.tensor([s + [data.tok.pad_id] * (T - len(s)) for s in seqs], dtype=torch.long, device=device)
        ids = torch.cat([batch["input_ids"][:, :P], outs], 1)  # (B, P + T): each output after its prompt, right-padded
        embeds = target.embed(ids, **vision_kwargs(batch))  # (B, P + T, D)
        for name, draft in drafts.items():
            pred = draft(ids, inputs_embeds=embeds, **grid_kwargs(batch)).argmax(-1)  # (B, P + T)
            # position P - 1 + k predicts output token k
            out[name] += [(pred[b, P - 1:P - 1 + len(s)] == ids[b, P:P + len(s)]).tolist() for b, s in enumerate(seqs)]
    return out


def simulate_rounds(match, gamma):
    """Greedy speculative decoding of one output, replayed from its match vector -> (rounds, tokens from the draft).

    Exact because every accepted draft token equals the target's own token: a round that starts after the committed
    prefix y[:i] drafts argmax q(. | y[:i]), then argmax q(. | y[:i+1]), ... and the verifier keeps them while they
    equal y[i], y[i+1], ...: the run of matches from i, at most gamma long. The round then emits the run plus the
    target's token (correction or bonus), cut after the stop token or at the output's end (max_new: that round emits
    drafts only), as speculate.speculative does."""
    n, i, rounds, from_draft = len(match), 0, 0, 0
    while i < n:
        run = 0
        while run < gamma and i + run < n and match[i + run]:
            run += 1
        from_draft += min(run, n - i)
        i += min(run + 1, n - i)
        rounds += 1
    return rounds, from_draft


def tau_by_gamma(matches, gammas):
    """{gamma: {"tau", "routine_fraction"}} over a set of outputs, from their match vectors."""
    n = sum(map(len, matches))
    out = {}
    for g in gammas:
        rounds, from_draft = map(sum, zip(*(simulate_rounds(m, g) for m in matches)))
        out[g] = {"tau": n / rounds, "routine_fraction": from_draft / n}
    return out


# ---- the speed-up model (Leviathan et al. 2023, section 3) ----
def measured_speedup(tau, t_target_1, t_draft_1, t_target_gamma1, gamma):
    """tau * T_target(1) / (gamma * T_draft(1) + T_target(gamma+1)), from measured step times."""
    return tau * t_target_1 / (gamma * t_draft_1 + t_target_gamma1)


def expected_tau(alpha, gamma):
    """Expected tokens per round for an i.i.d. acceptance rate alpha: (1 - a^(g+1)) / (1 - a)."""
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha, gamma, c):
    """Leviathan et al. Theorem 3.8: (1 - a^(g+1)) / ((1 - a)(g c + 1)), c = draft step / target step."""
    return expected_tau(alpha, gamma) / (gamma * c + 1.0)


def tree_speedup(tau, t_target_1, t_draft_1, t_draft_level, t_verify, shape, t_grow=None):
    """tau * T_target(1) / (T_draft(1) + (D - 1) T_draft(k) + T_verify(N + 1)): a tree round drafts its root level
    from the pending token, then D - 1 levels of k expanded nodes, and verifies x_last + N nodes in one forward.
    t_grow: those D - 1 levels and the tree's construction timed as they run (timing.grow_time), in their place."""
    grow = (shape.depth - 1) * t_draft_level if t_grow is None else t_grow
    return tau * t_target_1 / (t_draft_1 + grow + t_verify)


def tau_ceiling(lengths, gamma):
    """tau of a never-rejected draft (gamma, or a TreeShape) over outputs of these lengths: n tokens take at least
    ceil(n / (gamma + 1)) rounds, so short outputs cap tau whatever the draft (a 17-token CoC at gamma 6: 17 / 3)."""
    g = getattr(gamma, "depth", gamma)  # a tree emits at most depth + 1 per round
    return sum(lengths) / sum(math.ceil(n / (g + 1)) for n in lengths)


# ---- what a draft writes on its own, and how far it moved ----
@torch.no_grad()
def drafted_ade(target, draft, data: Data, max_new=MAX_NEW_TOKENS, batch_size=EVAL_BATCH):
    """ADE (m) of the target's trajectories after the draft's own greedy CoC, written without verification: the
    quantity AARL's action reward scores."""
    return trajectory_ade(target, data, greedy_outputs(target, data, max_new, batch_size, draft=draft), batch_size)[0]


def exact_kl_terms(logq, logr):
    """KL(q || r) = sum_v q (log q - log r) per position: log-probs (..., V) -> (...). Ids where q is 0 (a reduced-
    vocabulary draft's -inf outside its set, model.VLA.head) add 0 log 0 = 0; they are masked before the arithmetic, so
    that neither the value nor the gradient meets -inf - (-inf)."""
    out = ~torch.isfinite(logq)
    logq, logr = logq.masked_fill(out, 0.0), logr.masked_fill(out, 0.0)
    return (logq.exp() * (logq - logr)).masked_fill(out, 0.0).sum(-1)


@torch.no_grad()
def kl_to(model, ref, target, data: Data, batch_size=EVAL_BATCH):
    """Mean exact KL(model || ref) over the CoC positions of data's reference CoCs (teacher-forced), both reading the
    target's embeddings (on a reduced ref's set): KL(q || q_ref) for AARL, KL(p || q) for train.draft_scores."""
    total = n = 0.0
    for batch in data.batches(batch_size, next(target.parameters()).device):
        embeds = target.embed(batch["input_ids"], **vision_kwargs(batch))  # (B, L, D)
        m = batch["loss_mask"]  # (B, L) positions that predict CoC tokens
        ids = getattr(ref, "vocab_ids", slice(None))  # a reduced ref's K ids, else every id
        logq, logr = (torch.log_softmax(d(batch["input_ids"], inputs_embeds=embeds, **grid_kwargs(batch))[m].float()
                                        [:, ids], -1) for d in (model, ref))  # (N, V or K) each
        total += float(exact_kl_terms(logq, logr).sum())
        n += int(m.sum())
    return total / max(n, 1)
