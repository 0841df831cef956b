"""Writers that leave a whole output or nothing: write under a temporary name, rename on success, remove the
temporary on an error, Ctrl-C or SIGTERM (which `terminate_as_interrupt` turns into an exception, so that the same
clean-up runs; a scheduler's `timeout` or preemption sends it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from pathlib import Path


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by `terminate_as_interrupt` (a KeyboardInterrupt: Ctrl-C's clean-up runs)."""


@contextlib.contextmanager
def terminate_as_interrupt():
    """Inside, SIGTERM raises `Terminated` in the main thread (elsewhere, or outside, it keeps its handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated("SIGTERM")

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def atomic_folder(path):
    """Yield a temporary folder beside `path` to write into; on success it becomes `path` (which must not exist, or
    be an empty folder); on any failure it is removed, and `path` is left as it was."""
    path = Path(path).absolute()
    created = [parent for parent in path.parents if not parent.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        if path.is_dir():
            path.rmdir()  # empty: checked by the caller
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in created:  # innermost first: the folders made for it, if still empty
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
