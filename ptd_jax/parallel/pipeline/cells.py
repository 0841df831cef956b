"""One pipeline rank's cell of a tick (`executor.py` runs the ticks): the step's context, the cell it reads from the
table's columns, and the work of each kind — a layer's F, B, I or W (`LayerStep`), the embedding, and the head's
forward and backward on the last stage."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig
from ptd_jax.parallel import tensor as tp
from ptd_jax.parallel.pipeline.lowering import KIND_CODES, SLOT_POOLS
from ptd_jax.parallel.pipeline.stash import TAP_GROUPS, Record, Residuals, Taps
from ptd_jax.parallel.pipeline.table import Table
from ptd_jax.parallel.vma import mark_like

F_ = KIND_CODES["F"]


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's batch, as the shard_map body sees it."""

    tokens: jax.Array  # [M, B, S]
    labels: jax.Array  # [M, B, S]
    mask: jax.Array  # [M, B, S]
    total_tokens: jax.Array  # the loss's denominator: unmasked tokens of the global batch


@dataclasses.dataclass(frozen=True)
class Options:
    """How the step runs the table."""

    cfg: ModelConfig
    sequence_parallel: bool = False
    scatter_gather: bool = True
    recompute: str = "none"  # "none" | "selective" | "full" (`model.remat_layer`)
    branching: str = "auto"  # "uniform" | "per-rank" | "auto" (`runtime.platform.resolve_branching`)
    key: jax.Array | None = None  # dropout: microbatch i draws from fold_in(key, i)


@dataclasses.dataclass(frozen=True)
class Context:
    """What every tick of one step reads: built once per step (`executor._context`), before the scans."""

    opts: Options
    table: Table
    uniform: bool
    rank: jax.Array  # this device's pipeline rank (0 without a ring)
    chunks: dict  # this rank's chunks' parameters in the compute dtype, [v, k, ...]
    shared: dict  # the embeddings and the final LayerNorm in the compute dtype
    batch: StepInputs
    scatter: int  # t when the ring sends 1/t of the hidden dim per tensor rank (§4.1), else 0
    act_like: jax.Array  # a zero activation [B, S or S/t, D], typed like the slots' contents
    acc_dtype: jnp.dtype
    residuals: Residuals | None = None
    taps: Taps | None = None
    record: Record | None = None

    @property
    def cfg(self) -> ModelConfig:
        return self.opts.cfg

    @property
    def layers_per_chunk(self) -> int:
        return jax.tree.leaves(self.chunks)[0].shape[1]


class Cell(NamedTuple):
    """This rank's cell of one tick, as traced scalars."""

    kind: jax.Array
    chunk: jax.Array
    microbatch: jax.Array
    slots: dict  # SLOT_POOLS' names -> slot
    embed: jax.Array
    head: jax.Array
    active: jax.Array


# --- the cell -------------------------------------------------------------------------------------------------------


def read_cell(ctx: Context, row: dict, pattern_kinds: str) -> Cell:
    r = ctx.rank
    kind = row["kind"][r]
    if ctx.uniform:  # every rank runs the tick's one kind; an idle cell's writes are dropped (its slots are OOB)
        kind = jnp.full_like(kind, KIND_CODES[pattern_kinds])
        embed, head = jnp.any(row["embed"] > 0), jnp.any(row["head"] > 0)
    else:
        embed, head = row["embed"][r] > 0, row["head"][r] > 0
    return Cell(
        kind=kind,
        chunk=row["chunk"][r],
        microbatch=row["microbatch"][r],
        slots={name: row[name][r] for name in SLOT_POOLS},
        embed=embed,
        head=head,
        active=row["kind"][r] > 0,
    )


def stage_id(ctx: Context, chunk):
    """The virtual stage of this rank's `chunk` (`schedule.stage_of`)."""
    p = ctx.table.p
    if ctx.table.spec.stage_map == "v":
        return jnp.where(chunk == 0, ctx.rank, 2 * p - 1 - ctx.rank)
    return chunk * p + ctx.rank


def is_first(ctx: Context, cell: Cell):
    return cell.active & (stage_id(ctx, cell.chunk) == 0)


def is_last(ctx: Context, cell: Cell):
    return cell.active & (stage_id(ctx, cell.chunk) == ctx.table.p * ctx.table.v - 1)


def chunk_index(ctx: Context, cell: Cell):
    return cell.chunk if ctx.table.v > 1 else 0  # with one chunk per rank the index is static


def microbatch_keys(ctx: Context, cell: Cell):
    """(embedding key, layer-stream key) of the cell's microbatch, or Nones without dropout."""
    if ctx.opts.key is None:
        return None, None
    return jax.random.split(jax.random.fold_in(ctx.opts.key, cell.microbatch))


def layer_function(ctx: Context, cell: Cell):
    """Layer j of the cell's chunk as a function (its parameters, h, j) -> h under the recompute policy, drawing
    dropout from the stream of layer (its stage's first layer + j) of the whole stack."""
    opts = ctx.opts
    first = stage_id(ctx, cell.chunk) * ctx.layers_per_chunk
    stream = microbatch_keys(ctx, cell)[1]

    def layer(params, h, key):
        return tp.transformer_layer(params, h, opts.cfg, opts.sequence_parallel, key, opts.recompute)

    remat = gpt.remat_layer(layer, opts.recompute)

    def of_stack(params, h, j):
        return remat(params, h, jax.random.fold_in(stream, first + j) if stream is not None else None)

    return of_stack


# --- embedding and head ---------------------------------------------------------------------------------------------


def embed(ctx: Context, cell: Cell, shared):
    return tp.vocab_parallel_embed(
        shared, ctx.batch.tokens[cell.microbatch], ctx.cfg, ctx.opts.sequence_parallel, microbatch_keys(ctx, cell)[0]
    )


def head_loss(ctx: Context, cell: Cell, shared, y):
    """Output layer and loss: the sum of the microbatch's masked token losses."""
    logits = tp.vocab_parallel_logits(shared, y, ctx.cfg, ctx.opts.sequence_parallel)
    losses = tp.vocab_parallel_cross_entropy(
        logits, ctx.batch.labels[cell.microbatch], ctx.cfg.vocab_size, ctx.cfg.fused_kernels
    )
    return jnp.sum(jnp.where(ctx.batch.mask[cell.microbatch] > 0, losses, 0.0))


def named(name: str, fn, *bound):
    """`fn(*bound, *args)` as one call named `name` in the jaxpr (tests and experiments/ count them)."""

    def call(*args):
        return fn(*bound, *args)

    call.__name__ = call.__qualname__ = name
    return jax.jit(call)


def embed_input(ctx: Context, cell: Cell, x):
    return jnp.where(is_first(ctx, cell), embed(ctx, cell, ctx.shared), x)


def head_backward(ctx: Context, cell: Cell, y, grads_shared, loss):
    """The head's forward and backward on the last stage's output y, right after its F: adds the head's gradients
    and loss, and returns dL/dy, which waits in y's act slot for the chunk's B or I. Run at the F rather than the B
    or I, a tick's longest cell is shorter: the head (V/h = 25 in the paper's shape) joins the F, not the I of a
    unit row whose other ranks run an F, I or W each; what waits is dL/dy instead of y, of the same size."""
    last = is_last(ctx, cell) & (cell.kind == F_)
    y_in = jnp.where(last, y, jnp.zeros_like(y))  # under "uniform" another rank's head runs on zeros: zero gradients
    loss_sum, head_vjp = jax.vjp(partial(head_loss, ctx, cell), ctx.shared, y_in)
    seed = mark_like(jnp.where(last, 1.0 / ctx.batch.total_tokens, 0.0).astype(loss_sum.dtype), loss_sum)
    d_shared, dy = head_vjp(seed)
    grads_shared = jax.tree.map(lambda g, d: g + d.astype(g.dtype), grads_shared, d_shared)
    loss = loss + jnp.where(last, loss_sum, 0.0).astype(ctx.acc_dtype)
    return jnp.where(last, dy.astype(y.dtype), y), grads_shared, loss


def embed_backward(ctx: Context, cell: Cell, grads_shared, dx):
    """The embedding's transpose (a linear function of the word and position rows: nothing stashed)."""
    first = is_first(ctx, cell) & (cell.kind != F_)
    (d_embed,) = jax.linear_transpose(partial(embed, ctx, cell), ctx.shared)(jnp.where(first, dx, jnp.zeros_like(dx)))
    return jax.tree.map(lambda g, d: g + d.astype(g.dtype), grads_shared, d_embed)


def head_loss_add(ctx: Context, cell: Cell, y, loss):
    last = is_last(ctx, cell)
    return loss + jnp.where(last, head_loss(ctx, cell, ctx.shared, y), 0.0).astype(ctx.acc_dtype)


# --- one layer's work -----------------------------------------------------------------------------------------------


def is_kernel(group: str, name: str) -> bool:
    return any(group == g and name == f"{n}_kernel" for n, g in TAP_GROUPS.items())


class LayerStep:
    """One layer's work for each kind (executor's module docstring, step 3), as the body of that kind's loop over the
    chunk's layers. Each takes (layer parameters, h, the record's buffers, their slots, the layer index) and returns
    (h, a new row for every record buffer (zeros where it writes none), the layer's parameter gradients in the
    compute dtype (zeros where it adds none)); the loop writes only the rows and adds only the gradients its kind
    writes, so the zeros are never made. A kind reads only the rows it needs: an F reads none."""

    def __init__(self, ctx: Context, cell: Cell, zero_grads: dict):
        self.ctx, self.cell, self.zero = ctx, cell, zero_grads
        self.layer = layer_function(ctx, cell)
        self.record = ctx.record

    def _grads(self, d_params, keep):
        return {
            g: {n: (mark_like(d_params[g][n].astype(z.dtype), z) if keep(g, n) else z) for n, z in leaves.items()}
            for g, leaves in self.zero.items()
        }

    @staticmethod
    def _rows(bufs, slots, j):
        return [buf[slot, j] for buf, slot in zip(bufs, slots)]

    @staticmethod
    def _blank(bufs):
        return [jnp.zeros_like(buf[0, 0]) for buf in bufs]

    def forward(self, params_j, h, bufs, slots, j):
        y, vjp = jax.vjp(lambda prm, h: self.layer(prm, h, j), params_j, h)
        leaves = self.ctx.residuals.split(vjp, params_j)
        return y.astype(h.dtype), self.record.with_residuals(self._blank(bufs), leaves), self.zero

    def backward(self, params_j, ct, bufs, slots, j):
        rows = self._rows(bufs, slots, j)
        vjp = self.ctx.residuals.join(params_j, self.record.residual_values(rows))
        d_params, ct = vjp(ct)
        return ct.astype(self.ctx.act_like.dtype), self._blank(bufs), self._grads(d_params, lambda g, n: True)

    def input_backward(self, params_j, ct, bufs, slots, j):
        rows = self._rows(bufs, slots, j)
        vjp = self.ctx.residuals.join(params_j, self.record.residual_values(rows))
        d_params, ct = vjp(ct)
        taps = self.ctx.taps.leaves({name: d_params[g][f"{name}_tap"] for name, g in TAP_GROUPS.items()})
        return (
            ct.astype(self.ctx.act_like.dtype),
            self.record.with_taps(self._blank(bufs), taps),
            self._grads(d_params, lambda g, n: not is_kernel(g, n)),
        )

    def weight_backward(self, params_j, h, bufs, slots, j):
        taps = self.ctx.taps.unflatten(self.record.tap_values(self._rows(bufs, slots, j)))
        d = tp.tap_weight_grads(params_j, taps, self.ctx.cfg, TAP_GROUPS)
        return h, self._blank(bufs), self._grads(d, is_kernel)

    def of_kind(self, kind: str):
        """The kind's work, as one call named `layer_<method>` in the jaxpr (tests and experiments/ count them)."""
        fn = {"F": self.forward, "B": self.backward, "I": self.input_backward, "W": self.weight_backward}[kind]
        return named(f"layer_{fn.__name__}", fn)
