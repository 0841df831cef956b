"""Which accelerator this machine has, answered without starting a JAX backend: a JAX plugin installed *and* its
device present. An installed plugin alone is no accelerator: the gpu-compile extra installs the CUDA plugin on
CPU-only machines, to compile for GPUs that are not here (`ptd_jax/aot`)."""

from __future__ import annotations

import glob
import importlib.util

GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin")


def _installed(*modules: str) -> bool:
    return any(importlib.util.find_spec(name) is not None for name in modules)


GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/dxg", "/dev/kfd")
"""NVIDIA's device nodes, WSL2's GPU node and AMD's."""


def gpu_present() -> bool:
    """A CUDA or ROCm plugin and a GPU device node."""
    return any(glob.glob(pattern) for pattern in GPU_DEVICES) and _installed(*GPU_PLUGINS)


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
