"""The history-only routine reasoner (model.DRAFT_KINDS["history"]): no image / video token is ever one of its keys. Its
prefill leaves them out of the cache (the other tokens at their own positions) and equals its full forward, whose
mask hides them; its speculative decoding is lossless (greedy identity here and, through test_speculate.drafts_for,
in every chain, tree and B-row test; a chi-square test of the sampled law on a prompt with an image); real
decoding's tau equals the exact replay's (the draft's cache bookkeeping is its own, shorter than the target's); a
kind is one row of model.DRAFT_KINDS; a checkpoint written before a config field existed loads with its default.

Chi-square: level 1e-3 (a correct sampler fails with probability 1e-3); the negative control (the verifier handed
the wrong q) must fail at the same N.

run: python -m pytest -q tests/test_history_draft.py
"""
import json

import pytest
from safetensors import safe_open
from safetensors.torch import save_file
from test_speculate import SIGNIFICANCE, chi_square, o1_init, seeded_rows, tiny_target, vla_prompts, wrong_q
import torch

from evaluate import simulate_rounds, stack_prompts
import model
from ops import checkpoint
import speculate
from speculate import autoregressive, speculative, speculative_batch
import train
from tree import TreeShape

pytestmark = pytest.mark.usefixtures("one_thread")


def history_draft(target, n_layers=2, seed=1):
    torch.manual_seed(seed)
    return model.make_draft(target, n_layers=n_layers, kind="history").eval()


def embed_and_grids(target, prompt):
    embeds = target.embed(**{k: prompt[k] for k in speculate.EMBED_KEYS if prompt.get(k) is not None})
    return embeds, {k: prompt[k] for k in speculate.GRID_KEYS + ("attention_mask",) if prompt.get(k) is not None}


@torch.no_grad()
def test_prefill_skips_the_visual_tokens_and_equals_the_full_forward():
    """27 tokens, 16 of them image / video placeholders: the cache holds the 11 others; the last token's logits and
    three decode steps after it equal the full forward's (which masks the visual keys); no text logit moves when the
    image features change (the attention never reaches them), while the replica's do."""
    target = tiny_target()
    draft = history_draft(target)
    prompt = vla_prompts()["image+video"]
    ids = prompt["input_ids"]
    text = ~draft.visual_tokens(ids)[0]  # (27,)
    assert int(text.sum()) == 11 and draft.prompt_slots(ids) == 11
    embeds, grids = embed_and_grids(target, prompt)
    full = draft(ids, inputs_embeds=embeds, **grids)  # (1, 27, V)
    cache = draft.new_cache(max_len=32)
    pre = draft(ids, inputs_embeds=embeds, cache=cache, **grids)  # (1, 11, V)
    assert cache.lengths == [11]
    torch.testing.assert_close(pre[0], full[0, text], atol=2e-5, rtol=1e-4)
    seq = torch.tensor([[3, 4, 5]])
    steps = draft(seq, cache=cache)  # (1, 3, V)
    longer = dict(prompt, input_ids=torch.cat([ids, seq], 1))
    embeds2, _ = embed_and_grids(target, longer)
    torch.testing.assert_close(steps[0], draft(longer["input_ids"], inputs_embeds=embeds2, **grids)[0, -3:],
                               atol=2e-5, rtol=1e-4)
    moved = embeds.clone()
    moved[0, ~text] += 1.0  # other image features
    torch.testing.assert_close(draft(ids, inputs_embeds=moved, **grids)[0, text], full[0, text], atol=0, rtol=0)
    replica = model.make_draft(target, n_layers=2, kind="mrope").eval()
    assert not torch.allclose(replica(ids, inputs_embeds=moved, **grids)[0, text],
                              replica(ids, inputs_embeds=embeds, **grids)[0, text])


@torch.no_grad()
def test_padded_rows_prefill_each_as_alone():
    """Left-padded rows of different lengths and image counts (27, 5 and 2 tokens): each row's last logits and next
    steps are those of its own batch-1 prefill."""
    target = tiny_target()
    draft = history_draft(target)
    prompts = list(vla_prompts().values())
    batch = stack_prompts(prompts)
    embeds, grids = embed_and_grids(target, batch)
    cache = draft.new_cache(batch=3, max_len=40)
    last = draft(batch["input_ids"], inputs_embeds=embeds, cache=cache, logits_to_keep=1, **grids)[:, -1]  # (3, V)
    nxt = draft(torch.tensor([[7], [8], [9]]), cache=cache)[:, -1]  # (3, V)
    for b, p in enumerate(prompts):
        e, g = embed_and_grids(target, p)
        c = draft.new_cache(max_len=40)
        torch.testing.assert_close(last[b], draft(p["input_ids"], inputs_embeds=e, cache=c, **g)[0, -1],
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(nxt[b], draft(torch.tensor([[7 + b]]), cache=c)[0, -1], atol=2e-5, rtol=1e-4)


@torch.no_grad()
def test_greedy_equals_target_and_real_tau_equals_the_replay():
    """Chain (gamma 1, 3, 6), tree and B rows: the tokens are target-only greedy's; and the chain's rounds are the
    exact replay's from the draft's teacher-forced matches (full forward, visual keys masked): a cache out of step
    with the committed tokens would draft from the wrong prefix and change the rounds."""
    target = tiny_target()
    draft = history_draft(target)  # the target's layers: it agrees with the target where the images do not matter
    draft.layers.load_state_dict(target.layers.state_dict())
    draft.norm.load_state_dict(target.norm.state_dict())
    prompts, accepted = vla_prompts(), 0
    for name, prompt in prompts.items():
        ref = autoregressive(target, prompt, 24).tokens
        ids = torch.cat([prompt["input_ids"], torch.tensor([ref[:-1]])], 1)
        embeds, grids = embed_and_grids(target, dict(prompt, input_ids=ids))
        q = draft(ids, inputs_embeds=embeds, **grids)[0, -len(ref):].argmax(-1)  # (n,) q after each committed prefix
        match = (q == torch.tensor(ref)).tolist()
        for gamma in (1, 3, 6):
            res = speculative(target, draft, prompt, gamma, 24)
            assert res.tokens == ref, (name, gamma)
            assert (res.rounds, sum(res.from_draft)) == simulate_rounds(match, gamma), (name, gamma)
            accepted += sum(res.from_draft)
        assert speculative(target, draft, prompt, TreeShape(8, 4, 2), 24).tokens == ref, name
    assert accepted > 20  # the replay was tested on rounds that accepted drafts
    rows = speculative_batch(target, draft, stack_prompts(list(prompts.values())), 3, 24, samples=2)
    assert [r.tokens for r in rows] == [autoregressive(target, p, 24).tokens for p in prompts.values() for _ in "ab"]


def image_vla(seed):
    """A one-layer VLA of 5 ordinary tokens plus an image placeholder (5) and its vision-start token (6), no tower
    (placeholders keep their embeddings): small enough to compute the law of 2 sampled tokens exactly."""
    cfg = model.ModelConfig(vocab_size=7, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=48,
                            rope_theta=100.0, mrope_section=(2, 3, 3), image_token_id=5, video_token_id=100,
                            vision_start_token_id=6, vision=None, traj_len=0, spatial_merge_size=2)
    torch.manual_seed(seed)
    return o1_init(model.VLA(cfg).eval(), seed)


def test_sampled_law_is_the_targets():
    """N = 3000 sampled decodes (chain gamma 2, tree (4, 2, 2), two rows per prompt) of a prompt holding an image
    block, with a history-only draft: the first 2 tokens ~ the target's law, computed by cached target forwards
    (the decode's own reading of a generated placeholder id: text); the chain with the wrong q must fail."""
    target = image_vla(0)
    torch.manual_seed(3)
    draft = o1_init(model.make_draft(target, n_layers=1, kind="history").eval(), 4)
    prompt = dict(input_ids=torch.tensor([[0, 6, 5, 5, 5, 5, 3, 1]]), image_grid_thw=torch.tensor([[1, 4, 4]]))
    V, N, temperature = 7, 3000, 1.0

    @torch.no_grad()
    def probs(seq):  # p after the prompt and seq, seq fed as cached steps
        cache = target.new_cache(max_len=16)
        logits = target(prompt["input_ids"], cache=cache, image_grid_thw=prompt["image_grid_thw"])[:, -1]
        for t in seq:
            logits = target(torch.tensor([[t]]), cache=cache)[:, -1]
        return speculate.process_logits(logits[0], temperature)

    expected = (probs([])[:, None] * torch.stack([probs([a]) for a in range(V)])).reshape(-1)  # (V^2,)

    def law(decode, g):
        toks = seeded_rows(decode, target, draft, prompt, g, 2, N, samples=2, temperature=temperature)  # (N, 2)
        return chi_square(torch.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V), expected)[2]

    p_chain, p_tree = law(speculative_batch, 2), law(speculative_batch, TreeShape(4, 2, 2))
    print(f"history-only draft: chain p = {p_chain:.3g}, tree p = {p_tree:.3g}")
    assert min(p_chain, p_tree) > SIGNIFICANCE
    honest = speculate.verify_sample
    try:
        speculate.verify_sample = lambda d, q, p, g, also=None: honest(d, wrong_q(q), p, g, also)
        bad = law(speculative_batch, 2)
    finally:
        speculate.verify_sample = honest
    print(f"control: p = {bad:.3g}")
    assert bad < SIGNIFICANCE


def test_a_kind_is_one_row_of_the_table(tmp_path):
    """Every DRAFT_KINDS row builds (make_draft, train.make_drafts), names itself (draft_kind), saves and loads as that
    kind; an unknown kind is a named error, in make_draft and train.py --kinds."""
    target = tiny_target()
    built = train.make_drafts(target, dict(n_layers=1), tuple(model.DRAFT_KINDS))
    assert list(built) == list(model.DRAFT_KINDS)
    for kind, draft in built.items():
        assert model.draft_kind(draft.cfg) == kind
        path = checkpoint.draft_dir(str(tmp_path), kind, 0)
        checkpoint.save(draft, path, target=target)
        assert checkpoint.existing_kind(path) == f"{kind} draft"
        assert model.draft_kind(checkpoint.load(path, target=target).cfg) == kind
    with pytest.raises(ValueError, match="draft kind 'nope' is not one of"):
        model.make_draft(target, kind="nope")
    with pytest.raises(SystemExit):
        train.parse_args(["--kinds", "flat,nope"])
    with pytest.raises(ValueError, match="skip_visual is for drafts only"):
        model.ModelConfig(skip_visual=True)


def test_a_file_older_than_a_config_field_loads_with_its_default(tmp_path, capsys):
    """A checkpoint whose header predates skip_visual loads as written (False), says so on stderr, and keeps its
    config fingerprint: the same as the file written with the field (the drafts that recorded it stay valid)."""
    target = tiny_target()
    draft = model.make_draft(target, kind="flat")
    path = checkpoint.draft_dir(str(tmp_path), "flat", 0)
    checkpoint.save(draft, path, target=target)
    file = f"{path}/{checkpoint.WEIGHTS}"
    with safe_open(file, framework="pt") as f:
        meta, sd = json.loads(f.metadata()[checkpoint.KEY]), {k: f.get_tensor(k) for k in f.keys()}
    assert meta["config"]["skip_visual"] is False
    fp = checkpoint.load(path, target=target).checkpoint_fingerprint["config"]  # with the field, written now
    del meta["config"]["skip_visual"]
    save_file(sd, file, metadata={checkpoint.KEY: json.dumps(meta)})
    checkpoint._said.clear()
    loaded = checkpoint.load(path, target=target)
    assert loaded.cfg.skip_visual is False and model.draft_kind(loaded.cfg) == "flat"
    assert loaded.checkpoint_fingerprint["config"] == fp
    assert "predates config field(s) skip_visual (loaded as False)" in capsys.readouterr().err
    assert loaded.checkpoint_fingerprint["config"] == checkpoint.config_hash(meta["config"])
    del meta["config"]["rope_mode"]  # a field that was always there is still required
    save_file(sd, file, metadata={checkpoint.KEY: json.dumps(meta)})
    with pytest.raises(ValueError, match=r"missing config field\(s\) \['rope_mode'\]"):
        checkpoint.load(path, target=target)


def test_the_drafts_cache_is_sized_for_what_it_holds():
    """speculate.new_cache sizes each model's cache from its prompt_slots: the history-only draft's from the 10 text
    tokens of the 26 prefilled (the prompt's last is decoded), the target's from all 26."""
    target = tiny_target()
    prompt = vla_prompts()["image+video"]
    assert speculate.new_cache(history_draft(target), prompt, 10, None).max_len == 10 + 10
    assert speculate.new_cache(target, prompt, 10, None).max_len == 26 + 10
