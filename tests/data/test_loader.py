import threading
import time

import pytest

from ptd_jax.data.loader import prefetch


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ptd-prefetch")]


def test_items_come_in_order_and_are_computed_ahead():
    made = []

    def make(i):
        made.append(i)
        time.sleep(0.002 * (i % 3))  # uneven work must not reorder anything
        return i * i

    stream = prefetch(make, range(10), depth=3)
    assert next(stream) == 0
    deadline = time.monotonic() + 5
    while len(made) < 4 and time.monotonic() < deadline:  # item 0 handed over, 1..3 in flight
        time.sleep(0.001)
    assert made[:4] == [0, 1, 2, 3]
    assert list(stream) == [i * i for i in range(1, 10)]
    assert made == list(range(10)) and prefetch_threads() == []


def test_an_exception_reaches_the_consumer_at_its_item():
    def make(i):
        if i == 3:
            raise KeyError(f"sample {i}")
        return i

    got = []
    with pytest.raises(KeyError, match="sample 3"):
        for item in prefetch(make, range(10)):
            got.append(item)
    assert got == [0, 1, 2] and prefetch_threads() == []


def test_closing_early_stops_the_thread_and_the_work():
    made, release = [], threading.Event()

    def make(i):
        made.append(i)
        release.wait(5) if i == 2 else None
        return i

    stream = prefetch(make, iter(range(10**9)), depth=2)  # an endless index stream
    assert next(stream) == 0
    release.set()
    stream.close()
    assert prefetch_threads() == [] and max(made) <= 3
    for item in prefetch(make, range(5)):
        if item == 1:
            break  # a for-loop break closes the generator when it is dropped
    assert prefetch_threads() == []


def test_empty_indices_and_bad_depth():
    assert list(prefetch(lambda i: i, [])) == []
    with pytest.raises(ValueError, match="depth=0 must be >= 1"):
        list(prefetch(lambda i: i, range(3), depth=0))


def test_prefetched_batches_equal_direct_ones(small_corpus):
    """The loop's use: GPTData batches built on the prefetch thread while the main thread reads others."""
    from ptd_jax.data import GPTData

    data = GPTData(small_corpus, seq_length=32, global_batch_size=8, eval_iters=0, seed=1)
    direct = GPTData(small_corpus, seq_length=32, global_batch_size=8, eval_iters=0, seed=1)
    for i, batch in enumerate(prefetch(data.train_batch, range(0, 3000, 97), depth=3)):
        data.train_batch(i)  # the main thread uses the same dataset meanwhile
        assert (batch.tokens == direct.train_batch(i * 97).tokens).all()
