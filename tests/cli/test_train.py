"""`ptd-train` (`ptd_jax/cli/train/`): a smoke run with its metrics and plot, the installed scripts, the demo layout,
the kernel flags and their self-check fallback, and flags reaching the layout. Bad input: test_bad_input_train.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ptd_jax.runtime import platform
from tests.helpers.cli import run_train


REQUIRED_KEYS = {"iteration", "lm_loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu"}
SMALL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--no-progress",
]


def test_smoke_train_with_metrics_plot_and_fake_devices(small_corpus, tmp_path):
    proc = run_train(
        *SMALL,
        "--fake-devices",
        "1",
        "--data-path",
        small_corpus,
        "--train-iters",
        "6",
        "--log-interval",
        "2",
        "--eval-interval",
        "3",
        "--eval-iters",
        "1",
        "--split",
        "90,10,0",
        "--metrics-file",
        str(tmp_path / "m.jsonl"),
        "--plot-dir",
        str(tmp_path / "plots"),
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["iterations"] == 6 and summary["num_devices"] == 1
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train_records] == [2, 4, 6]
    assert all(set(r) >= REQUIRED_KEYS for r in train_records)
    assert [r["iteration"] for r in records if "valid_lm_loss" in r] == [3, 6]
    png = tmp_path / "plots" / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "peak" in proc.stderr and "TFLOP/s" in proc.stderr  # the layout/peak banner says what peak it used


def test_console_scripts_are_installed():
    bindir = Path(sys.executable).parent
    for script in ("ptd-train", "ptd-preprocess"):
        proc = subprocess.run([str(bindir / script), "--help"], capture_output=True, text=True)
        assert proc.returncode == 0 and "--" in proc.stdout


# Bad input (one line, exit 2, nothing written): tests/cli/test_bad_input_train.py.


def test_default_demo_is_the_3d_layout_on_8_simulated_devices(monkeypatch):
    from ptd_jax.cli import train as cli

    args = cli.build_parser().parse_args([])
    monkeypatch.setattr(platform, "accelerator_present", lambda: False)
    assert cli.apply_demo_layout(args)
    cli.fill_defaults(args)
    cfg = cli.model_config_from_args(args)
    parallel = cli.parallel_config_from_args(args, cfg, args.fake_devices)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (4, 128, 257) and args.data_path is None
    assert (
        parallel.data_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.tensor_model_parallel_size,
        parallel.virtual_pipeline_stages,
    ) == (2, 2, 2, 2)
    assert parallel.pipeline_schedule == "interleaved" and parallel.num_microbatches == 4
    # any layout flag, or an accelerator, turns the demo layout off
    assert not cli.apply_demo_layout(cli.build_parser().parse_args(["--fake-devices", "1"]))
    assert not cli.apply_demo_layout(cli.build_parser().parse_args(["--compile-only"]))
    monkeypatch.setattr(platform, "accelerator_present", lambda: True)
    assert not cli.apply_demo_layout(cli.build_parser().parse_args([]))


def test_kernel_flags_default_to_the_kernels_on_gpus_only(monkeypatch):
    from ptd_jax.cli import train as cli

    def config(argv, gpu):
        monkeypatch.setattr(platform, "gpu_present", lambda: gpu)
        return cli.model_config_from_args(cli.build_parser().parse_args(argv))

    assert (config([], gpu=False).attention_backend, config([], gpu=False).fused_kernels) == ("xla", False)
    assert (config([], gpu=True).attention_backend, config([], gpu=True).fused_kernels) == ("pallas", True)
    assert config(["--fused-kernels"], gpu=False).fused_kernels
    assert not config(["--no-fused-kernels"], gpu=True).fused_kernels
    assert config(["--attention-backend", "cudnn"], gpu=True).attention_backend == "cudnn"


def test_failing_default_kernels_fall_back_with_a_warning(capsys):
    from ptd_jax.cli import train as cli
    from ptd_jax.config import ModelConfig

    cfg = ModelConfig(attention_backend="pallas", fused_kernels=True, dtype="bfloat16")
    ok = {"flash_attention": None, "layer_norm": None, "cross_entropy": None}
    assert cli.apply_self_check(cfg, ok, attention=True, fused=True) == cfg
    bad_attention = {**ok, "flash_attention": "ValueError: no"}
    got = cli.apply_self_check(cfg, bad_attention, attention=True, fused=True, cudnn=True)
    assert (got.attention_backend, got.fused_kernels) == ("cudnn", True)
    assert (
        "Pallas flash_attention kernel failed its self-check on this GPU (ValueError: no); using attention by "
        "cudnn instead" in capsys.readouterr().err
    )
    # where cuDNN's attention does not take the model (or under context parallelism, where it is refused): XLA's
    got = cli.apply_self_check(cfg, bad_attention, attention=True, fused=True, cudnn=False)
    assert got.attention_backend == "xla"
    got = cli.apply_self_check(
        cfg.replace(dtype="float32"), {**ok, "cross_entropy": "relative error 1"}, attention=True, fused=True
    )
    assert (got.attention_backend, got.fused_kernels) == ("pallas", False)
    # kernels asked for by flag are kept, failures included
    assert cli.apply_self_check(cfg, bad_attention, attention=False, fused=False) == cfg


@pytest.mark.slow  # the default run has the self-check at the model's window (tests/pallas_kernels/)
def test_kernel_self_check_at_odd_model_widths_passes_in_interpret_mode():
    """hidden 48 (masked LayerNorm columns), head_dim 12 (padded), seq 40 (padded), vocab shard 512 of which 357
    real: every padded and masked path, forward and all gradients (weights and biases included)."""
    from pallas_kernels.self_check import self_check_model
    from ptd_jax.config import ModelConfig

    cfg = ModelConfig(num_layers=1, hidden_size=48, num_attention_heads=4, seq_length=40, vocab_size=357)
    assert self_check_model(cfg, tensor_parallel_size=1, interpret=True) == {
        "flash_attention": None,
        "layer_norm": None,
        "cross_entropy": None,
    }


def test_pipeline_branching_flag_reaches_the_layout():
    from ptd_jax.cli import train as cli

    def layout(argv):
        args = cli.build_parser().parse_args(argv)
        cli.fill_defaults(args)
        cfg = cli.model_config_from_args(args)
        return cli.parallel_config_from_args(args, cfg, 2)

    base = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]
    assert layout(base).pipeline_branching == "auto"
    assert layout(base + ["--pipeline-branching", "per-rank"]).pipeline_branching == "per-rank"
