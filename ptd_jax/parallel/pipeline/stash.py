"""What a layer saves between its actions, and where: F's `jax.vjp` residuals, I's matmul taps, in slot buffers.

`jax.vjp` returns a closure that is a pytree whose leaves are the residuals the backward needs; their shapes and the
tree structure are fixed at trace time. So an F tick can write layer j's leaves straight into scan-carried buffers
[slots, k, ...] at (slot, j), in place, and a later B or I tick can read them at (slot, j) and unflatten them into
the same closure (docs/architecture.md, "Recomputation: Megatron's semantics"). Two refinements over storing every
leaf (`Residuals`):
- leaves that *are* the chunk's parameters (a matmul's weight, passed through unchanged) are not stashed: the B
  tick puts its own copy of the same parameters back in their place, so no slot holds a weight;
- PRNG keys (selective recomputation re-draws attention dropout from its key) are stored as their raw key data.

A split backward (zero-bubble I and W) gives each matmul a *tap* (`tensor.dot`): a zero input whose cotangent is what
the kernel's gradient needs, the matmul's input and output gradient, so I computes the input gradient only and W
turns the taps into the kernel's gradient later (`Taps`); no matmul runs twice, but the one below.

`Record` lays both out in flat buffers. A tap leaf of a residual leaf's size, dtype and axes takes that residual's
buffer (dead once I has read it), in the "hold" slots (F to W); residuals no tap takes stay in "rec" (F to I), taps
without a partner go to "w" (I to W): `table.py` places the three pools. Sharing never costs more than separate
buffers (a microbatch held F to W is one held F to I plus one held I to W). Two choices make the taps fit the
residuals (recomputation none, fused LayerNorm; measured in experiments/README.md, "Zero-bubble memory"):
- the taps of values that are the same on every tensor rank (QKV's and fc1's inputs, the projection's and fc2's
  output gradients) are taken where they are typed so, outside Megatron's f and g, like the layer input, the
  LayerNorm outputs and the projection's output they replace;
- where a microbatch can wait between its I and its W (the zero-bubble tables), fc2 keeps no input tap: W
  recomputes it from fc1's (`tensor.fc2_input`: fc1's forward again, 2hF/t FLOPs and F/t values fewer per token). Its
  taps then hold 4h + 8h/t values per token, as its residuals do, so a microbatch waiting for its W costs what one
  waiting for its I costs (docs/architecture.md, "Pipeline"). Where W follows I at once (1F1B) fc2 keeps its input.

The structures are learned once per step with `jax.eval_shape` (nothing is computed), including each leaf's varying
mesh axes, so that the buffers carry the types the kinds' loop bodies return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ptd_jax.parallel import tensor as tp
from ptd_jax.parallel.vma import mark_varying, varying_axes


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@dataclass(frozen=True)
class Residuals:
    """Where each residual leaf of `vjp(fn, params, x)` comes from: a parameter leaf (its index) or a stash entry."""

    treedef: Any
    sources: tuple  # per residual leaf: ("param", i) or ("stash", j)
    structs: tuple  # per stash entry: ShapeDtypeStruct as stored (keys as their uint32 data)
    axes: tuple  # per stash entry: the mesh axes it varies over
    key_impls: tuple  # per stash entry: the PRNG impl of a key leaf, else None

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
        stashed = [
            jax.random.wrap_key_data(s, impl=impl) if impl is not None else s
            for s, impl in zip(stashed, self.key_impls, strict=True)
        ]
        leaves = [param_leaves[i] if where == "param" else stashed[i] for where, i in self.sources]
        return jax.tree.unflatten(self.treedef, leaves)


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
    """The types of a layer's matmul taps: per matmul its input "x" and output gradient "g" (`tensor.dot`); fc2 without
    "x" where W recomputes its input from fc1's (`tensor.fc2_input`)."""

    structs: dict  # name -> {"g": (ShapeDtypeStruct, axes), "x": ...}

    @classmethod
    def trace(cls, layer: Callable, params_j, h, j, fc2_input: bool = True) -> Taps:
        """The taps of `layer`; `fc2_input`: W keeps fc2's input (else it recomputes it, one matmul, to keep
        F/t fewer values per token while it waits)."""
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
            raise RuntimeError(
                f"tracing the layer recorded the matmuls {sorted(found)}, not {sorted(TAP_GROUPS)}: "
                f"trace the taps of a layer function before anything else traces it"
            )
        keep = {name: ("g", "x") if fc2_input or name != "fc2" else ("g",) for name in TAP_GROUPS}
        return cls({name: {k: found[name][k] for k in keep[name]} for name in TAP_GROUPS})

    def zeros(self) -> dict:
        """Zero taps {name: {"g", "x"}}, typed like the values they stand for."""
        return {
            name: {k: mark_varying(jnp.zeros(s.shape, s.dtype), axes) for k, (s, axes) in pair.items()}
            for name, pair in self.structs.items()
        }

    def entries(self) -> list[tuple[jax.ShapeDtypeStruct, tuple]]:
        """(struct, axes) per tap leaf in `leaves`' order."""
        return [pair[k] for pair in self.structs.values() for k in sorted(pair)]

    def leaves(self, taps: dict) -> list:
        """A taps tree's leaves: by matmul (`TAP_GROUPS`), then g, x."""
        return [taps[name][k] for name, pair in self.structs.items() for k in sorted(pair)]

    def unflatten(self, leaves: list) -> dict:
        it = iter(leaves)
        return {name: {k: next(it) for k in sorted(pair)} for name, pair in self.structs.items()}


@dataclass(frozen=True)
class Entry:
    """Where one leaf lives: buffer `buffer` of the record, elements [offset, offset + size) of its flat row."""

    buffer: int
    offset: int
    struct: jax.ShapeDtypeStruct


@dataclass(frozen=True)
class Record:
    """A layer's saved values laid out in flat buffers [slots of its pool, layers, n] (module docstring): per buffer
    its dtype, length, varying axes and slot pool ("rec", "hold" or "w"); for each residual leaf (F writes, B/I read)
    and each tap leaf (I writes, W reads) its `Entry`. One buffer per residual; a tap takes a residual's buffer where
    size, dtype and axes match ("hold"), the others get their own ("w"); the residuals no tap takes stay "rec"."""

    dtypes: tuple
    lengths: tuple
    axes: tuple
    pools: tuple
    residual_entries: tuple
    tap_entries: tuple

    @classmethod
    def layout(cls, residuals: Residuals, taps: Taps | None) -> Record:
        dtypes = [s.dtype for s in residuals.structs]
        lengths = [s.size for s in residuals.structs]
        axes, pools = list(residuals.axes), ["rec"] * len(dtypes)
        res = tuple(Entry(b, 0, s) for b, s in enumerate(residuals.structs))
        tap_entries = []
        for s, a in taps.entries() if taps is not None else []:
            match = next(
                (
                    b
                    for b in range(len(res))
                    if pools[b] == "rec" and lengths[b] == s.size and dtypes[b] == s.dtype and axes[b] == a
                ),
                None,
            )
            if match is None:
                dtypes.append(s.dtype)
                lengths.append(s.size)
                axes.append(a)
                pools.append("w")
                match = len(dtypes) - 1
            else:
                pools[match] = "hold"
            tap_entries.append(Entry(match, 0, s))
        return cls(tuple(dtypes), tuple(lengths), tuple(axes), tuple(pools), res, tuple(tap_entries))

    def bytes(self, slots: dict) -> int:
        """Bytes of one layer's record buffers at these pool sizes."""
        return sum(slots[pool] * n * jnp.dtype(d).itemsize for d, n, pool in zip(self.dtypes, self.lengths, self.pools))

    def buffers(self, slots: dict, layers: int) -> list:
        """Zero buffers [slots of its pool, layers, n], typed like the leaves they hold."""
        return [
            mark_varying(jnp.zeros((max(slots[pool], 1), layers, n), d), a)
            for d, n, a, pool in zip(self.dtypes, self.lengths, self.axes, self.pools)
        ]

    @property
    def residual_buffers(self) -> set:
        return {e.buffer for e in self.residual_entries}

    @property
    def tap_buffers(self) -> set:
        return {e.buffer for e in self.tap_entries}

    @staticmethod
    def _read(values: list, entries) -> list:
        return [values[e.buffer][e.offset : e.offset + e.struct.size].reshape(e.struct.shape) for e in entries]

    def _write(self, values: list, entries, leaves: list) -> list:
        """`values` with the buffers `entries` name rebuilt from `leaves` (each packed at its offset; the rest of a
        row is padding)."""
        out = list(values)
        rows: dict = {}
        for e, leaf in zip(entries, leaves, strict=True):
            rows.setdefault(e.buffer, []).append((e.offset, leaf.reshape(-1)))
        for b, parts in rows.items():
            parts.sort(key=lambda x: x[0])
            flat = [x for _, x in parts]
            pad = self.lengths[b] - sum(x.size for x in flat)
            if pad:
                flat.append(jnp.zeros((pad,), self.dtypes[b]) + jnp.zeros_like(values[b][:pad]))
            out[b] = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
        return out

    def residual_values(self, values: list) -> list:
        return self._read(values, self.residual_entries)

    def tap_values(self, values: list) -> list:
        return self._read(values, self.tap_entries)

    def with_residuals(self, values: list, leaves: list) -> list:
        return self._write(values, self.residual_entries, leaves)

    def with_taps(self, values: list, leaves: list) -> list:
        return self._write(values, self.tap_entries, leaves)
