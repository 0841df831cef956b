"""What every kernel file shares: one `pallas_call` entry point that lets kernels run inside `jax.shard_map`
bodies (each device's local heads, tokens or vocabulary shard); the typing helpers are public in `vma.py`.

Inside shard_map, jax 0.10 types every value with the mesh axes it varies over ("vma") and checks that the
operands of each primitive agree. In interpret mode (CPU), the interpreter re-binds the kernel's top-level
primitives on block values that carry the caller's varying axes, while the kernel itself was traced without any;
a literal such as the `D` in a mean then fails the check ("Primitive div requires varying manual axes to
match"). Tracing the kernel under `jax.jit` makes its body one call whose types are its own, so nothing inside
is re-checked. Grid indices must then be read outside that call (the interpreter substitutes `program_id` only
at top level), so every kernel takes them as its first argument. The jit is added only in interpret mode.

On GPUs the kernels are compiled by Pallas' Triton backend, named explicitly (see `pallas_call`); its tiles
must have power-of-two sizes, which each kernel file arranges by padding or masking.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl

try:  # deprecated since jax 0.11 (in favour of Mosaic GPU), still the backend these kernels are written for
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # a future jax without it: lower with whatever pallas_call picks; the masked loads of
    pltriton = None  # odd widths (LayerNorm columns, a partial vocabulary step) then need porting


def pallas_call(kernel, *, grid: tuple[int, ...], interpret: bool, num_warps: int = 4, num_stages: int = 2, **kwargs):
    """`pl.pallas_call` of `kernel(program_ids, *refs)`: the kernel gets its grid indices as a tuple (read
    outside the jit, where the interpreter can substitute them) and is traced under jit when interpreted (see
    the module docstring). On GPUs the Triton backend is asked for by name: with no compiler parameters, jax
    0.10 lowers generic `pallas_call`s with Mosaic GPU, which rejects these kernels (whole-row blocks exceed
    shared memory; no transpose)."""
    body = jax.jit(kernel) if interpret else kernel

    def with_ids(*refs):
        body(tuple(pl.program_id(axis) for axis in range(len(grid))), *refs)

    params = (
        None if interpret or pltriton is None else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    )
    return pl.pallas_call(with_ids, grid=grid, interpret=interpret, compiler_params=params, **kwargs)
