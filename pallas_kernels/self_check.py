"""A few-second check that the kernels compile and agree with their references on this machine's backend.

`ptd-train` runs it on GPUs when it picked the kernels by default, and falls back to XLA (or cuDNN attention)
for any kernel that fails, saying so: a kernel that does not compile for a GPU should cost a warning, not a run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cross_entropy import cross_entropy_reference, softmax_cross_entropy
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.layer_norm import layer_norm, layer_norm_reference

TOLERANCE = 2e-2  # bf16 inputs, float32 accumulation (float32 inputs pass far below it)


def max_rel_error(got, want) -> float:
    """max |got - want| / max |want| per leaf of a pytree pair (float64), the worst leaf."""
    errs = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        errs.append(float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30)))
    return max(errs)


def error_text(err: Exception) -> str:
    """The exception's type and first line (at most 300 characters)."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"


def _cases(hidden: int, head_dim: int, seq: int, vocab_shard: int, vocab_real: int, dtype, window_size=None):
    """One small case per kernel at the model's own widths (those decide tiles, masks and padding) and window."""
    k = jax.random.split(jax.random.key(0), 8)
    qkv = [jax.random.normal(kk, (1, seq, 1, head_dim), jnp.float32).astype(dtype) for kk in k[:3]]
    x = jax.random.normal(k[3], (8, hidden), jnp.float32).astype(dtype)
    w = 1.0 + 0.1 * jax.random.normal(k[4], (hidden,))
    b = 0.1 * jax.random.normal(k[5], (hidden,))
    logits = jax.random.normal(k[6], (8, vocab_shard), jnp.float32).astype(dtype)
    labels = jax.random.randint(k[7], (8,), 0, vocab_real)
    return {
        "flash_attention": (
            lambda interpret: lambda *a: flash_attention(*a, window_size=window_size, interpret=interpret),
            lambda *a: flash_attention_reference(*a, window_size=window_size),
            qkv,
        ),
        "layer_norm": (
            lambda interpret: lambda *a: layer_norm(*a, interpret=interpret),
            layer_norm_reference,
            [x, w, b],
        ),
        "cross_entropy": (
            lambda interpret: lambda z: softmax_cross_entropy(z, labels, vocab_size=vocab_real, interpret=interpret),
            lambda z: cross_entropy_reference(z, labels, vocab_size=vocab_real),
            [logits],
        ),
    }


def self_check(
    *,
    hidden: int = 256,
    head_dim: int = 64,
    seq: int = 128,
    vocab_shard: int = 512,
    vocab_real: int = 500,
    dtype=jnp.bfloat16,
    window_size: int | None = None,
    interpret: bool = False,
) -> dict[str, str | None]:
    """{kernel: None if its forward and all gradients match the reference, else why not (one line)}."""
    results = {}
    cases = _cases(hidden, head_dim, seq, vocab_shard, vocab_real, dtype, window_size)
    for name, (make, reference, args) in cases.items():
        fn = make(interpret)
        probe = jax.random.normal(jax.random.key(1), jax.eval_shape(reference, *args).shape, jnp.float32)

        def loss(f, probe=probe):
            return lambda *a: jnp.sum(f(*a).astype(jnp.float32) * probe)

        argnums = tuple(range(len(args)))
        try:
            got = jax.jit(jax.value_and_grad(loss(fn), argnums=argnums))(*args)
            want = jax.jit(jax.value_and_grad(loss(reference), argnums=argnums))(*args)
            err = max_rel_error(got, want)
            results[name] = None if err <= TOLERANCE else f"relative error {err:.2e} > {TOLERANCE}"
        except Exception as exc:  # any failure to lower, compile or run is the answer to "does it work here"
            results[name] = error_text(exc)
    return results


MAX_CHECK_SEQ = 4096
"""The longest sequence the self-check attends over: its reference holds [S, S] float32 scores and their gradient
(64 GiB each at S = 131072); the kernel's tiles and padding are the same at any longer length."""


def self_check_model(
    cfg, tensor_parallel_size: int = 1, interpret: bool = False, context_parallel_size: int = 1
) -> dict[str, str | None]:
    """`self_check` at a `ptd_jax.config.ModelConfig`'s widths: hidden size, head dim, the sequence length the
    kernel attends over (a context ring's sub-block of S/(2c) tokens), at most `MAX_CHECK_SEQ`, sliding window, and
    this tensor-parallel size's vocabulary shard."""
    shard = cfg.padded_vocab_size(tensor_parallel_size) // tensor_parallel_size
    seq = cfg.seq_length if context_parallel_size == 1 else cfg.seq_length // (2 * context_parallel_size)
    return self_check(
        hidden=cfg.hidden_size,
        head_dim=cfg.head_dim,
        seq=min(seq, MAX_CHECK_SEQ),
        vocab_shard=shard,
        vocab_real=min(cfg.vocab_size, shard),
        dtype=jnp.dtype(cfg.dtype),
        window_size=cfg.window_size,
        interpret=interpret,
    )
