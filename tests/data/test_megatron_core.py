"""Our .bin/.idx against megatron-core's own IndexedDataset and IndexedDatasetBuilder, both directions and byte for
byte (the test extra installs megatron-core with CPU torch)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")

from ptd_jax.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter  # noqa: E402


def documents(dtype):
    rng = np.random.RandomState(0)
    high = 257 if dtype == np.uint16 else 70000
    return [rng.randint(0, high, size=rng.randint(1, 50)).astype(dtype) for _ in range(23)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_core_reads_what_we_write_and_writes_what_we_read_byte_for_byte(tmp_path, dtype):
    docs = documents(dtype)
    ours = tmp_path / "ours"
    with IndexedDatasetWriter(ours, dtype=dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    theirs = tmp_path / "theirs"
    builder = mcore.IndexedDatasetBuilder(f"{theirs}.bin", dtype=dtype)
    for doc in docs:
        builder.add_item(torch.from_numpy(doc.astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{theirs}.idx")

    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "theirs.idx").read_bytes()
    read_by_them, read_by_us = mcore.IndexedDataset(str(ours)), IndexedDataset(theirs)
    assert len(read_by_them) == len(read_by_us) == len(docs)
    np.testing.assert_array_equal(read_by_them.document_indices, read_by_us.doc_index)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(read_by_them[i], doc)
        np.testing.assert_array_equal(read_by_us[i], doc)
