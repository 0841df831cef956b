"""Pick a pipeline schedule for (p, m) and the measured F/B/W times: build every schedule the request allows,
simulate each (`Schedule.simulate`) and take the shortest makespan among those whose memory fits. Pure Python, no
JAX (`ptd-train --pipeline-schedule auto`).

With f = b = w (the zero-bubble paper's assumption) and m ≥ p, ZB-V has the shortest makespan; ZB-H1 follows at
1F1B's stash, then interleaved 1F1B. A `memory_ok` that rejects the split schedules' extra W stash leaves the
fused ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ptd_jax.config import PIPELINE_SCHEDULES
from ptd_jax.parallel.pipeline.lockstep import Schedule
from ptd_jax.parallel.pipeline.schedule import ScheduleError
from ptd_jax.parallel.pipeline.tables import build

CANDIDATES = PIPELINE_SCHEDULES


def candidates(p: int, v_options: Sequence[int] = (2,)) -> list[tuple[str, int]]:
    """(schedule, v) pairs to try: interleaved once per v in `v_options` (v > 1), ZB-V at v = 2 when 2 is allowed;
    with one rank (p = 1) the pipelined schedules are all the same, 1F1B stands for them."""
    if p == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1), ("1f1b", 1)]
    out += [("interleaved", v) for v in v_options if v > 1]
    out += [("1f1b-split", 1), ("zb-h1", 1)]
    if 2 in v_options:
        out.append(("zb-v", 2))
    return out


def choose_schedule(p: int, v_hint: int | None, m: int, times: tuple[float, float, float] = (1.0, 1.0, 1.0),
                    memory_ok: Callable[[str, int, Schedule], bool] | None = None,
                    v_options: Sequence[int] = (2,), names: Sequence[str] = CANDIDATES
                    ) -> tuple[str, int, list[dict]]:
    """(name, v, rows): the schedule with the smallest simulated makespan at `times` = (f, b, w) among those
    valid for (p, m) and accepted by `memory_ok(name, v, sched)` (None: all fit). `v_hint`, when given and > 1,
    is tried for interleaved too; `names` limits the schedules tried. `rows`: one dict per schedule built, in
    `CANDIDATES` order: schedule, v, bubble_fraction, makespan, peak_stash (most microbatches a rank holds, in
    whole stages: peak / v), peak_w_stash (most B's waiting for their W), fits. Raises ScheduleError if none is
    valid and fits."""
    options = tuple(v_options) + ((v_hint,) if v_hint and v_hint > 1 and v_hint not in v_options else ())
    rows = []
    for name, v in candidates(p, options):
        if name not in names:
            continue
        try:
            sched = build(name, p, v, m)
        except ScheduleError:
            continue
        sim = sched.simulate(times=tuple(times))
        fits = True if memory_ok is None else bool(memory_ok(name, v, sched))
        rows.append({"schedule": name, "v": v, "bubble_fraction": sim["bubble_fraction"],
                     "makespan": sim["makespan"], "peak_stash": max(sched.peak_stash) / v,
                     "peak_w_stash": max(sched.peak_w_stash or [0]), "fits": fits})
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        tried = ", ".join(f"{r['schedule']} v={r['v']}" for r in rows) or "none valid"
        raise ScheduleError(f"no pipeline schedule fits at p={p}, m={m} (tried: {tried})")
    best = min(fitting, key=lambda r: (r["makespan"], r["peak_stash"], CANDIDATES.index(r["schedule"])))
    return best["schedule"], best["v"], rows


def format_choice(name: str, rows: list[dict], times: tuple[float, float, float] | None = None) -> str:
    """Several lines: the choice, then every schedule tried with its predicted bubble, makespan and stash."""
    chosen = next(r for r in rows if r["schedule"] == name)
    head = f"pipeline schedule: {name} (v={chosen['v']}), the shortest simulated step"
    if times is not None:
        head += f" at F:B:W = {times[0]:g}:{times[1]:g}:{times[2]:g}"
    lines = [head + "; alternatives:"]
    for r in rows:
        mark = "*" if r["schedule"] == name and r["v"] == chosen["v"] else " "
        lines.append(f" {mark} {r['schedule']:<11} v={r['v']}  bubble {r['bubble_fraction']:.3f}  makespan "
                     f"{r['makespan']:.2f}  stash {r['peak_stash']:g} stages + {r['peak_w_stash']} W"
                     + ("" if r["fits"] else "  (does not fit in memory)"))
    return "\n".join(lines)
