"""A split backward (zero-bubble B and W) of a chunk's layers, under a per-rank predicate.

Each matmul of a layer takes a *tap* (`tensor.dot`): a zero input whose cotangent, in the matmul's custom backward,
is the matmul's input and output gradient, while the kernel's gradient is not computed. So:
- F (`forward`) runs each layer under `jax.vjp` with taps beside its parameters and stashes its residuals
  (`stash.Residuals`; the taps are not residuals: the stash is the fused schedules');
- B (`input_backward`) rebuilds each layer's vjp from the residuals, passes the input gradient down, adds the small
  parameters' gradients (LayerNorms, biases) and stashes the taps in the W stash;
- W (`weight_backward`) turns the taps into the kernels' gradients (`tensor.tap_weight_grad`).
No matmul runs twice.

Every function loops over the chunk's layers with the work of one layer in a `lax.cond` on `run` (this rank's cell
is of that kind), and reads and writes the slot buffers outside that conditional: a conditional that takes a
whole stash buffer and writes it in place made XLA:GPU copy the buffer (measured: 9 copies of the stash for a 1.3B
step at p = 4, 2.7 GiB of temporaries, `experiments/README.md`), where a layer's slice costs a layer's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ptd_jax.parallel import tensor as tp
from ptd_jax.parallel.pipeline.stash import Residuals
from ptd_jax.parallel.vma import mark_varying

TAP_GROUPS = {"qkv": "attn", "out": "attn", "fc1": "mlp", "fc2": "mlp"}
"""Each tapped matmul (`parallel.tensor.DOTS`) and the parameter group holding its kernel."""


def with_taps(params_j, taps):
    """Layer j's parameters with the taps beside the kernels (`<name>_tap`), or as they are without taps."""
    if taps is None:
        return params_j
    out = dict(params_j)
    for name, group in TAP_GROUPS.items():
        out[group] = {**out[group], f"{name}_tap": taps[name]}
    return out


@dataclass(frozen=True)
class Taps:
    """The types of a layer's matmul taps: per matmul its input x and output gradient g (`tensor.dot`)."""

    structs: dict   # name -> {"x": (ShapeDtypeStruct, axes), "g": (ShapeDtypeStruct, axes)}

    @classmethod
    def trace(cls, layer: Callable, params_j, h, j) -> Taps:
        found = {}

        def probe(params_j, h):
            tp.TAP_SHAPES = {}
            try:
                layer(params_j, h, j)
            finally:
                found.update(tp.TAP_SHAPES)
                tp.TAP_SHAPES = None

        jax.eval_shape(probe, params_j, h)
        if set(found) != set(TAP_GROUPS):  # jax.checkpoint caches its trace: a layer traced before runs no `dot`
            raise RuntimeError(f"tracing the layer recorded the matmuls {sorted(found)}, not {sorted(TAP_GROUPS)}: "
                               f"trace the taps of a layer function before anything else traces it")
        return cls({name: {"x": found[name][0], "g": found[name][1]} for name in TAP_GROUPS})

    def zeros(self, lead: tuple = ()) -> dict:
        """Zero taps {name: {"g", "x"}} with `lead` dimensions first, typed like the values they stand for."""
        return {name: {k: mark_varying(jnp.zeros((*lead, *s.shape), s.dtype), axes) for k, (s, axes) in pair.items()}
                for name, pair in self.structs.items()}

    def leaves(self, taps: dict) -> list:
        """A taps tree's leaves in the W stash's order: by matmul (`TAP_GROUPS`), then g, x."""
        return [taps[name][k] for name in TAP_GROUPS for k in ("g", "x")]

    def unflatten(self, leaves: list) -> dict:
        it = iter(leaves)
        return {name: {k: next(it) for k in ("g", "x")} for name in TAP_GROUPS}

    def buffers(self, slots: int, layers: int) -> list:
        """The W stash: a buffer [slots, layers, ...] per tap leaf (`leaves`' order)."""
        return self.leaves(self.zeros((slots, layers)))


def _named(name: str, fn):
    """`fn` as one call named `name` in the jaxpr (layer_forward, layer_input_backward, layer_weight_backward:
    tests and experiments/ count them)."""
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn)


def _layer(chunks, chunk, j):
    return jax.tree.map(lambda a: a[chunk, j], chunks)


def _num_layers(chunks) -> int:
    return jax.tree.leaves(chunks)[0].shape[1]


def _only(run, index, size):
    """`index` where this rank runs the work, else `size`: out of bounds, so that a scatter with mode="drop" writes
    nothing (a `where` between the new and the old slice would read and write the slice on every tick)."""
    return jnp.where(run, index, size)


def forward(residuals: Residuals, taps: Taps, layer: Callable, chunks, chunk, x, buffers: list, slot, run):
    """F where `run`: `layer(params_j, h, j)` over the chunk's layers from x, layer j's residuals written to the
    buffers at (slot, j). Returns (y, buffers); y is x where not `run`."""
    zero_leaves = [mark_varying(jnp.zeros(s.shape, s.dtype), a) for s, a in zip(residuals.structs, residuals.axes)]

    def work(params_j, h, j):
        h, vjp = jax.vjp(lambda prm, h: layer(prm, h, j), params_j, h)
        return h, residuals.split(vjp, params_j)

    def body(carry, j):
        h, bufs = carry
        params_j = with_taps(_layer(chunks, chunk, j), taps.zeros())
        h, leaves = jax.lax.cond(run, _named("layer_forward", work), lambda prm, h, j: (h, zero_leaves), params_j, h,
                                 j)
        bufs = [buf.at[_only(run, slot, buf.shape[0]), j].set(leaf, mode="drop")
                for buf, leaf in zip(bufs, leaves, strict=True)]
        return (h, bufs), None

    (y, buffers), _ = jax.lax.scan(body, (x, buffers), jnp.arange(_num_layers(chunks)))
    return y, buffers


def _small(d_params):
    """The gradients B adds: every parameter but the kernels (and the taps)."""
    return {group: {n: d for n, d in leaves.items() if not n.endswith(("_kernel", "_tap"))}
            for group, leaves in d_params.items()}


def input_backward(residuals: Residuals, taps: Taps, chunks, chunk, buffers: list, slot, ct_y, grads,
                   tap_buffers: list, w_slot, run):
    """B where `run`: the layers in reverse from the residuals at (slot, j), each passing its input gradient down;
    the small parameters' gradients added to `grads[chunk, j]`; each matmul's taps to the W stash at (w_slot, j).
    Returns (dx, grads, tap buffers)."""
    zero_small = _small(jax.tree.map(jnp.zeros_like, _layer(grads, chunk, 0)))

    def work(params_j, stashed, ct):
        d_params, ct = residuals.join(params_j, stashed)(ct)
        small = jax.tree.map(lambda d, z: d.astype(z.dtype), _small(d_params), zero_small)
        return ct, taps.leaves({name: d_params[group][f"{name}_tap"] for name, group in TAP_GROUPS.items()}), small

    def skip(params_j, stashed, ct):
        return ct, taps.leaves(taps.zeros()), zero_small

    def body(carry, j):
        ct, acc, tbufs = carry
        params_j = with_taps(_layer(chunks, chunk, j), taps.zeros())
        ct, leaves, small = jax.lax.cond(run, _named("layer_input_backward", work), skip, params_j,
                                         [buf[slot, j] for buf in buffers], ct)
        tbufs = [buf.at[_only(run, w_slot, buf.shape[0]), j].set(leaf, mode="drop") for buf, leaf in zip(tbufs, leaves)]
        acc = {g: {n: (a.at[_only(run, chunk, a.shape[0]), j].add(small[g][n], mode="drop") if n in small[g] else a)
                   for n, a in leaves_.items()} for g, leaves_ in acc.items()}
        return (ct, acc, tbufs), None

    (dx, grads, tap_buffers), _ = jax.lax.scan(body, (ct_y, grads, tap_buffers), jnp.arange(_num_layers(chunks)),
                                               reverse=True)
    return dx, grads, tap_buffers


def weight_backward(taps: Taps, chunks, chunk, tap_buffers: list, w_slot, grads, run):
    """W where `run`: every layer's kernel gradients from its taps at (w_slot, j), added to `grads[chunk, j]`."""
    dtypes = {n: grads[g][f"{n}_kernel"].dtype for n, g in TAP_GROUPS.items()}

    def work(kernels, stashed):
        t = taps.unflatten(stashed)
        return {n: tp.tap_weight_grad(n, t[n], kernels[n]).astype(dtypes[n]) for n in TAP_GROUPS}

    def skip(kernels, stashed):  # typed like `work`'s: a contraction varies over what its operands vary over
        axes = {n: tuple(sorted(set(taps.structs[n]["x"][1]) | set(taps.structs[n]["g"][1]))) for n in TAP_GROUPS}
        return {n: mark_varying(jnp.zeros(k.shape, dtypes[n]), axes[n]) for n, k in kernels.items()}

    def body(acc, j):
        kernels = {n: chunks[g][f"{n}_kernel"][chunk, j] for n, g in TAP_GROUPS.items()}
        d = jax.lax.cond(run, _named("layer_weight_backward", work), skip, kernels,
                         [buf[w_slot, j] for buf in tap_buffers])
        acc = dict(acc)
        for n, g in TAP_GROUPS.items():
            a = acc[g][f"{n}_kernel"]
            acc[g] = {**acc[g], f"{n}_kernel": a.at[_only(run, chunk, a.shape[0]), j].add(d[n], mode="drop")}
        return acc, None

    grads, _ = jax.lax.scan(body, grads, jnp.arange(_num_layers(chunks)))
    return grads
