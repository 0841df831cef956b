"""Bytes per parameter per device with and without the distributed optimizer, against Megatron-LM's table, from
XLA's `memory_analysis()` of the compiled training step (compiled, not run).

Megatron's table (bytes per parameter; d = data-parallel size):

| params, grads        | without | with the distributed optimizer |
|----------------------|---------|--------------------------------|
| 16-bit, fp32 grads   | 18      | 6 + 12/d                       |
| fp32, fp32 grads     | 16      | 8 + 8/d                        |

Bytes per parameter = (argument bytes + temp bytes) / parameters per device: the arguments are the training state
(donated: the outputs alias them), the temps the float32 gradient accumulators, the gathered 16-bit copy and the
activations. The model is wide and the batch tiny (b = 1) so that the parameter state dominates, and the
activations are taken out exactly: every configuration is compiled at two sequence lengths s and 2s, and the
activation-free bytes are the intercept 2·T(s) − T(2s) (activations grow linearly in s; the s² attention scores
are 0.05% of the state at s = 32).

Three compute dtypes, because the CPU backend changes what a 16-bit step holds:
- float16 against Megatron's bf16 row (18 / 6 + 12/d): XLA:CPU computes float16 natively, and ptd_jax's float16
  keeps float32 gradients accumulated in place (Megatron's main_grad), so the step holds what Megatron's bf16
  step holds (Megatron's fp16 row, 20 / 4 + 16/d, has 16-bit gradients, which ptd_jax never keeps);
- bfloat16: XLA:CPU has no bfloat16 dot, so it converts the gathered weights to float32 copies before the matmuls
  (4 bytes per parameter where the GPU holds 2); measured for the record, and on a GPU by `gpu_check.sh`;
- float32 (the fp32 row).

On XLA:CPU an all-reduce is out of place (XLA:GPU runs NCCL's in place), so without the distributed optimizer the
step holds a second float32 gradient while the data-parallel all-reduce runs, also at d = 1 (a one-device
all-reduce that XLA:CPU keeps as a copy): +4 bytes per parameter on CPU.

Usage: python -m experiments.bench.memory.bench_optimizer_memory [--dtypes float16 bfloat16 float32]
       [--data-sizes 1 2 4 8] [--microbatches 1 4] [--out experiments/results/bench_optimizer_memory.json]
"""

from __future__ import annotations

import argparse

from experiments.common import fake_devices, write_json

MODEL = dict(num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=1024)
SEQ_LENGTHS = (16, 32)


def megatron_bytes(dtype: str, d: int, distributed: bool) -> float:
    if dtype == "float32":
        return 8 + 8 / d if distributed else 16.0
    return 6 + 12 / d if distributed else 18.0


def compiled_memory(dtype: str, d: int, distributed: bool, m: int, seq_length: int, model: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
    from ptd_jax.optimizer import make_optimizer
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import init_sharded_state, make_parallel_train_step

    cfg = ModelConfig(**model, seq_length=seq_length, dtype=dtype)
    parallel = ParallelConfig(
        data_parallel_size=d, micro_batch_size=1, global_batch_size=d * m, use_distributed_optimizer=distributed
    )
    train_cfg = TrainConfig()
    opt = make_optimizer(train_cfg)
    mesh = make_mesh(parallel)
    state = init_sharded_state(jax.random.key(0), cfg, opt, mesh, parallel, shapes_only=True, train_cfg=train_cfg)
    step = make_parallel_train_step(mesh, cfg, parallel, train_cfg, opt, state)
    batch = jax.ShapeDtypeStruct((m, d, seq_length), jnp.int32)
    mem = step.lower(state, batch, batch, batch, jax.random.key(0)).compile().memory_analysis()
    return {
        "params": gpt.count_params(state["params"]),
        "argument_bytes": mem.argument_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes,
    }


def measure(dtype: str, d: int, distributed: bool, m: int, model: dict = MODEL) -> dict:
    """One row: bytes per parameter of the compiled step with the activations taken out, against Megatron's."""
    short, long = (compiled_memory(dtype, d, distributed, m, s, model) for s in SEQ_LENGTHS)
    n = short["params"]
    temp = 2 * short["temp_bytes"] - long["temp_bytes"]  # activations extrapolated to zero
    per_param = (short["argument_bytes"] + temp) / n
    megatron = megatron_bytes(dtype, d, distributed)
    return {
        "dtype": dtype,
        "d": d,
        "m": m,
        "distributed_optimizer": distributed,
        "params": n,
        "argument_bytes": short["argument_bytes"],
        "temp_bytes": {str(s): r["temp_bytes"] for s, r in zip(SEQ_LENGTHS, (short, long))},
        "activation_bytes_per_param_at_s16": (short["temp_bytes"] - temp) / n,
        "state_bytes_per_param": short["argument_bytes"] / n,
        "temp_bytes_per_param": temp / n,
        "bytes_per_param": per_param,
        "megatron_bytes_per_param": megatron,
        "relative_error": per_param / megatron - 1,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dtypes", nargs="+", default=["float16", "bfloat16", "float32"], choices=["float16", "bfloat16", "float32"]
    )
    parser.add_argument("--data-sizes", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--microbatches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--out", default="experiments/results/bench_optimizer_memory.json")
    args = parser.parse_args(argv)
    import jax

    fake_devices(max(args.data_sizes))
    backend = jax.default_backend()
    rows = []
    for dtype in args.dtypes:
        for m in args.microbatches:
            for d in args.data_sizes:
                for distributed in (False, True) if d > 1 else (False,):
                    r = measure(dtype, d, distributed, m)
                    rows.append(r)
                    print(
                        f"{dtype} m={m} d={d} distributed={distributed!s:5}: {r['bytes_per_param']:6.2f} bytes/param "
                        f"(state {r['state_bytes_per_param']:.2f} + temp {r['temp_bytes_per_param']:.2f}; "
                        f"activations at s=16 {r['activation_bytes_per_param_at_s16']:.2f} taken out); Megatron "
                        f"{r['megatron_bytes_per_param']:.2f} ({100 * r['relative_error']:+.1f}%)",
                        flush=True,
                    )
    out = {"backend": backend, "model": MODEL, "seq_lengths": SEQ_LENGTHS, "micro_batch_size": 1, "rows": rows}
    write_json(args.out, out, end="\n")
    return out


if __name__ == "__main__":
    main()
