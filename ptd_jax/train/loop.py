"""The training loop, `train()`: data -> the parallel step on the mesh -> metrics -> checkpoints.

Each iteration takes the next B samples of the data stream (sample k is a function of the seed and k alone, so
`--train-iters` never moves it), cuts them into the layout's microbatches on a prefetching thread, runs the
jit(shard_map) train step of `parallel/step.py` (or, for comparisons on one device, the reference step), logs loss,
grad norm, throughput, TFLOP/s (model, hardware and the paper's eq. 3) and MFU, evaluates, and saves orbax checkpoints asynchronously.

Resume (Megatron's): `--load D` continues from D's newest complete step, in any layout, with the iteration, the
consumed samples and the dropout key it saved; `--save D --load D` on an empty D starts fresh (auto-resume).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from ptd_jax import model as gpt
from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.data import GPTData, local_rows, microbatches
from ptd_jax.data.corpus import default_corpus
from ptd_jax.data.loader import prefetch
from ptd_jax.loss_scale import to_meta as loss_scale_meta
from ptd_jax.optimizer import make_optimizer
from ptd_jax.runtime import multiprocess
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.sharding import BATCH_SPEC, param_specs
from ptd_jax.parallel.step import (init_sharded_state, make_parallel_eval_step, make_parallel_train_step,
                                   pipeline_schedule)
from ptd_jax.train import bubble, checkpoint
from ptd_jax.train.flops import (device_peak_tflops, flops_per_iteration, hardware_flops_per_iteration,
                                 model_flops_per_iteration)
from ptd_jax.train.guards import SkipCounter, state_is_finite, with_loss_scale
from ptd_jax.train.metrics import MetricsLogger
from ptd_jax.train.reference import init_state, make_eval_step, make_train_step


@dataclass
class RunOptions:
    """Where data comes from and where results go (not part of the algorithm)."""

    data_path: str | None = None
    """Prefix of a .bin/.idx pair; None = the embedded default corpus."""
    split: str = "969,30,1"
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
    on_record: object = None
    """Called with each logged training record (Python API only: e.g. a notebook's live loss plot)."""


def iteration_flops(model_cfg, parallel, train_cfg, sched=None) -> dict[str, float]:
    """FLOPs of one iteration, all devices: model (no recomputation: TFLOP/s and MFU), hardware (what runs:
    recomputation and the pipeline table's extra work) and the paper's eq. (3) (train/flops.py)."""
    B = parallel.global_batch_size
    vocab = model_cfg.padded_vocab_size(parallel.tensor_model_parallel_size)  # the logits actually computed
    return {"model": model_flops_per_iteration(model_cfg, B, vocab),
            "hardware": hardware_flops_per_iteration(model_cfg, B, vocab, train_cfg.recompute_granularity, sched,
                                                     parallel.pipeline_branching),
            "eq3": flops_per_iteration(model_cfg, B, vocab)}


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


def train(model_cfg: ModelConfig, parallel: ParallelConfig, train_cfg: TrainConfig,
          options: RunOptions | None = None) -> dict:
    """Train on the mesh of `parallel` (the shard_map step) and return a summary dict (the CLI's last line)."""
    options = options or RunOptions()
    parallel.check_model(model_cfg)
    messages: list[str] = []
    resume = _resume_point(options, model_cfg, train_cfg, messages)  # refusals first: before data or devices
    data_path = options.data_path or default_corpus(progress=options.progress)
    data = GPTData(data_path, seq_length=model_cfg.seq_length, global_batch_size=parallel.global_batch_size,
                   eval_iters=train_cfg.eval_iters, seed=train_cfg.seed, split=options.split,
                   vocab_size=model_cfg.vocab_size, cache_dir=options.data_cache_path)

    if resume is not None and not options.finetune:
        _check_data_config(options, resume[0], resume[1]["data"], data.data_config(), messages)
    optimizer = make_optimizer(train_cfg)
    init_key, dropout_key = jax.random.split(jax.random.key(train_cfg.seed))
    mesh = make_mesh(parallel)
    if options.reference_step:
        if parallel.num_devices != 1:
            raise ConfigError(f"the reference step runs on one device, not num_devices={parallel.num_devices}")
        state = init_state(init_key, model_cfg, optimizer, train_cfg)
    else:  # a full restore needs only the shapes and shardings: no second copy of the state on the devices
        restoring_all = resume is not None and options.load_optim and not options.finetune
        state = init_sharded_state(init_key, model_cfg, optimizer, mesh, parallel, shapes_only=restoring_all,
                                   train_cfg=train_cfg)
    start, consumed = 0, 0
    if resume is not None:
        load_step, meta = resume
        if not options.finetune:
            start, consumed = meta["iteration"], meta["consumed_samples"]
            dropout_key = jax.random.wrap_key_data(np.asarray(meta["rng_key"], np.uint32))
        load_optim = options.load_optim and not options.finetune
        state = checkpoint.set_step(
            checkpoint.restore(options.load, load_step, state, optimizer=optimizer, model_cfg=model_cfg,
                               parallel=parallel, mesh=mesh, load_optim=load_optim, iteration=start), start, mesh)
        state = with_loss_scale(state, meta if load_optim else None, model_cfg, train_cfg, mesh)
        messages.append(f"ptd_jax: {'fine-tuning from' if options.finetune else 'resuming from'} iteration "
                        f"{meta['iteration']} of {options.load} (consumed samples {meta['consumed_samples']}"
                        f"{'' if load_optim else '; optimizer state not loaded'})")
    num_params = gpt.count_params(state["params"])

    if options.reference_step:
        train_step = make_train_step(model_cfg, train_cfg, optimizer, poison_steps=options.poison_steps)
        eval_step = make_eval_step(model_cfg)
    else:
        train_step = make_parallel_train_step(mesh, model_cfg, parallel, train_cfg, optimizer, state,
                                              poison_steps=options.poison_steps)
        pipelined = parallel.pipeline_model_parallel_size > 1
        eval_step = make_parallel_eval_step(mesh, model_cfg, parallel, param_specs(state["params"], pipelined))
    device = jax.local_devices()[0]
    num_devices = parallel.num_devices
    peak, peak_source = device_peak_tflops(device.device_kind, model_cfg.dtype in ("bfloat16", "float16"),
                                           options.peak_tflops, jax.local_device_count())
    primary = jax.process_index() == 0  # only process 0 prints and writes metrics
    if data.valid is None and train_cfg.eval_iters > 0 and primary:
        print(f"ptd_jax: warning: the validation split of {data_path} is empty (split={options.split}); "
              f"no validation loss will be reported", file=sys.stderr)

    # each process reads only its data ranks' rows, and the global arrays are assembled from them
    ranks = multiprocess.local_data_ranks(mesh)
    rows = None if len(ranks) == parallel.data_parallel_size else local_rows(parallel, ranks)

    def to_devices(batch):
        cut = microbatches(batch, parallel, len(ranks))
        return cut if options.reference_step else tuple(multiprocess.global_batch(mesh, x, ranks, BATCH_SPEC)
                                                        for x in cut)

    def evaluate(params):
        losses = [float(eval_step(params, *to_devices(b))) for b in data.valid_batches(rows)]
        return float(np.mean(losses)) if losses else None

    logger = MetricsLogger(train_cfg.train_iters, start_iter=start, metrics_file=options.metrics_file if primary
                           else None, progress=options.progress and primary, quiet=not primary)
    for text in messages:
        logger.message(text)
    logger.message(f"ptd_jax: {num_params / 1e6:.2f}M parameters, layout d={parallel.data_parallel_size} "
                   f"p={parallel.pipeline_model_parallel_size} t={parallel.tensor_model_parallel_size}, "
                   f"B={parallel.global_batch_size} b={parallel.micro_batch_size} m={parallel.num_microbatches}, "
                   f"{model_cfg.dtype}, attention {model_cfg.attention_backend}, fused LayerNorm/loss kernels "
                   f"{'on' if model_cfg.fused_kernels else 'off'}, peak {peak:.3g} TFLOP/s/device ({peak_source}), "
                   f"data {data_path}")
    sched = pipeline_schedule(parallel) if parallel.pipeline_model_parallel_size > 1 else None
    if sched is not None:
        sim = sched.simulate()
        logger.message(f"pipeline: {sched.name} p={sched.p} v={sched.v} m={sched.m}: {sched.ticks} lockstep ticks, "
                       f"simulated bubble {sim['bubble_fraction']:.3f} (paper (p-1)/(v*m) = "
                       f"{sched.formula_bubble():.3f}), peak stash per rank {sched.peak_stash}; measured bubble: after "
                       f"the first step, if measured (train/bubble.py)")
    flops = iteration_flops(model_cfg, parallel, train_cfg, sched)
    logger.message(f"FLOPs per iteration: model {flops['model']:.3g} (TFLOP/s and MFU), hardware "
                   f"{flops['hardware']:.3g} ({flops['hardware'] / flops['model']:.2f}x: recompute="
                   f"{train_cfg.recompute_granularity}{', the pipeline table' if sched else ''}), paper eq. (3) "
                   f"{flops['eq3']:.3g}")
    B = parallel.global_batch_size

    def batch_of(iteration):  # the next B samples of the stream, whatever the run's length
        return to_devices(data.train_samples(consumed + (iteration - start) * B, B, rows))

    def save(done):
        meta = checkpoint.run_meta(model_cfg, parallel, train_cfg, consumed_samples=consumed + (done - start) * B,
                                   rng_key=dropout_key, data_config=data.data_config(), tokenizer=options.tokenizer)
        if not bool(state_is_finite(state)):  # the guards keep this from happening; never write it if it does
            logger.message(f"ptd_jax: not saving iteration {done}: the parameters or optimizer state are not finite")
            return
        saver.save(done, state, {**meta, "loss_scale": loss_scale_meta(state.get("loss_scale"))})

    saver = (checkpoint.Checkpointer(options.save, optimizer=optimizer, model_cfg=model_cfg, parallel=parallel,
                                     keep=options.keep_checkpoints, async_save=options.async_save, mesh=mesh)
             if options.save else None)
    wall_start = time.perf_counter()
    records, compile_time = [], None
    window_start, window_iters = time.perf_counter(), 0
    first_loss, done, exit_reason, measured_bubble = None, start, None, None
    batches = prefetch(batch_of, range(start, train_cfg.train_iters))
    skips = SkipCounter(train_cfg.max_skipped_iters)
    ctrl_c = _CtrlC()
    try:
        for iteration, batch in zip(range(start, train_cfg.train_iters), batches):
            if multiprocess.stop_agreed(iteration):  # several processes: a SIGTERM, all stop at this step
                if saver and done > start and not (train_cfg.save_interval and done % train_cfg.save_interval == 0):
                    save(done)  # a preempted run resumes from here
                raise KeyboardInterrupt
            if ctrl_c.requested:  # checked between steps: a checkpoint being written is finished first
                raise KeyboardInterrupt
            state, metrics = train_step(state, *batch, dropout_key)
            skips.add(bool(metrics["skipped"]), iteration + 1, float(metrics["loss_scale"]))
            window_iters += 1
            if compile_time is None:  # the first step includes compilation: time it apart
                jax.block_until_ready(metrics)
                compile_time = time.perf_counter() - window_start
                first_loss = float(metrics["lm_loss"])
                try:  # a second copy of the state and the step at 2m: it may not fit where the run does
                    measured_bubble = bubble.after_first_step(
                        options.measure_bubble, train_step, state, batch, dropout_key, mesh, model_cfg, parallel,
                        train_cfg, optimizer, train_cfg.train_iters - done, logger.message)
                except Exception as err:  # noqa: BLE001 - a measurement, never a reason to stop training
                    logger.message(f"pipeline: measured bubble skipped ({type(err).__name__}: "
                                   f"{str(err).splitlines()[0] if str(err) else ''})")
                window_start, window_iters = time.perf_counter(), 0
            logger.advance()
            done = iteration + 1
            if done % train_cfg.log_interval == 0 or done == train_cfg.train_iters:
                jax.block_until_ready(metrics)
                now = time.perf_counter()
                step_time = (now - window_start) / window_iters if window_iters else compile_time
                record = _log_record(done, metrics, step_time, model_cfg, parallel, peak, num_devices, flops)
                record["includes_compile"] = not window_iters
                record["skipped_iters"], record["loss_scale"] = skips.take_window(), float(metrics["loss_scale"])
                records.append(record)
                logger.log_train(record)
                if options.on_record is not None:
                    options.on_record(record)
                window_start, window_iters = now, 0
            if data.valid is not None and (done % train_cfg.eval_interval == 0 or done == train_cfg.train_iters):
                valid = evaluate(state["params"])
                logger.log_eval({"kind": "valid", "iteration": done, "valid_lm_loss": valid,
                                 "valid_ppl": math.exp(min(valid, 50))})
            exiting = bool(train_cfg.exit_interval) and done % train_cfg.exit_interval == 0
            if saver and ((train_cfg.save_interval and done % train_cfg.save_interval == 0)
                          or done == train_cfg.train_iters or exiting):
                save(done)
            if exiting and done < train_cfg.train_iters:  # Megatron's --exit-interval
                exit_reason = f"exit_interval={train_cfg.exit_interval}"
                logger.message(f"ptd_jax: exiting at iteration {done} ({exit_reason})")
                break
            if window_iters == 0:  # eval and save are not training time: restart the window after them
                window_start = time.perf_counter()
        if ctrl_c.requested:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted = True
    except Exception as err:  # a dead process: exit now, waiting for nothing (`exit_if_peer_failed`)
        multiprocess.exit_if_peer_failed(err, "ptd-train")
        raise
    else:
        interrupted = False
    finally:
        ctrl_c.restore()
        try:
            batches.close()
        finally:
            try:
                if saver:
                    saver.close()  # waits for the last asynchronous write: every step listed is complete
            finally:
                logger.close()
    if interrupted:
        newest = checkpoint.latest_step(options.save) if options.save else None
        kept = f"newest checkpoint: step {newest} in {options.save}" if newest is not None else "no checkpoint"
        raise KeyboardInterrupt(f"after iteration {done}; {kept}")

    timed = [r for r in records if not r["includes_compile"]]
    summary = {
        "iterations": done - start,
        "start_iteration": start,
        "last_iteration": done,
        "exit_reason": exit_reason,
        "num_params": num_params,
        "wall_time_s": time.perf_counter() - wall_start,
        "compile_time_s": compile_time,
        "first_lm_loss": first_loss,
        "final_lm_loss": records[-1]["lm_loss"] if records else None,
        "final_valid_lm_loss": logger.eval_records[-1]["valid_lm_loss"] if logger.eval_records else None,
        "tokens_per_s": float(np.median([r["tokens_per_s"] for r in timed])) if timed else None,
        "tflops_per_device": float(np.median([r["tflops_per_device"] for r in timed])) if timed else None,
        "mfu": float(np.median([r["mfu"] for r in timed])) if timed else None,
        "hardware_tflops_per_device": (float(np.median([r["hardware_tflops_per_device"] for r in timed]))
                                       if timed else None),
        "eq3_tflops_per_device": float(np.median([r["eq3_tflops_per_device"] for r in timed])) if timed else None,
        "hardware_over_model_flops": flops["hardware"] / flops["model"],
        "peak_tflops": peak,
        "peak_source": peak_source,
        "device": device.device_kind,
        "num_devices": num_devices,
        "attention_backend": model_cfg.attention_backend,
        "fused_kernels": model_cfg.fused_kernels,
        "skipped_iters": skips.total,
        "measured_bubble": measured_bubble,
    }
    if options.plot_dir and primary:
        summary["plot"] = logger.plot(options.plot_dir)
    return summary


def _same_folder(a, b) -> bool:
    return Path(a).absolute().resolve() == Path(b).absolute().resolve()


def _resume_point(options: RunOptions, model_cfg: ModelConfig, train_cfg: TrainConfig, messages: list[str]):
    """(step, meta) that `--load` resumes from — the newest complete step — or None; refuses a checkpoint that
    does not fit this run, and a --save folder that holds another run's steps, with one line each (the data
    configuration is compared once the data is open, `_check_data_config`)."""
    step = None
    if options.load:
        step = checkpoint.latest_step(options.load)
        if step is None:
            if not (options.save and _same_folder(options.save, options.load)):
                raise ConfigError(f"--load {options.load} holds no checkpoint")
            messages.append(f"ptd_jax: --load {options.load} holds no checkpoint yet: starting from scratch")
    _check_save_dir(options, step)
    if step is None:
        return None
    meta = checkpoint.read_meta(options.load, step)
    checkpoint.check_architecture(options.load, step, meta, model_cfg)
    if meta.get("params_only") and not options.finetune:
        raise ConfigError(f"--load {options.load} step {step} holds parameters only (written by ptd-convert): "
                          f"load it with --finetune")
    if not options.finetune:
        if meta["iteration"] > train_cfg.train_iters:
            raise ConfigError(f"--load {options.load} is at iteration {meta['iteration']}, past "
                              f"train_iters={train_cfg.train_iters}")
        saved = meta["train"]
        was = (saved.get("lr_decay_iters") or saved.get("train_iters"), saved.get("lr_warmup_iters"))
        if was != (train_cfg.decay_iters, train_cfg.lr_warmup_iters):
            messages.append(f"ptd_jax: note: the learning-rate schedule changes on resume: decay over "
                            f"{train_cfg.decay_iters} iterations with {train_cfg.lr_warmup_iters} of warm-up, was "
                            f"{was[0]} and {was[1]} (fix --lr-decay-iters to keep it)")
    return step, meta


def _check_save_dir(options: RunOptions, load_step: int | None) -> None:
    """Refuse, before training, a --save folder holding steps that this run did not resume from (orbax would skip
    an existing step silently, and --keep-checkpoints would delete another run's steps)."""
    if not options.save:
        return
    steps = checkpoint.all_steps(options.save)
    resuming_here = options.load and _same_folder(options.save, options.load) and not options.finetune
    if steps and not (resuming_here and load_step == steps[-1]):
        raise ConfigError(f"--save {options.save} already holds checkpoints of another run (steps {steps}); "
                          f"resume it with --load {options.save}, or save elsewhere")


def _check_data_config(options: RunOptions, step: int, saved: dict, current: dict, messages: list[str]) -> None:
    changes = checkpoint.data_config_changes(saved, current)
    if saved.get("data_path") != current.get("data_path") and "data_name" not in changes:
        messages.append(f"ptd_jax: the data moved: {saved.get('data_path')} -> {current.get('data_path')} "
                        f"(same name and sizes)")
    if not changes:
        return
    if not options.override_data_config:
        raise ConfigError(f"--load {options.load} step {step} was trained with another data configuration "
                          f"(saved, now): {changes}; pass --override-data-config to accept the change")
    messages.append(f"ptd_jax: --override-data-config: the data configuration changes (saved, now): {changes}")



class _CtrlC:
    """While training: the first Ctrl-C (SIGINT) only asks the loop to stop after the current step (and the save
    it may be writing); a second one interrupts at once. Only the main thread can take signals."""

    def __init__(self):
        import signal
        import threading

        self.requested = False
        self._forwarded = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        import os
        import signal

        if self.requested or self._forwarded:
            raise KeyboardInterrupt
        print("ptd_jax: Ctrl-C: stopping after this step (again to stop at once)", file=sys.stderr)
        if jax.distributed.is_initialized():  # the processes agree on the step: JAX's preemption sync, on SIGTERM
            self._forwarded = True
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.requested = True

    def restore(self) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
