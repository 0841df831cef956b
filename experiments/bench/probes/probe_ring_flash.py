"""Probe: the p2p ring's flash-kernel path (`parallel/context.py`, attention_backend='pallas') compiled by Triton on a
real GPU, against XLA attention: values and gradients, and the time of one forward + backward.

One GPU holds no context axis of 2, but a ring of one rank runs the same code: its load-balanced layout is the
natural order, cut into 2 chunks, and its one hop visits both diagonals (the causal kernel) and the full sub-block
(the kernel without its mask), merged by log-sum-exp, with the backward kernels on the final lse. Grouped-query
attention (32 query heads on 8 key/value heads, head dim 64, Llama 3.2 1B's), float32 and bfloat16.

Prints and writes {"backend", "device", "cases": [{"dtype", "seq_length", "max_rel_err": {out, dq, dk, dv},
"ms": {ring, flash, xla}}]}.

Usage: python -m experiments.bench.probes.probe_ring_flash [--seq-lengths 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from experiments.common import RESULTS, write_json
from ptd_jax import model as gpt
from ptd_jax.parallel import context

B, G, R, K = 1, 8, 4, 64


def grads_fn(attend, do):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * do), (0, 1, 2)))


def median_ms(fn, *args, rounds=10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def run_case(S: int, dtype) -> dict:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, S, G, R, K), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(x, (B, S, G, K), jnp.float32).astype(dtype) for x in keys[1:3])
    do = jax.random.normal(keys[3], q.shape, jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:1]), ("context",))
    ring = context.Ring(1, backend="pallas", interpret=gpt.interpret_kernels())
    spec = P(None, "context")
    ring_attend = jax.shard_map(
        lambda q, k, v: context.ring_attention(q, k, v, ring), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec
    )
    variants = {
        "ring": ring_attend,
        "flash": lambda q, k, v: gpt.causal_attention(q, k, v, backend="pallas"),
        "xla": lambda q, k, v: gpt.causal_attention(q, k, v, backend="xla"),
    }
    fns = {name: grads_fn(fn, do) for name, fn in variants.items()}
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want_out = gpt.causal_attention(*f32, backend="xla")
    _, want = fns["xla"](*f32)
    got_out = jax.jit(ring_attend)(q, k, v)
    _, got = fns["ring"](q, k, v)
    errors = {"out": rel(got_out, want_out), **{f"d{n}": rel(g, w) for n, g, w in zip("qkv", got, want)}}
    ms = {name: median_ms(fn, q, k, v) for name, fn in fns.items()}
    return {"dtype": jnp.dtype(dtype).name, "seq_length": S, "max_rel_err": errors, "ms_fwd_bwd": ms}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--out", default=str(RESULTS / "probe_ring_flash.json"))
    args = parser.parse_args(argv)
    cases = []
    for S in args.seq_lengths:
        for dtype in (jnp.float32, jnp.bfloat16):
            cases.append(run_case(S, dtype))
            print(json.dumps(cases[-1]), flush=True)
    result = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "cases": cases}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
