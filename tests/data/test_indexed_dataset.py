import json
import os
import struct

import numpy as np
import pytest

from ptd_jax.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    best_dtype,
    default_cache_dir,
)


def write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        for doc in docs:
            writer.add_document(doc)


DOCS = [[1, 2, 3], [256, 7], [9, 9, 9, 9, 9], [42]]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64])
def test_round_trip(tmp_path, dtype):
    prefix = tmp_path / "ds"
    docs = [[x % 250 for x in d] for d in DOCS] if dtype == np.uint8 else DOCS
    write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and ds.dtype == np.dtype(dtype) and ds.num_tokens == 11
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds.get(2, offset=1, length=3), [9, 9, 9])


def test_header_bytes_are_megatrons(tmp_path):
    """The .idx bytes, assembled by hand from the format description (not by our writer)."""
    prefix = tmp_path / "ds"
    write(prefix, DOCS, np.uint16)
    lengths = [3, 2, 5, 1]
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", 8)
        + struct.pack("<Q", 4)
        + struct.pack("<Q", 5)
        + struct.pack("<4i", *lengths)
        + struct.pack("<4q", 0, 6, 10, 20)  # byte pointers: cumulative lengths x 2 bytes
        + struct.pack("<5q", 0, 1, 2, 3, 4)
    )  # document index starts at 0 and ends at N
    assert (tmp_path / "ds.idx").read_bytes() == expected
    assert (tmp_path / "ds.bin").read_bytes() == np.array(sum(DOCS, []), dtype="<u2").tobytes()


def test_reads_a_hand_made_megatron_file_with_multi_sequence_documents(tmp_path):
    seqs = [[5, 6], [7], [8, 9, 10]]
    (tmp_path / "m.bin").write_bytes(np.array(sum(seqs, []), dtype="<i4").tobytes())
    (tmp_path / "m.idx").write_bytes(
        b"MMIDIDX\x00\x00"
        + struct.pack("<QBQQ", 1, 4, 3, 3)
        + struct.pack("<3i", 2, 1, 3)
        + struct.pack("<3q", 0, 8, 12)
        + struct.pack("<3q", 0, 2, 3)
    )  # two documents: seqs {0,1} and {2}
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32 and list(ds.doc_index) == [0, 2, 3]
    np.testing.assert_array_equal(ds[2], [8, 9, 10])


def test_best_dtype():
    assert best_dtype(257) == np.uint16 and best_dtype(100_000) == np.int32


def test_missing_file(tmp_path):
    with pytest.raises(IndexedDatasetError, match=r"missing file .*nothing\.idx"):
        IndexedDataset(tmp_path / "nothing")


def test_wrong_magic(tmp_path):
    write(tmp_path / "ds", DOCS)
    data = bytearray((tmp_path / "ds.idx").read_bytes())
    data[:7] = b"XXXXXXX"
    (tmp_path / "ds.idx").write_bytes(bytes(data))
    with pytest.raises(IndexedDatasetError, match=r"has magic b'XXXXXXX"):
        IndexedDataset(tmp_path / "ds")


@pytest.mark.parametrize("keep", [10, 40, 70])
def test_truncated_index(tmp_path, keep):
    write(tmp_path / "ds", DOCS)
    (tmp_path / "ds.idx").write_bytes((tmp_path / "ds.idx").read_bytes()[:keep])
    with pytest.raises(IndexedDatasetError, match=r"is truncated: \d+ bytes"):
        IndexedDataset(tmp_path / "ds")


def test_bin_size_disagrees(tmp_path):
    write(tmp_path / "ds", DOCS)
    (tmp_path / "ds.bin").write_bytes((tmp_path / "ds.bin").read_bytes()[:-2])
    with pytest.raises(IndexedDatasetError, match=r"has 20 bytes but .* describes 11 tokens of uint16 \(22 bytes\)"):
        IndexedDataset(tmp_path / "ds")


def test_bad_dtype_code_and_version(tmp_path):
    write(tmp_path / "ds", DOCS)
    raw = bytearray((tmp_path / "ds.idx").read_bytes())
    raw[17] = 99
    (tmp_path / "ds.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match=r"dtype code=99"):
        IndexedDataset(tmp_path / "ds")
    raw[17], raw[9] = 8, 2
    (tmp_path / "ds.idx").write_bytes(bytes(raw))
    with pytest.raises(IndexedDatasetError, match=r"version=2"):
        IndexedDataset(tmp_path / "ds")


def test_failed_write_leaves_nothing(tmp_path):
    with (
        pytest.raises(IndexedDatasetError, match=r"do not fit dtype=uint8"),
        IndexedDatasetWriter(tmp_path / "ds", dtype=np.uint8) as writer,
    ):
        writer.add_document([1, 2])
        writer.add_document([300])
    assert list(tmp_path.iterdir()) == []


def test_the_writer_stores_the_stats_and_max_token_reads_them(tmp_path):
    """With the stats file in place max_token() does not read the .bin: a byte changed behind its back (size
    and mtime restored) goes unnoticed; a .bin changed in the normal way (new mtime) is scanned again."""
    write(tmp_path / "ds", DOCS)
    stats = json.loads((default_cache_dir(tmp_path / "ds") / "ds.stats.json").read_text())
    assert stats["max_token"] == 256 and stats["num_tokens"] == 11
    assert stats["bin_bytes"] == 22 and stats["idx_bytes"] == (tmp_path / "ds.idx").stat().st_size
    bin_file = tmp_path / "ds.bin"
    before = bin_file.stat()
    raw = bytearray(bin_file.read_bytes())
    raw[0:2] = struct.pack("<H", 999)
    bin_file.write_bytes(bytes(raw))
    os.utime(bin_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert IndexedDataset(tmp_path / "ds").max_token() == 256  # from the stats file, not the bytes
    os.utime(bin_file, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert IndexedDataset(tmp_path / "ds").max_token() == 999  # stale stats: scanned again, then stored
    assert json.loads((default_cache_dir(tmp_path / "ds") / "ds.stats.json").read_text())["max_token"] == 999


def test_data_without_stats_is_scanned_once(tmp_path):
    tokens = np.arange(3 * 7, dtype="<u2")[::-1].copy()
    (tmp_path / "m.bin").write_bytes(tokens.tobytes())
    (tmp_path / "m.idx").write_bytes(
        b"MMIDIDX\x00\x00"
        + struct.pack("<QBQQ", 1, 8, 3, 4)
        + struct.pack("<3i", 7, 7, 7)
        + struct.pack("<3q", 0, 14, 28)
        + struct.pack("<4q", 0, 1, 2, 3)
    )
    stats_file = default_cache_dir(tmp_path / "m") / "m.stats.json"
    assert not stats_file.exists()
    assert IndexedDataset(tmp_path / "m").max_token() == 20
    assert json.loads(stats_file.read_text())["max_token"] == 20


def test_stats_in_another_cache_folder_and_an_unwritable_one(tmp_path):
    write(tmp_path / "ds", DOCS)
    other = tmp_path / "elsewhere"
    assert IndexedDataset(tmp_path / "ds", cache_dir=other).max_token() == 256  # the writer's copy is found
    (default_cache_dir(tmp_path / "ds") / "ds.stats.json").unlink()
    assert IndexedDataset(tmp_path / "ds", cache_dir=other).max_token() == 256  # scanned, stored in `other`
    assert json.loads((other / "ds.stats.json").read_text())["max_token"] == 256
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert IndexedDataset(tmp_path / "ds", cache_dir=blocker / "c").max_token() == 256
    assert not list(tmp_path.rglob("*.tmp"))


def test_megatron_bytes_do_not_change_with_the_stats(tmp_path):
    """The stats go to the cache folder; the pair itself is what Megatron writes (see the hand-made bytes above)."""
    write(tmp_path / "ds", DOCS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "ds.bin", "ds.idx"]


@pytest.mark.parametrize("positioned_reads", [True, False])
def test_read_pieces(tmp_path, monkeypatch, positioned_reads):
    write(tmp_path / "ds", DOCS)
    if not positioned_reads:
        monkeypatch.delattr(os, "preadv")  # the memory-map fallback
    ds = IndexedDataset(tmp_path / "ds")
    tokens = np.asarray(sum(DOCS, []))
    starts, counts = np.array([9, 0, 4, 10, 3]), np.array([2, 3, 0, 1, 6])
    expected = np.concatenate([tokens[a : a + n] for a, n in zip(starts, counts)])
    got = ds.read_pieces(starts, counts)
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, expected)
    with pytest.raises((IndexedDatasetError, IndexError)):
        ds.read_pieces(np.array([10]), np.array([5]))  # beyond the end of .bin
