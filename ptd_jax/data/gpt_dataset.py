"""GPT samples from an indexed dataset: an endless stream of epochs, train/validation splits, global batches
and how a layout cuts them.

**The stream.** A split is a contiguous range of documents, so of sequences [a, b) (in the GPT case each
document is one sequence). Sample k, for any k >= 0, lives in epoch e = k // samples_per_epoch at position
i = k % samples_per_epoch, and epoch e is a function of (seed, stream, e) alone:

    rng = Generator(PCG64(SeedSequence([seed, stream, e])))
    order = a + rng.permutation(b - a)            # the epoch's sequences, concatenated in this order
    shuffle = rng.permutation(samples_per_epoch)  # drawn second, from the same generator

Position i is the window of seq_length + 1 tokens that starts at token shuffle[i]·seq_length of that
concatenation: consecutive windows overlap by one token, as in Megatron's GPTDataset (inputs sample[:-1],
labels sample[1:]). samples_per_epoch = (tokens_per_epoch - 1) // seq_length; the tail is dropped and no window
reaches into the next epoch. So no sample repeats inside an epoch, and sample k is the same however long the
run is (Megatron instead sizes its epochs by the number of samples asked for). Training is stream 0 and
validation stream 1.

**The index cache.** An epoch's arrays (order, ends = cumsum of the lengths in order as int64, shuffle) are
kept in memory for the last two epochs used. Epochs of at least `cache_min_size` sequences or samples are also
stored as `<hash>_e<e>_{order,ends,shuffle}.npy` in the cache folder (by default `cache/ptd_jax_indices` beside
the data, see `indexed_dataset`) and memory-mapped from there by later runs. The hash covers the format
version, the file name, the .bin and .idx sizes, a digest of the split's sequence lengths, the split's range,
seq_length, seed and stream. Files are renamed into place; when the folder cannot be written the arrays are
just computed in memory (a few tens of milliseconds per million sequences).

**Other sources.** `GPTData` also mixes several datasets' streams by weight (Megatron's blends, `blend.py`: still
a function of the seed and k alone), takes the train/valid/test data from separate paths instead of a split, or
makes mock samples of random tokens (`mock.py`).

**Batches.** Global batch i holds samples [i·B, (i+1)·B) of the training stream, whatever the layout. A layout
only decides how that batch is cut: microbatch j of data-parallel rank r holds rows [j·b·d + r·b, j·b·d + (r+1)·b)
(Megatron's sampler), see `split_global_batch`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ptd_jax.data.blend import BlendedDataset, normalize, parse_blend
from ptd_jax.data.indexed_dataset import DataError, IndexedDataset, atomic_write
from ptd_jax.data.mock import MockDataset

INDEX_FORMAT = 1
CACHE_MIN_SIZE = 1 << 16
"""Epochs with fewer sequences and fewer samples than this are not written to the cache (cheap to rebuild)."""
TRAIN_STREAM, VALID_STREAM, TEST_STREAM = 0, 1, 2
_EPOCHS_IN_MEMORY = 2


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's --split "969,30,1" -> normalised (train, valid, test) fractions."""
    fields = split.replace("/", ",").split(",")
    if not all(x.strip() for x in fields):
        raise DataError(f"split={split!r} has an empty weight: give up to three numbers, e.g. 969,30,1")
    try:
        parts = [float(x) for x in fields]
    except ValueError:
        raise DataError(f"split={split!r} is not a comma-separated list of numbers") from None
    if len(parts) > 3 or not all(math.isfinite(x) for x in parts):
        raise DataError(f"split={split!r} needs at most three finite weights (train, valid, test)")
    parts = (parts + [0.0, 0.0, 0.0])[:3]
    if any(x < 0 for x in parts) or sum(parts) <= 0:
        raise DataError(f"split={split!r} needs non-negative weights with a positive sum")
    total = sum(parts)
    return tuple(x / total for x in parts)  # type: ignore[return-value]


def split_documents(num_docs: int, split: str) -> list[np.ndarray]:
    """Contiguous document ranges for train/valid/test, as Megatron's get_split_indices."""
    fractions = parse_split(split)
    cumulative = np.cumsum(fractions)
    bounds = [0] + [int(round(c * num_docs)) for c in cumulative]
    bounds[-1] = num_docs
    return [np.arange(bounds[i], bounds[i + 1]) for i in range(3)]


def epoch_rng(seed: int, stream: int, epoch: int) -> np.random.Generator:
    """The generator of one epoch: its order, then its shuffle, are drawn from it in that order."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, epoch])))


class Epoch(NamedTuple):
    """One epoch's index arrays (in memory, or memory-mapped from the cache)."""

    order: np.ndarray
    """[sequences] int64: sequence ids in the order they are concatenated."""
    ends: np.ndarray
    """[sequences] int64: token count of the concatenation up to and including each of them."""
    shuffle: np.ndarray
    """[samples_per_epoch] int64: which window of the concatenation each position of the epoch is."""


class GPTDataset:
    """The endless sample stream of documents `doc_ids` (a contiguous range) of `indexed`; `self[k]` is sample
    k, int32 [seq_length + 1], for any k >= 0 (see the module docstring for the rule)."""

    def __init__(
        self,
        indexed: IndexedDataset,
        doc_ids,
        seq_length: int,
        seed: int,
        stream: int = 0,
        cache_dir=None,
        cache_min_size: int = CACHE_MIN_SIZE,
    ):
        if seq_length < 1:
            raise DataError(f"seq_length={seq_length} must be positive")
        if seed < 0 or stream < 0:
            raise DataError(f"seed={seed} and stream={stream} must be >= 0")
        doc_ids = np.asarray(doc_ids, dtype=np.int64)
        if len(doc_ids) and np.any(doc_ids != doc_ids[0] + np.arange(len(doc_ids))):
            raise DataError(
                f"doc_ids must be a contiguous range, got {len(doc_ids)} ids from {doc_ids[0]} to {doc_ids.max()}"
            )
        self.indexed, self.seq_length, self.seed, self.stream = indexed, seq_length, seed, stream
        first_doc = int(doc_ids[0]) if len(doc_ids) else 0
        self.first_sequence = int(indexed.doc_index[first_doc]) if len(doc_ids) else 0
        stop = int(indexed.doc_index[first_doc + len(doc_ids)]) if len(doc_ids) else 0
        self.num_sequences = stop - self.first_sequence
        lengths = indexed.lengths[self.first_sequence : stop]
        self.tokens_per_epoch = int(lengths.sum(dtype=np.int64))
        if self.tokens_per_epoch < seq_length + 1:
            raise DataError(
                f"the split holds {self.tokens_per_epoch} tokens in {self.num_sequences} sequences, "
                f"fewer than one sample of seq_length+1={seq_length + 1}"
            )
        self.samples_per_epoch = (self.tokens_per_epoch - 1) // seq_length
        self.cache_dir = Path(cache_dir) if cache_dir is not None else indexed.cache_dir
        self.cached = max(self.num_sequences, self.samples_per_epoch) >= cache_min_size
        key = [
            INDEX_FORMAT,
            Path(indexed.prefix).name,
            indexed.bin_bytes,
            indexed.idx_bytes,
            hashlib.sha1(np.ascontiguousarray(lengths)).hexdigest(),
            self.first_sequence,
            stop,
            seq_length,
            seed,
            stream,
        ]
        self.key = hashlib.sha1(json.dumps(key).encode()).hexdigest()[:20]
        self._epochs: OrderedDict[int, Epoch] = OrderedDict()
        self._lock = threading.Lock()

    def epoch(self, e: int) -> Epoch:
        """Epoch e's arrays: from memory, else the cache folder, else computed (and stored if worth it). Safe to
        call from a prefetching thread and the main thread at once."""
        with self._lock:
            return self._epoch(e)

    def _epoch(self, e: int) -> Epoch:
        if e in self._epochs:
            self._epochs.move_to_end(e)
            return self._epochs[e]
        arrays = self._load(e) if self.cached else None
        if arrays is None:
            rng = epoch_rng(self.seed, self.stream, e)
            order = self.first_sequence + rng.permutation(self.num_sequences)
            ends = np.cumsum(self.indexed.lengths[order], dtype=np.int64)
            arrays = Epoch(order, ends, rng.permutation(self.samples_per_epoch))
            if self.cached:
                self._store(e, arrays)
        self._epochs[e] = arrays
        while len(self._epochs) > _EPOCHS_IN_MEMORY:
            self._epochs.popitem(last=False)
        return arrays

    def cache_paths(self, e: int) -> dict[str, Path]:
        return {name: self.cache_dir / f"{self.key}_e{e}_{name}.npy" for name in Epoch._fields}

    def _load(self, e: int) -> Epoch | None:
        sizes = {"order": self.num_sequences, "ends": self.num_sequences, "shuffle": self.samples_per_epoch}
        try:
            arrays = {name: np.load(path, mmap_mode="r") for name, path in self.cache_paths(e).items()}
        except (OSError, ValueError, EOFError):
            return None
        if any(a.shape != (sizes[n],) or a.dtype != np.int64 for n, a in arrays.items()):
            return None
        return Epoch(**arrays)

    def _store(self, e: int, arrays: Epoch) -> None:
        for name, path in self.cache_paths(e).items():
            array = np.ascontiguousarray(getattr(arrays, name), dtype=np.int64)
            if not atomic_write(path, lambda f, a=array: np.save(f, a)):
                return  # read-only or full: the arrays stay in memory only

    def windows(self, e: int, positions: np.ndarray) -> np.ndarray:
        """Samples at `positions` of epoch e: int32 [len(positions), seq_length + 1].

        Each window is cut into pieces, one per sequence it touches (two binary searches per window, then
        array arithmetic), and the pieces are read from .bin back to back: the cost follows the batch, not the
        corpus."""
        s, arrays = self.seq_length, self.epoch(e)
        start = arrays.shuffle[positions].astype(np.int64) * s  # [n] first token of each window
        stop = start + s + 1
        first = np.searchsorted(arrays.ends, start, side="right")  # index in `order` of the sequence holding it
        last = np.searchsorted(arrays.ends, stop - 1, side="right")
        count = last - first + 1  # [n] pieces per window
        owner = np.repeat(np.arange(len(positions)), count)  # [P] window of each piece
        before = np.cumsum(count) - count
        piece = first[owner] + np.arange(int(count.sum())) - before[owner]  # [P] index in `order`
        seq = arrays.order[piece]
        seq_end = arrays.ends[piece]
        seq_start = seq_end - self.indexed.lengths[seq]
        lo, hi = np.maximum(start[owner], seq_start), np.minimum(stop[owner], seq_end)
        take = hi - lo  # [P] tokens of each piece; sums to n·(s + 1)
        source = self.indexed.pointers[seq] // self.indexed.dtype.itemsize + (lo - seq_start)
        return self.indexed.read_pieces(source, take).astype(np.int32).reshape(len(positions), s + 1)

    def batch(self, first: int, size: int) -> np.ndarray:
        """Samples [first, first + size): int32 [size, seq_length + 1] (they may span several epochs)."""
        if first < 0 or size < 0:
            raise DataError(f"samples [{first}, {first + size}) are not a range of non-negative indices")
        out = np.empty((size, self.seq_length + 1), np.int32)
        n = self.samples_per_epoch
        for e in range(first // n, (first + size - 1) // n + 1 if size else first // n):
            lo, hi = max(first, e * n), min(first + size, (e + 1) * n)
            out[lo - first : hi - first] = self.windows(e, np.arange(lo - e * n, hi - e * n))
        return out

    def __getitem__(self, index: int) -> np.ndarray:
        """Sample `index`: int32 tokens [seq_length + 1]."""
        return self.batch(int(index), 1)[0]


@dataclass
class Batch:
    """Inputs, labels and loss mask, each [..., seq_length] int32."""

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray


def make_batch(samples: np.ndarray) -> Batch:
    return Batch(tokens=samples[..., :-1], labels=samples[..., 1:], loss_mask=np.ones_like(samples[..., 1:]))


def split_global_batch(
    array: np.ndarray, num_microbatches: int, data_parallel_size: int, micro_batch_size: int
) -> np.ndarray:
    """[B, ...] -> [M, d, b, ...]: microbatch j of data rank r = rows j·b·d + r·b ... + b (Megatron's order)."""
    return array.reshape(num_microbatches, data_parallel_size, micro_batch_size, *array.shape[1:])


@dataclass(frozen=True)
class PerSplit:
    """--train-data-path / --valid-data-path / --test-data-path: each a prefix or a blend's words, used whole."""

    train: object
    valid: object = None
    test: object = None


@dataclass(frozen=True)
class MockData:
    """--mock-data: random tokens of the model's vocabulary (`mock.py`), no files."""


class GPTData:
    """The train and validation streams of the data. `train_batch(i)` is global batch i (samples [i·B, (i+1)·B) of
    the training stream), `train_samples(first, count)` any range of it, and `valid_batches()` the same
    `eval_iters` batches of the validation stream at each evaluation, moving on from one to the next, and
    `test_batches()` those of the test stream (evaluated once, at the end). Nothing depends on the number of
    iterations; `data_config()` names what the streams do depend on.

    The data, `source`, is one of (Megatron's flags): a prefix (--data-path), one prefix or a blend's words
    "w1 prefix1 w2 prefix2 ..." (`blend.py`), each prefix cut by `split`; a `PerSplit` (--train-data-path ...),
    each a prefix or a blend, whole (no split);
    or `MockData()` (--mock-data, `mock.py`). Train, validation and test are
    streams 0, 1 and 2 of each dataset. In a blend, a dataset whose validation range is empty is left out of the
    validation blend (the others' weights renormalised)."""

    def __init__(
        self,
        source=None,
        *,
        seq_length: int,
        global_batch_size: int,
        eval_iters: int,
        seed: int,
        split: str = "969,30,1",
        vocab_size: int | None = None,
        cache_dir=None,
    ):
        mock = isinstance(source, MockData)
        per_split = source if isinstance(source, PerSplit) else None
        prefix = None if mock or per_split else source
        self.split, self.seed, self.seq_length = split, seed, seq_length
        self.global_batch_size, self.eval_iters = global_batch_size, eval_iters
        self.vocab_size, self.cache_dir, self.mock = vocab_size, cache_dir, mock
        self.valid = self.test = None
        if prefix is None and not mock and (per_split is None or per_split.train is None):
            raise DataError(f"give one of a data path, a train data path and mock data: got {source=}")
        if mock:
            self.name = f"mock data (random tokens of V={vocab_size})"
            self.train = MockDataset(vocab_size, seq_length, seed, TRAIN_STREAM)
            self.valid = MockDataset(vocab_size, seq_length, seed, VALID_STREAM) if eval_iters > 0 else None
            self.test = MockDataset(vocab_size, seq_length, seed, TEST_STREAM) if eval_iters > 0 else None
            self._config = {"mock_data": True, "vocab_size": vocab_size}
        elif per_split is not None:
            self._open_per_split(per_split.train, per_split.valid, per_split.test)
        else:
            self._open_split(prefix)

    def _open_split(self, words) -> None:
        """--data-path: one prefix or a blend, each dataset's documents cut by --split."""
        blend = parse_blend("data_path", words)
        sources = [self._open(p) for _, p in blend]
        ranges = [split_documents(len(s.doc_index) - 1, self.split) for s in sources]
        weights = [w for w, _ in blend]
        self.train = self._stream(weights, sources, [r[0] for r in ranges], TRAIN_STREAM)
        if self.train is None:  # refused here, before any model is built
            docs = sum(len(s.doc_index) - 1 for s in sources)
            raise DataError(
                f"split={self.split!r} leaves the training split empty: 0 of {docs} documents of "
                f"{' '.join(p for _, p in blend)} (give the train share more weight)"
            )
        self._refuse_a_train_split_under_one_batch(f"split={self.split!r}: ")
        if self.eval_iters > 0:
            self.valid = self._stream(weights, sources, [r[1] for r in ranges], VALID_STREAM)
            self.test = self._test_stream(weights, sources, [r[2] for r in ranges])
        if len(blend) == 1:  # as before blends: the checkpoints of single-prefix runs keep resuming
            self.indexed = sources[0]
            self.prefix, self.num_documents = os.path.abspath(blend[0][1]), len(sources[0].doc_index) - 1
            self.name = self.prefix
            self._config = {
                "data_path": self.prefix,
                "split": self.split,
                "num_documents": self.num_documents,
                "num_tokens": self.indexed.num_tokens,
                "bin_bytes": self.indexed.bin_bytes,
            }
        else:
            self.name = " ".join(f"{w:g} {os.path.abspath(p)}" for w, p in blend)
            self._config = {"data_path": None, "split": self.split, "blend": _describe(weights, sources)}

    def _refuse_a_train_split_under_one_batch(self, where: str) -> None:
        """A training split with fewer samples than one global batch would repeat its samples inside one batch:
        refused before the model is built, with the split's numbers."""
        datasets = getattr(self.train, "datasets", [self.train])
        samples = sum(d.samples_per_epoch for d in datasets)
        if samples < self.global_batch_size:
            tokens = sum(d.tokens_per_epoch for d in datasets)
            sequences = sum(d.num_sequences for d in datasets)
            raise DataError(
                f"{where}the training split holds {samples} samples of seq_length={self.seq_length} ({tokens} tokens "
                f"in {sequences} sequences), fewer than one batch of global_batch_size={self.global_batch_size}: "
                f"give training more data or lower --global-batch-size"
            )

    def _test_stream(self, weights, sources, doc_ranges):
        """The test stream of a split, or None (with one warning) where its documents hold less than one sample:
        the default split's last share is often a few short documents, and training must not fail for it."""
        try:
            return self._stream(weights, sources, doc_ranges, TEST_STREAM)
        except DataError as err:
            print(f"ptd_jax: warning: the test split is not evaluated: {err}", file=sys.stderr)
            return None

    def _open_per_split(self, train_path, valid_path, test_path) -> None:
        """--train-data-path / --valid-data-path / --test-data-path: each a prefix or a blend, used whole."""
        self._config = {"data_path": None}
        names = []
        for key, words, stream in (
            ("train", train_path, TRAIN_STREAM),
            ("valid", valid_path, VALID_STREAM),
            ("test", test_path, TEST_STREAM),
        ):
            if words is None:
                self._config[f"{key}_data"] = None
                continue
            blend = parse_blend(f"{key}_data_path", words)
            sources = [self._open(p) for _, p in blend]
            weights = [w for w, _ in blend]
            if key == "train" or self.eval_iters > 0:
                everything = [np.arange(len(s.doc_index) - 1) for s in sources]
                setattr(self, key, self._stream(weights, sources, everything, stream))
            if key == "train":
                self._refuse_a_train_split_under_one_batch("--train-data-path: ")
            self._config[f"{key}_data"] = _describe(weights, sources)
            names.append(f"{key}: " + " ".join(f"{w:g} {os.path.abspath(p)}" for w, p in blend))
        self.name = "; ".join(names)

    def _open(self, prefix) -> IndexedDataset:
        """A dataset of the data, refused when empty or holding ids past the vocabulary."""
        indexed = IndexedDataset(prefix, cache_dir=self.cache_dir)
        num_docs = len(indexed.doc_index) - 1
        if num_docs <= 0 or indexed.num_tokens == 0:
            raise DataError(f"the dataset at {prefix!r} is empty ({num_docs} documents, {indexed.num_tokens} tokens)")
        if self.vocab_size is not None:
            largest = indexed.max_token()
            if largest >= self.vocab_size:
                raise DataError(
                    f"the dataset at {prefix!r} holds token id {largest} but vocab_size={self.vocab_size} "
                    f"(pass --vocab-size for data made with another tokenizer)"
                )
        return indexed

    def _stream(self, weights, sources, doc_ranges, stream: int):
        """One dataset's stream, or the blend of several; None when no dataset has documents in its range."""
        parts = [(w, s, docs) for w, s, docs in zip(weights, sources, doc_ranges) if len(docs)]
        if not parts:
            return None
        datasets = []
        for _, indexed, docs in parts:
            try:
                datasets.append(GPTDataset(indexed, docs, self.seq_length, self.seed, stream))
            except DataError as err:
                raise DataError(f"{indexed.prefix}: {err}") from None
        if len(sources) == 1:
            return datasets[0]
        cache = self.cache_dir if self.cache_dir is not None else sources[0].cache_dir
        return BlendedDataset(datasets, [w for w, _, _ in parts], cache_dir=cache)

    def train_samples(self, first: int, count: int, rows: np.ndarray | None = None) -> Batch:
        """Samples [first, first + count) of the training stream (`first` = samples consumed so far); with `rows`
        (sorted positions in [0, count), `local_rows`), only samples first + rows."""
        if rows is None:
            return make_batch(self.train.batch(first, count))
        return make_batch(_read_rows(self.train, first, rows))

    def train_batch(self, iteration: int) -> Batch:
        return self.train_samples(iteration * self.global_batch_size, self.global_batch_size)

    def valid_batches(self, rows: np.ndarray | None = None, evaluation: int = 0):
        """The `eval_iters` global batches of evaluation number `evaluation` (0, 1, ...): batches
        [evaluation · eval_iters, (evaluation + 1) · eval_iters) of the validation stream, which moves on from one
        evaluation to the next as Megatron's valid iterator does."""
        yield from self._eval_batches(self.valid, rows, evaluation * self.eval_iters)

    def test_batches(self, rows: np.ndarray | None = None):
        """The `eval_iters` first global batches of the test stream (Megatron's test evaluation at the end)."""
        yield from self._eval_batches(self.test, rows, 0)

    def _eval_batches(self, stream, rows, first_batch: int):
        if stream is None:
            return
        for i in range(first_batch, first_batch + self.eval_iters):
            first = i * self.global_batch_size
            yield make_batch(
                stream.batch(first, self.global_batch_size) if rows is None else _read_rows(stream, first, rows)
            )

    def data_config(self) -> dict:
        """What the streams depend on (JSON-able), for a checkpoint to compare on resume: for a blend, each
        dataset's normalised weight, file name and sizes."""
        return {
            "data_path": self._config.get("data_path"),
            "seed": self.seed,
            "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length,
            **self._config,
        }


def _describe(weights, sources) -> list:
    """[[normalised weight, file name, documents, tokens, .bin bytes], ...] of a blend (folders may move)."""
    return [
        [float(w), Path(s.prefix).name, len(s.doc_index) - 1, s.num_tokens, s.bin_bytes]
        for w, s in zip(normalize(weights), sources)
    ]


def _read_rows(dataset: GPTDataset, first: int, rows: np.ndarray) -> np.ndarray:
    """Samples first + rows (sorted), one `batch` read per run of consecutive rows."""
    runs = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
    return np.concatenate([dataset.batch(first + int(run[0]), len(run)) for run in runs if len(run)])


def local_rows(parallel, data_ranks) -> np.ndarray:
    """The positions in a global batch of the rows that data ranks `data_ranks` (sorted) take, ordered by
    microbatch j, then rank r, then row i: j·b·d + r·b + i (`split_global_batch`). What one process of a
    multi-process run reads."""
    m, d, b = parallel.num_microbatches, parallel.data_parallel_size, parallel.micro_batch_size
    j, r, i = np.meshgrid(np.arange(m), np.asarray(data_ranks, np.int64), np.arange(b), indexing="ij")
    return (j * b * d + r * b + i).ravel()


def microbatches(batch: Batch, parallel, num_data_ranks: int | None = None):
    """Global batch [B, S] -> (tokens, labels, mask) each [M, d·b, S] in Megatron's sampler order (the step's
    in_specs then give data rank r its b rows of every microbatch). `parallel` is a `config.ParallelConfig`.
    `num_data_ranks` R: `batch` holds only the `local_rows` of R data ranks, and each is [M, R·b, S]."""
    m, b = parallel.num_microbatches, parallel.micro_batch_size
    d = parallel.data_parallel_size if num_data_ranks is None else num_data_ranks

    def cut(x):
        return split_global_batch(x, m, d, b).reshape(m, d * b, *x.shape[1:])

    return cut(batch.tokens), cut(batch.labels), cut(batch.loss_mask)
