"""Data: Megatron's .bin/.idx token files, the endless GPT sample stream, batches, a prefetching loader, the tokenizers
(bytes, GPT-2 BPE), preprocessing and the embedded default corpus. Pure numpy; nothing here imports JAX. The package
exports the reading side; `preprocess` and `corpus`, which write, are imported by their module names (so that
`python -m ptd_jax.data.preprocess` does not find itself imported already).

    tokenizer.py        text <-> token ids (ByteTokenizer, GPT2BPETokenizer)
    preprocess.py       text files / JSONL -> a .bin/.idx pair (`ptd-preprocess`)
    indexed_dataset.py  the .bin/.idx format: writer and memory-mapped reader (`IndexedDataset(prefix)`), and the
                        stats file (largest token id) in the cache folder beside the data
    gpt_dataset.py      the per-epoch sample stream of s+1 tokens and its index cache, splits, global batches and
                        how a layout cuts them; `GPTData`: one dataset, a blend, per-split paths or mock data
    blend.py            blends (`--data-path w1 p1 w2 p2`): Megatron's greedy blending index, endless, by cached blocks
    mock.py             `--mock-data`: random tokens from (seed, stream, sample), no files
    loader.py           `prefetch`: batches built ahead on one background thread
    corpus.py           the default corpus (this interpreter's standard library), built once into a cache
"""

from ptd_jax.data.gpt_dataset import (
    Batch,
    Epoch,
    GPTData,
    GPTDataset,
    MockData,
    PerSplit,
    local_rows,
    make_batch,
    microbatches,
    parse_split,
    split_documents,
    split_global_batch,
)
from ptd_jax.data.indexed_dataset import DataError, IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from ptd_jax.data.loader import prefetch

__all__ = [
    "Batch",
    "DataError",
    "Epoch",
    "GPTData",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetError",
    "IndexedDatasetWriter",
    "MockData",
    "PerSplit",
    "local_rows",
    "make_batch",
    "microbatches",
    "parse_split",
    "prefetch",
    "split_documents",
    "split_global_batch",
]
