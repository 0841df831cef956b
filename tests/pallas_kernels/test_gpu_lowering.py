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
    exported = jax.export.export(
        jax.jit(fn), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
    )(*args)
    return exported.mlir_module().count(f"@{TRITON}(")


def spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def grads(fn, argnums):
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=argnums)


@pytest.mark.parametrize(
    "shape, causal",
    [((1, 2048, 16, 128), True), ((2, 1000, 4, 96), True), ((1, 8, 2, 8), True), ((1, 48, 2, 64), False)],
    ids=["1.3b", "ragged-seq-head-dim-96", "tiny", "non-causal-ragged"],
)
def test_flash_attention_lowers_to_triton(shape, causal):
    q = spec(shape)
    attend = lambda q, k, v: flash_attention(q, k, v, causal=causal)  # noqa: E731
    assert triton_calls(attend, q, q, q) == 1
    assert triton_calls(grads(attend, (0, 1, 2)), q, q, q) == 3  # forward, dK/dV, dQ


@pytest.mark.parametrize("hidden", [2048, 768, 2304], ids=["1.3b", "gpt2-small", "paper-1.7b"])
def test_layer_norm_lowers_to_triton(hidden):
    x, w = spec((4096, hidden)), spec((hidden,), jnp.float32)
    assert triton_calls(lambda x, w, b: layer_norm(x, w, b), x, w, w) == 1
    assert triton_calls(grads(layer_norm, (0, 1, 2)), x, w, w) == 2


@pytest.mark.parametrize("vocab", [50304, 51200 // 8, 1000], ids=["t1", "t8-shard", "unpadded-1000"])
def test_cross_entropy_lowers_to_triton(vocab):
    logits, labels = spec((1000, vocab)), spec((1000,), jnp.int32)
    loss = lambda z, y: softmax_cross_entropy(z, y, vocab_size=vocab - 47)  # noqa: E731
    assert triton_calls(loss, logits, labels) == 1
    assert triton_calls(grads(loss, 0), logits, labels) == 2  # statistics, then d logits


def test_a_model_gradient_with_every_kernel_lowers_to_triton(monkeypatch):
    from ptd_jax import model as gpt
    from ptd_jax.presets import model_preset

    monkeypatch.setattr(gpt, "interpret_kernels", lambda: False)  # as on a GPU host
    cfg = model_preset("tiny").replace(dtype="bfloat16", attention_backend="pallas", fused_kernels=True)
    params = jax.eval_shape(lambda k: gpt.init_params(k, cfg), jax.random.key(0))
    tokens = spec((2, cfg.seq_length), jnp.int32)
    loss = jax.grad(lambda p, t: gpt.loss_sum(p, t, t, jnp.ones_like(t), cfg))
    # per layer: 2 LayerNorms (fwd + bwd) and attention (fwd, dK/dV, dQ); final LayerNorm; loss (stats, grad).
    # Calls inside the layer scan's body count once.
    assert triton_calls(loss, params, tokens) == (2 * 2 + 3) + 2 + 2


def test_the_3d_parallel_step_with_every_kernel_lowers_to_triton(monkeypatch):
    """(d, p, t) = (2, 2, 2), interleaved, sequence parallel, bf16, inside shard_map: every kernel appears."""
    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig, ParallelConfig
    from ptd_jax.parallel import sharding
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import make_parallel_grad_step

    monkeypatch.setattr(gpt, "interpret_kernels", lambda: False)  # as on a GPU host
    cfg = ModelConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=64,
        dtype="bfloat16",
        attention_backend="pallas",
        fused_kernels=True,
    )
    parallel = ParallelConfig(
        data_parallel_size=2,
        pipeline_model_parallel_size=2,
        tensor_model_parallel_size=2,
        virtual_pipeline_stages=2,
        pipeline_schedule="interleaved",
        sequence_parallel=True,
        micro_batch_size=2,
        global_batch_size=8,
        pipeline_branching="uniform",
    )  # what "auto" runs on a GPU (the mesh here is CPU's)
    params = jax.eval_shape(lambda k: gpt.init_params(k, cfg, tensor_parallel_size=2), jax.random.key(0))
    mesh = make_mesh(parallel)
    params, specs = sharding.place_params(params, parallel, mesh)
    step = make_parallel_grad_step(mesh, cfg, parallel, specs)
    tokens = spec((parallel.num_microbatches, 4, cfg.seq_length), jnp.int32)
    exported = jax.export.export(
        step, platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
    )(params, tokens, tokens, tokens)
    text = exported.mlir_module()
    assert exported.nr_devices == 8 and f"@{TRITON}(" in text
    for kernel in (
        "flash_attention_fwd",
        "flash_attention_dkdv",
        "flash_attention_dq",
        "layer_norm_fwd",
        "layer_norm_bwd",
        "cross_entropy_stats",
        "cross_entropy_grad",
    ):
        assert kernel in text, kernel
