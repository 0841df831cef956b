"""The epoch index cache beside the data (ptd_jax/data/gpt_dataset.py, "The index cache")."""

import numpy as np
import pytest

from ptd_jax.data import GPTData, GPTDataset, gpt_dataset
from ptd_jax.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, default_cache_dir


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    prefix = tmp_path / "data" / "c"
    with IndexedDatasetWriter(prefix) as writer:
        for _ in range(50):
            writer.add_document(rng.integers(0, 60000, size=int(rng.integers(1, 40))))
    return prefix


def files(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_forced_cache_writes_epochs_and_a_second_dataset_loads_them(corpus, monkeypatch):
    cache = default_cache_dir(corpus)
    assert cache == corpus.parent / "cache" / "ptd_jax_indices"
    first = GPTDataset(IndexedDataset(corpus), np.arange(50), 8, seed=1, cache_min_size=0)
    n = first.samples_per_epoch
    samples = first.batch(0, 2 * n + 3)  # epochs 0, 1 and 2
    npy = [f for f in files(cache) if f.endswith(".npy")]
    assert npy == sorted(f"{first.key}_e{e}_{name}.npy" for e in range(3) for name in ("ends", "order", "shuffle"))

    def no_recompute(*args):
        raise AssertionError("the epoch was recomputed instead of loaded")

    monkeypatch.setattr(gpt_dataset, "epoch_rng", no_recompute)
    second = GPTDataset(IndexedDataset(corpus), np.arange(50), 8, seed=1, cache_min_size=0)
    assert second.key == first.key
    assert isinstance(second.epoch(1).order, np.memmap)
    np.testing.assert_array_equal(second.batch(0, 2 * n + 3), samples)
    for e in range(3):
        for a, b in zip(first.epoch(e), second.epoch(e)):
            np.testing.assert_array_equal(a, b)
    assert not [f for f in files(cache) if "tmp" in f]


def test_small_epochs_are_not_written_by_default(corpus):
    ds = GPTDataset(IndexedDataset(corpus), np.arange(50), 8, seed=1)
    ds.batch(0, 100)
    assert [f for f in files(default_cache_dir(corpus)) if f.endswith(".npy")] == []


def test_the_key_changes_with_what_the_arrays_depend_on(corpus):
    indexed = IndexedDataset(corpus)
    keys = {
        GPTDataset(indexed, np.arange(50), 8, seed=1).key,
        GPTDataset(indexed, np.arange(50), 8, seed=2).key,
        GPTDataset(indexed, np.arange(50), 8, seed=1, stream=1).key,
        GPTDataset(indexed, np.arange(50), 9, seed=1).key,
        GPTDataset(indexed, np.arange(49), 8, seed=1).key,
    }
    assert len(keys) == 5


def test_an_unwritable_cache_still_works_and_leaves_nothing(corpus, tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    expected = GPTDataset(IndexedDataset(corpus), np.arange(50), 8, seed=1).batch(0, 300)
    ds = GPTDataset(IndexedDataset(corpus), np.arange(50), 8, seed=1, cache_dir=blocker / "cache", cache_min_size=0)
    np.testing.assert_array_equal(ds.batch(0, 300), expected)
    data = GPTData(
        corpus,
        seq_length=8,
        global_batch_size=4,
        eval_iters=1,
        seed=1,
        split="9,1,0",
        vocab_size=60000,
        cache_dir=blocker / "cache",
    )
    assert data.train_batch(0).tokens.shape == (4, 8)
    assert files(tmp_path) == ["data", "not_a_folder"]


def test_a_read_only_cache_folder(corpus, tmp_path, monkeypatch):
    """A folder that refuses new files (as chmod 0o555 does for anyone but root, who runs these tests here): the
    dataset computes its arrays in memory, gives the same batches and writes nothing."""
    import ptd_jax.data.indexed_dataset as indexed_dataset

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    folder = tmp_path / "ro"
    folder.mkdir()
    expected = GPTDataset(IndexedDataset(corpus), np.arange(50), 8, seed=1).batch(0, 50)
    monkeypatch.setattr(indexed_dataset.tempfile, "mkstemp", refused)
    ds = GPTDataset(IndexedDataset(corpus), np.arange(50), 8, seed=1, cache_dir=folder, cache_min_size=0)
    np.testing.assert_array_equal(ds.batch(0, 50), expected)
    assert files(folder) == []


def test_a_failed_write_leaves_no_temporary_file(corpus, monkeypatch):
    def failing_save(f, array):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "save", failing_save)
    ds = GPTDataset(IndexedDataset(corpus), np.arange(50), 8, seed=1, cache_min_size=0)
    assert ds.batch(0, 10).shape == (10, 9)
    assert [f for f in files(default_cache_dir(corpus)) if not f.endswith(".stats.json")] == []


def test_a_corrupt_cache_file_is_recomputed(corpus):
    ds = GPTDataset(IndexedDataset(corpus), np.arange(50), 8, seed=1, cache_min_size=0)
    expected = ds.batch(0, 20)
    path = ds.cache_paths(0)["shuffle"]
    path.write_bytes(path.read_bytes()[:-8])
    again = GPTDataset(IndexedDataset(corpus), np.arange(50), 8, seed=1, cache_min_size=0)
    np.testing.assert_array_equal(again.batch(0, 20), expected)
    assert np.load(path).shape == (ds.samples_per_epoch,)  # rewritten whole
