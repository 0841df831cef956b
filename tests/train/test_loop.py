"""The training loop `train()` end to end (`ptd_jax/train/loop.py`)."""

import math

import pytest

from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
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
