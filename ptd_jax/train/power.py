"""A training run's power side: the energy meter of the job's devices (`runtime/energy.py`, summed over processes)
and `--gpu-clock-plan`: each GPU locked at its pipeline rank's clock for the run (`runtime/clocks.py`), checked
against the run's layout and devices before anything is read."""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from ptd_jax.config import ConfigError, ParallelConfig
from ptd_jax.perf.hardware import for_device_kind
from ptd_jax.runtime import clocks, energy


class JobMeter:
    """The energy meter of this process's devices (`runtime/energy.py`), summed over the job's processes."""

    def __init__(self, meter):
        self._meter = meter
        n = jax.process_count()
        self.source = meter.source + (f", summed over {n} processes" if n > 1 else "")
        # several processes: one gather now says whether every process has a counter; if one has none, the job's
        # energy is unknown and no process gathers again
        self._gather = n > 1 and self._gathered(meter.read()) is not None
        if n > 1 and not self._gather:
            self.source = "unavailable: a process of the job has no energy counter"

    @classmethod
    def open(cls, mesh) -> JobMeter:
        """The meter of this process's devices in `mesh`."""
        devices = [device for _, device in local_mesh_devices(mesh)]
        platform = devices[0].platform
        indices = [clocks.nvml_index(d.local_hardware_id or 0) for d in devices] if platform == "gpu" else None
        return cls(energy.open_meter(platform, indices))

    def read(self) -> float | None:
        if jax.process_count() == 1:
            return self._meter.read()
        return self._gathered(self._meter.read()) if self._gather else None

    def _gathered(self, local: float | None) -> float | None:
        from jax.experimental import multihost_utils

        row = np.array([energy.host_id(), np.nan if local is None else local], dtype=np.float64)
        return energy.job_total(np.asarray(multihost_utils.process_allgather(row)), self._meter.per_host)


def read_clock_plan(path: str | None, parallel: ParallelConfig) -> clocks.ClockPlan | None:
    """--gpu-clock-plan, refused before anything is read when it is for another p or another GPU."""
    if path is None:
        return None
    try:
        plan = clocks.read_plan(path)
    except clocks.ClockError as err:
        raise ConfigError(str(err)) from None
    p = parallel.pipeline_model_parallel_size
    if plan.p != p:
        raise ConfigError(
            f"--gpu-clock-plan {path!r} holds {plan.p} clocks (p={plan.p}) but the run has "
            f"pipeline_model_parallel_size={p}"
        )
    device = jax.local_devices()[0]
    hw = for_device_kind(device.device_kind)  # None on CPUs and GPUs outside the catalogue
    if hw is None or hw.name != plan.hardware:
        raise ConfigError(
            f"--gpu-clock-plan {path!r} is for hardware={plan.hardware!r} but this run's devices are "
            f"{device.device_kind!r} ({hw.name if hw else 'not a GPU of perf/hardware.py'})"
        )
    return plan


@contextlib.contextmanager
def gpu_clocks(mesh, plan: clocks.ClockPlan | None, message):
    """Each of this process's GPUs in `mesh` locked at full clock, then (the governor) at its pipeline rank's clock;
    reset on exit. `message`: where the locks and the governor report."""
    if plan is None:
        yield None
        return
    nvml = energy.load_nvml()
    if nvml is None:
        raise ConfigError("--gpu-clock-plan needs NVML: pip install 'ptd_jax[energy]' (nvidia-ml-py) and a driver")
    pipe = mesh.axis_names.index("pipe")
    planned = {
        clocks.nvml_index(device.local_hardware_id or 0): plan.clocks_mhz[where[pipe]]
        for where, device in local_mesh_devices(mesh)
    }
    try:
        locks = clocks.ClockLocks(nvml, dict.fromkeys(planned, plan.max_clock_mhz), message)
        with locks:
            yield clocks.Governor(locks, planned, plan, message)
    except clocks.ClockError as err:
        raise ConfigError(str(err)) from None


def local_mesh_devices(mesh) -> list[tuple[tuple[int, ...], object]]:
    """(mesh coordinates, device) of this process's devices in the mesh (a run may use fewer than are here)."""
    here = jax.process_index()
    return [
        (where, mesh.devices[where])
        for where in np.ndindex(mesh.devices.shape)
        if mesh.devices[where].process_index == here
    ]


def govern(governor: clocks.Governor, record: dict) -> None:
    """The governor told the last logged step's time."""
    governor.observe(record["step_time_s"], record["includes_compile"], record["iteration"])
