"""The single-device reference step (`ptd_jax/train/reference.py`): microbatch accumulation and the AdamW step."""

import jax
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.data import GPTData, microbatches
from ptd_jax.optimizer import make_optimizer
from ptd_jax.train.reference import accumulate_gradients, init_state, make_train_step

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)


def _x64_setup():
    cfg = TINY.replace(dtype="float64", param_dtype="float64")
    params = gpt.init_params(jax.random.key(0), cfg)
    return cfg, params


@pytest.mark.parametrize("m, b", [(4, 2), (8, 1), pytest.param(2, 4, marks=pytest.mark.slow)])  # (2, 4): (4, 2) again
def test_gradient_accumulation_equals_full_batch_gradient(small_corpus, m, b):
    """The reference step's loss and grads do not depend on how the global batch is cut into microbatches."""
    with jax.enable_x64(True):
        cfg, params = _x64_setup()
        batch = GPTData(small_corpus, seq_length=32, global_batch_size=8, eval_iters=0, seed=0).train_batch(1)
        full = jax.jit(
            jax.value_and_grad(
                lambda p: gpt.loss_sum(p, batch.tokens, batch.labels, batch.loss_mask, cfg) / batch.loss_mask.sum()
            )
        )
        loss_ref, grads_ref = full(params)
        parallel = ParallelConfig(micro_batch_size=b, global_batch_size=8)
        assert parallel.num_microbatches == m
        loss, grads = jax.jit(accumulate_gradients, static_argnums=4)(params, *microbatches(batch, parallel), cfg)
        assert float(loss) == pytest.approx(float(loss_ref), rel=1e-12)
        for a, g in zip(jax.tree.leaves(grads_ref), jax.tree.leaves(grads)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(a), rtol=1e-10, atol=1e-14)


def test_train_step_applies_adamw(small_corpus):
    """One step by hand: first Adam step moves each weight by lr·(sign of grad) (+ decoupled decay)."""
    tcfg = TrainConfig(
        train_iters=2, lr=1e-2, lr_warmup_iters=0, lr_decay_style="constant", clip_grad=0.0, weight_decay=0.0
    )
    opt = make_optimizer(tcfg)
    state = init_state(jax.random.key(0), TINY, opt)
    before = jax.tree.map(np.asarray, state["params"])
    batch = GPTData(small_corpus, seq_length=32, global_batch_size=4, eval_iters=0, seed=0).train_batch(0)
    parallel = ParallelConfig(micro_batch_size=2, global_batch_size=4)
    _, grads = accumulate_gradients(state["params"], *microbatches(batch, parallel), TINY)
    new_state, metrics = make_train_step(TINY, tcfg, opt)(state, *microbatches(batch, parallel), jax.random.key(1))
    assert int(new_state["step"]) == 1 and float(metrics["lr"]) == pytest.approx(1e-2)
    w0, w1 = before["layers"]["mlp"]["fc1_kernel"], np.asarray(new_state["params"]["layers"]["mlp"]["fc1_kernel"])
    g = np.asarray(grads["layers"]["mlp"]["fc1_kernel"])
    big = np.abs(g) > 1e-5
    np.testing.assert_allclose((w0 - w1)[big], 1e-2 * np.sign(g[big]), rtol=1e-3)
