"""The training loop, `train()`: data -> the parallel step on the mesh -> metrics -> checkpoints.

Each iteration takes the next B samples of the data stream (sample k is a function of the seed and k alone, so
`--train-iters` never moves it), cuts them into the layout's microbatches on a prefetching thread, runs the
jit(shard_map) train step of `parallel/step.py` (or, for comparisons on one device, the reference step), logs loss,
grad norm, throughput, TFLOP/s (model, hardware and the paper's eq. 3) and MFU, evaluates, and saves orbax
checkpoints asynchronously. The loop itself only fetches batches, runs the step and calls hooks (`train/hooks.py`):
the bubble measurement after the first step, the progress bar, logging, evaluation and checkpointing.

Resume (Megatron's): `--load D` continues from D's newest complete step, in any layout, with the iteration, the
consumed samples and the dropout key it saved; `--save D --load D` on an empty D starts fresh (auto-resume).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import jax
import numpy as np

from ptd_jax import model as gpt
from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.data import GPTData, MockData, PerSplit, local_rows, microbatches
from ptd_jax.data.corpus import default_corpus
from ptd_jax.data.loader import prefetch
from ptd_jax.loss_scale import to_meta as loss_scale_meta
from ptd_jax.optimizer import make_optimizer
from ptd_jax.runtime import multiprocess
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.sharding import BATCH_SPEC, param_specs
from ptd_jax.parallel.step import (
    init_sharded_state,
    make_parallel_eval_step,
    make_parallel_train_step,
    pipeline_schedule,
)
from ptd_jax.train import bubble, checkpoint, power
from ptd_jax.perf.hardware import device_peak_tflops
from ptd_jax.perf.memory import check_fits
from ptd_jax.perf.flops import (
    flops_per_iteration,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
)
from ptd_jax.train.guards import SkipCounter, state_is_finite, with_loss_scale
from ptd_jax.train.hooks import Hooks, StepInfo, StepTimer
from ptd_jax.train.interrupt import StopSignals, Terminated
from ptd_jax.train.metrics import MetricsLogger, energy_fields, energy_summary, medians
from ptd_jax.train.reference import init_state, make_eval_step, make_train_step
from ptd_jax.train.resume import check_data_config, resume_point


@dataclass
class RunOptions:
    """Where data comes from and where results go (not part of the algorithm)."""

    data_path: str | tuple[str, ...] | None = None
    """Prefix of a .bin/.idx pair, or a blend's words ("w1", "prefix1", "w2", "prefix2", ...); None (and no
    `train_data_path`, no `mock_data`) = the embedded default corpus."""
    split: str = "969,30,1"
    train_data_path: str | tuple[str, ...] | None = None
    """The train data (a prefix or a blend), used whole instead of `data_path` cut by `split`; with
    `valid_data_path` and `test_data_path` (Megatron's --train-data-path ...)."""
    valid_data_path: str | tuple[str, ...] | None = None
    test_data_path: str | tuple[str, ...] | None = None
    mock_data: bool = False
    """Random tokens of the model's vocabulary, deterministic from the seed, no files (`data/mock.py`)."""
    save: str | None = None
    load: str | None = None
    metrics_file: str | None = None
    plot_dir: str | None = None
    peak_tflops: float | None = None
    progress: bool = True
    reference_step: bool = False
    """Run the single-device reference step instead of the shard_map step (one device only; for comparisons)."""
    keep_checkpoints: int | None = None
    """Keep the newest K steps in `save` (None: all)."""
    load_optim: bool = True
    """False: load the parameters only and start the optimizer afresh (Megatron's --no-load-optim)."""
    finetune: bool = False
    """Load the parameters only and start at iteration 0 with a fresh optimizer and data stream (--finetune)."""
    override_data_config: bool = False
    """Resume even though the data configuration changed (and say what changed)."""
    data_cache_path: str | None = None
    """Where the data's index arrays are cached (default: a cache/ folder beside the data)."""
    async_save: bool = True
    tokenizer: dict | None = None
    """The data's tokenizer (`data.tokenizer`'s describe()), recorded in checkpoints for ptd-generate."""
    poison_steps: tuple[int, ...] = ()
    """Test hook (Python API only): steps whose loss and gradients are made non-finite (`loss_scale.poison`)."""
    measure_bubble: bool | None = None
    """After the first step, time the run's train step at m and the same step at 2m and log the measured bubble
    (`train/bubble.py`); None: when p > 1 and at least `bubble.AUTO_MIN_ITERATIONS` iterations remain."""
    check_memory: bool = True
    """Refuse a run whose predicted memory (`perf.memory.run_memory_bytes`) exceeds a device's, before anything is
    read or written (False: try it anyway)."""
    gpu_clock_plan: str | None = None
    """A plan of `ptd-plan energy --output`: each local GPU's SM clock locked to its pipeline rank's through NVML
    while training, reset on every way out, raised when the step runs slower than (1 + ε) × full clock's
    (`runtime/clocks.py`)."""
    on_record: object = None
    """Called with each logged training record (Python API only: e.g. a notebook's live loss plot)."""


def iteration_flops(model_cfg, parallel, train_cfg, sched=None) -> dict[str, float]:
    """FLOPs of one iteration, all devices: model (no recomputation: TFLOP/s and MFU), hardware (what runs:
    recomputation and the pipeline table's extra work) and the paper's eq. (3) (perf/flops.py)."""
    B = parallel.global_batch_size
    vocab = model_cfg.padded_vocab_size(parallel.tensor_model_parallel_size)  # the logits actually computed
    return {
        "model": model_flops_per_iteration(model_cfg, B, vocab),
        "hardware": hardware_flops_per_iteration(
            model_cfg, B, vocab, train_cfg.recompute_granularity, sched, parallel.pipeline_branching
        ),
        "eq3": flops_per_iteration(model_cfg, B, vocab),
    }


def _log_record(iteration, metrics, step_time, model_cfg, parallel, peak_tflops, num_devices, flops):
    B, s = parallel.global_batch_size, model_cfg.seq_length
    per_device = {k: f / step_time / num_devices / 1e12 for k, f in flops.items()}
    return {
        "kind": "train",
        "iteration": iteration,
        "lm_loss": float(metrics["lm_loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "lr": float(metrics["lr"]),
        "step_time_s": step_time,
        "tokens_per_s": B * s / step_time,
        "tflops_per_device": per_device["model"],  # model FLOPs, no recomputation (as MFU)
        "mfu": per_device["model"] / peak_tflops,
        "hardware_tflops_per_device": per_device["hardware"],
        "eq3_tflops_per_device": per_device["eq3"],
    }


def train(
    model_cfg: ModelConfig, parallel: ParallelConfig, train_cfg: TrainConfig, options: RunOptions | None = None
) -> dict:
    """Train on the mesh of `parallel` (the shard_map step) and return a summary dict (the CLI's last line).

    1. Refuse what cannot run, before data or devices are touched: the layout, the memory estimate
       (`perf.memory.check_fits`, the message ptd-train gives; `RunOptions.check_memory=False` skips it), the
       resume point.
    2. Open the data, build or restore the state, make the train and eval steps (`_prepare`).
    3. Say what runs: the layout, the pipeline table, the FLOPs per iteration (`_announce`).
    4. Loop: fetch a batch, run the step, call the hooks (`_loop`, `_hooks`).
    5. Summarise: medians over the timed records (`_summary`)."""
    options = options or RunOptions()
    parallel.check_model(model_cfg)
    plan = power.read_clock_plan(options.gpu_clock_plan, parallel)
    if options.check_memory:
        check_fits(
            model_cfg, parallel, train_cfg.recompute_granularity, jax.local_devices()[0], jax.local_device_count()
        )
    run, progress = _prepare(model_cfg, parallel, train_cfg, options)
    _announce(run)
    timer = StepTimer(jax.block_until_ready, meter=power.JobMeter.open(run.mesh))
    # the clocks are locked before the first step and reset on every way out
    with power.gpu_clocks(run.mesh, plan, run.logger.message) as governor:
        hooks = _hooks(run, progress, timer)
        if governor is not None:
            hooks.add_hook(
                lambda info: power.govern(governor, progress.records[-1]), every=run.train_cfg.log_interval, final=True
            )
        _loop(run, progress, hooks, timer)
    summary = _summary(run, progress, timer)
    if governor is not None:
        summary["gpu_clock_events"] = governor.events
    return summary


@dataclass(frozen=True)
class _Run:
    """One run's fixed parts, built once by `_prepare`: configs, data, mesh, steps, logger, checkpointer, and where
    it starts. What changes as it goes is its `_Progress`."""

    model_cfg: ModelConfig
    parallel: ParallelConfig
    train_cfg: TrainConfig
    options: RunOptions
    data: GPTData
    mesh: object
    optimizer: object
    train_step: object
    eval_step: object
    logger: MetricsLogger
    saver: object
    """The checkpointer (`checkpoint.Checkpointer`), None without --save."""
    dropout_key: object
    start: int
    """The iteration the run starts from (0, or a resumed checkpoint's)."""
    consumed: int
    """Samples the stream had given out at `start`."""
    primary: bool
    """Process 0: the one that prints and writes metrics."""
    num_params: int
    ranks: list
    """This process's data ranks: it reads only their rows (`rows`), and the global arrays are assembled from them."""
    rows: object
    sched: object
    """The pipeline's schedule table, None without pipelining."""
    flops: dict
    peak: float
    peak_source: str
    device_kind: str

    def to_devices(self, batch):
        """The batch cut into microbatches and, for the shard_map step, assembled into global arrays from this
        process's data ranks."""
        cut = microbatches(batch, self.parallel, len(self.ranks))
        if self.options.reference_step:
            return cut
        return tuple(multiprocess.global_batch(self.mesh, x, self.ranks, BATCH_SPEC) for x in cut)

    def batch_of(self, iteration):
        """The next B samples of the stream, whatever the run's length."""
        B = self.parallel.global_batch_size
        return self.to_devices(self.data.train_samples(self.consumed + (iteration - self.start) * B, B, self.rows))

    def save(self, state, done: int) -> None:
        consumed = self.consumed + (done - self.start) * self.parallel.global_batch_size
        meta = checkpoint.run_meta(
            self.model_cfg,
            self.parallel,
            self.train_cfg,
            consumed_samples=consumed,
            rng_key=self.dropout_key,
            data_config=self.data.data_config(),
            tokenizer=self.options.tokenizer,
        )
        if not bool(state_is_finite(state)):  # the guards keep this from happening; never write it if it does
            self.logger.message(
                f"ptd_jax: not saving iteration {done}: the parameters or optimizer state are not finite"
            )
            return
        self.saver.save(done, state, {**meta, "loss_scale": loss_scale_meta(state.get("loss_scale"))})


@dataclass
class _Progress:
    """What changes as the run goes: the training state, the last iteration done, the log records, and what the
    hooks found."""

    state: dict
    done: int
    skips: SkipCounter
    records: list = field(default_factory=list)
    first_loss: float | None = None
    exit_reason: str | None = None
    measured_bubble: dict | None = None


def _prepare(model_cfg, parallel, train_cfg, options) -> tuple[_Run, _Progress]:
    """The data, the state (fresh or restored), the steps and the logger; refusals come first."""
    messages: list[str] = []
    resume = resume_point(options, model_cfg, train_cfg, messages)  # refusals first: before data or devices
    data = _open_data(model_cfg, parallel, train_cfg, options)
    if resume is not None and not options.finetune:
        check_data_config(options, resume[0], resume[1]["data"], data.data_config(), messages)
    optimizer = make_optimizer(train_cfg)
    mesh = make_mesh(parallel)
    state, dropout_key, start, consumed = _initial_state(
        model_cfg, parallel, train_cfg, options, optimizer, mesh, resume, messages
    )
    train_step, eval_step = _steps(model_cfg, parallel, train_cfg, options, optimizer, mesh, state)
    primary = jax.process_index() == 0  # only process 0 prints and writes metrics
    device = jax.local_devices()[0]
    peak, peak_source = device_peak_tflops(
        device.device_kind, model_cfg.dtype in ("bfloat16", "float16"), options.peak_tflops, jax.local_device_count()
    )
    if data.valid is None and train_cfg.eval_iters > 0 and primary:
        print(
            f"ptd_jax: warning: the validation split of {data.name} is empty (split={options.split}); "
            f"no validation loss will be reported",
            file=sys.stderr,
        )
    ranks = multiprocess.local_data_ranks(mesh)
    logger = MetricsLogger(
        train_cfg.train_iters,
        start_iter=start,
        quiet=not primary,
        metrics_file=options.metrics_file if primary else None,
        progress=options.progress and primary,
    )
    for text in messages:
        logger.message(text)
    sched = pipeline_schedule(parallel) if parallel.pipeline_model_parallel_size > 1 else None
    saver = None
    if options.save:
        saver = checkpoint.Checkpointer(
            options.save,
            optimizer=optimizer,
            model_cfg=model_cfg,
            parallel=parallel,
            keep=options.keep_checkpoints,
            async_save=options.async_save,
            mesh=mesh,
        )
    run = _Run(
        model_cfg,
        parallel,
        train_cfg,
        options,
        data,
        mesh,
        optimizer,
        train_step,
        eval_step,
        logger,
        saver,
        dropout_key,
        start,
        consumed,
        primary,
        num_params=gpt.count_params(state["params"]),
        ranks=ranks,
        rows=None if len(ranks) == parallel.data_parallel_size else local_rows(parallel, ranks),
        sched=sched,
        flops=iteration_flops(model_cfg, parallel, train_cfg, sched),
        peak=peak,
        peak_source=peak_source,
        device_kind=device.device_kind,
    )
    return run, _Progress(state, start, SkipCounter(train_cfg.max_skipped_iters))


def _open_data(model_cfg, parallel, train_cfg, options) -> GPTData:
    """The sample streams of --data-path, the per-split paths or --mock-data; the embedded corpus by default."""
    if options.mock_data:
        source = MockData()
    elif options.train_data_path:
        source = PerSplit(options.train_data_path, options.valid_data_path, options.test_data_path)
    else:
        source = options.data_path or default_corpus(progress=options.progress)
    return GPTData(
        source,
        seq_length=model_cfg.seq_length,
        global_batch_size=parallel.global_batch_size,
        eval_iters=train_cfg.eval_iters,
        seed=train_cfg.seed,
        split=options.split,
        vocab_size=model_cfg.vocab_size,
        cache_dir=options.data_cache_path,
    )


def _initial_state(model_cfg, parallel, train_cfg, options, optimizer, mesh, resume, messages):
    """(state, dropout key, start iteration, consumed samples): fresh, or restored from `resume` = (step, meta)."""
    init_key, dropout_key = jax.random.split(jax.random.key(train_cfg.seed))
    if options.reference_step:
        if parallel.num_devices != 1:
            raise ConfigError(f"the reference step runs on one device, not num_devices={parallel.num_devices}")
        state = init_state(init_key, model_cfg, optimizer, train_cfg)
    else:  # a full restore needs only the shapes and shardings: no second copy of the state on the devices
        restoring_all = resume is not None and options.load_optim and not options.finetune
        state = init_sharded_state(
            init_key, model_cfg, optimizer, mesh, parallel, shapes_only=restoring_all, train_cfg=train_cfg
        )
    if resume is None:
        return state, dropout_key, 0, 0
    load_step, meta = resume
    start, consumed = 0, 0
    if not options.finetune:
        start, consumed = meta["iteration"], meta["consumed_samples"]
        dropout_key = jax.random.wrap_key_data(np.asarray(meta["rng_key"], np.uint32))
    load_optim = options.load_optim and not options.finetune
    fresh_at = None if load_optim else 0 if options.finetune else checkpoint.schedule_step(meta)
    state = checkpoint.set_step(
        checkpoint.restore(
            options.load,
            load_step,
            state,
            optimizer=optimizer,
            model_cfg=model_cfg,
            parallel=parallel,
            mesh=mesh,
            fresh_optimizer_at=fresh_at,
        ),
        start,
        mesh,
    )
    state = with_loss_scale(state, meta if load_optim else None, model_cfg, train_cfg, mesh)
    messages.append(
        f"ptd_jax: {'fine-tuning from' if options.finetune else 'resuming from'} iteration "
        f"{meta['iteration']} of {options.load} (consumed samples {meta['consumed_samples']}"
        f"{'' if load_optim else '; optimizer state not loaded'})"
    )
    return state, dropout_key, start, consumed


def _steps(model_cfg, parallel, train_cfg, options, optimizer, mesh, state):
    """(train_step, eval_step): the shard_map steps, or the single-device reference ones."""
    if options.reference_step:
        return (
            make_train_step(model_cfg, train_cfg, optimizer, poison_steps=options.poison_steps),
            make_eval_step(model_cfg),
        )
    train_step = make_parallel_train_step(
        mesh, model_cfg, parallel, train_cfg, optimizer, state, poison_steps=options.poison_steps
    )
    pipelined = parallel.pipeline_model_parallel_size > 1
    return train_step, make_parallel_eval_step(mesh, model_cfg, parallel, param_specs(state["params"], pipelined))


def _announce(run: _Run) -> None:
    model_cfg, parallel, sched, flops = run.model_cfg, run.parallel, run.sched, run.flops
    run.logger.message(
        f"ptd_jax: {run.num_params / 1e6:.2f}M parameters, layout "
        f"d={parallel.data_parallel_size} p={parallel.pipeline_model_parallel_size} "
        f"t={parallel.tensor_model_parallel_size}, B={parallel.global_batch_size} b={parallel.micro_batch_size} "
        f"m={parallel.num_microbatches}, {model_cfg.dtype}, attention {model_cfg.attention_backend}, fused "
        f"LayerNorm/loss kernels {'on' if model_cfg.fused_kernels else 'off'}, peak {run.peak:.3g} TFLOP/s/device "
        f"({run.peak_source}), data {run.data.name}"
    )
    if sched is not None:
        sim = sched.simulate()
        formula, w = sched.formula_bubble(), f", in flight F to W {sched.peak_in_flight}" if sched.split else ""
        formula = "no closed form" if formula is None else f"formula {formula:.3f}"
        run.logger.message(
            f"pipeline: {sched.name} p={sched.p} v={sched.v} m={sched.m}: {sched.ticks} ticks, "
            f"simulated bubble {sim['bubble_fraction']:.3f} ({formula}), "
            f"peak stash per rank {sched.peak_stash}{w}; measured bubble: after the first step"
        )
    run.logger.message(
        f"FLOPs per iteration: model {flops['model']:.3g} (TFLOP/s and MFU), hardware "
        f"{flops['hardware']:.3g} ({flops['hardware'] / flops['model']:.2f}x: recompute="
        f"{run.train_cfg.recompute_granularity}{', the pipeline table' if sched else ''}), paper eq. "
        f"(3) {flops['eq3']:.3g}"
    )


def _hooks(run: _Run, progress: _Progress, timer: StepTimer) -> Hooks:
    """After each step, in this order: the bubble measurement (after the first), the progress bar, the log record,
    the validation loss, the checkpoint."""
    cfg = run.train_cfg
    hooks = Hooks()
    hooks.add_hook(lambda info: _after_first_step(run, progress, info), first=True)
    hooks.add_hook(lambda info: run.logger.advance(), every=1)
    hooks.add_hook(lambda info: _log(run, progress, timer, info), every=cfg.log_interval, final=True)
    if run.data.valid is not None:
        hooks.add_hook(lambda info: _evaluate(run, info), every=cfg.eval_interval, final=True)
    if run.data.test is not None:  # Megatron's test evaluation, once, when training ends
        hooks.add_hook(lambda info: _evaluate(run, info, "test"), final=True)
    if run.saver is not None:
        hooks.add_hook(
            lambda info: run.save(info.state, info.iteration), every=cfg.save_interval, final=True, exiting=True
        )
    return hooks


def _after_first_step(run: _Run, progress: _Progress, info: StepInfo) -> None:
    progress.first_loss = float(info.metrics["lm_loss"])
    # a failure (in any process) skips the measurement with one line, in every process alike
    progress.measured_bubble = bubble.after_first_step(
        run.options.measure_bubble,
        run.train_step,
        info.state,
        info.batch,
        run.dropout_key,
        bubble.StepBuild(run.mesh, run.model_cfg, run.parallel, run.train_cfg, run.optimizer),
        run.train_cfg.train_iters - run.start,
        run.logger.message,
    )


def _log(run: _Run, progress: _Progress, timer: StepTimer, info: StepInfo) -> None:
    step_time, includes_compile = timer.lap(info.metrics)
    record = _log_record(
        info.iteration,
        info.metrics,
        step_time,
        run.model_cfg,
        run.parallel,
        run.peak,
        run.parallel.num_devices,
        run.flops,
    )
    record["includes_compile"] = includes_compile
    tokens = run.parallel.global_batch_size * run.model_cfg.seq_length
    record.update(energy_fields(timer.window, tokens, timer.meter.source if timer.meter else "unavailable"))
    record["skipped_iters"], record["loss_scale"] = progress.skips.take_window(), float(info.metrics["loss_scale"])
    progress.records.append(record)
    run.logger.log_train(
        record, consumed_samples=run.consumed + (info.iteration - run.start) * run.parallel.global_batch_size
    )
    if run.options.on_record is not None:
        run.options.on_record(record)


def _evaluate(run: _Run, info: StepInfo, kind: str = "valid") -> None:
    """The mean lm loss of `eval_iters` batches: of the validation stream, evaluation k = (iteration − 1) //
    eval_interval taking its k-th group of batches (the stream moves on, as Megatron's valid iterator does, and a
    resumed run picks up where it was), or of the test stream's first batches."""
    if kind == "valid":
        interval = run.train_cfg.eval_interval
        batches = run.data.valid_batches(run.rows, (info.iteration - 1) // interval if interval else 0)
    else:
        batches = run.data.test_batches(run.rows)
    losses = [float(run.eval_step(info.state["params"], *run.to_devices(b))) for b in batches]
    loss = float(np.mean(losses)) if losses else None
    run.logger.log_eval(
        {"kind": kind, "iteration": info.iteration, f"{kind}_lm_loss": loss, f"{kind}_ppl": math.exp(min(loss, 50))}
    )


def _loop(run: _Run, progress: _Progress, hooks: Hooks, timer: StepTimer) -> None:
    """Fetch a batch, run the step, call the hooks, until train_iters or an --exit-interval stop. Ctrl-C and a
    stop the processes agreed on end it after the current step with KeyboardInterrupt (saying where), SIGTERM in a
    one-process run with `Terminated` (exit 143, `train/interrupt.py`); the prefetcher, the checkpointer (its last
    write) and the logger are closed whatever happens."""
    cfg = run.train_cfg
    batches = prefetch(run.batch_of, range(run.start, cfg.train_iters))
    stop = StopSignals()
    try:
        for iteration, batch in zip(range(run.start, cfg.train_iters), batches):
            _stop_if_asked(run, progress, stop, iteration)
            progress.state, metrics = run.train_step(progress.state, *batch, run.dropout_key)
            progress.skips.add(bool(metrics["skipped"]), iteration + 1, float(metrics["loss_scale"]))
            first = timer.step_done(metrics)
            progress.done = done = iteration + 1
            exiting = bool(cfg.exit_interval) and done % cfg.exit_interval == 0
            hooks.run(StepInfo(done, progress.state, metrics, batch, first, done == cfg.train_iters, exiting))
            if exiting and done < cfg.train_iters:  # Megatron's --exit-interval
                progress.exit_reason = f"exit_interval={cfg.exit_interval}"
                run.logger.message(f"ptd_jax: exiting at iteration {done} ({progress.exit_reason})")
                break
            timer.exclude_hooks()
        if stop.requested:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted = True
    except Exception as err:  # a dead process: exit now, waiting for nothing (`exit_if_peer_failed`)
        multiprocess.exit_if_peer_failed(err, "ptd-train")
        raise
    else:
        interrupted = False
    finally:  # the handlers stay until the last save is written: a second SIGTERM must not end it
        try:
            _close(batches, run.saver, run.logger)
        finally:
            stop.restore()
    if interrupted:
        newest = checkpoint.latest_step(run.options.save) if run.options.save else None
        kept = f"newest checkpoint: step {newest} in {run.options.save}" if newest is not None else "no checkpoint"
        if stop.terminated:  # one line, then exit 143
            raise Terminated.after(f"after iteration {progress.done}; {kept}", run.primary)
        raise KeyboardInterrupt(f"after iteration {progress.done}; {kept}")


def _stop_if_asked(run: _Run, progress: _Progress, stop: StopSignals, iteration: int) -> None:
    """Between steps (a checkpoint being written is finished first): several processes stop together on a SIGTERM
    at the step they agreed on, one process on its own SIGTERM, saving it unless it was just saved (a preempted run
    resumes from there); Ctrl-C."""
    if multiprocess.stop_agreed(iteration) or stop.terminated:
        interval = run.train_cfg.save_interval
        done = progress.done
        if run.saver and done > run.start and not (interval and done % interval == 0):
            run.save(progress.state, done)
        raise KeyboardInterrupt
    if stop.requested:
        raise KeyboardInterrupt


def _close(batches, saver, logger) -> None:
    try:
        batches.close()
    finally:
        try:
            if saver:
                saver.close()  # waits for the last asynchronous write: every step listed is complete
        finally:
            logger.close()


def _summary(run: _Run, progress: _Progress, timer: StepTimer) -> dict:
    """The run's summary (the CLI's last stdout line): throughput figures are medians over the logged windows
    that do not include compilation."""
    logger, flops = run.logger, run.flops
    summary = {
        "iterations": progress.done - run.start,
        "start_iteration": run.start,
        "last_iteration": progress.done,
        "exit_reason": progress.exit_reason,
        "num_params": run.num_params,
        "wall_time_s": timer.wall_time(),
        "compile_time_s": timer.compile_time,
        "first_lm_loss": progress.first_loss,
        "final_lm_loss": progress.records[-1]["lm_loss"] if progress.records else None,
        "final_valid_lm_loss": logger.eval_records[-1]["valid_lm_loss"] if logger.eval_records else None,
        "test_lm_loss": logger.test_record["test_lm_loss"] if logger.test_record else None,
        **medians(progress.records),
        **energy_summary(progress.records),
        "hardware_over_model_flops": flops["hardware"] / flops["model"],
        "peak_tflops": run.peak,
        "peak_source": run.peak_source,
        "device": run.device_kind,
        "num_devices": run.parallel.num_devices,
        "attention_backend": run.model_cfg.attention_backend,
        "fused_kernels": run.model_cfg.fused_kernels,
        "skipped_iters": progress.skips.total,
        "measured_bubble": progress.measured_bubble,
    }
    if run.options.plot_dir and run.primary:
        summary["plot"] = logger.plot(run.options.plot_dir)
    return summary
