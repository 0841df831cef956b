"""NaN/inf guards in every precision, and loss scaling for float16 (Megatron's `DynamicGradScaler`).

Every step checks its loss and its gradients' global norm (a non-finite gradient element makes the norm inf or
NaN; so does a norm that overflows float32). When either is not finite the update is skipped inside the jitted
step: a `lax.cond` on that replicated predicate returns the parameters and optimizer state as they were (a
`jnp.where` select would make XLA hold a second copy of the state), the step counter advances as the iteration
does, and the metrics say `skipped = 1`. The loop counts skips and stops after `max_skipped_iters` in a row.

float16 (`--fp16`, Micikevicius et al. 2018): the loss is multiplied by the scale before the backward, so that
small gradients survive float16, and the float32 gradients are divided by it before the norm and clipping. The
steps do this without touching the pipeline executor: they pass `total_tokens / scale` where the executor divides
by `total_tokens`. The dynamic scale follows Megatron-LM exactly: an overflow resets the growth count and
decrements a hysteresis count, and the scale halves (not below `min_loss_scale`) once that count reaches 0; after
`loss_scale_window` finite iterations in a row the scale doubles and the hysteresis count is reset. `--loss-scale
S` keeps S fixed (overflows still skip).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ptd_jax.config import ModelConfig, TrainConfig
from ptd_jax.optimizer import apply_gradients

F32 = jnp.float32


def uses_loss_scale(model_cfg: ModelConfig) -> bool:
    return model_cfg.dtype == "float16"


def init_loss_scale(model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict | None:
    """The scaler's state (replicated scalars, part of the training state) or None without float16."""
    if not uses_loss_scale(model_cfg):
        return None
    scale = train_cfg.loss_scale if train_cfg.loss_scale is not None else train_cfg.initial_loss_scale
    return {
        "scale": jnp.asarray(scale, F32),
        "growth_tracker": jnp.zeros((), jnp.int32),
        "hysteresis_tracker": jnp.asarray(train_cfg.hysteresis, jnp.int32),
    }


def current_scale(state) -> jax.Array:
    """The scale this step multiplies its loss by (1 without float16)."""
    return state["loss_scale"]["scale"] if "loss_scale" in state else jnp.ones((), F32)


def update_loss_scale(loss_scale: dict, finite, train_cfg: TrainConfig) -> dict:
    """Megatron's DynamicGradScaler.update(found_inf = not finite); a static scale stays as it is."""
    if train_cfg.loss_scale is not None:
        return loss_scale
    scale, growth, hysteresis = (loss_scale[k] for k in ("scale", "growth_tracker", "hysteresis_tracker"))
    # overflow: no growth, one hysteresis step used; halve once the hysteresis is used up
    hysteresis_bad = hysteresis - 1
    scale_bad = jnp.where(hysteresis_bad <= 0, jnp.maximum(scale * 0.5, train_cfg.min_loss_scale), scale)
    # finite: one more good iteration; a full window doubles the scale and restores the hysteresis
    grow = growth + 1 == train_cfg.loss_scale_window
    scale_good = jnp.where(grow, scale * 2.0, scale)
    growth_good = jnp.where(grow, 0, growth + 1)
    hysteresis_good = jnp.where(grow, train_cfg.hysteresis, hysteresis)
    return {
        "scale": jnp.where(finite, scale_good, scale_bad).astype(F32),
        "growth_tracker": jnp.where(finite, growth_good, 0).astype(jnp.int32),
        "hysteresis_tracker": jnp.where(finite, hysteresis_good, hysteresis_bad).astype(jnp.int32),
    }


def poison(loss, grads, step, steps: tuple[int, ...]):
    """Test hook (Python API only): at the given values of state["step"] the loss becomes NaN and the gradients
    inf, as a diverged or overflowed step would make them."""
    if not steps:
        return loss, grads
    hit = jnp.isin(step, jnp.asarray(steps, jnp.int32))
    return (
        jnp.where(hit, jnp.nan, loss).astype(loss.dtype),
        jax.tree.map(lambda g: jnp.where(hit, jnp.inf, g).astype(g.dtype), grads),
    )


def guarded_update(state, loss, grads, grad_norm, optimizer, train_cfg: TrainConfig):
    """Clip and apply the (unscaled) gradients unless the loss or the norm is not finite; advance the scaler.
    Returns (state, {"skipped", "loss_scale"}). `loss` and `grad_norm` must be replicated."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    body = {"params": state["params"], "opt_state": state["opt_state"], "step": state["step"]}

    def update(body):
        return apply_gradients(body, grads, grad_norm, optimizer, train_cfg)

    def skip(body):
        return {**body, "step": body["step"] + 1}

    out = jax.lax.cond(finite, update, skip, body)
    if "loss_scale" in state:
        out["loss_scale"] = update_loss_scale(state["loss_scale"], finite, train_cfg)
    return out, {"skipped": jnp.logical_not(finite).astype(jnp.int32), "loss_scale": current_scale(state)}


def unscale(loss, grads, scale):
    """Divide the scaled loss and float32 gradients by the scale (a no-op multiply by 1 without float16)."""
    inverse = 1.0 / scale
    return loss * inverse.astype(loss.dtype), jax.tree.map(lambda g: g * inverse.astype(g.dtype), grads)


def to_meta(loss_scale: dict | None) -> dict | None:
    """The scaler's state as JSON (checkpoint meta)."""
    if loss_scale is None:
        return None
    return {k: float(v) if k == "scale" else int(v) for k, v in jax.device_get(loss_scale).items()}


def from_meta(meta: dict | None, model_cfg: ModelConfig, train_cfg: TrainConfig) -> dict | None:
    """The scaler's state of a checkpoint (a fresh one when it has none or the run's precision changed); a static
    `--loss-scale` always wins."""
    fresh = init_loss_scale(model_cfg, train_cfg)
    if fresh is None or not meta or train_cfg.loss_scale is not None:
        return fresh
    return {
        "scale": jnp.asarray(meta["scale"], F32),
        "growth_tracker": jnp.asarray(meta["growth_tracker"], jnp.int32),
        "hysteresis_tracker": jnp.asarray(meta["hysteresis_tracker"], jnp.int32),
    }
