"""What the history-only routine reasoner saves per plan: its prefill and its KV cache leave the image / video tokens
out (model.DRAFT_KINDS["history"]), so both shrink with the visual share of the prompt. Measured beside the FlatRoPE
draft (the paper's routine reasoner, which reads every visual token) on the same prompts, both arms interleaved in
one process (measure.timing.interleaved): the draft's prefill alone (the target's embeddings given, as in a decode), its
cache length after the prefill and the KV bytes that length holds.

  toy:     the shipped target and seed 0's FlatRoPE and history-only drafts, held-out test scenes (fp32)
  preset:  Alpamayo-R1's backbone shape (qwen3-vl-8b: 4096 wide; a one-layer draft as the paper's), random weights,
           real.alpamayo.real_prompt's geometry (16 camera images of 180 merged tokens, 48 history tokens)

run: python experiments/history_prefill.py [--out runs/history_prefill.json]
     (the README's numbers: --out experiments/history_prefill.json)
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import driving  # noqa: E402
from driving import Data  # noqa: E402
import evaluate  # noqa: E402
import model as M  # noqa: E402
from ops import checkpoint, cli, files  # noqa: E402
from measure import timing  # noqa: E402
from real.alpamayo import real_prompt  # noqa: E402
import speculate  # noqa: E402


def kv_bytes(draft, slots):
    c = draft.cfg
    return slots * c.n_layers * 2 * c.n_kv_heads * c.head_dim * draft.layers[0].self_attn.qkv.weight.element_size()


@torch.no_grad()
def measure(target, drafts, prompts, repeats):
    """{kind: {prefill_ms (median over prompts and passes), cache_slots, cache_kb}}: each draft's prefill of each
    prompt (the target's embeddings computed once, outside the clock), the arms interleaved."""
    embedded = [speculate.embed_prompt(target, p)[0] for p in prompts]  # (1, L, D) each

    def arm(draft):
        def run(i):
            cache = speculate.new_cache(draft, prompts[i], 1, None)
            speculate.prefill(draft, prompts[i], embedded[i], cache)
            return cache.lengths[0]
        return run

    runs = timing.interleaved({k: arm(d) for k, d in drafts.items()}, len(prompts), repeats, "cpu")
    out = {}
    for k, passes in runs.items():
        slots = statistics.mean(r.result for p in passes for r in p)
        out[k] = {"prefill_ms": 1e3 * statistics.median(r.wall_s for p in passes for r in p),
                  "prefill_cpu_ms": 1e3 * statistics.median(r.cpu_s for p in passes for r in p),
                  "cache_slots": slots, "cache_kb": kv_bytes(drafts[k], slots) / 1024}
    out["saved"] = {"prefill_time": 1 - out["history"]["prefill_ms"] / out["flat"]["prefill_ms"],
                    "cache": 1 - out["history"]["cache_slots"] / out["flat"]["cache_slots"]}
    return out


def toy(run, history, n, repeats):
    target = checkpoint.load(os.path.join(run, "target")).eval()
    drafts = {"flat": checkpoint.load(checkpoint.draft_dir(run, "flat", 0), target=target).eval(),
              "history": checkpoint.load(history, target=target).eval()}
    test = Data("test", n, 0, driving.Tokenizer())
    prompts = evaluate.scene_prompts(test.scenes, test.tok, "cpu", views=test.views_at(0))
    ids = prompts[0]["input_ids"]
    return {"prompt_tokens": ids.shape[1], "visual_tokens": int(target.visual_tokens(ids).sum()), "scenes": n,
            **measure(target, drafts, prompts, repeats)}


def preset(name, repeats):
    """One target layer (only the draft's prefill is timed; the target only lends its embedding and LM head)."""
    cfg = M.PRESETS[name]
    torch.manual_seed(0)
    target = M.VLA(M.ModelConfig(**{**cfg.to_dict(), "n_layers": 1, "vision": None})).eval()
    drafts = {k: M.make_draft(target, n_layers=1, kind=k).eval() for k in ("flat", "history")}
    prompt = real_prompt(target.cfg, "cpu")
    ids = prompt["input_ids"]
    return {"preset": name, "prompt_tokens": ids.shape[1], "visual_tokens": int(target.visual_tokens(ids).sum()),
            **measure(target, drafts, [prompt], repeats)}


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default=checkpoint.SHIPPED, help="the toy's run folder (target, draft_flat_s0)")
    ap.add_argument("--history", default=None, help="the history-only draft (default RUN/draft_history_s0)")
    ap.add_argument("--scenes", type=int, default=16, help="held-out toy scenes prefilled")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes over them (toy; the preset: 3)")
    ap.add_argument("--preset", default="qwen3-vl-8b", choices=[k for k in M.PRESETS if "toy" not in k],
                    help="the real shape's preset (random weights); Alpamayo-R1's backbone is Qwen3-VL-8B")
    ap.add_argument("--out", default="runs/history_prefill.json", help="the JSON written")
    a = cli.checked(ap, ap.parse_args(argv), counts=("scenes", "repeats"), out="runs/history_prefill.json")
    cli.progress(f"the draft prefills: {a.scenes} toy scenes, then one {a.preset}-shaped prompt")
    with cli.user_errors(ap):
        res = {"command": "python experiments/history_prefill.py " + " ".join(argv or sys.argv[1:]),
               "environment": timing.environment("cpu") | {"threads": torch.get_num_threads()},
               "toy": toy(a.run, a.history or checkpoint.draft_dir(a.run, "history", 0), a.scenes, a.repeats),
               "preset": preset(a.preset, min(a.repeats, 3))}
        files.write_json(a.out, res)
    for k in ("toy", "preset"):
        r = res[k]
        print(f"{k}: {r['prompt_tokens']} prompt tokens, {r['visual_tokens']} visual; draft prefill "
              f"{r['flat']['prefill_ms']:.1f} ms (FlatRoPE) -> {r['history']['prefill_ms']:.1f} ms (history-only), "
              f"cache {r['flat']['cache_slots']:.0f} -> {r['history']['cache_slots']:.0f} slots "
              f"({r['flat']['cache_kb']:.0f} -> {r['history']['cache_kb']:.0f} KiB)")
    print(f"written to {a.out}")
    return res


if __name__ == "__main__":
    main()
