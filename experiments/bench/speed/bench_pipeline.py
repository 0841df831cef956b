"""Pipeline schedules on simulated devices (paper §2.2, Figures 4 and 12): for a grid of (schedule, p, v, m) —
ticks (placed by the spec's row rule: lockstep for GPipe and interleaved, unit for 1F1B, whose backwards split
into I and W), simulated bubble next to the formula, peak stash per rank, XLA `memory_analysis()` temp bytes per
device, compile time and step time; plus compile time at m = 64 vs m = 8 and the executor at p = 1 against the
reference step with the same (full) recomputation. JSON and a plot.

Usage: python -m experiments.bench.speed.bench_pipeline [--quick] [--out experiments/results/bench_pipeline.json]
Step times on 8 simulated devices sharing the host's cores are not GPU speedups; ratios in one run are comparable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from experiments.common import fake_devices, write_json


def compile_and_time(step, args, repeats: int):
    import jax

    start = time.perf_counter()
    compiled = step.lower(*args).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    out = compiled(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return compile_s, temp, statistics.median(times)


def grad_step(mesh, cfg, parallel, params_specs, sched):
    import jax
    from jax.sharding import PartitionSpec as P

    from ptd_jax.parallel import sharding
    from ptd_jax.parallel.step import GradPlan, loss_and_grads

    def body(params, tokens, labels, mask):
        return loss_and_grads(params, tokens, labels, mask, None, GradPlan(cfg, parallel, params_specs, "none", sched))

    batch = sharding.BATCH_SPEC
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(params_specs, batch, batch, batch), out_specs=(P(), params_specs, P()))
    )


def run_case(name, p, v, m, cfg, repeats):
    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.config import ParallelConfig
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.pipeline import build
    from ptd_jax.parallel.sharding import place_params
    from ptd_jax.parallel.step import accumulation_schedule

    parallel = ParallelConfig(
        pipeline_model_parallel_size=p,
        virtual_pipeline_stages=v,
        pipeline_schedule=name if p > 1 else "1f1b",
        micro_batch_size=1,
        global_batch_size=m,
    )
    sched = build(name, p, v, m) if p > 1 else accumulation_schedule(parallel)  # p = 1: what the training step runs
    mesh = make_mesh(parallel)
    params, specs = place_params(gpt.init_params(jax.random.key(0), cfg), parallel, mesh)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (m, 1, cfg.seq_length), dtype=np.int32)
    step = grad_step(mesh, cfg, parallel, specs, sched)
    compile_s, temp, step_s = compile_and_time(step, (params, tokens, tokens, np.ones_like(tokens)), repeats)
    sim = sched.simulate()
    return {
        "schedule": name,
        "p": p,
        "v": v,
        "m": m,
        "ticks": sched.ticks,
        "bubble": sim["bubble_fraction"],
        "formula_bubble": sched.formula_bubble(),
        "peak_stash": sched.peak_stash,
        "peak_in_flight": sched.peak_in_flight,
        "record_slots": sched.slots,
        "temp_bytes_per_device": temp,
        "compile_s": compile_s,
        "step_s": step_s,
    }


def reference_case(m, cfg, repeats, recompute="full"):
    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.train.reference import accumulate_gradients

    params = gpt.init_params(jax.random.key(0), cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (m, 1, cfg.seq_length), dtype=np.int32)
    step = jax.jit(lambda prm, t, lab, msk: accumulate_gradients(prm, t, lab, msk, cfg, recompute=recompute))
    compile_s, temp, step_s = compile_and_time(step, (params, tokens, tokens, np.ones_like(tokens)), repeats)
    return {
        "schedule": f"reference (recompute={recompute})",
        "p": 1,
        "v": 1,
        "m": m,
        "temp_bytes_per_device": temp,
        "compile_s": compile_s,
        "step_s": step_s,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="experiments/results/bench_pipeline.json")
    parser.add_argument("--plot", default="experiments/results/bench_pipeline.png")
    args = parser.parse_args(argv)
    fake_devices(8)
    from ptd_jax.config import ModelConfig

    cfg = ModelConfig(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=128)
    grid = [("gpipe", 4, 1, 16), ("1f1b", 4, 1, 16), ("interleaved", 4, 2, 16)]
    if not args.quick:
        grid += [
            ("gpipe", 2, 1, 8),
            ("1f1b", 2, 1, 8),
            ("interleaved", 2, 2, 8),
            ("interleaved", 2, 4, 8),
            ("interleaved", 4, 2, 8),
            ("1f1b", 8, 1, 16),
            ("gpipe", 8, 1, 16),
        ]
    rows = []
    for case in grid:
        rows.append(run_case(*case, cfg, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    compile_rows = [run_case("interleaved", 4, 2, m, cfg, 1) for m in (8, 64)]
    for row in compile_rows:
        print(json.dumps(row), flush=True)
    p1 = run_case("1f1b", 1, 1, 8, cfg, args.repeats)
    ref = reference_case(8, cfg, args.repeats)
    by = {(r["schedule"], r["p"], r["v"], r["m"]): r for r in rows}
    gpipe = by[("gpipe", 4, 1, 16)]["temp_bytes_per_device"]
    summary = {
        "temp_ratio_1f1b_over_gpipe_p4_m16": by[("1f1b", 4, 1, 16)]["temp_bytes_per_device"] / gpipe if gpipe else None,
        "temp_ratio_interleaved_over_gpipe_p4_m16": by[("interleaved", 4, 2, 16)]["temp_bytes_per_device"] / gpipe
        if gpipe
        else None,
        "compile_ratio_m64_over_m8": compile_rows[1]["compile_s"] / compile_rows[0]["compile_s"],
        "executor_p1_speed_over_reference_full_recompute": ref["step_s"] / p1["step_s"],
    }
    result = {
        "model": {"num_layers": 8, "hidden_size": 128, "seq_length": 128, "micro_batch_size": 1},
        "grid": rows,
        "compile_m8_m64": compile_rows,
        "executor_p1": p1,
        "reference": ref,
        "summary": summary,
    }
    write_json(args.out, result)
    print(json.dumps(summary))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [f"{r['schedule']}\np={r['p']} v={r['v']} m={r['m']}" for r in rows]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 4))
        a1.bar(labels, [r["bubble"] for r in rows], label="table (simulated)")
        a1.plot(labels, [r["formula_bubble"] for r in rows], "kx", label="formula")
        a1.set_ylabel("bubble fraction")
        a1.legend()
        a2.bar(labels, [(r["temp_bytes_per_device"] or 0) / 2**20 for r in rows])
        a2.set_ylabel("XLA temp MiB per device")
        for ax in (a1, a2):
            ax.tick_params(axis="x", labelsize=6)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
