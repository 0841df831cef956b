"""The shard_map step at (d, t) = (1, 1) against the single-device reference step: the cost of the explicit
parallel machinery when there is nothing to parallelise (target: ratio >= 1, i.e. no slower).

Alternating rounds in one process (the machine is shared and noisy), medians, JSON out.
Usage: python -m experiments.bench.speed.bench_tp_step [--rounds 7] [--steps 5]
       [--out experiments/results/bench_tp_step.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from experiments.common import write_json


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--recompute-granularity", default="none")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="experiments/results/bench_tp_step.json")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from ptd_jax.config import ParallelConfig, TrainConfig
    from ptd_jax.presets import model_preset
    from ptd_jax.optimizer import make_optimizer
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import init_sharded_state, make_parallel_train_step
    from ptd_jax.train.reference import init_state, make_train_step

    cfg = model_preset(args.preset)
    parallel = ParallelConfig(micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size)
    tcfg = TrainConfig(recompute_granularity=args.recompute_granularity)
    opt = make_optimizer(tcfg)
    m, b = parallel.num_microbatches, parallel.micro_batch_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (m, b, cfg.seq_length), dtype=np.int32)
    mask = np.ones_like(tokens)
    key = jax.random.key(1)

    mesh = make_mesh(parallel)
    states = {
        "reference": init_state(jax.random.key(0), cfg, opt),
        "shard_map": init_sharded_state(jax.random.key(0), cfg, opt, mesh),
    }
    steps = {
        "reference": make_train_step(cfg, tcfg, opt),
        "shard_map": make_parallel_train_step(mesh, cfg, parallel, tcfg, opt, states["shard_map"]),
    }
    compile_s = {}
    for name in steps:
        start = time.perf_counter()
        states[name], metrics = steps[name](states[name], tokens, tokens, mask, key)
        jax.block_until_ready(metrics)
        compile_s[name] = time.perf_counter() - start
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name in steps:
            start = time.perf_counter()
            for _ in range(args.steps):
                states[name], metrics = steps[name](states[name], tokens, tokens, mask, key)
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - start) / args.steps)
    median = {name: statistics.median(v) for name, v in times.items()}
    result = {
        "preset": args.preset,
        "global_batch_size": args.global_batch_size,
        "micro_batch_size": b,
        "recompute": args.recompute_granularity,
        "device": jax.devices()[0].device_kind,
        "median_step_s": median,
        "all_step_s": times,
        "first_call_s": compile_s,
        "speed_ratio_shard_map_over_reference": median["reference"] / median["shard_map"],
    }
    write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("median_step_s", "first_call_s", "speed_ratio_shard_map_over_reference")}))


if __name__ == "__main__":
    main()
