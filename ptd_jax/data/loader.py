"""Batches computed ahead of the training step, on one background thread.

`prefetch(make, indices)` yields make(i) for i in indices, in order, while up to `depth` of the next ones are
being built by a worker thread. numpy releases the GIL in the gathers and copies that make a batch, so the
next batch is cut while the step runs. An exception raised by `make` reaches the consumer at the item that
raised it; closing the generator early (a `break`, garbage collection) cancels what was queued and joins the
thread. Pure Python; the step that consumes the batches is not imported here.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar
from collections.abc import Callable, Iterable, Iterator

T = TypeVar("T")


def prefetch(make: Callable[[int], T], indices: Iterable[int], depth: int = 2) -> Iterator[T]:
    """make(i) for i in indices, in order, computed up to `depth` items ahead on one thread."""
    if depth < 1:
        raise ValueError(f"depth={depth} must be >= 1")
    pending: deque = deque()
    remaining = iter(indices)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ptd-prefetch")
    try:
        for index in remaining:
            pending.append(pool.submit(make, index))
            if len(pending) >= depth:
                break
        while pending:
            result = pending.popleft().result()
            for index in remaining:  # keep `depth` items in flight while the consumer works on this one
                pending.append(pool.submit(make, index))
                break
            yield result
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
