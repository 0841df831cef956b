"""The experiment scripts: their smoke runs end to end on CPU (slow: `pytest -m slow`), and the FLOP count."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_kernels_smoke_checks_every_kernel_and_the_fused_training_step(tmp_path):
    from experiments.bench_kernels import main

    out = tmp_path / "bench.json"
    main(["--smoke", "--out", str(out), "--plot", str(tmp_path / "bench.png")])
    result = json.loads(out.read_text())
    for row in result["attention"]:
        assert "pallas_check_error" not in row and row["pallas_max_rel_err"] <= 1e-5, row
    for name in ("layer_norm", "cross_entropy"):
        assert result["norm_and_loss"][f"{name}_pallas_max_rel_err"] <= 1e-5, result["norm_and_loss"]
    assert result["self_check"] == {"flash_attention": None, "layer_norm": None, "cross_entropy": None}
    xla, fused = result["training_step"]
    assert "error" not in xla and "error" not in fused and fused["fused_kernels"]
    assert fused["loss"] == pytest.approx(xla["loss"], rel=1e-5)
    assert (tmp_path / "bench.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_interleaving_smoke_runs_every_case(tmp_path):
    out = tmp_path / "bench.json"  # its own process: the benchmark sets 4 fake devices before JAX starts
    env = {**os.environ, "XLA_FLAGS": ""}
    subprocess.run([sys.executable, "-m", "experiments.bench_interleaving", "--smoke", "--out", str(out)],
                   check=True, cwd=Path(__file__).resolve().parents[1], env=env)
    (result,) = json.loads(out.read_text()).values()
    assert len(result["median_step_s"]) == 5 and all(t > 0 for t in result["median_step_s"].values())
    assert set(result["ratios"]) == {"interleaved/1f1b (uniform)", "1f1b/reference (uniform)",
                                     "interleaved/1f1b (per-rank)", "1f1b/reference (per-rank)"}


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_per_rank_pipeline_runs_exactly_megatrons_matmuls(recompute):
    """The traced executor's matmul FLOPs (each switch branch times the table's counts) equal the analytic count
    of Megatron's schedule on the last rank, for per-rank branching; uniform adds the bubble's dummy cells."""
    from experiments.pipeline_flops import measure

    model = dict(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=32)
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        row = measure("tiny", model, schedule, 2, v, 4, 2, recompute)
        assert row["per-rank"]["executed_over_megatron_per_rank"] == pytest.approx([1.0, 1.0], rel=1e-9)
        assert row["uniform"]["executed_over_megatron_last_rank"] > 1.05
        assert row["uniform"]["critical_path_flops"] == pytest.approx(row["per-rank"]["critical_path_flops"],
                                                                      rel=1e-9)
