"""Context parallelism's attention traffic in the compiled HLO of one training step against the formula, per comm
type (`ptd_jax/parallel/context.py`), per layer per microbatch, bytes received by one device:

- p2p: (3c − 2) · 2·b·(S/c)·G·K · itemsize — forward c − 1 hops of K and V; backward c − 1 hops of K and V again
  and c hops of the travelling dK/dV buffers (accumulation dtype: float32 here, as the compute dtype);
- all_gather: 3 · (c − 1)/c · 2·b·S·G·K · itemsize — forward all-gather of K and V, the backward's all-gather again
  (the `none` recompute policy keeps no all-gather's output, `model.REGATHERED_PRIMITIVES`) and the reduce-scatter
  of dK and dV.

G, not H: with grouped-query attention only the key/value heads travel. A collective is attributed to the mesh axes
its groups span (`analysis.hlo.collectives_by_axes`); a collective-permute's result is what a device receives, an
all-gather's (c − 1)/c of its result, a reduce-scatter's c − 1 times its result. The gradient all-reduce over
context (every parameter, once a step) is reported beside it.

Usage: python -m experiments.bench.counts.context_comm [--fake-devices 8]
"""

from __future__ import annotations

import argparse
import json

from experiments.common import RESULTS, fake_devices, write_json

RECEIVED = {"collective-permute": lambda c: 1.0, "all-gather": lambda c: (c - 1) / c, "reduce-scatter": lambda c: c - 1}
"""Bytes a device receives per byte of a collective's result, on a ring of c."""


def formula(comm: str, c: int, b: int, S: int, G: int, K: int, itemsize: int) -> float:
    """Attention bytes received per device per layer per microbatch (module docstring)."""
    if comm == "p2p":
        return (3 * c - 2) * 2 * b * (S // c) * G * K * itemsize
    return 3 * (c - 1) / c * 2 * b * S * G * K * itemsize


def report(comm: str, c: int, L: int, b: int, S: int, d: int) -> dict:
    import jax
    import jax.numpy as jnp

    from ptd_jax.analysis.hlo import collectives_by_axes
    from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
    from ptd_jax.optimizer import make_optimizer
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import init_sharded_state, make_parallel_train_step

    cfg = ModelConfig(
        num_layers=L,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=2,
        seq_length=S,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        add_bias_linear=False,
    )
    parallel = ParallelConfig(
        data_parallel_size=d,
        context_parallel_size=c,
        cp_comm_type=comm,
        micro_batch_size=b,
        global_batch_size=b * d,
    )
    parallel.check_model(cfg)
    tcfg = TrainConfig()
    opt = make_optimizer(tcfg)
    mesh = make_mesh(parallel)
    state = jax.eval_shape(lambda k: init_sharded_state(k, cfg, opt, mesh, parallel), jax.random.key(0))
    step = make_parallel_train_step(mesh, cfg, parallel, tcfg, opt, state)
    x = jax.ShapeDtypeStruct((1, d * b, S), jnp.int32)
    hlo = step.lower(state, x, x, x, jax.random.key(0)).compile().as_text()
    by_axes = collectives_by_axes(hlo, dict(mesh.shape))
    attention = {
        key: entry for key, entry in by_axes.items() if key.split("@")[1] == "context" and key.split("@")[0] in RECEIVED
    }
    received = sum(entry["bytes"] * RECEIVED[key.split("@")[0]](c) for key, entry in attention.items())
    measured = received / L
    analytic = formula(comm, c, b, S, cfg.num_groups, cfg.head_dim, 4)
    return {
        "comm_type": comm,
        "c": c,
        "d": d,
        "L": L,
        "b": b,
        "S": S,
        "H": cfg.num_attention_heads,
        "G": cfg.num_groups,
        "K": cfg.head_dim,
        "dtype": cfg.dtype,
        "hlo_collectives_by_axes": by_axes,
        "attention_collectives": attention,
        "measured_bytes_per_layer_per_microbatch": measured,
        "formula_bytes_per_layer_per_microbatch": analytic,
        "ratio": measured / analytic,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake-devices", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--cases", default="p2p:2,p2p:4,all_gather:2,all_gather:4", help="comm:c,...")
    parser.add_argument("--out", default=str(RESULTS / "context_comm.json"))
    args = parser.parse_args(argv)
    fake_devices(args.fake_devices)
    rows = []
    for case in args.cases.split(","):
        comm, c = case.split(":")
        row = report(comm, int(c), args.num_layers, args.micro_batch_size, args.seq_length, d=2)
        rows.append(row)
        keep = ("comm_type", "c", "measured_bytes_per_layer_per_microbatch", "formula_bytes_per_layer_per_microbatch")
        print(json.dumps({k: row[k] for k in (*keep, "ratio")} | {"attention": row["attention_collectives"]}))
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
