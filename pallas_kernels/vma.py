"""Varying-manual-axes ("vma") typing for code that runs inside `jax.shard_map` bodies: public, because both the
kernels and `ptd_jax.parallel` need it (`pallas_kernels` imports nothing from `ptd_jax`, so the one definition
lives here).

Inside shard_map, jax types every value with the mesh axes it varies over and checks that the operands of each
primitive agree. A kernel's `out_shape` must therefore carry its inputs' varying axes (`out_struct`), and its
operands must agree among themselves (`match_varying`).
"""

from __future__ import annotations

import inspect

import jax


def varying_axes(x) -> frozenset:
    """Mesh axes x varies over inside shard_map (empty outside; jax 0.10: manual_axis_type, earlier: vma)."""
    aval = jax.typeof(x)
    if getattr(aval, "manual_axis_type", None) is not None:
        return frozenset(aval.manual_axis_type.varying)
    return frozenset(getattr(aval, "vma", None) or ())


def match_varying(*arrays):
    """The arrays, each marked varying over the union of their varying axes (a kernel's operands must agree;
    autodiff turns each mark into the psum that the broadcast implies)."""
    union = frozenset().union(*(varying_axes(a) for a in arrays))
    out = []
    for a in arrays:
        missing = tuple(sorted(union - varying_axes(a)))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def out_struct(shape, dtype, like):
    """ShapeDtypeStruct varying over the same shard_map axes as `like`."""
    aval = jax.typeof(like)
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    if "manual_axis_type" in params and getattr(aval, "manual_axis_type", None) is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
    if "vma" in params and getattr(aval, "vma", None) is not None:
        return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)
    return jax.ShapeDtypeStruct(shape, dtype)
