"""Backward without recomputation: each layer's `jax.vjp` residuals, kept in slot buffers from its F tick to its B tick.

`jax.vjp` returns a closure that is a pytree whose leaves are the residuals the backward needs; their shapes and the
tree structure are fixed at trace time. So an F tick's scan over its chunk's layers can write layer j's leaves
straight into scan-carried buffers [slots (+ a trash slot where idle cells write), k, ...] at (slot, j), in place,
and a later B tick's reverse scan can read them at (slot, j) and unflatten them into the same closure
(docs/architecture.md, "Recomputation: Megatron's semantics"): the same traffic as autodiff's own stacked residuals,
with no copy into or out of a slot. Two refinements over storing every leaf:
- leaves that *are* the chunk's parameters (a matmul's weight, passed through unchanged) are not stashed: the B
  tick puts its own copy of the same parameters back in their place, so no slot holds a weight;
- PRNG keys (selective recomputation re-draws attention dropout from its key) are stored as their raw key data.

The residual structure is learned once per step with `jax.eval_shape` (nothing is computed), including each leaf's
varying mesh axes, so that the buffers carry the types the branches return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ptd_jax.parallel.vma import mark_varying, varying_axes


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@dataclass(frozen=True)
class Residuals:
    """Where each residual leaf of `vjp(fn, params, x)` comes from: a parameter leaf (its index) or a stash entry."""

    treedef: Any
    sources: tuple           # per residual leaf: ("param", i) or ("stash", j)
    structs: tuple           # per stash entry: ShapeDtypeStruct as stored (keys as their uint32 data)
    axes: tuple              # per stash entry: the mesh axes it varies over
    key_impls: tuple         # per stash entry: the PRNG impl of a key leaf, else None

    @classmethod
    def trace(cls, fn: Callable, params, x, *extra) -> Residuals:
        """The residuals of `vjp(lambda params, x: fn(params, x, *extra), params, x)`."""
        found = {}

        def probe(params, x, *extra):
            _, vjp = jax.vjp(lambda params, x: fn(params, x, *extra), params, x)
            leaves, treedef = jax.tree.flatten(vjp)
            param_leaves = jax.tree.leaves(params)
            sources, stashed, axes, impls = [], [], [], []
            for leaf in leaves:
                hit = next((i for i, q in enumerate(param_leaves) if leaf is q), None)
                if hit is not None:
                    sources.append(("param", hit))
                    continue
                sources.append(("stash", len(stashed)))
                axes.append(tuple(sorted(varying_axes(leaf))))
                impls.append(jax.random.key_impl(leaf) if _is_key(leaf.dtype) else None)
                stashed.append(jax.random.key_data(leaf) if _is_key(leaf.dtype) else leaf)
            found.update(treedef=treedef, sources=tuple(sources), axes=tuple(axes), impls=tuple(impls))
            return stashed

        shapes = jax.eval_shape(probe, params, x, *extra)
        structs = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes)
        return cls(found["treedef"], found["sources"], structs, found["axes"], found["impls"])

    @property
    def slot_bytes(self) -> int:
        return sum(s.size * jnp.dtype(s.dtype).itemsize for s in self.structs)

    def split(self, vjp, params) -> list:
        """The leaves of `vjp` that go to the stash (checks that the others are `params`' own leaves)."""
        leaves = jax.tree.leaves(vjp)
        param_leaves = jax.tree.leaves(params)
        out = []
        for leaf, (where, i) in zip(leaves, self.sources, strict=True):
            if where == "param":
                assert leaf is param_leaves[i], "a residual traced as a parameter is not one here"
            else:
                out.append(jax.random.key_data(leaf) if _is_key(leaf.dtype) else leaf)
        return out

    def join(self, params, stashed: list):
        """The vjp closure again, from this tick's parameters and the stashed leaves."""
        param_leaves = jax.tree.leaves(params)
        stashed = [jax.random.wrap_key_data(s, impl=impl) if impl is not None else s
                   for s, impl in zip(stashed, self.key_impls, strict=True)]
        leaves = [param_leaves[i] if where == "param" else stashed[i] for where, i in self.sources]
        return jax.tree.unflatten(self.treedef, leaves)

    def buffers(self, slots: int, layers: int) -> list:
        """Zero buffers [slots, layers, ...] typed like the leaves they hold."""
        return [mark_varying(jnp.zeros((slots, layers, *s.shape), s.dtype), a)
                for s, a in zip(self.structs, self.axes)]

    def forward(self, layer: Callable, chunks, chunk, x, buffers: list, slot):
        """Run `layer(params_j, h, j)` over the layers of `chunks[chunk]` ([v, k, ...]: layer j's parameters are
        sliced inside the loop, once) from x, writing layer j's residuals to the buffers at (slot, j). Returns
        (y, buffers)."""
        def body(carry, j):
            h, bufs = carry
            params_j = jax.tree.map(lambda a: a[chunk, j], chunks)
            h, vjp = jax.vjp(lambda prm, h: layer(prm, h, j), params_j, h)
            bufs = [buf.at[slot, j].set(r) for buf, r in zip(bufs, self.split(vjp, params_j), strict=True)]
            return (h, bufs), None

        (y, buffers), _ = jax.lax.scan(body, (x, buffers), jnp.arange(_num_layers(chunks)))
        return y, buffers

    def layer_backward(self, chunks, chunk, buffers: list, slot, j, ct):
        """Layer j's backward from its residuals at (slot, j): (its input gradient, its parameter gradients), from
        one vjp (the split schedules' B and W: `split.py`)."""
        params_j = jax.tree.map(lambda a: a[chunk, j], chunks)
        d_params, ct = self.join(params_j, [buf[slot, j] for buf in buffers])(ct)
        return ct, d_params

    def backward(self, chunks, chunk, buffers: list, slot, ct_y, grads, keep=None):
        """The layers' backwards in reverse from the residuals at (slot, j): returns (dx, grads), each layer's input
        gradient passed down and its parameter gradients added to `grads[chunk, j]` (`add_layer_grads`)."""
        def body(carry, j):
            ct, acc = carry
            ct, d_params = self.layer_backward(chunks, chunk, buffers, slot, j, ct)
            return (ct, add_layer_grads(acc, chunk, j, d_params, keep)), None

        (dx, grads), _ = jax.lax.scan(body, (ct_y, grads), jnp.arange(_num_layers(chunks)), reverse=True)
        return dx, grads


def add_layer_grads(grads, chunk, j, d_params, keep=None, only=None):
    """`grads[chunk, j] += d_params` in place (in the accumulators' dtype), zeros where `keep` is false (an idle
    cell's, under "uniform" branching). `only(leaf name)`: add just those leaves (a split backward's B adds the
    small parameters', its W the kernels'); `d_params` may then hold other entries (taps) or miss the rest."""
    if only is None:
        if keep is not None:
            d_params = jax.tree.map(lambda d: jnp.where(keep, d, jnp.zeros_like(d)), d_params)
        return jax.tree.map(lambda g, d: g.at[chunk, j].add(d.astype(g.dtype)), grads, d_params)
    out = {}
    for group, leaves in grads.items():
        if isinstance(leaves, dict):
            out[group] = {n: g.at[chunk, j].add(d_params[group][n].astype(g.dtype)) if only(n) else g
                          for n, g in leaves.items()}
        else:
            out[group] = leaves.at[chunk, j].add(d_params[group].astype(leaves.dtype)) if only(group) else leaves
    return out


def _num_layers(chunks) -> int:
    return jax.tree.leaves(chunks)[0].shape[1]
