"""Small corpora written on the spot: the Python-like text behind the `small_corpus` fixture, and random byte-token
documents for a second dataset (blends)."""

import numpy as np

TEXT = (
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
)


def write_text_documents(root, documents: int = 60, seed: int = 0) -> None:
    """`documents` files under `root`, each a random tail of TEXT twice under a numbered header."""
    rng = np.random.RandomState(seed)
    lines = TEXT.splitlines(keepends=True)
    for i in range(documents):
        start = rng.randint(0, len(lines) - 4)
        (root / f"doc{i:03d}.txt").write_text(f"# document {i}\n" + "".join(lines[start:]) * 2)


def random_corpus_at(folder, documents: int, shortest: int, longest: int, seed: int) -> str:
    """A .bin/.idx pair of `documents` random byte-token documents of shortest..longest tokens (a second dataset
    beside `small_corpus`, for blends); returns its prefix."""
    from ptd_jax.data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    prefix = folder / "random_document"
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as writer:
        for _ in range(documents):
            writer.add_document(rng.integers(0, 257, size=int(rng.integers(shortest, longest))))
    return str(prefix)
