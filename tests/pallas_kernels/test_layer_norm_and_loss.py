"""Fused LayerNorm, RMSNorm and cross-entropy kernels (interpret mode) against their references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cross_entropy import BlockSizes as CEBlocks
from pallas_kernels.cross_entropy import cross_entropy_reference, softmax_cross_entropy
from pallas_kernels.layer_norm import BlockSizes as LNBlocks
from pallas_kernels.layer_norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from tests.helpers.exactness import rel


@pytest.mark.parametrize(
    "shape, blocks, dtype, tol",
    [
        pytest.param(
            shape,
            blocks,
            dtype,
            tol,
            id=f"{name}-{dname}",
            # bfloat16 runs the blocking and padding paths float32 runs, at a looser tolerance: the default run keeps
            # float32 on the ragged shape only (-m slow: both dtypes at every shape)
            marks=[pytest.mark.slow] * (dname == "f32" and name != "ragged-rows-width-not-power-of-2"),
        )
        for shape, blocks, name in [
            ((4, 16, 32), LNBlocks(16), "blocks"),
            ((3, 10, 64), LNBlocks(128), "one-padded-block"),
            ((3, 10, 48), LNBlocks(16), "ragged-rows-width-not-power-of-2"),
        ]
        for dtype, tol, dname in [(jnp.float32, 1e-5, "f32"), (jnp.bfloat16, 1e-2, "bf16")]
    ],
)
def test_layer_norm_forward_and_gradients(shape, blocks, dtype, tol):
    k = jax.random.split(jax.random.key(0), 4)
    x = (jax.random.normal(k[0], shape) * 3 + 1).astype(dtype)
    w, b = jax.random.normal(k[1], shape[-1:]), jax.random.normal(k[2], shape[-1:])
    dy = jax.random.normal(k[3], shape)
    assert rel(layer_norm(x, w, b, block_sizes=blocks, interpret=True), layer_norm_reference(x, w, b)) <= tol

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * dy)

    got = jax.grad(loss(lambda *a: layer_norm(*a, block_sizes=blocks, interpret=True)), (0, 1, 2))(x, w, b)
    want = jax.grad(loss(layer_norm_reference), (0, 1, 2))(x, w, b)
    for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
        assert rel(g, r) <= 2 * tol, name


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "shape, blocks", [((4, 16, 32), LNBlocks(16)), ((3, 10, 48), LNBlocks(16))], ids=["blocks", "ragged-width-48"]
)
def test_rms_norm_forward_and_gradients(shape, blocks, dtype, tol):
    """RMSNorm (Llama's): the LayerNorm kernels without centring or shift, against the reference, value and
    gradients; and it is not LayerNorm (the input has a mean the two treat differently)."""
    k = jax.random.split(jax.random.key(0), 3)
    x = (jax.random.normal(k[0], shape) * 3 + 1).astype(dtype)
    w, dy = jax.random.normal(k[1], shape[-1:]), jax.random.normal(k[2], shape)
    got = rms_norm(x, w, block_sizes=blocks, interpret=True)
    assert rel(got, rms_norm_reference(x, w)) <= tol
    assert rel(got, layer_norm_reference(x, w, jnp.zeros_like(w))) > 0.1

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * dy)

    got = jax.grad(loss(lambda *a: rms_norm(*a, block_sizes=blocks, interpret=True)), (0, 1))(x, w)
    want = jax.grad(loss(rms_norm_reference), (0, 1))(x, w)
    for name, g, r in zip(("dx", "dweight"), got, want):
        assert rel(g, r) <= 2 * tol, name


def test_layer_norm_blocks_are_powers_of_two():
    assert LNBlocks(128, max_elements=6000).for_shape(rows=4096, width=1024) == 4
    assert LNBlocks(128).for_shape(rows=30, width=64) == 32
    assert LNBlocks(128).for_shape(rows=4096, width=32768) == 1


def test_layer_norm_errors_name_shapes():
    x = jnp.ones((6, 8))
    with pytest.raises(ValueError, match=r"block_rows=0 must be a positive power of two"):
        layer_norm(x, jnp.ones(8), jnp.zeros(8), block_sizes=LNBlocks(0), interpret=True)
    with pytest.raises(ValueError, match=r"weight.shape=\(7,\)"):
        layer_norm(x, jnp.ones(7), jnp.zeros(8), interpret=True)


@pytest.mark.parametrize(
    "N, V, blocks",
    [
        # whole blocks: -m slow (the two cases below run them beside their padded and masked ones)
        pytest.param(32, 384, CEBlocks(16, 128), marks=pytest.mark.slow),
        (40, 384, CEBlocks(16, 256)),
        (24, 300, CEBlocks(16, 64)),
    ],
    ids=["blocks", "ragged-rows-and-vocab", "vocab-not-a-multiple-of-16"],
)
def test_cross_entropy_forward_and_gradient_with_padded_vocabulary(N, V, blocks):
    """V=384 with block_vocab 256 runs whole 128-column steps; N=40 rows leave a padded last row block; V=300
    has no power-of-two divisor >= 8, so its last 64-column step is masked (44 real columns)."""
    real = 257
    x = jax.random.normal(jax.random.key(0), (N, V)) * 3
    x = x.at[:, real:].set(50.0)  # padded columns must never count
    y = jax.random.randint(jax.random.key(1), (N,), 0, real)
    g = jax.random.normal(jax.random.key(2), (N,))
    got = softmax_cross_entropy(x, y, vocab_size=real, block_sizes=blocks, interpret=True)
    want = cross_entropy_reference(x, y, vocab_size=real)
    assert rel(got, want) <= 1e-5
    dgot = jax.grad(
        lambda x: jnp.sum(softmax_cross_entropy(x, y, vocab_size=real, block_sizes=blocks, interpret=True) * g)
    )(x)
    dwant = jax.grad(lambda x: jnp.sum(cross_entropy_reference(x, y, vocab_size=real) * g))(x)
    assert rel(dgot, dwant) <= 1e-5
    assert not np.any(np.asarray(dgot[:, real:]))


def test_cross_entropy_shard_statistics_compose_like_the_vocab_parallel_loss():
    """Per-shard kernels (vocab_start, no axis) give max / sum-exp / target that combine to the full loss."""
    from pallas_kernels.cross_entropy import shard_statistics

    N, V, real, t = 16, 512, 300, 4
    x = jax.random.normal(jax.random.key(0), (N, V)) * 2
    y = jax.random.randint(jax.random.key(1), (N,), 0, real)
    shard = V // t
    stats = []
    for r in range(t):
        valid = jnp.clip(jnp.asarray(real - r * shard, jnp.int32), 0, shard).reshape(1)
        stats.append(
            shard_statistics(
                x[:, r * shard : (r + 1) * shard], (y - r * shard).astype(jnp.int32), valid, CEBlocks(16, 64), True
            )
        )
    m = jnp.max(jnp.stack([s[0] for s in stats]), axis=0)
    total = sum(jnp.where(jnp.isfinite(s[0]), s[1] * jnp.exp(s[0] - m), 0.0) for s in stats)
    target = sum(s[2] for s in stats)
    assert rel(m + jnp.log(total) - target, cross_entropy_reference(x, y, vocab_size=real)) <= 1e-5


def test_cross_entropy_shape_errors():
    with pytest.raises(ValueError, match=r"logits must be \[N, V\] and labels \[N\]"):
        softmax_cross_entropy(jnp.ones((4, 8)), jnp.zeros((3,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"block_vocab=384 must be a positive power of two"):
        softmax_cross_entropy(
            jnp.ones((4, 768)), jnp.zeros((4,), jnp.int32), block_sizes=CEBlocks(4, 384), interpret=True
        )


def test_kernels_inside_shard_map_match_the_references():
    """Under shard_map (data x tensor, vma checking on) with differently-typed operands: LayerNorm on
    data-sharded rows with replicated weights, cross-entropy on a vocabulary shard combined over "tensor".
    Loss and every gradient equal the single-device references."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 2), ("data", "tensor"), devices=jax.devices()[:4])
    N, D, V, real = 32, 64, 256, 200
    k = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(k[0], (N, D)) * 2 + 1
    w, b = jax.random.normal(k[1], (D,)), jax.random.normal(k[2], (D,))
    head = jax.random.normal(k[3], (D, V)) * 0.3
    y = jax.random.randint(k[4], (N,), 0, real)

    def loss(ln, ce, x, w, b, head):
        return jnp.sum(ce(ln(x, w, b) @ head, y))

    def reference(x, w, b, head):
        return loss(layer_norm_reference, lambda z, y: cross_entropy_reference(z, y, vocab_size=real), x, w, b, head)

    def body(x, w, b, head, y):
        start = jax.lax.axis_index("tensor") * head.shape[1]
        ce = lambda z, _: softmax_cross_entropy(
            z, y, vocab_size=real, vocab_start=start, axis_name="tensor", block_sizes=CEBlocks(8, 64), interpret=True
        )
        ln = lambda *a: layer_norm(*a, block_sizes=LNBlocks(8), interpret=True)
        value, grads = jax.value_and_grad(lambda *a: loss(ln, ce, *a), argnums=(0, 1, 2, 3))(x, w, b, head)
        return (jax.lax.psum(value, "data"), *grads)  # replicated inputs' gradients arrive summed over data

    specs = (P("data"), P(), P(), P(None, "tensor"), P("data"))
    put = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, b, head, y), specs)]
    got = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P("data"), P(), P(), P(None, "tensor")))
    )(*put)
    want_value, want_grads = jax.value_and_grad(reference, argnums=(0, 1, 2, 3))(x, w, b, head)
    assert rel(got[0], want_value) <= 1e-5
    for name, g, r in zip(("dx", "dw", "db", "dhead"), got[1:], want_grads):
        assert rel(g, r) <= 1e-5, name


@pytest.mark.slow  # 16 s; each kernel alone above, and inside shard_map
def test_a_llama_model_with_fused_kernels_equals_xla():
    """`fused_kernels` and Pallas attention on a Llama config: the RMSNorm kernel, the fused loss and grouped flash
    attention give XLA's loss and gradients."""
    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig

    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        seq_length=16,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        add_bias_linear=False,
    )
    params = gpt.init_params(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 257)
    mask = jnp.ones_like(tokens)

    def loss(c):
        return jax.value_and_grad(lambda p: gpt.loss_sum(p, tokens, tokens, mask, c))(params)

    (want, gw), (got, gg) = loss(cfg), loss(cfg.replace(fused_kernels=True, attention_backend="pallas"))
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for a, b in zip(jax.tree.leaves(gg), jax.tree.leaves(gw)):
        assert rel(a, b) <= 1e-4
