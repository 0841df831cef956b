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

TOLERANCE = 2e-2  # bf16 inputs, float32 accumulation


def _max_rel_error(got, want) -> float:
    errs = []
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        errs.append(float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30)))
    return max(errs)


def _cases():
    k = jax.random.split(jax.random.key(0), 6)
    qkv = [jax.random.normal(kk, (1, 128, 2, 64), jnp.float32).astype(jnp.bfloat16) for kk in k[:3]]
    x = jax.random.normal(k[3], (64, 256), jnp.float32).astype(jnp.bfloat16)
    w, b = jnp.linspace(0.5, 1.5, 256), jnp.linspace(-0.1, 0.1, 256)
    logits = jax.random.normal(k[4], (64, 512), jnp.float32).astype(jnp.bfloat16)
    labels = jax.random.randint(k[5], (64,), 0, 500)
    return {
        "flash_attention": (lambda interpret: lambda *a: flash_attention(*a, interpret=interpret),
                            flash_attention_reference, qkv),
        "layer_norm": (lambda interpret: lambda x: layer_norm(x, w, b, interpret=interpret),
                       lambda x: layer_norm_reference(x, w, b), [x]),
        "cross_entropy": (lambda interpret: lambda z: softmax_cross_entropy(z, labels, vocab_size=500,
                                                                           interpret=interpret),
                          lambda z: cross_entropy_reference(z, labels, vocab_size=500), [logits]),
    }


def self_check(interpret: bool = False) -> dict[str, str | None]:
    """{kernel: None if its forward and gradients match the reference, else why not (one line)}."""
    results = {}
    for name, (make, reference, args) in _cases().items():
        fn = make(interpret)
        probe = jax.random.normal(jax.random.key(1), jax.eval_shape(reference, *args).shape, jnp.float32)

        def loss(f):
            return lambda *a: jnp.sum(f(*a).astype(jnp.float32) * probe)

        argnums = tuple(range(len(args)))
        try:
            got = jax.jit(jax.value_and_grad(loss(fn), argnums=argnums))(*args)
            want = jax.jit(jax.value_and_grad(loss(reference), argnums=argnums))(*args)
            err = _max_rel_error(got, want)
            results[name] = None if err <= TOLERANCE else f"relative error {err:.2e} > {TOLERANCE}"
        except Exception as exc:  # any failure to lower, compile or run is the answer to "does it work here"
            results[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return results
