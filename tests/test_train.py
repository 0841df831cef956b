import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.data import GPTData
from ptd_jax.optimizer import clip_by_global_norm, learning_rate_schedule, make_optimizer, weight_decay_mask
from ptd_jax.train import RunOptions, accumulate_gradients, init_state, make_train_step, microbatches, train

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)


def test_loss_falls_on_a_tiny_corpus(small_corpus, tmp_path):
    summary = train(TINY, ParallelConfig(micro_batch_size=4, global_batch_size=8),
                    TrainConfig(train_iters=40, lr=3e-3, lr_warmup_iters=5, log_interval=5, eval_interval=20,
                                eval_iters=2),
                    RunOptions(data_path=small_corpus, split="90,10,0", progress=False,
                               metrics_file=str(tmp_path / "m.jsonl")))
    assert summary["first_lm_loss"] == pytest.approx(math.log(257), abs=0.3)
    assert summary["final_lm_loss"] < summary["first_lm_loss"] - 2.0
    assert summary["final_valid_lm_loss"] < summary["first_lm_loss"] - 2.0


def _x64_setup():
    cfg = TINY.replace(dtype="float64", param_dtype="float64")
    params = gpt.init_params(jax.random.key(0), cfg)
    return cfg, params


@pytest.mark.parametrize("m, b", [(4, 2), (8, 1), (2, 4)])
def test_gradient_accumulation_equals_full_batch_gradient(small_corpus, m, b):
    """The reference step's loss and grads do not depend on how the global batch is cut into microbatches."""
    with jax.enable_x64(True):
        cfg, params = _x64_setup()
        batch = GPTData(small_corpus, seq_length=32, global_batch_size=8, train_iters=2, eval_iters=0,
                        seed=0).train_batch(1)
        full = jax.jit(jax.value_and_grad(
            lambda p: gpt.loss_sum(p, batch.tokens, batch.labels, batch.loss_mask, cfg) / batch.loss_mask.sum()))
        loss_ref, grads_ref = full(params)
        parallel = ParallelConfig(micro_batch_size=b, global_batch_size=8)
        assert parallel.num_microbatches == m
        loss, grads = jax.jit(accumulate_gradients, static_argnums=4)(params, *microbatches(batch, parallel), cfg)
        assert float(loss) == pytest.approx(float(loss_ref), rel=1e-12)
        for a, g in zip(jax.tree.leaves(grads_ref), jax.tree.leaves(grads)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(a), rtol=1e-10, atol=1e-14)


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


def test_train_step_applies_adamw(small_corpus):
    """One step by hand: first Adam step moves each weight by lr·(sign of grad) (+ decoupled decay)."""
    tcfg = TrainConfig(train_iters=2, lr=1e-2, lr_warmup_iters=0, lr_decay_style="constant", clip_grad=0.0,
                       weight_decay=0.0)
    opt = make_optimizer(tcfg)
    state = init_state(jax.random.key(0), TINY, opt)
    before = jax.tree.map(np.asarray, state["params"])
    batch = GPTData(small_corpus, seq_length=32, global_batch_size=4, train_iters=2, eval_iters=0,
                    seed=0).train_batch(0)
    parallel = ParallelConfig(micro_batch_size=2, global_batch_size=4)
    _, grads = accumulate_gradients(state["params"], *microbatches(batch, parallel), TINY)
    new_state, metrics = make_train_step(TINY, tcfg, opt)(state, *microbatches(batch, parallel), jax.random.key(1))
    assert int(new_state["step"]) == 1 and float(metrics["lr"]) == pytest.approx(1e-2)
    w0, w1 = before["layers"]["mlp"]["fc1_kernel"], np.asarray(new_state["params"]["layers"]["mlp"]["fc1_kernel"])
    g = np.asarray(grads["layers"]["mlp"]["fc1_kernel"])
    big = np.abs(g) > 1e-5
    np.testing.assert_allclose((w0 - w1)[big], 1e-2 * np.sign(g[big]), rtol=1e-3)


@pytest.mark.parametrize("d, t", [pytest.param(1, 1, marks=pytest.mark.slow), (2, 4)])  # (2, 4): sharded state
def test_checkpoint_resume_reproduces_an_uninterrupted_run(small_corpus, tmp_path, d, t):
    parallel = ParallelConfig(data_parallel_size=d, tensor_model_parallel_size=t, micro_batch_size=4 // d,
                              global_batch_size=4)
    base = dict(lr=1e-3, lr_warmup_iters=1, log_interval=1, eval_iters=0)
    straight = train(TINY, parallel, TrainConfig(train_iters=4, **base),
                     RunOptions(data_path=small_corpus, progress=False, metrics_file=str(tmp_path / "a.jsonl")))
    train(TINY, parallel, TrainConfig(train_iters=4, lr_decay_iters=4, save_interval=2, **base).replace(
        train_iters=2), RunOptions(data_path=small_corpus, progress=False, save=str(tmp_path / "ckpt")))
    resumed = train(TINY, parallel, TrainConfig(train_iters=4, **base),
                    RunOptions(data_path=small_corpus, progress=False, load=str(tmp_path / "ckpt"),
                               metrics_file=str(tmp_path / "b.jsonl")))
    assert resumed["iterations"] == 2
    assert resumed["final_lm_loss"] == pytest.approx(straight["final_lm_loss"], rel=1e-6)


def test_load_with_another_architecture_fails(small_corpus, tmp_path):
    from ptd_jax.config import ConfigError

    parallel = ParallelConfig(micro_batch_size=4, global_batch_size=4)
    train(TINY, parallel, TrainConfig(train_iters=1, eval_iters=0),
          RunOptions(data_path=small_corpus, progress=False, save=str(tmp_path / "ckpt")))
    with pytest.raises(ConfigError, match=r"different architecture .*'hidden_size': \(32, 64\)"):
        train(TINY.replace(hidden_size=64), parallel, TrainConfig(train_iters=2, eval_iters=0),
              RunOptions(data_path=small_corpus, progress=False, load=str(tmp_path / "ckpt")))
