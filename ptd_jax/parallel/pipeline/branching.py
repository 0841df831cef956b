"""Where a tick's work runs (`ParallelConfig.pipeline_branching`), decided here and nowhere else in the executor.

- "uniform" (`Uniform`): every predicate is per tick, the same on every rank. The embedding and the head run on
  every rank, masked, on the ticks where some rank needs them; an idle cell runs its tick's chunk work on trash
  slots and the result is selected away. No collective ever sits in a pipe-divergent branch.
- "per-rank" (`PerRank`): every predicate is per cell. Only the rank of virtual stage 0 embeds, only the last
  stage's rank runs the head, and an idle cell runs no layer (a `lax.cond` on its activity). Its tensor-parallel
  collectives then sit in pipe-divergent branches, which XLA:CPU runs correctly (docs/architecture.md,
  "Pipeline"); the pipe ring stays outside every branch either way.

On a GPU both should take about the same lockstep wall time (a tick lasts as long as its busiest rank); on fake CPU
devices, which share the cores, "per-rank" does less total work, so "auto" (`config.resolve_branching`) is
"per-rank" on XLA:CPU and "uniform" elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ptd_jax.config import PIPELINE_BRANCHINGS, resolve_branching


class Branching:
    """The five questions whose answers differ between the two ways of branching, and whether idle cells run."""

    name: str
    idle_cells_run: bool
    """An idle cell runs its tick's chunk work on the trash slot (its stash needs one), or nothing."""

    def columns(self, embed_TxP: np.ndarray, head_TxP: np.ndarray) -> dict[str, np.ndarray]:
        """The table's "embed" and "head" columns, from where each cell needs them."""
        raise NotImplementedError

    def cell_work(self, row: dict, rank) -> tuple[jax.Array, jax.Array]:
        """(embed, head) of this rank's cell, from its tick's row of those columns."""
        raise NotImplementedError

    def chunk_work(self, active, fn, skip, *args):
        """A chunk's work: `fn(*args)`, or `skip(*args)` for an idle cell where idle cells run nothing."""
        raise NotImplementedError

    def only_where(self, pred, x):
        """`x` where `pred`, zeros elsewhere: needed where a rank whose `pred` is false ran the work too."""
        raise NotImplementedError

    def keep(self, active):
        """The mask that drops an idle cell's parameter gradients (`stash.Residuals.backward`), or None."""
        raise NotImplementedError


class Uniform(Branching):
    name = "uniform"
    idle_cells_run = True

    def columns(self, embed_TxP, head_TxP):
        return {"embed": embed_TxP.any(axis=1), "head": head_TxP.any(axis=1)}

    def cell_work(self, row, rank):
        return row["embed"], row["head"]

    def chunk_work(self, active, fn, skip, *args):
        return fn(*args)  # an idle cell on trash slots, selected away after

    def only_where(self, pred, x):
        # An idle cell ran on the trash slot, which may still hold the initial zeros (a LayerNorm's 1/sqrt backward
        # then gives inf·0), and another rank's head ran on a slot that is not its input: select, never multiply.
        return jnp.where(pred, x, jnp.zeros_like(x))

    def keep(self, active):
        return active


class PerRank(Branching):
    name = "per-rank"
    idle_cells_run = False

    def columns(self, embed_TxP, head_TxP):
        return {"embed": embed_TxP, "head": head_TxP}

    def cell_work(self, row, rank):
        return row["embed"][rank], row["head"][rank]

    def chunk_work(self, active, fn, skip, *args):
        return jax.lax.cond(active, fn, skip, *args)

    def only_where(self, pred, x):
        return x  # the work ran only where `pred` holds

    def keep(self, active):
        return None


STRATEGIES: dict[str, Branching] = {"uniform": Uniform(), "per-rank": PerRank()}


def strategy(branching: str) -> Branching:
    """The strategy of "uniform", "per-rank" or "auto" (resolved for the default backend)."""
    if branching not in PIPELINE_BRANCHINGS:
        raise ValueError(f"pipeline_branching={branching!r} is not one of {PIPELINE_BRANCHINGS}")
    return STRATEGIES[resolve_branching(branching)]
