"""The repository's root, for the tests that read its files (README, docs, the packages' sources)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ptd_jax", "pallas_kernels")
"""The installed packages: the library and its kernels."""
