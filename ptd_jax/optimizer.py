"""The update rule shared by every train step: AdamW with Megatron's learning-rate schedule (built from optax),
clipping by a global norm, and the training state it updates.

Schedule (Megatron's OptimizerParamScheduler): linear warm-up from 0 to `lr` over `lr_warmup_iters`, then decay
to `min_lr` by iteration `lr_decay_iters` (counted from 0, warm-up included) — cosine, linear or constant — and
`min_lr` afterwards. Biases and LayerNorm parameters are not weight-decayed. Each step computes its gradients'
global norm its own way (the parallel step counts every sharded parameter once) and hands it to
`apply_gradients`, which clips and updates.

This module sits below both the single-device reference step (`train/reference.py`) and the parallel step
(`parallel/step.py`), so that neither imports the other and both apply exactly the same update.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ptd_jax.config import TrainConfig
from ptd_jax.model import acc_dtype

State = dict[str, Any]
"""The training state: {"params", "opt_state", "step"} (a pytree; donated to every train step)."""


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    warmup, decay_end = cfg.lr_warmup_iters, cfg.decay_iters
    peak, floor = cfg.lr, cfg.min_lr

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * step / max(warmup, 1)
        ratio = jnp.clip((step - warmup) / max(decay_end - warmup, 1), 0.0, 1.0)
        if cfg.lr_decay_style == "cosine":
            coeff = 0.5 * (jnp.cos(math.pi * ratio) + 1.0)
        elif cfg.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = jnp.ones_like(ratio)
        decayed = floor + coeff * (peak - floor)
        return jnp.where(step < warmup, warm, decayed)

    return schedule


def weight_decay_mask(params):
    """True for matrices and embeddings; False for biases and LayerNorm scale/shift (Megatron's no-decay group)."""

    def decays(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return not (name.endswith("bias") or name == "scale")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.adamw(
        learning_rate=learning_rate_schedule(cfg),
        b1=cfg.adam_beta1,
        b2=cfg.adam_beta2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=weight_decay_mask,
    )


def global_norm(tree):
    """L2 norm over every leaf (accumulated in at least float32)."""
    leaves = [jnp.sum(jnp.square(x.astype(acc_dtype(x.dtype)))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(leaves))


def clip_by_global_norm(grads, max_norm: float, norm=None):
    """Scale grads so their global L2 norm is at most max_norm (0 disables); returns (grads, norm before).
    `norm` is the norm when the caller computed it (the parallel step counts every sharded parameter once)."""
    norm = global_norm(grads) if norm is None else norm
    if max_norm <= 0:
        return grads, norm
    scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads), norm


def at_schedule_step(opt_state, step: int):
    """`opt_state` with the learning-rate schedule's counter at `step` (Adam's own counter, for its bias
    correction, untouched): a fresh optimizer state for a run that resumes at `step` (--no-load-optim)."""

    def set_count(x):
        if isinstance(x, optax.ScaleByScheduleState):
            return x._replace(count=jnp.full_like(x.count, step))
        return x

    return jax.tree.map(set_count, opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))


def schedule_count(opt_state):
    """The learning-rate schedule's counter in `opt_state`: the updates applied so far. A skipped iteration (a
    non-finite loss or gradients, `loss_scale.guarded_update`) does not advance it — as Megatron's
    OptimizerParamScheduler, stepped only after a successful update — while the state's "step" does.
    `learning_rate_schedule(cfg)(schedule_count(opt_state))` is the rate the next update applies."""
    counts = [
        x.count
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
        if isinstance(x, optax.ScaleByScheduleState)
    ]
    if not counts:
        raise ValueError("the optimizer state holds no learning-rate schedule (optax.ScaleByScheduleState)")
    return counts[0]


def new_state(params, optimizer: optax.GradientTransformation) -> State:
    return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}


def apply_gradients(
    state: State, grads, grad_norm, optimizer: optax.GradientTransformation, train_cfg: TrainConfig
) -> State:
    """Clip `grads` to `train_cfg.clip_grad` by their (given) global norm and take one optimizer step."""
    grads, _ = clip_by_global_norm(grads, train_cfg.clip_grad, grad_norm)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state, "step": state["step"] + 1}
