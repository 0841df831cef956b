"""Evaluation's memory at p > 1 against m: the compiled evaluation step's temp bytes for m ∈ {8, 32, 64} with the
forward-only table (`table.build_forward_only`), which frees an input slot once its forward has read it: flat in m.

Before ac63b79 the evaluation table held every chunk input until a backward that evaluation never runs (m·v slots);
results/eval_memory.json keeps that "held" table's rows beside the "freed" ones, measured on the previous
executor. The one placement (`table.place`) frees an input once read in every table, so there is no "held" table to
build any more: the script measures the forward-only table alone.

Interleaved (v = 2) and 1F1B (v = 1, its forwards in Megatron's order) at p = 4, t = 1, b = 1; compiled, not run,
on 4 fake CPU devices.

Usage: python -m experiments.bench.memory.eval_memory [--out experiments/results/eval_memory.json]
"""

from __future__ import annotations

import argparse
import json

from experiments.common import BENCH_MODEL, fake_devices, write_json

MODEL = BENCH_MODEL
P = 4
CASES = [(s, v, m) for s, v in (("1f1b", 1), ("interleaved", 2)) for m in (8, 32, 64)]


def measure(schedule, v, m):
    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig, ParallelConfig
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.pipeline import build_forward_only
    from ptd_jax.parallel.sharding import place_params
    from ptd_jax.parallel.step import make_parallel_eval_step

    cfg = ModelConfig(**MODEL)
    parallel = ParallelConfig(
        pipeline_model_parallel_size=P,
        virtual_pipeline_stages=v,
        pipeline_schedule=schedule,
        micro_batch_size=1,
        global_batch_size=m,
    )
    sched = build_forward_only(schedule, P, v, m)
    mesh = make_mesh(parallel)
    abstract = jax.eval_shape(lambda key: gpt.init_params(key, cfg), jax.random.key(0))
    params, specs = place_params(abstract, parallel, mesh)
    step = make_parallel_eval_step(mesh, cfg, parallel, specs)
    batch = jax.ShapeDtypeStruct((m, 1, cfg.seq_length), np.int32)
    temp = step.lower(params, batch, batch, batch).compile().memory_analysis().temp_size_in_bytes
    slot_bytes = cfg.seq_length * cfg.hidden_size * np.dtype(cfg.dtype).itemsize  # one chunk input, b = 1
    return {
        "schedule": schedule,
        "v": v,
        "m": m,
        "table": "freed",
        "slots": sched.slots,
        "slot_bytes": slot_bytes,
        "temp_bytes_per_device": temp,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/eval_memory.json")
    args = parser.parse_args(argv)
    fake_devices(P)
    rows = [measure(*case) for case in CASES]
    for r in rows:
        print(json.dumps(r))
    by = {(r["schedule"], r["m"]): r["temp_bytes_per_device"] for r in rows}
    summary = {f"{s} freed: temp m=64 - m=8 (bytes)": by[(s, 64)] - by[(s, 8)] for s in ("1f1b", "interleaved")}
    print(json.dumps(summary))
    write_json(args.out, {"model": MODEL, "p": P, "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
