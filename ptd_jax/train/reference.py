"""The single-device training step: the oracle every parallel code path is compared against.

One iteration (Megatron's `train_step`): the global batch of B samples is cut into M = B / b microbatches;
the gradient of each microbatch's summed token loss is accumulated in float32 (a `lax.scan`), divided by the
global token count (so the loss is the mean over the whole batch whatever the layout), clipped to a global
norm, and applied by AdamW (`optimizer.apply_gradients`, the same update as the parallel step's). State is
donated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig, TrainConfig
from ptd_jax.loss_scale import current_scale, guarded_update, init_loss_scale, poison, unscale
from ptd_jax.optimizer import State, global_norm, learning_rate_schedule, new_state, schedule_count


def init_state(
    key: jax.Array,
    model_cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    train_cfg: TrainConfig | None = None,
) -> State:
    state = new_state(gpt.init_params(key, model_cfg), optimizer)
    loss_scale = init_loss_scale(model_cfg, train_cfg or TrainConfig())
    return state if loss_scale is None else {**state, "loss_scale": loss_scale}


def accumulate_gradients(
    params,
    tokens_MxBxS,
    labels_MxBxS,
    mask_MxBxS,
    model_cfg: ModelConfig,
    *,
    recompute: str = "none",
    key=None,
    loss_scale=None,
):
    """Sum over microbatches of d(loss_sum / total_tokens)/d(params), accumulated in float32 (or float64).
    With a `loss_scale` the backward runs on the loss times the scale (total_tokens / scale as the divisor) and
    the float32 sums are unscaled after.

    Returns (mean token loss of the batch, grads)."""
    acc = gpt.acc_dtype(jax.tree.leaves(params)[0].dtype)
    scale = jnp.ones((), acc) if loss_scale is None else loss_scale.astype(acc)
    total_tokens = jnp.maximum(jnp.sum(mask_MxBxS > 0), 1).astype(acc) / scale

    def micro_loss(p, tokens, labels, mask, k):
        return gpt.loss_sum(p, tokens, labels, mask, model_cfg, key=k, recompute=recompute) / total_tokens

    grad_fn = jax.value_and_grad(micro_loss)

    def body(carry, xs):
        loss_acc, grad_acc = carry
        index, tokens, labels, mask = xs
        k = jax.random.fold_in(key, index) if key is not None else None
        loss, grads = grad_fn(params, tokens, labels, mask, k)
        grad_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_acc, grads)
        return (loss_acc + loss, grad_acc), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, gpt.acc_dtype(x.dtype)), params)
    indices = jnp.arange(tokens_MxBxS.shape[0])
    (loss, grads), _ = jax.lax.scan(
        body, (jnp.zeros((), acc), zeros), (indices, tokens_MxBxS, labels_MxBxS, mask_MxBxS)
    )
    return (loss, grads) if loss_scale is None else unscale(loss, grads, scale)


def make_train_step(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    optimizer: optax.GradientTransformation,
    *,
    poison_steps: tuple[int, ...] = (),
):
    """jit(state, tokens, labels, mask [M, b, S], key) -> (state, metrics); the state is donated. A non-finite
    loss or gradient skips the update (`loss_scale.guarded_update`); `poison_steps` is its test hook."""
    schedule = learning_rate_schedule(train_cfg)
    use_dropout = model_cfg.hidden_dropout > 0 or model_cfg.attention_dropout > 0

    def step(state, tokens, labels, mask, key):
        key = jax.random.fold_in(key, state["step"]) if use_dropout else None
        loss, grads = accumulate_gradients(
            state["params"],
            tokens,
            labels,
            mask,
            model_cfg,
            recompute=train_cfg.recompute_granularity,
            key=key,
            loss_scale=current_scale(state) if "loss_scale" in state else None,
        )
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
        loss, grads = poison(loss, grads, state["step"], poison_steps)
        grad_norm = global_norm(grads)
        metrics = {"lm_loss": loss, "grad_norm": grad_norm, "lr": schedule(schedule_count(state["opt_state"]))}
        state, guard = guarded_update(state, loss, grads, grad_norm, optimizer, train_cfg)
        return state, {**metrics, **guard}

    return jax.jit(step, donate_argnums=0)


def make_eval_step(model_cfg: ModelConfig):
    """jit(params, tokens, labels, mask [M, b, S]) -> mean token loss (no dropout)."""

    def eval_step(params, tokens, labels, mask):
        def body(total, xs):
            return total + gpt.loss_sum(params, *xs, model_cfg), None

        acc = gpt.acc_dtype(jax.tree.leaves(params)[0].dtype)
        total, _ = jax.lax.scan(body, jnp.zeros((), acc), (tokens, labels, mask))
        return total / jnp.maximum(jnp.sum(mask > 0), 1)

    return jax.jit(eval_step)
