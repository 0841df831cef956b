"""Stopping a run on a signal, with its checkpoints intact.

Ctrl-C (SIGINT): the first one stops the loop after the current step (and the checkpoint it may be writing), so
that the run ends with its checkpoints intact (the CLI exits 130); a second one interrupts at once.

SIGTERM (a scheduler's preemption, `kill`), in a one-process run: the loop stops after the current step, saves that
step when --save is set (as several processes do on their agreed stop), finishes the asynchronous write, says so in
one line naming the signal and exits 143 (128 + 15, the status a shell reports for a process SIGTERM ended:
`Terminated`). A second SIGTERM changes nothing: the save goes on (a scheduler's SIGKILL ends it if it must).
A SIGTERM during the last step still exits 143, without the JSON summary: the run was stopped, even if it had
nothing left to do (its final checkpoint is written).

With several processes, the first Ctrl-C becomes a SIGTERM, on which JAX's preemption sync makes every process stop
at the same step (`runtime/multiprocess.stop_agreed`); SIGTERM is left to JAX there.
"""

from __future__ import annotations

import sys

import jax

SIGTERM_EXIT_CODE = 143
"""128 + SIGTERM (15): the exit status of a run stopped by SIGTERM, as a shell reports one the signal ended."""


class Terminated(SystemExit):
    """Raised by `train()` after it stopped on SIGTERM and saved: the process ends with `SIGTERM_EXIT_CODE`, as
    SIGTERM's default action would have ended it, but after the checkpoint. `message` is the line already printed."""

    def __init__(self, message: str):
        super().__init__(SIGTERM_EXIT_CODE)
        self.message = message

    @classmethod
    def after(cls, where: str, primary: bool = True) -> Terminated:
        """The exception for a run stopped `where` ("after iteration N; newest checkpoint: ..."), its line printed
        to stderr (by process 0)."""
        message = f"ptd_jax: stopped by SIGTERM {where}"
        if primary:
            print(message, file=sys.stderr, flush=True)
        return cls(message)


class StopSignals:
    """While training: the signals that ask the loop to stop after the current step. `requested` names the first
    one ("SIGINT" or "SIGTERM"; None before). Only the main thread can take signals."""

    def __init__(self):
        import signal
        import threading

        self.requested: str | None = None
        self._forwarded = False
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._ctrl_c)
            if not jax.distributed.is_initialized():  # several processes: JAX's preemption notifier has SIGTERM
                self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._sigterm)

    @property
    def terminated(self) -> bool:
        """Whether SIGTERM came first (the loop then saves at the stop and the run exits 143)."""
        return self.requested == "SIGTERM"

    def _ctrl_c(self, signum, frame):
        import os
        import signal

        if self.requested or self._forwarded:
            raise KeyboardInterrupt
        print("ptd_jax: Ctrl-C: stopping after this step (again to stop at once)", file=sys.stderr)
        if jax.distributed.is_initialized():  # the processes agree on the step: JAX's preemption sync, on SIGTERM
            self._forwarded = True
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.requested = "SIGINT"

    def _sigterm(self, signum, frame):
        if self.requested:
            return
        print("ptd_jax: SIGTERM: stopping after this step, saving it if --save is set", file=sys.stderr)
        self.requested = "SIGTERM"

    def restore(self) -> None:
        import signal

        for signum, previous in self._previous.items():
            if previous is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(signum, previous)
        self._previous = {}
