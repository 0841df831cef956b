"""`--pipeline-schedule auto`, all of it: pick the schedule (and its chunk count) for a run. Pure Python.

Every schedule the request allows is built and simulated (`Table.simulate`) at the F : B : W times of one layer
(`model_times`: the ratios of the FLOPs it executes, or measured times given by `--schedule-times`). Among those
whose memory fits (`perf.memory.check_fits` on the run's device, where one is given), the shortest simulated step
wins, unless one that holds less memory is within `MARGIN` of it: the simulation knows the actions' times only as
well as the F:B:W ratios it is given and ignores the ring's latency, and a schedule that holds fewer microbatches
leaves memory for a larger micro-batch or less recomputation. Memory is compared by the bytes `perf.memory`
predicts for the run with that schedule (`choose_for_run`), else by the most layer-microbatches a rank keeps in
flight (`Table.peak_in_flight` / v: whole stages' worth; `choose_schedule` without `memory`), which undercounts
a split schedule's W-waiting microbatches (their taps outweigh their residuals).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ptd_jax.config import PIPELINE_SCHEDULES, SCHEDULE_SPECS, ConfigError, ModelConfig, ParallelConfig
from ptd_jax.parallel.pipeline.schedule import ScheduleError
from ptd_jax.parallel.pipeline.table import Table, build
from ptd_jax.perf.flops import layer_executed_flops, layer_matmul_flops
from ptd_jax.perf.memory import check_fits, run_memory_bytes

CANDIDATES = PIPELINE_SCHEDULES
MARGIN = 0.03
"""A schedule must simulate more than 3% faster to beat one holding less memory."""


def candidates(p: int, v_options: Sequence[int] = (2,)) -> list[tuple[str, int]]:
    """(schedule, v) pairs to try: schedules with a fixed chunk count at it (where v_options allows more than one
    chunk), chunked ones once per v in `v_options` (v > 1); at p = 1 only the first unchunked one (all the same)."""
    out = []
    for name, spec in SCHEDULE_SPECS.items():
        if p < spec.min_p:
            continue
        if spec.chunks is None:
            out += [(name, v) for v in v_options if v > 1]
        elif spec.chunks == 1 or spec.chunks in v_options:
            out.append((name, spec.chunks))
    return out[:1] if p == 1 else out


def choose_schedule(
    p: int,
    v_hint: int | None,
    m: int,
    times: tuple[float, float, float] = (1.0, 1.0, 1.0),
    memory_ok: Callable[[str, int, Table], bool] | None = None,
    v_options: Sequence[int] = (2,),
    names: Sequence[str] = CANDIDATES,
    memory: Callable[[str, int, Table], float] | None = None,
) -> tuple[str, int, list[dict]]:
    """(name, v, rows): the choice (module docstring) among the schedules valid for (p, m) and accepted by
    `memory_ok(name, v, table)` (None: all fit). `v_hint`, when given and > 1, is tried for chunked schedules too;
    `names` limits the schedules tried. `rows`: one dict per schedule built: schedule, v, bubble_fraction,
    makespan, in_flight (most layer-microbatches a rank holds, in whole stages), memory_gib (where `memory` is
    given), fits, and the chosen row's `why`.
    Raises ScheduleError if none is valid and fits."""
    options = tuple(v_options) + ((v_hint,) if v_hint and v_hint > 1 and v_hint not in v_options else ())
    rows = []
    for name, v in candidates(p, options):
        if name not in names:
            continue
        try:
            table = build(name, p, v, m)
        except ScheduleError:
            continue
        sim = table.simulate(times=tuple(times))
        fits = True if memory_ok is None else bool(memory_ok(name, v, table))
        row = {
            "schedule": name,
            "v": v,
            "bubble_fraction": sim["bubble_fraction"],
            "makespan": sim["makespan"],
            "in_flight": max(table.peak_in_flight) / v,
            "fits": fits,
        }
        if memory is not None:
            row["memory_gib"] = memory(name, v, table) / 2**30
        rows.append(row)
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        tried = ", ".join(f"{r['schedule']} v={r['v']}" for r in rows) or "none valid"
        raise ScheduleError(f"no pipeline schedule fits at p={p}, m={m} (tried: {tried})")
    held, unit = ("memory_gib", "GiB") if memory is not None else ("in_flight", "stages in flight")
    fastest = min(fitting, key=lambda r: (r["makespan"], r[held]))
    close = [r for r in fitting if r["makespan"] <= fastest["makespan"] * (1 + MARGIN)]
    best = min(close, key=lambda r: (r[held], r["makespan"]))
    if best is fastest:
        best["why"] = "the shortest simulated step"
    else:
        best["why"] = (
            f"within {MARGIN:.0%} of the shortest simulated step ({fastest['schedule']}, "
            f"{fastest['makespan']:.2f}) holding less ({best[held]:.3g} {unit} against {fastest[held]:.3g})"
        )
    return best["schedule"], best["v"], rows


def format_choice(name: str, rows: list[dict], times: tuple[float, float, float] | None = None) -> str:
    """Several lines: the choice and why, then every schedule tried with its bubble, makespan and memory."""
    chosen = next(r for r in rows if r["schedule"] == name)
    head = f"pipeline schedule: {name} (v={chosen['v']}), {chosen.get('why', 'chosen')}"
    if times is not None:
        head += f" at F:B:W = {times[0]:g}:{times[1]:g}:{times[2]:g}"
    lines = [head + "; alternatives:"]
    for r in rows:
        mark = "*" if r["schedule"] == name and r["v"] == chosen["v"] else " "
        lines.append(
            f" {mark} {r['schedule']:<13} v={r['v']}  bubble {r['bubble_fraction']:.3f}  makespan "
            f"{r['makespan']:.2f}  in flight {r['in_flight']:g} stages"
            + (f"  {r['memory_gib']:.2f} GiB" if r.get("memory_gib", float("inf")) < float("inf") else "")
            + (
                ""
                if r["fits"]
                else "  (not valid for this layout)"
                if r.get("memory_gib") == float("inf")
                else "  (does not fit in memory)"
            )
        )
    return "\n".join(lines)


def model_times(cfg: ModelConfig, recompute: str) -> tuple[float, float, float]:
    """F : B : W of one layer from the FLOPs it executes (`perf.flops`), F = 1: B is the backward but the weight
    gradients (with what `recompute` recomputes), W those."""
    f, backward = layer_executed_flops(cfg, cfg.seq_length, recompute)
    w = layer_matmul_flops(cfg, cfg.seq_length)
    return 1.0, (backward - w) / f, w / f


@dataclass(frozen=True)
class Request:
    """A run that asks for `auto`: its devices and ParallelConfig fields but the schedule and v."""

    num_devices: int
    fields: dict
    """`ParallelConfig.for_devices` keywords: the layout, batch sizes, branching (not the schedule or v)."""
    layers_per_chunk: int | None = None
    """--num-layers-per-virtual-pipeline-stage, where given: then only its v is tried."""
    recompute: str = "none"
    times: tuple[float, float, float] | None = None
    """F : B : W of one layer, e.g. measured (None: `model_times`)."""
    device: object | None = field(default=None, compare=False)
    """A JAX device: schedules whose run does not fit its memory are refused (None: no check)."""
    num_local_devices: int = 1
    memory_budget: float | None = None
    """Bytes per device when there is no device to ask (`--compile-only`, `ptd-plan predict`: the target's
    `usable_memory_bytes`): schedules whose predicted run exceeds it are refused."""


@dataclass(frozen=True)
class Choice:
    name: str
    v: int
    rows: tuple[dict, ...]
    times: tuple[float, float, float]

    def text(self) -> str:
        return format_choice(self.name, list(self.rows), self.times) if self.rows else ""


def parallel_for(cfg: ModelConfig, request: Request, name: str, v: int) -> ParallelConfig:
    """The run's ParallelConfig with schedule `name` at v chunks (raises ConfigError where it is invalid)."""
    parallel = ParallelConfig.for_devices(
        request.num_devices, **request.fields, pipeline_schedule=name, virtual_pipeline_stages=v
    )
    parallel.check_model(cfg)
    return parallel


def microbatches(request: Request) -> int | None:
    """m = B / (b · d) with d = devices / (t · p), as `ParallelConfig.for_devices`; None where that does not
    divide (the ParallelConfig names the problem)."""
    f = request.fields
    tp = f.get("tensor_model_parallel_size", 1) * f.get("pipeline_model_parallel_size", 1)
    b, global_batch = f.get("micro_batch_size") or 0, f.get("global_batch_size") or 0
    if tp < 1 or request.num_devices % tp or b < 1:
        return None
    per_step = b * (request.num_devices // tp)
    if global_batch % per_step or global_batch < per_step:
        return None
    return global_batch // per_step


def options(cfg: ModelConfig, request: Request) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(v_options, names) allowed by the layers and the layers per chunk: chunked schedules (interleaved, ZB-V at
    v = 2) only where the layers split into v·p equal chunks; no schedule on unit ticks under uniform branching
    (they run per-rank only)."""
    p, k = request.fields.get("pipeline_model_parallel_size", 1), request.layers_per_chunk
    uniform = request.fields.get("pipeline_branching") == "uniform"
    names = tuple(n for n in CANDIDATES if not (uniform and SCHEDULE_SPECS[n].rows == "unit"))
    if k is None:
        return ((2,) if cfg.num_layers % (2 * p) == 0 else ()), names
    if k < 1 or cfg.num_layers % (k * p):
        return (), ("1f1b",)  # the ParallelConfig refuses k with its own message
    v = cfg.num_layers // (k * p)
    if v == 1:
        return (), names
    return (v,), tuple(n for n in names if SCHEDULE_SPECS[n].chunks in (None, v))


def choose_for_run(cfg: ModelConfig, request: Request) -> Choice:
    """The schedule `auto` gives this run: `choose_schedule` over the allowed schedules, each weighed by the bytes
    per GPU `perf.memory` predicts for the run with it and, given a device, refused where `check_fits` refuses the
    run. Where nothing is valid: 1f1b, and the ParallelConfig says why."""
    times = tuple(request.times or model_times(cfg, request.recompute))
    m = microbatches(request)
    if m is None:
        return Choice("1f1b", 1, (), times)

    def run_config(name: str, v: int) -> ParallelConfig | None:
        try:
            return parallel_for(cfg, request, name, v)
        except ConfigError:
            return None

    def fits(name: str, v: int, table: Table) -> bool:
        parallel = run_config(name, v)
        if parallel is None:
            return False
        if request.device is None:
            budget = request.memory_budget
            return budget is None or run_memory_bytes(cfg, parallel, request.recompute)["total"] <= budget
        try:
            check_fits(cfg, parallel, request.recompute, request.device, request.num_local_devices)
        except ConfigError:
            return False
        return True

    def memory(name: str, v: int, table: Table) -> float:
        parallel = run_config(name, v)
        return float("inf") if parallel is None else run_memory_bytes(cfg, parallel, request.recompute)["total"]

    v_options, names = options(cfg, request)
    p = request.fields.get("pipeline_model_parallel_size", 1)
    try:
        name, v, rows = choose_schedule(p, None, m, times, fits, v_options=v_options, names=names, memory=memory)
    except ScheduleError:
        return Choice("1f1b", 1, (), times)
    return Choice(name, v, tuple(rows), times)
