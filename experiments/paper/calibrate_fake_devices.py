"""The performance model (`ptd_jax.perf`, `ptd-plan`'s) calibrated once on this machine's own measured steps on
fake CPU devices, and its error against them.

Reads the measured gradient steps that the figure scripts stored (`"measured"` records with `"layouts"` in
experiments/results/fig_*.json: the small model at (d, p, t, v, b, m, recompute, scatter/gather)), and fits the two
rates of a `Hardware` for "this host as n fake devices": a matmul rate R and a memory rate W, shared by the n
devices (each gets R/n and W/n: the fake devices share the host's cores, and under uniform branching every rank
executes as much as the critical path). Collectives run at W/n too (on one host they are copies). The prediction
for a gradient step is the model's iteration time without the optimizer term. The fit minimises the squared log
error over all steps (a grid search over R and W, coarse then fine); the error per step is reported, with its
median and largest absolute value. Nothing from the paper enters.

Usage: python -m experiments.paper.calibrate_fake_devices [--out experiments/results/calibrate_fake_devices.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from experiments import common
from experiments.paper import figures


def measured_steps(results: Path) -> list[dict]:
    """Every measured step of the figure scripts' JSON: {"source", "name", "model", "layout", "step_s"}."""
    steps = []
    for path in sorted(results.glob("fig*.json")):
        record = json.loads(path.read_text()).get("measured")
        if not record or "layouts" not in record:
            continue
        for name, layout in record["layouts"].items():
            steps.append(
                {
                    "source": path.name,
                    "name": name,
                    "model": record["model"],
                    "layout": layout,
                    "step_s": record["median_step_s"][name],
                }
            )
    return steps


def parallel_of(step):
    from ptd_jax.config import ModelConfig, ParallelConfig

    lay = step["layout"]
    p, v, d, b, m = lay.get("p", 1), lay.get("v", 1), lay.get("d", 1), lay.get("b", 1), lay["m"]
    cfg = ModelConfig(**step["model"])
    parallel = ParallelConfig(
        data_parallel_size=d,
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=lay.get("t", 1),
        virtual_pipeline_stages=v,
        pipeline_schedule=lay.get("schedule", "1f1b") if p > 1 else "1f1b",
        micro_batch_size=b,
        global_batch_size=m * b * d,
        scatter_gather=lay.get("scatter_gather", True),
    )
    return cfg, parallel, lay.get("recompute", "none")


def predict_step(step, matmul_rate: float, memory_rate: float) -> float:
    from ptd_jax.perf import HARDWARE, predict

    cfg, parallel, recompute = parallel_of(step)
    n = parallel.num_devices
    hw = replace(
        HARDWARE["a100-80gb"],
        name="fake-cpu",
        peak_flops=matmul_rate / n,
        hbm_bandwidth=memory_rate / n,
        nvlink_bandwidth=memory_rate / n,
        ib_bandwidth=memory_rate / n,
        gpus_per_node=1 << 20,
        gemm_efficiency=1.0,
        hbm_efficiency=1.0,
        nvlink_efficiency=1.0,
        ib_efficiency=1.0,
    )
    pred = predict(cfg, parallel, hw, recompute)
    return pred.iteration_time_s - pred.terms["optimizer"]


def loss(steps, r, w) -> float:
    return sum(math.log(predict_step(s, r, w) / s["step_s"]) ** 2 for s in steps)


def fit(steps) -> tuple[float, float]:
    """Grid search in log space: R over 1e8 … 1e12 FLOP/s, W over 1e8 … 1e12 B/s, then finer grids around the
    best."""
    best = None
    lo_r, hi_r, lo_w, hi_w = 8.0, 12.0, 8.0, 12.0
    for _ in range(3):
        grid_r = [lo_r + (hi_r - lo_r) * i / 12 for i in range(13)]
        grid_w = [lo_w + (hi_w - lo_w) * i / 12 for i in range(13)]
        best = min((loss(steps, 10**a, 10**b), a, b) for a in grid_r for b in grid_w)
        _, a, b = best
        span_r, span_w = (hi_r - lo_r) / 6, (hi_w - lo_w) / 6
        lo_r, hi_r, lo_w, hi_w = a - span_r, a + span_r, b - span_w, b + span_w
    return 10 ** best[1], 10 ** best[2]


def plot(result, plt):
    rows = result["steps"]
    fig, ax = plt.subplots(figsize=(7, 6))
    sources = sorted({r["source"] for r in rows})
    for i, source in enumerate(sources):
        rs = [r for r in rows if r["source"] == source]
        ax.scatter([r["measured_s"] for r in rs], [r["predicted_s"] for r in rs], s=18, label=source, color=f"C{i}")
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 0.8
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1.25
    ax.plot([lo, hi], [lo, hi], "k:", lw=0.8)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="measured step time (s)",
        ylabel="predicted (calibrated) (s)",
        title=f"ptd_jax.perf calibrated on fake CPU devices: median |error| {result['median_abs_error']:.0%}, "
        f"max {result['max_abs_error']:.0%}",
    )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(common.RESULTS), help="folder of the figure scripts' JSON")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    steps = measured_steps(Path(args.results))
    if len(steps) < 3:
        raise SystemExit(
            f"calibrate_fake_devices: error: {len(steps)} measured steps under {args.results}; run the "
            f"fig_*.py scripts first"
        )
    r, w = fit(steps)
    rows = []
    for s in steps:
        pred = predict_step(s, r, w)
        rows.append(
            {
                "source": s["source"],
                "name": s["name"],
                "measured_s": s["step_s"],
                "predicted_s": pred,
                "error": pred / s["step_s"] - 1,
            }
        )
    errors = [abs(x["error"]) for x in rows]
    result = {
        "fitted": {
            "matmul_flops_per_s_host": r,
            "memory_bytes_per_s_host": w,
            "per_device": "R/n and W/n on n fake devices",
        },
        "num_steps": len(rows),
        "median_abs_error": statistics.median(errors),
        "max_abs_error": max(errors),
        "steps": rows,
        "timing_note": common.TIMING_NOTE,
        "note": "two rates fitted on all steps at once (not per figure); the error is in-sample",
    }
    figures.write("calibrate_fake_devices", result, plot, args.out)
    print(json.dumps({k: result[k] for k in ("fitted", "num_steps", "median_abs_error", "max_abs_error")}))


if __name__ == "__main__":
    main()
