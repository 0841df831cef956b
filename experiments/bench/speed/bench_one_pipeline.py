"""Step time of every pipeline schedule against the single-device step, on four fake CPU devices (issue: "every
schedule ≤ the single-device step of the same model and batch").

p = 4, m = 8, d = t = 1, b = 1, recompute none, per-rank branching, the paper's vocabulary/hidden shape
(`common.BENCH_MODEL`: 16 layers, h 256, V 6400 = 25 h, s 256). The single-device step is
`train.reference.accumulate_gradients` over the same 8 microbatches. Medians of alternating rounds after a warm-up
(`common.alternate`), wall and process CPU time; on fake devices every rank's work shares the host's cores, so a
step's time follows the work all ranks execute, and the per-tick overhead shows as the ratio to the single-device
step.

Usage: python -m experiments.bench.speed.bench_one_pipeline [--rounds 5]
       [--out experiments/results/bench_one_pipeline.json]
"""

from __future__ import annotations

import argparse
import os
import statistics

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

from experiments.common import (
    BENCH_MODEL,
    RESULTS,
    TIMING_NOTE,
    alternate,
    pipeline_step,  # noqa: E402
    reference_step,
    write_json,
)

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", nargs="+", default=[name for name, _ in CASES])
    parser.add_argument("--out", default=str(RESULTS / "bench_one_pipeline.json"))
    args = parser.parse_args(argv)

    from ptd_jax.config import ModelConfig
    from ptd_jax.parallel.pipeline import build

    cfg = ModelConfig(**BENCH_MODEL)
    steps = {"single": reference_step(cfg, "none", m=8)}
    tables = {}
    for name, v in CASES:
        if name in args.cases:
            steps[name] = pipeline_step(cfg, name, v, "per-rank", "none")
            tables[name] = build(name, 4, v, 8)
    times = alternate(steps, args.rounds)
    single = {k: statistics.median(times["single"][k]) for k in ("wall", "cpu")}
    rows = []
    for name, t in times.items():
        wall, cpu = statistics.median(t["wall"]), statistics.median(t["cpu"])
        row = {
            "schedule": name,
            "median_wall_s": wall,
            "median_cpu_s": cpu,
            "wall_vs_single": wall / single["wall"],
            "cpu_vs_single": cpu / single["cpu"],
            "all": t,
        }
        if name in tables:
            row["ticks"] = tables[name].ticks
            row["simulated_bubble"] = tables[name].simulate(times=(1.0, 1.0, 1.0))["bubble_fraction"]
        rows.append(row)
        print(
            f"{name:12s} wall {wall:.3f} s ({wall / single['wall']:.2f}x single)  cpu {cpu:.3f} s "
            f"({cpu / single['cpu']:.2f}x)",
            flush=True,
        )
    write_json(
        args.out,
        {
            "model": BENCH_MODEL,
            "p": 4,
            "m": 8,
            "branching": "per-rank",
            "recompute": "none",
            "rounds": args.rounds,
            "note": TIMING_NOTE,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
