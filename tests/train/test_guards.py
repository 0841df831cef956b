"""The loop's NaN/inf guards (`ptd_jax/train/guards.py`): skips counted and logged, a run of them stops training
with exit 1, no checkpoint from a poisoned state; float16 with the dynamic scaler trains."""

import json

import jax
import numpy as np
import pytest

from ptd_jax.cli.train import command
from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.train import RunOptions, checkpoint, train
from ptd_jax.train.guards import DivergedError

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)
PARALLEL = ParallelConfig(micro_batch_size=4, global_batch_size=8)


def test_nan_loss_for_n_steps_stops_the_run_and_keeps_the_last_good_checkpoint(small_corpus, tmp_path):
    cfg = TrainConfig(
        train_iters=20,
        lr=3e-3,
        lr_warmup_iters=0,
        lr_decay_iters=20,
        log_interval=1,
        eval_iters=0,
        save_interval=2,
        max_skipped_iters=3,
    )
    options = dict(data_path=small_corpus, progress=False, async_save=False)
    with pytest.raises(DivergedError, match="stopping at iteration 8: max_skipped_iters=3"):
        train(
            TINY,
            PARALLEL,
            cfg,
            RunOptions(
                save=str(tmp_path / "bad"),
                poison_steps=tuple(range(5, 40)),
                metrics_file=str(tmp_path / "bad.jsonl"),
                **options,
            ),
        )
    records = [json.loads(line) for line in (tmp_path / "bad.jsonl").read_text().splitlines()]
    assert [r["skipped_iters"] for r in records] == [0, 0, 0, 0, 0, 1, 1]  # iteration 8 raised before its log
    assert checkpoint.all_steps(tmp_path / "bad") == [2, 4, 6]
    # step 6 holds the state after iteration 5 (6 was skipped): what a clean run has at iteration 5
    train(TINY, PARALLEL, cfg.replace(exit_interval=5), RunOptions(save=str(tmp_path / "good"), **options))
    _, saved = checkpoint.read_params(tmp_path / "bad", 6)
    _, clean = checkpoint.read_params(tmp_path / "good", 5)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(clean), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # roundoff (XLA fuses otherwise); an update moves 3e-3


def test_a_diverged_run_exits_1_with_one_line(monkeypatch, capsys):
    def diverge(argv):
        raise DivergedError("stopping at iteration 8: max_skipped_iters=3 iterations in a row had a non-finite")

    monkeypatch.setattr(command, "run", diverge)
    assert command.main([]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ptd-train: error: stopping at iteration 8")


@pytest.mark.slow  # 40 iterations; the default run checks the scaler's steps against the reference (test_loss_scale.py)
def test_fp16_with_the_dynamic_scaler_trains(small_corpus, tmp_path):
    """From 2^32 the scale falls by overflows (skipped, logged) until float16 holds the gradients; the loss falls as
    in float32, and the checkpoint carries the scaler's state."""
    cfg = TrainConfig(train_iters=40, lr=3e-3, lr_warmup_iters=5, log_interval=5, eval_iters=0)
    summary = train(
        TINY.replace(dtype="float16"),
        PARALLEL,
        cfg,
        RunOptions(
            data_path=small_corpus,
            progress=False,
            save=str(tmp_path / "ck"),
            async_save=False,
            metrics_file=str(tmp_path / "m.jsonl"),
        ),
    )
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert 10 <= summary["skipped_iters"] == sum(r["skipped_iters"] for r in records) < 30
    assert records[0]["loss_scale"] < 2.0**32 and records[-1]["skipped_iters"] == 0
    assert summary["final_lm_loss"] < summary["first_lm_loss"] - 1.5
    meta = checkpoint.read_meta(tmp_path / "ck", 40)
    assert meta["loss_scale"]["scale"] == records[-1]["loss_scale"]


@pytest.mark.parametrize(
    "reference_step", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["parallel", "reference"]
)
def test_the_logged_learning_rate_is_the_applied_one_after_skipped_steps(small_corpus, tmp_path, reference_step):
    """Iterations 1 and 2 are skipped in the warm-up (lr = 4e-4 · k / 4 at the k-th update): the rate logged is the
    one the update applied (optax's counter, which a skip does not advance), not the iteration's."""
    cfg = TrainConfig(train_iters=5, lr=4e-4, lr_warmup_iters=4, log_interval=1, eval_iters=0)
    metrics = tmp_path / "m.jsonl"
    train(
        TINY,
        ParallelConfig(micro_batch_size=8, global_batch_size=8) if reference_step else PARALLEL,
        cfg,
        RunOptions(
            data_path=small_corpus,
            progress=False,
            poison_steps=(0, 1),
            reference_step=reference_step,
            metrics_file=str(metrics),
        ),
    )
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["skipped_iters"] for r in records] == [1, 1, 0, 0, 0]
    assert [r["lr"] for r in records] == pytest.approx([0.0, 0.0, 0.0, 1e-4, 2e-4], rel=1e-6, abs=1e-12)  # float32


@pytest.mark.slow  # three training runs, 16 s
def test_no_load_optim_restarts_the_schedule_at_the_updates_applied_not_the_iteration(small_corpus, tmp_path):
    """Megatron steps its learning-rate scheduler only after a successful update: after 2 skips in 4 iterations the
    schedule is at 2, which the checkpoint records and --no-load-optim restarts from (as a full resume goes on)."""
    cfg = TrainConfig(train_iters=4, lr=4e-4, lr_warmup_iters=8, lr_decay_iters=20, log_interval=1, eval_iters=0)
    options = dict(data_path=small_corpus, progress=False, async_save=False)
    ckpt = tmp_path / "ckpt"
    train(TINY, PARALLEL, cfg, RunOptions(save=str(ckpt), poison_steps=(1, 2), **options))
    assert checkpoint.read_meta(ckpt, 4)["schedule_step"] == 2
    lrs = {}
    for load_optim in (True, False):
        metrics = tmp_path / f"{load_optim}.jsonl"
        train(
            TINY,
            PARALLEL,
            cfg.replace(train_iters=5),
            RunOptions(load=str(ckpt), load_optim=load_optim, metrics_file=str(metrics), **options),
        )
        lrs[load_optim] = [json.loads(line)["lr"] for line in metrics.read_text().splitlines()]
    assert lrs[True] == lrs[False] == pytest.approx([1e-4], rel=1e-6)  # lr(2) = 4e-4 · 2 / 8, not lr(4) = 2e-4
