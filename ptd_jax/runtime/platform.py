"""Platform policy: which accelerator this machine has, and the defaults that depend on it.

Which accelerator, answered without starting a JAX backend: a JAX plugin installed *and* its device present. An
installed plugin alone is no accelerator: the gpu-compile extra installs the CUDA plugin on CPU-only machines, to
compile for GPUs that are not here (`ptd_jax/aot`). The pipeline's branching under "auto" depends on the backend
(`resolve_branching`)."""

from __future__ import annotations

import glob
import importlib.util
import os

from ptd_jax.config import SCHEDULE_SPECS

GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin")


def _installed(*modules: str) -> bool:
    return any(importlib.util.find_spec(name) is not None for name in modules)


GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")
"""NVIDIA's device nodes, WSL2's GPU node and AMD's."""


def gpu_present() -> bool:
    """A CUDA or ROCm plugin and a GPU device node, and JAX allowed to use them (`JAX_PLATFORMS`, when set, names
    cuda, rocm or gpu)."""
    if not _platform_allowed("cuda", "rocm", "gpu"):
        return False
    return any(glob.glob(pattern) for pattern in GPU_DEVICES) and _installed(*GPU_PLUGINS)


def _platform_allowed(*names: str) -> bool:
    """`JAX_PLATFORMS` unset, or naming one of `names`: a run on this machine may start that backend."""
    chosen = os.environ.get("JAX_PLATFORMS", "").strip()
    return not chosen or any(name in chosen.split(",") for name in names)


def cuda_gpu_present() -> bool:
    """An NVIDIA GPU and JAX's CUDA plugin (what cuDNN attention needs; ROCm has no cuDNN)."""
    nvidia = any(glob.glob(pattern) for pattern in GPU_DEVICES[:2]) and _platform_allowed("cuda", "gpu")
    return nvidia and _installed("jax_cuda12_plugin", "jax_cuda13_plugin")


def other_plugin_installed() -> bool:
    """A JAX plugin this module cannot check for a device (registered under another name): taken as present."""
    import importlib.metadata

    known = {"xla_cuda12", "xla_cuda13", "xla_rocm7", "xla_rocm60"}
    return any(entry.name not in known for entry in importlib.metadata.entry_points(group="jax_plugins"))


def tpu_present() -> bool:
    """libtpu and a TPU device (/dev/accel* or /dev/vfio/N)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")) and _installed("libtpu")


def accelerator_present() -> bool:
    return gpu_present() or tpu_present() or other_plugin_installed()


def resolve_branching(branching: str, backend: str | None = None, schedule: str | None = None) -> str:
    """ "auto" is "per-rank" on XLA:CPU (fake devices share the host's cores, so an idle cell's dummy work and the
    masked embedding and head on every rank cost step time; tensor collectives in pipe-divergent branches are
    measured correct there) and "uniform" on accelerators (no collective in a pipe-divergent branch, and no
    device-to-host read of a per-rank predicate); the other two are returned as they are. A schedule on unit ticks
    (`ScheduleSpec.rows`) runs different kinds on different ranks in one tick: "auto" is "per-rank" for it."""
    if branching != "auto":
        return branching
    if schedule is not None and schedule in SCHEDULE_SPECS and SCHEDULE_SPECS[schedule].rows == "unit":
        return "per-rank"
    if backend is None:
        import jax

        backend = jax.default_backend()
    return "per-rank" if backend == "cpu" else "uniform"
