"""GPT samples from an indexed dataset, train/validation splits, global batches and their microbatches.

A sample is seq_length + 1 consecutive tokens of the concatenation of the (shuffled) documents; consecutive
samples overlap by one token, as in Megatron's GPTDataset, so inputs are sample[:-1] and labels sample[1:].

Batch order is a function of the iteration alone: global batch i holds samples [i·B, (i+1)·B) of the
shuffled training set, whatever the layout. A layout only decides how that batch is cut: microbatch j of
data-parallel rank r holds rows [j·b·d + r·b, j·b·d + (r+1)·b) (Megatron's sampler), see `split_global_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ptd_jax.data.indexed_dataset import DataError, IndexedDataset


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's --split "969,30,1" -> normalised (train, valid, test) fractions."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise DataError(f"split={split!r} is not a comma-separated list of numbers") from None
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


class GPTDataset:
    """`num_samples` samples of seq_length + 1 tokens from the documents `doc_ids` of `indexed`.

    Document order is reshuffled every epoch and sample order shuffled once, both from `seed`; as many epochs are
    made as `num_samples` needs.
    """

    def __init__(self, indexed: IndexedDataset, doc_ids: np.ndarray, seq_length: int, num_samples: int,
                 seed: int):
        self.indexed, self.seq_length, self.num_samples = indexed, seq_length, num_samples
        # Each document here is one sequence; Megatron's doc index maps documents to sequences.
        sequences = np.concatenate([np.arange(indexed.doc_index[d], indexed.doc_index[d + 1]) for d in doc_ids]) \
            if len(doc_ids) else np.zeros(0, np.int64)
        tokens_per_epoch = int(indexed.lengths[sequences].astype(np.int64).sum()) if len(sequences) else 0
        if tokens_per_epoch < seq_length + 1:
            raise DataError(f"the split holds {tokens_per_epoch} tokens in {len(sequences)} sequences, fewer than "
                            f"one sample of seq_length+1={seq_length + 1}")
        needed = num_samples * seq_length + 1
        num_epochs = -(-needed // tokens_per_epoch)
        rng = np.random.RandomState(seed % 2**32)
        self.order = np.concatenate([rng.permutation(sequences) for _ in range(num_epochs)])
        lengths = indexed.lengths[self.order].astype(np.int64)
        self.ends = np.cumsum(lengths)
        total_samples = (int(self.ends[-1]) - 1) // seq_length
        self.shuffle = rng.permutation(total_samples)[:num_samples]  # enough epochs were made above

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        """Sample `index`: int32 tokens [seq_length + 1]."""
        start = int(self.shuffle[index]) * self.seq_length
        stop = start + self.seq_length + 1
        pieces = []
        doc = int(np.searchsorted(self.ends, start, side="right"))
        while start < stop:
            doc_start = int(self.ends[doc - 1]) if doc else 0
            take = min(stop, int(self.ends[doc])) - start
            pieces.append(self.indexed.get(int(self.order[doc]), start - doc_start, take))
            start += take
            doc += 1
        return np.concatenate(pieces).astype(np.int32)

    def batch(self, first: int, size: int) -> np.ndarray:
        return np.stack([self[i] for i in range(first, first + size)])


@dataclass
class Batch:
    """Inputs, labels and loss mask, each [..., seq_length] int32."""

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray


def make_batch(samples: np.ndarray) -> Batch:
    return Batch(tokens=samples[..., :-1], labels=samples[..., 1:], loss_mask=np.ones_like(samples[..., 1:]))


def split_global_batch(array: np.ndarray, num_microbatches: int, data_parallel_size: int,
                       micro_batch_size: int) -> np.ndarray:
    """[B, ...] -> [M, d, b, ...]: microbatch j of data rank r = rows j·b·d + r·b ... + b (Megatron's order)."""
    return array.reshape(num_microbatches, data_parallel_size, micro_batch_size, *array.shape[1:])


class GPTData:
    """The train/validation datasets of one run; `train_batch(i)` is global batch i, `valid_batches()` fixed."""

    def __init__(self, prefix, *, seq_length: int, global_batch_size: int, train_iters: int, eval_iters: int,
                 seed: int, split: str = "969,30,1", vocab_size: int | None = None):
        self.indexed = IndexedDataset(prefix)
        num_docs = len(self.indexed.doc_index) - 1
        if num_docs <= 0 or self.indexed.num_tokens == 0:
            raise DataError(f"the dataset at {prefix!r} is empty ({num_docs} documents, "
                            f"{self.indexed.num_tokens} tokens)")
        if vocab_size is not None:
            largest = self.indexed.max_token()
            if largest >= vocab_size:
                raise DataError(f"the dataset at {prefix!r} holds token id {largest} but vocab_size={vocab_size} "
                                f"(pass --vocab-size for data made with another tokenizer)")
        train_docs, valid_docs, _ = split_documents(num_docs, split)
        self.global_batch_size = global_batch_size
        self.train = GPTDataset(self.indexed, train_docs, seq_length, train_iters * global_batch_size, seed)
        self.valid = None
        if eval_iters > 0 and len(valid_docs) > 0:
            self.valid = GPTDataset(self.indexed, valid_docs, seq_length, eval_iters * global_batch_size, seed + 1)
        self.eval_iters = eval_iters

    def train_batch(self, iteration: int) -> Batch:
        return make_batch(self.train.batch(iteration * self.global_batch_size, self.global_batch_size))

    def valid_batches(self):
        if self.valid is None:
            return
        for i in range(self.eval_iters):
            yield make_batch(self.valid.batch(i * self.global_batch_size, self.global_batch_size))


def microbatches(batch: Batch, parallel):
    """Global batch [B, S] -> (tokens, labels, mask) each [M, d·b, S] in Megatron's sampler order (the step's
    in_specs then give data rank r its b rows of every microbatch). `parallel` is a `config.ParallelConfig`."""
    m, d, b = parallel.num_microbatches, parallel.data_parallel_size, parallel.micro_batch_size

    def cut(x):
        return split_global_batch(x, m, d, b).reshape(m, d * b, *x.shape[1:])

    return cut(batch.tokens), cut(batch.labels), cut(batch.loss_mask)
