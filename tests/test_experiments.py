"""The experiment scripts run end to end on CPU (slow: `pytest -m slow`)."""

import json

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
