"""Ours against a peer: the same weights, prompts and process through Hugging Face transformers' `generate` (greedy,
KV cache, sdpa) and its assisted generation (speculative decoding as transformers ships it), beside ours; the draft
is the M-RoPE replica (FlatRoPE has no transformers counterpart). The shipped toy's target and replica are exported as
Qwen2.5-VL folders (hf_export.export_pretrained) and loaded back by transformers. Timed one call per prompt, end to
end: greedy (`compare`; `hf_assisted` fixes gamma as ours, constant schedule, confidence threshold off;
`hf_assisted_defaults` keeps transformers' assistant defaults), or N sampled rows per prompt (`compare_samples`,
--samples N --temperature T). Paper: RSD accelerates the reasoning step; this times our decoders against the
library's own on the same weights (docs/results.md, "Against transformers").

run: OMP_NUM_THREADS=1 python experiments/peer_hf.py --device cpu --prompts 16 --repeats 5 --out PATH   (greedy)
     python experiments/peer_hf.py --device cpu --samples 6 --temperature 0.6 --top-p 0.98       (6 sampled rows)
"""
import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import driving  # noqa: E402
import evaluate  # noqa: E402
from ops import checkpoint, cli, files  # noqa: E402
from measure import flags, timing  # noqa: E402
from hf_export import export_pretrained  # noqa: E402
import speculate  # noqa: E402

PEER_DRAFT = ("mrope", 0)  # the draft both speculative arms use: the M-RoPE replica, seed 0
ARMS = ("ours_target_only", "ours_speculative", "hf_generate", "hf_assisted", "hf_assisted_defaults")
DEFAULTS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
# the `ratios` (ms/token of the first arm over the second's; > 1: ours faster), the first three also in CPU time
RATIOS = (("hf_generate", "ours_target_only"), ("hf_assisted", "ours_speculative"),
          ("hf_assisted_defaults", "ours_speculative"), ("hf_generate", "hf_assisted"),
          ("ours_target_only", "ours_speculative"))

# ---- the transformers side ----
def hf_inputs(prompt, cfg):
    """Our prompt dict (batch 1) -> transformers' generate inputs: the same tensors, an all-ones attention_mask, and
    mm_token_type_ids (1 image, 2 video placeholder), from which transformers 5 builds the M-RoPE positions."""
    ids = prompt["input_ids"]  # (1, L)
    out = {k: prompt[k] for k in speculate.EMBED_KEYS + speculate.GRID_KEYS if prompt.get(k) is not None}
    mm = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()  # (1, L)
    return dict(out, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm)


def hf_generate(model, inputs, max_new, stop, pad, assistant=None, settings=None):
    """transformers' greedy generate (assisted when `assistant` is given) -> the generated ids, the stop included."""
    for k, v in (settings or {}).items():  # on the assistant, shared by both assisted arms: set before each call
        setattr(assistant.generation_config, k, v)
    out = model.generate(**inputs, max_new_tokens=max_new, eos_token_id=stop, pad_token_id=pad, do_sample=False,
                         num_beams=1, use_cache=True, assistant_model=assistant)  # (1, L + T)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def hf_models(target, draft, stop, pad):
    """transformers' Qwen2.5-VL models of our target and draft, the same weights (exported to a temporary folder,
    loaded in the target's dtype and device, sdpa attention)."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    w = target.embed_tokens.weight
    with tempfile.TemporaryDirectory() as folder:
        export_pretrained(target, os.path.join(folder, "target"), eos_token_id=stop, pad_token_id=pad)
        export_pretrained(draft, os.path.join(folder, "draft"), target=target, eos_token_id=stop, pad_token_id=pad)
        return tuple(Qwen2_5_VLForConditionalGeneration.from_pretrained(
            os.path.join(folder, m), dtype=w.dtype, attn_implementation="sdpa").to(w.device).eval()
            for m in ("target", "draft"))


# ---- timing ----
def one_token_forward(target, hf_target, prompt, inputs, reps=20):
    """{"ours", "hf"}: ms of one cached one-token forward of each after the same prompt (the step both decode loops
    repeat), median of reps, the cache rolled back each time: model code apart from generation-loop code."""
    device, L = prompt["input_ids"].device, prompt["input_ids"].shape[1]
    x = prompt["input_ids"][:, -1:]  # (1, 1): any token; its value does not change the time
    cache = target.new_cache(max_len=L + 1)
    target(**{k: prompt[k] for k in inputs if k in prompt}, cache=cache, logits_to_keep=1)
    hf_cache = hf_target(**inputs, use_cache=True, logits_to_keep=1).cache  # also sets its M-RoPE rope_deltas

    def ours():
        target(x, cache=cache)
        cache.crop(L)

    def hf():
        hf_target(input_ids=x, cache=hf_cache, use_cache=True)
        hf_cache.crop(-1)

    return {name: 1e3 * timing.median_time(fn, device, reps) for name, fn in (("ours", ours), ("hf", hf))}


def time_calls(arms, prompts, device, repeats):
    """arms: name -> fn(i, prompt) -> (tokens, inner seconds or None). A warm-up call per arm and prompt, then
    timing.interleaved's `repeats` passes -> {name: {tokens (per prompt), ms_per_token, ms_per_prompt,
    inner_ms_per_token, cpu_ms_per_token (on a CPU: process time, which leaves out a shared CPU's waits)}}: medians."""
    tokens = {name: [fn(i, p)[0] for i, p in enumerate(prompts)] for name, fn in arms.items()}
    runs = timing.interleaved({name: lambda i, fn=fn: fn(i, prompts[i]) for name, fn in arms.items()}, len(prompts),
                              repeats, device, warmup=0)
    on_cpu, out = torch.device(device).type == "cpu", {}
    for name, passes in runs.items():
        per = []
        for p in passes:
            n, inner = sum(len(x.result[0]) for x in p), sum(x.result[1] or 0.0 for x in p)
            wall, cpu = sum(x.wall_s for x in p), sum(x.cpu_s for x in p)
            per.append({"ms_per_token": wall / n, "ms_per_prompt": wall / len(prompts)}
                       | ({"inner_ms_per_token": inner / n} if inner else {})
                       | ({"cpu_ms_per_token": cpu / n} if on_cpu else {}))
        out[name] = {"tokens": tokens[name], **{k: 1e3 * statistics.median(q[k] for q in per) for k in per[0]}}
    return out


@torch.inference_mode()
def compare(target, draft, prompts, gamma, max_new, stop, pad, repeats=3):
    """Our target-only and speculative decoding and transformers' generate and assisted
    generation, greedy, on the same weights (exported to a temporary folder, loaded in the target's dtype, device)."""
    import transformers  # an optional extra, as in the parity tests
    from transformers import GenerationConfig
    hf_target, hf_draft = hf_models(target, draft, stop, pad)
    inputs = [hf_inputs(p, target.cfg) for p in prompts]  # built once, outside the clock, as our prompts are
    settings = {"hf_assisted": {"num_assistant_tokens": gamma, "num_assistant_tokens_schedule": "constant",
                                "assistant_confidence_threshold": 0.0}, "hf_assisted_defaults": dict.fromkeys(DEFAULTS)}

    def ours(d):
        def fn(i, p):
            r = evaluate.decode(target, d, p, gamma, max_new, stop, timing=True)
            return r.tokens, r.prefill_s + r.decode_s
        return fn

    def hf(arm):
        assistant = hf_draft if arm != "hf_generate" else None
        return lambda i, p: (hf_generate(hf_target, inputs[i], max_new, stop, pad, assistant, settings.get(arm)), None)

    arms = {"ours_target_only": ours(None), "ours_speculative": ours(draft), **{arm: hf(arm) for arm in ARMS[2:]}}
    res = time_calls(arms, prompts, target.embed_tokens.weight.device, repeats)
    out = {arm: dict(r, tokens=sum(map(len, r["tokens"]))) for arm, r in res.items()}
    defaults = {k: GenerationConfig._get_default_generation_params()[k] for k in DEFAULTS}
    ratios = lambda key, pairs: {f"{a}_over_{b}": out[a][key] / out[b][key] for a, b in pairs}  # noqa: E731
    out.update(
        prompts=len(prompts), gamma=gamma, max_new=max_new, repeats=repeats, transformers=transformers.__version__,
        attn_implementation="sdpa", one_token_forward_ms=one_token_forward(target, hf_target, prompts[0], inputs[0]),
        timed="one call per prompt, end to end (vision tower + prefill + reasoning step), over the tokens generated",
        assistant={"hf_assisted": settings["hf_assisted"], "hf_assisted_defaults": defaults},
        greedy_match={f"{a}_vs_{b}": sum(x == y for x, y in zip(res[a]["tokens"], res[b]["tokens"])) for a, b in (
            ("hf_generate", "ours_target_only"), ("ours_speculative", "ours_target_only"),
            ("hf_assisted", "hf_generate"), ("hf_assisted_defaults", "hf_generate"))},
        ratios=ratios("ms_per_token", RATIOS))
    if "cpu_ms_per_token" in out["hf_generate"]:  # the same ratios in CPU time: what a busy machine does not inflate
        out["ratios_cpu_time"] = ratios("cpu_ms_per_token", RATIOS[:3])
    return out


@torch.inference_mode()
def compare_samples(target, draft, prompts, samples, sampling, gamma, max_new, stop, pad, repeats=3):
    """--samples N: each prompt's N sampled rows as one batch, ours (target-only and the chain,
    speculate's *_batch) beside transformers' generate(num_return_sequences=N, do_sample=True) at the same temperature
    and top-p, timed one call per prompt; and what transformers' assisted generation answers to N rows."""
    hf_target, hf_draft = hf_models(target, draft, stop, pad)
    inputs = [hf_inputs(p, target.cfg) for p in prompts]
    hf_kw = dict(do_sample=True, num_return_sequences=samples, max_new_tokens=max_new, eos_token_id=stop,
                 pad_token_id=pad, temperature=sampling.temperature, top_p=sampling.top_p or 1.0,
                 top_k=sampling.top_k or 0)

    def ours(d):
        def fn(i, p):
            s = sampling.offset(samples * i)  # prompt i's rows seeded seed + N i + r
            rows = (speculate.autoregressive_batch(target, p, max_new, samples, s, stop) if d is None
                    else speculate.speculative_batch(target, d, p, gamma, max_new, samples, s, stop))
            return [t for r in rows for t in r.tokens], None
        return fn

    def hf(i, p):
        out = hf_target.generate(**inputs[i], **hf_kw)[:, inputs[i]["input_ids"].shape[1]:]  # (N, T), padded
        return [t for row in out.tolist() for t in row[:row.index(stop) + 1 if stop in row else len(row)]], None

    res = time_calls({"ours_target_only": ours(None), "ours_speculative": ours(draft), "hf_generate": hf}, prompts,
                     target.embed_tokens.weight.device, repeats)
    try:
        hf_target.generate(**inputs[0], **hf_kw, assistant_model=hf_draft)
        assisted = "ran"
    except ValueError as e:  # what transformers says to N rows
        assisted = f"refused: {e}"
    out = {arm: {k: v for k, v in r.items() if k != "tokens"} | {"tokens": sum(map(len, r["tokens"]))}
           for arm, r in res.items()}
    return dict(out, prompts=len(prompts), samples=samples, gamma=gamma, decoding=flags.sampling_json(sampling),
                hf_assisted=assisted,
                timed="one call per prompt of its N rows, end to end (vision tower + prefill + reasoning step)",
                ratios={f"{a}_over_{b}": out[a]["ms_per_prompt"] / out[b]["ms_per_prompt"] for a, b in
                        (("hf_generate", "ours_target_only"), ("ours_target_only", "ours_speculative"))})


def report_lines(peers, dtype):
    if "samples" in peers:  # --samples: the rows of a prompt as one batch
        r = peers["ratios"]
        return [f"peers          transformers on the same weights, {peers['prompts']} prompts x {peers['samples']} "
                f"sampled rows as one batch, end to end per call"] + [
                f"  {arm:<21} {peers[arm]['ms_per_prompt']:.1f} ms per prompt's rows   {peers[arm]['tokens']} tokens"
                for arm in ("ours_target_only", "ours_speculative", "hf_generate")] + [
                f"  generate(num_return_sequences) over ours target-only {r['hf_generate_over_ours_target_only']:.2f}x"
                f"; ours speculative over ours target-only {r['ours_target_only_over_ours_speculative']:.2f}x",
                f"  transformers' assisted generation with {peers['samples']} rows: {peers['hf_assisted']}"]
    n, g, r = peers["prompts"], peers["greedy_match"], peers["ratios"]
    lines = [f"peers          transformers {peers['transformers']} (sdpa, dynamic cache) on the same weights, "
             f"{n} prompts, end to end per call (vision + prefill + reasoning), draft: the M-RoPE replica, gamma "
             f"{peers['gamma']}"]
    for arm in ARMS:
        a = peers[arm]
        cpu = f"   CPU time {a['cpu_ms_per_token']:.3f} ms/token" if "cpu_ms_per_token" in a else ""
        inner = f"   (prefill + decode alone {a['inner_ms_per_token']:.3f})" if "inner_ms_per_token" in a else ""
        lines.append(f"  {arm:<21} {a['ms_per_token']:.3f} ms/token   {a['ms_per_prompt']:.1f} ms/prompt   "
                     f"{a['tokens']} tokens{cpu}{inner}")
    lines += [f"  ours over transformers (its ms/token over ours; > 1: ours faster): target-only vs generate "
              f"{r['hf_generate_over_ours_target_only']:.2f}x, speculative vs assisted "
              f"{r['hf_assisted_over_ours_speculative']:.2f}x (gamma fixed), "
              f"{r['hf_assisted_defaults_over_ours_speculative']:.2f}x (its assistant defaults)"
              + ("" if "ratios_cpu_time" not in peers else "; in CPU time {:.2f}x, {:.2f}x, {:.2f}x".format(
                  *peers["ratios_cpu_time"].values())),
              "  one cached one-token forward of the target (the decode step, no loop): ours {ours:.3f} ms, "
              "transformers {hf:.3f} ms".format(**peers["one_token_forward_ms"]),
              f"  greedy tokens: transformers' generate = ours target-only on "
              f"{g['hf_generate_vs_ours_target_only']} of {n} prompts; its assisted = its generate on "
              f"{g['hf_assisted_vs_hf_generate']} (gamma fixed) and {g['hf_assisted_defaults_vs_hf_generate']} "
              f"(defaults); ours speculative = ours target-only on {g['ours_speculative_vs_ours_target_only']}"
              + ("" if dtype == "fp32" else f"; in {dtype} two implementations can part at near-ties")]
    return lines


# ---- the flags ----
def check_flags(ap, args):
    """Every bad flag is one line before any work; returns the Sampling."""
    if min(args.gamma, args.max_new, args.prompts, args.samples) < 1 or args.repeats < 3:
        ap.error("--gamma, --max-new, --prompts and --samples must be >= 1, --repeats >= 3")
    with cli.user_errors(ap):
        cli.check_device(args.device)
        sampling = flags.sampling(args.temperature, args.top_k, args.top_p, args.sampling_seed)
        if not sampling.greedy and args.samples == 1:
            raise ValueError("greedy compares tokens and times: drop --temperature (or sample rows: --samples N)")
        if args.samples > 1 and sampling.greedy:
            raise ValueError("--samples N compares sampled rows: give --temperature (the release's 0.6, --top-p 0.98)")
        if importlib.util.find_spec("transformers") is None:
            raise ValueError("the peer is transformers: pip install -r requirements-test.txt")
        missing = [d for d in (os.path.join(args.run, "target"), checkpoint.draft_dir(args.run, *PEER_DRAFT))
                   if not os.path.isdir(d)]
        if missing:
            raise ValueError(f"no toy checkpoints (missing {', '.join(missing)}): use the shipped checkpoints/toy")
        cli.check_values(args, [(cli.VIEWS_RULE, ("views",))], flags=True)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1 (omit it for torch's default), got {args.threads}")
        if args.out:  # the report's file, before any work
            cli.check_out(args.out)
    return sampling


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description="Ours beside transformers' generate and assisted generation, the toy.")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="bf16", choices=sorted(cli.DTYPES), help="weights, activations and KV cache")
    ap.add_argument("--run", default=checkpoint.SHIPPED, help="toy checkpoints folder (default: the shipped ones)")
    for flag, default, text in (("--gamma", evaluate.GAMMA, "the draft length of both speculative arms"),
                                ("--max-new", evaluate.MAX_NEW_TOKENS, "reasoning tokens per prompt at most"),
                                ("--prompts", 32, "held-out test scenes"),
                                ("--views", driving.WorldConfig().views, "surround views per prompt"),
                                ("--samples", 1, "rows per prompt, sampled, one call each (with --temperature)"),
                                ("--repeats", 3, "timed passes (median reported), >= 3"),
                                ("--threads", None, "CPU threads (default: torch's)")):
        ap.add_argument(flag, type=int, default=default, help=text)
    flags.add_decoding_flags(ap, "> 0 with --samples N: N sampled rows per prompt (Alpamayo-R1: 0.6, top-p 0.98)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--out", help="write the report's JSON here")
    args = ap.parse_args(argv)
    sampling = check_flags(ap, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), cli.DTYPES[args.dtype]
    torch.manual_seed(0)
    tok, draft_dir = driving.Tokenizer(), checkpoint.draft_dir(args.run, *PEER_DRAFT)
    target = checkpoint.load(os.path.join(args.run, "target"), dtype=dtype, device=device).eval()
    draft = checkpoint.load(draft_dir, target=target).eval()  # in the target's dtype: they share embedding and head
    prompts = evaluate.scene_prompts(driving.make_split("test", args.prompts, seed=0), tok, device, dtype, args.views)
    stop, pad = tok.cot_end_id, tok.pad_id
    cli.progress(f"ours beside transformers on {args.prompts} prompts, {args.repeats} passes")
    with cli.json_stdout(args.json):
        res = compare(target, draft, prompts, args.gamma, args.max_new, stop, pad, args.repeats) if args.samples == 1 \
            else compare_samples(target, draft, prompts, args.samples, sampling, args.gamma, args.max_new, stop, pad,
                                 args.repeats)
    res.update(draft=draft_dir, device=str(device), dtype=args.dtype, threads=torch.get_num_threads(),
               hardware=torch.cuda.get_device_name(device) if device.type == "cuda" else
               (platform.processor() or platform.machine()), torch=torch.__version__,
               environment=timing.environment(device))
    with cli.json_stdout(args.json):
        print("\n".join(report_lines(res, args.dtype)))  # printed first: a failing write below loses no measurement
    if args.json:
        print(json.dumps(res))
    if args.out:
        with cli.user_errors(ap):
            files.write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
