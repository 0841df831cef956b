"""Megatron's distributed optimizer (ZeRO stage 1, Rajbhandari et al. 2020; Megatron-LM `--use-distributed-optimizer`).

The float32 master weights and Adam's moments are sharded over "data": each parameter gets an extra "data" split on
one of its dims that no other axis splits (the outermost one that d divides; a leaf with none stays replicated),
so a data rank holds and updates 1/d of them. Per step, inside shard_map:
1. all-gather the master shards over "data", already cast to the compute dtype (bf16 in, bf16 out: the
   gathered copy costs 2 bytes per parameter, not 4);
2. forward and backward as without it, float32 gradients accumulated over microbatches;
3. reduce-scatter the gradients over "data" (`psum_scatter`, the same bytes as half an all-reduce), so each rank
   receives the sum of its own 1/d;
4. clip by the global norm (each element counted once: the norm sums the shards over "data") and AdamW on the
   shard. The next step's all-gather completes the all-reduce that data parallelism would have done.

Memory per parameter and device with bf16 compute (Megatron's table): 2 (bf16 params) + 4 (fp32 grads) + 12/d
(fp32 master, two moments), against 18 without. The global shapes are unchanged (only shardings differ), so the
checkpoints' canonical form, and restoring into either optimizer, need nothing new.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from ptd_jax.parallel.mesh import Axis

DATA = Axis.DATA.value


def data_dim(spec: P, shape: tuple[int, ...], d: int) -> int | None:
    """The dim of a leaf that the distributed optimizer splits over "data": the outermost one that no other axis
    splits and d divides (for a stack of layers [L, ...] the layer dim when d divides L); None when there is none
    (the leaf stays replicated). Outermost, because an all-gather concatenates along its most major dim: gathered
    along an inner dim, the copy comes out in a layout with that dim major, and XLA transposes it back (a second
    copy of the leaf in the compute dtype, measured in `experiments/bench/memory/bench_optimizer_memory.py`)."""
    dims = list(spec) + [None] * (len(shape) - len(tuple(spec)))
    free = [i for i, (n, axis) in enumerate(zip(shape, dims)) if axis is None and n % d == 0 and n >= d]
    return free[0] if free and d > 1 else None


def shard_spec(spec: P, shape: tuple[int, ...], d: int) -> P:
    dim = data_dim(spec, shape, d)
    if dim is None:
        return spec
    dims = list(spec) + [None] * (len(shape) - len(tuple(spec)))
    dims[dim] = DATA
    return P(*dims)


def is_spec(x) -> bool:
    return isinstance(x, P)


def shard_specs(specs, params, d: int):
    """The parameter specs with the extra "data" split (a tree matching `params`)."""
    return jax.tree.map(lambda s, x: shard_spec(s, x.shape, d), specs, params, is_leaf=is_spec)


def data_dims(sharded_specs):
    """Per leaf, the dim split over "data" (-1 for none: a tree of ints)."""

    def dim(spec):
        return next((i for i, axis in enumerate(tuple(spec)) if axis == DATA), -1)

    return jax.tree.map(dim, sharded_specs, is_leaf=is_spec)


def gather_params(params_shards, dims, dtype):
    """Inside shard_map: the data-sharded master weights -> the whole local (tensor/pipe) shards in `dtype`."""

    def gather(x, dim):
        x = x.astype(dtype)
        return x if dim < 0 else jax.lax.all_gather(x, DATA, axis=dim, tiled=True)

    return jax.tree.map(gather, params_shards, dims)


def scatter_grads(grads, dims):
    """Inside shard_map: per-rank partial float32 gradients -> this rank's 1/d of their sum over "data"."""

    def scatter(g, dim):
        if dim < 0:
            return jax.lax.psum(g, DATA)
        return jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)

    return jax.tree.map(scatter, grads, dims)
