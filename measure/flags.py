"""The decoding flags of the measuring programs (bench.py, rsd.py, experiments/): --temperature / --top-k / --top-p /
--sampling-seed as a speculate.Sampling, --relaxed as a beyond/relaxed.Relaxed, --tree N/D/k, and how a report names
the decoding (its "decoding" object, its greedy identity). Checked before any work, each defect one line naming its
flag (ops/cli.user_errors).
Paper: its decoding (greedy, and Alpamayo-R1's sampled CoCs at T 0.6, top-p 0.98) as the programs take it.

run: python bench.py --help   (also rsd.py --help)
"""
import argparse

from beyond import relaxed
from ops import files
from ops.cli import number_list
import speculate


def tree_shape(text, flag="--tree"):
    """--tree N/D/k -> a tree.TreeShape, or a ValueError naming the flag (its own checks: a tree it can grow)."""
    from tree import TreeShape
    parts = number_list(text, flag, rule=">= 1", unique=False, sep="/")
    if len(parts) != 3:
        raise ValueError(f"{flag} must be N/D/k (nodes, depth, width), got {text!r}")
    return TreeShape(*parts)


def tree_arg(budget=False):
    """The one --tree of every program, an argparse type: N/D/k, that tree (tree_shape); 0, the chain; with budget, a
    bare N, a node budget (rsd.py's search). A bad value is argparse's one line, naming the flag."""
    def parse(text):
        try:
            if text.strip() == "0" or budget and text.strip().isdecimal():
                return int(text)
            if "/" not in text:
                raise ValueError(f"--tree takes N/D/k (nodes/depth/width, e.g. 16/8/3) or 0 (the chain), got {text!r}")
            return tree_shape(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def identity(exact_match, lossy_match=None):
    """A report's identity fields, from what ran: "greedy_match" the whole run's (every decode it made: a lossy one
    whose outputs changed makes it False; None where nothing was compared), "lossy" whether a lossy decode ran, and
    "exact_greedy_match" the lossless decodes' own. exact_match / lossy_match: True, False or None (not compared; no
    lossy decode)."""
    whole = exact_match if lossy_match is None else None if exact_match is None else exact_match and lossy_match
    return {"greedy_match": whole, "lossy": lossy_match is not None, "exact_greedy_match": exact_match}


def add_decoding_flags(ap, temperature_help, relaxed=True):
    """--temperature, --top-k, --top-p, --sampling-seed (and, if relaxed, --relaxed and --commitments) on a script's
    parser (bench.py, rsd.py); sampling() checks them. temperature_help: what sampling changes in that script's
    report."""
    ap.add_argument("--temperature", type=float, default=0.0, help=f"0 = greedy; {temperature_help}")
    ap.add_argument("--top-k", type=int, default=None, help="with --temperature: sample among the k likeliest tokens")
    ap.add_argument("--top-p", type=float, default=None, help="with --temperature: sample among the likeliest tokens "
                    "whose mass reaches p")
    ap.add_argument("--sampling-seed", type=int, default=0, help="with --temperature: prompt i's generator is seeded "
                    "this + i")
    if relaxed:
        add_relaxed_flags(ap)


def add_relaxed_flags(ap):
    """--relaxed and --commitments (relaxed_rule checks them)."""
    ap.add_argument("--relaxed", metavar="RULE:BOUND", help="LOSSY, off by default: also accept drafts a relaxed rule "
                    "passes (relaxed.Relaxed): typical:B (Medusa's typical acceptance, eps = 1 - B, every position) "
                    "or routine:B (the same, commitment tokens kept exact); B in [0, 1], 0 = exact. Reports then give "
                    "what it cost: tau, speed-up and how far the plan moved from the exact one")
    ap.add_argument("--commitments", metavar="FILE", help="with --relaxed routine:B on a real target: a JSON list of "
                    "the token ids it keeps exact (the toy's default: the words its CoC grammar leaves open)")


def relaxed_rule(text, commitments=None, default=(), vocab_size=None):
    """--relaxed RULE:BOUND -> a relaxed.Relaxed, or None for exact verification (no --relaxed, or a bound of 0, which
    accepts nothing more: reported as exact and decoded once); commitments: the --commitments file (a JSON list of
    token ids), else `default` (the toy's commitment ids); vocab_size: the target's, when known, checks the ids."""
    if text is None:
        if commitments is not None:
            raise ValueError("--commitments names what --relaxed routine:B keeps exact: give --relaxed with it")
        return None
    rule, _, bound = text.partition(":")
    try:
        bound = float(bound)
    except ValueError:
        raise ValueError(f"--relaxed must be RULE:BOUND (typical:0.9 or routine:0.9), got {text!r}") from None
    if commitments is not None and rule != "routine":  # flags a rule ignores are refused, not recorded
        raise ValueError(f"--commitments names what the routine rule keeps exact: --relaxed {text} relaxes every "
                         "position (give routine:B, or no --commitments)")
    if commitments is not None:
        files.check_regular(commitments, f"--commitments {commitments}")
        ids = files.read_json(commitments)
        if not (isinstance(ids, list) and ids):
            raise ValueError(f"--commitments {commitments}: must hold a non-empty JSON list of token ids")
        default = ids
    if rule == "routine" and not default:
        raise ValueError("--relaxed routine:B on this target needs --commitments FILE (the token ids kept exact)")
    try:  # a tuple: a set would make [1, true] one id before Relaxed sees the bool
        r = relaxed.Relaxed(rule, bound, tuple(default) if rule == "routine" else ())
        if vocab_size:
            r.check_vocab(vocab_size)
    except ValueError as e:
        raise ValueError(f"--relaxed {text}" + (f" --commitments {commitments}" if commitments else "") + f": {e}") \
            from None
    return None if bound == 0 else r


def sampling(temperature=0.0, top_k=None, top_p=None, seed=0, relaxed=None) -> speculate.Sampling:
    """The decoding settings of bench.py and rsd.py (their --temperature, --top-k, --top-p, --sampling-seed, and a
    relaxed.Relaxed from relaxed_rule), checked before any work (ValueError); greedy (temperature 0) keeps no seed."""
    if not isinstance(seed, int) or not 0 <= seed < 2**62:  # prompt i's generator takes seed + i, a 63-bit seed
        raise ValueError(f"the sampling seed must be an int >= 0 and < 2**62, got {seed!r}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        # a greedy decode reads only the argmax: the filters would be silently ignored
        raise ValueError("top_k / top_p filter a sampled distribution: give a temperature > 0 with them (0 = greedy)")
    return speculate.Sampling(float(temperature), top_k, top_p, None if temperature == 0 else seed, relaxed)


def sampling_json(s: speculate.Sampling):
    """A report's "decoding" object: mode "greedy" (temperature 0) or "sampling", the settings, and the verification:
    "exact", or the relaxed rule (lossy when its bound is > 0)."""
    r = s.relaxed
    return {"mode": "greedy" if s.greedy else "sampling", "temperature": s.temperature, "top_k": s.top_k,
            "top_p": s.top_p, "seed": s.seed, "lossy": s.lossy,
            "verification": "exact" if r is None else {"rule": r.rule, "bound": r.bound,
                                                       "commitments": len(r.commitments)}}


def decoding_text(d, rows=None):
    """The decoding in words; rows: a plan's rows (row r of plan j then draws from seed + rows j + r)."""
    v, seeds = d.get("verification", "exact"), f"prompt i's generator seeded {d['seed']} + i" if rows is None else (
        f"row r of plan j seeded {d['seed']} + {rows} j + r")
    return ("greedy" if d["mode"] == "greedy" else (
        f"sampling at temperature {d['temperature']:g}, top-k {d['top_k'] or 'off'}, top-p {d['top_p'] or 'off'}, "
        f"{seeds}")) + ("" if v == "exact" else f", LOSSY: relaxed acceptance, rule {v['rule']}, bound {v['bound']:g}")
