"""The experiment scripts: their smoke runs end to end on CPU (slow: `pytest -m slow`), and the FLOP count."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_kernels_smoke_checks_every_kernel_and_the_fused_training_step(tmp_path):
    from experiments.bench.speed.bench_kernels import main

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
    subprocess.run(
        [sys.executable, "-m", "experiments.bench.speed.bench_interleaving", "--smoke", "--out", str(out)],
        check=True,
        cwd=Path(__file__).resolve().parents[1],
        env=env,
    )
    (result,) = json.loads(out.read_text()).values()
    assert len(result["median_step_s"]) == 5 and all(t > 0 for t in result["median_step_s"].values())
    assert set(result["ratios"]) == {
        "interleaved/1f1b (uniform)",
        "1f1b/reference (uniform)",
        "interleaved/1f1b (per-rank)",
        "1f1b/reference (per-rank)",
    }


@pytest.mark.parametrize(
    "recompute",
    [pytest.param("none", marks=pytest.mark.slow), "selective", pytest.param("full", marks=pytest.mark.slow)],
)
def test_per_rank_pipeline_runs_exactly_megatrons_matmuls(recompute):
    """The traced executor's matmul FLOPs (its named pieces of work times the table's counts) equal the analytic
    count of Megatron's schedule on every rank, for per-rank branching, less what JAX's checkpoint does not
    recompute because the backward does not need its output (Megatron reruns it): under full the fc2 matmul, under
    selective the attention core's context matmul; uniform adds the bubble's dummy cells."""
    from experiments.bench.counts.pipeline_flops import measure

    model = dict(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=32)
    p, m, t = 2, 4, 2
    for schedule, v in (("1f1b-lockstep", 1), ("interleaved", 2), ("1f1b", 1)):  # 1f1b: I and W split
        row = measure("tiny", model, schedule, p, v, m, t, recompute)
        fc2 = 2 * 32 * 64 * 256 / t  # one layer's fc2 over one microbatch (b = 1, s = 32, h = 64, 4h = 256)
        context = 2 * 32 * 32 * 64 / t  # one layer's scores·V over one microbatch (2·s·s·h)
        skipped = m * v * (8 // (p * v)) * {"none": 0.0, "selective": context, "full": fc2}[recompute]
        assert row["per-rank"]["executed_flops_per_rank"] == pytest.approx(
            [g - skipped for g in row["megatron_flops_per_rank"]], rel=1e-12
        )
        if "uniform" in row:
            assert row["uniform"]["executed_flops_per_rank"][0] > 1.05 * row["per-rank"]["executed_flops_per_rank"][0]
            assert row["uniform"]["critical_path_flops"] == pytest.approx(
                row["per-rank"]["critical_path_flops"], rel=1e-9
            )


def test_compare_torch_refuses_a_tensor_parallel_layout_with_nothing_to_compare_it_with():
    """t > 1 runs only in ptd_jax and megatron-core: without megatron-core, or with GPipe (which it lacks), the
    layout is refused in one line before anything runs."""
    from experiments.compare_torch.compare_torch import main

    with pytest.raises(SystemExit, match=r"layouts \['t2'\] have t > 1, .*--no-megatron-core"):
        main(["--layouts", "serial", "t2", "--no-megatron-core", "--rounds", "1"])
    with pytest.raises(SystemExit, match=r"layouts \['p2t2-gpipe'\] have t > 1, .*no GPipe there"):
        main(["--layouts", "p2t2-gpipe", "--rounds", "1"])


@pytest.mark.slow
def test_compare_torch_losses_agree_with_torch_and_megatron_core_at_serial_p2_and_p2t2(tmp_path):
    """The same GPT, weights and data trained by ptd_jax, by torch.distributed.pipelining (torchrun, gloo), by
    eager torch and by megatron-core's own schedules (torchrun, gloo, CPU): the loss traces agree to 1e-4 at
    (1, 1, 1) and at p = 2 (1F1B), ptd_jax and megatron-core's to 1e-5, also at (p, t) = (2, 2) (3e-7 measured;
    without the all-reduce of the tied embedding's two gradients megatron-core's p = 2 trace is off by 2.5e-4), and
    the grad norms to 1e-4 (2e-6 measured; counting the tensor-parallel shards on one tensor rank only gave a norm
    12% low, which the losses showed only as 5e-6 since Adam barely sees the clipping scale)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from experiments.compare_torch.compare_torch import main

    out = tmp_path / "compare.json"
    result = main(
        [
            "--layouts",
            "serial",
            "p2-1f1b",
            "p2t2-1f1b",
            "--iters",
            "4",
            "--rounds",
            "1",
            "--micro-batch-size",
            "1",
            "--microbatches",
            "2",
            "--model",
            '{"num_layers": 2, "hidden_size": 32, "seq_length": 32}',
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == result and (tmp_path / "compare.png").stat().st_size > 0
    for name in ("serial", "p2-1f1b"):
        row = result["layouts"][name]
        assert len(row["loss_jax"]) == len(row["loss_torch"]) == 4, row
        assert row["loss_max_rel_diff"] < 1e-4 and row["loss_max_rel_diff_jax_vs_eager"] < 1e-4, row
        assert row["jax_tokens_per_s"] > 0 and row["torch_tokens_per_s"] > 0
    assert result["layouts"]["p2-1f1b"]["torch_engine"] == "torch.distributed.pipelining 1f1b"
    assert result["layouts"]["p2-1f1b"]["pipeline_branching"] == "per-rank"  # the default, auto, on CPU
    if importlib.util.find_spec("megatron.core") is not None:
        assert result["megatron_core"]
        for name, schedule in (
            ("serial", "no_pipelining"),
            ("p2-1f1b", "pipelining_without_interleaving"),
            ("p2t2-1f1b", "pipelining_without_interleaving"),
        ):
            row = result["layouts"][name]
            assert row["megatron_core_engine"] == f"megatron.core.pipeline_parallel.forward_backward_{schedule}"
            assert len(row["loss_megatron_core"]) == 4 and row["megatron_core_tokens_per_s"] > 0
            assert row["loss_max_rel_diff_jax_vs_megatron_core"] < 1e-5, row
            assert row["grad_norm_max_rel_diff_jax_vs_megatron_core"] < 1e-4, row
        tp = result["layouts"]["p2t2-1f1b"]  # no torch engine at t > 1: compared with megatron-core
        assert tp["torch_engine"] is None and tp["loss_max_rel_diff"] < 1e-5


def test_figure_predictions_at_the_papers_scale_point_the_papers_way():
    """The figure scripts' predicted halves (pure Python, ptd_jax.perf): the directions the paper's text states."""
    from experiments.paper import fig12_interleaved, fig13_15_parallelism, fig17_recompute, fig18_scatter_gather

    fig12 = fig12_interleaved.predicted()
    ratios = [r["ratio"] for r in fig12]
    assert all(x > 1 for x in ratios) and ratios == sorted(ratios, reverse=True)  # the gap closes with the batch
    assert all(r["speedup"] >= 1 for r in fig18_scatter_gather.predicted())
    assert fig17_recompute.predicted()["full_over_none_at_smallest_batch"] < 1
    fig13 = [r for r in fig13_15_parallelism.predicted()["fig13"] if r["batch"] == 32]
    assert max(fig13, key=lambda r: r["tflops_per_gpu"])["t"] == 8  # Takeaway #1: t = GPUs per node


def test_calibration_recovers_the_rates_of_synthetic_steps():
    """calibrate_fake_devices fits (matmul rate, memory rate) to steps timed by the model itself: it must find
    rates that predict them, and a step time changed by 50% must show up as that step's error."""
    from experiments.common import SMALL
    from experiments.paper.calibrate_fake_devices import fit, predict_step

    layouts = [
        dict(schedule="1f1b", p=4, m=8),
        dict(schedule="interleaved", p=4, v=2, m=8),
        dict(schedule="1f1b", t=2, p=2, m=4),
        dict(d=4, m=4),
        dict(b=4, m=2),
        dict(schedule="1f1b", p=4, m=16, recompute="full"),
    ]
    steps = [{"model": dict(SMALL), "layout": lay} for lay in layouts]
    for s in steps:
        s["step_s"] = predict_step(s, 3e10, 5e9)
    r, w = fit(steps)
    assert r == pytest.approx(3e10, rel=0.15)
    assert all(predict_step(s, r, w) == pytest.approx(s["step_s"], rel=0.05) for s in steps)
    steps[0]["step_s"] *= 1.5
    r, w = fit(steps)
    assert predict_step(steps[0], r, w) / steps[0]["step_s"] - 1 < -0.2


@pytest.mark.parametrize("script", ["fig12_interleaved", "fig13_15_parallelism", "fig18_scatter_gather"])
def test_predicted_only_keeps_the_measured_half_and_recomputes_the_predicted(tmp_path, script, capsys):
    """--predicted-only on a copy of the checked-in JSON whose predicted half is stale: the measured half comes back
    byte for byte, the predicted half is a fresh `predicted()`, the PNG is rewritten; a missing JSON is one error
    line naming it; --rounds or --smoke beside it is refused (they would be silently ignored); a script without the
    flag's implementation refuses it."""
    import importlib

    from experiments.common import RESULTS
    from experiments.paper import figures

    module = importlib.import_module(f"experiments.paper.{script}")
    source = json.loads((RESULTS / f"{script}.json").read_text())
    out = tmp_path / f"{script}.json"
    out.write_text(json.dumps({**source, "predicted": "stale"}, indent=1))
    module.main(["--predicted-only", "--out", str(out)])
    new = json.loads(out.read_text())
    assert json.dumps(new["measured"], indent=1) == json.dumps(source["measured"], indent=1)
    assert new["timing_note"] == source["timing_note"]
    assert new["predicted"] == module.predicted()
    assert out.with_suffix(".png").stat().st_size > 0
    missing = tmp_path / "missing.json"
    with pytest.raises(SystemExit, match=f"{script}: error: .*{missing}.* does not exist"):
        module.main(["--predicted-only", "--out", str(missing)])
    for ignored in (["--rounds", "3"], ["--smoke"]):
        with pytest.raises(SystemExit):
            module.main(["--predicted-only", *ignored, "--out", str(out)])
        assert f"--predicted-only measures nothing: drop {ignored[0]}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        figures.parse_args("fig17", ["--predicted-only"])
    assert "--predicted-only is not implemented" in capsys.readouterr().err
    assert figures.parse_args("fig17", []).rounds == 5 and figures.parse_args("fig17", ["--smoke"]).rounds == 1


@pytest.mark.slow
@pytest.mark.parametrize("script", ["fig_bubble", "fig18_scatter_gather"])
def test_figure_script_smoke_runs(tmp_path, script):
    out = tmp_path / f"{script}.json"  # its own process: the script sets its fake devices before JAX starts
    subprocess.run(
        [sys.executable, "-m", f"experiments.paper.{script}", "--smoke", "--out", str(out)],
        check=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "XLA_FLAGS": ""},
    )
    result = json.loads(out.read_text())
    assert all(t > 0 for t in result["measured"]["median_step_s"].values())
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_divergent_branches_probe_agrees_with_uniform(tmp_path):
    """The GPU probe, run here on fake CPU devices: per-rank (pipe-divergent conds) equals uniform."""
    from experiments.bench.probes.probe_divergent_branches import main

    result = main(["--out", str(tmp_path / "probe.json")])
    assert result["status"] == "ok" and result["max_rel_diff"] <= 1e-5
    assert json.loads((tmp_path / "probe.json").read_text()) == result


@pytest.mark.slow
def test_bench_branching_smoke_times_both_branchings(tmp_path):
    out = tmp_path / "branching.json"
    subprocess.run(
        [sys.executable, "-m", "experiments.bench.speed.bench_branching", "--smoke", "--out", str(out)],
        check=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "XLA_FLAGS": ""},
    )
    rows = json.loads(out.read_text())["layouts"]
    assert set(rows) == {"compare_torch p2 1f1b", "demo d2 p2 t2 interleaved"}
    for row in rows.values():
        assert set(row["median_step_s"]) == {"uniform", "per-rank"} and row["uniform_over_per_rank"] > 0
