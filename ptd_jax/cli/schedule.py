"""`ptd-schedule`: build, check and show a pipeline schedule (table, JSON, PNG/PDF/SVG timeline).

    ptd-schedule --schedule interleaved --pipeline-model-parallel-size 4 --virtual-stages 2 --num-microbatches 8
                 [--microbatch-group-size G] [--json] [--plot FILE.png] [--backward-ratio 2]
                 [--f-time F] [--b-time B] [--w-time W]

Every flag is checked before anything is built: sizes are positive integers, the backward ratio a positive finite
number, and the --plot file a .png/.pdf/.svg name in an existing folder. The plot is drawn into a temporary file
beside it and renamed, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ptd_jax.cli.args import OneLineParser, positive_float, positive_int
from ptd_jax.config import PIPELINE_SCHEDULES, SCHEDULE_SPECS
from ptd_jax.parallel.pipeline import ScheduleError, build, plot, validate

PLOT_FORMATS = (".png", ".pdf", ".svg")
MAX_ACTIONS = 200_000
"""Most actions (2·p·v·m, 3·p·v·m with split backwards) one table may hold: 10 s to build and check on one core
(measured)."""
MAX_PLOT_ACTIONS = 8192
"""Most actions --plot draws: one bar and one label each, 30 s for 8192 (measured)."""


def plot_problem(name: str) -> str | None:
    """Why the timeline cannot be written to the file `name`, or None."""
    path = Path(name)
    if not name.strip():
        return "the file name is empty"
    try:
        path.is_dir()
    except OSError as err:  # e.g. a name too long
        return f"{name[:60]!r}...: {err.strerror}" if len(name) > 60 else f"{name!r}: {err.strerror}"
    if path.is_dir():
        return f"{name!r} is a folder: name a file in it, e.g. {str(path / 'schedule.png')!r}"
    if path.suffix.lower() not in PLOT_FORMATS:
        return f"{name!r} has no image extension: name a {', '.join(PLOT_FORMATS)} file"
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        return f"the folder {str(folder)!r} of {name!r} {what}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {str(folder)!r} of {name!r} is not writable"
    return None


def write_plot(sched, path: Path, times: tuple[float, float, float]) -> None:
    """Draw into a temporary file beside `path` (same extension: matplotlib reads the format from it), then
    rename it to `path`; the temporary is removed on any failure."""
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        plot(sched, str(tmp), times=times)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def schedule_times(args) -> tuple[float, float, float]:
    """(f, b, w): --f-time, and --b-time/--w-time, each by default half of --backward-ratio."""
    half = args.backward_ratio / 2
    return (args.f_time, half if args.b_time is None else args.b_time, half if args.w_time is None else args.w_time)


def summary(sched, times: tuple[float, float, float]) -> str:
    """The line under the table: ticks, simulated bubble and makespan, the formula's bubble, the peak stash."""
    sim = sched.simulate(times=times)
    formula = sched.formula_bubble(times)
    law = sched.spec.bubble_formula
    formula_text = "no closed form" if formula is None else f"formula {law} = {formula:.4f}"
    line = (
        f"{sched.name}: p={sched.p} v={sched.v} m={sched.m} G={sched.group}: {sched.ticks} ticks, makespan "
        f"{sim['makespan']:.4g} at f={times[0]:g} b={times[1]:g} w={times[2]:g}, bubble "
        f"{sim['bubble_fraction']:.4f} ({formula_text}), peak stash per rank {sched.peak_stash}"
    )
    if sched.split:
        line += f", in flight from F to W {sched.peak_in_flight}"
    return line


def main(argv=None) -> int:
    from ptd_jax.cli.errors import run_tool

    return run_tool("ptd-schedule", run, argv, interrupted="interrupted; nothing was written")


def run(argv) -> int:
    parser = OneLineParser(prog="ptd-schedule", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default="interleaved")
    parser.add_argument("--pipeline-model-parallel-size", "-p", type=positive_int, default=4)
    parser.add_argument(
        "--virtual-stages", "-v", type=positive_int, help="model chunks per rank (default: 2 for interleaved, else 1)"
    )
    parser.add_argument("--num-microbatches", "-m", type=positive_int, default=8)
    parser.add_argument("--microbatch-group-size", type=positive_int, help="interleaved only (default: p)")
    parser.add_argument(
        "--backward-ratio",
        type=positive_float,
        default=2.0,
        help="backward time / forward time: b + w when --b-time/--w-time are not given",
    )
    parser.add_argument("--f-time", type=positive_float, default=1.0, help="a whole stage's forward time")
    parser.add_argument(
        "--b-time", type=positive_float, help="a stage's input-gradient backward time (default: backward ratio / 2)"
    )
    parser.add_argument(
        "--w-time",
        type=positive_float,
        help="a stage's weight-gradient time (default: backward ratio / 2); a fused schedule's backward lasts b + w",
    )
    parser.add_argument("--json", action="store_true", help="print the schedule as JSON")
    parser.add_argument("--plot", help=f"write a timeline (paper Figure 4 style); {'/'.join(PLOT_FORMATS)}")
    args = parser.parse_args(argv)
    p, m = args.pipeline_model_parallel_size, args.num_microbatches
    spec = SCHEDULE_SPECS[args.schedule]
    v = args.virtual_stages if args.virtual_stages is not None else (spec.chunks or 2)
    times = schedule_times(args)
    actions = (3 if spec.split else 2) * p * v * m
    per = "3·p·v·m" if spec.split else "2·p·v·m"
    if args.microbatch_group_size is not None and not spec.grouped:
        parser.error(
            f"argument --microbatch-group-size: G={args.microbatch_group_size} needs --schedule "
            f"interleaved (schedule={args.schedule!r} has no groups)"
        )
    if actions > MAX_ACTIONS:
        parser.error(f"p={p}, v={v}, m={m} make {per} = {actions} actions, more than this tool builds ({MAX_ACTIONS})")
    if args.plot is not None and (problem := plot_problem(args.plot)):
        parser.error(f"argument --plot: {problem}")
    if args.plot is not None and actions > MAX_PLOT_ACTIONS:
        parser.error(
            f"argument --plot: p={p}, v={v}, m={m} make {actions} actions, more than a timeline "
            f"draws ({MAX_PLOT_ACTIONS}); leave out --plot or use fewer microbatches"
        )
    try:
        sched = build(args.schedule, p, v, m, args.microbatch_group_size)
        validate(sched)
    except ScheduleError as err:
        print(f"ptd-schedule: error: {err}", file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            write_plot(sched, Path(args.plot), times)
        except (OSError, ValueError) as err:  # the file system's and matplotlib's
            print(f"ptd-schedule: error: cannot write --plot {args.plot!r}: {err}", file=sys.stderr)
            return 2
    try:
        if args.json:
            print(json.dumps(sched.to_json(times=times)))
        else:
            print(sched.text())
            print(summary(sched, times))
        sys.stdout.flush()
    except BrokenPipeError:  # `ptd-schedule | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
