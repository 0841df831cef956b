"""Pallas kernels for the hot paths, each with a pure-jnp reference (docs/architecture.md, "Pallas kernels")."""

from pallas_kernels.cross_entropy import cross_entropy_reference, softmax_cross_entropy
from pallas_kernels.flash_attention import (
    BlockSizes,
    NoBlockFits,
    choose_blocks,
    flash_attention,
    flash_attention_reference,
)
from pallas_kernels.layer_norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from pallas_kernels.target import GpuTarget, compile_target, current_target

__all__ = [
    "BlockSizes",
    "GpuTarget",
    "NoBlockFits",
    "choose_blocks",
    "compile_target",
    "current_target",
    "flash_attention",
    "flash_attention_reference",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "softmax_cross_entropy",
    "cross_entropy_reference",
]
