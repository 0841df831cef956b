"""The named device mesh ("data", "pipe", "tensor"), with "context" before "tensor" when c > 1, and CPU device
simulation.

Tensor is the innermost axis so that tensor-parallel groups are neighbouring devices (one host, NVLink): the
paper's takeaway #1 (§3.3) — tensor parallelism up to the GPUs of a node, pipeline parallelism across nodes.
Context comes next, as in Megatron's rank order (tp, then cp): after TP's four all-reduces of b·s·h per layer,
context parallelism moves the most bytes, K/V blocks around a ring in every layer's forward and backward
(2·b·(s/c)·G·K per hop, c − 1 hops each way, `parallel/context.py`), against one activation per microbatch at a
pipeline boundary and one gradient reduction per step for data parallelism; with t·c GPUs in a node the ring stays
on NVLink. The axis exists only when c > 1, so a run at c = 1 compiles the very program it compiled before.
"""

from __future__ import annotations

import enum
import os
import re

import numpy as np

from ptd_jax.config import ConfigError, ParallelConfig


class Axis(str, enum.Enum):
    """Mesh axis names; `Axis.TENSOR` is the innermost, `Axis.CONTEXT` (c > 1 only) the next."""

    DATA = "data"
    PIPE = "pipe"
    CONTEXT = "context"
    TENSOR = "tensor"


MESH_AXES = (Axis.DATA.value, Axis.PIPE.value, Axis.TENSOR.value)
"""The axes at c = 1; with context parallelism, `CONTEXT_MESH_AXES`."""
CONTEXT_MESH_AXES = (Axis.DATA.value, Axis.PIPE.value, Axis.CONTEXT.value, Axis.TENSOR.value)

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def set_fake_devices(num_devices: int, before_backend=None) -> None:
    """Simulate `num_devices` CPU devices (per process). Must run before JAX initialises its backend (before any JAX
    op). `before_backend()`, if given, runs once the device count is set and before the backend starts (where
    `jax.distributed.initialize` must run).

    Sets both XLA_FLAGS (read by XLA at backend start) and `jax_num_cpu_devices`; raises ConfigError if the
    backend is already running with a different device count.
    """
    if num_devices < 1:
        raise ConfigError(f"fake devices={num_devices} must be >= 1")
    previous = os.environ.get("XLA_FLAGS")
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S+", "", previous or "").strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={num_devices}".strip()
    import jax  # imported here so that the environment is set first when this is the first import

    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError:
        pass  # backend already up: report below with the numbers
    if before_backend is not None:
        before_backend()
    have = len(jax.local_devices(backend="cpu"))  # this process's: several processes each simulate their own
    if have != num_devices:
        if previous is None:  # leave the environment as it was: child processes must not inherit the failed ask
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = previous
        raise ConfigError(
            f"fake devices={num_devices} requested but the JAX CPU backend is already initialised with {have} "
            f"device(s); call set_fake_devices before any JAX operation (or set XLA_FLAGS={_DEVICE_COUNT_FLAG}="
            f"{num_devices} before starting Python)"
        )


def mesh_shape(parallel: ParallelConfig) -> dict[str, int]:
    """{axis: size} of the layout's mesh, outermost first: `MESH_AXES`, or `CONTEXT_MESH_AXES` when c > 1."""
    c = parallel.context_parallel_size
    d, p, t = parallel.data_parallel_size, parallel.pipeline_model_parallel_size, parallel.tensor_model_parallel_size
    return dict(zip(CONTEXT_MESH_AXES, (d, p, c, t))) if c > 1 else dict(zip(MESH_AXES, (d, p, t)))


def make_mesh(parallel: ParallelConfig, devices=None):
    """A `jax.sharding.Mesh` of shape (d, p, t) with axes ("data", "pipe", "tensor"), all `AxisType.Auto`; with
    context parallelism (d, p, c, t) with axes ("data", "pipe", "context", "tensor").

    Uses the first d·p·t of `devices` (default: `jax.devices()` ordered by process, so that each process holds
    a contiguous block: with n devices per process and t dividing n, tensor groups never span processes, and
    pipeline stages only when p·t > n); fails if there are fewer.
    """
    import jax
    from jax.sharding import AxisType, Mesh

    if devices is None:
        devices = sorted(jax.devices(), key=lambda dev: (dev.process_index, dev.id))
    devices = list(devices)
    sizes = mesh_shape(parallel)
    shape, axes = tuple(sizes.values()), tuple(sizes)
    needed = int(np.prod(shape))
    if needed > len(devices):
        named = " x ".join(f"{a}={n}" for a, n in zip(axes, shape))
        raise ConfigError(
            f"the layout {named} needs {needed} devices but only "
            f"{len(devices)} exist (on CPU, simulate more with --fake-devices {needed})"
        )
    grid = np.array(devices[:needed], dtype=object).reshape(shape)
    return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))
