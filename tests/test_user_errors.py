"""What a user points a command at is never destroyed, a bad flag is one line before any work, and an expected error
(a bad value, a missing or existing file, a full disk) is one line `script: error: ...` with no traceback (issue #24).
Each test stops before any training: tiny models, a few seconds for the file.

run: python -m pytest -q tests/test_user_errors.py
"""
import json
import os
import shutil

import pytest
import torch

import aarl
import bench
from model import make_draft
from ops import checkpoint, files
from measure import flags, timing
from real import hf
import rsd
from tiny_models import tiny_model
import train as T


def error_line(capsys):
    """The one error line a script printed (argparse's `prog: error: ...`), and that no traceback came with it."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if ": error: " in line][-1]


def snapshot(path):
    """{relative path: bytes} of everything under path (or the file itself)."""
    if os.path.isfile(path):
        return {"": open(path, "rb").read()}
    return {os.path.relpath(os.path.join(d, n), path): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(path) for n in names}


class Started(Exception):
    """Raised where a script's work would start: every check before it has passed."""


@pytest.fixture
def tiny_run(tmp_path):
    """A run folder laid out as train.py leaves a finished (or shipped) one: target/, draft_{flat,mrope}_s0/, notes,
    and no *.state.pt."""
    run = tmp_path / "run"
    target = tiny_model()
    checkpoint.save(target, str(run / "target"))
    for kind in ("flat", "mrope"):
        checkpoint.save(make_draft(target, kind=kind), checkpoint.draft_dir(str(run), kind, 0), target=target)
    (run / "metrics.json").write_text("{}")
    return run


# ---- case 1: a save never replaces what is not a checkpoint of its kind ----

def test_save_refuses_to_replace_a_folder_a_file_or_another_kind(tiny_run, tmp_path):
    target = tiny_model()
    draft = make_draft(target, kind="flat")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    (tmp_path / "plain").write_text("keep me too")
    before = {p: snapshot(p) for p in (str(tiny_run), str(notes), str(tmp_path / "plain"))}
    for dest, what in ((tiny_run, r"a folder of 4 entries \(draft_flat_s0"), (notes, "a folder of 1 entries"),
                       (tmp_path / "plain", "a file"), (tiny_run / "draft_mrope_s0", "a mrope draft checkpoint"),
                       (tiny_run / "target", "a target checkpoint")):
        with pytest.raises(FileExistsError, match=f"holds {what}.*not a flat draft checkpoint: refusing"):
            checkpoint.save(draft, str(dest), target=target)
    assert {p: snapshot(p) for p in before} == before
    # a checkpoint of the same kind is replaced, and an empty folder holds nothing to lose
    checkpoint.save(draft, str(tiny_run / "draft_flat_s0"), target=target)
    (tmp_path / "empty").mkdir()
    checkpoint.save(draft, str(tmp_path / "empty"), target=target)
    assert checkpoint.existing_kind(str(tmp_path / "empty")) == "flat draft"


def test_aarl_out_never_deletes_what_it_is_pointed_at(tiny_run, tmp_path, capsys):
    """The issue's `aarl.py --run runs/copy --out runs/copy`, a folder of notes, a plain file, another kind of draft:
    one line, before any work, nothing touched; an existing FlatRoPE draft only with --overwrite."""
    (tmp_path / "plain").write_text("x")
    before = snapshot(str(tiny_run))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    for out, msg, more in ((tiny_run, f"--out {tiny_run} contains --run's target", []),
                           (tmp_path / "notes", "not a flat draft checkpoint: refusing to replace it", []),
                           (tmp_path / "plain", "holds a file, not a flat draft", []),
                           (tiny_run / "draft_mrope_s0", "holds a mrope draft checkpoint, not a flat draft", []),
                           (tiny_run / "draft_flat_s0", "holds a flat draft checkpoint already: rerun with --overwrite",
                            ["--seed", "1"]),  # another seed's SFT draft: replaced with --overwrite only
                           # issue #43: its own SFT reference (or its target) is never replaced, --overwrite or not
                           (tiny_run / "draft_flat_s0", f"--out {tiny_run / 'draft_flat_s0'} is --run's SFT reference "
                            f"draft {tiny_run / 'draft_flat_s0'}: the run would write into what it reads",
                            ["--overwrite"]),
                           (tiny_run / "target" / "d", f"lies inside --run's target {tiny_run / 'target'}", [])):
        with pytest.raises(SystemExit) as e:
            aarl.main(["--run", str(tiny_run), "--out", str(out), "--steps", "1"] + more)
        assert e.value.code == 2 and msg in error_line(capsys)
    assert snapshot(str(tiny_run)) == before and (tmp_path / "plain").read_text() == "x"


# ---- case 2: train.py does not retrain what it cannot resume, and aarl.py's hint says --stage drafts ----

def test_train_refuses_to_retrain_a_finished_target_unless_asked(tiny_run, monkeypatch, capsys):
    def started(*a, **k):
        raise Started

    monkeypatch.setattr(T, "Data", started)  # the first work a run does
    before = snapshot(str(tiny_run))
    for argv, msg in (([], "target holds a target checkpoint already: rerun with --overwrite to retrain it"),
                      (["--stage", "target"], "--stage drafts --draft-seed N` to distil a new draft seed"),
                      (["--stage", "drafts"], "draft_flat_s0 holds a flat draft checkpoint already")):
        with pytest.raises(SystemExit):
            T.main(["--out", str(tiny_run)] + argv)
        assert msg in error_line(capsys)
    assert snapshot(str(tiny_run)) == before
    for argv in (["--overwrite"], ["--stage", "drafts", "--draft-seed", "1"]):  # asked for, or a new seed: it runs
        with pytest.raises(Started):
            T.main(["--out", str(tiny_run)] + argv)
    (tiny_run / "target.state.pt").write_bytes(b"")  # a resumable target is resumed, not refused
    with pytest.raises(Started):
        T.main(["--out", str(tiny_run), "--stage", "target"])


def test_aarl_hint_trains_only_the_missing_draft(tiny_run, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--stage drafts --draft-seed 3`"):
        aarl.load_run(str(tiny_run), 3, "cpu")
    with pytest.raises(FileNotFoundError, match=r"`python train.py --out \S+empty`"):
        aarl.load_run(str(tmp_path / "empty"), 0, "cpu")


# ---- case 3: aarl.py's default output is a fresh folder, not the shipped draft ----

def test_aarl_default_out_is_not_the_run_folder(tiny_run, tmp_path, monkeypatch):
    seen = {}

    def start(cfg, run_dir, n, device, out):
        seen["out"] = out
        raise Started

    monkeypatch.setattr(aarl, "_run", start)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Started):
        aarl.main(["--run", str(tiny_run)])
    assert seen["out"] == os.path.join("runs", "aarl", "draft_aarl_s0")
    os.makedirs(os.path.join("runs", "aarl"), exist_ok=True)
    checkpoint.save(tiny_model(), os.path.join("runs", "aarl", "draft_aarl_s0"))  # a target where a draft would go
    with pytest.raises(SystemExit):
        aarl.main(["--run", str(tiny_run), "--overwrite"])
    assert checkpoint.existing_kind(os.path.join("runs", "aarl", "draft_aarl_s0")) == "target"


# ---- case 6 and 8: bad flags are one line at parse time ----

@pytest.mark.parametrize("argv, msg", [
    (["--draft-vocab", "100000"], "--draft-vocab must be at most the toy vocabulary's 257 ids"),
    (["--views", "40"], "--views must be at most 21"),
    (["--max-views", "22"], "--max-views must be at most 21"),
    (["--seed", str(2**64)], "--seed must be in 0..2**30-1"),
    (["--draft-seed", str(2**40)], "--draft-seed must be in 0..2**30-1"),
    (["--draft-lr", "inf"], "--draft-lr must be a finite number > 0, got inf"),  # issue #33: inf passed "> 0"
    (["--grad-clip", "inf"], "--grad-clip must be a finite number > 0, got inf"),
    (["--draft-width", "100000"], "--draft-width must be in 64..128 (the target's head_dim..hidden_size), got 100000"),
    (["--draft-heads", "100000"], "--draft-heads must be at most the target's 2, got 100000"),
    (["--draft-layers", "100000"], "--draft-layers must be at most the target's 20, got 100000"),
    (["--draft-kv-heads", "3"], "--draft-kv-heads must be a divisor of the draft's 2 heads, got 3"),
])
def test_train_bad_flags_fail_at_parse_time(argv, msg, capsys):
    with pytest.raises(SystemExit):
        T.parse_args(argv)
    assert msg in error_line(capsys)


@pytest.mark.parametrize("argv, msg", [
    (["--threads", "0"], "argument --threads: must be >= 1"),
    (["--threads", "-3"], "argument --threads: must be >= 1"),
    (["--views", "30"], "argument --views: must be in 0..21"),
    (["--views", "-1"], "argument --views: must be in 0..21"),
    (["--temperature", "0.6", "--sampling-seed", str(2**64 - 1)], "sampling seed must be an int >= 0 and < 2**62"),
    (["real", "--target", checkpoint.SHIPPED, "--image-size", "abc"], "--image-size must be HxW"),
    (["real", "--target", checkpoint.SHIPPED, "--image-size", "0x512"], "--image-size must be HxW"),
    (["real", "--target", checkpoint.SHIPPED, "--image-size", "100000x100000"], "each in 1..8192"),
    (["real", "--target", checkpoint.SHIPPED, "--min-pixels", "100", "--max-pixels", "10"],
     "min <= max, got 100 and 10"),
    (["real", "--target", checkpoint.SHIPPED, "--min-pixels", "-5"], "argument --min-pixels: must be >= 1, got -5"),
    (["--images-dir", "."], "--images-dir is a flag of `bench.py real`, not of `bench.py toy`"),
    (["real", "--target", "/nonexistent"], "--target /nonexistent: folder not found"),
    (["--draft", "/nonexistent"], "--draft /nonexistent: folder not found"),
    (["real", "--target", os.path.join(checkpoint.SHIPPED, "target")], "a checkpoint of this repo's own format"),
    # issue #43: no bounds grew to 20 GB, ran past the 1,024 positions, or ended in a traceback
    (["--gamma", "100000"], "--gamma 100000 is more than --max-new 32"),
    (["--gamma", "2000", "--max-new", "8"], "--gamma 2000 is more than --max-new 8"),
    (["--max-new", "4", "--tree", "32/8/3", "--gamma", "2"], "--tree 32/8/3's depth is more than --max-new 4"),
    (["--tree", "1000/8/1000"], "--tree 1000/8/1000 grows 7001000 candidates a round, more than 1024"),
    (["--tree", "300/1/300"], "--tree 300/1/300's width is more than the draft's 257"),
    (["--tree", "16"], "--tree takes N/D/k (nodes/depth/width, e.g. 16/8/3) or 0 (the chain), got '16'"),
    (["--max-new", "1000", "--gamma", "900", "--tree", "0"], "--max-new 1000 and --gamma 900 need 1900 positions "
     "beyond the prompt, more than the model's 1024"),
    (["preset", "qwen2.5-vl-7b", "--max-new", "8170"], "--max-new 8170 and --tree 32/8/3 need 8202 positions beyond "
     "the prompt, more than the model's 8192"),
    (["--samples", "6", "--temperature", "0"], "--samples 6 at --temperature 0 decodes identical greedy rows"),
    (["real", "--target", "/nonexistent", "--samples", "2"], "--samples 2 at --temperature 0"),
    (["--out", os.path.join(checkpoint.SHIPPED, "draft_aarl_s0", "model.safetensors")], "inside the shipped"),
    (["--batch", "2", "--prompts", "3"], "--prompts 3 is not a multiple of --batch 2"),
    (["--relaxed", "typical"], "--relaxed must be RULE:BOUND"),
    (["--relaxed", "routine:1.5"], "relaxed bound must be in [0, 1]"),
    (["--commitments", "x.json"], "--commitments names what --relaxed routine:B keeps exact"),
    # plans in a stream (#50): a clip of one frame, a stream with what it does not time, an interval alone
    (["--stream", "1"], "--stream takes the frames of a clip, >= 2 (0: off), got 1"),
    (["--stream", "-2"], "--stream takes the frames of a clip, >= 2"),
    (["--stream", "4", "--temperature", "0.6"], "--stream's plan of --samples rows is sampled"),
    (["--stream", "4", "--samples", "6"], "--samples 6 at --temperature 0 decodes identical greedy rows"),
    (["--stream", "4", "--batch", "2", "--prompts", "4"], "--stream times decodes of one prompt per frame"),
    (["preset", "qwen2.5-vl-7b", "--stream", "4"], "--stream is a flag of `bench.py toy` and `bench.py real`"),
    (["real", "--target", checkpoint.SHIPPED, "--stream", "4"], "--stream runs clips: the toy's, or real --scenes"),
    (["--stream", "4", "--stream-interval", "0"], "argument --stream-interval: must be a finite number > 0, got 0"),
    (["--stream", "4", "--stream-interval", "nan"], "argument --stream-interval: must be a finite number > 0, got nan"),
    (["--stream-interval", "0.1"], "--stream-interval goes with --stream"),
])
def test_bench_bad_flags_are_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and msg in error_line(capsys)


def test_bench_out_is_never_an_input_nor_a_file_it_did_not_write(tmp_path, monkeypatch, capsys):
    """--out that is, contains or lies inside an input folder, or that holds anything but a bench report, is refused
    before any work (issue #43: it overwrote the model.safetensors of the draft it measured); --out "" writes no
    report (not the toy default), and where the report went is one line on stderr, --json's stdout its last line."""
    draft = tmp_path / "draft"
    shutil.copytree(checkpoint.draft_dir(checkpoint.SHIPPED, "aarl", 0), draft)
    (tmp_path / "other.json").write_text('["mode"]')
    os.mkfifo(tmp_path / "fifo")  # opened to be checked, a FIFO would wait for a writer forever
    before = snapshot(str(draft))
    for out, msg in [(draft / "model.safetensors", "lies inside --draft"), (draft, "is --draft"),
                     (tmp_path, "contains --draft"), (tmp_path / "other.json", "is not a bench.py report"),
                     (tmp_path / "fifo", "is not a bench.py report")]:
        with pytest.raises(SystemExit):
            bench.main(["--draft", str(draft), "--out", str(out)])
        line = error_line(capsys)
        assert f"--out {out} " in line and msg in line
    assert snapshot(str(draft)) == before
    monkeypatch.setattr(bench, "TOY_JSON", str(tmp_path / "toy.json"))
    monkeypatch.setattr(bench, "toy", lambda *a: {"mode": "toy"})  # no measurement: what main does with its report
    monkeypatch.setattr(bench, "report", lambda res: None)
    bench.main(["--out", ""])
    assert capsys.readouterr().err.strip() == "no report file (--out FILE writes one)"
    assert not os.path.exists(tmp_path / "toy.json")
    for _ in range(2):  # a bench report may be replaced
        bench.main(["--out", str(tmp_path / "r.json"), "--json"])
        captured = capsys.readouterr()
        assert captured.err.strip() == f"wrote {tmp_path / 'r.json'}" and json.loads(captured.out.splitlines()[-1])
    assert files.read_json(tmp_path / "r.json")["mode"] == "toy"


@pytest.mark.parametrize("argv, msg", [
    (["--relaxed", "fuzzy:0.5"], "relaxed rule must be 'typical' or 'routine'"),
    (["--views", "30"], "--views must be in 0..21"),
    (["--seeds", "0,0"], "--seeds must not repeat a seed"),
    (["--seeds", "a"], "--seeds must be a comma-separated list of ints, got 'a'"),
    (["--seeds", "0,-1"], "--seeds: every value must be >= 0, got -1"),
    (["--scenes", "2", "--time-scenes", "16"], "--time-scenes (16) and --show (3) must be at most --scenes (2)"),
    (["--temperature", "0.5", "--sampling-seed", str(2**64)], "sampling seed must be an int >= 0 and < 2**62"),
    (["--temperature", "inf"], "temperature must be finite"),
    (["--gamma", "4", "--tree", "32"], "they take no --search, and a tree as N/D/k (or 0)"),  # 32: a search's budget
    (["--tree", "16/8/3", "--search"], "--gamma and --tree N/D/k give the decoders (no search on val)"),
    (["--tree", "16/2/3"], "argument --tree: a tree of depth 2 and width 3 has 12 candidates"),
    (["--gamma", "9"], "argument --gamma: invalid choice: 9"),  # tau is replayed at evaluate.GAMMAS
    (["--stream", "-1"], "--stream takes 0..10000 clips (0: off)"),
    (["--stream", "2", "--stream-frames", "1"], "--stream-frames 2..1000 frames; got 2, 1"),
    (["--stream", "2", "--stream-samples", "3"], "--stream-samples goes with --stream and --temperature > 0"),
    (["--stream", "2", "--compile"], "--stream times eager lossless decodes"),
    (["--stream-frames", "4"], "--stream-frames goes with --stream"),
])
def test_rsd_bad_flags_are_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit):
        rsd.main(argv)
    assert msg in error_line(capsys)


def shipped_draft(kind, seed):
    return checkpoint.draft_dir(checkpoint.SHIPPED, kind, seed)


@pytest.mark.parametrize("drafts, more, msg", [  # issue #43: the rows --drafts names, checked before any work
    (["x=" + shipped_draft("flat", 0), "x tree=" + shipped_draft("aarl", 0)], [], "'x tree' is a name the table gives"),
    (["target-only=" + shipped_draft("flat", 0)], [], "'target-only' is a name the table gives its own rows"),
    (["a=" + shipped_draft("flat", 0), "a=" + shipped_draft("flat", 0)], [],
     f"{shipped_draft('flat', 0)} is given twice (also as a="),
    (["a=" + shipped_draft("flat", 0), "b=" + shipped_draft("flat", 0) + "/"], [], "is given twice"),  # one real path
    (["a=" + shipped_draft("flat", 0)], ["--seeds", "0"], "folders, which define the rows: it takes no --retrain, "
                                                          "--search or --seeds"),
])
def test_rsd_drafts_rows_are_checked_at_parse_time(drafts, more, msg, monkeypatch, capsys):
    def started(*args):
        raise Started

    monkeypatch.setattr(rsd, "check_search_record", started)  # the first step of the work
    with pytest.raises(SystemExit):
        rsd.main(["--drafts", *drafts, *more])
    assert msg in error_line(capsys)


def test_rsd_drafts_symlinked_folder_is_one_folder(tmp_path, capsys):
    (tmp_path / "link").symlink_to(os.path.abspath(shipped_draft("flat", 1)))
    with pytest.raises(SystemExit):
        rsd.main(["--drafts", f"a={shipped_draft('flat', 1)}", f"b={tmp_path / 'link'}"])
    assert f"b={tmp_path / 'link'}: {tmp_path / 'link'} is given twice (also as a=" in error_line(capsys)


def test_rsd_drafts_rows_are_folders_not_seeds():
    """Distinct folders pass; the rows are over folder positions (a checkpoint records no seed), and the ± and the
    header's spread wording come only with a row of two or more folders."""
    _, a, seeds, _, _ = rsd.parse_args(["--drafts", f"x={shipped_draft('flat', 0)}", f"x={shipped_draft('flat', 2)}",
                                        f"y={shipped_draft('aarl', 1)}"])
    assert seeds == [0, 1] and list(a.named) == ["x", "y"] and "seed" not in json.dumps(checkpoint.header(
        shipped_draft("flat", 2))[0])  # no training seed in the header: rows say "folder i"
    assert rsd.draft_words(a.named, seeds) == ("mean ± half the spread over the row's folders (folder 0, 1, ... as "
                                               "given; none for a row of one)", "folder 0")
    assert rsd.draft_words({"y": ["f"]}, [0]) == ("each row's one folder", "folder 0")
    assert rsd.draft_words(None, [0, 1]) == ("mean ± half the spread over seeds [0, 1]", "seed 0")
    assert rsd.draft_words(None, [2]) == ("seed 2's draft", "seed 2")
    row = {"gamma": 3, "tau": 2.5, "tau_spread": 0.4, "routine_fraction": 0.5, "commit_acc": 1.0, "ms_per_token": 1.0,
           "speedup": 2.0, "speedup_range": [1.9, 2.1], "ade": 0.1, "attn_history": 0.2, "attn_image": 0.3}
    lines = []
    rsd.print_table([{**row, "name": "x", "folders": 2}, {**row, "name": "y", "folders": 1},
                     {**row, "name": "y tree", "gamma": None, "tree": [16, 6, 3], "folders": 1}], log=lines.append)
    assert "2.50 ±0.20" in lines[1] and "±" not in lines[2] + lines[3]


@pytest.mark.parametrize("argv, msg", [
    (["--lr", "inf"], "lr must be a finite number > 0, got inf"),
    (["--temperature", "inf"], "temperature must be a finite number > 0, got inf"),
    (["--beta", "inf"], "beta must be a finite number >= 0, got inf"),
])
def test_aarl_infinite_floats_are_one_line(argv, msg, capsys):
    with pytest.raises(SystemExit):
        aarl.main(argv)
    assert msg in error_line(capsys)


def refused():
    raise ValueError("absolute aspect ratio must be smaller than 200, got 201.0")


@pytest.mark.parametrize("workers", [0, 1])
def test_a_worker_error_is_the_same_one_line(workers, capsys):
    """real.distill's prompts built ahead (--workers N): the error names its scene, and under a DataLoader worker,
    which carries the worker's traceback in the message, it is one line all the same (issue #33)."""
    import argparse

    from ops import cli
    from real import distill
    data = distill.RankPrompts([{"scene": "clip1"}], {"clip1": refused}, distill.DraftConfig(steps=1, batch_size=1),
                               0, 0, 1)
    with pytest.raises(SystemExit):
        with cli.user_errors(argparse.ArgumentParser(prog="p")):
            next(iter(torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers)))
    assert error_line(capsys) == "p: error: scene clip1: absolute aspect ratio must be smaller than 200, got 201.0"


def test_out_is_never_an_input_or_a_root(tmp_path, capsys):
    """--out that is, contains or lies inside an input folder, or a filesystem root, is refused before any work
    (issue #33: data/ and a draft were written into the scene folder); an SFT draft may sit inside it."""
    (tmp_path / "scenes").mkdir()
    (tmp_path / "t").mkdir()
    inputs = {"--scenes": str(tmp_path / "scenes"), "--target": str(tmp_path / "t"), "--processor": None}
    for out, how in [(tmp_path / "scenes", "is --scenes"), (tmp_path / "scenes" / "run", "lies inside --scenes"),
                     (tmp_path, "contains --scenes"), ("/", "is a filesystem root")]:
        with pytest.raises(ValueError, match=f"--out {out} {how}"):
            files.check_out_dir(str(out), inputs)
    files.check_out_dir(str(tmp_path), {"--draft": str(tmp_path / "t")}, may_contain=("--draft",))
    from real import distill
    with pytest.raises(SystemExit):
        distill.main(["--target", str(tmp_path / "t"), "--scenes", str(tmp_path / "scenes"), "--out",
                      str(tmp_path / "scenes")])
    assert "--out" in error_line(capsys) and os.listdir(tmp_path / "scenes") == []


def test_no_input_is_ever_an_output(tiny_run, monkeypatch, capsys):
    """Issue #43: train.py's draft stage never writes into its --target-dir (an --out beside it, containing it, runs),
    nor rsd.py --search with other settings over the search recorded with the defaults; one line, nothing written."""
    monkeypatch.setattr(T, "Data", lambda *a, **k: (_ for _ in ()).throw(Started()))  # the first work a run does
    target = tiny_run / "target"
    before = snapshot(str(tiny_run))
    for out, how in ((target, "is"), (target / "drafts", "lies inside")):
        with pytest.raises(SystemExit):
            T.main(["--stage", "drafts", "--target-dir", str(target), "--out", str(out), "--draft-seed", "1"])
        assert f"--out {out} {how} --target-dir {target}: the run would write into what it reads" in error_line(capsys)
    assert snapshot(str(tiny_run)) == before
    with pytest.raises(Started):
        T.main(["--stage", "drafts", "--target-dir", str(target), "--out", str(tiny_run), "--draft-seed", "1"])
    record = tiny_run / rsd.SEARCH_JSON
    shipped = files.read_json(os.path.join(checkpoint.SHIPPED, rsd.SEARCH_JSON))["key"]  # the default settings'
    for key, argv, refused in ((shipped, ["--scenes", "2", "--seeds", "1"], "--seeds, --scenes differ"),
                               (shipped, [], None), ({**shipped, "scenes": 2}, ["--scenes", "3"], None)):
        files.write_json(record, {"key": key})
        with pytest.raises(SystemExit):  # refused, or past the check: the run folder has no draft_aarl_s*
            rsd.main(["--run", str(tiny_run), "--search", "--time-scenes", "1", "--show", "0"] + argv)
        line = error_line(capsys)
        assert (f"--search: {record} holds the search made with the default settings, and this run's {refused}: "
                f"rerun --search with the defaults, or delete {record}" in line) if refused else "missing" in line
        assert files.read_json(record) == {"key": key}


def test_the_writer_lock_removes_killed_writes_and_what_a_refused_run_made(tmp_path):
    """A killed state save's .tmp is removed when the folder's next writer starts (a user's notes.tmp stays); a run
    refused inside the lock leaves no folder it made (issue #33: an empty --out stayed)."""
    (tmp_path / "run").mkdir()
    stale = tmp_path / "run" / ".draft_flat_s0.state.pt.4242.0badf00d.tmp"
    stale.write_bytes(b"partial")
    (tmp_path / "run" / "notes.tmp").write_text("mine")
    with files.writer_lock(str(tmp_path / "run")):
        assert sorted(os.listdir(tmp_path / "run")) == [".lock", "notes.tmp"]
    with pytest.raises(ValueError), files.writer_lock(str(tmp_path / "new" / "out")):
        raise ValueError("refused")
    assert sorted(os.listdir(tmp_path)) == ["run"]


# ---- case 7: the shipped files are found from any working folder ----

def test_shipped_files_are_found_from_another_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert rsd.missing(checkpoint.SHIPPED, [0, 1, 2]) == []
    with pytest.raises(SystemExit):  # the default --run is the shipped folder: only the seed-9 draft is missing
        aarl.main(["--seed", "9"])
    assert f"{checkpoint.draft_dir(checkpoint.SHIPPED, 'flat', 9)} not found" in error_line(capsys)


# ---- case 8: files that are not what they claim, and a full disk ----

def test_foreign_folders_are_named_with_their_cause(tmp_path):
    with pytest.raises(ValueError, match="a checkpoint of this repo's own format"):
        hf.load_pretrained(os.path.join(checkpoint.SHIPPED, "target"))
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "hidden_size": 64}))
    with pytest.raises(ValueError, match="missing config field 'vision_config'"):
        hf.load_pretrained(str(folder))
    checkpoint.save(tiny_model(), str(tmp_path / "t"))
    (tmp_path / "t" / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\n")
    with pytest.raises(ValueError, match="a git-lfs pointer, not the weights: fetch them with `git lfs pull`"):
        checkpoint.load(str(tmp_path / "t"))
    (folder / "config.json").write_bytes(b'{"model_type": "\xff"}')  # not UTF-8: the codec's error named no file
    with pytest.raises(ValueError, match=r"hf/config.json: not valid JSON \('utf-8' codec"):
        files.read_json(str(folder / "config.json"))


def test_a_full_disk_names_the_path_and_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    files.torch_save({"step": 1}, str(path))

    def full(obj, f):  # what torch's serializer raises when the disk fills
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match=r"state.pt: write failed \(.*inline_container.*\); \d+ MiB free on its disk"):
        files.torch_save({"step": 2}, str(path))
    monkeypatch.undo()
    assert torch.load(str(path))["step"] == 1 and os.listdir(tmp_path) == ["state.pt"]

    def enospc(p):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="t: write failed .*No space left on device.*: no space left on device"):
        files.atomic_write(str(tmp_path / "t"), enospc)


# ---- issue #43: sampling flags that cannot matter, a Ctrl-C ----

def test_distill_refuses_top_p_at_temperature_0(tmp_path, capsys):
    """real.distill's --top-p (like bench.py's and rsd.py's) filters sampled CoCs: given at temperature 0 it would be
    silently ignored, so it is refused, even at its default value; left out, the release's 0.98 is kept."""
    from real import distill
    (tmp_path / "t").mkdir()
    base = ["--target", str(tmp_path / "t"), "--toy-scenes", "2", "--out", str(tmp_path / "out")]
    for argv in (["--top-p", "0.5"], ["--top-p", "0.98"], ["--samples", "2"]):
        with pytest.raises(SystemExit):
            distill.main(base + argv)
        assert "--temperature > 0" in error_line(capsys)
    assert distill.parse_args(base)[0].top_p == 0.98
    assert distill.parse_args(base + ["--temperature", "0.6", "--top-p", "0.5"])[0].top_p == 0.5
    assert not os.path.exists(tmp_path / "out")


def test_ctrl_c_is_one_line_saying_what_was_saved(tiny_run, tmp_path, monkeypatch, capsys):
    """A Ctrl-C in any program's work is one line (no traceback), exit status 130, saying what a rerun does: before
    any state, before its first save, or from the step it holds."""
    from ops import runs
    model = torch.nn.Linear(1, 1)
    opt = runs.make_optimizer(model.parameters(), 1e-3)
    path = str(tmp_path / "x.state.pt")
    cfg = T.TrainConfig()

    def ctrl_c(load=False, save=None):
        def work(*a, **k):
            if load:
                runs.load_state(path, {"m": model}, {"m": opt}, cfg)
            if save:
                runs.save_state(path, save, {"m": model}, {"m": opt}, cfg, 0)
            raise KeyboardInterrupt
        return work

    monkeypatch.setattr(runs, "LAST_STATE", {})
    for work, msg in ((ctrl_c(), "interrupted before any training state was saved: rerun the same command"),
                      (ctrl_c(load=True), f"interrupted before {path} was first saved: rerun the same command"),
                      (ctrl_c(load=True, save=3), f"interrupted: the state in {path} was saved at step 3; rerun"),
                      (ctrl_c(load=True), f"interrupted: the state in {path} was saved at step 3; rerun")):
        monkeypatch.setattr(aarl, "_run", work)
        with pytest.raises(SystemExit) as e:
            aarl.main(["--run", str(tiny_run), "--out", str(tmp_path / "aarl")])
        err = capsys.readouterr().err
        assert e.value.code == 130 and "Traceback" not in err and msg in err.splitlines()[-1]


# ---- issue #52: the cases of the contract's families (the families themselves: tests/test_contract.py) ----

def test_relaxed_acceptance_bad_flags_are_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    """Each bad flag of experiments/relaxed_acceptance.py is one line naming it, before the target is even loaded
    (the issue: tracebacks, and --bounds 0,2 failing after the bound-0 work)."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                             "experiments"))
    import relaxed_acceptance as ra

    def started(*a, **k):
        raise Started

    monkeypatch.setattr(ra.checkpoint, "load", started)  # the first work
    (tmp_path / "d").mkdir()
    for argv, msg in ((["--seeds", "a"], "--seeds must be a comma-separated list of ints"),
                      (["--seeds", "0,0"], "--seeds repeats a value"), (["--seeds", "-1"], "--seeds: every value"),
                      (["--seeds", "0,7"], "lacks"), (["--bounds", ""], "--bounds must be a comma-separated list"),
                      (["--bounds", "0,2"], "--bounds: every value must be in [0, 1], got 2.0"),
                      (["--bounds", "0.5,1"], "--bounds must include 0"), (["--scenes", "0"], "--scenes must be >= 1"),
                      (["--gamma", "-2"], "--gamma must be >= 0"), (["--tree", "32/8/3"], "--tree is the decoder of "
                                                                                         "--gamma 0"),
                      (["--gamma", "0", "--tree", "32/8"], "tree"), (["--gamma", "0", "--tree", "a/b/c"], "--tree"),
                      (["--temperature", "-1"], "temperature"), (["--top-p", "0.5"], "give a temperature > 0"),
                      (["--out", str(tmp_path / "d")], "--out"), (["--out", str(tmp_path / "no" / "r.json")],
                                                                   "does not exist"),
                      (["--figure", str(tmp_path / "d")], "--figure")):
        with pytest.raises(SystemExit) as e:
            ra.main(argv)
        assert e.value.code == 2 and msg in error_line(capsys), (argv, msg)
    # the quick run: its outputs go to runs/, never onto the committed JSON and figure
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Started):
        ra.main(["--scenes", "1", "--seeds", "0", "--bounds", "0,1"])
    assert os.path.isdir(tmp_path / "runs")


def test_commitments_are_token_ids_checked_before_work(tmp_path, capsys, monkeypatch):
    """--commitments: a bool, a negative or a fractional id, a directory, an id outside the vocabulary (known before
    any work on the toy) are each one line; the Python API (relaxed.Relaxed) refuses the same ids."""
    from beyond.relaxed import Relaxed
    f = tmp_path / "ids.json"
    for ids, msg in (([True, False], "got True"), ([1, True], "got True"), ([3, -1], "got -1"), ([2.5], "got 2.5"),
                     ([], "non-empty JSON list"), ([[1]], r"got \[1\]")):
        f.write_text(json.dumps(ids))
        with pytest.raises(ValueError, match=msg):
            flags.relaxed_rule("routine:0.5", str(f))
    with pytest.raises(ValueError, match="is a directory"):
        flags.relaxed_rule("routine:0.5", str(tmp_path))
    for ids in ([True], [-1], [1.5]):
        with pytest.raises(ValueError, match="commitment token ids must be ints >= 0"):
            Relaxed("routine", 0.5, ids)
    with pytest.raises(ValueError, match="outside the target's vocabulary 0..9"):
        Relaxed("routine", 0.5, [10]).check_vocab(10)

    def started(*a, **k):
        raise Started

    monkeypatch.setattr(bench, "toy", started)
    f.write_text("[5, 100000]")
    with pytest.raises(SystemExit):
        bench.main(["--relaxed", "routine:0.5", "--commitments", str(f), "--out", ""])
    assert "commitment token id 100000 is outside the target's vocabulary" in error_line(capsys)


def test_an_exact_bound_is_reported_exact_and_decoded_once():
    """--relaxed typical:0 accepts nothing more: exact verification, no LOSSY label, no second decode (rsd.py)."""
    assert flags.relaxed_rule("typical:0") is None and flags.relaxed_rule("routine:0", default=[3]) is None
    sampling = rsd.parse_args(["--relaxed", "typical:0"])[3]
    assert sampling.relaxed is None and flags.sampling_json(sampling)["verification"] == "exact"


def test_what_ran_is_the_tree_that_ran_and_ignored_flags_are_refused(tmp_path, capsys, monkeypatch):
    """bench.py's what_ran records the decoder that ran (a tree chosen on val), not the flag's default; a toy flag
    given with --preset or --target is refused, not recorded."""
    def ran(args, device, dtype, sampling):
        return {"mode": "toy", "decoder": timing.decoder_json(bench.TreeShape(16, 8, 3))}

    monkeypatch.setattr(bench, "toy", ran)
    monkeypatch.setattr(bench, "report", lambda res: None)
    res = bench.main(["--out", ""])
    assert res["what_ran"]["flags"]["tree"] == "16/8/3"
    for flag in ("--prompts", "--views"):  # issue #58: a flag of another mode is refused by that mode's parser
        with pytest.raises(SystemExit):
            bench.main(["preset", "qwen3-vl-8b", flag, "2"])
        assert f"{flag} is a flag of `bench.py toy`, not of `bench.py preset`" in error_line(capsys)
    for argv, owner in ((["--min-pixels", "64"], "real"), (["preset", "qwen3-vl-8b", "--image-size", "8x8"], "real"),
                        (["real", "--target", ".", "--batch", "2"], "toy")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert f"{argv[-2]} is a flag of `bench.py {owner}`" in error_line(capsys)
    with pytest.raises(SystemExit):
        bench.main(["real", "--target", ".", "--scenes", ".", "--image-size", "8x8"])
    assert "--image-size shapes generated images" in error_line(capsys)


def test_atomic_write_names_a_missing_folder(tmp_path):
    """Not "0 MiB free ... no space left on device": the folder that does not exist."""
    with pytest.raises(FileNotFoundError, match=f"its folder {tmp_path / 'no'} does not exist"):
        files.write_json(str(tmp_path / "no" / "x.json"), {})
