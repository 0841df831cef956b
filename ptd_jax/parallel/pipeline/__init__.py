"""Pipeline model parallelism (paper §2.2): the schedule as data, and the one executor that reads it.

    schedule.py   actions (F/B/W chunk.microbatch) and each rank's order: GPipe, 1F1B, interleaved 1F1B, and the
                  split ones 1F1B-split, ZB-H1, ZB-V. Pure Python.
    lockstep.py   fused orders placed on global ticks of one kind, stash slots, validation, simulation. Pure Python.
    unit.py       split orders placed on unit ticks (each rank its own kind), slots, validation. Pure Python.
    tables.py     a request -> its table (lockstep or unit ticks). Pure Python.
    plot.py       the timeline as a PNG (paper Figure 4).
    columns.py    the table as the executor's integer columns, and its ticks as runs of a static pattern (numpy).
    branching.py  where a tick's work runs: "uniform" (the same on every rank, masked) or "per-rank" (JAX).
    stash.py      each layer's vjp residuals, kept in slot buffers from its F tick to its B tick (JAX).
    executor.py   one SPMD program: `lax.scan` over the ticks inside the step's shard_map (JAX).

The CLI is `ptd_jax/cli/schedule.py` (`ptd-schedule`). Importing this package does not import JAX: schedules can be
built, checked and drawn anywhere.
"""

from ptd_jax.parallel.pipeline.lockstep import Cell, Schedule
from ptd_jax.parallel.pipeline.tables import build, build_forward_only, validate
from ptd_jax.parallel.pipeline.plot import plot
from ptd_jax.parallel.pipeline.schedule import SCHEDULES, SPLIT_SCHEDULES, Action, ScheduleError, build_orders

__all__ = ["SCHEDULES", "SPLIT_SCHEDULES", "Action", "Cell", "Schedule", "ScheduleError", "build", "build_forward_only",
           "build_orders", "plot", "validate"]
