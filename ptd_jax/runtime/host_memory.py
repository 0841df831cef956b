"""Host memory for XLA:CPU steps: keep freed memory in the process instead of handing it back to the OS.

XLA:CPU allocates an execution's temporaries as one large block from one of its worker threads and frees it at the
end. glibc serves a block that large by mmap (it is above the dynamic mmap threshold, at most 32 MB, and no thread
arena holds it) and unmaps it on free, so every step writes to fresh pages and pays their minor page faults. Eager
PyTorch allocates each tensor on its own, below the threshold, from the heap, which glibc keeps: no faults after the
first step.

`keep_freed_host_memory()` makes glibc keep such blocks: M_ARENA_MAX 1 (every thread allocates from the main heap,
which can grow past the 64 MB a thread arena holds), M_MMAP_THRESHOLD and M_TRIM_THRESHOLD 2 GiB (blocks below
come from the heap, and the heap is not shrunk), so the next step reuses the same pages. The resident size then
stays at its peak, as with any caching allocator. The arena limit only binds threads that have not allocated yet:
call it before JAX's CPU backend starts (before the first computation); called later, it keeps only the blocks
that fit a worker thread's arena (under 64 MB). It changes only how glibc's malloc behaves in this process; a
no-op off glibc, or with PTD_JAX_KEEP_HOST_MEMORY=0.

It removes the page faults, but its effect on step time depends on the step: a large step gains, while a small
one loses to the single arena's lock (experiments/compare_torch/bench_cpu_step.py; the numbers are in
experiments/README.md). So it is opt-in: `ptd-train` calls it before the backend starts only with
PTD_JAX_KEEP_HOST_MEMORY=1, and the CPU benchmarks call it explicitly; nothing else (tests included) changes the
process's malloc.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
"""glibc's mallopt parameters (malloc.h)."""
KEEP = {M_ARENA_MAX: 1, M_MMAP_THRESHOLD: 2**31 - 1, M_TRIM_THRESHOLD: 2**31 - 1}


def _mallopt():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        _ = libc.gnu_get_libc_version  # glibc only (AttributeError elsewhere): musl's mallopt does nothing
        return libc.mallopt
    except (OSError, AttributeError):
        return None


def keep_freed_host_memory() -> bool:
    """Make glibc keep freed memory for reuse (see the module docstring). Returns whether it applied."""
    mallopt = _mallopt()
    if mallopt is None or os.environ.get("PTD_JAX_KEEP_HOST_MEMORY", "1") == "0":
        return False
    applied = [mallopt(param, value) == 1 for param, value in KEEP.items()]  # each one on its own
    return all(applied)
