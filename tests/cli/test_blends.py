"""`ptd-train`'s data sources end to end: a blend of two corpora trains, resumes bitwise and refuses other weights
on resume; --train-data-path/--valid-data-path; --mock-data; bad weights and flags refused with one line and exit
2. In this process, on the 8 simulated devices at d = 8 (tiny model)."""

import json
from pathlib import Path

import numpy as np
import pytest

from ptd_jax.cli.train import main
from tests.helpers.cli import exit_code
from tests.helpers.corpus import random_corpus_at

TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--no-progress",
    "--eval-iters",
    "0",
    "--tensor-model-parallel-size",
    "1",
    "--pipeline-model-parallel-size",
    "1",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
    "--log-interval",
    "1",
    "--lr-decay-iters",
    "20",
    "--lr-warmup-iters",
    "2",
]


@pytest.fixture(scope="module")
def second_corpus(tmp_path_factory):
    """60 documents of random byte tokens."""
    return random_corpus_at(tmp_path_factory.mktemp("second"), 60, 50, 300, seed=2)


def losses(path):
    with open(path) as f:
        return [r["lm_loss"] for r in map(json.loads, f) if r.get("kind") == "train"]


def test_a_blend_trains_resumes_bitwise_and_refuses_other_weights(small_corpus, second_corpus, tmp_path, capsys):
    """8 iterations straight == 4 + save + load and 4 more (float32 losses equal); the straight run asks for 8
    iterations and the first part for 4, so the blend does not depend on --train-iters. Resuming with other weights
    is refused naming them, and accepted with --override-data-config."""
    blend = ["--data-path", "0.3", small_corpus, "0.7", second_corpus]
    ckpt = str(tmp_path / "ckpt")
    assert main([*TINY, *blend, "--train-iters", "8", "--metrics-file", str(tmp_path / "a.jsonl")]) == 0
    assert main([*TINY, *blend, "--train-iters", "4", "--save", ckpt, "--metrics-file", str(tmp_path / "b.jsonl")]) == 0
    assert (
        main(
            [
                *TINY,
                *blend,
                "--train-iters",
                "8",
                "--save",
                ckpt,
                "--load",
                ckpt,
                "--metrics-file",
                str(tmp_path / "b.jsonl"),
            ]
        )
        == 0
    )
    straight, resumed = losses(tmp_path / "a.jsonl"), losses(tmp_path / "b.jsonl")
    assert len(straight) == 8 and straight == resumed  # bitwise
    cache = Path(small_corpus).parent / "cache" / "ptd_jax_indices"  # beside the first dataset of the blend
    assert list(cache.glob("*_blend_b0_dataset_index.npy"))
    capsys.readouterr()

    other = ["--data-path", "0.5", small_corpus, "0.5", second_corpus, "--train-iters", "9", "--load", ckpt]
    assert main([*TINY, *other]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was trained with another data configuration" in err
    assert "'blend': ([[0.3, 'small_text_document'" in err and "[[0.5, 'small_text_document'" in err
    assert main([*TINY, *other, "--override-data-config"]) == 0
    assert "--override-data-config: the data configuration changes" in capsys.readouterr().err


def test_separate_train_and_valid_paths_train_and_evaluate(small_corpus, second_corpus, tmp_path):
    metrics = tmp_path / "m.jsonl"
    argv = [
        *TINY,
        "--train-data-path",
        "1",
        small_corpus,
        "2",
        second_corpus,
        "--valid-data-path",
        second_corpus,
        "--eval-iters",
        "1",
        "--eval-interval",
        "2",
        "--train-iters",
        "2",
        "--metrics-file",
        str(metrics),
    ]
    assert main(argv) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records if r.get("kind") == "valid"] == [2]


def test_mock_data_trains_without_files(tmp_path, monkeypatch):
    """(That its samples are a function of the seed alone is tests/data/test_blend.py's.)"""
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--mock-data", "--train-iters", "2", "--metrics-file", "m.jsonl"]) == 0
    assert abs(losses(tmp_path / "m.jsonl")[0] - np.log(257)) < 0.5  # random tokens: the loss starts at ln V
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]


REFUSALS = [
    (["--data-path", "0.5", "{a}", "-0.5", "{b}"], "data_path: weight -0.5 of '{b}' is negative"),
    (["--data-path", "0", "{a}", "0", "{b}"], "data_path: the weights [0.0, 0.0] sum to zero"),
    (["--data-path", "0.5", "{a}", "0.5"], "data_path needs one prefix or pairs of weight and prefix"),
    (["--data-path", "{a}", "{b}"], "data_path: weight '{a}' (before '{b}') is not a number"),
    (["--data-path", "one", "{a}"], "data_path: weight 'one' (before '{a}') is not a number"),
    (["--data-path", "inf", "{a}", "1", "{b}"], "data_path: weight 'inf' of '{a}' is not a finite number"),
    (["--data-path", "1", "{a}", "1", "nothing"], "missing file nothing.idx"),
    (["--train-data-path", "0.5", "{a}", "-2", "{b}"], "train_data_path: weight -2.0 of '{b}' is negative"),
    (["--train-data-path", "{b}", "--valid-data-path", "1", "{a}", "1"], "valid_data_path needs one prefix or pairs"),
    (["--data-path", "{a}", "--train-data-path", "{b}"], "give one of --data-path and --train-data-path, not both"),
    (["--mock-data", "--data-path", "{a}"], "give one of --data-path and --mock-data, not both"),
    (["--valid-data-path", "{a}"], "--valid-data-path needs --train-data-path"),
    (["--train-data-path", "{a}", "--split", "90,10,0"], "split='90,10,0' is not used with --train-data-path"),
    (["--mock-data", "--split", "90,10,0"], "split='90,10,0' is not used with --mock-data"),
]


@pytest.mark.parametrize("args, message", REFUSALS, ids=[" ".join(a)[:50] for a, _ in REFUSALS])
def test_bad_data_flags_exit_2_with_one_line(args, message, small_corpus, second_corpus, capsys):
    fill = {"a": small_corpus, "b": second_corpus}
    capsys.readouterr()
    assert exit_code(main, [*TINY, *[a.format(**fill) for a in args]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ptd-train: error: ") and "Traceback" not in err, err
    assert message.format(**fill) in err, err
