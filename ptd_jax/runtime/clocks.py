"""Applying a clock plan (`ptd-plan energy --output PLAN.json`, `ptd-train --gpu-clock-plan PLAN.json`): lock each
local GPU's SM clock to its pipeline rank's clock through NVML, put it back on every way out, and keep the user's
step time.

- `read_plan`: the plan file, checked (format, one positive clock per rank); the caller compares its p and hardware
  with the run's.
- `ClockLocks`: a context manager. On entry it locks every listed GPU (`nvmlDeviceSetGpuLockedClocks(h, f, f)`);
  without the permission (NVML_ERROR_NO_PERMISSION: root, or `nvidia-smi -acp UNRESTRICTED`) it raises
  `ClockError` with one line before any step runs, unlocking what it had locked. On exit, by return, exception,
  Ctrl-C or SIGTERM (a handler, while no other is installed, turns SIGTERM into an exception that unwinds through
  it), and at interpreter exit, it resets each GPU (`nvmlDeviceResetGpuLockedClocks`: the driver's default; a lock
  someone set before the run is not brought back). Only SIGKILL escapes it.
- `Governor`: the user's satisfaction. The first `window` timed log windows run at full clock and their median step
  time is the target; then the plan's clocks are locked. When the median of the last `window` step times is above
  (1 + ε) × target, every GPU's clock rises by that ratio (rounded up to the driver's step, at most full clock),
  and the change is logged.

Tests inject a fake NVML object (`nvml=`); nothing here changes a clock unless asked by `ptd-train`.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import statistics
from dataclasses import dataclass
from pathlib import Path

PLAN_FORMAT = "ptd_jax.clock_plan/1"
NO_PERMISSION = 4
"""NVML_ERROR_NO_PERMISSION."""
WINDOW = 5
"""Log windows the governor measures the target over, and watches the step time over."""


class ClockError(Exception):
    """A clock plan that cannot be applied here (one line)."""


@dataclass(frozen=True)
class ClockPlan:
    clocks_mhz: tuple[float, ...]
    """One per pipeline rank."""
    hardware: str
    epsilon: float
    max_clock_mhz: float
    step_mhz: float = 15.0
    path: str = ""

    @property
    def p(self) -> int:
        return len(self.clocks_mhz)


def read_plan(path: str | Path) -> ClockPlan:
    """The plan file, or ClockError with one line."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ClockError(f"--gpu-clock-plan {str(path)!r} does not parse: {err}") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise ClockError(f"--gpu-clock-plan {str(path)!r} is not a plan of `ptd-plan energy --output`")
    clocks = data.get("clocks_mhz")
    fields = (data.get("epsilon"), data.get("max_clock_mhz"), *(clocks if isinstance(clocks, list) else [None]))
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in fields)
    if not numbers or not clocks or fields[0] < 0 or min(fields[1:]) <= 0 or max(clocks) > fields[1]:
        raise ClockError(
            f"--gpu-clock-plan {str(path)!r}: clocks_mhz must be positive numbers up to max_clock_mhz, epsilon >= 0"
        )
    return ClockPlan(
        clocks_mhz=tuple(float(f) for f in clocks),
        hardware=str(data.get("hardware")),
        epsilon=float(data["epsilon"]),
        max_clock_mhz=float(data["max_clock_mhz"]),
        step_mhz=float(data.get("clock_step_mhz") or 15.0),
        path=str(path),
    )


def nvml_index(local_hardware_id: int, visible: str | None = None) -> int:
    """NVML's index of the CUDA device `local_hardware_id`, through CUDA_VISIBLE_DEVICES where it lists numbers
    (NVML numbers every GPU; CUDA only the visible ones, in PCI order under CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [x.strip() for x in (visible or "").split(",") if x.strip()]
    if ids and all(x.isdigit() for x in ids) and local_hardware_id < len(ids):
        return int(ids[local_hardware_id])
    return local_hardware_id


class _Terminate(BaseException):
    """SIGTERM while the clocks are locked and no other handler is set: unwinds through `ClockLocks.__exit__`."""


class ClockLocks:
    """Locks {NVML index: MHz} on entry and resets them on every exit (module docstring)."""

    def __init__(self, nvml, clocks: dict[int, float], say=print):
        self._nvml = nvml
        self._clocks = dict(clocks)
        self._handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in clocks}
        self._locked: set[int] = set()
        self._say = say
        self._previous_handler = None

    @property
    def clocks(self) -> dict[int, float]:
        return dict(self._clocks)

    def set(self, clocks: dict[int, float]) -> None:
        """Lock each listed GPU at its clock (MHz); ClockError with one line without the permission."""
        for index, mhz in clocks.items():
            try:
                self._nvml.nvmlDeviceSetGpuLockedClocks(self._handles[index], int(mhz), int(mhz))
            except Exception as err:  # pynvml.NVMLError
                self.restore()
                why = "no permission" if getattr(err, "value", None) == NO_PERMISSION else str(err)
                raise ClockError(
                    f"cannot lock GPU {index}'s clock at {mhz:g} MHz through NVML ({why}): run as root or after "
                    f"`nvidia-smi -acp UNRESTRICTED`, or drop --gpu-clock-plan"
                ) from None
            self._locked.add(index)
            self._clocks[index] = mhz

    def restore(self) -> None:
        """Reset every GPU this object locked (each tried, whatever the others do)."""
        for index in sorted(self._locked):
            try:
                self._nvml.nvmlDeviceResetGpuLockedClocks(self._handles[index])
            except Exception as err:  # keep resetting the others
                self._say(f"ptd_jax: warning: could not reset GPU {index}'s clock: {err}")
        self._locked.clear()

    def _on_sigterm(self, signum, frame):
        raise _Terminate

    def __enter__(self) -> ClockLocks:
        atexit.register(self.restore)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # None: a handler from C (JAX's preemption notifier)
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.set(self._clocks)
        return self

    def __exit__(self, kind, value, traceback) -> bool:
        self.restore()
        atexit.unregister(self.restore)
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
        if kind is _Terminate:
            raise SystemExit(143)
        return False


class Governor:
    """Full clock for `window` timed windows (the target), then the plan; raises the clocks when the step runs slower
    than (1 + ε) × target over `window` windows (module docstring)."""

    def __init__(self, locks: ClockLocks, plan_clocks: dict[int, float], plan: ClockPlan, say=print):
        self.locks, self.plan, self._say = locks, plan, say
        self._planned = dict(plan_clocks)
        self._times: list[float] = []
        self.target_s: float | None = None
        self.events: list[dict] = []

    def observe(self, step_time_s: float, includes_compile: bool = False, iteration: int = 0) -> None:
        if includes_compile:
            return
        self._times.append(step_time_s)
        if len(self._times) < WINDOW:
            return
        recent = statistics.median(self._times[-WINDOW:])
        if self.target_s is None:
            self.target_s = recent
            self.locks.set(self._planned)
            self._log(iteration, "plan locked", recent)
            self._times.clear()
            return
        limit = (1 + self.plan.epsilon) * self.target_s
        current = self.locks.clocks
        if recent <= limit or all(f >= self.plan.max_clock_mhz for f in current.values()):
            return
        ratio = recent / limit
        step = self.plan.step_mhz or 1.0
        raised = {i: min(self.plan.max_clock_mhz, math.ceil(f * ratio / step) * step) for i, f in current.items()}
        self.locks.set(raised)
        self._log(iteration, f"step {recent:.4g} s > (1 + {self.plan.epsilon:g}) x target: clocks raised", recent)
        self._times.clear()

    def _log(self, iteration: int, what: str, recent: float) -> None:
        clocks = self.locks.clocks
        self.events.append({"iteration": iteration, "event": what, "step_time_s": recent, "clocks_mhz": clocks})
        self._say(
            f"ptd_jax: gpu clocks at iteration {iteration}: {what} (target {self.target_s:.4g} s, median of the last "
            f"{WINDOW} windows {recent:.4g} s); MHz by NVML index {clocks}"
        )
