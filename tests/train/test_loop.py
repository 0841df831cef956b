"""The training loop `train()` end to end (`ptd_jax/train/loop.py`), with checkpoint save, resume and load checks."""

import math

import pytest

from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.train import RunOptions, train

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)


def test_loss_falls_on_a_tiny_corpus(small_corpus, tmp_path):
    summary = train(TINY, ParallelConfig(micro_batch_size=4, global_batch_size=8),
                    TrainConfig(train_iters=40, lr=3e-3, lr_warmup_iters=5, log_interval=5, eval_interval=20,
                                eval_iters=2),
                    RunOptions(data_path=small_corpus, split="90,10,0", progress=False,
                               metrics_file=str(tmp_path / "m.jsonl")))
    assert summary["first_lm_loss"] == pytest.approx(math.log(257), abs=0.3)
    assert summary["final_lm_loss"] < summary["first_lm_loss"] - 2.0
    assert summary["final_valid_lm_loss"] < summary["first_lm_loss"] - 2.0


@pytest.mark.parametrize("d, t", [pytest.param(1, 1, marks=pytest.mark.slow), (2, 4)])  # (2, 4): sharded state
def test_checkpoint_resume_reproduces_an_uninterrupted_run(small_corpus, tmp_path, d, t):
    parallel = ParallelConfig(data_parallel_size=d, tensor_model_parallel_size=t, micro_batch_size=4 // d,
                              global_batch_size=4)
    base = dict(lr=1e-3, lr_warmup_iters=1, log_interval=1, eval_iters=0)
    straight = train(TINY, parallel, TrainConfig(train_iters=4, **base),
                     RunOptions(data_path=small_corpus, progress=False, metrics_file=str(tmp_path / "a.jsonl")))
    train(TINY, parallel, TrainConfig(train_iters=4, lr_decay_iters=4, save_interval=2, **base).replace(
        train_iters=2), RunOptions(data_path=small_corpus, progress=False, save=str(tmp_path / "ckpt")))
    resumed = train(TINY, parallel, TrainConfig(train_iters=4, **base),
                    RunOptions(data_path=small_corpus, progress=False, load=str(tmp_path / "ckpt"),
                               metrics_file=str(tmp_path / "b.jsonl")))
    assert resumed["iterations"] == 2
    assert resumed["final_lm_loss"] == pytest.approx(straight["final_lm_loss"], rel=1e-6)


def test_load_with_another_architecture_fails(small_corpus, tmp_path):
    from ptd_jax.config import ConfigError

    parallel = ParallelConfig(micro_batch_size=4, global_batch_size=4)
    train(TINY, parallel, TrainConfig(train_iters=1, eval_iters=0),
          RunOptions(data_path=small_corpus, progress=False, save=str(tmp_path / "ckpt")))
    with pytest.raises(ConfigError, match=r"different architecture .*'hidden_size': \(32, 64\)"):
        train(TINY.replace(hidden_size=64), parallel, TrainConfig(train_iters=2, eval_iters=0),
              RunOptions(data_path=small_corpus, progress=False, load=str(tmp_path / "ckpt")))
