"""The embedded default corpus: this interpreter's standard-library sources, byte-tokenized once into a cache
(`$PTD_JAX_CACHE`, default ~/.cache/ptd_jax) so that the demo trains with no download."""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from ptd_jax.data.indexed_dataset import IndexedDataset, IndexedDatasetError
from ptd_jax.data.preprocess import build_indexed_dataset

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The .py files of the running interpreter's standard library (tests and site-packages left out), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(files)


def cache_dir() -> Path:
    return Path(os.environ.get("PTD_JAX_CACHE", Path.home() / ".cache" / "ptd_jax"))


def default_corpus(progress: bool = True) -> str:
    """Prefix of the default corpus, preprocessing the standard library once into the cache (no download)."""
    files = stdlib_files()
    fingerprint = hashlib.sha1("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:10]
    version = ".".join(map(str, sys.version_info[:3]))
    prefix = cache_dir() / "corpus" / f"stdlib-py{version}-{fingerprint}_text_document"
    try:
        IndexedDataset(prefix)
        return str(prefix)
    except IndexedDatasetError:
        pass
    build_indexed_dataset([str(p) for p in files], str(prefix), progress=progress, desc="default corpus")
    return str(prefix)
