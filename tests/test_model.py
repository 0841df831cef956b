import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=257)

# jitted entry points (eager op-by-op execution of scans is slow); configs are hashable, hence static
init = jax.jit(gpt.init_params, static_argnums=1)
forward = jax.jit(gpt.forward, static_argnums=2, static_argnames="recompute")
loss_sum = jax.jit(gpt.loss_sum, static_argnums=4, static_argnames="recompute")
grad_loss = jax.jit(jax.grad(gpt.loss_sum), static_argnums=4, static_argnames="recompute")


@pytest.fixture(scope="module")
def params():
    return init(jax.random.key(0), CFG)


def tokens(shape, seed=1, vocab=257):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


def test_param_shapes(params):
    L, D, H, K, F, Vp, S = 2, 32, 4, 8, 128, 384, 16
    shapes = jax.tree.map(lambda x: x.shape, params)
    assert shapes["embed"] == {"word": (Vp, D), "position": (S, D)}
    assert shapes["layers"]["attn"] == {
        "qkv_kernel": (L, D, H, 3, K),  # G = H query groups of one head: [D, G, R + 2, K]
        "qkv_bias": (L, H, 3, K),
        "out_kernel": (L, H, K, D),
        "out_bias": (L, D),
    }
    assert shapes["layers"]["mlp"] == {
        "fc1_kernel": (L, D, F),
        "fc1_bias": (L, F),
        "fc2_kernel": (L, F, D),
        "fc2_bias": (L, D),
    }
    assert shapes["layers"]["ln1"] == shapes["layers"]["ln2"] == {"scale": (L, D), "bias": (L, D)}
    assert shapes["final_ln"] == {"scale": (D,), "bias": (D,)}
    assert "output" not in params  # the output layer is tied to embed/word


def test_param_count_is_eq2_plus_final_layernorm(params):
    l, h, V, s = 2, 32, 384, 16
    by_hand = l * (12 * h * h + 13 * h) + V * h + s * h + 2 * h
    assert gpt.count_params(params) == by_hand


def test_logits_shape_and_dtype(params):
    logits = forward(params, tokens((3, 16)), CFG)
    assert logits.shape == (3, 16, 384) and logits.dtype == jnp.float32


def test_causal_mask_later_token_never_changes_earlier_logits(params):
    x = tokens((2, 16))
    base = forward(params, x, CFG)
    for j in (0, 5, 15):
        changed = forward(params, x.at[:, j].set((x[:, j] + 7) % 257), CFG)
        np.testing.assert_array_equal(np.asarray(changed[:, :j]), np.asarray(base[:, :j]))
        assert not np.allclose(np.asarray(changed[:, j:]), np.asarray(base[:, j:]))


def test_init_statistics():
    cfg = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=16)
    p = init(jax.random.key(3), cfg)
    std = lambda x: float(jnp.std(x))  # noqa: E731
    assert std(p["layers"]["attn"]["qkv_kernel"]) == pytest.approx(0.02, rel=0.02)
    assert std(p["layers"]["mlp"]["fc1_kernel"]) == pytest.approx(0.02, rel=0.02)
    assert std(p["embed"]["word"][:257]) == pytest.approx(0.02, rel=0.02)
    assert not np.any(np.asarray(p["embed"]["word"][257:]))  # padded rows: zero, never looked up
    out_std = 0.02 / math.sqrt(2 * 8)
    assert std(p["layers"]["attn"]["out_kernel"]) == pytest.approx(out_std, rel=0.02)
    assert std(p["layers"]["mlp"]["fc2_kernel"]) == pytest.approx(out_std, rel=0.02)
    assert not np.any(np.asarray(p["layers"]["mlp"]["fc1_bias"]))
    np.testing.assert_array_equal(np.asarray(p["layers"]["ln1"]["scale"]), 1.0)


def test_real_vocabulary_rows_do_not_depend_on_padding():
    """t only changes the padding (384 rows at t=1, 1024 at t=8); the 257 real rows are the same."""
    p1 = gpt.init_params(jax.random.key(5), CFG, tensor_parallel_size=1)
    p8 = gpt.init_params(jax.random.key(5), CFG, tensor_parallel_size=8)
    assert p1["embed"]["word"].shape == (384, 32) and p8["embed"]["word"].shape == (1024, 32)
    np.testing.assert_array_equal(np.asarray(p1["embed"]["word"][:257]), np.asarray(p8["embed"]["word"][:257]))


def test_layer_init_does_not_depend_on_depth():
    """Layer i draws from its own stream: a 2-layer model's layers equal the first two of a 4-layer model's
    (up to the output-projection scale, which depends on depth by design)."""
    p2 = init(jax.random.key(5), CFG)
    p4 = init(jax.random.key(5), CFG.replace(num_layers=4))
    np.testing.assert_array_equal(
        np.asarray(p2["layers"]["attn"]["qkv_kernel"]), np.asarray(p4["layers"]["attn"]["qkv_kernel"][:2])
    )


def test_padded_vocabulary_never_counts(params):
    x = tokens((2, 16))
    mask = jnp.ones_like(x)
    loss = loss_sum(params, x, x, mask, CFG)
    word = params["embed"]["word"].at[257:].set(5.0)  # huge logits on padded ids
    loss_padded = loss_sum({**params, "embed": {**params["embed"], "word": word}}, x, x, mask, CFG)
    np.testing.assert_allclose(float(loss), float(loss_padded), rtol=1e-6)


def test_loss_matches_naive_cross_entropy(params):
    x, y = tokens((2, 16)), tokens((2, 16), seed=2)
    logits = np.asarray(forward(params, x, CFG), np.float64)[..., :257]
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    expected = -np.take_along_axis(logp, np.asarray(y)[..., None], -1).sum()
    got = loss_sum(params, x, y, jnp.ones_like(x), CFG)
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recomputation_gives_same_gradients(params, granularity):
    x = tokens((2, 16))
    mask = jnp.ones_like(x)
    g_ref = grad_loss(params, x, x, mask, CFG)
    g = grad_loss(params, x, x, mask, CFG, recompute=granularity)
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)


def _layer_residuals(layer_fn, p, x, key):
    """Shapes of the arrays a layer's vjp keeps, less its parameters (what the pipeline stash stores)."""
    _, vjp = jax.vjp(lambda p, x: layer_fn(p, x, key), p, x)
    weights = {id(w) for w in jax.tree.leaves(p)}
    return sorted(tuple(r.shape) for r in jax.tree.leaves(vjp) if id(r) not in weights and r.ndim > 0)


@pytest.mark.slow  # 24 s of eager float64; each policy's gradients above, its matmuls and stash in tests/parallel/
def test_layer_keeps_matmul_outputs_and_recomputes_the_elementwise_work():
    """remat_layer's policies: none keeps the layer input, its matmuls' outputs (the context by name) and its
    dropout masks, nothing of the LayerNorms, softmax or GeLU (autodiff alone keeps 38 arrays, six [B, S, F] for the
    GeLU); selective drops the attention core's scores and masks too; full keeps the input; and each gives the
    gradients of plain autodiff (float64)."""
    with jax.enable_x64(True):
        cfg = CFG.replace(dtype="float64", hidden_dropout=0.1, attention_dropout=0.1)
        p = jax.tree.map(lambda a: a[0], gpt.init_params(jax.random.key(0), cfg)["layers"])
        x = jax.random.normal(jax.random.key(1), (2, 16, 32), jnp.float64)
        key = jax.random.key(2)

        def plain(p, x, k):
            return gpt.transformer_layer(p, x, cfg, k)

        B, S, D, H, K, F = 2, 16, 32, 4, 8, 128
        kept = {
            r: _layer_residuals(
                gpt.remat_layer(lambda p, x, k, r=r: gpt.transformer_layer(p, x, cfg, k, r), r), p, x, key
            )
            for r in ("none", "selective", "full")
        }
        # qkv, scores (as the dot_general emits them: [B, G, S, S, R]), context, out, fc1 (G = H query groups of
        # R = 1 head: qkv [B, S, G, R + 2, K])
        matmuls = [(B, S, H, 3, K), (B, H, S, S, 1), (B, S, H, 1, K), (B, S, D), (B, S, F)]
        assert kept["none"] == sorted([(B, S, D), *matmuls, (B, H, 1, S, S), (B, S, D), (B, S, D)])  # + 3 masks
        assert kept["selective"] == sorted([(B, S, D), (B, S, H, 3, K), (B, S, H, 1, K), (B, S, D), (B, S, F), (3,)])
        assert kept["full"] == [(B, S, D)]  # the input (the key is an argument)
        assert len(_layer_residuals(plain, p, x, key)) > 30
        want = jax.grad(lambda p, x: jnp.sum(plain(p, x, key) ** 2), (0, 1))(p, x)
        for r in ("none", "selective", "full"):
            layer = gpt.remat_layer(lambda p, x, k, r=r: gpt.transformer_layer(p, x, cfg, k, r), r)
            got = jax.grad(lambda p, x, layer=layer: jnp.sum(layer(p, x, key) ** 2), (0, 1))(p, x)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-13, err_msg=r)


def test_bf16_compute_is_close_to_float32(params):
    x = tokens((2, 16))
    mask = jnp.ones_like(x)
    l32 = float(loss_sum(params, x, x, mask, CFG))
    l16 = float(loss_sum(params, x, x, mask, CFG.replace(dtype="bfloat16")))
    assert l16 == pytest.approx(l32, rel=2e-2) and l16 != l32


def test_exact_gelu_option(params):
    x = tokens((1, 16))
    a = forward(params, x, CFG)
    b = forward(params, x, CFG.replace(gelu_approximate=False))
    assert 0 < float(jnp.max(jnp.abs(a - b))) < 1e-2


def test_dropout_only_with_a_key(params):
    cfg = CFG.replace(hidden_dropout=0.1, attention_dropout=0.1)
    x = tokens((2, 16))
    np.testing.assert_array_equal(np.asarray(forward(params, x, cfg)), np.asarray(forward(params, x, CFG)))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    d1 = forward(params, x, cfg, key=k1)
    assert not np.allclose(np.asarray(d1), np.asarray(forward(params, x, CFG)))
    np.testing.assert_array_equal(np.asarray(d1), np.asarray(forward(params, x, cfg, key=k1)))
    assert not np.allclose(np.asarray(d1), np.asarray(forward(params, x, cfg, key=k2)))
