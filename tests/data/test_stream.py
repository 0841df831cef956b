"""The endless per-epoch stream (ptd_jax/data/gpt_dataset.py, module docstring): samples do not depend on how
many are read, nothing repeats inside an epoch, epochs differ. The reference below re-derives an epoch from the
documented rule (SeedSequence([seed, stream, epoch]) -> permutation of sequences, then of windows), concatenates
the documents and slices, without looking at the dataset's own arrays."""

from collections import Counter

import numpy as np
import pytest

from ptd_jax.data import GPTData, GPTDataset, split_documents
from ptd_jax.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter

S = 16


@pytest.fixture(scope="module")
def random_corpus(tmp_path_factory):
    """120 documents of random tokens (so every window's contents are unique), one of them empty and some
    longer than a sample."""
    rng = np.random.default_rng(0)
    prefix = tmp_path_factory.mktemp("random") / "random"
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for i in range(120):
            writer.add_document(rng.integers(0, 60000, size=0 if i == 7 else int(rng.integers(1, 50))))
    return prefix


def reference_epoch(indexed, docs, seq_length, seed, stream, epoch):
    """All windows of one epoch, from the documented rule."""
    first, stop = int(indexed.doc_index[docs[0]]), int(indexed.doc_index[docs[-1] + 1])
    tokens = int(indexed.lengths[first:stop].astype(np.int64).sum())
    per_epoch = (tokens - 1) // seq_length
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, epoch])))
    order = first + rng.permutation(stop - first)
    shuffle = rng.permutation(per_epoch)
    concatenation = np.concatenate([indexed[int(j)] for j in order]).astype(np.int32)
    return np.stack([concatenation[w * seq_length : w * seq_length + seq_length + 1] for w in shuffle])


def test_first_samples_do_not_depend_on_how_many_are_read(small_corpus):
    """A run of 20 iterations and one of 2000 (B = 8) read the same first 160 samples; the long one runs over
    many epochs of this small corpus and every sample there matches the reference."""
    args = dict(seq_length=S, global_batch_size=8, eval_iters=0, seed=3)
    short, long = GPTData(small_corpus, **args), GPTData(small_corpus, **args)
    short_run = np.concatenate([short.train_batch(i).tokens for i in range(20)])
    long_run = np.concatenate([long.train_samples(first, 800).tokens for first in range(0, 2000 * 8, 800)])
    np.testing.assert_array_equal(short_run, long_run[:160])
    per_epoch = long.train.samples_per_epoch
    assert 2000 * 8 // per_epoch >= 10
    docs = split_documents(len(long.indexed.doc_index) - 1, "969,30,1")[0]
    for e in (0, 1, 2000 * 8 // per_epoch - 1):
        expected = reference_epoch(long.indexed, docs, S, 3, 0, e)[:, :-1]
        got = long_run[e * per_epoch : (e + 1) * per_epoch]
        np.testing.assert_array_equal(got, expected[: len(got)])
    deep = 10**7 + 5  # far beyond any run: still a window of its own epoch
    e, i = divmod(deep, per_epoch)
    np.testing.assert_array_equal(long.train[deep], reference_epoch(long.indexed, docs, S, 3, 0, e)[i])


@pytest.mark.parametrize("seed,stream", [(0, 0), (5, 1)])
def test_no_sample_repeats_within_an_epoch(random_corpus, seed, stream):
    indexed = IndexedDataset(random_corpus)
    docs = np.arange(10, 110)
    ds = GPTDataset(indexed, docs, S, seed, stream)
    split_tokens = Counter(np.concatenate([indexed[int(j)] for j in range(docs[0], docs[-1] + 1)]).tolist())
    n = ds.samples_per_epoch
    assert n == (sum(split_tokens.values()) - 1) // S
    for e in (0, 1):
        samples = ds.batch(e * n, n)
        assert samples.dtype == np.int32 and samples.shape == (n, S + 1)
        assert len({s.tobytes() for s in samples}) == n
        used = Counter(samples[:, :-1].ravel().tolist())
        assert not used - split_tokens, "an epoch used some tokens more often than the split holds them"
        np.testing.assert_array_equal(samples, reference_epoch(indexed, docs, S, seed, stream, e))


def test_epoch_order_changes_between_epochs_and_with_the_seed_and_stream(random_corpus):
    indexed = IndexedDataset(random_corpus)
    docs = np.arange(100)
    base = GPTDataset(indexed, docs, S, seed=1)
    others = [GPTDataset(indexed, docs, S, seed=2), GPTDataset(indexed, docs, S, seed=1, stream=1)]
    e0, e1 = base.epoch(0), base.epoch(1)
    assert sorted(e0.order.tolist()) == sorted(e1.order.tolist()) == list(range(int(indexed.doc_index[100])))
    assert not np.array_equal(e0.order, e1.order) and not np.array_equal(e0.shuffle, e1.shuffle)
    for other in others:
        assert not np.array_equal(other.epoch(0).order, e0.order)
        assert not np.array_equal(other.batch(0, 8), base.batch(0, 8))
    assert np.array_equal(GPTDataset(indexed, docs, S, seed=1).batch(0, 64), base.batch(0, 64))


def test_multi_sequence_documents_and_empty_sequences(tmp_path):
    """Megatron files may group several sequences into one document: a split takes all of their sequences."""
    with IndexedDatasetWriter(tmp_path / "m", dtype=np.int32) as writer:
        rng = np.random.default_rng(1)
        for d in range(30):
            for _ in range(d % 3 + 1):
                writer.add_sequence(rng.integers(0, 10**6, size=int(rng.integers(0, 20))))
            writer.end_document()
    indexed = IndexedDataset(tmp_path / "m")
    docs = np.arange(5, 25)
    ds = GPTDataset(indexed, docs, 8, seed=4)
    assert ds.num_sequences == int(indexed.doc_index[25] - indexed.doc_index[5])
    n = ds.samples_per_epoch
    for e in (0, 2):
        np.testing.assert_array_equal(ds.batch(e * n, n), reference_epoch(indexed, docs, 8, 4, 0, e))
