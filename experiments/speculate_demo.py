"""speculate.py on a small random target (model.PRESETS["toy-target"], weights of O(1) effect) with a draft that is
the target plus noise: tau, alpha, and the greedy outputs of both arms compared (equal, the lossless property).
Paper: the deliberative reasoner p verifying the routine reasoner q's gamma tokens, here without the driving world.

run: python experiments/speculate_demo.py --device cpu [--gamma 4] [--temperature 0]
"""
import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from ops import cli  # noqa: E402
from model import PRESETS, VLA  # noqa: E402
from speculate import Sampling, autoregressive, speculative  # noqa: E402
from evaluate import expected_tau  # noqa: E402


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description="tau of a small random target with a perturbed-copy draft")
    ap.add_argument("--device", default="cpu", help="torch device")
    ap.add_argument("--gamma", type=int, default=4, help="draft length")
    ap.add_argument("--tokens", type=int, default=64, help="max_new_tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--noise", type=float, default=0.05, help="draft = target + noise * std(w) * N(0, 1) per weight")
    ap.add_argument("--seed", type=int, default=0)
    args = cli.checked(ap, ap.parse_args(argv), counts=("gamma", "tokens"))
    with cli.user_errors(ap):
        cli.check_device(args.device)
        cli.check_values(args, [("a finite number >= 0", ("temperature", "noise"))], flags=True)
    cli.progress(f"a random {PRESETS['toy-target'].n_layers}-layer target and its perturbed copy, {args.tokens} tokens")
    torch.manual_seed(args.seed)
    target = VLA(copy.deepcopy(PRESETS["toy-target"])).to(args.device).eval()
    with torch.no_grad():  # weights of O(1) effect, so the random target has peaked, non-trivial logits
        for w in (w for w in target.parameters() if w.dim() > 1):
            w.normal_(0.0, 1.0 / w.shape[-1] ** 0.5)
        draft = copy.deepcopy(target)
        for w in draft.parameters():
            w.add_(args.noise * w.std() * torch.randn_like(w))
    prompt = dict(input_ids=torch.randint(10, target.cfg.vocab_size, (1, 16), device=args.device))  # text ids only
    sampling = Sampling(args.temperature, seed=args.seed)
    base = autoregressive(target, prompt, args.tokens, sampling)
    spec = speculative(target, draft, prompt, args.gamma, args.tokens, sampling)
    for name, r in (("autoregressive", base), ("speculative", spec)):
        print(f"{name:15s} tokens {len(r.tokens)}  rounds {r.rounds}  tau {r.tau:.2f}  alpha {r.alpha:.3f}")
    print(f"expected tau at this alpha (Leviathan): {expected_tau(spec.alpha, args.gamma):.2f}")
    if args.temperature == 0:
        print(f"greedy outputs identical: {base.tokens == spec.tokens}")


if __name__ == "__main__":
    main()
