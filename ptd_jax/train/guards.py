"""The loop's side of the NaN/inf guards (`ptd_jax/loss_scale.py` is the step's side): count the iterations the
step skipped, stop the run after `max_skipped_iters` in a row, and never write a checkpoint from a state that is
not finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ptd_jax import loss_scale as ls
from ptd_jax.config import ModelConfig, TrainConfig


class DivergedError(RuntimeError):
    """Too many consecutive iterations had a non-finite loss or gradients; the message is one line."""


class SkipCounter:
    """Skipped iterations: in total, in the current logging window, and in a row."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.total = self.window = self.in_a_row = 0

    def add(self, skipped: bool, iteration: int, loss_scale: float) -> None:
        """Count one iteration; raises DivergedError on the `max_in_a_row`-th skip in a row."""
        self.total += skipped
        self.window += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.in_a_row >= self.max_in_a_row:
            raise DivergedError(
                f"stopping at iteration {iteration}: max_skipped_iters={self.max_in_a_row} "
                f"iterations in a row had a non-finite loss or gradients (loss scale "
                f"{loss_scale:g}); no checkpoint written from them"
            )

    def take_window(self) -> int:
        window, self.window = self.window, 0
        return window


@jax.jit
def state_is_finite(state) -> jax.Array:
    """Whether every floating-point element of the parameters and optimizer state is finite."""
    leaves = [
        x
        for x in jax.tree.leaves({"params": state["params"], "opt_state": state["opt_state"]})
        if jnp.issubdtype(x.dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def with_loss_scale(state, meta: dict | None, model_cfg: ModelConfig, train_cfg: TrainConfig, mesh):
    """A restored state plus the loss scaler of its checkpoint's meta (float16 only), replicated on the mesh."""
    scaler = ls.from_meta((meta or {}).get("loss_scale"), model_cfg, train_cfg)
    if scaler is None:
        return state
    return {**state, "loss_scale": jax.device_put(scaler, NamedSharding(mesh, P()))}
