"""Input checks and NaN guards of the reader's path: what model.py and speculate.py refuse before a forward, and the
non-finite logits they name after one. None of it is the algorithm; each check says which input is wrong instead of
letting a bad shape fail deep in a forward, or a bad id or a NaN pass silently (an out-of-range stop token never
stops, argmax(NaN) emits token 0).

Paper: none (the guards around p, the target, and q, the draft).

run: python -m pytest -q tests/test_user_errors.py tests/test_speculate.py
"""
import contextlib

import torch

from rope import check_mrope_section


# ---- the models (model.py) ----
def check_config(c):
    """A bad shape would fail deep in a forward; a target with a reduced head would silently never emit V - K ids."""
    vm = getattr(c.vision, "spatial_merge_size", None)
    if c.head_dim is None:
        raise ValueError(f"hidden_size {c.hidden_size} is not divisible by n_heads {c.n_heads}")
    if c.n_heads % c.n_kv_heads:
        raise ValueError(f"n_heads {c.n_heads} is not divisible by n_kv_heads {c.n_kv_heads}")
    check_mrope_section(c.mrope_section, c.head_dim)
    if c.rope_mode not in ("mrope", "flat"):
        raise ValueError(f"rope_mode must be 'mrope' or 'flat', got {c.rope_mode!r}")
    if None not in (vm, c.spatial_merge_size) and vm != c.spatial_merge_size:
        raise ValueError(f"spatial_merge_size {c.spatial_merge_size} != vision.spatial_merge_size {vm}")
    K = c.draft_vocab
    if not isinstance(K, int) or isinstance(K, bool) or not 0 <= K <= c.vocab_size:
        raise ValueError(f"draft_vocab must be 0 (the full head) or a number of token ids 1..vocab_size "
                         f"{c.vocab_size}, got {K!r}")
    if c.skip_visual and c.shared_width is None:
        raise ValueError("skip_visual is for drafts only (shared_width set, model.make_draft): a target reads its "
                         "images")
    if K and c.shared_width is None:
        raise ValueError(f"draft_vocab {K}: a reduced-vocabulary head is for drafts only (shared_width set, "
                         "model.make_draft); a target's head must cover its whole vocabulary")


def check_vocab_ids(ids, vocab_size, k=None):
    """A reduced head's ids: 1..V distinct token ids (k when given); out-of-range ids would index garbage rows."""
    if ids.dim() != 1 or ids.dtype != torch.long:
        raise ValueError(f"vocab_ids must be a 1-D tensor of token ids (long), got shape {tuple(ids.shape)} "
                         f"dtype {ids.dtype}")
    if not 1 <= len(ids) <= vocab_size:
        raise ValueError(f"a reduced draft head covers 1..{vocab_size} token ids (the vocabulary), got {len(ids)}")
    if k is not None and len(ids) != k:
        raise ValueError(f"{len(ids)} vocab_ids for a head of draft_vocab {k}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"vocab_ids hold token id {lo if lo < 0 else hi}, outside the vocabulary 0..{vocab_size - 1}")
    if len(ids.unique()) != len(ids):
        raise ValueError(f"vocab_ids repeat token ids ({len(ids) - len(ids.unique())} duplicates)")


# ---- a decode's inputs and its logits (speculate.py) ----
def config_of(model):
    """A model's config: ours (VLA.cfg) or a Hugging Face model's (.config)."""
    return getattr(model, "cfg", None) or getattr(model, "config", None)


def check_inputs(target, draft, prompt, max_new_tokens, sampling, stop_token, samples, known_keys, sampling_type):
    """A bad prompt or setting would fail deep in a forward, or silently (a stop token out of range never stops).
    known_keys: the prompt keys speculate reads; sampling_type: speculate.Sampling."""
    if unknown := set(prompt) - set(known_keys) - {"attention_mask"}:
        raise ValueError(f"prompt has keys speculate does not understand: {sorted(unknown)}")
    ids, mask = prompt["input_ids"], prompt.get("attention_mask")
    if ids.dim() != 2 or ids.shape[0] < 1:
        raise ValueError(f"input_ids must be (rows, L), got {tuple(ids.shape)}")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ValueError(f"samples (rows per prompt) must be an int >= 1, got {samples!r}")
    real = ids.shape[1] if mask is None else mask.sum(-1).min()  # the shortest row's tokens
    if mask is not None and (tuple(mask.shape) != tuple(ids.shape) or not bool((mask.diff(dim=-1) >= 0).all())):
        raise ValueError(f"attention_mask {tuple(mask.shape)} must match input_ids {tuple(ids.shape)} and pad on the "
                         "left (each row's tokens at its end: its last token is decoded first)")
    if real < 2:  # an empty cache would make the model read the first decoded token as a prompt
        raise ValueError("each prompt row needs at least 2 tokens: all but the last are prefilled, the last is decoded")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(sampling, sampling_type):
        raise ValueError(f"sampling must be a speculate.Sampling, got {sampling!r}")
    cfg = config_of(target)
    # the held-back last token is decoded as text; an image placeholder there would split features from slots
    if {getattr(cfg, "image_token_id", None), getattr(cfg, "video_token_id", None)} & set(ids[:, -1].tolist()):
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
