"""Ctrl-C during training: the first one stops the loop after the current step (and the checkpoint it may be
writing), so that the run ends with its checkpoints intact (the CLI exits 130); a second one interrupts at once.
With several processes, the first Ctrl-C becomes a SIGTERM, on which JAX's preemption sync makes every process stop
at the same step."""

from __future__ import annotations

import sys

import jax


class CtrlC:
    """While training: the first Ctrl-C (SIGINT) only asks the loop to stop after the current step (and the save
    it may be writing); a second one interrupts at once. Only the main thread can take signals."""

    def __init__(self):
        import signal
        import threading

        self.requested = False
        self._forwarded = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        import os
        import signal

        if self.requested or self._forwarded:
            raise KeyboardInterrupt
        print("ptd_jax: Ctrl-C: stopping after this step (again to stop at once)", file=sys.stderr)
        if jax.distributed.is_initialized():  # the processes agree on the step: JAX's preemption sync, on SIGTERM
            self._forwarded = True
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.requested = True

    def restore(self) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
