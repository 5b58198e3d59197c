"""experiments/peer_hf.py on the shipped toy (checkpoints/toy), two prompts, fp32: its report carries every arm's
ms/token and tokens and the ratios, and transformers' greedy generate and assisted generation emit exactly our
target-only tokens (the exported weights are the same model). Also the flags it refuses.

run: python -m pytest -q tests/test_peer.py        (about 10 s on one thread; -m 'not peer' leaves it out)
"""
import os
import sys

import pytest
import torch

import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import peer_hf  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.peer]


def test_peer_hf_on_the_shipped_toy(tmp_path, capsys):
    pytest.importorskip("transformers")
    run = os.path.join(ROOT, "checkpoints", "toy")
    # one surround view (plus the front camera's video): images and a video in every prompt, a short prefill
    peers = peer_hf.main(["--device", "cpu", "--dtype", "fp32", "--run", run, "--prompts", "2", "--views", "1",
                       "--max-new", "12", "--json", "--out", str(tmp_path / "peer_hf.json")])
    assert (tmp_path / "peer_hf.json").is_file()
    assert peers["draft"] == os.path.join(run, "draft_mrope_s0") and peers["prompts"] == 2
    tokens = {arm: peers[arm]["tokens"] for arm in peer_hf.ARMS}
    assert all(peers[arm][k] > 0 for arm in peer_hf.ARMS for k in ("ms_per_token", "ms_per_prompt", "cpu_ms_per_token"))
    assert set(peers["ratios_cpu_time"]) == {"hf_generate_over_ours_target_only", "hf_assisted_over_ours_speculative",
                                             "hf_assisted_defaults_over_ours_speculative"}
    assert len(set(tokens.values())) == 1 and tokens["hf_generate"] > 2  # every arm emitted the same count
    # fp32: transformers' generate is our target-only decoding, token for token; both speculative arms are lossless
    assert peers["greedy_match"] == {"hf_generate_vs_ours_target_only": 2, "ours_speculative_vs_ours_target_only": 2,
                                     "hf_assisted_vs_hf_generate": 2, "hf_assisted_defaults_vs_hf_generate": 2}
    assert peers["assistant"]["hf_assisted"]["num_assistant_tokens"] == peers["gamma"] == evaluate.GAMMA
    assert peers["one_token_forward_ms"]["ours"] > 0 and peers["one_token_forward_ms"]["hf"] > 0
    ms = {arm: peers[arm]["ms_per_token"] for arm in peer_hf.ARMS}
    assert peers["ratios"]["hf_generate_over_ours_target_only"] == pytest.approx(
        ms["hf_generate"] / ms["ours_target_only"])
    assert peers["ratios"]["hf_assisted_over_ours_speculative"] == pytest.approx(
        ms["hf_assisted"] / ms["ours_speculative"])
    out, err = capsys.readouterr()  # --json: the report on stderr, stdout the one JSON line (issue #52)
    assert "transformers' generate = ours target-only on 2 of 2 prompts;" in err
    assert len(out.splitlines()) == 1 and '"greedy_match"' in out


def test_peer_hf_with_sampled_rows(capsys):
    """--samples 3 at 0.6 / 0.98: transformers' generate(num_return_sequences=3) timed beside our batched
    target-only and chain on each prompt's rows; what its assisted generation answers to 3 rows is recorded."""
    pytest.importorskip("transformers")
    peers = peer_hf.main(["--device", "cpu", "--dtype", "fp32", "--run", os.path.join(ROOT, "checkpoints", "toy"),
                       "--prompts", "2", "--views", "1", "--max-new", "12", "--samples", "3",
                       "--temperature", "0.6", "--top-p", "0.98"])
    assert peers["samples"] == 3 and peers["gamma"] == evaluate.GAMMA
    assert all(peers[a]["ms_per_prompt"] > 0 and peers[a]["tokens"] >= 6 for a in
               ("ours_target_only", "ours_speculative", "hf_generate"))
    assert peers["hf_assisted"].startswith(("refused: ", "ran"))
    assert "transformers' assisted generation with 3 rows" in capsys.readouterr().out


def test_hf_inputs_mark_image_and_video_placeholders():
    class Cfg:
        image_token_id, video_token_id = 3, 4
    prompt = {"input_ids": torch.tensor([[5, 1, 3, 3, 2, 1, 4, 2, 7]]), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    inputs = peer_hf.hf_inputs(prompt, Cfg)
    assert inputs["mm_token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0, 2, 0, 0]]
    assert inputs["attention_mask"].tolist() == [[1] * 9] and inputs["image_grid_thw"] is prompt["image_grid_thw"]


@pytest.mark.parametrize("argv,msg", [(["--temperature", "0.6"], "drop --temperature"),
                                      (["--samples", "3"], "give --temperature"),
                                      (["--run", "nowhere"], "no toy checkpoints"),
                                      (["--repeats", "2"], "--repeats >= 3")])
def test_peer_flags_refuse_what_it_cannot_compare(argv, msg, capsys):
    with pytest.raises(SystemExit):
        peer_hf.main(argv)
    assert msg in capsys.readouterr().err
