"""The training and evaluation steps compiled by XLA:GPU for a GPU that is not here (MaxText's train_compile idea):
a virtual topology of the target (`jax.experimental.topologies`, hosts of 8), the state and batch as shapes with
their shardings, `jit(...).lower(...).compile()`, and a summary of what XLA made of it — per-GPU memory against the
device's, the collectives and the kernels in the compiled HLO.

Needs the CUDA plugin (`pip install -e '.[gpu-compile]'`); with `JAX_PLATFORMS=cpu` nothing looks for a device.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from pallas_kernels.target import GpuTarget, compile_target
from ptd_jax import model as gpt
from ptd_jax.perf.hardware import Hardware, allocator_fraction
from ptd_jax.analysis.hlo import collective_summary, collectives_by_axes, hlo_kernels
from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.optimizer import make_optimizer
from ptd_jax.parallel import sharding
from ptd_jax.parallel.mesh import make_mesh, mesh_shape
from ptd_jax.parallel.step import init_sharded_state, make_parallel_eval_step, make_parallel_train_step, on_mesh

GPUS_PER_HOST = 8
INSTALL_HINT = "pip install -e '.[gpu-compile]' (the CUDA plugin for this jax, no GPU needed)"


def plugin_installed() -> bool:
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None for v in (12, 13))


def topology_name(num_gpus: int) -> str:
    """`slices x hosts x devices per host`, hosts of 8 GPUs as in a DGX."""
    if num_gpus < 1 or (num_gpus > GPUS_PER_HOST and num_gpus % GPUS_PER_HOST):
        raise ConfigError(
            f"num_gpus={num_gpus} must be 1..{GPUS_PER_HOST} or a multiple of {GPUS_PER_HOST} "
            f"(hosts of {GPUS_PER_HOST} GPUs)"
        )
    per_host = min(num_gpus, GPUS_PER_HOST)
    return f"1x{num_gpus // per_host}x{per_host}"


def kernel_target(target: Hardware) -> GpuTarget:
    """The GPU the Pallas kernels choose their blocks for (compute capability, shared memory per block)."""
    if target.chip is None:
        raise ConfigError(f"target={target.name!r} has no chip description to compile for")
    return GpuTarget(target.chip.compute_capability, target.chip.shared_memory_per_block_optin)


def virtual_devices(target: Hardware, num_gpus: int) -> list:
    """`num_gpus` devices of `target` that XLA:GPU can compile for and no program can run on."""
    if not plugin_installed():
        raise ConfigError(f"compiling for GPUs needs the CUDA plugin: {INSTALL_HINT}")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=target.target_config(), topology=topology_name(num_gpus)
    )
    return list(topology.devices)


@dataclass
class Compiled:
    """One compiled program and what it costs per GPU."""

    name: str
    compile_time_s: float
    memory: dict
    hlo_text: str


def _compile(name: str, fn, *args) -> Compiled:
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    memory = {
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
        "temporaries": stats.temp_size_in_bytes,
        "generated_code": stats.generated_code_size_in_bytes,
    }
    # donated state aliases its outputs: count those bytes once
    memory["total"] = (
        memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"] + memory["generated_code"]
    )
    return Compiled(name, seconds, memory, compiled.as_text())


def _batch_shapes(mesh, parallel: ParallelConfig, seq_length: int):
    """(tokens, labels, mask) as the train step takes them: [M, d·b, S] int32, sharded over data."""
    shape = (parallel.num_microbatches, parallel.data_parallel_size * parallel.micro_batch_size, seq_length)
    batch = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding.named(mesh, sharding.BATCH_SPEC))
    return batch, batch, batch


def compile_steps(
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    train_cfg: TrainConfig,
    target: Hardware,
    num_gpus: int,
    *,
    evaluation: bool = True,
) -> tuple[ParallelConfig, list[Compiled]]:
    """The layout's train step (and eval step) compiled for `num_gpus` of `target`; nothing is computed."""
    mesh = make_mesh(parallel, virtual_devices(target, num_gpus))
    parallel = on_mesh(parallel, mesh)
    optimizer = make_optimizer(train_cfg)
    with gpt.kernels_for("gpu"), compile_target(kernel_target(target)):  # the kernels' blocks fit the target's SMs
        state = init_sharded_state(
            jax.random.key(0), model_cfg, optimizer, mesh, parallel, shapes_only=True, train_cfg=train_cfg
        )
        batch = _batch_shapes(mesh, parallel, model_cfg.seq_length)
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding.named(mesh, PartitionSpec()))
        step = make_parallel_train_step(mesh, model_cfg, parallel, train_cfg, optimizer, state)
        programs = [_compile("train_step", step, state, *batch, key)]
        if evaluation:
            specs = sharding.param_specs(state["params"], parallel.pipeline_model_parallel_size > 1)
            eval_step = make_parallel_eval_step(mesh, model_cfg, parallel, specs)
            programs.append(_compile("eval_step", eval_step, state["params"], *batch))
    return parallel, programs


def summary(
    model_cfg: ModelConfig, parallel: ParallelConfig, target: Hardware, num_gpus: int, programs: list[Compiled]
) -> dict:
    """The JSON object `ptd-train --compile-only --json` prints: the train step's memory and contents, the
    evaluation step's memory beside it."""
    train = programs[0]
    peak = max(p.memory["total"] for p in programs)
    fraction = allocator_fraction()
    budget = int(target.memory_bytes * fraction)
    return {
        "target": target.name,
        "device": target.description,
        "num_gpus": num_gpus,
        "layout": {
            "data": parallel.data_parallel_size,
            "pipe": parallel.pipeline_model_parallel_size,
            "tensor": parallel.tensor_model_parallel_size,
            "context": parallel.context_parallel_size,
            "cp_comm_type": parallel.cp_comm_type,
            "virtual": parallel.virtual_pipeline_stages,
            "schedule": parallel.pipeline_schedule,
            "micro_batch_size": parallel.micro_batch_size,
            "num_microbatches": parallel.num_microbatches,
        },
        "resolved": {
            "pipeline_branching": parallel.pipeline_branching,
            "attention_backend": model_cfg.attention_backend,
            "fused_kernels": model_cfg.fused_kernels,
            "dtype": model_cfg.dtype,
            "vocab_size": model_cfg.vocab_size,
        },
        "memory_bytes_per_gpu": peak,
        "memory": {p.name: p.memory for p in programs},
        "device_memory_bytes": target.memory_bytes,
        "allocator_fraction": fraction,
        "memory_budget_bytes": budget,
        "fits": peak <= budget,
        "compile_time_s": sum(p.compile_time_s for p in programs),
        "compile_time_s_by_program": {p.name: p.compile_time_s for p in programs},
        "collectives": collective_summary(train.hlo_text),
        # by the mesh axes each spans: "collective-permute@context" is context parallelism's ring
        "collectives_by_axes": collectives_by_axes(train.hlo_text, mesh_shape(parallel)),
        "kernels": hlo_kernels(train.hlo_text),
    }
