"""Activation memory of the pipeline executor against the schedule's stash (paper §2.2.1: 1F1B bounds the
in-flight microbatches by p, GPipe holds all m), from XLA's `memory_analysis()` of the compiled gradient step.

For GPipe and 1F1B at p = 4 and m ∈ {8, 32}, and interleaved (v = 2): temp bytes per device of the compiled step
next to the table's peak stash × bytes per slot (one chunk input, b·s·h activations). Compiled, not run, on
fake CPU devices. The executor stashes chunk inputs and recomputes each chunk in its backward, so its stash is
the table's; the rest of the temp bytes is one tick's working set, which does not grow with m.

Usage: python -m experiments.pipeline_memory [--out experiments/results/pipeline_memory.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODEL = dict(num_layers=16, hidden_size=256, num_attention_heads=8, vocab_size=6400, seq_length=256)
CASES = [("gpipe", 1, 8), ("gpipe", 1, 32), ("1f1b", 1, 8), ("1f1b", 1, 32), ("interleaved", 2, 8),
         ("interleaved", 2, 32)]
P = 4


def measure(schedule, v, m):
    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig, ParallelConfig
    from ptd_jax.parallel import sharding
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import make_parallel_grad_step, pipeline_schedule

    cfg = ModelConfig(**MODEL)
    parallel = ParallelConfig(pipeline_model_parallel_size=P, virtual_pipeline_stages=v, pipeline_schedule=schedule,
                              micro_batch_size=1, global_batch_size=m)
    sched = pipeline_schedule(parallel)
    abstract = jax.eval_shape(lambda key: gpt.init_params(key, cfg), jax.random.key(0))
    abstract = {**abstract, "layers": jax.eval_shape(lambda x: sharding.stage_layers(x, P, v), abstract["layers"])}
    specs = sharding.param_specs(abstract, pipelined=True)
    mesh = make_mesh(parallel)
    step = make_parallel_grad_step(mesh, cfg, parallel, specs)
    shardings = sharding.named(mesh, specs)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    batch = jax.ShapeDtypeStruct((m, 1, cfg.seq_length), np.int32)
    compiled = step.lower(params, batch, batch, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    slot_bytes = cfg.seq_length * cfg.hidden_size * np.dtype(cfg.dtype).itemsize  # b = 1
    return {"schedule": schedule, "p": P, "v": v, "m": m, "ticks": sched.ticks, "peak_stash": sched.peak_stash,
            "activation_slots": sched.num_act_slots, "gradient_slots": sched.num_grad_slots,
            "stash_bytes_rank0": sched.peak_stash[0] * slot_bytes, "temp_bytes_per_device": temp}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/pipeline_memory.json")
    args = parser.parse_args(argv)
    from ptd_jax.parallel.mesh import set_fake_devices

    set_fake_devices(P)
    rows = [measure(*case) for case in CASES]
    by = {(r["schedule"], r["m"]): r for r in rows}
    summary = {f"{s}: temp m=32 / m=8": by[(s, 32)]["temp_bytes_per_device"] / by[(s, 8)]["temp_bytes_per_device"]
               for s in ("gpipe", "1f1b", "interleaved")}
    for r in rows:
        print(json.dumps({k: r[k] for k in ("schedule", "m", "peak_stash", "stash_bytes_rank0",
                                             "temp_bytes_per_device")}))
    print(json.dumps(summary))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": MODEL, "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
