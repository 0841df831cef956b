"""Where a pipeline step's time goes on four fake CPU devices beyond the work it runs: the fixed cost of a tick, and
the time the host's cores wait on the devices' rendezvous.

Two measurements, per schedule (p = 4, m = 8, per-rank branching, recompute none):
1. the fixed cost per tick: the step time of a tiny model (h 32, s 16, V 64: next to no arithmetic) over the table's
   tick count, beside the single-device step of the same tiny model;
2. on the benchmark model (`common.BENCH_MODEL`), from one profiled step: how long 0, 1, ... 4 device threads were
   running (outside a collective). On a 2-core host a time with one running thread leaves a core idle unless XLA
   splits that thread's operations, and a time with 3 or 4 shares the cores. The device threads are those XLA names
   "Eigen" that ran operations, and a thread counts as running from its first event to its last outside collectives
   (its idle gaps in between count as running: the one-thread times are lower bounds).
The first is an upper bound on the fixed cost: the tiny model's steps still hold some work (compare its single-device
step); differences between schedules bound it better.

Usage: python -m experiments.bench.speed.tick_overhead [--rounds 9] [--cases zb-h1 zb-v]
       [--out experiments/results/tick_overhead.json]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import tempfile

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

from experiments.common import BENCH_MODEL, RESULTS, alternate, pipeline_step, reference_step, write_json  # noqa: E402

CASES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-v": 2}
TINY = dict(num_layers=16, hidden_size=32, num_attention_heads=2, vocab_size=64, seq_length=16)
COLLECTIVES = ("ppermute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def running_threads(trace_file: str) -> dict[int, float]:
    """{n: milliseconds during which n device threads were outside a collective} over one profiled step."""
    with gzip.open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    per_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "Eigen" in names.get((e["pid"], e["tid"]), ""):
            per_thread[(e["pid"], e["tid"])].append(e)
    points = []
    for evs in per_thread.values():
        points += [(min(e["ts"] for e in evs), 1), (max(e["ts"] + e["dur"] for e in evs), -1)]
        for e in evs:
            if e["name"].startswith(COLLECTIVES):  # a collective's event spans the wait for the other ranks
                points += [(e["ts"], -1), (e["ts"] + e["dur"], 1)]
    points.sort()
    running, last, spans = 0, points[0][0], collections.Counter()
    for ts, change in points:
        spans[running] += ts - last
        running, last = running + change, ts
    return {n: spans[n] / 1e3 for n in sorted(spans)}


def profile_once(fn, args) -> dict[int, float]:
    import jax

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(fn(*args))
        return running_threads(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default=str(RESULTS / "tick_overhead.json"))
    args = parser.parse_args(argv)

    from ptd_jax.config import ModelConfig
    from ptd_jax.parallel.pipeline import build

    tiny = ModelConfig(**TINY)
    steps = {"single": reference_step(tiny, "none", m=8)}
    for name in args.cases:
        steps[name] = pipeline_step(tiny, name, CASES[name], "per-rank", "none")
    times = alternate(steps, args.rounds)
    single_ms = statistics.median(times["single"]["wall"]) * 1e3
    rows = {}
    for name in args.cases:
        ticks = build(name, 4, CASES[name], 8).ticks
        wall_ms = statistics.median(times[name]["wall"]) * 1e3
        rows[name] = {"ticks": ticks, "tiny_wall_ms": wall_ms, "ms_per_tick": wall_ms / ticks}
        print(f"{name:12s} tiny model: {wall_ms:.1f} ms over {ticks} ticks = {wall_ms / ticks:.2f} ms/tick", flush=True)

    bench = ModelConfig(**BENCH_MODEL)
    for name in args.cases:
        spans = profile_once(*pipeline_step(bench, name, CASES[name], "per-rank", "none"))
        rows[name]["bench_running_threads_ms"] = spans
        print(f"{name:12s} bench model, ms with n device threads running: {spans}", flush=True)
    write_json(
        args.out,
        {
            "tiny_model": TINY,
            "bench_model": BENCH_MODEL,
            "p": 4,
            "m": 8,
            "branching": "per-rank",
            "rounds": args.rounds,
            "tiny_single_wall_ms": single_ms,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
