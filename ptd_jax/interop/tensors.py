"""What both converters share: a one-line error for a missing or misshapen tensor, and float32 trees."""

from __future__ import annotations

import numpy as np

from ptd_jax.config import ConfigError


def tensor_getter(tensors: dict, source: str, implied_by: str):
    """get(name, shape): tensors[name] as float32, or a one-line ConfigError naming `source` when it is missing or
    has another shape than the one `implied_by` implies."""

    def get(name, shape):
        if name not in tensors:
            raise ConfigError(f"{source} has no tensor {name!r}")
        value = np.asarray(tensors[name], np.float32)
        if value.shape != tuple(shape):
            raise ConfigError(f"{source}: {name!r} has shape {value.shape}, {implied_by} implies {shape}")
        return value

    return get


def float32_tree(tree):
    """Every leaf a contiguous float32 numpy array."""
    if isinstance(tree, dict):
        return {k: float32_tree(v) for k, v in tree.items()}
    return np.ascontiguousarray(tree, np.float32)
