"""Start-up cost of the data pipeline on a ~2 GB corpus (issue #11): how long `GPTData(...)` takes before the
first step, cold (no cache: the largest-token scan and the epoch index build) and warm (a fresh process once
the stats file and the epoch index files exist), and how long the first global batch takes (B = 512, s = 2048).

The corpus is synthetic: uint16 random tokens (a 64 Mi-token random block repeated) in ~1.5M documents of
exponentially distributed lengths (uniform random cut points), written with numpy and `indexed_dataset.write_index`,
so it has no stats file (as data preprocessed by Megatron would not). Each measurement runs in a fresh Python
process; before the cold run and the first warm run the .bin/.idx pages are dropped from the page cache
(posix_fadvise DONTNEED), so those read from disk; the second warm run finds them in memory. The files are deleted
at the end.

Usage: python -m experiments.bench.io.bench_data_startup [--tokens 1e9] [--documents 1.5e6] [--dir /tmp]
                                                 [--out experiments/results/bench_data_startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.common import write_json

SEQ_LENGTH, GLOBAL_BATCH, EVAL_ITERS, SEED, VOCAB = 2048, 512, 10, 1234, 65536
BLOCK = 1 << 26  # tokens of the random block that fills the .bin


def make_corpus(prefix: Path, num_tokens: int, num_docs: int) -> dict:
    import numpy as np

    from ptd_jax.data.indexed_dataset import write_index

    rng = np.random.default_rng(0)
    cuts = np.sort(rng.integers(1, num_tokens, size=num_docs - 1))  # uniform cut points: exponential lengths
    lengths = np.diff(np.concatenate([[0], cuts, [num_tokens]]))
    block = rng.integers(0, 50000, size=BLOCK, dtype=np.uint16)
    with open(f"{prefix}.bin", "wb") as f:
        for start in range(0, num_tokens, BLOCK):
            f.write(block[: min(BLOCK, num_tokens - start)].tobytes())
    write_index(prefix, np.uint16, lengths, np.arange(num_docs + 1))
    return {
        "tokens": num_tokens,
        "documents": num_docs,
        "bin_bytes": os.path.getsize(f"{prefix}.bin"),
        "idx_bytes": os.path.getsize(f"{prefix}.idx"),
    }


def drop_page_cache(prefix: Path) -> None:
    for suffix in (".bin", ".idx"):
        fd = os.open(f"{prefix}{suffix}", os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(prefix: str) -> None:
    """One start-up in this (fresh) process; prints its timings as JSON."""
    t0 = time.perf_counter()
    from ptd_jax.data import GPTData

    t1 = time.perf_counter()
    data = GPTData(
        prefix,
        seq_length=SEQ_LENGTH,
        global_batch_size=GLOBAL_BATCH,
        eval_iters=EVAL_ITERS,
        seed=SEED,
        vocab_size=VOCAB,
    )
    t2 = time.perf_counter()
    data.train.epoch(0)  # built or loaded on first use; timed apart from the batch itself
    t3 = time.perf_counter()
    first = data.train_batch(0)
    t4 = time.perf_counter()
    data.train_batch(1)
    t5 = time.perf_counter()
    next(data.valid_batches())
    t6 = time.perf_counter()
    print(
        json.dumps(
            {
                "import_s": t1 - t0,
                "construct_s": t2 - t1,
                "epoch0_index_s": t3 - t2,
                "first_batch_s": t4 - t3,
                "second_batch_s": t5 - t4,
                "first_valid_batch_s": t6 - t5,
                "startup_s": t4 - t1,
                "batch_shape": list(first.tokens.shape),
                "samples_per_epoch": data.train.samples_per_epoch,
                "epoch_index_cached": data.train.cached,
            }
        )
    )


def run_child(prefix: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "experiments.bench.io.bench_data_startup", "--child", str(prefix)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--documents", type=float, default=1.5e6)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default="experiments/results/bench_data_startup.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    num_tokens, num_docs = int(args.tokens), int(args.documents)
    need, free = 2 * num_tokens + 64 * 2**20, shutil.disk_usage(args.dir).free
    if free < 2 * need:
        sys.exit(f"bench_data_startup: {args.dir} has {free / 2**30:.1f} GiB free, needs {2 * need / 2**30:.1f}")
    folder = Path(tempfile.mkdtemp(prefix="ptd_data_startup_", dir=args.dir))
    try:
        prefix = folder / "synthetic_text_document"
        t0 = time.perf_counter()
        corpus = make_corpus(prefix, num_tokens, num_docs)
        corpus["write_s"] = time.perf_counter() - t0
        drop_page_cache(prefix)
        cold = run_child(prefix)
        drop_page_cache(prefix)
        warm = run_child(prefix)
        warm_in_memory = run_child(prefix)
        cache = folder / "cache" / "ptd_jax_indices"
        cache_files = {p.name: p.stat().st_size for p in sorted(cache.iterdir())}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {
        "corpus": corpus,
        "seq_length": SEQ_LENGTH,
        "global_batch_size": GLOBAL_BATCH,
        "eval_iters": EVAL_ITERS,
        "cold": cold,
        "warm": warm,
        "warm_page_cache": warm_in_memory,
        "cache_files": cache_files,
        "cpu_count": os.cpu_count(),
        "target": "warm start-up (construct + first batch) <= 5 s",
    }
    write_json(args.out, result, end="\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
