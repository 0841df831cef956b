"""The measured pipeline bubble (paper §2.2: t_pb / t_id) of a run's layout, shown after its first step.

All of a step's ticks run inside one XLA program, so there is no per-tick clock to read idle time from. Instead the
run's own training step (already compiled, at m microbatches) and the same step at 2m microbatches (one more
compile; the batch twice) are timed in alternating rounds, each call on a fresh copy of the state whose result is
discarded, and the step time is split into the part that grows with m and the part that does not:

    T(m) = c + m·t_mb        t_mb = (T(2m) − T(m)) / m     (one microbatch's forward and backward, steady state)
    ideal = m·t_mb           measured bubble = (T(m) − ideal) / ideal = c / (m·t_mb)

which is the paper's t_pb / t_id (and the simulator's `bubble_fraction`); `idle_share` = 1 − ideal / T(m) is the
share of the step spent outside the ideal. The same two-point figure taken on the lockstep tables' simulated
makespans is `simulated_two_point`: it equals the simulated bubble whenever the bubble does not depend on m.
Honest limits: c also holds what every step pays once (the gradient reduction, the optimizer update), so the
measured figure is an upper bound of the pipeline's own bubble; and on fake CPU devices the devices share the
host's cores, so step time follows the total work of all ranks and a bubble need not show at all: an idle rank
frees the cores for the busy ones (experiments/paper/fig_bubble.py measured T(m) proportional to m at p = 4). The
figure means what the paper's does on real devices only.
`time_alternating` and `two_point` also serve experiments/ (the bubble figure, on gradient steps).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ptd_jax.config import ParallelConfig
from ptd_jax.runtime.platform import resolve_branching

DESCRIPTION = (
    "the run's train step timed at m and 2m microbatches (fresh state copies, alternating rounds, "
    "medians); bubble = (T(m) - m*t_mb)/(m*t_mb) with t_mb = (T(2m) - T(m))/m; the m-independent part "
    "also holds per-step costs (gradient reduction, optimizer), so this is an upper bound"
)


def two_point(t_m: float, t_2m: float, m: int) -> dict:
    """Split T(m) = c + m·t_mb from step times at m and 2m: {"per_microbatch_s", "fixed_s", "bubble_fraction",
    "idle_share"}."""
    per_mb = (t_2m - t_m) / m
    ideal = m * per_mb
    fixed = t_m - ideal
    bubble = fixed / ideal if ideal > 0 else float("nan")
    return {
        "per_microbatch_s": per_mb,
        "fixed_s": fixed,
        "bubble_fraction": bubble,
        "idle_share": fixed / t_m if t_m > 0 else float("nan"),
    }


def simulated_two_point(parallel: ParallelConfig, backward_ratio: float = 2.0) -> float:
    """The two-point figure on the lockstep tables' simulated makespans at m and 2m (ptd_jax's own schedule)."""
    from ptd_jax.parallel.step import pipeline_schedule

    m = parallel.num_microbatches
    spans = [pipeline_schedule(cfg).simulate(backward_ratio)["makespan"] for cfg in (parallel, doubled(parallel))]
    return two_point(spans[0], spans[1], m)["bubble_fraction"]


def doubled(parallel: ParallelConfig) -> ParallelConfig:
    """The same layout with twice the microbatches (twice the global batch)."""
    return replace(parallel, global_batch_size=2 * parallel.global_batch_size)


def time_alternating(steps: dict, rounds: int, cpu_times: dict | None = None) -> dict[str, list[float]]:
    """{name: [seconds per round]} of each `(fn, args)` in `steps` (`args` a tuple, or a function returning a fresh
    tuple for each call, untimed: a step that donates its input), called once to warm up, then in alternating
    rounds (the machine may be shared: every step sees the same load). A `cpu_times` dict receives the process CPU
    seconds of the same calls ({name: [...]}: every XLA thread's work, which follows the work executed better than
    the wall time on a loaded machine)."""
    import jax

    def args_of(args):
        return args() if callable(args) else args

    for fn, args in steps.values():
        jax.block_until_ready(fn(*args_of(args)))
    times = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (fn, args) in steps.items():
            call_args = jax.block_until_ready(args_of(args))
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*call_args))
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    if cpu_times is not None:
        cpu_times.update(cpu)
    return times


@dataclass(frozen=True)
class StepBuild:
    """What builds the run's train step (`parallel.step.make_parallel_train_step`): the 2m step is built alike."""

    mesh: Any
    model_cfg: Any
    parallel: ParallelConfig
    train_cfg: Any
    optimizer: Any


def prepare_2m(state, batch, key, build: StepBuild):
    """(the train step at 2m, compiled; the batch twice): the part of the measurement that may fail on its own in
    one process (a second program and batch that need not fit where the run does) and runs no collective."""
    from ptd_jax.parallel.step import make_parallel_train_step

    twice = tuple(_twice(x) for x in batch)
    step_2m = make_parallel_train_step(
        build.mesh, build.model_cfg, doubled(build.parallel), build.train_cfg, build.optimizer, state
    )
    return step_2m.lower(state, *twice, key).compile(), twice


def measure(train_step, state, batch, key, build: StepBuild, rounds: int = 3, prepared=None) -> dict:
    """Time the run's `train_step` (at m) and the same step built at 2m on copies of `state` and a batch of the
    run (tokens, labels, mask [M, d·b, S]; the 2m batch is the batch twice). Returns the two-point split, both
    medians, the simulated bubble and its two-point figure. `prepared`: what `prepare_2m` returned (None: built
    here)."""
    import jax

    from ptd_jax.parallel.step import pipeline_schedule

    start = time.perf_counter()
    parallel = build.parallel
    step_2m, twice = prepared or prepare_2m(state, batch, key, build)

    def fresh(b):
        return lambda: (jax.tree.map(lambda x: x.copy(), state), *b, key)  # the steps donate their state

    times = time_alternating({"m": (train_step, fresh(batch)), "2m": (step_2m, fresh(twice))}, rounds)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    m = parallel.num_microbatches
    result = two_point(median["m"], median["2m"], m)
    sched = pipeline_schedule(parallel)
    result.update(
        m=m,
        rounds=rounds,
        median_step_s=median,
        all_step_s=times,
        simulated_bubble=sched.simulate()["bubble_fraction"] if sched else 0.0,
        simulated_two_point=simulated_two_point(parallel) if sched else 0.0,
        formula_bubble=sched.formula_bubble() if sched else 0.0,
        branching=resolve_branching(parallel.pipeline_branching, schedule=parallel.pipeline_schedule),
        measurement_s=time.perf_counter() - start,
        method=DESCRIPTION,
    )
    return result


def _twice(x):
    """The batch twice along M; a global array stays one (several processes: no host gather)."""
    import jax
    import jax.numpy as jnp

    if isinstance(x, jax.Array):
        return jax.jit(lambda y: jnp.concatenate([y, y]), out_shardings=x.sharding)(x)
    return np.concatenate([x, x])


def describe(result: dict, fake_devices: bool) -> str:
    """The banner line."""
    median = result["median_step_s"]
    line = (
        f"pipeline: measured bubble {result['bubble_fraction']:.3f} (simulated {result['simulated_bubble']:.3f}, "
        f"two-point on the simulated table {result['simulated_two_point']:.3f}; idle share of the step "
        f"{result['idle_share']:.1%}): train step timed at m={result['m']} ({median['m']:.3f} s) and "
        f"m={2 * result['m']} ({median['2m']:.3f} s), {result['rounds']} alternating rounds, medians; bubble = "
        f"fixed part / (m x per-microbatch part), an upper bound (the fixed part also holds per-step costs: "
        f"gradient reduction, optimizer); "
        f"{result['measurement_s']:.1f} s, not counted in step times"
    )
    if fake_devices:
        line += (
            f"; on fake CPU devices, which share the host's cores, time follows the total work of all ranks "
            f"(branching {result['branching']}) and a bubble need not show: meaningful on real devices"
        )
    return line


AUTO_MIN_ITERATIONS = 100
"""`measure_bubble=None` measures when p > 1 and at least this many iterations remain (one extra compile: the step
at 2m)."""


def after_first_step(
    enabled: bool | None, train_step, state, batch, key, build: StepBuild, iterations_left: int, message
) -> dict | None:
    """The training loop's hook: measure and `message` the banner line, or return None when not measuring.

    The measurement needs a second program and a second copy of the state, which may not fit where the run does: a
    failure skips it (one line) and training goes on. Several processes agree on that after each part (building the
    2m step, timing): were one to skip while the others went on to run the 2m step, their collectives would no
    longer pair up and the run would hang with its heartbeats alive. The agreement covers a failure while building
    the step (compiling, allocating its state); one process failing *inside* the 2m step's collectives still leaves
    the others waiting there, as any collective failing on one process does."""
    if build.parallel.pipeline_model_parallel_size == 1:
        return None
    if enabled is None:
        enabled = iterations_left >= AUTO_MIN_ITERATIONS
    if not enabled:
        return None
    import jax

    prepared, err = _attempt(prepare_2m, state, batch, key, build)
    if _skipped_by_any(err, message):
        return None
    result, err = _attempt(measure, train_step, state, batch, key, build, prepared=prepared)
    if _skipped_by_any(err, message):
        return None
    message(describe(result, fake_devices=jax.devices()[0].platform == "cpu"))
    return result


def _attempt(fn, *args, **kwargs):
    """(fn's result, None), or (None, the exception it raised)."""
    try:
        return fn(*args, **kwargs), None
    except Exception as err:  # noqa: BLE001 - a measurement, never a reason to stop training
        return None, err


def _skipped_by_any(err: Exception | None, message) -> bool:
    """Whether any process failed (`err` is this one's failure): then `message` one line saying so. Every process
    calls it at the same point, and all get the same answer (`multiprocess.failed_processes`)."""
    from ptd_jax.runtime import multiprocess

    failed = multiprocess.failed_processes(err is None)
    if not failed:
        return False
    here = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}" if err is not None else ""
    if multiprocess.process_count() > 1:
        where = f"failed in process {', '.join(map(str, failed))} of {multiprocess.process_count()}"
        here = f"{where}{'; here: ' + here if here else ''}"
    message(f"pipeline: measured bubble skipped ({here})")
    return True
