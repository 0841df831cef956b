"""Megatron's indexed dataset (`MMIDIDX`), read and written byte-compatibly.

`PREFIX.bin` holds the raw tokens of every sequence back to back. `PREFIX.idx` is, little-endian:

    magic      9 bytes  b"MMIDIDX\\x00\\x00"
    version    u64      1
    dtype      u8       1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16
    sequences  u64      N
    documents  u64      D (length of the document index, which starts with 0: D = documents + 1)
    lengths    int32[N] tokens per sequence
    pointers   int64[N] byte offset of each sequence in .bin
    doc index  int64[D] sequence index where each document starts, then N

Files are written to temporary names and renamed, so a failed write leaves nothing half-written.

Derived files live in a cache folder, by default `cache/ptd_jax_indices/` beside the data (Megatron's
`--data-cache-path` defaults to a `cache/` folder there too); any other folder can be given. Beside the index
files of `gpt_dataset`, it holds `<name>.stats.json` per dataset: the smallest and largest token id and the token
count, with the .bin's size and mtime_ns and the .idx's size, so that a rewritten .bin is noticed and rescanned.
The writer stores it at `finalize` (freshly preprocessed data is never scanned); a dataset without it is scanned
once, in chunks, and the result stored where that is allowed. Nothing in the cache is needed: a read-only or
missing folder only costs the scan again.

Token ids are integers >= 0: the reader refuses the format's floating-point dtype codes when it opens a pair, and
negative ids (which a signed dtype can hold) when `max_token` reads the stats or scans.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
TOKEN_DTYPES = [np.dtype(v) for v in DTYPE_CODES.values() if np.dtype(v).kind in "iu"]
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


class DataError(ValueError):
    """Empty corpus, bad split string or a dataset too small for the request; the message names values.
    Defined here, at the bottom of the data package, so that preprocessing and datasets share it without
    importing each other."""


class IndexedDatasetError(ValueError):
    """A missing, corrupt or inconsistent .bin/.idx pair; the message names the file and the values."""


def best_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when every id fits, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def idx_path(prefix) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix) -> Path:
    return Path(f"{prefix}.bin")


def default_cache_dir(prefix) -> Path:
    """`cache/ptd_jax_indices` in the folder of the data, as Megatron's default `cache/` beside it."""
    return Path(prefix).parent / "cache" / "ptd_jax_indices"


STATS_VERSION = 2  # 2 added min_token; older stats files are rescanned once
_SCAN_CHUNK = 1 << 24  # tokens per chunk of the token-range scan (32 MiB of uint16)


def atomic_write(path: Path, write) -> bool:
    """`write(file)` into a temporary file in path's folder, then rename it to `path`. Best effort: returns False
    (leaving nothing behind) when the folder cannot be created or written."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError:
        return False
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def make_folders(folder: Path) -> list[Path]:
    """Create `folder` and its missing ancestors; returns those created, outermost first (for undoing). A file in
    the way is an IndexedDatasetError naming it."""
    missing = []
    while not folder.is_dir():
        if folder.exists() or folder.is_symlink():
            raise IndexedDatasetError(f"{folder} is not a folder: cannot write the dataset under it")
        missing.append(folder)
        folder = folder.parent
    created = []
    try:
        for path in reversed(missing):
            path.mkdir()
            created.append(path)
    except BaseException:
        for path in reversed(created):
            path.rmdir()
        raise
    return created


def file_key(prefix) -> dict:
    """What identifies one version of a .bin/.idx pair for the stats file: sizes and the .bin's mtime_ns."""
    bstat = bin_path(prefix).stat()
    return {"bin_bytes": bstat.st_size, "bin_mtime_ns": bstat.st_mtime_ns, "idx_bytes": idx_path(prefix).stat().st_size}


def stats_path(cache_dir, prefix) -> Path:
    return Path(cache_dir) / f"{Path(prefix).name}.stats.json"


def write_stats(prefix, cache_dir, *, min_token: int, max_token: int, num_tokens: int) -> bool:
    """Store the stats JSON of the pair at `prefix` in `cache_dir` (best effort)."""
    try:
        key = file_key(prefix)
    except OSError:
        return False
    stats = {
        "version": STATS_VERSION,
        **key,
        "min_token": int(min_token),
        "max_token": int(max_token),
        "num_tokens": int(num_tokens),
    }
    return atomic_write(stats_path(cache_dir, prefix), lambda f: f.write(json.dumps(stats).encode()))


def read_stats(prefix, cache_dir) -> dict | None:
    """The stats JSON in `cache_dir` if it describes the pair as it is now on disk, else None."""
    try:
        stats = json.loads(stats_path(cache_dir, prefix).read_text())
        key = file_key(prefix)
    except (OSError, ValueError):
        return None
    if not isinstance(stats, dict) or stats.get("version") != STATS_VERSION:
        return None
    if any(stats.get(name) != value for name, value in key.items()):
        return None
    return stats


def write_index(prefix, dtype, lengths, doc_index, path=None) -> Path:
    """PREFIX.idx (or `path`) for sequences of `lengths` tokens of `dtype` grouped by `doc_index`."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * dtype.itemsize
    doc_index = np.asarray(doc_index, dtype=np.int64)
    path = idx_path(prefix) if path is None else Path(path)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_index.tobytes())
    return path


class IndexedDatasetWriter:
    """Streams documents into PREFIX.bin/.idx, tracking the smallest and largest token id so that `finalize` can
    store the stats file in `cache_dir` (default: `default_cache_dir`).

    Both files are written under temporary names and renamed only once both are complete; the .bin's rename is
    undone when the .idx's fails. On any failure, a KeyboardInterrupt included, the temporaries and the folders
    the writer created are removed: a failed write leaves the disk as it was."""

    def __init__(self, prefix, dtype=np.uint16, cache_dir=None):
        self.prefix = str(prefix)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in TOKEN_DTYPES:
            raise IndexedDatasetError(
                f"dtype={self.dtype} is not an integer dtype of the format "
                f"({[str(d) for d in TOKEN_DTYPES]}): token ids are integers"
            )
        self._created = make_folders(Path(self.prefix).parent)
        self._tmp_bin = Path(f"{self.prefix}.bin.tmp{os.getpid()}")
        self._tmp_idx = Path(f"{self.prefix}.idx.tmp{os.getpid()}")
        try:
            self._bin = open(self._tmp_bin, "wb")
        except BaseException:
            self.abort()
            raise
        self.lengths: list[int] = []
        self.doc_index: list[int] = [0]
        self.min_token, self.max_token = None, -1

    def add_document(self, tokens) -> None:
        """One document made of one sequence (the GPT case)."""
        self.add_sequence(tokens)
        self.end_document()

    def add_sequence(self, tokens) -> None:
        array = np.asarray(tokens)
        if array.size > np.iinfo(np.int32).max:
            raise IndexedDatasetError(
                f"a sequence of {array.size} tokens is longer than the format's int32 "
                f"lengths allow ({np.iinfo(np.int32).max})"
            )
        if array.size:
            if array.dtype.kind not in "iu":
                raise IndexedDatasetError(f"token ids of dtype={array.dtype} are not integers")
            info, lo, hi = np.iinfo(self.dtype), int(array.min()), int(array.max())
            if lo < 0 or hi > info.max:
                raise IndexedDatasetError(
                    f"token ids in [{lo}, {hi}] do not fit dtype={self.dtype} (token ids are in [0, {info.max}])"
                )
            self.min_token = lo if self.min_token is None else min(self.min_token, lo)
            self.max_token = max(self.max_token, hi)
        self._bin.write(array.astype(self.dtype).tobytes(order="C"))
        self.lengths.append(int(array.size))

    def end_document(self) -> None:
        self.doc_index.append(len(self.lengths))

    def finalize(self) -> None:
        try:
            self._bin.close()
            write_index(self.prefix, self.dtype, self.lengths, self.doc_index, path=self._tmp_idx)
            self._rename_both()
        except BaseException:
            self.abort()
            raise
        write_stats(
            self.prefix,
            self.cache_dir,
            min_token=0 if self.min_token is None else self.min_token,
            max_token=self.max_token,
            num_tokens=int(sum(self.lengths)),
        )

    def _rename_both(self) -> None:
        """Temporaries -> PREFIX.bin and PREFIX.idx; if the second rename fails, the first is undone (the old
        .bin comes back from a hard link where the file system allows one, else the new one is removed)."""
        bin_dst, idx_dst = bin_path(self.prefix), idx_path(self.prefix)
        for dst in (bin_dst, idx_dst):
            if dst.is_dir():
                raise IndexedDatasetError(f"{dst} is a folder: the pair at prefix {self.prefix!r} cannot be written")
        backup = Path(f"{self.prefix}.bin.old{os.getpid()}")
        try:
            os.link(bin_dst, backup, follow_symlinks=False)
        except OSError:
            backup = None
        try:
            os.replace(self._tmp_bin, bin_dst)
            try:
                os.replace(self._tmp_idx, idx_dst)
            except BaseException:
                if backup is not None:
                    os.replace(backup, bin_dst)
                else:
                    bin_dst.unlink(missing_ok=True)
                raise
        finally:
            if backup is not None:
                backup.unlink(missing_ok=True)

    def abort(self) -> None:
        """Remove the temporaries and the folders this writer created (when they are empty)."""
        if getattr(self, "_bin", None) is not None:
            self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            path.unlink(missing_ok=True)
        for folder in reversed(self._created):
            try:
                folder.rmdir()
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Memory-mapped reader; validates the header and that .idx and .bin agree before any access. `cache_dir`
    (default: `default_cache_dir`) is where `token_range` looks for and stores the stats file. Opening reads the
    .idx only: the token ids are checked (>= 0) by `max_token`, from the stats or one scan."""

    def __init__(self, prefix, cache_dir=None):
        self.prefix = str(prefix)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(prefix)
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for path in (ipath, bpath):
            if not path.is_file():
                raise IndexedDatasetError(f"missing file {path} (expected a .bin/.idx pair at prefix {prefix!r})")
        idx_size = ipath.stat().st_size
        with open(ipath, "rb") as f:
            header = f.read(_HEADER)
        if len(header) < _HEADER:
            raise IndexedDatasetError(f"{ipath} is truncated: {idx_size} bytes, header needs {_HEADER}")
        if header[: len(MAGIC)] != MAGIC:
            raise IndexedDatasetError(f"{ipath} has magic {header[: len(MAGIC)]!r}, expected {MAGIC!r}")
        version, code, num_seq, num_docs = struct.unpack("<QBQQ", header[len(MAGIC) :])
        if version != VERSION:
            raise IndexedDatasetError(f"{ipath} has version={version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{ipath} has dtype code={code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype not in TOKEN_DTYPES:
            raise IndexedDatasetError(
                f"{ipath} has dtype code={code} ({self.dtype}): token ids must be integers, "
                f"codes {sorted(CODE_OF_DTYPE[d] for d in TOKEN_DTYPES)}"
            )
        expected = _HEADER + 4 * num_seq + 8 * num_seq + 8 * num_docs
        if idx_size < expected:
            raise IndexedDatasetError(
                f"{ipath} is truncated: {idx_size} bytes for sequences={num_seq} documents={num_docs} "
                f"(needs {expected})"
            )
        index = np.memmap(ipath, mode="r", dtype=np.uint8)
        offset = _HEADER
        self.lengths = np.frombuffer(index, dtype=np.int32, count=num_seq, offset=offset)
        offset += 4 * num_seq
        self.pointers = np.frombuffer(index, dtype=np.int64, count=num_seq, offset=offset)
        offset += 8 * num_seq
        self.doc_index = np.frombuffer(index, dtype=np.int64, count=num_docs, offset=offset)
        bin_size = bpath.stat().st_size
        self.bin_bytes, self.idx_bytes = bin_size, idx_size
        total_tokens = int(self.lengths.astype(np.int64).sum())
        if bin_size != total_tokens * self.dtype.itemsize:
            raise IndexedDatasetError(
                f"{bpath} has {bin_size} bytes but {ipath} describes {total_tokens} tokens of {self.dtype} "
                f"({total_tokens * self.dtype.itemsize} bytes)"
            )
        if num_seq:
            expected_ptr = np.concatenate([[0], np.cumsum(self.lengths[:-1], dtype=np.int64)]) * self.dtype.itemsize
            if not np.array_equal(expected_ptr, self.pointers):
                raise IndexedDatasetError(f"{ipath} has sequence pointers that disagree with its lengths")
        if num_docs and (
            self.doc_index[0] != 0 or self.doc_index[-1] != num_seq or np.any(np.diff(self.doc_index) < 0)
        ):
            raise IndexedDatasetError(f"{ipath} has a document index that does not run from 0 to sequences={num_seq}")
        self._num_tokens = total_tokens
        self._bin = np.memmap(bpath, mode="r", dtype=self.dtype) if total_tokens else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id in .bin ((0, -1) when empty): from the stats file in `cache_dir` (or the
        default cache, where the writer puts it) if it matches the files; else one chunked scan, then stored (best
        effort)."""
        for directory in dict.fromkeys([self.cache_dir, default_cache_dir(self.prefix)]):
            stats = read_stats(self.prefix, directory)
            if stats is not None and stats.get("num_tokens") == self.num_tokens and "min_token" in stats:
                return int(stats["min_token"]), int(stats["max_token"])
        smallest, largest = (0, -1) if self._bin.size == 0 else (int(self._bin[0]), int(self._bin[0]))
        for start in range(0, self._bin.size, _SCAN_CHUNK):
            chunk = self._bin[start : start + _SCAN_CHUNK]
            smallest, largest = min(smallest, int(chunk.min())), max(largest, int(chunk.max()))
        write_stats(self.prefix, self.cache_dir, min_token=smallest, max_token=largest, num_tokens=self.num_tokens)
        return smallest, largest

    def max_token(self) -> int:
        """Largest token id in .bin (-1 when empty), as `token_range`; negative ids are an IndexedDatasetError."""
        smallest, largest = self.token_range()
        if smallest < 0:
            raise IndexedDatasetError(
                f"{bin_path(self.prefix)} holds token id {smallest} ({self.dtype}): token ids must be >= 0"
            )
        return largest

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence `index`."""
        start = int(self.pointers[index]) // self.dtype.itemsize + offset
        stop = start + (int(self.lengths[index]) - offset if length is None else length)
        return np.asarray(self._bin[start:stop])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(index)

    def read_pieces(self, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Tokens [starts[j], starts[j] + counts[j]) of .bin (token offsets) for every j, back to back.

        One positioned read per piece into the output, not page faults on the memory map: with a cold page cache
        each fault reads the device's whole read-ahead window (8 MiB on the development machine), and a batch of
        512 windows of 2049 tokens took 1.7 s through the map against 0.15 s this way (0.004 s and 0.008 s when
        the pages are cached)."""
        counts = np.asarray(counts, dtype=np.int64)
        out = np.empty(int(counts.sum()), self.dtype)
        if not hasattr(os, "preadv"):  # no positioned vector reads on this platform: go through the map
            return self._bin[np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(len(out))]
        buffer, done, size = memoryview(out).cast("B"), 0, self.dtype.itemsize
        with open(bin_path(self.prefix), "rb", buffering=0) as f:
            for start, count in zip((np.asarray(starts) * size).tolist(), (counts * size).tolist()):
                if count and os.preadv(f.fileno(), [buffer[done : done + count]], start) != count:
                    raise IndexedDatasetError(f"{bin_path(self.prefix)} is shorter than {start + count} bytes")
                done += count
        return out
