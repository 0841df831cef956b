"""The measured bubble (`ptd_jax/train/bubble.py`): its two-point split, the simulated figure it is compared with,
and the loop's banner line."""

import math

import pytest

from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.train import RunOptions, bubble, train

TINY = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)


def test_two_point_recovers_the_fixed_part_over_the_ideal():
    c, t_mb, m = 0.3, 0.1, 8
    split = bubble.two_point(c + m * t_mb, c + 2 * m * t_mb, m)
    assert split["per_microbatch_s"] == pytest.approx(t_mb)
    assert split["fixed_s"] == pytest.approx(c)
    assert split["bubble_fraction"] == pytest.approx(c / (m * t_mb))
    assert split["idle_share"] == pytest.approx(c / (c + m * t_mb))


@pytest.mark.parametrize("schedule, v, m", [("1f1b", 1, 8), ("gpipe", 1, 4), ("interleaved", 2, 8)])
def test_the_two_point_figure_of_the_simulated_table_is_its_bubble(schedule, v, m):
    from ptd_jax.parallel.step import pipeline_schedule

    parallel = ParallelConfig(
        pipeline_model_parallel_size=4,
        virtual_pipeline_stages=v,
        pipeline_schedule=schedule,
        micro_batch_size=1,
        global_batch_size=m,
    )
    simulated = pipeline_schedule(parallel).simulate()["bubble_fraction"]
    assert bubble.simulated_two_point(parallel) == pytest.approx(simulated, rel=0.02)


@pytest.mark.slow  # 20 s: a p = 2 run that compiles and times the step twice
def test_the_loop_logs_the_measured_bubble_after_the_first_step(small_corpus, capsys):
    parallel = ParallelConfig(pipeline_model_parallel_size=2, micro_batch_size=2, global_batch_size=8)
    summary = train(
        TINY,
        parallel,
        TrainConfig(train_iters=3, lr=3e-3, log_interval=1, eval_iters=0),
        RunOptions(data_path=small_corpus, progress=False, measure_bubble=True),
    )
    measured = summary["measured_bubble"]
    assert measured["m"] == 4 and set(measured["median_step_s"]) == {"m", "2m"}
    t_m, t_2m = measured["median_step_s"]["m"], measured["median_step_s"]["2m"]
    assert t_2m > 0 and t_m > 0  # t_2m > t_m is what a quiet machine shows; a loaded one may not
    assert measured["fixed_s"] + 4 * measured["per_microbatch_s"] == pytest.approx(t_m)
    assert math.isfinite(measured["bubble_fraction"])
    assert measured["simulated_bubble"] == pytest.approx(2 * (2 - 1) / (3 * 4))  # 1F1B, I and W split: 2(p-1)/(3m)
    err = capsys.readouterr().err
    assert f"pipeline: measured bubble {measured['bubble_fraction']:.3f}" in err
    assert "train step timed at m=4" in err and "m=8" in err


@pytest.mark.slow  # a p = 2 training run, 15-20 s without the one above (also -m slow) to compile its step
def test_short_runs_and_p1_do_not_measure(small_corpus):
    run = RunOptions(data_path=small_corpus, progress=False)
    tcfg = TrainConfig(train_iters=2, lr=3e-3, log_interval=1, eval_iters=0)
    assert (
        train(TINY, ParallelConfig(pipeline_model_parallel_size=2, micro_batch_size=2, global_batch_size=8), tcfg, run)[
            "measured_bubble"
        ]
        is None
    )
    assert (
        bubble.after_first_step(
            True, *[None] * 4, bubble.StepBuild(None, TINY, ParallelConfig(), None, None), 500, print
        )
        is None
    )
