"""Pick a pipeline schedule for (p, m) and the F/B/W times (`ptd-train --pipeline-schedule auto`). Pure Python.

Every schedule the request allows is built and simulated (`Table.simulate`). Among those whose memory fits, the
shortest simulated step wins, unless one that holds less is within `MARGIN` of it: the simulation knows the
actions' times only as well as the F:B:W ratios it is given and ignores the ring's latency, and a schedule that holds
fewer microbatches leaves memory for a larger micro-batch or less recomputation. Memory is compared by the bytes a
`memory(name, v, table)` function predicts (ptd-train gives `perf.memory`'s), else by the most layer-microbatches a
rank keeps in flight (`Table.peak_in_flight` / v: whole stages' worth), which undercounts a split schedule's
W-waiting microbatches (their taps outweigh their residuals).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ptd_jax.config import PIPELINE_SCHEDULES, SCHEDULE_SPECS
from ptd_jax.parallel.pipeline.schedule import ScheduleError
from ptd_jax.parallel.pipeline.table import Table, build

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
            f" {mark} {r['schedule']:<11} v={r['v']}  bubble {r['bubble_fraction']:.3f}  makespan "
            f"{r['makespan']:.2f}  in flight {r['in_flight']:g} stages"
            + (f"  {r['memory_gib']:.2f} GiB" if "memory_gib" in r else "")
            + ("" if r["fits"] else "  (does not fit in memory)")
        )
    return "\n".join(lines)
