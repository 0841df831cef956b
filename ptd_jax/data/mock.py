"""`--mock-data` (Megatron's mock GPT dataset, for benchmarks): samples of random token ids, no files.

Sample k of stream `stream` is seq_length + 1 ids drawn uniformly from [0, vocab_size) by
Generator(PCG64(SeedSequence([seed, stream, MOCK_TAG, k]))): a function of (seed, stream, k) alone, like the
file-backed stream, so batches do not depend on the run's length, resume is exact, and training stream 0 and
validation stream 1 differ. (Megatron's MockGPTLowLevelDataset fills documents of random lengths with
1, 2, 3, ... modulo the vocabulary; random ids keep the loss near ln V, which is what a benchmark wants: no
pattern for the model to learn that would change the step's numerics over time.)
"""

from __future__ import annotations

import numpy as np

from ptd_jax.data.indexed_dataset import DataError

MOCK_TAG = 0x6D6F636B
"""'mock': keeps these generators apart from the file-backed stream's (seed, stream, epoch)."""


class MockDataset:
    """The endless stream of random samples; `batch(first, size)` -> int32 [size, seq_length + 1]."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, stream: int = 0):
        if vocab_size is None or vocab_size < 1:
            raise DataError(f"mock data needs a positive vocab_size, got vocab_size={vocab_size}")
        if seq_length < 1 or seed < 0 or stream < 0:
            raise DataError(f"seq_length={seq_length} must be positive, seed={seed} and stream={stream} >= 0")
        self.vocab_size, self.seq_length, self.seed, self.stream = vocab_size, seq_length, seed, stream

    def sample(self, k: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.stream, MOCK_TAG, k])))
        return rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int32)

    def batch(self, first: int, size: int) -> np.ndarray:
        if first < 0 or size < 0:
            raise DataError(f"samples [{first}, {first + size}) are not a range of non-negative indices")
        out = np.empty((size, self.seq_length + 1), np.int32)
        for i in range(size):
            out[i] = self.sample(first + i)
        return out

    def __getitem__(self, index: int) -> np.ndarray:
        return self.sample(int(index))
