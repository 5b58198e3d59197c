"""Alpamayo-R1 end to end on a tiny random Alpamayo-shaped folder (Qwen3-VL with DeepStack under
'vlm.', the action expert's decoder, action projections, nested config, a tiny tokenizer and image
processor): the expert's decoder against transformers' Qwen3-VL text model on the same KV cache,
every key loaded, 64 waypoints, the Euler flow and the unicycle, the history tokenizer, the prompt
through the folder's tokenizer and image processor, speculative decoding with DeepStack, and
`bench.py --target` on pixels.

Parity: fp32, O(1)-scale weights, max |diff| <= 1e-4.
run: python -m pytest -q tests/test_alpamayo.py
"""
import copy
import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file
import torch

import bench
import evaluate
from model import make_draft
from real import alpamayo
from real.alpamayo import HistoryTokenizer, build_prompt
from real.expert import ExpertConfig, unicycle
from real.hf import load_pretrained
import speculate
from tiny_models import IMG, VE, VID, VS, hf_qwen3, mm_token_type_ids, o1_init, qwen3_prompt

tf = pytest.importorskip("transformers")

PARITY_TOL = 1e-4
MEASURED = {}
N_WP, DE, HIN, NF = 64, 48, 24, 8  # waypoints, expert width, input-projection width, Fourier features
TRAJ_START, FUTURE_BINS, HIST_BINS = 40, 8, 16  # history bin b is vocabulary id 48 + b
SPECIAL = {"<|im_start|>": 0, "<|im_end|>": 1, "[UNK]": 2, "<|traj_history_start|>": 64, "<|traj_history|>": 65,
           "<|traj_history_end|>": 66, "<|cot_start|>": 67, "<|cot_end|>": 68, "<|traj_future_start|>": 69,
           "<|vision_start|>": VS, "<|vision_end|>": VE, "<|image_pad|>": IMG, "<|video_pad|>": VID}
WORDS = ["system", "user", "assistant", "keep", "lane", "because", "clear", "ahead"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% if not loop.last %}<|im_end|> {% endif %}{% endfor %}")


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module", autouse=True)
def report():
    # one thread: tiny matrices gain nothing from two, and lose a lot when the cores are shared
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if MEASURED:
        print("\nparity max|diff|:", {k: f"{v:.2e}" for k, v in MEASURED.items()})


def save_processor(d):
    """A word-level tokenizer with Alpamayo's tokens at fixed ids and a Qwen-VL image processor (patch 2,
    temporal patch 2, merge 2, mean / std 0.5), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    vocab = dict(SPECIAL, **{w: 3 + i for i, w in enumerate(WORDS)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]",
                                     additional_special_tokens=[t for t in SPECIAL if t != "[UNK]"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3).save_pretrained(d)


def projection_weights(g):
    """Alpamayo's action projections by their checkpoint names, random O(1) weights; the Fourier
    frequencies stored as a release saved with persistent buffers would hold them."""
    r = lambda *s: torch.randn(*s, generator=g) / (s[-1] ** 0.5 if len(s) > 1 else 1)  # noqa: E731
    freqs = torch.logspace(0, 2, NF // 2)[None]  # (1, F/2): max_freq 100
    return {"action_in_proj.sinus.0.freqs": freqs, "action_in_proj.sinus.1.freqs": freqs.clone(),
            "action_in_proj.timestep_fourier_encoder.freqs": freqs.clone(),
            "action_in_proj.encoder.trunk.0.weight": r(HIN, 3 * NF), "action_in_proj.encoder.trunk.0.bias": r(HIN),
            "action_in_proj.encoder.trunk.2.weight": 1 + 0.2 * r(HIN),
            "action_in_proj.encoder.trunk.3.weight": r(HIN, HIN), "action_in_proj.encoder.trunk.3.bias": r(HIN),
            "action_in_proj.encoder.trunk.5.weight": 1 + 0.2 * r(HIN),
            "action_in_proj.encoder.trunk.6.weight": r(DE, HIN), "action_in_proj.encoder.trunk.6.bias": r(DE),
            "action_in_proj.norm.weight": 1 + 0.2 * r(DE), "action_in_proj.norm.bias": r(DE),
            "action_out_proj.weight": r(2, DE), "action_out_proj.bias": r(2)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(transformers VLM, transformers expert text model, folder): VLM under 'vlm.', the expert's
    decoder (the VLM's 3 layers and KV heads at width 48) under 'expert.', the projections, config."""
    d = tmp_path_factory.mktemp("alpamayo")
    hf = hf_qwen3()
    vlm_dir = tmp_path_factory.mktemp("vlm")
    hf.save_pretrained(vlm_dir)
    ecfg = copy.deepcopy(hf.config.text_config)  # Alpamayo: the VLM's text config, width overridden
    for k, v in dict(hidden_size=DE, num_attention_heads=4, intermediate_size=80).items():
        setattr(ecfg, k, v)
    ecfg._attn_implementation = "eager"
    torch.manual_seed(1)
    hfx = o1_init(tf.Qwen3VLTextModel(ecfg).eval(), seed=5)
    sd = {"vlm." + k: v for k, v in load_file(os.path.join(vlm_dir, "model.safetensors")).items()}
    sd.update({"expert." + k: v for k, v in hfx.state_dict().items() if not k.startswith("embed_tokens")})
    sd.update(projection_weights(torch.Generator().manual_seed(7)))
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"))
    config = {"model_type": "alpamayo_r1", "vlm_name_or_path": "Qwen/Qwen3-VL-8B-Instruct", "vocab_size": 97,
              "vlm_config": json.load(open(os.path.join(vlm_dir, "config.json"))),
              "expert_cfg": {"hidden_size": DE, "num_attention_heads": 4, "intermediate_size": 80, "head_dim": 16},
              "action_space_cfg": {"n_waypoints": N_WP, "dt": 0.1, "accel_mean": 0.03, "accel_std": 0.7,
                                   "curvature_mean": 3e-4, "curvature_std": 0.026},
              "action_in_proj_cfg": {"hidden_size": HIN, "num_enc_layers": 2, "max_freq": 100.0,
                                     "num_fourier_feats": NF},
              "diffusion_cfg": {"num_inference_steps": 10, "int_method": "euler"}, "expert_non_causal_attention": True,
              "traj_token_start_idx": TRAJ_START, "traj_tokenizer_cfg": {"num_bins": FUTURE_BINS},
              "hist_traj_tokenizer_cfg": {"num_bins": HIST_BINS},
              "traj_token_ids": {"history": SPECIAL["<|traj_history|>"],
                                 "future_start": SPECIAL["<|traj_future_start|>"]}}
    json.dump(config, open(os.path.join(d, "config.json"), "w"))
    save_processor(d)
    return hf, hfx, d


@pytest.fixture(scope="module")
def model(folder):
    return load_pretrained(folder[2])


def edited(src, dst, edit_cfg=None, edit_sd=None):
    shutil.copytree(src, dst)
    if edit_cfg:
        cfg = json.load(open(os.path.join(dst, "config.json")))
        edit_cfg(cfg)
        json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    if edit_sd:
        sd = load_file(os.path.join(dst, "model.safetensors"))
        edit_sd(sd)
        save_file(sd, os.path.join(dst, "model.safetensors"))
    return dst


# ---- loading ----


def test_every_key_loads_and_a_plan_has_64_waypoints(folder, model):
    _, _, d = folder
    stored = load_file(os.path.join(d, "model.safetensors"))
    ours = model.state_dict()
    assert model.traj_head is None and model.expert.cfg.n_waypoints == N_WP
    # every stored tensor is a weight of ours except the 3 Fourier frequency rows, which the config fixes
    fused = sum(2 for k in ours if k.endswith("self_attn.qkv.weight"))  # q/k/v are one tensor in ours
    fused += sum(k.endswith("mlp.gate_up.weight") for k in ours)  # and gate/up
    assert len(stored) - 3 == len(ours) + fused
    assert torch.equal(ours["expert.action_out_proj.weight"], stored["action_out_proj.weight"])
    q = stored["expert.layers.2.self_attn.q_proj.weight"]
    assert torch.equal(ours["expert.layers.2.self_attn.qkv.weight"][:q.shape[0]], q)
    with torch.no_grad():
        cache = model.new_cache(max_len=64 + N_WP)
        model(**qwen3_prompt(), cache=cache)
        model(torch.tensor([[SPECIAL["<|traj_future_start|>"]]]), cache=cache)
        L = cache.length
        plan = model.expert(cache, torch.tensor([6.0]), generator=torch.Generator().manual_seed(0))
        again = model.expert(cache, torch.tensor([6.0]), generator=torch.Generator().manual_seed(0))
    assert plan.shape == (1, N_WP, 2) and torch.isfinite(plan).all() and torch.equal(plan, again)
    assert cache.length == L  # the expert leaves the cache as it found it


def test_missing_config_field_and_keys_are_named(folder, tmp_path):
    _, _, d = folder
    with pytest.raises(ValueError, match=r"missing Alpamayo config field 'action_space_cfg.accel_std'"):
        load_pretrained(edited(d, tmp_path / "a", edit_cfg=lambda c: c["action_space_cfg"].pop("accel_std")))
    with pytest.raises(ValueError, match=r"missing 1 \['expert.action_in_proj.norm.bias'\]"):
        load_pretrained(edited(d, tmp_path / "b", edit_sd=lambda sd: sd.pop("action_in_proj.norm.bias")))

    def stray(sd):
        sd["action_out_proj.scale"] = torch.ones(2)
    with pytest.raises(ValueError, match=r"unexpected 1 \['expert.action_out_proj.scale'\]"):
        load_pretrained(edited(d, tmp_path / "c", edit_sd=stray))

    def freqs(sd):
        sd["action_in_proj.sinus.1.freqs"] = sd["action_in_proj.sinus.1.freqs"] * 2
    with pytest.raises(ValueError, match=r"'action_in_proj.sinus.1.freqs' holds Fourier frequencies"):
        load_pretrained(edited(d, tmp_path / "e", edit_sd=freqs))
    with pytest.raises(ValueError, match=r"expert_cfg.num_key_value_heads = 4 but the VLM has 2"):
        load_pretrained(edited(d, tmp_path / "f", edit_cfg=lambda c: c["expert_cfg"].update(num_key_value_heads=4)))


# ---- the expert ----


@torch.no_grad()
def test_expert_decoder_matches_transformers_on_the_same_cache(folder, model):
    """Our expert layers over our VLM cache vs transformers' Qwen3-VL text model of the expert's sizes
    over transformers' VLM cache, action tokens at the positions after the prompt, all visible."""
    hf, hfx, _ = folder
    prompt = qwen3_prompt(seed=2)
    L = prompt["input_ids"].shape[1]
    cache = model.new_cache(max_len=L + N_WP)
    model(**prompt, cache=cache)
    ref_cache = hf(**prompt, mm_token_type_ids=mm_token_type_ids(prompt["input_ids"]), use_cache=True).past_key_values
    h = torch.randn(1, N_WP, DE, generator=torch.Generator().manual_seed(3))
    pos = (torch.arange(N_WP) + L + hf.model.rope_deltas).view(1, 1, N_WP).expand(3, 1, N_WP)  # (3, 1, N)
    visible = torch.zeros(1, 1, N_WP, L + N_WP)  # additive mask: every cached key and every action token
    ref = hfx(inputs_embeds=h, position_ids=pos, attention_mask=visible, cache=ref_cache).last_hidden_state
    ours = model.expert.stack(h, cache)
    MEASURED["expert decoder vs Qwen3-VL text model"] = diff = max_diff(ours, ref)
    assert ref.abs().mean() > 0.3 and diff <= PARITY_TOL, diff
    # bidirectional: the first action token reads the last one
    h2 = h.clone()
    h2[:, -1] += 1
    assert max_diff(model.expert.stack(h2, cache)[:, 0], ours[:, 0]) > 1e-3


def test_euler_flow_runs_from_noise_to_data(model, monkeypatch):
    """With the exact velocity of a straight path (x1 - noise), 10 Euler steps from t = 0 land on x1."""
    x1 = torch.randn(1, N_WP, 2, generator=torch.Generator().manual_seed(4))
    seen = []

    def velocity(x, t, cache):
        seen.append((x.clone(), t.clone()))
        return x1 - seen[0][0]
    monkeypatch.setattr(model.expert, "velocity", velocity)
    cache = model.new_cache(max_len=8)
    out = model.expert.sample(cache, generator=torch.Generator().manual_seed(5))
    assert max_diff(out, x1) < 1e-5 and [round(float(t), 6) for _, t in seen] == [k / 10 for k in range(10)]


def test_the_rotary_frequencies_are_built_once_per_device(model, monkeypatch):
    """The expert's rotary table is built once per device, not at every Euler step (on CUDA a CPU build and copy per
    step is a host sync inside the timed action stage); the plan is unchanged."""
    from real import expert
    builds, build = [], expert.rope_inv_freq
    monkeypatch.setattr(expert, "rope_inv_freq", lambda *a: builds.append(a) or build(*a))
    model.expert._inv_freq.clear()
    with torch.no_grad():
        cache = model.new_cache(max_len=64 + N_WP)
        model(**qwen3_prompt(), cache=cache)
        model(torch.tensor([[SPECIAL["<|traj_future_start|>"]]]), cache=cache)
        plans = [model.expert(cache, torch.tensor([6.0]), generator=torch.Generator().manual_seed(0))
                 for _ in range(2)]  # 2 plans x 10 Euler steps
    assert len(builds) == 1, len(builds)
    c = model.expert.layer_cfg
    assert torch.equal(model.expert.inv_freq(torch.device("cpu")), build(c.head_dim, c.rope_theta))
    assert torch.equal(plans[0], plans[1])


def test_unicycle_straight_line_and_circle():
    cfg = ExpertConfig(n_waypoints=N_WP, accel_mean=0.0, accel_std=1.0, curvature_mean=0.0, curvature_std=1.0)
    v0 = torch.tensor([5.0])
    straight = unicycle(torch.zeros(1, N_WP, 2), v0, cfg)
    t = 0.1 * torch.arange(1, N_WP + 1)
    assert max_diff(straight[0, :, 0], 5.0 * t) < 1e-4 and straight[0, :, 1].abs().max() < 1e-6
    kappa = 0.05  # radius 20 m, turning left: the centre is at (0, 20)
    arc = unicycle(torch.tensor([0.0, kappa]).expand(1, N_WP, 2), v0, cfg)
    radius = (arc[0] - torch.tensor([0.0, 20.0])).norm(dim=-1)
    assert (radius - 20).abs().max() < 0.02 and arc[0, -1, 1] > 10
    # normalisation from config: a = 0.5 * 2 + 1 = 2 m/s^2 -> v0 t + t^2
    cfg2 = ExpertConfig(n_waypoints=N_WP, accel_mean=1.0, accel_std=2.0, curvature_mean=0.0, curvature_std=1.0)
    acc = unicycle(torch.tensor([0.5, 0.0]).expand(1, N_WP, 2), v0, cfg2)
    assert max_diff(acc[0, :, 0], 5.0 * t + t ** 2) < 1e-3


# ---- history tokens and the prompt ----


def test_history_tokenizer_bins_per_step_deltas():
    hist = HistoryTokenizer(first_id=48, num_bins=16)
    xyz = alpamayo.history_poses(speed=8.0)  # 0.8 m per step along x, the oldest pose at x = -12 m
    ids = hist.encode(xyz[None])[0]
    assert ids.shape == (48,)
    # first delta: the oldest pose from the origin (-12, 0, 0): x saturates at bin 0; y, z in the middle
    assert ids[:3].tolist() == [48 + 0, 48 + 8, 48 + 8]
    # then (0.8, 0, 0): x bin round((0.8 + 4) / 8 * 15) = 9
    assert ids[3:].view(15, 3).tolist() == [[48 + 9, 48 + 8, 48 + 8]] * 15


@torch.no_grad()
def test_prompt_through_the_folders_tokenizer_and_image_processor(folder, model, tmp_path):
    _, _, d = folder
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 24, 40), dtype=torch.uint8, generator=g) for _ in range(16)]
    p = build_prompt(d, images, alpamayo.history_poses(), min_pixels=64, max_pixels=256)
    ids = p["input_ids"][0].tolist()
    n_img = (p["image_grid_thw"].prod(-1) // 4).tolist()
    assert len(n_img) == 16 and ids.count(IMG) == sum(n_img) and ids.count(VS) == 16
    h0 = ids.index(SPECIAL["<|traj_history_start|>"])
    assert ids[h0 + 49] == SPECIAL["<|traj_history_end|>"]
    assert ids[h0 + 1:h0 + 49] == HistoryTokenizer(first_id=TRAJ_START + FUTURE_BINS, num_bins=HIST_BINS).encode(
        alpamayo.history_poses()[None])[0].tolist()
    assert ids[0] == SPECIAL["<|im_start|>"] and ids[-1] == SPECIAL["<|cot_start|>"] and ids.index(VS) < h0
    logits = model(**p)
    assert torch.isfinite(logits).all()

    def wrong(c):
        c["traj_token_ids"]["future_start"] = 70
    with pytest.raises(ValueError, match=r"traj_token_ids.future_start = 70 but the tokenizer"):
        build_prompt(edited(d, tmp_path / "w", edit_cfg=wrong), images, alpamayo.history_poses())


# ---- the reasoning step with DeepStack, and the benchmark ----


@torch.no_grad()
def test_greedy_decoding_with_deepstack_matches_transformers(folder, model):
    """speculate's prefill hands DeepStack to the target: its greedy CoC is transformers' argmax
    teacher-forced, and speculative decoding with a draft emits the same tokens."""
    hf, _, _ = folder
    prompt = qwen3_prompt(seed=6, text_after=(7, SPECIAL["<|cot_start|>"]))
    ar = speculate.autoregressive(model, prompt, 6)
    ids = torch.cat([prompt["input_ids"], torch.tensor([ar.tokens[:-1]])], 1)
    ref = hf(**dict(prompt, input_ids=ids), mm_token_type_ids=mm_token_type_ids(ids)).logits
    assert ref[0, -6:].argmax(-1).tolist() == ar.tokens
    draft = make_draft(model, n_layers=1)
    assert speculate.speculative(model, draft, prompt, 3, 6).tokens == ar.tokens


def test_bench_target_runs_the_plan_on_pixels(folder, tmp_path, capsys):
    from PIL import Image
    _, _, d = folder
    os.makedirs(tmp_path / "cams")
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        px = torch.randint(0, 256, (20, 28, 3), dtype=torch.uint8, generator=g)
        Image.fromarray(px.numpy()).save(tmp_path / "cams" / f"cam{i}.png")
    common = ["real", "--target", str(d), "--dtype", "fp32", "--max-new", "8", "--gamma", "2", "--repeats", "3",
              "--min-pixels", "64", "--max-pixels", "256", "--threads", "1", "--json"]  # 8: the default tree's depth
    res = bench.main(common + ["--images-dir", str(tmp_path / "cams")])
    out = "".join(capsys.readouterr()[::-1])  # stderr (--json: the report), stdout
    assert "plan timings   prefill (vision tower + prompt)" in out and "trajectory (action expert)" in out
    assert res["prompt_source"].startswith("Alpamayo-R1 prompt") and res["images"] == 4
    assert len(res["waypoints"]) == N_WP and res["trajectory_ms"] > 0
    assert all(res["arms"][a][k] > 0 for a in ("target-only", "speculative") for k in ("prefill_ms", "ms_per_token"))
    assert res["greedy_match"]
    # no tokenizer: generated images in the prompt's layout, same three timings
    os.makedirs(tmp_path / "none")
    res = bench.main(common + ["--images", "2", "--image-size", "16x24", "--processor", str(tmp_path / "none")])
    assert res["prompt_source"].startswith("placeholder") and len(res["waypoints"]) == N_WP
    assert f"no tokenizer in {tmp_path / 'none'}" in res["prompt_source"]  # the cause, named


def test_the_expert_over_rows_of_their_own_lengths_equals_each_rows_plan(model):
    """evaluate.action_rows: three sampled rows of one prompt with CoCs of 1, 3 and 5 tokens, teacher-forced in one
    right-padded step, the expert over all three under the per-row mask: each row's waypoints equal that CoC's plan
    alone (batch 1, no padding). In fp64: this random expert turns a 1e-6 change of its cache into ~0.2 m of waypoints
    (ten Euler steps, then the unicycle's double integration), so fp32 rounding of a batched matmul would not compare."""
    model = copy.deepcopy(model).double()
    prompt, fs = qwen3_prompt(), SPECIAL["<|traj_future_start|>"]
    prompt = {k: v.double() if v.is_floating_point() else v for k, v in prompt.items()}
    cocs = [[fs], [7, 8, fs], [9, 10, 11, 12, fs]]
    v0 = torch.tensor([6.0, 6.0, 6.0], dtype=torch.float64)
    rows = evaluate.action_rows(model, prompt, cocs, (fs,), v0)[0]  # (3, N, 2)
    for r, coc in enumerate(cocs):
        one = evaluate.action_rows(model, prompt, [coc], (fs,), v0[:1])[0]  # (1, N, 2)
        torch.testing.assert_close(rows[r:r + 1], one, atol=1e-6, rtol=1e-6)


def test_bench_target_samples_six_plans_through_the_expert(folder, tmp_path, capsys):
    """--samples 6 at the release's --temperature 0.6 --top-p 0.98: one scene's six sampled CoCs on pixels decoded as
    one batch (chain and target-only in the same passes), then the action expert over all six rows."""
    _, _, d = folder
    os.makedirs(tmp_path / "none")
    res = bench.main(["real", "--target", str(d), "--dtype", "fp32", "--max-new", "6", "--gamma", "2", "--repeats", "3",
                      "--images", "2", "--image-size", "16x24", "--processor", str(tmp_path / "none"), "--threads",
                      "1", "--samples", "6", "--temperature", "0.6", "--top-p", "0.98", "--tree", "0", "--json"])
    p = res["plan"]
    assert p["rows"] == 6 and len(p["arms"]["speculative"]["tau_per_row"]) == 6 and len(p["cocs"]) == 6
    assert len(p["waypoints"]) == 6 and all(len(w) == N_WP for w in p["waypoints"]) and p["action_ms"] > 0
    assert "the action expert (toy: trajectory head) over all rows" in "".join(capsys.readouterr())
