"""The GPU path without a GPU: each kernel, forward and backward, lowers through Pallas' Triton backend for
CUDA at production shapes (`jax.export` for platform "cuda", compiled no further). This catches what interpret
mode cannot: Triton's power-of-two tiles, primitives without a Triton rule, and jax picking Mosaic GPU (which
rejects these kernels) when no compiler parameters name Triton. PTX compilation and speed need a real GPU."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import flash_attention, layer_norm, softmax_cross_entropy

TRITON = "__gpu$xla.gpu.triton"


def triton_calls(fn, *args) -> int:
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    return exported.mlir_module().count(f"@{TRITON}(")


def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def grads(fn, argnums):
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=argnums)


@pytest.mark.parametrize("shape", [(1, 2048, 16, 128), (2, 1000, 4, 96)], ids=["1.3b", "ragged-seq-head-dim-96"])
def test_flash_attention_lowers_to_triton(shape):
    q = spec(shape)
    assert triton_calls(lambda q, k, v: flash_attention(q, k, v), q, q, q) == 1
    assert triton_calls(grads(flash_attention, (0, 1, 2)), q, q, q) == 3  # forward, dK/dV, dQ


@pytest.mark.parametrize("hidden", [2048, 768, 2304], ids=["1.3b", "gpt2-small", "paper-1.7b"])
def test_layer_norm_lowers_to_triton(hidden):
    x, w = spec((4096, hidden)), spec((hidden,), jnp.float32)
    assert triton_calls(lambda x, w, b: layer_norm(x, w, b), x, w, w) == 1
    assert triton_calls(grads(layer_norm, (0, 1, 2)), x, w, w) == 2


@pytest.mark.parametrize("vocab", [50304, 51200 // 8], ids=["t1", "t8-shard"])
def test_cross_entropy_lowers_to_triton(vocab):
    logits, labels = spec((1000, vocab)), spec((1000,), jnp.int32)
    loss = lambda z, y: softmax_cross_entropy(z, y, vocab_size=vocab - 47)  # noqa: E731
    assert triton_calls(loss, logits, labels) == 1
    assert triton_calls(grads(loss, 0), logits, labels) == 2  # statistics, then d logits


def test_a_model_gradient_with_every_kernel_lowers_to_triton(monkeypatch):
    from ptd_jax import model as gpt
    from ptd_jax.config import model_preset

    monkeypatch.setattr(gpt, "interpret_kernels", lambda: False)  # as on a GPU host
    cfg = model_preset("tiny").replace(dtype="bfloat16", attention_backend="pallas", fused_kernels=True)
    params = jax.eval_shape(lambda k: gpt.init_params(k, cfg), jax.random.key(0))
    tokens = spec((2, cfg.seq_length), jnp.int32)
    loss = jax.grad(lambda p, t: gpt.loss_sum(p, t, t, jnp.ones_like(t), cfg))
    # per layer: 2 LayerNorms (fwd + bwd) and attention (fwd, dK/dV, dQ); final LayerNorm; loss (stats, grad).
    # Calls inside the layer scan's body count once.
    assert triton_calls(loss, params, tokens) == (2 * 2 + 3) + 2 + 2
