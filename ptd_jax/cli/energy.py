"""`ptd-plan energy`: one SM clock per pipeline rank for the least energy per step at (1 + ε) × full clock's step
time (`perf/energy.py`), the time–energy frontier, and the plan file `ptd-train --gpu-clock-plan` applies.

    ptd-plan energy --schedule 1f1b -p 4 -m 8 [-v V] [--f-time 1 --b-time 1 --w-time 1 --memory-fraction 0.15]
        --hardware a100-80gb --epsilon 0.01 [--profile SWEEP.json] [--plot FRONTIER.png] [--output PLAN.json] [--json]
    ptd-plan energy --schedule interleaved -v 2 --model-preset paper-1.7b --num-layers 96 --hidden-size 12288
        --num-attention-heads 96 --tensor-model-parallel-size 8 -p 12 --num-gpus 96 --global-batch-size 48 --fp16 ...

Stage times come from --f-time/--b-time/--w-time as `ptd-schedule` takes them (seconds of a whole stage at full
clock, each with --memory-fraction of memory-bound time), or from a model and layout as `ptd-plan predict` times
them (`perf.energy.stage_times`) when --num-gpus is given. Why one clock per rank: a rank's cells run inside one
compiled step, with no point between them where the clock could change; the per-action figure printed beside the
plan is the bound a per-cell plan could reach, not a plan. Bad input (ε < 0, an unknown hardware, a profile that
does not parse): one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from ptd_jax.cli.args import OneLineParser, positive_float, positive_int
from ptd_jax.config import PIPELINE_SCHEDULES, RECOMPUTE_GRANULARITIES, SCHEDULE_SPECS, ConfigError, ParallelConfig
from ptd_jax.presets import MODEL_PRESETS, model_preset
from ptd_jax.parallel.pipeline import ScheduleError, build
from ptd_jax.perf import energy
from ptd_jax.perf.hardware import HARDWARE

PLAN_FORMAT = "ptd_jax.clock_plan/1"
DEFAULT_MEMORY_FRACTION = 0.15
"""The memory-bound share of an action given by --f-time/--b-time/--w-time: about what `perf.timing` predicts for
the paper's GPT-3 175B layout (elementwise kernels, collectives and sends against GEMMs)."""


def _epsilon(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"epsilon={text} must be a finite slowdown budget >= 0 (0.01 = 1%)")
    return value


def _fraction(text: str) -> float:
    value = _epsilon(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text} must be in [0, 1)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("schedule (as ptd-schedule)")
    g.add_argument("--schedule", "--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="1f1b")
    g.add_argument("--pipeline-model-parallel-size", "-p", type=positive_int, default=4)
    g.add_argument("--virtual-stages", "-v", type=positive_int, help="chunks per rank (default: 2 for interleaved)")
    g.add_argument("--num-microbatches", "-m", type=positive_int, default=8, help="(a model layout sets it)")
    g.add_argument("--microbatch-group-size", type=positive_int)
    g.add_argument("--f-time", type=positive_float, default=1.0, help="a whole stage's forward at full clock, s")
    g.add_argument("--b-time", type=positive_float, default=1.0, help="its input-gradient backward (I)")
    g.add_argument("--w-time", type=positive_float, default=1.0, help="its weight-gradient backward (W)")
    g.add_argument(
        "--memory-fraction", type=_fraction, default=DEFAULT_MEMORY_FRACTION, help="memory-bound share of each time"
    )
    m = parser.add_argument_group("or a model and layout (times as ptd-plan predict; --num-gpus selects this)")
    m.add_argument("--model-preset", choices=sorted(MODEL_PRESETS), default="paper-1.7b")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--vocab-size"):
        m.add_argument(flag, type=positive_int)
    m.add_argument("--tensor-model-parallel-size", "-t", type=positive_int, default=1)
    m.add_argument("--num-gpus", type=positive_int)
    m.add_argument("--global-batch-size", type=positive_int)
    m.add_argument("--micro-batch-size", type=positive_int, default=1)
    m.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default="full")
    m.add_argument("--fp16", action="store_true", help="the paper's precision (default bf16)")
    e = parser.add_argument_group("energy")
    e.add_argument("--hardware", default="a100-80gb", help=f"one of {sorted(energy.CLOCK_POWER)}")
    e.add_argument("--epsilon", type=_epsilon, default=0.0, help="slowdown budget: step time <= (1 + eps) x full")
    e.add_argument("--profile", help="a measured clock sweep (JSON, docs/architecture.md 'Energy') for --hardware")
    e.add_argument("--max-nodes", type=positive_int, default=energy.MAX_NODES, help="search nodes before stopping")
    e.add_argument("--frontier", action="store_true", help="print the time-energy frontier (--plot draws it)")
    e.add_argument("--plot", help="write the time-energy frontier (PNG)")
    e.add_argument("--output", help="write the plan for ptd-train --gpu-clock-plan (JSON)")
    e.add_argument("--json", action="store_true", help="one JSON object on stdout")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `energy` on `ptd-plan`'s subparsers."""
    parser = subparsers.add_parser("energy", help="one GPU clock per pipeline rank: least energy at (1+eps) x time")
    add_arguments(parser)
    return parser


def problem_of(args) -> tuple[energy.Problem, dict]:
    """The table, its stage times and the clock/power model the flags describe, and the request's description."""
    power = energy.clock_power(args.hardware)
    if args.profile:
        power = energy.load_profile(args.profile, power)
    spec = SCHEDULE_SPECS[args.schedule]
    p = args.pipeline_model_parallel_size
    v = args.virtual_stages or (spec.chunks or 2)
    m = args.num_microbatches
    if args.num_gpus is not None:
        if args.global_batch_size is None:
            raise ConfigError("--num-gpus (a model layout) needs --global-batch-size")
        cfg = model_preset(args.model_preset)
        changes = {
            k: getattr(args, k)
            for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
            if getattr(args, k) is not None
        }
        cfg = cfg.replace(**changes, dtype="float16" if args.fp16 else "bfloat16")
        parallel = ParallelConfig.for_devices(
            args.num_gpus,
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=p,
            micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size,
            pipeline_schedule=args.schedule,
            virtual_pipeline_stages=v,
        )
        parallel.check_model(cfg)
        m = parallel.num_microbatches
        times = energy.stage_times(cfg, parallel, HARDWARE[args.hardware], args.recompute_granularity)
        source = f"model {args.model_preset} {changes} on {args.num_gpus} x {args.hardware}"
    else:
        times = energy.StageTimes.from_ratios((args.f_time, args.b_time, args.w_time), args.memory_fraction)
        source = f"--f-time {args.f_time:g} --b-time {args.b_time:g} --w-time {args.w_time:g}"
    try:
        table = build(args.schedule, p, v, m, args.microbatch_group_size)
    except ScheduleError as err:
        raise ConfigError(str(err)) from None
    request = {"schedule": args.schedule, "p": p, "v": v, "m": m, "hardware": args.hardware, "times": source}
    return energy.Problem(table, times, power), request


def plan_record(best: energy.Plan, request: dict, bound: float, power) -> dict:
    """The plan as JSON: what `ptd-train --gpu-clock-plan` reads, and what was predicted."""
    return {
        "format": PLAN_FORMAT,
        **request,
        "epsilon": best.epsilon,
        "clocks_mhz": list(best.clocks),
        "max_clock_mhz": power.max_mhz,
        "clock_step_mhz": power.step_mhz,
        "power_model": power.source,
        "predicted": {
            "time_s": best.time_s,
            "energy_j": best.energy_j,
            "full_clock_time_s": best.full_time_s,
            "full_clock_energy_j": best.full_energy_j,
            "saving": best.saving,
            "slowdown": best.slowdown,
            "exact": best.exact,
            "search_nodes": best.nodes,
            "per_action_bound_energy_j": bound,
            "per_action_bound_saving": 1 - bound / best.full_energy_j,
        },
        "why_one_clock_per_rank": "a rank's actions run inside one compiled SPMD step: the clock cannot change "
        "between them; per-action plans are reported as a bound",
    }


def write_json(path: str, record: dict) -> None:
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, target)


def plot_frontier(front: energy.Frontier, path: str, title: str) -> None:
    """Step time against step energy, both relative to full clock: the per-rank plans, one clock for all ranks,
    and the per-action bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = front.plans[0]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    uni = front.uniform
    ax.plot(
        [u["time_s"] / full.full_time_s for u in uni],
        [u["energy_j"] / full.full_energy_j for u in uni],
        ".-",
        color="0.6",
        label="one clock for every rank",
    )
    ax.plot(
        [1 + q.slowdown for q in front.plans],
        [q.energy_j / q.full_energy_j for q in front.plans],
        "o-",
        label="one clock per pipeline rank (plan)",
    )
    ax.plot(
        [1 + e for e, _ in front.bounds],
        [b / full.full_energy_j for _, b in front.bounds],
        "v--",
        label="clock per action (bound)",
    )
    ax.set_xlabel("step time / full clock")
    ax.set_ylabel("step energy / full clock")
    ax.set_xlim(0.99, 1 + max(e for e, _ in front.bounds) + 0.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def run(args) -> dict:
    """`ptd-plan energy`: plan, print, write; raises ConfigError on bad input (the caller prints it, exit 2)."""
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise ConfigError(f"--plot {args.plot!r} must name a .png file")
    for flag, name in (("--plot", args.plot), ("--output", args.output)):
        if name is not None and not Path(name).resolve().parent.is_dir():
            raise ConfigError(f"{flag} {name!r}: the folder {str(Path(name).parent)!r} does not exist")
    problem, request = problem_of(args)
    best = energy.plan(problem, args.epsilon, args.max_nodes)
    bound = energy.per_action_bound(problem, args.epsilon)
    record = plan_record(best, request, bound, problem.power)
    if args.plot or args.frontier:
        epsilons = sorted({*energy.FRONTIER_EPSILONS, args.epsilon})
        front = energy.frontier(problem, epsilons, args.max_nodes)
        record["frontier"] = [
            {"epsilon": q.epsilon, "saving": q.saving, "slowdown": q.slowdown, "exact": q.exact} for q in front.plans
        ]
    if args.plot:
        title = f"{request['schedule']} p={request['p']} v={request['v']} m={request['m']} on {request['hardware']}"
        plot_frontier(front, args.plot, title)
        record["plot"] = args.plot
    if args.output:
        write_json(args.output, record)
    if args.json:
        print(json.dumps(record))
    else:
        print_plan(record)
    return record


def print_plan(record: dict) -> None:
    pred = record["predicted"]
    print(
        f"{record['schedule']} p={record['p']} v={record['v']} m={record['m']} on {record['hardware']}, "
        f"epsilon {record['epsilon']:g} ({record['times']})"
    )
    print("clock per pipeline rank (MHz): " + " ".join(f"{f:g}" for f in record["clocks_mhz"]))
    print(
        f"predicted step: {pred['time_s']:.4g} s, {pred['energy_j']:.4g} J against full clock "
        f"{pred['full_clock_time_s']:.4g} s, {pred['full_clock_energy_j']:.4g} J: saving {pred['saving']:.2%} at "
        f"slowdown {pred['slowdown']:.2%}"
        + ("" if pred["exact"] else f" (best of {pred['search_nodes']} search nodes, not proven optimal)")
    )
    print(
        f"one clock per rank, because {record['why_one_clock_per_rank']}: a clock per action could save at most "
        f"{pred['per_action_bound_saving']:.2%}"
    )
    for row in record.get("frontier", []):
        print(f"  frontier: epsilon {row['epsilon']:<7g} saving {row['saving']:.2%} slowdown {row['slowdown']:.2%}")


def main(argv=None) -> int:
    """`ptd-plan energy` on its own (the tests call it; `ptd-plan` registers `add_parser`)."""
    parser = OneLineParser(prog="ptd-plan energy", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except ConfigError as err:
        print(f"ptd-plan: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
