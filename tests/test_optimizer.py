"""AdamW, Megatron's learning-rate schedule, the no-decay group and clipping (`ptd_jax/optimizer.py`)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig, TrainConfig
from ptd_jax.optimizer import clip_by_global_norm, learning_rate_schedule, weight_decay_mask

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)


def test_learning_rate_schedule_by_hand():
    cfg = TrainConfig(train_iters=100, lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style="cosine")
    lr = learning_rate_schedule(cfg)
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(55)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-6)
    assert float(lr(100)) == pytest.approx(0.1) and float(lr(150)) == pytest.approx(0.1)
    linear = learning_rate_schedule(cfg.replace(lr_decay_style="linear"))
    assert float(linear(55)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-6)
    constant = learning_rate_schedule(cfg.replace(lr_decay_style="constant"))
    assert float(constant(80)) == pytest.approx(1.0)


def test_no_weight_decay_on_biases_and_layernorm():
    mask = weight_decay_mask(gpt.init_params(jax.random.key(0), TINY))
    assert mask["layers"]["attn"]["qkv_kernel"] and mask["embed"]["word"] and mask["layers"]["mlp"]["fc2_kernel"]
    assert not mask["layers"]["attn"]["qkv_bias"] and not mask["layers"]["ln1"]["scale"]
    assert not mask["final_ln"]["bias"]


def test_clip_by_global_norm():
    grads = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}
    clipped, norm = clip_by_global_norm(grads, 1.0)
    assert float(norm) == pytest.approx(5.0)
    assert float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(clipped)))) == pytest.approx(1.0, rel=1e-5)
    same, _ = clip_by_global_norm(grads, 10.0)
    np.testing.assert_array_equal(np.asarray(same["a"]), [3.0, 0.0])
