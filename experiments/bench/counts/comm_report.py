"""Tensor-parallel communication of one training step, measured in the compiled HLO, against the paper's analytic
8·b·s·h·(t−1)/t elements per layer per microbatch (§3.2: 4 all-reduces of b·s·h per layer, forward + backward,
each moving 2(t−1)/t of its payload per device in a ring).

Usage: python -m experiments.bench.counts.comm_report [--fake-devices 8] [--out experiments/results/comm_report.json]
"""

from __future__ import annotations

import argparse
import json

from experiments.common import fake_devices, write_json


def report(L: int, h: int, heads: int, s: int, b: int, m: int, d: int, t: int, sp: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from ptd_jax.analysis.collectives import hlo_collectives, jaxpr_collectives, summarize
    from ptd_jax.analysis.hlo import group_size
    from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
    from ptd_jax.optimizer import make_optimizer
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import init_sharded_state, make_parallel_train_step

    cfg = ModelConfig(num_layers=L, hidden_size=h, num_attention_heads=heads, seq_length=s)
    parallel = ParallelConfig(
        data_parallel_size=d,
        tensor_model_parallel_size=t,
        micro_batch_size=b,
        global_batch_size=b * d * m,
        sequence_parallel=sp,
    )
    tcfg = TrainConfig()
    opt = make_optimizer(tcfg)
    mesh = make_mesh(parallel)
    state = jax.eval_shape(lambda k: init_sharded_state(k, cfg, opt, mesh), jax.random.key(0))
    step = make_parallel_train_step(mesh, cfg, parallel, tcfg, opt, state)
    x = jax.ShapeDtypeStruct((m, d * b, s), jnp.int32)
    hlo = step.lower(state, x, x, x, jax.random.key(0)).compile().as_text()
    measured = hlo_collectives(hlo)
    itemsize = 4
    act_bytes = b * s * h * itemsize  # one [b, s, h] float32 activation
    ring = 2 * (t - 1) / t
    tensor_ops = [
        op | {"op": kind}
        for kind, entry in measured.items()
        for op in entry["ops"]
        if group_size(op["replica_groups"]) == t and t > 1
    ]
    if sp:
        # all-gather results and reduce-scatter inputs are full [b, s, h]; each moves (t-1)/t of it per device.
        full = [op for op in tensor_ops if op["op"] in ("all-gather", "reduce-scatter")]
        payload = sum(op["times"] * (op["bytes"] * (t if op["op"] == "reduce-scatter" else 1)) for op in full)
        traffic = payload * (t - 1) / t
        non_layer = 4 * m * act_bytes * (t - 1) / t  # embedding and output layer: 2 fwd + 2 bwd
    else:
        full = [op for op in tensor_ops if op["op"] == "all-reduce" and op["bytes"] == act_bytes]
        payload = sum(op["times"] * op["bytes"] for op in full)
        traffic = payload * ring
        non_layer = 2 * m * act_bytes * ring  # embedding forward, output-layer input gradient
    per_layer_per_micro = (traffic - non_layer) / (L * m)
    analytic = 8 * b * s * h * (t - 1) / t * itemsize
    return {
        "layout": {"d": d, "t": t, "sequence_parallel": sp, "L": L, "h": h, "s": s, "b": b, "m": m},
        "hlo": {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in measured.items()},
        "jaxpr": summarize(jaxpr_collectives(jax.make_jaxpr(step)(state, x, x, x, jax.random.key(0)))),
        "activation_collectives_per_step": sum(op["times"] for op in full),
        "measured_layer_bytes_per_layer_per_microbatch": per_layer_per_micro,
        "analytic_bytes_per_layer_per_microbatch": analytic,
        "ratio": per_layer_per_micro / analytic if analytic else None,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake-devices", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--num-microbatches", type=int, default=2)
    parser.add_argument("--out", default="experiments/results/comm_report.json")
    args = parser.parse_args(argv)
    fake_devices(args.fake_devices)
    rows = []
    for d, t in [(1, 2), (1, 4), (1, 8), (2, 4), (4, 2)]:
        for sp in (False, True):
            row = report(
                args.num_layers,
                args.hidden_size,
                args.num_attention_heads,
                args.seq_length,
                args.micro_batch_size,
                args.num_microbatches,
                d,
                t,
                sp,
            )
            rows.append(row)
            print(
                json.dumps(
                    {
                        **row["layout"],
                        "measured": row["measured_layer_bytes_per_layer_per_microbatch"],
                        "analytic": row["analytic_bytes_per_layer_per_microbatch"],
                        "ratio": row["ratio"],
                    }
                )
            )
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
