"""`ptd-schedule`: build, check and show a pipeline schedule (table, JSON, PNG timeline).

    ptd-schedule --schedule interleaved --pipeline-model-parallel-size 4 --virtual-stages 2 --num-microbatches 8
                 [--microbatch-group-size G] [--json] [--plot FILE.png] [--backward-ratio 2]
"""

from __future__ import annotations

import argparse
import json
import sys

from ptd_jax.parallel.pipeline import SCHEDULES, ScheduleError, build, plot, validate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ptd-schedule", description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="interleaved")
    parser.add_argument("--pipeline-model-parallel-size", "-p", type=int, default=4)
    parser.add_argument("--virtual-stages", "-v", type=int)
    parser.add_argument("--num-microbatches", "-m", type=int, default=8)
    parser.add_argument("--microbatch-group-size", type=int)
    parser.add_argument("--backward-ratio", type=float, default=2.0, help="backward time / forward time")
    parser.add_argument("--json", action="store_true", help="print the schedule as JSON")
    parser.add_argument("--plot", help="write a PNG timeline (paper Figure 4 style)")
    args = parser.parse_args(argv)
    v = args.virtual_stages or (2 if args.schedule == "interleaved" else 1)
    try:
        sched = build(args.schedule, args.pipeline_model_parallel_size, v, args.num_microbatches,
                      args.microbatch_group_size)
        validate(sched)
    except ScheduleError as err:
        print(f"ptd-schedule: error: {err}", file=sys.stderr)
        return 2
    if args.plot:
        plot(sched, args.plot, args.backward_ratio)
    if args.json:
        print(json.dumps(sched.to_json(args.backward_ratio)))
    else:
        sim = sched.simulate(args.backward_ratio)
        print(sched.table())
        print(f"{sched.name}: p={sched.p} v={sched.v} m={sched.m} G={sched.group}: {sched.ticks} ticks, bubble "
              f"{sim['bubble_fraction']:.4f} (formula (p-1)/(v*m) = {sched.formula_bubble():.4f}), peak stash per "
              f"rank {sched.peak_stash}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
