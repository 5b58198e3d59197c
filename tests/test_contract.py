"""One contract for every program a user runs (issue #52), tested over every program the README and docs/ name, not
case by case: `--out` a directory (or, for a folder output, a file), `--out` in a missing folder, a negative count,
Ctrl-C after the first progress line (exit 130, one line, no partial file) and `--json` (one JSON line on stdout).
Every member ends before any heavy work: a refusal at the flags, or an interrupt at the first line a program prints.

run: python -m pytest -q tests/test_contract.py
"""
import glob
import importlib
import io
import json
import os
import re
import signal
import sys
import types

import pytest
import torch

from ops import cli
from measure import flags
from test_user_errors import tiny_run  # noqa: F401 (a fixture: a run folder of tiny models)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXP = os.path.join(ROOT, "experiments")
if EXP not in sys.path:  # the experiments import as modules, as tests/test_shipped.py does
    sys.path.insert(0, EXP)

# program: (module, output kind (a file, a folder, none), a count flag, whether it has --json, the argv of a cheap run
# whose first line comes before any heavy work ({tmp}: a fresh folder, {run}: a run folder of tiny models)). Every
# flag a member adds goes after these, so argparse's last value wins.
PROGRAMS = {
    "bench.py": ("bench", "file", "--prompts", True,
                 "--prompts 1 --max-new 4 --repeats 3 --tree 0 --gamma 2 --out {tmp}/b.json"),
    # bench.py's other modes (its subcommands; the toy is the default): their own flags, the same contract
    "bench.py preset": ("bench", "file", "--images", True, "preset qwen2.5-vl-7b --layers 1 --images 1 --max-new 3 "
                        "--repeats 3 --tree 0 --gamma 2 --out {tmp}/b.json"),
    "bench.py real": ("bench", "file", "--images", True, "real --target {tmp}/t --max-new 3 --repeats 3 --tree 0 "
                      "--gamma 2 --out {tmp}/b.json"),
    "rsd.py": ("rsd", None, "--scenes", True, "--scenes 2 --time-scenes 1 --show 0 --seeds 0 --gamma 2"),
    "train.py": ("train", "folder", "--n-train", False, "--out {tmp}/run"),
    "aarl.py": ("aarl", "folder", "--n-report", True, "--run {run} --out {tmp}/aarl"),
    "driving.py": ("driving", None, "--n", False, "--n 1"),
    "real.distill": ("real.distill", "folder", "--steps", False, "--target {tmp}/t --toy-scenes 2 --out {tmp}/d"),
    "real.aarl_real": ("real.aarl_real", "folder", "--steps", True,
                       "--target {tmp}/t --draft {tmp}/q --scenes {tmp}/s --out {tmp}/a"),
    "experiments/gpu_check.py": ("gpu_check", "folder", "--reps", False,
                                 "--device cpu --layers 1 --stages a_env --out {tmp}/g"),
    "experiments/peer_hf.py": ("peer_hf", "file", "--prompts", True, "--prompts 1 --max-new 4 --out {tmp}/p.json"),
    "experiments/figures.py": ("figures", "folder", None, False, "--out {tmp}/f"),
    "experiments/aarl_ablation.py": ("aarl_ablation", "file", "--n-report", False,
                                     "--seeds 0 --references static --work {tmp}/w --out {tmp}/a.json"),
    "experiments/views_sweep.py": ("views_sweep", "file", "--scenes", False, "--work {tmp}/w --out {tmp}/v.json"),
    "experiments/tree_real.py": ("tree_real", "file", "--reps", False, "--out {tmp}/t.json"),
    "experiments/toy_roundtrip.py": ("toy_roundtrip", "file", "--n-test", False, "--work {tmp}/w --out {tmp}/t.json"),
    "experiments/relaxed_acceptance.py": ("relaxed_acceptance", "file", "--scenes", False,
                                          "--seeds 0 --bounds 0,1 --out {tmp}/r.json --figure {tmp}/r.png"),
    "experiments/draft_vocab.py": ("draft_vocab", "file", "--steps", False, "--toy --work {tmp}/w --out {tmp}/d.json"),
    "experiments/data_stage_ab.py": ("data_stage_ab", "file", "--pairs", False, "--work {tmp}/w --out {tmp}/d.json"),
    "experiments/tree_sweep.py": ("tree_sweep", "file", "--scenes", False, "--out {tmp}/t.json"),
    "experiments/tree_paths.py": ("tree_paths", "file", "--scenes", False, "--out {tmp}/t.json"),
    "experiments/rope_base.py": ("rope_base", "file", "--scenes", False, "--work {tmp}/w --out {tmp}/r.json"),
    "experiments/learning_speed.py": ("learning_speed", "file", "--scenes", False, "--work {tmp}/w --out {tmp}/l.json"),
    "experiments/history_prefill.py": ("history_prefill", "file", "--scenes", False,
                                       "--scenes 1 --repeats 1 --out {tmp}/h.json"),
    "experiments/stream.py": ("stream", "file", "--clips", False,
                              "--clips 1 --sweep-clips 1 --frames 2 --rates 1 --seeds 1 --out {tmp}/s.json"),
    "experiments/stream_lookup.py": ("stream_lookup", "file", "--clips", False,
                                     "--clips 1 --check 0 --out {tmp}/l.json"),
    "experiments/cost_per_1000_scenes.py": ("cost_per_1000_scenes", "file", "--reps", False, "--out {tmp}/c.json"),
    "experiments/choose_grid.py": ("choose_grid", "file", "--prompts", False,
                                   "--prompts 1 --repeats 1 --out {tmp}/c.json"),
    "experiments/choose_tail.py": ("choose_tail", "file", None, False, "--out {tmp}/c.json"),
    "experiments/choose_repeat.py": ("choose_repeat", "file", "--runs", False, "--runs 1 --out {tmp}/c.json"),
    "experiments/profile_rsd.py": ("profile_rsd", "file", "--scenes", False,
                                   "--out {tmp}/p.json --scenes 2 --time-scenes 1 --show 0 --seeds 0 --gamma 2"),
    "experiments/render_scenes.py": ("render_scenes", None, "--n", False, "--n 1"),
    "experiments/speculate_demo.py": ("speculate_demo", None, "--tokens", False, "--tokens 4 --gamma 2"),
    "experiments/ship_toy.py": ("ship_toy", "folder", None, False,
                                "--run {run} --out {tmp}/ship --kinds flat --seeds 0"),
    # A/B tools over checkouts of the repo ({root}: this one), printing their measurements: no output file
    "experiments/decode_ab.py": ("decode_ab", None, "--pairs", False, "--a {root} --compile --pairs 1 --scenes 1"),
    "experiments/step_ab.py": ("step_ab", None, "--rounds", False, "{root} --rounds 1"),
    "experiments/greedy_stage_ab.py": ("greedy_stage_ab", None, "--visits", False, "{root} --visits 1"),
    # reads two JSON files and compares them at once: no output, no count, no stage to interrupt
    "experiments/compare_rsd.py": ("compare_rsd", None, None, False, None),
    # counts the repo's lines per room (git's tracked files): no flags but revisions, no output
    "experiments/lines.py": ("lines", None, None, False, None),
    # rewrites the reports it is given in place, atomically: no output of its own, no count
    "experiments/migrate_arms.py": ("migrate_arms", None, None, False, None),
}


def documented():
    """Every `python X.py`, `python experiments/X.py` and `python -m X` the README and docs/ tell a user to run."""
    text = " ".join(open(p).read() for p in [os.path.join(ROOT, "README.md"), *glob.glob(f"{ROOT}/docs/*.md")])
    text = re.sub(r"\s+", " ", text)  # a command wrapped over two lines
    found = re.findall(r"python (?:-m ([\w.]+)|((?:experiments/)?\w+\.py))", text)
    modes = {f"bench.py {m}" for m in re.findall(r"python bench\.py (preset|real)\b", text)}  # its subcommands
    return {m or p for m, p in found} - {"pytest"} | modes


def command_lines():
    """Every experiment a user runs from the command line (it has a __main__ block)."""
    return {f"experiments/{os.path.basename(p)}" for p in glob.glob(f"{EXP}/*.py")
            if 'if __name__ == "__main__":' in open(p).read()}


def test_every_documented_program_is_in_the_contract():
    """A program the docs name, or an experiment with a command line, is covered the day it lands, or named here as
    missing."""
    docs = documented() | command_lines()
    assert not docs - set(PROGRAMS), f"programs with no contract entry: {sorted(docs - set(PROGRAMS))}"
    extra = sorted(set(PROGRAMS) - docs)
    assert not extra, f"contract entries no doc names and no command line: {extra}"
    for name, spec in PROGRAMS.items():
        assert os.path.isfile(os.path.join(ROOT, name.replace(".", "/") + ".py" if spec[0].startswith("real.") else
                                           name.split()[0])), name


def run(name, argv, capsys):
    """(exit status, stdout, stderr) of the program's main(argv), in this process."""
    main = importlib.import_module(PROGRAMS[name][0]).main
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def error_line(err):
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert lines, err
    return lines[-1]


def cheap_argv(name, tmp, run_dir):
    (tmp / "t").mkdir(exist_ok=True)  # folders a real-target program requires to exist (they stay empty)
    (tmp / "q").mkdir(exist_ok=True)
    (tmp / "s").mkdir(exist_ok=True)
    return PROGRAMS[name][4].format(tmp=tmp, run=run_dir, root=ROOT).split()


def listing(folder):
    """Every file under folder (an output folder made before the work may stay, empty)."""
    return sorted(os.path.relpath(os.path.join(d, n), folder) for d, _, names in os.walk(folder) for n in names)


FILE_OUTS = [n for n, s in PROGRAMS.items() if s[1] == "file"]
FOLDER_OUTS = [n for n, s in PROGRAMS.items() if s[1] == "folder"]


@pytest.mark.parametrize("name", FILE_OUTS + FOLDER_OUTS)
def test_out_that_cannot_take_the_output_is_one_line(name, tmp_path, tiny_run, capsys):  # noqa: F811
    """--out a directory (a file program) or a file (a folder program): one line naming --out, nothing written."""
    wrong = tmp_path / "wrong"
    wrong.mkdir() if PROGRAMS[name][1] == "file" else wrong.write_text("keep me")
    argv = cheap_argv(name, tmp_path, tiny_run)
    before = listing(tmp_path)
    code, _, err = run(name, argv + ["--out", str(wrong)], capsys)
    assert code == 2 and ("--out" in error_line(err) or str(wrong) in error_line(err)), err
    assert listing(tmp_path) == before


@pytest.mark.parametrize("name", FILE_OUTS)
def test_out_in_a_missing_folder_is_one_line(name, tmp_path, tiny_run, capsys):  # noqa: F811
    """Not created, not reported as a full disk: the folder that does not exist is named before any work."""
    argv = cheap_argv(name, tmp_path, tiny_run)
    code, _, err = run(name, argv + ["--out", str(tmp_path / "missing" / "x.json")], capsys)
    assert code == 2 and f"its folder {tmp_path / 'missing'} does not exist" in error_line(err)
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("name", [n for n, s in PROGRAMS.items() if s[2]])
def test_a_negative_count_is_one_line_naming_its_flag(name, tmp_path, tiny_run, capsys):  # noqa: F811
    flag = PROGRAMS[name][2]
    code, _, err = run(name, cheap_argv(name, tmp_path, tiny_run) + [flag, "-1"], capsys)
    assert code == 2 and flag in error_line(err)


class Interrupting(io.StringIO):
    """A stdout / stderr that sends this process a SIGINT (a Ctrl-C) once the first whole line is written."""

    def __init__(self, armed):
        super().__init__()
        self.armed = armed

    def write(self, text):
        n = super().write(text)
        if self.armed["on"] and "\n" in text:
            self.armed["on"] = False
            self.armed["at"] = self.armed["err"].tell()  # what stderr held before the Ctrl-C
            signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt here, as a Ctrl-C would
        return n


@pytest.mark.parametrize("name", [n for n, s in PROGRAMS.items() if s[4]])
def test_ctrl_c_after_the_first_line_is_one_line_and_130(name, tmp_path, tiny_run, monkeypatch):  # noqa: F811
    """The first line a program prints comes before its heavy work; a Ctrl-C right after it ends the program with one
    line on stderr, exit status 130, and no file written (a partial one or a temporary one)."""
    argv = cheap_argv(name, tmp_path, tiny_run)
    before = listing(tmp_path)
    armed = {"on": True}
    out = Interrupting(armed)
    err = armed["err"] = Interrupting(armed)
    main = importlib.import_module(PROGRAMS[name][0]).main
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with monkeypatch.context() as m:
            m.setattr(sys, "stdout", out)
            m.setattr(sys, "stderr", err)
            try:
                main(argv)
                code = 0
            except SystemExit as e:
                code = e.code
            except KeyboardInterrupt:
                code = "a traceback"  # what the user would see: the Ctrl-C escaped the program
    finally:
        signal.signal(signal.SIGINT, handler)
    assert not armed["on"], f"{name} printed no line"
    after = err.getvalue()[armed["at"]:].splitlines()
    assert code == 130 and "Traceback" not in err.getvalue(), (code, err.getvalue())
    assert len(after) == 1 and "interrupted" in after[0], after
    assert listing(tmp_path) == before


# ---- --json: one JSON line on stdout, everything else on stderr ----
def canned(path):
    return json.load(open(os.path.join(EXP, path)))


def noisy(result):
    """A stand-in for a program's work: it prints to stdout, as the real work does, and returns result."""
    def work(*a, **k):
        print("a line of the work's own report")
        return result
    return work


def stub_bench(monkeypatch):
    import bench
    for mode in ("toy", "real"):  # real: a preset's and a real checkpoint's work
        monkeypatch.setattr(bench, mode, noisy(canned("bench_cpu_tree.json")))


def stub_rsd(monkeypatch):
    import rsd
    monkeypatch.setattr(rsd, "run", noisy({"rows": []}))


def stub_aarl(monkeypatch):
    import aarl
    res = canned("aarl_ablation.json")["runs"][0]
    for split in ("val", "test"):  # the gammas, JSON's string keys, back to ints
        for when in ("before", "after"):
            res[when][split]["tau_by_gamma"] = {int(g): v for g, v in res[when][split]["tau_by_gamma"].items()}
    monkeypatch.setattr(aarl, "_run", noisy(res))


def stub_peer(monkeypatch):
    import peer_hf
    monkeypatch.setattr(peer_hf, "compare", noisy({}))
    monkeypatch.setattr(peer_hf, "report_lines", lambda res, dtype: ["a line of the report"])
    monkeypatch.setattr(peer_hf.checkpoint, "load", lambda *a, **k: torch.nn.Linear(1, 1))


def stub_aarl_real(monkeypatch):
    from real import aarl_real
    target = types.SimpleNamespace(embed_tokens=torch.nn.Embedding(1, 1))
    monkeypatch.setattr(aarl_real, "load_real", noisy((target, torch.nn.Linear(1, 1), None, [None], None, None)))

    def train(*a, log, **k):
        print("a line of the work's own report")
        log({"step": 0, "reward": 1.0})
    monkeypatch.setattr(aarl_real, "train_real", train)
    monkeypatch.setattr(aarl_real.checkpoint, "save", lambda *a, **k: None)


STUBS = {"bench.py": stub_bench, "bench.py preset": stub_bench, "bench.py real": stub_bench, "rsd.py": stub_rsd,
         "aarl.py": stub_aarl, "experiments/peer_hf.py": stub_peer, "real.aarl_real": stub_aarl_real}


def test_every_json_program_is_stubbed():
    assert set(STUBS) == {n for n, s in PROGRAMS.items() if s[3]}


@pytest.mark.parametrize("name", sorted(STUBS))
def test_json_is_one_line_on_stdout(name, tmp_path, tiny_run, monkeypatch, capsys):  # noqa: F811
    """The work (stubbed: it prints a line of its own) and the report go to stderr; stdout is the one JSON line."""
    STUBS[name](monkeypatch)
    code, out, err = run(name, cheap_argv(name, tmp_path, tiny_run) + ["--json"], capsys)
    assert code == 0, err
    assert len(out.splitlines()) == 1 and isinstance(json.loads(out), dict), out[:300]
    assert "a line of the work's own report" in err


# ---- no default output lands on a file the repo ships ----
class Parsed(Exception):
    """Raised where a program would parse its flags: its parser is caught, nothing runs."""


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_no_default_output_is_a_file_the_repo_ships(name, monkeypatch):
    """Every output flag's default (--out, --figure, --work) lies under the git-ignored runs/: a quick run never
    replaces a committed result; the README and experiments/reproduce_toy.sh pass the committed paths explicitly."""
    import argparse
    import subprocess
    parsers = []

    def parse_args(self, *a, **k):
        parsers.append(self)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_args)
    with pytest.raises(Parsed):
        importlib.import_module(PROGRAMS[name][0]).main([])
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    actions = parsers[0]._actions  # and a program's subcommands' (bench.py's modes)
    actions += [a for sub in actions if isinstance(sub, argparse._SubParsersAction) for q in sub.choices.values()
                for a in q._actions]
    for action in actions:
        if action.dest in ("out", "figure", "work") and action.default not in (None, argparse.SUPPRESS):
            path = os.path.relpath(os.path.abspath(os.path.join(ROOT, action.default)), ROOT)
            assert path.split(os.sep)[0] == "runs", f"{name} --{action.dest} defaults to {action.default}"
            assert not any(t == path or t.startswith(path + os.sep) for t in tracked), (name, path)


def test_a_real_ctrl_c_from_outside_is_one_line_and_130(tmp_path):
    """The in-process members above raise the signal themselves; here SIGINT comes from outside, to a subprocess, as a
    terminal's Ctrl-C does, after its first progress line: exit status 130, one line, no report file (partial or
    temporary)."""
    import subprocess
    out = tmp_path / "b.json"
    proc = subprocess.Popen([sys.executable, "bench.py", "--prompts", "1", "--max-new", "4", "--repeats", "3", "--tree",
                             "0", "--gamma", "2", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        rest, code = proc.stderr.read().splitlines(), proc.wait(timeout=120)
    finally:
        proc.kill()
    assert first.startswith("[") and code == 130, (first, rest, code)
    assert len(rest) == 1 and rest[0].startswith("bench.py toy: interrupted"), rest
    assert os.listdir(tmp_path) == []


# ---- a file a program opens, named by a flag or found by listing a folder, is a regular file (issue #59) ----
def plant_fifo(path):
    """A FIFO at path (its folder made): opening it would wait for a writer forever."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.remove(path)
    os.mkfifo(path)
    return path


def hf_folder(tmp, shard):
    """{tmp}/t: a tiny Qwen3-VL's config, and an index that maps its weights to `shard` (a FIFO the door plants)."""
    pytest.importorskip("transformers")
    from tiny_models import hf_qwen3
    d = tmp / "t"
    d.mkdir(exist_ok=True)
    hf_qwen3().config.to_json_file(d / "config.json")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
    return d


# door: (program, argv ({tmp}, {run}), where the FIFO goes (relative to tmp), what the one line names)
INPUT_DOORS = {
    "an image listed in --images-dir": ("bench.py real", "real --target {tmp}/t --images-dir {tmp}/img",
                                        "img/00.png", "00.png: is not a regular file"),
    "a --target's config.json": ("bench.py real", "real --target {tmp}/t", "t/config.json",
                                 "config.json: is not a regular file"),
    "a --target's shard, listed by its index": ("bench.py real", "real --target {tmp}/t", "t/shard-1.safetensors",
                                                "shard-1.safetensors: is not a regular file"),
    "a --draft's weights": ("bench.py", "--draft {tmp}/q --prompts 1 --tree 0 --gamma 2 --out {tmp}/b.json",
                            "q/model.safetensors", "model.safetensors: is not a regular file"),
    "a --run's target weights (rsd.py)": ("rsd.py", "--run {run} --drafts flat={run}/draft_flat_s0 --scenes 2 --time-scenes 1 --show 0",
                                          "run/target/model.safetensors", "model.safetensors: is not a regular file"),
    "a --run's target weights (aarl.py)": ("aarl.py", "--run {tmp}/run --out {tmp}/a", "run/target/model.safetensors",
                                           "model.safetensors: is not a regular file"),
    "a --target's config.json (real.distill)": ("real.distill", "--target {tmp}/t --toy-scenes 2 --out {tmp}/d",
                                                "t/config.json", "config.json: is not a regular file"),
    "a --draft's weights (real.aarl_real)": ("real.aarl_real", "--target {tmp}/t --draft {tmp}/q --scenes {tmp}/s "
                                             "--out {tmp}/a", "q/model.safetensors",
                                             "model.safetensors: is not a regular file"),
    "a --target's config.json (real.aarl_real)": ("real.aarl_real", "--target {tmp}/t --draft {tmp}/q --scenes "
                                                  "{tmp}/s --out {tmp}/a", "t/config.json",
                                                  "config.json: is not a regular file"),
    "a --run's target weights (train.py --stage drafts)": ("train.py", "--stage drafts --out {tmp}/run",
                                                           "run/target/model.safetensors",
                                                           "model.safetensors: is not a regular file"),
    "compare_rsd's earlier report": ("experiments/compare_rsd.py", "{tmp}/old.json {tmp}/new.json", "old.json",
                                     "old.json: is not a regular file"),
    "a report migrate_arms rewrites": ("experiments/migrate_arms.py", "{tmp}/old.json", "old.json",
                                       "old.json: is not a regular file"),
    "figures' --rsd-json": ("experiments/figures.py", "--out {tmp}/f --rsd-json {tmp}/r.json", "r.json",
                            "r.json: is not a regular file"),
    "tree_real's --sweep": ("experiments/tree_real.py", "--out {tmp}/t.json --sweep {tmp}/s.json", "s.json",
                            "s.json: is not a regular file"),
    "gpu_check's --toy-json": ("experiments/gpu_check.py", "--device cpu --layers 1 --stages a_env --out {tmp}/g "
                               "--toy-json {tmp}/toy.json", "toy.json", "toy.json: is not a regular file"),
    "a --run's target weights (profile_rsd.py)": ("experiments/profile_rsd.py", "--out {tmp}/p.json --run {tmp}/run "
                                                  "--drafts flat={tmp}/run/draft_flat_s0 --scenes 2 --time-scenes 1 "
                                                  "--show 0", "run/target/model.safetensors",
                                                  "model.safetensors: is not a regular file"),
    "ship_toy.py's --run target": ("experiments/ship_toy.py", "--run {tmp}/run --out {tmp}/ship",
                                   "run/target/model.safetensors", "model.safetensors: is not a regular file"),
    **{f"{n}'s checkout's target weights": (f"experiments/{n}.py", argv, "co/checkpoints/toy/target/model.safetensors",
                                            "co: its checkpoints/toy/target/model.safetensors: is not a regular file")
       for n, argv in (("decode_ab", "--a {tmp}/co --compile"), ("step_ab", "{tmp}/co"),
                       ("greedy_stage_ab", "{tmp}/co"))},
    "stream.py --replot's --out": ("experiments/stream.py", "--replot --out {tmp}/s.json --figure {tmp}/s.png",
                                   "s.json", "s.json exists and is not a regular file"),
}


@pytest.mark.parametrize("door", sorted(INPUT_DOORS))
def test_a_fifo_where_a_file_is_read_is_one_line(door, tmp_path, tiny_run, capsys):  # noqa: F811
    """Every door a program reads a file through, with a FIFO behind it: one line naming the file, never a hang (a
    10 s alarm turns a hang into a failure)."""
    name, argv, where, says = INPUT_DOORS[door]
    import shutil
    for d in "ts":  # tiny_run is tmp_path / "run"
        (tmp_path / d).mkdir(exist_ok=True)
    if "draft" in door or "aarl_real" in door:
        shutil.rmtree(tmp_path / "q", ignore_errors=True)
        shutil.copytree(tiny_run / "draft_flat_s0", tmp_path / "q")
    if "shard" in door:
        hf_folder(tmp_path, "shard-1.safetensors")
    plant_fifo(tmp_path / where)
    argv = argv.format(tmp=tmp_path, run=tiny_run).split()

    def hang(*_):
        raise TimeoutError(f"{door}: the program waited on the FIFO")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    try:
        code, _, err = run(name, argv, capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert code != 0 and says in error_line(err), err


# ---- what a program writes is never an input, a shipped model, another output of the run, or another's file ----
SHIPPED_WEIGHTS = os.path.join(ROOT, "checkpoints", "toy", "target", "model.safetensors")
# every output flag of every program beyond --out: figures, and --work folders of trained drafts
MORE_OUTS = {"experiments/relaxed_acceptance.py": ("--figure",), "experiments/stream.py": ("--figure",),
             **{f"experiments/{n}.py": ("--work",) for n in ("aarl_ablation", "data_stage_ab", "draft_vocab",
                                                             "learning_speed", "rope_base", "toy_roundtrip",
                                                             "views_sweep")}}


@pytest.mark.parametrize("name,flag", [(n, f) for n in FILE_OUTS + FOLDER_OUTS
                                       for f in ("--out", *MORE_OUTS.get(n, ()))])
def test_no_output_flag_writes_inside_the_shipped_checkpoints(name, flag, tmp_path, tiny_run, capsys):  # noqa: F811
    """The family of issue #59's losses (stream.py wrote over the shipped weights): every output flag of every
    program, pointed at the shipped target's weights (a file output) or its folder (a folder output), is one line before any
    work, and the shipped files are as they were."""
    folder = flag == "--work" or flag == "--out" and PROGRAMS[name][1] == "folder"
    where = os.path.dirname(SHIPPED_WEIGHTS) if folder else SHIPPED_WEIGHTS
    before = sorted(os.listdir(os.path.dirname(SHIPPED_WEIGHTS))), open(SHIPPED_WEIGHTS, "rb").read(64)
    code, _, err = run(name, cheap_argv(name, tmp_path, tiny_run) + [flag, where], capsys)
    assert code == 2 and "checkpoints/toy" in error_line(err), err  # one line naming it (the shipped, or a target's)
    assert (sorted(os.listdir(os.path.dirname(SHIPPED_WEIGHTS))), open(SHIPPED_WEIGHTS, "rb").read(64)) == before


OUTPUT_DOORS = {  # (program, the flags after its cheap argv, what the one line says)
    "stream.py --figure its own --out": ("experiments/stream.py", "--figure {tmp}/s.json", "is also this run's --out"),
    "stream.py --replot onto its --out": ("experiments/stream.py", "--replot --figure {tmp}/s.json",
                                          "is also this run's --out"),
    "stream.py --out another program's JSON": ("experiments/stream.py", "--out {tmp}/other.json",
                                               "is not an output of experiments/stream.py"),
    "stream_lookup.py --out another program's JSON": ("experiments/stream_lookup.py", "--out {tmp}/other.json",
                                                      "is not an output of experiments/stream_lookup.py"),
}


@pytest.mark.parametrize("door", sorted(OUTPUT_DOORS))
def test_an_output_that_would_destroy_something_is_one_line(door, tmp_path, tiny_run, capsys):  # noqa: F811
    name, more, says = OUTPUT_DOORS[door]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"command": "python rsd.py", "rows": []}))
    before = {p: open(p, "rb").read(64) for p in (SHIPPED_WEIGHTS, other)}
    code, _, err = run(name, cheap_argv(name, tmp_path, tiny_run) + more.format(tmp=tmp_path).split(), capsys)
    assert code == 2 and says in error_line(err), err
    assert {p: open(p, "rb").read(64) for p in before} == before


def test_an_experiment_rewrites_its_own_output(tmp_path, capsys):
    """Its own earlier JSON (its command) is replaced; checked by own_output, the rule of every `program=` output."""
    own = tmp_path / "s.json"
    own.write_text(json.dumps({"command": "python experiments/stream.py --clips 1"}))
    assert cli.check_out(str(own), program="experiments/stream.py") == str(own)
    with pytest.raises(ValueError, match="not an output of experiments/stream_lookup.py"):
        cli.check_out(str(own), program="experiments/stream_lookup.py")


# ---- counts, sizes and floats bounded before any work (issue #59: each of these hung or ran on silently) ----
BOUND_DOORS = {  # (program, flags after its cheap argv, what the one line says)
    "bench.py --stream 10**8": ("bench.py", "--stream 100000000", "--stream takes 0..1000 frames"),
    "bench.py --stream-interval inf": ("bench.py", "--stream 3 --stream-interval inf", "must be a finite number > 0"),
    "bench.py --stream-interval nan": ("bench.py", "--stream 3 --stream-interval nan", "must be a finite number > 0"),
    "rsd.py --stream-frames 10**8": ("rsd.py", "--stream 1 --stream-frames 100000000", "--stream-frames 2..1000"),
    "rsd.py --stream 10**8": ("rsd.py", "--stream 100000000", "--stream takes 0..10000 clips"),
    "stream.py --frames 10**8": ("experiments/stream.py", "--frames 100000000", "2..1000 frames"),
    "stream.py --clips 10**8": ("experiments/stream.py", "--clips 100000000", "0..10000 clips"),
    "stream.py --rates nan": ("experiments/stream.py", "--rates nan", "a per-frame probability"),
    "stream.py --default-only --rate1-only": ("experiments/stream.py", "--default-only --rate1-only",
                                              "not allowed with argument"),
    "stream_lookup.py --time swap 7": ("experiments/stream_lookup.py", "--time 32/2/7/8", "swap 0 or 1"),
    "stream_lookup.py --time M 0": ("experiments/stream_lookup.py", "--time 0/2/1/8", "M and alpha ints >= 1"),
    "stream_lookup.py --check -1": ("experiments/stream_lookup.py", "--check -1", "--check takes a number of clips"),
    "train.py --stage drafts without a target": ("train.py", "--stage drafts --out {tmp}/fresh", "holds none"),
}


@pytest.mark.parametrize("door", sorted(BOUND_DOORS))
def test_a_count_or_float_out_of_bounds_is_one_line_before_any_work(door, tmp_path, tiny_run, monkeypatch,
                                                                     capsys):  # noqa: F811
    """Refused at the flags, within seconds: a 20 s alarm turns a build of 10**8 frames into a failure."""
    name, more, says = BOUND_DOORS[door]

    def hang(*_):
        raise TimeoutError(f"{door}: not refused before the work")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(20)
    try:
        code, _, err = run(name, cheap_argv(name, tmp_path, tiny_run) + more.format(tmp=tmp_path).split(), capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert code == 2 and says in error_line(err), err


# ---- a report's identity fields come from what ran: a lossy decode is never called identical (issue #59) ----
@pytest.mark.parametrize("exact, lossy, whole", [
    (True, None, True), (False, None, False), (None, None, None),  # lossless runs: the exact decodes' own
    (True, False, False), (True, True, True),  # a lossy section whose outputs changed makes the whole run's False
    (None, False, None), (False, True, False)])
def test_identity_fields_are_the_whole_runs(exact, lossy, whole):
    got = flags.identity(exact, lossy)
    assert got == {"greedy_match": whole, "lossy": lossy is not None, "exact_greedy_match": exact}


RUN_READERS = ["bench.py", "rsd.py", "aarl.py", "experiments/choose_grid.py", "experiments/history_prefill.py",
               "experiments/stream.py", "experiments/stream_lookup.py", "experiments/tree_paths.py",
               "experiments/tree_sweep.py", "experiments/relaxed_acceptance.py", "experiments/peer_hf.py",
               "experiments/aarl_ablation.py", "experiments/draft_vocab.py", "experiments/rope_base.py",
               "experiments/toy_roundtrip.py", "experiments/views_sweep.py"]
# programs that open no file a user names or plants (their own outputs aside: the output doors above)
READS_NOTHING = {"driving.py": "the world is built from its seed",
                 "bench.py preset": "random weights of a preset's shape",
                 "experiments/data_stage_ab.py": "trains its own target and drafts in --work",
                 "experiments/learning_speed.py": "trains its own models; --plot-only reads its --out (an output door)",
                 "experiments/cost_per_1000_scenes.py": "random weights of a preset's shape",
                 "experiments/lines.py": "git's tracked files",
                 "experiments/choose_tail.py": "the shipped checkpoints and the committed grids' JSONs",
                 "experiments/choose_repeat.py": "the shipped checkpoints and the committed grids' JSONs",
                 "experiments/render_scenes.py": "the world is built from its seed",
                 "experiments/speculate_demo.py": "a random target of a preset's shape"}


def test_every_program_is_in_a_table_of_the_files_it_reads():
    """The family of issue #59's FIFO: each program in the contract has its input doors walked above (a file named by
    a flag, a file found by listing a folder, a --run's weights), or says why it reads none."""
    walked = {d[0] for d in INPUT_DOORS.values()} | set(RUN_READERS) | set(READS_NOTHING)
    assert set(PROGRAMS) == walked, sorted(set(PROGRAMS) ^ walked)


@pytest.mark.parametrize("name", RUN_READERS)
def test_every_run_reader_refuses_a_fifo_for_its_weights(name, tmp_path, tiny_run, capsys):  # noqa: F811
    """Every program that reads a --run folder's target, given one whose weights are a FIFO: one line, no hang."""
    plant_fifo(tiny_run / "target" / "model.safetensors")

    def hang(*_):
        raise TimeoutError(f"{name}: waited on the FIFO")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(15)
    try:
        argv = cheap_argv(name, tmp_path, tiny_run) + ["--run", str(tiny_run)]
        if name == "rsd.py":  # the tiny run has two draft kinds: --drafts names one (and takes no --seeds)
            argv = f"--run {tiny_run} --drafts flat={tiny_run / 'draft_flat_s0'} --scenes 2 --time-scenes 1 --show 0".split()
        if name == "bench.py":
            argv += ["--draft", str(tiny_run / "draft_flat_s0")]
        code, _, err = run(name, argv, capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert code != 0 and "model.safetensors: is not a regular file" in error_line(err), err
