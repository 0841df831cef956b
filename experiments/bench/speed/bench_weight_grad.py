"""A zero-bubble W's kernel gradient on one CPU device, written two ways: `jax.linear_transpose` of the forward
einsum (before) and the einsum of input and output gradient written out (`tensor.tap_weight_grad`, now).

Each reads fc1's taps from record-shaped buffers [slots, layers, n] at a traced (slot, layer), as a W's loop does,
and adds the gradient into a float32 accumulator in place; the bench model's shapes (s 256, h 256, 4h 1024). Prints
the time per call (median of alternating rounds) and whether XLA:CPU gave the matmul to its fast path (a
`ynn_fusion` in the compiled program) or ran it as a plain `dot`.

Usage: python -m experiments.bench.speed.bench_weight_grad [--rounds 7]
       [--out experiments/results/bench_weight_grad.json]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

from experiments.common import BENCH_MODEL, RESULTS, write_json


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100, help="calls per round")
    parser.add_argument("--out", default=str(RESULTS / "bench_weight_grad.json"))
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ptd_jax.parallel import tensor as tp

    s, h = BENCH_MODEL["seq_length"], BENCH_MODEL["hidden_size"]
    f = 4 * h
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((6, 2, s * h)), jnp.float32)  # fc1's input rows
    gs = jnp.asarray(rng.standard_normal((8, 2, s * f)), jnp.float32)  # fc1's output-gradient rows
    kernel = jnp.zeros((h, f), jnp.float32)

    def transposed(tap):
        return jax.linear_transpose(lambda w: jnp.einsum(tp.DOTS["fc1"], tap["x"], w), kernel)(tap["g"])[0]

    def written_out(tap):
        return tp.tap_weight_grad("fc1", tap, kernel)

    def step_of(grad):
        def step(xs, gs, acc, slot, j):
            tap = {"x": xs[slot, j].reshape(1, s, h), "g": gs[slot, j].reshape(1, s, f)}
            return acc.at[j].add(grad(tap))

        return jax.jit(step, donate_argnums=2)

    steps = {"linear_transpose": step_of(transposed), "einsum written out": step_of(written_out)}
    accs, fast = {}, {}
    for name, step in steps.items():
        text = step.lower(xs, gs, jnp.zeros((2, h, f)), 1, 1).compile().as_text()
        fast[name] = bool(re.search(r"%ynn_fusion\S* = ", text))
        accs[name] = jax.block_until_ready(step(xs, gs, jnp.zeros((2, h, f)), 1, 1))
    np.testing.assert_allclose(accs["einsum written out"], accs["linear_transpose"], rtol=1e-5, atol=1e-3)
    times = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            acc = accs[name]
            start = time.perf_counter()
            for _ in range(args.calls):
                acc = step(xs, gs, acc, 1, 1)
            jax.block_until_ready(acc)
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
            accs[name] = acc
    rows = {
        name: {"median_ms": statistics.median(t), "all_ms": t, "fast_matmul_path": fast[name]}
        for name, t in times.items()
    }
    for name, row in rows.items():
        print(f"{name:20s} {row['median_ms']:.3f} ms per call, fast matmul path: {row['fast_matmul_path']}")
    write_json(
        args.out, {"shapes": {"s": s, "h": h, "ffn": f}, "rounds": args.rounds, "calls": args.calls, "rows": rows}
    )


if __name__ == "__main__":
    main()
