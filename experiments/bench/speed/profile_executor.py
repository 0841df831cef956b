"""Where the pipeline executor's time goes at p = 1 (one device): XLA:CPU profile of the executor step and of the
reference step with the same recomputation policy, leaf operations grouped by kind, per step. Explains the ratio
measured by `bench_executor_p1.py`.

Usage: python -m experiments.bench.speed.profile_executor [--recompute none|full]
       [--out experiments/results/profile_executor.json]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import tempfile

from experiments.common import fake_devices, leaf_times, write_json


def profile(steps: dict, runs: int) -> dict:
    """{name: {"wall_ms", "leaf_ms", "ops"}} per step of each compiled `(fn, args)`: `runs` runs each under the
    profiler (after one warm-up call), the first of each left out."""
    import jax

    for fn, fn_args in steps.values():
        jax.block_until_ready(fn(*fn_args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for fn, fn_args in steps.values():
                for _ in range(runs):
                    jax.block_until_ready(fn(*fn_args))
        trace_file = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
        # One window per run: from the end of the previous run's wait to the end of its own (dispatch is async).
        with gzip.open(trace_file) as f:
            events = json.load(f)["traceEvents"]
        waits = sorted(
            (e for e in events if e.get("ph") == "X" and "block_until_ready" in e["name"]), key=lambda e: e["ts"]
        )
        ends = [e["ts"] + e["dur"] for e in waits]
        windows = list(zip([waits[0]["ts"] - 1e6, *ends[:-1]], ends))
        names = [name for name in steps for _ in range(runs)]
        per_step = {}
        for name in steps:
            mine = [w for w, n in zip(windows, names) if n == name][1:]  # the first run of each warms up
            ms, count = leaf_times(trace_file, mine)
            k = len(mine)
            per_step[name] = {
                "wall_ms": sum(hi - lo for lo, hi in mine) / 1e3 / k,
                "leaf_ms": sum(ms.values()) / k,
                "ops": {kind: {"ms": ms[kind] / k, "count": count[kind] // k} for kind in ms},
            }
    return per_step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--recompute", choices=["none", "selective", "full"], default="none", help="recomputation policy of both steps"
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="experiments/results/profile_executor.json")
    args = parser.parse_args(argv)
    fake_devices(8)
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig, ParallelConfig
    from ptd_jax.parallel import sharding
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import GradPlan, accumulation_schedule, loss_and_grads
    from ptd_jax.train.reference import accumulate_gradients

    cfg = ModelConfig(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=128)
    m = 8
    parallel = ParallelConfig(pipeline_schedule="1f1b", micro_batch_size=1, global_batch_size=m)
    sched = accumulation_schedule(parallel)  # the p = 1 table the training step runs
    mesh = make_mesh(parallel)
    params = gpt.init_params(jax.random.key(0), cfg)
    placed, specs = sharding.place_params(params, parallel, mesh)  # p = 1: the reference layout, as training runs it
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (m, 1, cfg.seq_length), dtype=np.int32)
    mask = np.ones_like(tokens)

    def body(prm, tok, lab, msk):
        return loss_and_grads(prm, tok, lab, msk, None, GradPlan(cfg, parallel, specs, args.recompute, sched))

    batch = sharding.BATCH_SPEC
    steps = {
        "executor": (
            jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, batch, batch, batch), out_specs=(P(), specs, P()))),
            (placed, tokens, tokens, mask),
        ),
        "reference": (
            jax.jit(lambda prm, t, lab, msk: accumulate_gradients(prm, t, lab, msk, cfg, recompute=args.recompute)),
            (params, tokens, tokens, mask),
        ),
    }
    per_step = profile(steps, args.runs)
    ex, ref = per_step["executor"]["ops"], per_step["reference"]["ops"]
    kinds = sorted(set(ex) | set(ref), key=lambda kd: -(ex.get(kd, {}).get("ms", 0) - ref.get(kd, {}).get("ms", 0)))
    extra = [
        {
            "op": kd,
            "executor_ms": ex.get(kd, {}).get("ms", 0.0),
            "executor_count": ex.get(kd, {}).get("count", 0),
            "reference_ms": ref.get(kd, {}).get("ms", 0.0),
            "reference_count": ref.get(kd, {}).get("count", 0),
        }
        for kd in kinds[:12]
    ]
    result = {
        "model": {"num_layers": 8, "hidden_size": 128, "seq_length": 128, "micro_batch_size": 1, "m": m},
        "executor_recompute": args.recompute,
        "wall_ms": {name: per_step[name]["wall_ms"] for name in steps},
        "leaf_ms": {name: per_step[name]["leaf_ms"] for name in steps},
        "largest_differences": extra,
    }
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("executor_recompute", "wall_ms", "leaf_ms")}))
    for row in extra:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
