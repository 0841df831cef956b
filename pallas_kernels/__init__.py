"""Pallas kernels for the hot paths, each with a pure-jnp reference (DESIGN.md §5)."""

from pallas_kernels.flash_attention import BlockSizes, flash_attention, flash_attention_reference

__all__ = ["BlockSizes", "flash_attention", "flash_attention_reference"]
