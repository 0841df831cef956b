"""`ptd-train --pipeline-schedule auto`: resolve "auto" to the schedule with the shortest simulated step
(`ptd_jax/parallel/pipeline/choose.py`) before the ParallelConfig is built, print the choice and the alternatives,
and give ZB-V its two chunks per rank (v = 2) when --num-layers-per-virtual-pipeline-stage is not set."""

from __future__ import annotations

from ptd_jax.cli.args import positive_float
from ptd_jax.config import SCHEDULE_SPECS
from ptd_jax.parallel.pipeline.choose import CANDIDATES, choose_schedule, format_choice
from ptd_jax.parallel.pipeline.schedule import ScheduleError
from ptd_jax.runtime import multiprocess


def add_args(g) -> None:
    g.add_argument(
        "--schedule-times",
        type=positive_float,
        nargs=3,
        metavar=("F", "B", "W"),
        help="--pipeline-schedule auto: a stage's forward, input-gradient and weight-gradient times, "
        "e.g. measured (default: the ratios of their FLOPs in this model; 1 1 1 is the zero-bubble "
        "paper's assumption)",
    )


def model_times(cfg, recompute: str) -> tuple[float, float, float]:
    """F : B : W of one layer from the FLOPs it executes (`train.flops`), F = 1: B is the backward but the kernels'
    gradients (with what `recompute` recomputes), W those."""
    from ptd_jax.train.flops import layer_executed_flops, layer_matmul_flops

    f, backward = layer_executed_flops(cfg, cfg.seq_length, recompute)
    w = layer_matmul_flops(cfg, cfg.seq_length)
    return 1.0, (backward - w) / f, w / f


def microbatches(args, num_devices: int) -> int | None:
    """m = B / (b · d) with d = devices / (t · p), as `ParallelConfig.for_devices`; None where that does not
    divide (the ParallelConfig names the problem)."""
    tp = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if tp < 1 or num_devices % tp or args.micro_batch_size is None or args.micro_batch_size < 1:
        return None
    per_step = args.micro_batch_size * (num_devices // tp)
    if per_step < 1 or args.global_batch_size % per_step or args.global_batch_size < per_step:
        return None
    return args.global_batch_size // per_step


def choices(args, num_layers: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(v_options, names) allowed by the layers and --num-layers-per-virtual-pipeline-stage: chunked schedules
    (interleaved, ZB-V at v = 2) only where the layers split into v·p equal chunks; no schedule on unit ticks under
    --pipeline-branching uniform (they run per-rank only)."""
    p, k = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    uniform = args.pipeline_branching == "uniform"
    names = tuple(n for n in CANDIDATES if not (uniform and SCHEDULE_SPECS[n].rows == "unit"))
    if k is None:
        return ((2,) if num_layers % (2 * p) == 0 else ()), names
    if k < 1 or num_layers % (k * p):
        return (), ("1f1b",)  # the ParallelConfig refuses k with its own message
    v = num_layers // (k * p)
    if v == 1:
        return (), names
    return (v,), tuple(n for n in names if SCHEDULE_SPECS[n].chunks in (None, v))


def memory_estimate(args, model_cfg, num_devices: int, recompute: str, build_parallel):
    """`memory` for `choose_schedule`: the bytes per GPU `perf.memory.memory_per_gpu` predicts for the run with that
    schedule (inf where the layout is invalid)."""
    from ptd_jax.config import ConfigError
    from ptd_jax.perf.memory import memory_per_gpu

    def estimate(name: str, v: int, sched) -> float:
        try:
            return memory_per_gpu(
                model_cfg, build_parallel(_trial(args, model_cfg, name, v), model_cfg, num_devices), recompute
            )["total"]
        except ConfigError:
            return float("inf")

    return estimate


def _trial(args, model_cfg, name: str, v: int):
    """A copy of the flags with the schedule (and its chunks) set."""
    import copy

    trial = copy.copy(args)
    trial.pipeline_schedule = name
    if v > 1:
        trial.num_layers_per_virtual_pipeline_stage = model_cfg.num_layers // (v * args.pipeline_model_parallel_size)
    return trial


def memory_check(args, model_cfg, num_devices: int, recompute: str, device, num_local_devices: int, build_parallel):
    """`memory_ok` for `choose_schedule`: whether the run with that schedule passes `perf.memory.check_fits` on
    `device` (the same estimate ptd-train refuses by); `build_parallel(args, model_cfg, num_devices)` makes the
    ParallelConfig from a copy of the flags with the schedule (and its chunks) set."""
    from ptd_jax.config import ConfigError
    from ptd_jax.perf.memory import check_fits

    def ok(name: str, v: int, sched) -> bool:
        try:
            check_fits(
                model_cfg,
                build_parallel(_trial(args, model_cfg, name, v), model_cfg, num_devices),
                recompute,
                device,
                num_local_devices,
            )
        except ConfigError:
            return False
        return True

    return ok


def resolve(args, model_cfg, num_devices: int, primary_only: bool = False, memory_ok=None, memory=None) -> str | None:
    """Replace "auto" in `args.pipeline_schedule` by the chosen schedule (and set the layers per chunk for a
    chunked one) among those `memory_ok` accepts (`memory_check`; None: all); for ZB-V without
    --num-layers-per-virtual-pipeline-stage set v = 2. Returns the printed block
    (`format_choice`), or None when nothing was chosen. `primary_only`: print in process 0 only (JAX started)."""
    p, text, num_layers = args.pipeline_model_parallel_size, None, model_cfg.num_layers
    if args.pipeline_schedule == "auto":
        m = microbatches(args, num_devices)
        v_options, names = choices(args, num_layers)
        times = tuple(args.schedule_times or model_times(model_cfg, args.recompute_granularity))
        name, v, rows = "1f1b", 1, []  # where nothing is valid: the ParallelConfig says why
        if m is not None:
            try:
                name, v, rows = choose_schedule(
                    p, None, m, times, memory_ok, v_options=v_options, names=names, memory=memory
                )
            except ScheduleError:
                pass
        args.pipeline_schedule = name
        if v > 1 and args.num_layers_per_virtual_pipeline_stage is None:
            args.num_layers_per_virtual_pipeline_stage = num_layers // (v * p)
        if rows:
            text = format_choice(name, rows, times)
            if not primary_only or multiprocess.is_primary():
                print(text, flush=True)
    chunks = SCHEDULE_SPECS[args.pipeline_schedule].chunks if args.pipeline_schedule in SCHEDULE_SPECS else None
    if (
        chunks
        and chunks > 1
        and args.num_layers_per_virtual_pipeline_stage is None
        and p >= 1
        and num_layers % (chunks * p) == 0
    ):
        args.num_layers_per_virtual_pipeline_stage = num_layers // (chunks * p)
    return text
