"""On a real GPU: the train step's memory as XLA compiled it for this device, as the same step compiled ahead of
time for the matching described target (`ptd_jax/aot`, what `ptd-train --compile-only` reports on a laptop), and
as the device saw it after running (`memory_stats()` peak), beside the planner's prediction.

    python -m experiments.bench.memory.gpu_memory_check [--target h200] [--out FILE]

Runs `gpu_check.sh`'s 1.3B-shaped step on one device (8 layers, bf16, b = 1, m = 4, recompute none; Pallas
kernels as the GPU default). On a CPU host it only compiles (no device memory to read) and says so.
"""

from __future__ import annotations

import argparse
import time

from experiments.common import RESULTS, write_json

GIB = 2**30


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h200")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS / "gpu_memory_check.json"))
    args = parser.parse_args(argv)

    import jax

    from ptd_jax import model as gpt
    from ptd_jax.aot.compile import compile_steps, plugin_installed
    from ptd_jax.perf.hardware import TARGETS
    from ptd_jax.config import ParallelConfig, TrainConfig
    from ptd_jax.presets import model_preset
    from ptd_jax.optimizer import make_optimizer
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import init_sharded_state, make_parallel_train_step
    from ptd_jax.perf.memory import memory_per_gpu

    on_gpu = jax.default_backend() == "gpu"
    cfg = model_preset("1.3b").replace(
        num_layers=args.layers, dtype="bfloat16", attention_backend="pallas", fused_kernels=True
    )
    parallel = ParallelConfig(micro_batch_size=1, global_batch_size=4)
    train_cfg = TrainConfig(recompute_granularity="none")
    record = {
        "device": jax.devices()[0].device_kind,
        "target": args.target,
        "layers": args.layers,
        "predicted_gib": memory_per_gpu(cfg, parallel, "none")["total"] / GIB,
    }
    if plugin_installed():
        _, (aot,) = compile_steps(cfg, parallel, train_cfg, TARGETS[args.target], 1, evaluation=False)
        record["aot_compiled_gib"] = {k: v / GIB for k, v in aot.memory.items()}
    if on_gpu:
        mesh = make_mesh(parallel)
        optimizer = make_optimizer(train_cfg)
        with gpt.kernels_for("gpu"):
            state = init_sharded_state(jax.random.key(0), cfg, optimizer, mesh, parallel, train_cfg=train_cfg)
            step = make_parallel_train_step(mesh, cfg, parallel, train_cfg, optimizer, state)
            tokens = jax.numpy.zeros((4, 1, cfg.seq_length), jax.numpy.int32)
            compiled = step.lower(state, tokens, tokens, tokens + 1, jax.random.key(0)).compile()
        stats = compiled.memory_analysis()
        record["device_compiled_gib"] = {
            "arguments": stats.argument_size_in_bytes / GIB,
            "temporaries": stats.temp_size_in_bytes / GIB,
            "outputs": stats.output_size_in_bytes / GIB,
        }
        start = time.perf_counter()
        for _ in range(2):
            state, metrics = compiled(state, tokens, tokens, tokens + 1, jax.random.key(0))
        jax.block_until_ready(metrics)
        record["step_s"] = (time.perf_counter() - start) / 2
        peak = jax.devices()[0].memory_stats() or {}
        record["device_peak_gib"] = peak.get("peak_bytes_in_use", 0) / GIB
        record["device_bytes_limit_gib"] = peak.get("bytes_limit", 0) / GIB  # JAX's allocator budget
    else:
        record["note"] = "no GPU: the device's compiled and measured memory are not measured here"
    print(record)
    write_json(args.out, record, end="\n")


if __name__ == "__main__":
    main()
