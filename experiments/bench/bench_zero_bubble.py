"""Zero-bubble (split-backward) schedules against 1F1B and interleaved 1F1B on four fake CPU devices.

p = 4, m = 8, d = t = 1, b = 1, recompute none, per-rank branching, the bench model (`common.BENCH_MODEL`, as in
`bench_interleaving.py`): "1f1b", "interleaved" (v = 2), "1f1b-split", "zb-h1", "zb-v" (v = 2, layers in the V:
`sharding.stage_layers(..., v_shape=True)`). Per schedule:
- XLA's temporary bytes per device of the compiled grad step, and the ratio to 1F1B's;
- executed matmul FLOPs per rank and the critical path (Σ over ticks of the busiest cell's FLOPs), counted from the
  traced step (`analysis.jaxpr.dot_flops`) and the table. Fused schedules: as `pipeline_flops.py` (named calls
  chunk_forward / chunk_backward / head_backward, weighted by the table's active cells). Split schedules: the
  per-layer named calls of `pipeline/split.py` (layer_forward, layer_input_backward, layer_weight_backward) times
  the chunk's layers, the head's backward added on the cells whose `unit_arrays` head column is set, times the
  table's cells of that kind;
- the step's median wall and process CPU time over alternating rounds after a warm-up (`common.alternate`);
- the simulated bubble (`pipeline.build(name, p, v, m).simulate(times=(1, 1, 1))`).

Usage: python -m experiments.bench.bench_zero_bubble [--rounds 3] [--out experiments/results/zero_bubble_bench.json]
"""

from __future__ import annotations

import argparse
import os
import statistics

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

from experiments.common import BENCH_MODEL, RESULTS, TIMING_NOTE, alternate, fake_devices, write_json  # noqa: E402

P, M = 4, 8
CASES = [("1f1b", 1), ("interleaved", 2), ("1f1b-split", 1), ("zb-h1", 1), ("zb-v", 2)]


def build_step(cfg, schedule, v):
    """(jitted grad step, concrete args, abstract args, schedule table) — `common.pipeline_step`'s layout, with
    ZB-V's layers staged in the V."""
    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.config import ParallelConfig
    from ptd_jax.parallel import sharding
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import make_parallel_grad_step, pipeline_schedule

    parallel = ParallelConfig(data_parallel_size=1, pipeline_model_parallel_size=P, tensor_model_parallel_size=1,
                              virtual_pipeline_stages=v, pipeline_schedule=schedule, micro_batch_size=1,
                              global_batch_size=M, pipeline_branching="per-rank")
    mesh = make_mesh(parallel)
    params = gpt.init_params(jax.random.key(0), cfg, 1)
    params = {**params, "layers": sharding.stage_layers(params["layers"], P, v, v_shape=schedule == "zb-v")}
    specs = sharding.param_specs(params, pipelined=True)
    params = jax.device_put(params, sharding.named(mesh, specs))
    step = make_parallel_grad_step(mesh, cfg, parallel, specs, recompute="none",
                                   scatter_gather=parallel.scatter_gather)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (M, 1, cfg.seq_length), dtype=np.int32)
    args = (params, tokens, tokens, np.ones_like(tokens))
    return step, args, pipeline_schedule(parallel)


def _named(jaxpr, name):
    from ptd_jax.analysis.jaxpr import dot_flops, named_calls

    body = next(named_calls(jaxpr, name), None)
    return 0.0 if body is None else dot_flops(body)


def cell_flops(jaxpr, sched, layers: int):
    """[T, p] matmul FLOPs of each cell, and the per-piece FLOPs they were built from."""
    import numpy as np


    head = _named(jaxpr, "head_backward")
    if not getattr(sched, "split", False):  # fused ticks: pipeline_flops.py's count (per-rank branching)
        from ptd_jax.parallel.pipeline.executor import tick_work

        work = {n: _named(jaxpr, n) for n in ("chunk_forward", "chunk_backward", "head_backward")}
        where = tick_work(sched, "per-rank")
        chunk = np.array([[work["chunk_forward" if kind == "F" else "chunk_backward"]] * sched.p
                          for kind in sched.kinds])
        active = np.array([[c.action is not None for c in row] for row in sched.cells])
        return chunk * active + head * where["head"], {**work, "method": "named calls x table (pipeline_flops.py)"}
    from ptd_jax.parallel.pipeline.unit_executor import unit_arrays

    k = layers  # the named calls are per layer
    fwd, bwd, wgt = (k * _named(jaxpr, n) for n in ("layer_forward", "layer_input_backward", "layer_weight_backward"))
    cols = unit_arrays(sched)
    per_kind = np.array([0.0, fwd, bwd, wgt])  # per layer calls x layers; the head apart
    cells = per_kind[cols["kind"]] + head * (cols["head"] > 0)
    return cells, {"idle": 0.0, "F": fwd, "B_without_head": bwd, "W": wgt, "head_backward": head,
                   "method": "per-layer named calls (layer_forward, layer_input_backward, layer_weight_backward)"
                             " x layers x unit table"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "zero_bubble_bench.json"))
    args = parser.parse_args(argv)
    fake_devices(P)
    import time

    import jax
    import numpy as np

    from ptd_jax.config import ModelConfig
    from ptd_jax.parallel import pipeline

    cfg = ModelConfig(**BENCH_MODEL)
    rows, steps = {}, {}
    for name, v in CASES:
        t0 = time.perf_counter()
        step, step_args, sched = build_step(cfg, name, v)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), step_args)
        cells, work = cell_flops(jax.make_jaxpr(step)(*abstract), sched, cfg.num_layers // (P * v))
        compiled = step.lower(*step_args).compile()
        steps[name] = (compiled, step_args)
        mem = compiled.memory_analysis()
        sim = pipeline.build(name, P, v, M).simulate(times=(1.0, 1.0, 1.0))
        rows[name] = {"v": v, "ticks": int(cells.shape[0]), "temp_bytes_per_device": int(mem.temp_size_in_bytes),
                      "executed_flops_per_rank": [float(x) for x in cells.sum(axis=0)],
                      "executed_flops_total": float(cells.sum()),
                      "critical_path_flops": float(cells.max(axis=1).sum()), "work_flops": work,
                      "simulated_bubble_fraction": sim["bubble_fraction"], "simulated": sim,
                      "build_s": time.perf_counter() - t0}
        print(f"{name}: built in {rows[name]['build_s']:.1f}s, temp {mem.temp_size_in_bytes / 2**20:.1f} MiB",
              flush=True)
    times = alternate(steps, args.rounds)
    base = rows["1f1b"]
    for name, row in rows.items():
        row["median_wall_s"] = statistics.median(times[name]["wall"])
        row["median_cpu_s"] = statistics.median(times[name]["cpu"])
        row["all_wall_s"], row["all_cpu_s"] = times[name]["wall"], times[name]["cpu"]
        row["temp_over_1f1b"] = row["temp_bytes_per_device"] / base["temp_bytes_per_device"]
        row["critical_path_over_1f1b"] = row["critical_path_flops"] / base["critical_path_flops"]
        row["executed_over_1f1b"] = row["executed_flops_total"] / base["executed_flops_total"]
    for row in rows.values():
        row["wall_over_1f1b"] = row["median_wall_s"] / base["median_wall_s"]
        row["cpu_over_1f1b"] = row["median_cpu_s"] / base["median_cpu_s"]
    targets = {
        "1f1b-split temp <= 0.65x 1f1b": rows["1f1b-split"]["temp_over_1f1b"] <= 0.65,
        "zb-h1 critical path < 1f1b": rows["zb-h1"]["critical_path_flops"] < base["critical_path_flops"],
        "zb-v critical path <= interleaved": (rows["zb-v"]["critical_path_flops"]
                                              <= rows["interleaved"]["critical_path_flops"]),
    }
    write_json(args.out, {"model": BENCH_MODEL, "p": P, "m": M, "d": 1, "t": 1, "micro_batch_size": 1,
                          "recompute": "none", "branching": "per-rank", "rounds": args.rounds,
                          "timing_note": TIMING_NOTE, "schedules": rows, "targets_met": targets}, end="\n")
    head = (f"{'schedule':12} {'temp MiB':>9} {'x1f1b':>6} {'exec TF':>8} {'crit TF':>8} {'x1f1b':>6} "
            f"{'wall s':>7} {'cpu s':>7} {'bubble':>7}")
    print(head)
    for name, r in rows.items():
        print(f"{name:12} {r['temp_bytes_per_device'] / 2**20:9.1f} {r['temp_over_1f1b']:6.3f} "
              f"{r['executed_flops_total'] / 1e12:8.4f} {r['critical_path_flops'] / 1e12:8.4f} "
              f"{r['critical_path_over_1f1b']:6.3f} {r['median_wall_s']:7.2f} {r['median_cpu_s']:7.2f} "
              f"{r['simulated_bubble_fraction']:7.3f}")
    for k, ok in targets.items():
        print(f"{k}: {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
