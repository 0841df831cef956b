"""Progress output (`ptd_jax/train/metrics.py`): off a terminal, one Megatron-style line per log interval and no
carriage-return bar updates."""

from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.train import RunOptions, train

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)


def test_output_that_is_not_a_terminal_gets_one_line_per_log_interval(small_corpus, capfd):
    train(
        TINY,
        ParallelConfig(micro_batch_size=4, global_batch_size=8),
        TrainConfig(train_iters=6, lr=3e-3, lr_warmup_iters=1, log_interval=2, eval_iters=0),
        RunOptions(data_path=small_corpus, progress=True),
    )
    err = capfd.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith(" iteration ")]
    assert ["".join(line.split("|")[0].split()[1:]) for line in lines] == ["2/6", "4/6", "6/6"]
    assert "consumed samples:           32 |" in lines[1] and "learning rate: " in lines[1] and "lm loss: " in lines[1]


def test_a_log_line_reads_like_megatrons():
    from ptd_jax.train.metrics import log_line

    record = {
        "iteration": 10,
        "lm_loss": 5.1,
        "grad_norm": 1.234,
        "lr": 3e-4,
        "step_time_s": 0.1234,
        "tokens_per_s": 4150.0,
        "tflops_per_device": 1.5,
        "hardware_tflops_per_device": 2.0,
        "eq3_tflops_per_device": 1.8,
        "mfu": 0.25,
        "skipped_iters": 0,
        "loss_scale": 1.0,
    }
    assert log_line(record, 300, 160) == (
        " iteration       10/     300 | consumed samples:          160 | elapsed time per iteration (ms): 123.4 | "
        "learning rate: 3.000000E-04 | lm loss: 5.100000E+00 | grad norm: 1.234 | loss scale: 1 | number of skipped "
        "iterations:   0 | tokens/s: 4150 | TFLOP/s/device: model 1.5 hardware 2 eq3 1.8 | MFU: 25.0% |"
    )
