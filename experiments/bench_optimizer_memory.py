"""Bytes per parameter per device with and without the distributed optimizer (Megatron-LM's ZeRO-1 table:
bf16 params + fp32 grads + fp32 master weights and Adam moments = 18 bytes without it, 6 + 12/d with it), from
XLA's `memory_analysis()` of the compiled training step (compiled, not run, on fake CPU devices).

The model is wide and the batch tiny (b = 1, s = 16) so that the parameter state dominates: bytes per parameter =
(argument bytes + temp bytes) / parameters per device; the arguments are the training state (donated, so the
outputs alias them), the temps the float32 gradients, the gathered bf16 copy and the activations.

Usage: python -m experiments.bench_optimizer_memory [--out experiments/results/optimizer_memory.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODEL = dict(num_layers=2, hidden_size=512, num_attention_heads=8, seq_length=16, vocab_size=1024)
DATA_SIZES = (1, 2, 4, 8)
MICROBATCHES = (1, 4)
MICROBATCHES_NOTE = ("m = 1 holds one float32 gradient; m > 1 also the microbatch's gradient before it is added to "
                     "the accumulator (Megatron adds into main_grad inside the backward): 4 bytes per parameter more "
                     "than Megatron's table")


def megatron_bytes(d: int, distributed: bool) -> float:
    return 6 + 12 / d if distributed else 18.0


def measure(d: int, distributed: bool, m: int) -> dict:
    import jax
    import jax.numpy as jnp

    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
    from ptd_jax.optimizer import make_optimizer
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import init_sharded_state, make_parallel_train_step

    cfg = ModelConfig(**MODEL, dtype="bfloat16")
    parallel = ParallelConfig(data_parallel_size=d, micro_batch_size=1, global_batch_size=d * m,
                              use_distributed_optimizer=distributed)
    train_cfg = TrainConfig()
    opt = make_optimizer(train_cfg)
    mesh = make_mesh(parallel)
    state = init_sharded_state(jax.random.key(0), cfg, opt, mesh, parallel, shapes_only=True, train_cfg=train_cfg)
    step = make_parallel_train_step(mesh, cfg, parallel, train_cfg, opt, state)
    batch = jax.ShapeDtypeStruct((m, d, cfg.seq_length), jnp.int32)
    compiled = step.lower(state, batch, batch, batch, jax.random.key(0)).compile()
    mem = compiled.memory_analysis()
    n = gpt.count_params(state["params"])
    per_param = (mem.argument_size_in_bytes + mem.temp_size_in_bytes) / n
    return {"d": d, "m": m, "distributed_optimizer": distributed, "params": n,
            "argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
            "state_bytes_per_param": mem.argument_size_in_bytes / n, "temp_bytes_per_param": mem.temp_size_in_bytes / n,
            "bytes_per_param": per_param, "megatron_bytes_per_param": megatron_bytes(d, distributed),
            "relative_error": per_param / megatron_bytes(d, distributed) - 1}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/optimizer_memory.json")
    args = parser.parse_args(argv)
    from ptd_jax.parallel.mesh import set_fake_devices

    set_fake_devices(max(DATA_SIZES))
    rows = [measure(d, distributed, m) for m in MICROBATCHES for d in DATA_SIZES for distributed in (False, True)]
    for r in rows:
        print(f"m={r['m']} d={r['d']} distributed={r['distributed_optimizer']!s:5}: {r['bytes_per_param']:6.2f} bytes/param "
              f"(state {r['state_bytes_per_param']:.2f} + temp {r['temp_bytes_per_param']:.2f}); Megatron "
              f"{r['megatron_bytes_per_param']:.2f} ({100 * r['relative_error']:+.1f}%)")
    out = {"model": {**MODEL, "dtype": "bfloat16"}, "micro_batch_size": 1, "rows": rows,
           "note": MICROBATCHES_NOTE}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
