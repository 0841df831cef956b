"""Every Pallas kernel, forward and backward, compiles with XLA:GPU (Triton) for sm_80 and sm_90 at the shapes of
the presets and the paper's Table 1 models, with its default block sizes; and a block too large for the target's
shared memory is refused at compile time, so these compiles do check the target's limits. No GPU is used: the
devices are a described topology (`ptd_jax/aot`), which needs the `gpu-compile` extra (in `[test]`)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import pallas_kernels as pk
from ptd_jax.aot.compile import virtual_devices
from ptd_jax.perf.hardware import TARGETS

TARGET_NAMES = ["a100-80gb", "h100-sxm"]  # sm_80, sm_90 (the h200 is an sm_90 die too)
HEAD_DIMS = [64, 80, 96, 128]  # Table 1: h / heads is 96 (1.7B) ... 160 -> padded to 128 tiles below
LAYER_NORM_WIDTHS = [2048, 12288, 25600]  # 1.3B, 145B, 1T
VOCAB_SHARDS = [51200 // t for t in (1, 2, 4, 8)]


def one_gpu(name):
    mesh = jax.sharding.Mesh(virtual_devices(TARGETS[name], 1), ("x",))
    return NamedSharding(mesh, PartitionSpec())


def compiles(fn, *shapes):
    jax.jit(fn).lower(*shapes).compile()


def flash_loss(block_sizes=None):
    blocks = block_sizes or pk.BlockSizes()
    return lambda q, k, v: pk.flash_attention(q, k, v, block_sizes=blocks).astype(jnp.float32).sum()


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_flash_attention_compiles(target, head_dim):
    gpu = one_gpu(target)
    q = jax.ShapeDtypeStruct((1, 2048, 4, head_dim), jnp.bfloat16, sharding=gpu)
    compiles(jax.value_and_grad(flash_loss(), (0, 1, 2)), q, q, q)
    kv = jax.ShapeDtypeStruct((1, 2048, 2, head_dim), jnp.bfloat16, sharding=gpu)  # grouped: 2 key/value heads
    compiles(jax.value_and_grad(flash_loss(), (0, 1, 2)), q, kv, kv)


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("width", LAYER_NORM_WIDTHS)
def test_layer_norm_compiles(target, width):
    gpu = one_gpu(target)
    x = jax.ShapeDtypeStruct((256, width), jnp.bfloat16, sharding=gpu)
    w = jax.ShapeDtypeStruct((width,), jnp.float32, sharding=gpu)
    compiles(jax.value_and_grad(lambda x, w, b: pk.layer_norm(x, w, b).astype(jnp.float32).sum(), (0, 1, 2)), x, w, w)
    compiles(jax.value_and_grad(lambda x, w: pk.rms_norm(x, w).astype(jnp.float32).sum(), (0, 1)), x, w)


@pytest.mark.parametrize("target", TARGET_NAMES)
@pytest.mark.parametrize("vocab", VOCAB_SHARDS)
def test_cross_entropy_compiles(target, vocab):
    gpu = one_gpu(target)
    logits = jax.ShapeDtypeStruct((2048, vocab), jnp.bfloat16, sharding=gpu)
    labels = jax.ShapeDtypeStruct((2048,), jnp.int32, sharding=gpu)
    compiles(jax.value_and_grad(lambda x, y: pk.softmax_cross_entropy(x, y).sum()), logits, labels)


@pytest.mark.parametrize("target, requested", [("a100-80gb", 196608), ("h100-sxm", 327680)])
def test_an_oversized_block_is_refused_at_compile_time(target, requested):
    """256 x 256 tiles at head dim 128 ask for more shared memory than one block may have on either GPU; the
    error names the target's own limit (`shared_memory_per_block_optin`)."""
    q = jax.ShapeDtypeStruct((1, 2048, 4, 128), jnp.bfloat16, sharding=one_gpu(target))
    limit = TARGETS[target].chip.shared_memory_per_block_optin
    with pytest.raises(
        Exception, match=f"Shared memory size limit exceeded: requested {requested}, available: {limit}"
    ):
        compiles(jax.value_and_grad(flash_loss(pk.BlockSizes(256, 256)), (0, 1, 2)), q, q, q)


def test_the_planner_and_the_compiler_describe_the_same_gpus():
    """One catalogue: every planner preset is a compile target, with the chip of its generation."""
    from ptd_jax.perf.hardware import HARDWARE

    assert set(HARDWARE) == set(TARGETS)
    assert {n: t.chip.compute_capability for n, t in TARGETS.items()} == {
        "a100-80gb": (8, 0),
        "h100-sxm": (9, 0),
        "h200": (9, 0),
    }
