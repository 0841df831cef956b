"""Pallas kernels against XLA (and cuDNN attention) over a sweep of sequence lengths, plus one training step of a
~1.3B GPT on one device (TFLOP/s per device by eq. 3, and MFU). JSON and a plot.

On a GPU:   python -m experiments.bench.speed.bench_kernels            (bf16, compiled kernels)
On a CPU:   python -m experiments.bench.speed.bench_kernels --smoke    (tiny shapes, interpret mode: checks only)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pallas_kernels.self_check import error_text, max_rel_error


def timed(fn, *args, repeats=10):
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_rows(seqs, batch, heads, head_dim, dtype, interpret, repeats):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import flash_attention, flash_attention_reference

    rows = []
    for s in seqs:
        keys = jax.random.split(jax.random.key(s), 3)
        q, k, v = (jax.random.normal(kk, (batch, s, heads, head_dim), jnp.float32).astype(dtype) for kk in keys)
        impls = {
            "pallas": lambda q, k, v: flash_attention(q, k, v, interpret=interpret),
            "xla": lambda q, k, v: flash_attention_reference(q, k, v),
        }
        if jax.default_backend() == "gpu":
            impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn"
            )
        row = {"seq": s}
        try:  # the compiled kernel against the float32 definition: output and all three gradients
            probe = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)

            def loss(fn, probe=probe):
                return lambda q_, k_, v_: jnp.sum(fn(q_, k_, v_).astype(jnp.float32) * probe)

            got = jax.jit(jax.value_and_grad(loss(impls["pallas"]), argnums=(0, 1, 2)))(q, k, v)
            want = jax.jit(jax.value_and_grad(loss(impls["xla"]), argnums=(0, 1, 2)))(
                *(a.astype(jnp.float32) for a in (q, k, v))
            )
            row["pallas_max_rel_err"] = max_rel_error(got, want)
        except Exception as err:  # record and go on: one run on a lent GPU must bring back every number it can
            row["pallas_check_error"] = error_text(err)
        for name, fn in impls.items():
            fwd = jax.jit(fn)
            fwd_bwd = jax.jit(
                jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
            )
            try:
                row[f"{name}_fwd_ms"] = 1e3 * timed(fwd, q, k, v, repeats=repeats)
                row[f"{name}_fwd_bwd_ms"] = 1e3 * timed(fwd_bwd, q, k, v, repeats=repeats)
            except Exception as err:  # a backend without this implementation: record why, keep going
                row[f"{name}_error"] = error_text(err)
        flops = 4 * batch * heads * s * s * head_dim / 2  # causal: half of QKᵀ and PV
        for name in impls:
            if f"{name}_fwd_ms" in row:
                row[f"{name}_fwd_tflops"] = flops / (row[f"{name}_fwd_ms"] / 1e3) / 1e12
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def norm_and_loss_rows(tokens, hidden, vocab, dtype, interpret, repeats):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import cross_entropy_reference, layer_norm, layer_norm_reference, softmax_cross_entropy

    x = jax.random.normal(jax.random.key(0), (tokens, hidden), jnp.float32).astype(dtype)
    w, b = jnp.ones((hidden,)), jnp.zeros((hidden,))
    logits = jax.random.normal(jax.random.key(1), (tokens, vocab), jnp.float32).astype(dtype)
    labels = jax.random.randint(jax.random.key(2), (tokens,), 0, vocab)
    out = {}
    cases = {
        "layer_norm": (lambda x: layer_norm(x, w, b, interpret=interpret), lambda x: layer_norm_reference(x, w, b), x),
        "cross_entropy": (
            lambda z: softmax_cross_entropy(z, labels, interpret=interpret),
            lambda z: cross_entropy_reference(z, labels),
            logits,
        ),
    }
    for name, (pallas_fn, xla_fn, arg) in cases.items():
        grads = {}
        probe = jax.random.normal(jax.random.key(3), jax.eval_shape(xla_fn, arg).shape, jnp.float32)
        for impl, fn in (("pallas", pallas_fn), ("xla", xla_fn)):
            grad = jax.jit(jax.value_and_grad(lambda a, fn=fn, probe=probe: jnp.sum(fn(a).astype(jnp.float32) * probe)))
            try:
                grads[impl] = grad(arg)
                out[f"{name}_{impl}_fwd_bwd_ms"] = 1e3 * timed(grad, arg, repeats=repeats)
            except Exception as err:  # record and go on (see attention_rows)
                out[f"{name}_{impl}_error"] = error_text(err)
        if len(grads) == 2:
            out[f"{name}_pallas_max_rel_err"] = max_rel_error(grads["pallas"], grads["xla"])
    print(json.dumps(out), flush=True)
    return out


def training_step_row(preset, micro_batch, dtype, attention_backend, fused_kernels, steps):
    row = {
        "preset": preset,
        "micro_batch": micro_batch,
        "dtype": dtype,
        "attention_backend": attention_backend,
        "fused_kernels": fused_kernels,
    }
    try:
        row.update(_training_step(preset, micro_batch, dtype, attention_backend, fused_kernels, steps))
    except Exception as err:  # record and go on (see attention_rows)
        row["error"] = error_text(err)
    print(json.dumps(row), flush=True)
    return row


def _training_step(preset, micro_batch, dtype, attention_backend, fused_kernels, steps):
    import jax
    import numpy as np

    from ptd_jax.config import ParallelConfig, TrainConfig
    from ptd_jax.presets import model_preset
    from ptd_jax.optimizer import make_optimizer
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import init_sharded_state, make_parallel_train_step
    from ptd_jax.perf.flops import flops_per_iteration, model_flops_per_iteration
    from ptd_jax.perf.hardware import device_peak_tflops

    cfg = model_preset(preset).replace(
        vocab_size=50257, dtype=dtype, attention_backend=attention_backend, fused_kernels=fused_kernels
    )
    parallel = ParallelConfig(micro_batch_size=micro_batch, global_batch_size=micro_batch)
    tcfg = TrainConfig(recompute_granularity="selective")
    opt = make_optimizer(tcfg)
    mesh = make_mesh(parallel)
    state = init_sharded_state(jax.random.key(0), cfg, opt, mesh, parallel)
    step = make_parallel_train_step(mesh, cfg, parallel, tcfg, opt, state)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, micro_batch, cfg.seq_length), dtype=np.int32)
    mask = np.ones_like(tokens)
    key = jax.random.key(1)
    start = time.perf_counter()
    state, metrics = step(state, tokens, tokens, mask, key)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, tokens, tokens, mask, key)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - start) / steps
    peak, source = device_peak_tflops(jax.devices()[0].device_kind, dtype == "bfloat16")
    return {
        "seq": cfg.seq_length,
        "compile_s": compile_s,
        "step_s": step_s,
        "loss": float(metrics["lm_loss"]),
        "tflops_per_device_eq3": flops_per_iteration(cfg, micro_batch) / step_s / 1e12,
        "mfu": model_flops_per_iteration(cfg, micro_batch) / step_s / (peak * 1e12),
        "peak_source": source,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check)")
    parser.add_argument("--out", default="experiments/results/bench_kernels.json")
    parser.add_argument("--plot", default="experiments/results/bench_kernels.png")
    parser.add_argument(
        "--parts",
        default="attention,norm,step",
        help="comma-separated subset of attention,norm,step (a second run on a lent GPU can skip what the first got)",
    )
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if parts - {"attention", "norm", "step"}:
        parser.error(f"--parts={args.parts!r}: each part is one of attention, norm, step")
    import jax
    import jax.numpy as jnp

    from pallas_kernels.self_check import self_check_model
    from ptd_jax.presets import model_preset

    on_gpu = jax.default_backend() == "gpu"
    smoke = args.smoke or not on_gpu
    result = {
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "self_check": None,
        "attention": [],
        "norm_and_loss": None,
        "training_step": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every row: a run cut short by a time limit still leaves what it measured
        out.write_text(json.dumps(result, indent=1))

    preset = "tiny" if smoke else "1.3b"
    dtype = "float32" if smoke else "bfloat16"
    result["self_check"] = self_check_model(
        model_preset(preset).replace(vocab_size=50257, dtype=dtype), interpret=not on_gpu
    )
    print(json.dumps({"self_check": result["self_check"]}), flush=True)
    save()
    if smoke:
        seqs, attn_shape, repeats = [32, 64], (1, 2, 16, jnp.float32), 2
        norm_shape = (64, 64, 512, jnp.float32)
        variants, micro_batch, steps = (("xla", False), ("pallas", True)), 2, 2
    else:
        seqs, attn_shape, repeats = [512, 1024, 2048, 4096, 8192], (4, 16, 128, jnp.bfloat16), 10
        norm_shape = (8192, 2048, 50304, jnp.bfloat16)
        # the GPU default (cudnn + fused, `cli/train/checks.default_attention_backend`) first, then the others
        variants = (("cudnn", True), ("pallas", True), ("xla", False), ("cudnn", False), ("pallas", False))
        micro_batch, steps = 4, 5
    # the step first: on a lent GPU the MFU matters most, and the attention sweep's float32 checks take longest
    for backend, fused in variants if "step" in parts else ():
        result["training_step"].append(training_step_row(preset, micro_batch, dtype, backend, fused, steps))
        save()
    if "norm" in parts:
        result["norm_and_loss"] = norm_and_loss_rows(*norm_shape, not on_gpu, repeats=repeats)
        save()
    for seq in seqs if "attention" in parts else ():
        result["attention"] += attention_rows([seq], *attn_shape, not on_gpu, repeats=repeats)
        save()
    attn = result["attention"]
    if args.plot and attn:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name in ("pallas", "xla", "cudnn"):
            pts = [(r["seq"], r[f"{name}_fwd_bwd_ms"]) for r in attn if f"{name}_fwd_bwd_ms" in r]
            if pts:
                ax.plot(*zip(*pts), "o-", label=name)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("attention fwd+bwd (ms)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"causal attention on {result['device']}")
        fig.savefig(args.plot, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
