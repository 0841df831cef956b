"""NaN/inf guards and float16 loss scaling (`ptd_jax/loss_scale.py`), in the reference and the parallel step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.data import GPTData, microbatches
from ptd_jax.loss_scale import guarded_update, init_loss_scale, update_loss_scale
from ptd_jax.optimizer import make_optimizer
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.step import init_sharded_state, make_parallel_train_step
from ptd_jax.train.reference import init_state, make_train_step

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)
FP16 = TINY.replace(dtype="float16")


def megatron_scales(found_infs, initial, window, hysteresis, min_scale):
    """Megatron-LM's DynamicGradScaler.update, transcribed: the scale after each iteration."""
    scale, growth, hyst, out = initial, 0, hysteresis, []
    for found_inf in found_infs:
        if found_inf:
            growth = 0
            hyst -= 1
            if hyst <= 0:
                scale = max(scale * 0.5, min_scale)
        else:
            growth += 1
            if growth == window:
                growth, hyst, scale = 0, hysteresis, scale * 2.0
        out.append(scale)
    return out


def test_dynamic_scale_follows_megatrons_scaler():
    found = [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    cfg = TrainConfig(initial_loss_scale=16.0, loss_scale_window=3, hysteresis=2, min_loss_scale=2.0)
    state, got = init_loss_scale(FP16, cfg), []
    update = jax.jit(lambda s, f: update_loss_scale(s, f, cfg))
    for f in found:
        state = update(state, jnp.asarray(not f))
        got.append(float(state["scale"]))
    assert got == megatron_scales(found, 16.0, 3, 2, 2.0)
    static = TrainConfig(loss_scale=8.0)
    assert float(update_loss_scale(init_loss_scale(FP16, static), jnp.asarray(False), static)["scale"]) == 8.0


def test_a_non_finite_loss_or_gradient_alone_skips_the_update():
    cfg = TrainConfig(lr=1e-2)
    opt = make_optimizer(cfg)
    state = init_state(jax.random.key(0), TINY, opt)
    grads = jax.tree.map(jnp.ones_like, state["params"])
    update = jax.jit(lambda loss, norm: guarded_update(state, loss, grads, norm, opt, cfg))
    for loss, norm, skipped in [(1.0, 1.0, 0), (jnp.nan, 1.0, 1), (1.0, jnp.inf, 1), (-jnp.inf, jnp.nan, 1)]:
        new, guard = update(jnp.asarray(loss), jnp.asarray(norm))
        assert int(guard["skipped"]) == skipped and int(new["step"]) == 1
        same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), new["params"], state["params"])
        assert all(jax.tree.leaves(same)) == bool(skipped)


def batches(corpus, parallel, n):
    data = GPTData(corpus, seq_length=32, global_batch_size=parallel.global_batch_size, eval_iters=0, seed=0)
    return [microbatches(data.train_batch(i), parallel) for i in range(n)]


def run_reference(corpus, model_cfg, train_cfg, n, poison_steps=()):
    opt = make_optimizer(train_cfg)
    state = init_state(jax.random.key(0), model_cfg, opt, train_cfg)
    step = make_train_step(model_cfg, train_cfg, opt, poison_steps=poison_steps)
    trace = []
    for batch in batches(corpus, ParallelConfig(micro_batch_size=4, global_batch_size=8), n):
        before = jax.tree.map(np.asarray, state["params"])
        state, metrics = step(state, *batch, jax.random.key(1))
        trace.append({k: float(v) for k, v in metrics.items()})
        trace[-1]["unchanged"] = all(
            np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state["params"]))
        )
    return trace


def run_parallel(corpus, model_cfg, train_cfg, parallel, n, poison_steps=()):
    opt = make_optimizer(train_cfg)
    mesh = make_mesh(parallel)
    state = init_sharded_state(jax.random.key(0), model_cfg, opt, mesh, parallel, train_cfg=train_cfg)
    step = make_parallel_train_step(mesh, model_cfg, parallel, train_cfg, opt, state, poison_steps=poison_steps)
    trace = []
    for batch in batches(corpus, parallel, n):
        state, metrics = step(state, *batch, jax.random.key(1))
        trace.append({k: float(v) for k, v in metrics.items()})
    return trace


TRAIN = TrainConfig(train_iters=20, lr=3e-3, lr_warmup_iters=0, lr_decay_iters=20)


# -m slow: the default run skips a poisoned float16 step in the parallel step like the reference (below)
@pytest.mark.slow
@pytest.mark.parametrize("d, p, t", [(2, 1, 2), (2, 2, 2)])
def test_float32_guard_skips_the_poisoned_step_like_the_reference(small_corpus, d, p, t):
    """An injected NaN loss / inf gradient at step 1 skips exactly that update, in the parallel step as in the
    reference; the loss traces around it agree."""
    ref = run_reference(small_corpus, TINY, TRAIN, 4, poison_steps=(1,))
    assert [r["skipped"] for r in ref] == [0, 1, 0, 0] and [r["unchanged"] for r in ref] == [False, True, False, False]
    parallel = ParallelConfig(
        data_parallel_size=d,
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=t,
        micro_batch_size=2,
        global_batch_size=8,
    )
    par = run_parallel(small_corpus, TINY, TRAIN, parallel, 4, poison_steps=(1,))
    assert [r["skipped"] for r in par] == [0, 1, 0, 0]
    np.testing.assert_allclose(
        [r["lm_loss"] for r in par if r["skipped"] == 0], [r["lm_loss"] for r in ref if r["skipped"] == 0], rtol=1e-5
    )


def test_fp16_injected_inf_skips_one_update_and_lowers_the_scale(small_corpus):
    """float16: the scale each step used; one inf halves it at hysteresis 1, only the second in a row at
    hysteresis 2 (Megatron's). The tensor- and data-parallel step scales, skips and losses as the reference."""
    cfg = TRAIN.replace(initial_loss_scale=1024.0, hysteresis=1)
    trace = run_reference(small_corpus, FP16, cfg, 4, poison_steps=(2,))
    assert [r["skipped"] for r in trace] == [0, 0, 1, 0] and [r["unchanged"] for r in trace] == [0, 0, 1, 0]
    assert [r["loss_scale"] for r in trace] == [1024, 1024, 1024, 512]
    cfg = cfg.replace(hysteresis=2)
    ref = run_reference(small_corpus, FP16, cfg, 6, poison_steps=(2, 3))
    assert [r["skipped"] for r in ref] == [0, 0, 1, 1, 0, 0] and [r["unchanged"] for r in ref] == [0, 0, 1, 1, 0, 0]
    assert [r["loss_scale"] for r in ref] == [1024, 1024, 1024, 1024, 512, 512]


@pytest.mark.slow
def test_fp16_parallel_step_scales_skips_and_losses_as_the_reference(small_corpus):
    cfg = TRAIN.replace(initial_loss_scale=1024.0, hysteresis=2)
    ref = run_reference(small_corpus, FP16, cfg, 6, poison_steps=(2, 3))
    par = run_parallel(
        small_corpus,
        FP16,
        cfg,
        ParallelConfig(data_parallel_size=2, tensor_model_parallel_size=2, micro_batch_size=2, global_batch_size=8),
        6,
        poison_steps=(2, 3),
    )
    assert [r["loss_scale"] for r in par] == [r["loss_scale"] for r in ref]
    assert [r["skipped"] for r in par] == [r["skipped"] for r in ref]
    np.testing.assert_allclose(
        [r["lm_loss"] for r in par if not r["skipped"]], [r["lm_loss"] for r in ref if not r["skipped"]], rtol=2e-3
    )
