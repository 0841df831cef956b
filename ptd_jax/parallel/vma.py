"""Typing helpers for `jax.shard_map` bodies: the mesh axes a value varies over, and marking values varying.

Inside shard_map with vma checking, every value carries the set of mesh axes it varies over. The rules that the
parallel code leans on (docs/architecture.md, "shard_map typing"):
- `pcast(x, axes, to="varying")` is a no-op on values whose transpose is a `psum` over those axes; Megatron's `f`
  is exactly that, and marking a parameter varying before autodiff keeps `jax.vjp` from all-reducing its
  gradient once per microbatch (it is reduced once per step instead).
- scan carries and the branches of a `cond` must agree in type, so zero buffers are marked like what they hold.
"""

from __future__ import annotations

import jax

from pallas_kernels.vma import varying_axes  # one definition for the kernels and the parallel code

__all__ = ["mark_like", "mark_tree", "mark_varying", "varying_axes"]


def mark_varying(x, axes: tuple[str, ...]):
    """pcast x to varying over the axes it is not yet varying over (a no-op on values; its transpose is psum)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def mark_like(x, like):
    """x marked varying over the same mesh axes as `like` (scan carries and cond branches must match types)."""
    return mark_varying(x, tuple(sorted(varying_axes(like))))


def mark_tree(tree, axes_tree):
    """`mark_varying` leaf by leaf; `axes_tree` has a tuple of axis names where `tree` has a leaf."""
    return jax.tree.map(lambda a, x: mark_varying(x, a), axes_tree, tree, is_leaf=lambda a: isinstance(a, tuple))
