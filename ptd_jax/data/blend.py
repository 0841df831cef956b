"""Data blends (Megatron's `--data-path w1 prefix1 w2 prefix2 ...` and `BlendedDataset`): several sample streams
mixed in proportion to normalised weights.

**The rule** (megatron/core/datasets/helpers.cpp `build_blending_indices`). Sample i of the blend comes from the
dataset j whose error w_j·max(i, 1) − c_j is largest (the first such j on a tie), where c_j counts the samples
already drawn from j; it is that dataset's sample c_j, then c_j grows by one. So the blend of n samples draws
within one sample of w_j·n from each dataset, and dataset j's samples are read in order 0, 1, 2, ...

**Endless, as the plain stream.** The rule needs only i and the counts, never the number of samples asked for, so
the blend is cut into blocks of `BLOCK` samples: block b is the rule run over samples [b·BLOCK, (b+1)·BLOCK) from
the counts at its first sample, and sample k is the same however long the run is (Megatron instead builds the
index for the run's total). Each component is an endless stream itself (`GPTDataset`), so any count is a sample.

**The cache.** Block b is stored as `<hash>_blend_b<b>_{dataset_index,dataset_sample_index,counts}.npy` (int16,
int64, and the counts at its first sample) in the cache folder, beside the data like the epochs' arrays, and
memory-mapped by later runs; the hash covers the format, the block size and the normalised weights (the index
depends on nothing else). Building a block takes a Python loop of about a microsecond per sample and dataset.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ptd_jax.data.indexed_dataset import DataError, atomic_write

BLEND_FORMAT = 1
BLOCK = 1 << 16
"""Samples per block of the blend index (a block is built, cached and loaded as one)."""
MAX_DATASETS = 1 << 15
"""Megatron's dataset index is int16."""
_BLOCKS_IN_MEMORY = 4


def parse_blend(flag: str, words) -> list[tuple[float, str]]:
    """Megatron's blend words -> [(weight, prefix)], weights as written. One word is a prefix of weight 1;
    otherwise the words alternate weight, prefix. Refuses (one line naming the values) an odd count, a weight
    that is not a finite number, a negative weight and weights summing to zero."""
    words = [words] if isinstance(words, (str, Path)) else [str(w) for w in words]
    if len(words) == 1:
        return [(1.0, str(words[0]))]
    if not words or len(words) % 2:
        raise DataError(
            f"{flag} needs one prefix or pairs of weight and prefix (w1 prefix1 w2 prefix2 ...), got "
            f"{len(words)} values: {' '.join(map(str, words))}"
        )
    pairs = []
    for weight, prefix in zip(words[::2], words[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise DataError(
                f"{flag}: weight {weight!r} (before {prefix!r}) is not a number; give pairs of weight "
                f"and prefix (w1 prefix1 w2 prefix2 ...)"
            ) from None
        if not math.isfinite(value):
            raise DataError(f"{flag}: weight {weight!r} of {prefix!r} is not a finite number")
        if value < 0:
            raise DataError(f"{flag}: weight {value} of {prefix!r} is negative; weights must be >= 0")
        pairs.append((value, prefix))
    if sum(w for w, _ in pairs) <= 0:
        raise DataError(f"{flag}: the weights {[w for w, _ in pairs]} sum to zero; at least one must be positive")
    if len(pairs) > MAX_DATASETS:
        raise DataError(f"{flag}: {len(pairs)} datasets in one blend, more than {MAX_DATASETS}")
    return pairs


def normalize(weights) -> np.ndarray:
    """float64 weights / their sum, computed as megatron.core.datasets.utils.normalize (so the index matches)."""
    w = np.asarray(weights, dtype=np.float64)
    return w / np.sum(w)


def blending_indices(weights, first: int, size: int, counts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule over samples [first, first + size) from `counts` (samples drawn from each dataset before `first`):
    (dataset_index int16 [size], dataset_sample_index int64 [size], counts after them int64 [n]). With first=0
    and zero counts this is megatron-core's `build_blending_indices(.., weights, n, size, ..)`, float for float."""
    w = [float(x) for x in weights]
    c = [int(x) for x in counts]
    n = len(w)
    chosen, drawn = [0] * size, [0] * size
    for k in range(size):
        t = float(max(first + k, 1))
        best, most = 0, w[0] * t - c[0]
        for j in range(1, n):
            error = w[j] * t - c[j]
            if error > most:
                best, most = j, error
        chosen[k], drawn[k] = best, c[best]
        c[best] += 1
    return np.asarray(chosen, np.int16), np.asarray(drawn, np.int64), np.asarray(c, np.int64)


class Block(NamedTuple):
    """One block of the blend index."""

    dataset_index: np.ndarray
    """[BLOCK] int16: the dataset each sample comes from."""
    dataset_sample_index: np.ndarray
    """[BLOCK] int64: which sample of that dataset's stream."""
    counts: np.ndarray
    """[n] int64: samples drawn from each dataset before the block's first sample."""


class BlendIndex:
    """The endless blend index of normalised `weights`, by blocks (module docstring), cached in `cache_dir`
    (None: memory only)."""

    def __init__(self, weights, cache_dir=None, block: int = BLOCK):
        self.weights = normalize(weights)
        self.block, self.cache_dir = block, Path(cache_dir) if cache_dir is not None else None
        key = [BLEND_FORMAT, block, [float(w) for w in self.weights]]
        self.key = hashlib.sha1(json.dumps(key).encode()).hexdigest()[:20]
        self._blocks: OrderedDict[int, Block] = OrderedDict()
        self._starts: dict[int, np.ndarray] = {0: np.zeros(len(self.weights), np.int64)}
        self._lock = threading.Lock()

    def cache_paths(self, b: int) -> dict[str, Path]:
        return {name: self.cache_dir / f"{self.key}_blend_b{b}_{name}.npy" for name in Block._fields}

    def get(self, b: int) -> Block:
        """Block b: from memory, else the cache, else built from the counts at its start (building or loading the
        blocks before it as needed)."""
        with self._lock:
            return self._get(b)

    def _get(self, b: int) -> Block:
        if b in self._blocks:
            self._blocks.move_to_end(b)
            return self._blocks[b]
        block = self._load(b)
        if block is None:
            counts = self._start_counts(b)
            index, drawn, _ = blending_indices(self.weights, b * self.block, self.block, counts)
            block = Block(index, drawn, counts)
            self._store(b, block)
        self._starts[b] = np.asarray(block.counts, np.int64)
        self._blocks[b] = block
        while len(self._blocks) > _BLOCKS_IN_MEMORY:
            self._blocks.popitem(last=False)
        return block

    def _start_counts(self, b: int) -> np.ndarray:
        """Samples drawn from each dataset before block b: from the nearest block before it whose counts are
        known, adding each block's draws (a loop, not a recursion: a resume may start thousands of blocks in)."""
        known = max(k for k in self._starts if k <= b)
        for k in range(known + 1, b + 1):
            before = self._get(k - 1)
            self._starts[k] = np.asarray(before.counts) + np.bincount(before.dataset_index, minlength=len(self.weights))
        return self._starts[b]

    def _load(self, b: int) -> Block | None:
        if self.cache_dir is None:
            return None
        try:
            arrays = {name: np.load(path, mmap_mode="r") for name, path in self.cache_paths(b).items()}
        except (OSError, ValueError, EOFError):
            return None
        shapes = {
            "dataset_index": ((self.block,), np.int16),
            "dataset_sample_index": ((self.block,), np.int64),
            "counts": ((len(self.weights),), np.int64),
        }
        if any((a.shape, a.dtype) != shapes[n] for n, a in arrays.items()):
            return None
        return Block(**arrays)

    def _store(self, b: int, block: Block) -> None:
        if self.cache_dir is None:
            return
        for name, path in self.cache_paths(b).items():
            array = np.ascontiguousarray(getattr(block, name))
            if not atomic_write(path, lambda f, a=array: np.save(f, a)):
                return  # read-only or full: the block stays in memory only

    def indices(self, first: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(dataset_index, dataset_sample_index) of samples [first, first + size)."""
        if first < 0 or size < 0:
            raise DataError(f"samples [{first}, {first + size}) are not a range of non-negative indices")
        parts = []
        for b in range(first // self.block, (first + size - 1) // self.block + 1 if size else 0):
            block, origin = self.get(b), b * self.block
            lo, hi = max(first, origin) - origin, min(first + size, origin + self.block) - origin
            parts.append((block.dataset_index[lo:hi], block.dataset_sample_index[lo:hi]))
        if not parts:
            return np.zeros(0, np.int16), np.zeros(0, np.int64)
        return (
            np.concatenate([p[0] for p in parts]).astype(np.int16),
            np.concatenate([p[1] for p in parts]).astype(np.int64),
        )


class BlendedDataset:
    """The endless stream of a blend: sample k is sample `dataset_sample_index[k]` of `datasets[dataset_index[k]]`.
    `datasets` are streams with `batch(first, size)` and one `seq_length` (`GPTDataset`, `MockDataset`)."""

    def __init__(self, datasets, weights, cache_dir=None):
        if len(datasets) != len(weights) or not datasets:
            raise DataError(
                f"a blend needs one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights"
            )
        lengths = {d.seq_length for d in datasets}
        if len(lengths) != 1:
            raise DataError(f"the blended datasets have different seq_length: {sorted(lengths)}")
        self.datasets, self.seq_length = list(datasets), lengths.pop()
        self.index = BlendIndex(weights, cache_dir)

    def batch(self, first: int, size: int) -> np.ndarray:
        """Samples [first, first + size): int32 [size, seq_length + 1]. The samples of one dataset in a range are
        consecutive in its stream, so each dataset is read once, as one range."""
        dataset_index, sample_index = self.index.indices(first, size)
        out = np.empty((size, self.seq_length + 1), np.int32)
        for j in np.unique(dataset_index):
            rows = np.flatnonzero(dataset_index == j)
            out[rows] = self.datasets[int(j)].batch(int(sample_index[rows[0]]), len(rows))
        return out

    def __getitem__(self, index: int) -> np.ndarray:
        return self.batch(int(index), 1)[0]
