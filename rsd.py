"""Reasoning-aware Speculative Decoding end to end (the paper's table). The routine reasoner (a 1-layer FlatRoPE draft,
post-trained with AARL) proposes CoC tokens, the deliberative reasoner (the unmodified target, M-RoPE) verifies them and
writes the commitments itself, the trajectory head plans from prompt + CoC. On the synthetic driving world's held-out
test split: target-only, the replica draft (M-RoPE), the FlatRoPE draft, the history-only draft (no image token in its
prefill or cache) and FlatRoPE + AARL at their speed-optimal gamma on val (mean over the draft seeds), then their draft
trees. tau at every gamma comes from one teacher-forced replay of
the target's greedy outputs (evaluate.simulate_rounds); real speculative decoding checks the outputs and the replay. The
choice of gamma and tree on val needs the val sweep (every row's tau at every gamma) and the trees' val tau, which no
hardware changes: python rsd.py --search records them beside the checkpoints (checkpoints/toy/rsd_search.json), and a
run reads that record (decoding no val scene) while the checkpoints' fingerprints and the settings match; the step
costs are this machine's (measure.choose's profile, cached under runs/choose/), so the chosen gamma and tree are the
machine's too; --gamma / --tree N/D/k give the decoders (no search). ms/token: every row and target-only timed in
one interleaved pass, the speed-up with its spread (bench.py: the full benchmark of one draft). The top of the
layering: it calls train.py, aarl.py and the library's timing harness (measure/timing.py), never bench.py.

run: python rsd.py [--json]        (--retrain trains what is missing: train.py, aarl.py; --search: see above)
"""
import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

import aarl
from beyond import stream
import driving
from driving import Data
import evaluate
from evaluate import MAX_NEW_TOKENS, TARGET_ONLY, TREES, TreeShape
from model import DRAFT_KINDS
from ops import checkpoint, cli, files
from measure import choose as chooser, flags, timing
from measure.choose import shape_key
from speculate import GREEDY, Chain, SpecResult, autoregressive_batch, speculative_batch
import train

# table row -> draft folder kind (model.DRAFT_KINDS, and aarl.py's post-trained FlatRoPE draft)
ROWS = (("replica", "mrope"), ("flatrope", "flat"), ("history-only", "history"), ("flatrope+aarl", "aarl"))
GAMMAS = evaluate.GAMMAS
SEEDS = "0,1,2"  # --seeds' default: the shipped rows' draft seeds
# in the run folder, beside the checkpoints: what python rsd.py --search measured on val (the step times and the trees'
# val tau that choose gamma and tree), keyed by the checkpoints' fingerprints; a run without a matching one searches
SEARCH_JSON = "rsd_search.json"
TIME_BLOCKS = 4  # the timed scenes cut into this many blocks: the speed-up's spread is min..max over them (and passes)


# ---- the search on val: step times and tree taus, recorded once per set of checkpoints ----
def search_key(target, drafts, seeds, a, device):
    """What a recorded search holds for: the checkpoints' fingerprints (the target; each row's drafts, its val sweep a
    mean over them, its trees searched with the first), the val scenes and their geometry, the dtype, the device type,
    the candidates."""
    return {"target": checkpoint.fingerprint(target),
            "drafts": {row: [checkpoint.fingerprint(d) for d in by_seed.values()] for row, by_seed in drafts.items()},
            **search_settings(a, seeds, device), "max_new": MAX_NEW_TOKENS, "gammas": list(GAMMAS),
            "trees": [shape_key(sh) for sh in TREES]}


def search_settings(a, seeds, device):
    return {"seeds": seeds, "scenes": a.scenes, "views": a.views, "dtype": a.dtype,
            "device": torch.device(device).type}


def check_search_record(ap, a, seeds, device):
    """--search with other settings than the defaults never replaces a record made with the defaults (the one a default
    run reads): refused before any work; deleting the record first names it explicitly."""
    if not a.search or not os.path.isfile(path := os.path.join(a.run, SEARCH_JSON)):
        return
    key, mine = files.read_json(path).get("key") or {}, search_settings(a, seeds, device)
    default = search_settings(ap.parse_args([]), cli.number_list(SEEDS, "--seeds", unique=False), "cpu")
    if all(key.get(k) == v for k, v in default.items()) and (differ := [k for k in default if mine[k] != default[k]]):
        raise ValueError(f"--search: {path} holds the search made with the default settings, and this run's "
                         f"{', '.join('--' + k for k in differ)} differ: rerun --search "
                         f"with the defaults, or delete {path} to record one for these settings")


def search(target, drafts, first, val, prompts, shapes):
    """The recorded part of the choice of gamma and tree on val, which no hardware changes: the val sweep (val_sweep:
    each row's tau at every gamma) and each row's tau on val with each tree shape (real tree decoding of its first
    draft, `first`: a tree has no teacher-forced replay). The step costs are this machine's own (measure.choose's
    profile, cached under runs/choose/)."""
    return {"val_sweep": val_sweep(target, drafts, val),
            "tree_val_tau": tree_val_taus(target, first, prompts, shapes, val.tok.cot_end_id) if shapes else {}}


def replay(target, drafts, data, outputs):
    """{row: [tau_by_gamma of each of its drafts]} (drafts {row: {seed: draft}}) on data's scenes: one teacher-forced
    pass per draft over the target's greedy outputs (evaluate.simulate_rounds), every draft reading one target.embed."""
    m = evaluate.draft_matches({(row, s): d for row, by_seed in drafts.items() for s, d in by_seed.items()}, target,
                               data, outputs)
    return {row: [evaluate.tau_by_gamma(m[(row, s)], GAMMAS) for s in by_seed] for row, by_seed in drafts.items()}


def sweep_of(taus, outputs):
    """{gamma: {"ceiling": a never-rejected draft's tau, row: its mean tau over its drafts}} from replay's taus."""
    return {g: {"ceiling": evaluate.tau_ceiling([len(o) for o in outputs], g),
                **{row: statistics.mean(t[g]["tau"] for t in per_seed) for row, per_seed in taus.items()}}
            for g in GAMMAS}


def val_sweep(target, drafts, val):
    """The sweep on val (sweep_of), which chooses each row's gamma: the target's greedy val outputs replayed."""
    cli.progress(f"the target's greedy CoCs of {len(val.scenes)} val scenes, every draft's replay of them")
    outputs = evaluate.greedy_outputs(target, val)
    return sweep_of(replay(target, drafts, val, outputs), outputs)


def tree_val_taus(target, drafts, val, shapes, stop):
    """{row: {shape: tau}}: each row's draft decoding the val prompts with each tree shape (real tree decoding)."""
    return {row: {shape_key(sh): evaluate.spec_stats(target, {row: d}, val, sh, stop_token=stop,
                                                     check_greedy=False)[row]["tau"] for sh in shapes}
            for row, d in drafts.items()}


def recorded_search(path, key, log=print):
    """(the search recorded at path by python rsd.py --search, the rows it lacks) when it was made for these
    checkpoints and settings, the rows it has with the same drafts (a row added since lacks only its trees' val tau);
    else None, saying why (a stale record is never used: its step times and taus belong to other models)."""
    if not os.path.isfile(path):
        return None
    rec = files.read_json(path)
    have = (rec.get("key") or {}).get("drafts") or {}
    other = [row for row, fp in have.items() if key["drafts"].get(row) != fp]  # rows with another draft now
    if differ := sorted(k for k in key if k != "drafts" and key[k] != rec["key"].get(k)) + \
            ([f"drafts ({', '.join(other)})"] if other else []):
        log(f"{path} was recorded for other checkpoints or settings ({', '.join(differ)} differ): not used, searching "
            "on val now (python rsd.py --search records the search)")
        return None
    sweep = {int(g): v for g, v in rec["val_sweep"].items()}  # JSON keys are strings
    return {"tree_val_tau": rec["tree_val_tau"], "val_sweep": sweep}, [row for row in key["drafts"] if row not in have]


def choose(rec, val_taus, shapes):
    """({row: gamma}, {row: tree shape}) predicted fastest on val: val tau (the replay's for a chain, the recorded real
    decoding's for a tree) at this machine's round times (rec["profile"], measure.choose). Deterministic given both."""
    prof = rec["profile"]
    gamma = {row: max(taus, key=lambda g: chooser.speedup(prof, Chain(g), taus[g])) for row, taus in val_taus.items()}
    tree = {row: max(shapes, key=lambda sh: chooser.speedup(prof, sh, rec["tree_val_tau"][row][shape_key(sh)]))
            for row in val_taus} if shapes else {}
    return gamma, tree


# ---- timing: every arm in one interleaved pass (timing.time_arms) ----
def unordered(rows):
    """Groups of rows whose speed-up ranges overlap (through a chain of overlaps): the timing does not order the rows
    of a group, whatever the digits of their speed-ups say."""
    groups, top = [], None
    for r in sorted(rows, key=lambda r: r["speedup_range"][0]):
        lo, hi = r["speedup_range"]
        if groups and lo <= top:
            groups[-1].append(r["name"])
            top = max(top, hi)
        else:
            groups.append([r["name"]])
            top = hi
    return [g for g in groups if len(g) > 1]


# ---- the table ----
def test_decoder(target, prompts, n_time, stop):
    """(shared, real): the target with each test prompt batch's prefill computed once (evaluate.SharedPrefill), and
    real(draft, decoder, done=()) -> greedy real decoding of the test prompts in two batches, the first n_time (the
    timed scenes) and the rest, the same batches for every decode (each row is its batch-1 decode,
    tests/test_batch.py); draft None: target-only (the target's greedy CoCs); done: the timed scenes' decodes."""
    shared = evaluate.SharedPrefill(target)  # keyed on the batches' tensors: stacked once, here
    batches = [evaluate.stack_prompts(prompts[lo:hi]) for lo, hi in ((0, n_time), (n_time, len(prompts))) if hi > lo]

    def real(draft, g, done=()):
        out = list(done)
        for batch in batches[1 if done else 0:]:  # done: the first batch's decodes
            out += autoregressive_batch(shared, batch, MAX_NEW_TOKENS, stop_token=stop) if draft is None else \
                speculative_batch(shared, draft, batch, g, MAX_NEW_TOKENS, stop_token=stop)
        return out
    return shared, real


def paper_table(target, drafts, test, prompts, decoding, outputs, val, metrics, rec, n_time, repeats, sampling=GREEDY,
                compile=False, tree=0, gamma=evaluate.GAMMA):
    """The rows and the sweep (mean tau per split and gamma, and the ceiling: val's the record's, else measured on
    val); prompts: the test scenes', decoding: test_decoder's, outputs: the target's greedy test CoCs; metrics: the
    target's on test (ADE and commitment accuracy, computed once in main). Chain rows at the gamma, tree rows (of
    TREES, <= `tree` nodes; none for 0) at the shape chosen on val (choose); with no search (rec None) at `gamma` and
    `tree` (a TreeShape, or 0).
    Real decoding on every test scene: each row's first-seed draft, each tree row's every seed (a tree has no replay).
    ms/token: timing.time_arms over the first n_time test scenes, every row's first-seed draft beside target-only;
    with greedy eager decoding its first pass is also those scenes' real decoding. A sampled `sampling`: timed
    sampling, plus real sampled decoding's sampled_tau / sampled_alpha; compile: the timed arms on compiled steps
    (timing.compiled_pair)."""
    stop, (shared, real) = test.tok.cot_end_id, decoding
    flat = {(row, s): d for row, by_seed in drafts.items() for s, d in by_seed.items()}
    taus = replay(target, drafts, test, outputs)  # {row: [tau_by_gamma of each seed]}

    def mean_tau(per_seed, g):
        return statistics.mean(t[g]["tau"] for t in per_seed)

    # the val sweep (the search's record, or measured now), the test sweep
    sweep = {"val": rec["val_sweep"] if rec else val_sweep(target, drafts, val), "test": sweep_of(taus, outputs)}
    shapes = [sh for sh in TREES if rec and sh.nodes <= tree]
    gammas, trees = choose(rec, {row: {g: sweep["val"][g][row] for g in GAMMAS} for row in drafts}, shapes) \
        if rec else (dict.fromkeys(drafts, gamma), dict.fromkeys(drafts if tree else (), tree))
    first = {row: next(iter(by_seed.values())) for row, by_seed in drafts.items()}
    decoders = {row: (first[row], gammas[row]) for row in drafts} | {f"{row} tree": (first[row], trees[row])
                                                                     for row in trees}
    # compile: each row its own compiled pair; target-only: the first pair's compiled target. Eager: each scene's
    # prefill computed once (shared): the table times the reasoning step
    pairs = {name: timing.compiled_pair(target, d, prompts[:n_time], [g], MAX_NEW_TOKENS) if compile else (shared, d)
             for name, (d, g) in decoders.items()}
    speed, timed = timing.time_arms(next(iter(pairs.values()))[0], {}, prompts[:n_time], 1, MAX_NEW_TOKENS, stop,
                                    repeats, sampling, {name: (*pairs[name], g) for name, (_, g) in decoders.items()},
                                    TIME_BLOCKS, warm_all=False)
    # the arms' timing columns; tau and greedy identity are the table's own (every test scene, every draft)
    speed = {arm: {k: v for k, v in a.items() if k not in ("decoder", "tau", "greedy_match")}
             for arm, a in speed.items()}
    sampled = not sampling.greedy
    reuse = not sampled and not compile  # the timed pass's decodes are the eager greedy ones

    ade = metrics["ade"]  # every arm emits the target's greedy CoC: one ADE
    commit = evaluate.commitment_accs(flat, target, test)
    attn = evaluate.attention_split(target, target, test)
    # the batch-1 target-only decodes of the timed scenes emit the batched greedy outputs the rows are checked against
    base_match = not reuse or [r.tokens for r in timed[TARGET_ONLY]] == outputs[:n_time]
    rows = [{"name": TARGET_ONLY, "gamma": None, "tau": 1.0, "tau_spread": 0.0, "tau_by_gamma": None,
             "tau_ceiling": 1.0, "routine_fraction": 0.0, "commit_acc": metrics["commitment_acc"], "ade": ade,
             "greedy_match": base_match, **speed[TARGET_ONLY], **{f"attn_{k}": v for k, v in attn.items()},
             **({"sampled_tau": 1.0, "sampled_alpha": None} if sampled else {})}]
    chain = {}
    for name, by_seed in drafts.items():
        per_seed, g = taus[name], gammas[name]
        # real speculative decoding emits the target's greedy output, at the tau the replay predicts
        spec = evaluate.result_stats(real(first[name], g, timed[name] if reuse else ()), g, outputs)
        attn = [evaluate.attention_split(d, target, test) for d in by_seed.values()]
        chain[name] = {"name": name, "gamma": g, "tau": mean_tau(per_seed, g),
                       "tau_spread": max(t[g]["tau"] for t in per_seed) - min(t[g]["tau"] for t in per_seed),
                       "tau_by_seed": [t[g]["tau"] for t in per_seed],
                       "tau_by_gamma": {gg: mean_tau(per_seed, gg) for gg in GAMMAS},
                       "tau_ceiling": sweep["test"][g]["ceiling"],
                       "routine_fraction": statistics.mean(t[g]["routine_fraction"] for t in per_seed),
                       "commit_acc": statistics.mean(commit[(name, s)] for s in by_seed), **speed[name], "ade": ade,
                       **{f"attn_{k}": statistics.mean(a[k] for a in attn) for k in ("history", "image", "text")},
                       "greedy_match": spec["greedy_match"], "replay_exact": spec["tau"] == per_seed[0][g]["tau"],
                       "folders": len(by_seed)}
        rows.append(chain[name])
    for name, sh in trees.items():
        # every seed's real tree decoding on every test scene (the first seed's timed scenes: the timed pass's)
        stats = [evaluate.result_stats(real(d, sh, timed[f"{name} tree"] if reuse and s == next(iter(drafts[name]))
                                            else ()), sh, outputs) for s, d in drafts[name].items()]
        tree_taus = [st["tau"] for st in stats]
        rows.append({**{k: chain[name][k] for k in ("commit_acc", "ade", "attn_history", "attn_image", "attn_text")},
                    "name": f"{name} tree", "gamma": None, "tree": [sh.nodes, sh.depth, sh.width],
                    "tau": statistics.mean(tree_taus), "tau_spread": max(tree_taus) - min(tree_taus),
                    "tau_by_seed": tree_taus, "tau_ceiling": stats[0]["tau_ceiling"], "folders": len(tree_taus),
                    "val_tau": {str(x): rec["tree_val_tau"][name][shape_key(x)] for x in shapes},  # str(TreeShape)
                    "routine_fraction": statistics.mean(st["routine_fraction"] for st in stats),
                    "alpha_by_depth": stats[0]["alpha_by_depth"], "nodes_per_round": stats[0]["nodes_per_round"],
                    **speed[f"{name} tree"], "greedy_match": all(st["greedy_match"] for st in stats),
                    "replay_exact": True})
    for r in rows[1:] if sampled else ():  # the replay is greedy; sampled tau needs real decoding
        s = evaluate.spec_stats(target, {"x": decoders[r["name"]][0]}, prompts, decoders[r["name"]][1], stop_token=stop,
                                sampling=sampling)["x"]
        r.update(sampled_tau=s["tau"], sampled_alpha=s["alpha"])
    return rows, sweep


# ---- display ----
def draft_words(named, seeds):
    """(what a draft row's tau is over, the draft decoded for the single-draft figures): `named` the --drafts rows
    {row: [folders]} (None: the shipped rows over `seeds`); the spread's wording only when some row has two or more."""
    if named is None:
        return (f"mean ± half the spread over seeds {seeds}" if len(seeds) > 1 else f"seed {seeds[0]}'s draft"), \
            f"seed {seeds[0]}"
    return ("mean ± half the spread over the row's folders (folder 0, 1, ... as given; none for a row of one)"
            if max(map(len, named.values())) > 1 else "each row's one folder"), "folder 0"


def show_scenes(target, draft, data: Data, gamma, n, log=print, sampling=GREEDY):
    """A few scenes planned by the two reasoners, next to target-only decoding (both sampled under `sampling`)."""
    tok, device = data.tok, next(target.parameters()).device
    prompts = evaluate.scene_prompts(data.scenes[:n], tok, device, views=data.views_at(0))
    for i, (scene, prompt) in enumerate(zip(data.scenes, prompts)):
        spec = evaluate.decode(target, draft, prompt, gamma, MAX_NEW_TOKENS, tok.cot_end_id, sampling.offset(i))
        base = evaluate.decode(target, None, prompt, gamma, MAX_NEW_TOKENS, tok.cot_end_id, sampling.offset(i))
        # sampled outputs share the target's distribution, not its tokens: no token-by-token comparison
        same = "" if not sampling.greedy else f"   identical: {spec.tokens == base.tokens}"
        log(f"scene {i} ({scene.f.road}, {scene.f.event}, history {scene.f.hist_class}):")
        log(f"  RSD    tau {spec.tau:.1f}: {evaluate.marked_coc([tok.vocab[t] for t in spec.tokens], spec.from_draft)}")
        log(f"  target-only: {tok.decode(base.tokens)}{same}")


def print_table(rows, log=print):
    """A draft row's tau ± half its spread over its drafts (seeds or folders): none for a row of one draft."""
    sampled = "sampled_tau" in rows[0]  # a column only when the run samples
    log(f"{'':20s} {'gamma':>7s} {'tau':>11s} " + (f"{'tau sampled':>11s} " if sampled else "")
        + f"{'routine':>8s} {'commit':>7s} {'ms/token':>9s} {'speed-up [min-max]':>19s} {'ADE m':>6s} "
        f"{'attn hist':>9s} {'attn img':>9s}")
    for r in rows:
        g = "/".join(map(str, r["tree"])) if r.get("tree") else "" if r["gamma"] is None else str(r["gamma"])
        tau = f"{r['tau']:.2f}" + (f" ±{r['tau_spread'] / 2:.2f}" if r.get("folders", 0) > 1 else "")
        stau = f"{r['sampled_tau']:11.2f} " if sampled else ""
        lo, hi = r["speedup_range"]
        up = f"{r['speedup']:.2f}x" + ("" if r["name"] == TARGET_ONLY else f" [{lo:.2f}-{hi:.2f}]")
        log(f"{r['name']:20s} {g:>7s} {tau:>11s} {stau}{r['routine_fraction']:8.3f} {r['commit_acc']:7.3f} "
            f"{r['ms_per_token']:9.3f} {up:>19s} {r['ade']:6.2f} {r['attn_history']:9.3f} {r['attn_image']:9.3f}")


def print_sweep(sweep, rows, log=print):
    names = [r["name"] for r in rows if r["gamma"] is not None]  # the chain rows
    log("tau by draft length (mean over a row's drafts; ceiling = a draft the verifier never rejects):")
    log(f"{'split':6s} {'gamma':>5s} {'ceiling':>8s} " + " ".join(f"{n:>14s}" for n in names))
    for split, by_g in sweep.items():
        for g, v in by_g.items():
            log(f"{split:6s} {g:5d} {v['ceiling']:8.2f} " + " ".join(f"{v[n]:14.2f}" for n in names))


def find_search(a, target, drafts, seeds, val, device):
    """(the search record and this machine's profile under "profile", how they were had): none for given decoders;
    run/SEARCH_JSON when it holds for these checkpoints and settings, else the search on val now, recorded there with
    --search (every tree of TREES); the profile (measure.choose: the flatrope row's draft, eager) cached or measured."""
    if a.given:  # nothing to choose: no step time, no tree decoded on val (the replay gives tau at every gamma)
        return None, f"gamma {a.gamma}{f' and tree {shape_key(a.tree)}' if a.tree else ''} as given, no search on val"
    path = os.path.join(a.run, SEARCH_JSON)
    key = search_key(target, drafts, seeds, a, device)
    found = None if a.drafts else recorded_search(path, key)
    shapes = list(TREES) if a.search else [sh for sh in TREES if sh.nodes <= a.tree]
    prompts = evaluate.scene_prompts(val.scenes, val.tok, next(target.parameters()).device, views=val.views_at(0))
    first = {row: by_seed[seeds[0]] for row, by_seed in drafts.items()}
    if found and not (a.search and not found[1]):  # --search with nothing lacking measures everything again
        rec, lacking = found
        if not lacking:
            return with_profile(rec, f"recorded by python rsd.py --search in {path}", target, first, prompts, val)
        # a row added since the record: its val sweep and trees' val tau alone, the recorded rows' choice unchanged
        cli.progress(f"{path} lacks the rows {', '.join(lacking)}: their val sweep and trees' val tau")
        shapes = [sh for sh in TREES if shape_key(sh) in next(iter(rec["tree_val_tau"].values()))]
        rec["tree_val_tau"] |= tree_val_taus(target, {r: first[r] for r in lacking}, prompts, shapes,
                                             val.tok.cot_end_id)
        for g, v in val_sweep(target, {r: drafts[r] for r in lacking}, val).items():
            rec["val_sweep"][g] |= v
        rec["key"] = key
        how = f"recorded by python rsd.py --search in {path}, the rows {', '.join(lacking)} measured now"
        if not a.search:
            return with_profile(rec, how, target, first, prompts, val)
    else:
        rec, how = search(target, drafts, first, val, prompts, shapes), "measured now"
    if a.search:
        files.write_json(path, {"what": "rsd.py's search on val, the part no hardware changes: each row's tau at "
                                        "every gamma on val (the replay, mean over the key's drafts) and each tree's "
                                        "(real tree decoding, the first draft)",
                                "command": "python rsd.py --search", "key": key, **rec})
        print(f"search recorded in {path}")
        how = f"{how}, recorded in {path}"
    return with_profile(rec, how, target, first, prompts, val)


def with_profile(rec, how, target, first, prompts, val):
    """The search record with this machine's profile under "profile" (the round times that choose gamma and tree),
    and how both were had."""
    draft = first.get("flatrope") or next(iter(first.values()))  # the timed draft architecture: the first row's
    prof, how_p = chooser.profile(target, draft, prompts[0], stop_token=val.tok.cot_end_id)
    return {**rec, "profile": prof}, f"{how}; step times: this machine's profile, {how_p}"


# ---- main ----
@cli.program
def main(argv=None):
    ap, a, seeds, sampling, device = parse_args(argv)
    with cli.json_stdout(a.json):
        out = run(ap, a, seeds, sampling, device)
    if a.json:
        print(json.dumps(out))


def run(ap, a, seeds, sampling, device):
    """The main job: the target's metrics, the search (or the given decoders), the table, the sweep -> the JSON."""
    t0, cpu0 = time.time(), time.process_time()
    with cli.user_errors(ap):  # a failed retrain, a corrupt file, a draft distilled from another target: one line
        check_search_record(ap, a, seeds, device)
        if a.retrain:
            retrain(a.run, seeds, device)
        if gone := missing(a.run, [] if a.drafts else seeds):
            raise ValueError(f"missing checkpoints: {', '.join(gone)}; use the shipped checkpoints/toy, or train them "
                             f"with `python rsd.py --retrain --run {a.run}`")
        target = checkpoint.load(os.path.join(a.run, "target"), dtype=cli.DTYPES[a.dtype], device=device).eval()
        folders = ({row: dict(enumerate(dirs)) for row, dirs in a.named.items()} if a.drafts else
                   {row: {s: checkpoint.draft_dir(a.run, kind, s) for s in seeds} for row, kind in ROWS})
        drafts = {row: {s: checkpoint.load(d, target=target).eval() for s, d in dirs.items()}
                  for row, dirs in folders.items()}  # {row: {seed: draft}}; --drafts: seeds 0.. per row
    tok = driving.Tokenizer()
    val, test = (Data(split, a.scenes, 0, tok, views=a.views) for split in ("val", "test"))
    # the target's greedy test outputs, computed once: its metrics and the rows' reference and replay (val's: only
    # where no search record holds the val sweep)
    cli.progress(f"the target's greedy CoCs of {a.scenes} test scenes, its metrics")
    prompts = evaluate.scene_prompts(test.scenes, tok, device, views=test.views_at(0))
    decoding = test_decoder(target, prompts, a.time_scenes, tok.cot_end_id)  # the prefills shared with the table's
    outputs = [r.tokens for r in decoding[1](None, None)]
    metrics = {"coc_exact": evaluate.coc_exact_match(outputs, test.coc_ids()),
               "commitment_acc": evaluate.commitment_acc(target, target, test),
               "ade": evaluate.trajectory_ade(target, test, outputs)[0]}
    print(f"target on the held-out test split: CoC exact {metrics['coc_exact']:.3f}, "
          f"commitment accuracy {metrics['commitment_acc']:.3f}, ADE {metrics['ade']:.2f} m")
    cli.progress("the decoders: " + ("as given (--gamma / --tree)" if a.given else "the val search's record, or "
                                     "the search itself (minutes)"))
    rec, searched = find_search(a, target, drafts, seeds, val, device)
    cli.progress(f"the table: every row's real decoding of the test scenes, then {a.repeats} timed pass(es) over "
                 f"{a.time_scenes} of them" + (" (compiling first: minutes)" if a.compile else ""))
    table = dataclasses.replace(sampling, relaxed=None)  # the paper's table is lossless; --relaxed: a section after it
    rows, sweep = paper_table(target, drafts, test, prompts, decoding, outputs, val, metrics, rec, a.time_scenes,
                              a.repeats, table, a.compile, a.tree, a.gamma)
    shown = list(drafts)[-1]  # the paper's routine reasoner (FlatRoPE + AARL), or the last row given
    aarl_row = next(r for r in rows if r["name"] == shown)
    show_scenes(target, drafts[shown][seeds[0]], test, aarl_row["gamma"], a.show, sampling=table)
    ids = evaluate.scene_prompts(test.scenes[:1], tok, device, views=a.views)[0]["input_ids"]
    n_visual, n_hist = int(((ids == tok.image_token_id) | (ids == tok.video_token_id)).sum()), 3 * tok.cfg.n_hist
    blocks = min(TIME_BLOCKS, a.time_scenes)
    over, first = draft_words(a.named if a.drafts else None, seeds)
    print(f"\nheld-out test split, {a.scenes} scenes, {n_visual} visual and {n_hist} history "
          f"tokens per prompt, {a.dtype} on {a.device} ({torch.get_num_threads()} threads); draft rows: {over} at "
          + (f"the row's speed-optimal gamma / tree (chosen on {a.scenes} val scenes by the cost model, {searched})"
             if rec else searched))
    print(f"ms/token: the reasoning step's decode time per token, {first}'s drafts, every row and target-only "
          f"timed in one interleaved pass over {a.time_scenes} test scenes (each scene decoded by all arms back to "
          f"back, the order rotated), {a.repeats} timed pass{'es' if a.repeats > 1 else ''}"
          + (", all arms torch.compile'd" if a.compile else "")
          + f"; speed-up = target-only's ms/token over the row's, [min-max] over {a.repeats * blocks} block"
          f"{'s' if a.repeats * blocks > 1 else ''} of {a.time_scenes // blocks}"
          f"{'+' if a.time_scenes % blocks else ''} scenes: rows whose ranges overlap are not ranked by it")
    if not table.greedy:
        print(f"decoding: {flags.decoding_text(flags.sampling_json(table))} (prompt i = test scene i). tau = the exact "
              "greedy replay "
              f"(gamma chosen on it); tau sampled = real sampled speculative decoding with {first}'s draft; "
              f"ms/token and speed-up timed sampling; ADE after the greedy CoC")
    print_table(rows)
    print((f"step times ({chooser.hardware(device)}, {searched}): T_target(1) {1e3 * rec['profile']['target'][1]:.2f} "
           f"ms, T_draft(1) {1e3 * rec['profile']['draft'][1]:.3f} ms; " if rec else "") + "commit = teacher-forced "
          "accuracy on the commitment tokens")
    groups = unordered(rows[1:])
    print("speed-up ranges that overlap (timing noise, not an order): "
          + ("; ".join(" ~ ".join(g) for g in groups) if groups else "none"))
    for r in rows:
        if r.get("tree"):
            print(f"{r['name']}: tree of N/D/k = {'/'.join(map(str, r['tree']))}{' (chosen on val)' * (not a.given)}, "
                  f"{r['nodes_per_round']:.1f} nodes per round, alpha by depth "
                  + " ".join("-" if x is None else f"{x:.2f}" for x in r["alpha_by_depth"]) + f" ({first})")
    greedy_match = all(r["greedy_match"] for r in rows)
    print(f"greedy outputs identical to target-only on every scene and draft (real decoding of all {a.scenes} test "
          f"scenes: each chain row's {first}, each tree row's every draft): {greedy_match}; real speculative "
          f"decoding's tau equals the replay's: {all(r.get('replay_exact', True) for r in rows)}\n")
    print_sweep(sweep, rows)
    lossy = relaxed_rows(target, drafts, rows, test, sampling, first) if sampling.relaxed else None
    streams = stream_rows(target, drafts, rows, tok, a, device, first, sampling) if a.stream else None
    share = driving.routine_share("train")
    print(f"routine share of the world (the Bayes-optimal reader of the history, python driving.py): {share:.3f}")
    # CPU time beside the wall time: on a shared machine the wall time also holds the waits for the other jobs
    print(f"wall time {time.time() - t0:.0f} s (CPU time of this process {time.process_time() - cpu0:.0f} s)")
    keys = ("name", "gamma", "tau", "tau_spread", "tau_pm", "tau_by_seed", "tau_by_gamma", "tau_ceiling",
            "routine_fraction", "commit_acc",
            "ms_per_token", "speedup", "ms_per_token_range", "speedup_range", "ade", "attn_history", "attn_image",
            "attn_text")
    keys += ("sampled_tau", "sampled_alpha") if not table.greedy else ()
    keys += ("tree", "val_tau", "alpha_by_depth", "nodes_per_round")  # None on chain rows
    for r in rows:  # the table's "± x": half the spread over a row's drafts (tau_spread is the whole of it)
        r["tau_pm"] = r["tau_spread"] / 2 if r.get("folders", 0) > 1 else None
    # the top level's identity is the whole run's: a lossy section whose CoCs changed makes it False
    same = None if lossy is None else all(r["identical_to_lossless"] for r in lossy.values())
    return {"decoding": flags.sampling_json(sampling), "compiled": a.compile,
            **flags.identity(greedy_match, same if table.greedy else None if lossy is None else False),
            "tau_ceiling": aarl_row["tau_ceiling"], "sweep": sweep,
            "target": {k: metrics[k] for k in ("coc_exact", "commitment_acc", "ade")},
            "prompt": {"visual_tokens": n_visual, "history_tokens": n_hist},
            "routine_share_world": share, "seeds": None if a.drafts else seeds, "drafts": a.named if a.drafts else None,
            "timing": {"scenes": a.time_scenes, "passes": a.repeats, "blocks": blocks, "unordered": groups,
                       "step_times": searched},
            "rows": [{k: r.get(k) for k in keys} for r in rows], "relaxed": lossy, "stream": streams,
            "stream_settings": stream.settings(**({"samples": 1} if table.greedy else {
                "samples": a.stream_samples, "siblings": a.stream_samples, "frames_back": stream.K_FRAMES})
            ) if streams else None,
            "hardware": chooser.hardware(device), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "what_ran": cli.ran(a, t0, cpu0) | {"device": str(device), "run": a.run, "rows": [
                {"name": r["name"], "decoder": "target-only" if r["name"] == TARGET_ONLY else
                 f"tree {'/'.join(map(str, r['tree']))}" if r.get("tree") else f"chain {r['gamma']}",
                 "drafts": [] if r["name"] == TARGET_ONLY else list(folders[r["name"].removesuffix(" tree")].values())}
                for r in rows], "ignored": ["gamma", "tree"] * (not a.given) + ["seeds"] * bool(a.drafts)}}


def stream_rows(target, drafts, rows, tok, a, device, first, sampling):
    """--stream CLIPS (beyond the paper, lossless: beyond/stream.py): held-out clips of --stream-frames frames replanned
    every 0.5 s at the default event rate; per row, its first draft at its gamma (the tree of width 1) or tree alone,
    the plans before alone, and both merged, timed interleaved with target-only (measure.timing.stream_arms) -> {row:
    {arm: record}}, printed. Sampled (--temperature > 0): each frame's plan is --stream-samples rows (Alpamayo-R1's
    six), drafted from the frames before's rows and their siblings."""
    rate = driving.event_rate(0.5)
    clips = [evaluate.scene_prompts(c, tok, device, cli.DTYPES[a.dtype], a.views)
             for c in driving.make_clips("test", a.stream, a.stream_frames, 0.5, rate)]
    cli.progress(f"--stream: {a.stream} held-out clips of {a.stream_frames} frames, 4 arms per row, interleaved")
    samples = 1 if sampling.greedy else a.stream_samples
    print(f"\nplans in a stream (beyond the paper, lossless): {a.stream} held-out clips of {a.stream_frames} frames, "
          f"replanned every 0.5 s, event rate {rate:.3f} a frame, {samples} row(s) a plan; {first}'s drafts; tau, "
          f"speed-up over target-only ({'its' if samples == 1 else 'batch-%d' % samples} plan)")
    out = {}
    for row in rows[1:]:
        g = row["gamma"]
        shape = TreeShape(*row["tree"]) if row.get("tree") else TreeShape(g, g, 1)
        draft = next(iter(drafts[row["name"].removesuffix(" tree")].values()))
        out[row["name"]], _ = timing.stream_arms(target, draft, clips, shape, MAX_NEW_TOKENS, tok.cot_end_id,
                                                 samples=samples, sampling=sampling)
        print(f"{row['name']}, {chooser.name(shape)}:")  # then its arms through the one printer
        print("\n".join(timing.arms_lines(out[row["name"]], "ms_per_plan")))
    return out


def relaxed_rows(target, drafts, rows, test, sampling, first):
    """--relaxed (LOSSY): every test scene decoded again with each row's first draft at its gamma or tree under the
    relaxed rule; its price beside its tau: the CoCs it changed and how far it moved the plan (evaluate.relaxed_cost)
    -> {row: record}, printed."""
    prompts = evaluate.scene_prompts(test.scenes, test.tok, next(target.parameters()).device, views=test.views_at(0))
    r = sampling.relaxed
    cli.progress("--relaxed: each row's test scenes decoded again, exact and relaxed, and their plans")
    print(f"\nLOSSY: relaxed acceptance, rule {r.rule}, bound {r.bound:g} ({len(r.commitments)} commitment ids kept "
          f"exact by the routine rule), {first}'s drafts, every test scene; the table above is lossless")
    out = {}
    for row in rows[1:]:
        decoder = TreeShape(*row["tree"]) if row.get("tree") else row["gamma"]
        draft = next(iter(drafts[row["name"].removesuffix(" tree")].values()))
        tau, cocs = {}, {}  # the exact decode (greedy: the target's own CoCs) and the relaxed one, the same draws
        for name, s in (("tau_exact", dataclasses.replace(sampling, relaxed=None)), ("tau", sampling)):
            res = [evaluate.decode(target, draft, p, decoder, MAX_NEW_TOKENS, test.tok.cot_end_id, s.offset(i))
                   for i, p in enumerate(prompts)]
            tau[name], cocs[name] = SpecResult.pooled(res).tau, [x.tokens for x in res]
        out[row["name"]] = tau | evaluate.relaxed_cost(target, test, cocs["tau_exact"], cocs["tau"]) | {
            "lossy": True, "identical_to_lossless": cocs["tau"] == cocs["tau_exact"]}
        print("{:<30} tau {tau:.2f} (lossless {tau_exact:.2f})  CoCs changed {cocs_changed:.0%}  plan moved "
              "{plan_moved_m:.3f} m  ADE {ade_relaxed:.3f} m (lossless {ade_exact:.3f})".format(row["name"],
                                                                                            **out[row["name"]]))
    return out


# ---- operations: checkpoints, retraining, the command line and its checks ----
def missing(run, seeds):
    paths = [os.path.join(run, "target")] + [checkpoint.draft_dir(run, kind, s) for _, kind in ROWS for s in seeds]
    return [p for p in paths if not os.path.isdir(p)]


def retrain(run, seeds, device="cpu", log=print):
    """Train what `run` lacks, under its writer lock: the target and SFT drafts (train.py), then AARL's (aarl.py)."""
    with files.writer_lock(run):
        for seed in seeds:
            sft = [os.path.join(run, "target")] + [checkpoint.draft_dir(run, kind, seed) for kind in ("mrope", "flat")]
            if not all(os.path.isdir(p) for p in sft):  # a missing AARL draft alone retrains nothing
                stage = "all" if not os.path.isdir(sft[0]) else "drafts"
                log(f"training into {run}: stage {stage}, draft seed {seed} (train.py defaults)")
                train.run(train.TrainConfig(out=run, device=str(device), draft_seed=seed), stage=stage, log=log)
            if not os.path.isdir(checkpoint.draft_dir(run, "history", seed)):  # distilled on its own, as shipped
                log(f"training into {run}: the history-only draft, seed {seed} (train.py --kinds history)")
                train.run(train.TrainConfig(out=run, device=str(device), draft_seed=seed, kinds="history"),
                          stage="drafts", log=log)
            if not os.path.isdir(aarl.out_dir(run, "static", seed)):
                log(f"post-training the FlatRoPE draft of seed {seed} with AARL (aarl.py defaults, static anchor)")
                aarl.print_result(aarl.run(aarl.AARLConfig(seed=seed), run, device=device,
                                           out=aarl.out_dir(run, "static", seed)))


def named_drafts(a):
    """--drafts NAME=DIR ... -> a.named {row: [folders]} in the order given, and the folder indices 0..n-1 of the row
    with the most folders (a row's spread is over its own folders; a checkpoint records no training seed)."""
    a.named, seen = {}, {}
    for item in a.drafts:
        name, _, folder = item.partition("=")
        if not name or not folder:
            raise ValueError(f"--drafts takes NAME=DIR, got {item!r}")
        if name == TARGET_ONLY or name.endswith(" tree"):  # the table's own row, and the tree rows it derives
            raise ValueError(f"--drafts {item}: {name!r} is a name the table gives its own rows (target-only, "
                             "'NAME tree'): choose another")
        if checkpoint.existing_kind(folder) not in [f"{k} draft" for k in DRAFT_KINDS]:
            raise ValueError(f"--drafts {item}: {folder} is not a draft checkpoint folder")
        if (real := os.path.realpath(folder)) in seen:  # it would count twice in its row's mean and spread
            raise ValueError(f"--drafts {item}: {folder} is given twice (also as {seen[real]}): one folder once")
        seen[real] = item
        a.named.setdefault(name, []).append(folder)
    if a.retrain or a.search or a.seeds_given:
        raise ValueError("--drafts scores given folders, which define the rows: it takes no --retrain, --search or "
                         "--seeds")
    return list(range(max(map(len, a.named.values()))))


def parse_args(argv):
    """(parser, flags, seeds, sampling, device), every flag checked before any work: one line `rsd.py: error: ...`."""
    ap = argparse.ArgumentParser(description="The two-reasoner planner (RSD) on the synthetic driving world.")
    ap.add_argument("--run", default=checkpoint.SHIPPED, help="run folder (default: the shipped checkpoints/toy)")
    ap.add_argument("--retrain", action="store_true", help="train whatever is missing in --run first")
    ap.add_argument("--seeds", help="draft seeds of every row (mean and spread over them; default 0,1,2)")
    ap.add_argument("--drafts", nargs="+", metavar="NAME=DIR", help="score these draft folders (trained for --run's "
                    "target) instead of the shipped three rows; a NAME given several times is one row over its "
                    "folders (its seeds); nothing is read from or written to --run's search record")
    ap.add_argument("--device", default="cpu", help="torch device")
    for flag, default, text in (
            ("--views", driving.WorldConfig().views, "surround views per prompt (the drafts' training geometry)"),
            ("--scenes", 64, "held-out scenes of the table (and val scenes for gamma)"),
            ("--time-scenes", 12, "of those, scenes timed for ms/token (all arms interleaved on each)"),
            ("--repeats", 1, "timed passes over them"),
            ("--show", 3, "scenes printed with routine / [deliberative] tokens")):
        ap.add_argument(flag, type=int, default=default, help=text)
    ap.add_argument("--dtype", default="fp32", choices=sorted(cli.DTYPES),
                    help="inference dtype (fp32: the exactness claims hold bit for bit)")
    flags.add_decoding_flags(ap, "> 0 also reports the sampled tau of real speculative decoding per row and "
                                "times both arms sampling (prompt i = held-out scene i)")
    ap.add_argument("--compile", action="store_true", help="time both arms with torch.compile'd steps "
                    "(minutes of compilation; gamma is still chosen with the eager cost model)")
    ap.add_argument("--gamma", type=int, choices=GAMMAS, help="the chain rows' draft length, with no search on val "
                    "(the replay gives tau at every gamma): tree rows only at --tree N/D/k")
    ap.add_argument("--tree", type=flags.tree_arg(budget=True), help="draft-tree rows beside the chain rows: N, the "
                    "tree of evaluate."
                    f"TREES of at most N nodes chosen on val (default {evaluate.TREE.nodes}, none beside --gamma; 0 = "
                    f"chain rows); N/D/k, this tree, with no search on val (the chain rows at --gamma, default "
                    f"{evaluate.GAMMA})")
    ap.add_argument("--search", action="store_true", help=f"measure the choice of gamma and tree on val again (step "
                    f"times, every tree's val tau) and record it in --run's {SEARCH_JSON}, which later runs read "
                    "while it holds for their checkpoints and settings; a record made with the default settings "
                    "(--scenes, --views, --dtype, --device, the first of --seeds) is only replaced by a --search with "
                    "them: delete it to record one for other settings")
    ap.add_argument("--stream", type=int, default=0, help="plans in a stream (beyond/stream.py): a section after the "
                    "table timing each row alone, the previous plan alone and both on this many held-out clips (0: "
                    "off)")
    ap.add_argument("--stream-frames", type=int, default=10, help="with --stream: frames per clip (>= 2)")
    ap.add_argument("--stream-samples", type=int, default=6, help="with --stream and --temperature > 0: rows a frame's "
                    "plan samples (Alpamayo-R1: 6)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = ap.parse_args(argv)
    with cli.user_errors(ap):
        cli.check_values(a, [(">= 1", ("scenes", "time_scenes", "repeats")), ("a finite number >= 0", ("show",)),
                                  (cli.VIEWS_RULE, ("views",))], flags=True)
        a.seeds_given, a.seeds = a.seeds is not None, SEEDS if a.seeds is None else a.seeds
        seeds = cli.number_list(a.seeds, "--seeds", unique=False)  # in order: the first is the one timed and shown
        shape = not isinstance(a.tree, (int, type(None)))  # --tree N/D/k, not a node budget N
        a.given = a.gamma is not None or shape  # the decoders themselves: nothing searched
        a.gamma, a.tree = a.gamma or evaluate.GAMMA, (0 if a.given else evaluate.TREE.nodes) if a.tree is None else a.tree
        budget = 0 if shape else a.tree  # --tree N: the search's node budget
        for bad, msg in ((budget and not any(sh.nodes <= budget for sh in TREES), f"--tree {a.tree}: the smallest "
                          f"tree rsd.py chooses from has {min(sh.nodes for sh in TREES)} nodes (0: chain rows only)"),
                         (a.given and (budget or a.search), "--gamma and --tree N/D/k give the decoders (no search on "
                          "val): they take no --search, and a tree as N/D/k (or 0)"),
                         # below: both are taken from the --scenes held-out scenes
                         (a.time_scenes > a.scenes or a.show > a.scenes, f"--time-scenes ({a.time_scenes}) and --show "
                          f"({a.show}) must be at most --scenes ({a.scenes})"),
                         (len(set(seeds)) < len(seeds),  # a repeated seed would count twice in the mean and spread
                          f"--seeds must not repeat a seed, got {a.seeds!r}"),
                         (not 0 <= a.stream <= driving.MAX_CLIPS or not 2 <= a.stream_frames <= driving.MAX_CLIP_FRAMES,
                          f"--stream takes 0..{driving.MAX_CLIPS} clips (0: off), --stream-frames "
                          f"2..{driving.MAX_CLIP_FRAMES} frames; got {a.stream}, {a.stream_frames}"),
                         (a.stream_frames != ap.get_default("stream_frames") and not a.stream,
                          "--stream-frames goes with --stream"),
                         (a.stream_samples != ap.get_default("stream_samples") and not (a.stream and a.temperature),
                          "--stream-samples goes with --stream and --temperature > 0"),
                         (a.stream_samples < 1, f"--stream-samples takes an int >= 1, got {a.stream_samples}"),
                         (a.stream and (a.relaxed or a.compile), "--stream times eager lossless decodes: it takes no "
                          "--relaxed or --compile")):
            if bad:
                raise ValueError(msg)
        tok = driving.Tokenizer()
        ids = tok.encode(driving.commitment_words())  # the toy's commitments: the grammar's choices
        sampling = flags.sampling(a.temperature, a.top_k, a.top_p, a.sampling_seed,
                                flags.relaxed_rule(a.relaxed, a.commitments, ids, len(tok)))
        device = cli.check_device(a.device)
        if a.drafts:
            seeds = named_drafts(a)
    return ap, a, seeds, sampling, device


if __name__ == "__main__":
    main()
