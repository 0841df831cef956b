"""Resuming (Megatron's `--load`): which step to continue from, and the refusals that come before any data or device
is touched: a checkpoint that does not fit this run, a --save folder holding another run's steps, a changed data
configuration. `options` is the run's `loop.RunOptions`."""

from __future__ import annotations

from pathlib import Path

from ptd_jax.config import ConfigError, ModelConfig, TrainConfig
from ptd_jax.train import checkpoint


def same_folder(a, b) -> bool:
    return Path(a).absolute().resolve() == Path(b).absolute().resolve()


def resume_point(options, model_cfg: ModelConfig, train_cfg: TrainConfig, messages: list[str]):
    """(step, meta) that `--load` resumes from — the newest complete step — or None; refuses a checkpoint that
    does not fit this run, and a --save folder that holds another run's steps, with one line each (the data
    configuration is compared once the data is open, `check_data_config`)."""
    step = None
    if options.load:
        step = checkpoint.latest_step(options.load)
        if step is None:
            if not (options.save and same_folder(options.save, options.load)):
                raise ConfigError(f"--load {options.load} holds no checkpoint")
            messages.append(f"ptd_jax: --load {options.load} holds no checkpoint yet: starting from scratch")
    check_save_dir(options, step)
    if step is None:
        return None
    meta = checkpoint.read_meta(options.load, step)
    checkpoint.check_architecture(options.load, step, meta, model_cfg)
    if meta.get("params_only") and not options.finetune:
        raise ConfigError(
            f"--load {options.load} step {step} holds parameters only (written by ptd-convert): load it with --finetune"
        )
    if not options.finetune:
        if meta["iteration"] > train_cfg.train_iters:
            raise ConfigError(
                f"--load {options.load} is at iteration {meta['iteration']}, past train_iters={train_cfg.train_iters}"
            )
        saved = meta["train"]
        was = (saved.get("lr_decay_iters") or saved.get("train_iters"), saved.get("lr_warmup_iters"))
        if was != (train_cfg.decay_iters, train_cfg.lr_warmup_iters):
            messages.append(
                f"ptd_jax: note: the learning-rate schedule changes on resume: decay over "
                f"{train_cfg.decay_iters} iterations with {train_cfg.lr_warmup_iters} of warm-up, was "
                f"{was[0]} and {was[1]} (fix --lr-decay-iters to keep it)"
            )
    return step, meta


def check_save_dir(options, load_step: int | None) -> None:
    """Refuse, before training, a --save folder holding steps that this run did not resume from (orbax would skip
    an existing step silently, and --keep-checkpoints would delete another run's steps)."""
    if not options.save:
        return
    steps = checkpoint.all_steps(options.save)
    resuming_here = options.load and same_folder(options.save, options.load) and not options.finetune
    if steps and not (resuming_here and load_step == steps[-1]):
        raise ConfigError(
            f"--save {options.save} already holds checkpoints of another run (steps {steps}); "
            f"resume it with --load {options.save}, or save elsewhere"
        )


def check_data_config(options, step: int, saved: dict, current: dict, messages: list[str]) -> None:
    """Refuse to resume on another data configuration than the checkpoint's, unless --override-data-config (then
    say what changed); note data that only moved."""
    changes = checkpoint.data_config_changes(saved, current)
    if saved.get("data_path") != current.get("data_path") and "data_name" not in changes:
        messages.append(
            f"ptd_jax: the data moved: {saved.get('data_path')} -> {current.get('data_path')} (same name and sizes)"
        )
    if not changes:
        return
    if not options.override_data_config:
        raise ConfigError(
            f"--load {options.load} step {step} was trained with another data configuration "
            f"(saved, now): {changes}; pass --override-data-config to accept the change"
        )
    messages.append(f"ptd_jax: --override-data-config: the data configuration changes (saved, now): {changes}")
