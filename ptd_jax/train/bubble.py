"""The measured pipeline bubble (paper §2.2: t_pb / t_id) of a run's layout, shown after its first step.

All of a step's ticks run inside one XLA program, so there is no per-tick clock to read idle time from. Instead
the layout's gradient step (the same p, v, b, schedule, branching, recompute policy and shapes, no optimizer) is
timed at two microbatch counts, m and 2m, in alternating rounds, and the step time is split into the part that
grows with m and the part that does not:

    T(m) = c + m·t_mb        t_mb = (T(2m) − T(m)) / m     (one microbatch's forward and backward, steady state)
    ideal = m·t_mb           measured bubble = (T(m) − ideal) / ideal = c / (m·t_mb)

which is the paper's t_pb / t_id (and the simulator's `bubble_fraction`); `idle_share` = 1 − ideal / T(m) is
the share of the step spent outside the ideal. The same two-point figure taken on the lockstep table's simulated
makespans is `simulated_two_point`: it equals the simulated bubble whenever the bubble does not depend on m.
Honest limits: c also holds what every step pays once (the gradient reduction, the accumulators' set-up), so the
measured figure is an upper bound of the pipeline's own bubble; and on fake CPU devices the devices share the
host's cores, so step time follows the work that every rank executes (`--pipeline-branching uniform` computes
masked dummies in idle cells, which then cost time; `per-rank` idle cells cost nothing there, unlike a GPU's).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import numpy as np

from ptd_jax.config import ParallelConfig

DESCRIPTION = ("the layout's gradient step timed at m and 2m microbatches (alternating rounds, medians); bubble = "
               "(T(m) - m*t_mb)/(m*t_mb) with t_mb = (T(2m) - T(m))/m; the m-independent part also holds fixed "
               "per-step costs, so this is an upper bound")


def two_point(t_m: float, t_2m: float, m: int) -> dict:
    """Split T(m) = c + m·t_mb from step times at m and 2m: {"per_microbatch_s", "fixed_s", "bubble_fraction",
    "idle_share"}."""
    per_mb = (t_2m - t_m) / m
    ideal = m * per_mb
    fixed = t_m - ideal
    bubble = fixed / ideal if ideal > 0 else float("nan")
    return {"per_microbatch_s": per_mb, "fixed_s": fixed, "bubble_fraction": bubble,
            "idle_share": fixed / t_m if t_m > 0 else float("nan")}


def simulated_two_point(parallel: ParallelConfig, backward_ratio: float = 2.0) -> float:
    """The two-point figure on the lockstep tables' simulated makespans at m and 2m (ptd_jax's own schedule)."""
    from ptd_jax.parallel.step import pipeline_schedule

    m = parallel.num_microbatches
    spans = [pipeline_schedule(cfg).simulate(backward_ratio)["makespan"]
             for cfg in (parallel, doubled(parallel))]
    return two_point(spans[0], spans[1], m)["bubble_fraction"]


def doubled(parallel: ParallelConfig) -> ParallelConfig:
    """The same layout with twice the microbatches (twice the global batch)."""
    return replace(parallel, global_batch_size=2 * parallel.global_batch_size)


def time_alternating(steps: dict, rounds: int) -> dict[str, list[float]]:
    """{name: [seconds per round]} of each `(fn, args)` in `steps`, called once to warm up, then in alternating
    rounds (the machine may be shared: every step sees the same load)."""
    import jax

    for fn, args in steps.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (fn, args) in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return times


def measure(mesh, model_cfg, parallel: ParallelConfig, params, batch, recompute: str = "none",
            rounds: int = 3) -> dict:
    """Time the layout's gradient step at m and 2m on `params` (the run's sharded parameters) and a batch
    (tokens, labels, mask [M, d·b, S]) of the run; the 2m batch is the batch twice. Returns the two-point split,
    both medians, the simulated bubble and its two-point figure."""
    from ptd_jax.parallel import sharding
    from ptd_jax.parallel.step import make_parallel_grad_step, pipeline_schedule

    specs = sharding.param_specs(params, parallel.pipeline_model_parallel_size > 1)
    twice = tuple(np.concatenate([x, x]) for x in batch)
    steps = {
        "m": (make_parallel_grad_step(mesh, model_cfg, parallel, specs, recompute, parallel.scatter_gather),
              (params, *batch)),
        "2m": (make_parallel_grad_step(mesh, model_cfg, doubled(parallel), specs, recompute,
                                       parallel.scatter_gather), (params, *twice)),
    }
    start = time.perf_counter()
    times = time_alternating(steps, rounds)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    m = parallel.num_microbatches
    result = two_point(median["m"], median["2m"], m)
    sched = pipeline_schedule(parallel)
    result.update(m=m, rounds=rounds, median_step_s=median, all_step_s=times,
                  simulated_bubble=sched.simulate()["bubble_fraction"] if sched else 0.0,
                  simulated_two_point=simulated_two_point(parallel) if sched else 0.0,
                  formula_bubble=sched.formula_bubble() if sched else 0.0,
                  branching=parallel.pipeline_branching, measurement_s=time.perf_counter() - start,
                  method=DESCRIPTION)
    return result


def describe(result: dict, fake_devices: bool) -> str:
    """The banner line."""
    median = result["median_step_s"]
    line = (f"pipeline: measured bubble {result['bubble_fraction']:.3f} (simulated {result['simulated_bubble']:.3f}, "
            f"two-point on the simulated table {result['simulated_two_point']:.3f}; idle share of the step "
            f"{result['idle_share']:.1%}): gradient step timed at m={result['m']} ({median['m']:.3f} s) and "
            f"m={2 * result['m']} ({median['2m']:.3f} s), {result['rounds']} alternating rounds, medians; bubble = "
            f"fixed part / (m x per-microbatch part), an upper bound (the fixed part also holds per-step costs); "
            f"{result['measurement_s']:.1f} s, not counted in step times")
    if fake_devices:
        line += (f"; fake CPU devices share the cores, so this follows the work all ranks execute "
                 f"(branching {result['branching']})")
    return line


AUTO_MIN_ITERATIONS = 100
"""`measure_bubble=None` measures when p > 1 and at least this many iterations remain (two extra compiles)."""


def after_first_step(enabled: bool | None, mesh, model_cfg, parallel: ParallelConfig, recompute: str, params,
                     batch, iterations_left: int, message) -> dict | None:
    """The training loop's hook: measure and `message` the banner line, or return None when not measuring."""
    if parallel.pipeline_model_parallel_size == 1:
        return None
    if enabled is None:
        enabled = iterations_left >= AUTO_MIN_ITERATIONS
    if not enabled:
        return None
    import jax

    result = measure(mesh, model_cfg, parallel, params, batch, recompute)
    message(describe(result, fake_devices=jax.devices()[0].platform == "cpu"))
    return result
