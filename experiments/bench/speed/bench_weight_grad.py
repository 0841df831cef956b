"""A zero-bubble W's kernel gradient on one CPU device, written two ways: `jax.linear_transpose` of the forward
einsum (before) and the einsum of input and output gradient written out (`tensor.tap_weight_grad`, now).

Each reads fc1's taps from record-shaped buffers [slots, layers, n] at a traced (slot, layer), as a W's loop does,
and adds the gradient into a float32 accumulator in place; the bench model's shapes (s 256, h 256, 4h 1024). Prints
the time per call (median of alternating rounds) and whether XLA:CPU gave the matmul to its fast path (a
`ynn_fusion` in the compiled program) or ran it as a plain `dot`.

`--steps`: also the grad steps of the split schedules (p = 4, m = 8, per-rank, 4 fake CPU devices, the bench
model) compiled with each formulation, timed side by side in alternating rounds against the single-device step.

Usage: python -m experiments.bench.speed.bench_weight_grad [--rounds 7] [--steps [--step-rounds 7]]
       [--out experiments/results/bench_weight_grad.json]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

from experiments.common import BENCH_MODEL, RESULTS, alternate, pipeline_step, reference_step, write_json  # noqa: E402

SPLIT = {"1f1b": 1, "zb-h1": 1, "zb-v": 2}


def transposed_weight_grad(name: str, tap, kernel):
    """The kernel gradient as it was: the transpose of the forward einsum (varying-axes typing as in
    `tensor.tap_weight_grad`)."""
    import jax
    import jax.numpy as jnp

    from ptd_jax.parallel import tensor as tp
    from ptd_jax.parallel.vma import mark_varying, varying_axes

    g = mark_varying(tap["g"], tuple(sorted(varying_axes(tap["x"]) | varying_axes(kernel))))
    return jax.linear_transpose(lambda w: jnp.einsum(tp.dot_spec(name, kernel), tap["x"], w), kernel)(g)[0]


def step_ratios(rounds: int) -> dict:
    """{step: {"wall", "cpu"}} median ratios to the single-device step, each split schedule compiled with the
    transposed ("before") and the written-out ("now") kernel gradient, all timed in the same alternating rounds."""
    from ptd_jax.config import ModelConfig
    from ptd_jax.parallel import tensor as tp

    cfg = ModelConfig(**BENCH_MODEL)
    steps = {"single": reference_step(cfg, "none", m=8)}
    written_out = tp.tap_weight_grad
    try:
        for name, v in SPLIT.items():
            tp.tap_weight_grad = transposed_weight_grad
            steps[f"{name} before"] = pipeline_step(cfg, name, v, "per-rank", "none")
            tp.tap_weight_grad = written_out
            steps[f"{name} now"] = pipeline_step(cfg, name, v, "per-rank", "none")
    finally:
        tp.tap_weight_grad = written_out
    times = alternate(steps, rounds)
    single = {k: statistics.median(times["single"][k]) for k in ("wall", "cpu")}
    return {
        name: {k: statistics.median(t[k]) / single[k] for k in ("wall", "cpu")} | {"all": t}
        for name, t in times.items()
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100, help="calls per round")
    parser.add_argument("--steps", action="store_true", help="also time the split schedules' grad steps both ways")
    parser.add_argument("--step-rounds", type=int, default=7)
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
        return transposed_weight_grad("fc1", tap, kernel)

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
    result = {"shapes": {"s": s, "h": h, "ffn": f}, "rounds": args.rounds, "calls": args.calls, "rows": rows}
    if args.steps:
        ratios = step_ratios(args.step_rounds)
        for name, r in ratios.items():
            print(f"{name:14s} wall {r['wall']:.3f}  cpu {r['cpu']:.3f}  of the single-device step", flush=True)
        result["steps"] = {"p": 4, "m": 8, "branching": "per-rank", "rounds": args.step_rounds, "ratios": ratios}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
