"""Activation memory of the pipeline executor against the schedule's stash (paper §2.2.1: 1F1B bounds the
in-flight microbatches by p, GPipe holds all m), from XLA's `memory_analysis()` of the compiled gradient step.

For GPipe and 1F1B at p = 4 and m ∈ {8, 32}, and interleaved (v = 2), with `--recompute-granularity` none
(Megatron's default: every F stashes each layer's vjp residuals, no matmul is recomputed) and full (each layer is
checkpointed: the stash holds each layer's input, every B recomputes its layers): temp bytes per device of the
compiled step next to the table's peak stash × bytes per slot (the residuals of one chunk's k layers and one
microbatch, as `stash.Residuals` traces a layer: under full, k layer inputs of b·s·h). Compiled, not run, on fake
CPU devices. The rest of the temp bytes is one tick's working set, which does not grow with m. Megatron's activation
formula (Korthikanti et al. 2022, per layer and 16-bit activations: s·b·h·(34 + 5·a·s/h) bytes) is printed next to
the residual bytes for scale.

"1f1b" splits its backwards (I, then W at once): its record also holds the matmul taps W reads (`stash.Record`, the
"hold" and "w" pools of `Table.slots`), which `slot_bytes` (the vjp residuals alone) does not count; the rows give
every pool's slots. Rows in results/pipeline_memory.json from before the one pipeline measured the previous
executor, whose "1f1b" was today's `1f1b-lockstep` (fused backwards).

Usage: python -m experiments.bench.memory.pipeline_memory [--out experiments/results/pipeline_memory.json]
"""

from __future__ import annotations

import argparse
import json

from experiments.common import BENCH_MODEL, fake_devices, write_json

MODEL = BENCH_MODEL
CASES = [
    (s, v, m, r) for r in ("none", "full") for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)) for m in (8, 32)
]
P = 4


def residual_slot_bytes(cfg, layers_per_chunk: int, recompute: str) -> int:
    """Bytes of one stash slot under `recompute`: k times the traced vjp residuals of one layer (b = 1), the layer
    checkpointed as the executor does it (`model.remat_layer`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, PartitionSpec

    from ptd_jax import model as gpt
    from ptd_jax.parallel import sharding
    from ptd_jax.parallel import tensor as tp
    from ptd_jax.parallel.pipeline.stash import Residuals
    from ptd_jax.parallel.vma import mark_varying

    # Typed as in the executor: the chunk's weights split over "tensor" (here of size 1), everything varying over
    # "pipe"; otherwise autodiff would keep pcast copies of the weights among the residuals.
    mesh = jax.make_mesh((1, 1), ("pipe", "tensor"), devices=jax.devices()[:1], axis_types=(AxisType.Auto,) * 2)
    layers = jax.eval_shape(lambda key: gpt.init_params(key, cfg)["layers"], jax.random.key(0))
    specs = sharding.param_specs({"layers": layers})["layers"]
    layers = jax.tree.map(lambda a: jax.ShapeDtypeStruct((layers_per_chunk, *a.shape[1:]), a.dtype), layers)
    x = jax.ShapeDtypeStruct((1, cfg.seq_length, cfg.hidden_size), jnp.dtype(cfg.dtype))
    found = {}

    def body(lc, x):
        lc, x = jax.tree.map(lambda a: mark_varying(a, ("pipe",)), (lc, x))
        layer = gpt.remat_layer(lambda lp, h, k: tp.transformer_layer(lp, h, cfg, False, k, recompute), recompute)
        one = jax.tree.map(lambda a: a[0], lc)
        found["bytes"] = layers_per_chunk * Residuals.trace(lambda lp, h: layer(lp, h, None), one, x).slot_bytes
        return x

    jax.eval_shape(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, PartitionSpec()), out_specs=PartitionSpec("pipe")), layers, x
    )
    return found["bytes"]


def measure(schedule, v, m, recompute):
    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig, ParallelConfig
    from ptd_jax.parallel import sharding
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import make_parallel_grad_step, pipeline_schedule

    cfg = ModelConfig(**MODEL)
    parallel = ParallelConfig(
        pipeline_model_parallel_size=P,
        virtual_pipeline_stages=v,
        pipeline_schedule=schedule,
        micro_batch_size=1,
        global_batch_size=m,
    )
    sched = pipeline_schedule(parallel)
    mesh = make_mesh(parallel)
    abstract = jax.eval_shape(lambda key: gpt.init_params(key, cfg), jax.random.key(0))
    params, specs = sharding.place_params(abstract, parallel, mesh)
    step = make_parallel_grad_step(mesh, cfg, parallel, specs, recompute=recompute)
    batch = jax.ShapeDtypeStruct((m, 1, cfg.seq_length), np.int32)
    compiled = step.lower(params, batch, batch, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    k = cfg.num_layers // (P * v)
    act_bytes = cfg.seq_length * cfg.hidden_size * np.dtype(cfg.dtype).itemsize  # one chunk input, b = 1
    slot_bytes = residual_slot_bytes(cfg, k, recompute)
    s_, h, a = cfg.seq_length, cfg.hidden_size, cfg.num_attention_heads
    return {
        "schedule": schedule,
        "recompute": recompute,
        "p": P,
        "v": v,
        "m": m,
        "ticks": sched.ticks,
        "peak_stash": sched.peak_stash,
        "peak_in_flight": sched.peak_in_flight,
        "slots": sched.slots,
        "record_slots": sched.slots["rec"],
        "gradient_slots": sched.slots["grad"],
        "slot_bytes": slot_bytes,
        "megatron_16bit_bytes_per_chunk": k * s_ * h * (34 + 5 * a * s_ / h) if recompute != "full" else k * 2 * s_ * h,
        "stash_bytes_rank0": sched.peak_stash[0] * slot_bytes,
        "buffer_bytes_rank0": sched.slots["rec"] * slot_bytes + sched.slots["act"] * act_bytes,
        "temp_bytes_per_device": temp,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/pipeline_memory.json")
    args = parser.parse_args(argv)
    fake_devices(P)
    rows = [measure(*case) for case in CASES]
    by = {(r["schedule"], r["recompute"], r["m"]): r for r in rows}
    summary = {
        f"{s} {r}: temp m=32 / m=8": by[(s, r, 32)]["temp_bytes_per_device"] / by[(s, r, 8)]["temp_bytes_per_device"]
        for s in ("gpipe", "1f1b", "interleaved")
        for r in ("none", "full")
    }
    for r in rows:
        print(
            json.dumps(
                {
                    k: r[k]
                    for k in (
                        "schedule",
                        "recompute",
                        "m",
                        "peak_stash",
                        "slot_bytes",
                        "stash_bytes_rank0",
                        "temp_bytes_per_device",
                    )
                }
            )
        )
    print(json.dumps(summary))
    write_json(args.out, {"model": MODEL, "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
