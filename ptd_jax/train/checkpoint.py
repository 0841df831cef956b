"""Orbax checkpoints of the training state (`--save DIR`, `--load DIR`, `--save-interval N`).

A checkpoint is one orbax step folder holding the state pytree (params, optimizer state, step) and the run's
configs as JSON. Orbax writes to a temporary folder and renames it when complete, so an interrupted save leaves no
half-written step. Data order depends on the iteration only, so resuming at step k replays exactly the batches
an uninterrupted run would see.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig

_ARCHITECTURE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                        "ffn_hidden_size", "max_position_embeddings", "make_vocab_size_divisible_by")


def _manager(directory, create: bool) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        Path(directory).absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=create, enable_async_checkpointing=False),
    )


def save(directory, step: int, state, model_cfg: ModelConfig, parallel: ParallelConfig,
         train_cfg: TrainConfig) -> None:
    configs = {"model": dataclasses.asdict(model_cfg), "parallel": dataclasses.asdict(parallel),
               "train": dataclasses.asdict(train_cfg)}
    with _manager(directory, create=True) as manager:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   configs=ocp.args.JsonSave(configs)))
        manager.wait_until_finished()


def latest_step(directory) -> int | None:
    if not Path(directory).is_dir():
        return None
    with _manager(directory, create=False) as manager:
        return manager.latest_step()


def restore(directory, like_state, model_cfg: ModelConfig, parallel: ParallelConfig | None = None):
    """Restore the latest step into the structure (and shardings) of `like_state`; returns (state, step)."""
    step = latest_step(directory)
    if step is None:
        raise ConfigError(f"--load {directory} holds no checkpoint")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
    with _manager(directory, create=False) as manager:
        configs = manager.restore(step, args=ocp.args.Composite(configs=ocp.args.JsonRestore()))["configs"]
        saved = configs["model"]
        mismatched = {k: (saved.get(k), getattr(model_cfg, k)) for k in _ARCHITECTURE_FIELDS
                      if saved.get(k) != getattr(model_cfg, k)}
        if mismatched:
            raise ConfigError(f"--load {directory} step {step} has a different architecture (saved, requested): "
                              f"{mismatched}")
        if parallel is not None:
            layout = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_stages")
            saved_layout = {k: configs["parallel"].get(k) for k in layout}
            wanted = {k: getattr(parallel, k) for k in layout}
            if saved_layout != wanted:
                raise ConfigError(f"--load {directory} step {step} was saved with {saved_layout}, this run uses "
                                  f"{wanted}; resuming on another t/p/v layout is not supported yet")
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    return restored["state"], step
