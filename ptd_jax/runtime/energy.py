"""Energy meters: the joules this process's devices have used, read from the hardware's own counters, or
"unavailable" (never an estimate). `perf/energy.py` predicts; this measures.

- GPUs: NVML's total-energy counter of each local device (`nvmlDeviceGetTotalEnergyConsumption`, millijoules since
  the driver loaded; Volta and later), through nvidia-ml-py (the `energy` extra), imported only here and only when
  asked. The run sums the processes' readings (`train/power.JobMeter`).
- CPU hosts: Linux powercap/RAPL (`/sys/class/powercap/intel-rapl:N/energy_uj`, one counter per CPU package, the
  same files on AMD). A counter wraps at its `max_energy_range_uj` (commonly 262,143 J: 17 minutes at 250 W); a
  reader that looks at least once per wrap counts every joule (the loop reads at each log interval). The packages'
  subzones (cores, uncore, DRAM as `intel-rapl:N:M`) lie inside them and are not added again. RAPL measures the
  whole package: every process on it, not only this one; the source says so. Since Linux 5.10 `energy_uj` is
  readable by root only: elsewhere the meter is unavailable, with the reason.
"""

from __future__ import annotations

import re
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

POWERCAP = "/sys/class/powercap"
_PACKAGE = re.compile(r"^intel-rapl:\d+$")


@dataclass(frozen=True)
class Window:
    """Energy over a timing window: joules (None: unavailable), seconds, steps."""

    joules: float | None
    seconds: float
    steps: int


class Unavailable:
    """No counter to read: `read()` is None and `source` says why."""

    per_host = False

    def __init__(self, why: str):
        self.source = f"unavailable: {why}"

    def read(self) -> float | None:
        return None


class RaplMeter:
    """Cumulative joules of the CPU packages' RAPL counters under a powercap folder, wrap-around included."""

    per_host = True
    """Every process on a host reads the same packages: the job counts one per host (`job_total`)."""

    def __init__(self, root: str | Path = POWERCAP):
        zones = sorted(p for p in Path(root).glob("intel-rapl:*") if _PACKAGE.match(p.name))
        if not zones:
            raise OSError(f"no RAPL package zone under {root}")
        self._zones = zones
        self._range = [int((z / "max_energy_range_uj").read_text()) for z in zones]
        self._last = [self._raw(z) for z in zones]
        self._joules = 0.0
        names = ", ".join((z / "name").read_text().strip() if (z / "name").exists() else z.name for z in zones)
        self.source = f"rapl ({names}: the whole CPU package, every process on it)"

    @staticmethod
    def _raw(zone: Path) -> int:
        return int((zone / "energy_uj").read_text())

    def read(self) -> float:
        """Joules since this meter was opened."""
        for k, zone in enumerate(self._zones):
            raw = self._raw(zone)
            delta = raw - self._last[k]
            if delta < 0:  # the counter wrapped at max_energy_range_uj (at most once between reads)
                delta += self._range[k]
            self._joules += delta / 1e6
            self._last[k] = raw
        return self._joules


class NvmlMeter:
    """Cumulative joules of NVML's total-energy counters of the devices at `indices` (NVML's numbering)."""

    per_host = False

    def __init__(self, nvml, indices: list[int]):
        self._nvml = nvml
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        self._start = self._total()  # raises where the counter is not supported
        self.source = f"nvml (total energy counter of {len(indices)} local GPU(s))"

    def _total(self) -> int:
        return sum(int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._handles)

    def read(self) -> float:
        """Joules since this meter was opened (the counter is 64-bit millijoules: it does not wrap)."""
        return (self._total() - self._start) / 1e3


def host_id() -> int:
    """This host's number in `job_total`'s rows (a CRC of its name)."""
    return zlib.crc32(socket.gethostname().encode())


def job_total(rows: np.ndarray, per_host: bool) -> float | None:
    """The job's joules from every process's (host id, joules) row: None when any process has none (NaN); a counter
    of the whole host (RAPL) counted once per host, one of the process's own devices (NVML) from every process."""
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, 2)
    if np.isnan(rows[:, 1]).any():
        return None
    if per_host:
        _, first = np.unique(rows[:, 0], return_index=True)
        rows = rows[first]
    return float(rows[:, 1].sum())


def load_nvml():
    """pynvml (nvidia-ml-py), initialised, or None where it is not installed or finds no driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # pynvml.NVMLError: no driver, no library
        return None
    return pynvml


def open_meter(platform: str, nvml_indices: list[int] | None = None, nvml=None, root: str | Path = POWERCAP):
    """The meter of this process's devices: NVML on "gpu" (`nvml`, else nvidia-ml-py loaded here), RAPL on "cpu",
    else `Unavailable` with the reason."""
    if platform == "gpu":
        nvml = nvml if nvml is not None else load_nvml()
        if nvml is None:
            return Unavailable("NVML not loaded (pip install 'ptd_jax[energy]' for nvidia-ml-py, and a driver)")
        try:
            return NvmlMeter(nvml, list(nvml_indices or []))
        except Exception as err:  # pynvml.NVMLError: not supported on this GPU, or no permission
            return Unavailable(f"NVML's energy counter: {err}")
    if platform == "cpu":
        try:
            return RaplMeter(root)
        except (OSError, ValueError) as err:
            return Unavailable(f"RAPL: {err}")
    return Unavailable(f"no energy counter known for {platform} devices")
