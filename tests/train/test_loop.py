"""The training loop `train()` end to end (`ptd_jax/train/loop.py`)."""

import json
import math

import numpy as np
import pytest

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.data import GPTData
from ptd_jax.train import RunOptions, train

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)


def test_loss_falls_on_a_tiny_corpus(small_corpus, tmp_path):
    summary = train(
        TINY,
        ParallelConfig(micro_batch_size=4, global_batch_size=8),
        TrainConfig(train_iters=40, lr=3e-3, lr_warmup_iters=5, log_interval=5, eval_interval=20, eval_iters=2),
        RunOptions(data_path=small_corpus, split="90,10,0", progress=False, metrics_file=str(tmp_path / "m.jsonl")),
    )
    assert summary["first_lm_loss"] == pytest.approx(math.log(257), abs=0.3)
    assert summary["final_lm_loss"] < summary["first_lm_loss"] - 2.0
    assert summary["final_valid_lm_loss"] < summary["first_lm_loss"] - 2.0


# Checkpoint save, resume, resharding and their refusals: tests/train/test_checkpoint.py.


@pytest.mark.slow  # two training runs, 13 s; pipeline/test_executor.py checks parallel evaluation against the reference
def test_test_split_is_evaluated_at_the_end_as_the_reference_does(small_corpus, tmp_path):
    """A split with a test share logs `test_lm_loss` once, at the end (Megatron's test evaluation); the parallel
    step's equals the single-device reference's. Validation moves on: its two evaluations read different batches."""
    train_cfg = TrainConfig(train_iters=4, lr=3e-3, lr_warmup_iters=1, log_interval=1, eval_interval=2, eval_iters=2)
    runs = {}
    for name, parallel, reference in (
        (
            "ptd",
            ParallelConfig(tensor_model_parallel_size=2, data_parallel_size=2, micro_batch_size=2, global_batch_size=8),
            False,
        ),
        ("ref", ParallelConfig(micro_batch_size=4, global_batch_size=8), True),
    ):
        metrics = tmp_path / f"{name}.jsonl"
        summary = train(
            TINY,
            parallel,
            train_cfg,
            RunOptions(
                data_path=small_corpus,
                split="80,10,10",
                progress=False,
                metrics_file=str(metrics),
                reference_step=reference,
            ),
        )
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        runs[name] = (
            summary,
            [r for r in records if r.get("kind") == "test"],
            [r for r in records if r.get("kind") == "valid"],
        )
    (ptd, ptd_test, ptd_valid), (ref, ref_test, _) = runs["ptd"], runs["ref"]
    assert len(ptd_test) == len(ref_test) == 1 and ptd_test[0]["iteration"] == 4
    assert ptd["test_lm_loss"] == ptd_test[0]["test_lm_loss"]
    assert ptd["test_lm_loss"] == pytest.approx(ref["test_lm_loss"], rel=1e-5)
    assert ptd["test_lm_loss"] != pytest.approx(ptd["final_valid_lm_loss"], rel=1e-4)  # another stream
    assert [r["iteration"] for r in ptd_valid] == [2, 4]
    # evaluation 1 reads the next batches (the stream moves on), where the old loop re-read evaluation 0's
    data = GPTData(
        small_corpus, seq_length=32, global_batch_size=8, eval_iters=2, seed=train_cfg.seed, split="80,10,10"
    )
    assert not np.array_equal(
        next(data.valid_batches(evaluation=0)).tokens, next(data.valid_batches(evaluation=1)).tokens
    )


def test_a_run_that_does_not_fit_is_refused_before_anything_is_written(tmp_path):
    """`train()` from Python refuses what ptd-train refuses: the memory estimate over a device's, one ConfigError
    naming the bytes, and no checkpoint folder or metrics file."""
    big = ModelConfig(num_layers=64, hidden_size=8192, num_attention_heads=64, seq_length=128, vocab_size=257)
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    with pytest.raises(ConfigError, match=r"the run needs about [\d,.]+ GiB per device"):
        train(
            big,
            ParallelConfig(micro_batch_size=1, global_batch_size=1),
            TrainConfig(train_iters=1),
            RunOptions(mock_data=True, progress=False, save=str(save), metrics_file=str(metrics)),
        )
    assert not save.exists() and not metrics.exists()
