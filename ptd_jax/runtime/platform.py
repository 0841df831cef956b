"""Which accelerator this machine has, answered without starting a JAX backend: a JAX plugin installed *and* its
device present. An installed plugin alone is no accelerator: the gpu-compile extra installs the CUDA plugin on
CPU-only machines, to compile for GPUs that are not here (`ptd_jax/aot`)."""

from __future__ import annotations

import glob
import importlib.util
import os

GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin")


def _installed(*modules: str) -> bool:
    return any(importlib.util.find_spec(name) is not None for name in modules)


def gpu_present() -> bool:
    """A CUDA or ROCm plugin and an NVIDIA (/dev/nvidia*) or AMD (/dev/kfd) device."""
    devices = os.path.exists("/dev/nvidiactl") or glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")
    return bool(devices) and _installed(*GPU_PLUGINS)


def tpu_present() -> bool:
    """libtpu and a TPU device (/dev/accel* or /dev/vfio/N)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")) and _installed("libtpu")


def accelerator_present() -> bool:
    return gpu_present() or tpu_present()
