"""Pipeline model parallelism (paper §2.2): the schedule as data, and the one executor that reads it. Read in order:

    schedule.py   actions (F, B, I, W chunk.microbatch), the stage map, dependencies, each rank's order: GPipe,
                  1F1B, interleaved 1F1B, ZB-H1, ZB-V, chosen by the spec (`config.SCHEDULE_SPECS`). Pure Python.
    table.py      the orders placed on ticks (one placement, by the spec's row rule), buffer slots, the validator
                  and the simulator. Pure Python.
    plot.py       the timeline as a PNG (paper Figure 4).
    lowering.py   the table as the executor's integer columns, its ticks cut into runs of a static pattern (numpy).
    stash.py      what a layer saves for its backward and its W (`jax.vjp` residuals, matmul taps) in slot buffers.
    cells.py      one rank's cell of a tick: the step's context, and each kind's work (a layer's F/B/I/W, the
                  embedding, the head) (JAX).
    executor.py   one SPMD program: `lax.scan` over the ticks inside the step's shard_map (JAX).

The CLI is `ptd_jax/cli/schedule.py` (`ptd-schedule`); `--pipeline-schedule auto` is
`ptd_jax/perf/auto_schedule.py`. Importing this package does not import JAX: schedules can be
built, checked and drawn anywhere.
"""

from ptd_jax.parallel.pipeline.plot import plot
from ptd_jax.parallel.pipeline.schedule import Action, ScheduleError, build_orders
from ptd_jax.parallel.pipeline.table import Cell, Table, build, build_forward_only, validate

__all__ = [
    "Action",
    "Cell",
    "ScheduleError",
    "Table",
    "build",
    "build_forward_only",
    "build_orders",
    "plot",
    "validate",
]
