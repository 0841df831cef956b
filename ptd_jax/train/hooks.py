"""The loop's hooks: what runs after a step besides the step itself (levanter's `add_hook`).

The loop only fetches batches, runs the step and hands each hook a `StepInfo`; a hook says when it is due: every N
iterations, at the run's final iteration, at an --exit-interval stop, or after the first step (the one that
compiled). Hooks run in the order they were added. `StepTimer` keeps the timing window out of their way: the first
step is timed apart (compilation), and time spent in hooks (evaluation, saving, the bubble measurement) never
enters a window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from ptd_jax.runtime.energy import Window


@dataclass(frozen=True)
class StepInfo:
    """What a hook sees after a step."""

    iteration: int
    """Iterations done, resumed ones included (the step just run is this one, counting from 1)."""
    state: Any
    metrics: dict
    batch: tuple
    first: bool
    """This run's first step (it includes compilation)."""
    final: bool
    """iteration == train_iters."""
    exiting: bool
    """An --exit-interval stop is due at this iteration."""


@dataclass(frozen=True)
class Hook:
    fn: Callable[[StepInfo], None]
    every: int | None = None
    final: bool = False
    exiting: bool = False
    first: bool = False

    def due(self, info: StepInfo) -> bool:
        return bool(
            (self.every and info.iteration % self.every == 0)
            or (self.final and info.final)
            or (self.exiting and info.exiting)
            or (self.first and info.first)
        )


@dataclass
class Hooks:
    hooks: list[Hook] = field(default_factory=list)

    def add_hook(
        self,
        fn: Callable[[StepInfo], None],
        every: int | None = None,
        *,
        final: bool = False,
        exiting: bool = False,
        first: bool = False,
    ) -> None:
        """Run `fn(info)` every `every` iterations (None or 0: never by count), and/or at the final iteration,
        at an exit-interval stop, after the first step."""
        self.hooks.append(Hook(fn, every, final, exiting, first))

    def run(self, info: StepInfo) -> None:
        for hook in self.hooks:
            if hook.due(info):
                hook.fn(info)


class StepTimer:
    """Seconds per step over a window of steps, the first step (compilation) apart, hooks' time excluded.

    `step_done` after each step; `lap` when logging (the mean step time since the last lap); `exclude_hooks` after
    the hooks: an empty window restarts there, so evaluation and saving never count as training time. `meter`
    (`runtime/energy.py`: `read()` cumulative joules or None, `source`) is read at the same instants, so
    `window` holds the last lap's joules over the same steps."""

    def __init__(self, block_until_ready: Callable[[Any], Any], meter=None):
        self._block = block_until_ready
        self.meter = meter
        self.wall_start = self._start = time.perf_counter()
        self._joules = self._read()
        self._steps = 0
        self.compile_time: float | None = None
        self.window: Window | None = None
        """The last lap's energy (`lap`)."""

    def _read(self) -> float | None:
        return self.meter.read() if self.meter is not None else None

    def step_done(self, metrics) -> bool:
        """Count a step; True for the first one, whose time (compilation included) is `compile_time`."""
        if self.compile_time is None:
            self._block(metrics)
            self.compile_time = time.perf_counter() - self._start
            return True
        self._steps += 1
        return False

    def lap(self, metrics) -> tuple[float, bool]:
        """(seconds per step since the last lap, whether that is the compile step's time) and a new window."""
        self._block(metrics)
        now = time.perf_counter()
        step_time = (now - self._start) / self._steps if self._steps else self.compile_time
        includes_compile = not self._steps
        joules = self._read()
        used = None if joules is None or self._joules is None else joules - self._joules
        self.window = Window(used, now - self._start, max(self._steps, 1))
        self._start, self._steps, self._joules = now, 0, joules
        return step_time, includes_compile

    def exclude_hooks(self) -> None:
        if self._steps == 0:
            self._start = time.perf_counter()
            self._joules = self._read()

    def wall_time(self) -> float:
        return time.perf_counter() - self.wall_start
