"""The pipeline executor (paper §2.2): one SPMD program runs any schedule's table, tick by tick.

The table (`table.Table`) becomes integer columns before tracing (`lowering.columns`), and its ticks runs of a static
pattern (`lowering.tick_runs`: the kinds a tick's cells run and the ring directions they send in), each run one
`lax.scan`. In a tick each pipeline rank

1. reads its cell (kind, chunk, microbatch, slots) and its inputs from the activation and gradient slots, before any
   branch;
2. prepares the layers' input: an F's activation (on virtual stage 0 the embedding, in a `lax.cond`), or a B's or
   I's output gradient (on the last stage the one its F left in the act slot);
3. runs the chunk's layers in one `lax.scan`, each layer's work one `lax.switch` on the cell's kind (`layer_step`):
   - F: the layer under `jax.vjp`, its residuals to the record (`stash.Record`) at (slot, j);
   - B: the layer's vjp from its record: the input gradient passed down, every parameter gradient added;
   - I: the same with taps beside the matmuls: the input gradient and the small parameters' gradients, the taps
     to the record for the W;
   - W: the kernels' gradients from the taps;
   each branch reads the record rows it needs (an F none), and the rows are written after the switch by a scatter
   that drops an out-of-bounds row (no write where the rank runs another kind); the gradients are added the same
   way, in place, into float32 accumulators; F runs the layers forwards, B and I backwards. No conditional writes a
   buffer: XLA:GPU copied buffers written inside conditionals (measured: 1.3B at p = 4, several GiB);
4. on stage 0 after a B or I, the embedding's transpose (a `lax.cond`); on the last stage after an F, the head's
   forward and backward (a `lax.cond`: the loss added, the output layer's gradients added, and dL/d(output) kept
   in the act slot for the chunk's B or I);
5. sends its output (an F's activation, a B's or I's input gradient) over "pipe" in each direction the tick's
   pattern uses, issued by every rank outside every branch, and writes what arrived to the slot the table names.

"per-rank" branching (`ParallelConfig.pipeline_branching`) switches on each cell's own kind: an idle cell runs no
layer, only the rank that needs it embeds or runs the head; tensor collectives then sit in pipe-divergent branches,
which XLA:CPU runs correctly (docs/architecture.md, "Pipeline"). "uniform" (lockstep tables only: one kind per row)
runs every rank through its tick's kind, idle cells on whatever their slots hold, their writes dropped: no
collective in a pipe-divergent branch.

The parameters are cast to the compute dtype once per step, before the scans. Scatter/gather (§4.1): with t > 1 and
no sequence parallelism each tensor rank sends 1/t of the hidden dim; the receivers all-gather it.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig
from ptd_jax.runtime.platform import resolve_branching
from ptd_jax.parallel import sharding
from ptd_jax.parallel import tensor as tp
from ptd_jax.parallel.mesh import Axis
from ptd_jax.parallel.pipeline.lowering import KIND_CODES, SIDES, SLOT_POOLS, columns, tick_runs
from ptd_jax.parallel.pipeline.stash import TAP_GROUPS, Record, Residuals, Taps, with_taps
from ptd_jax.parallel.pipeline.table import Table
from ptd_jax.parallel.vma import mark_like, mark_varying, varying_axes

PIPE, TENSOR = Axis.PIPE.value, Axis.TENSOR.value
F_, B_, I_, W_ = (KIND_CODES[k] for k in "FBIW")


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
    """What every tick of one step reads: built once per step (`_context`), before the scans."""

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


class Carry(NamedTuple):
    act: jax.Array  # [act slots, B, S or S/t, D]: chunk inputs from arrival to F; on the last stage, the gradients of
    # its outputs from its F (which runs the head) to its B or I
    grad: jax.Array  # [grad slots, B, S or S/t, D]: output gradients from arrival to B/I
    record: list  # per buffer [slots of its pool, k, ...] (`stash.Record`); empty in evaluation
    grads_chunks: dict | None  # float32 accumulators [v, k, ...] of this rank's chunks; None in evaluation
    grads_shared: dict | None  # float32 accumulators of the embeddings and final LayerNorm
    loss: jax.Array  # sum of the last stage's token losses (accumulation dtype)


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


def _embed_input(ctx: Context, cell: Cell, x):
    return jnp.where(is_first(ctx, cell), embed(ctx, cell, ctx.shared), x)


def _head_backward(ctx: Context, cell: Cell, y, grads_shared, loss):
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


def _embed_backward(ctx: Context, cell: Cell, grads_shared, dx):
    """The embedding's transpose (a linear function of the word and position rows: nothing stashed)."""
    first = is_first(ctx, cell) & (cell.kind != F_)
    (d_embed,) = jax.linear_transpose(partial(embed, ctx, cell), ctx.shared)(jnp.where(first, dx, jnp.zeros_like(dx)))
    return jax.tree.map(lambda g, d: g + d.astype(g.dtype), grads_shared, d_embed)


def _head_loss_add(ctx: Context, cell: Cell, y, loss):
    last = is_last(ctx, cell)
    return loss + jnp.where(last, head_loss(ctx, cell, ctx.shared, y), 0.0).astype(ctx.acc_dtype)


# --- one layer's work -----------------------------------------------------------------------------------------------


def _is_kernel(group: str, name: str) -> bool:
    return any(group == g and name == f"{n}_kernel" for n, g in TAP_GROUPS.items())


class LayerStep:
    """One layer's work for each kind, as the branches of one `lax.switch` (module docstring, step 3). Every branch
    takes (layer parameters, h, the record's buffers, their slots, the layer index) and returns (h, a new row for
    every record buffer (zeros where it writes none: dropped after the switch), the layer's parameter gradients in
    the accumulators' dtype). A branch reads only the rows it needs: an F reads none."""

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

    def idle(self, params_j, h, bufs, slots, j):
        return h, self._blank(bufs), self.zero

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
            self._grads(d_params, lambda g, n: not _is_kernel(g, n)),
        )

    def weight_backward(self, params_j, h, bufs, slots, j):
        taps = self.ctx.taps.unflatten(self.record.tap_values(self._rows(bufs, slots, j)))
        d = tp.tap_weight_grads(params_j, taps, self.ctx.cfg, TAP_GROUPS)
        return h, self._blank(bufs), self._grads(d, _is_kernel)

    def branches(self, kinds: str):
        """(the switch's branches, each kind's code -> its branch index) for the kinds a pattern runs."""
        by_kind = {"F": self.forward, "B": self.backward, "I": self.input_backward, "W": self.weight_backward}
        fns = [self.idle] + [by_kind[k] for k in kinds]
        index = {KIND_CODES[k]: i + 1 for i, k in enumerate(kinds)}
        return [named(f"layer_{fn.__name__}", fn) if fn != self.idle else fn for fn in fns], index


def _branch_index(cell: Cell, index: dict):
    out = jnp.zeros((), jnp.int32)
    for code, i in index.items():
        out = jnp.where(cell.kind == code, i, out)
    return out


def run_layers(ctx: Context, cell: Cell, kinds: str, h, record: list, grads, direct: bool = False):
    """The chunk's layers (module docstring, step 3): -> (h, record, grads)."""
    k = ctx.layers_per_chunk
    c = chunk_index(ctx, cell)
    taps = ctx.taps.zeros() if ctx.taps is not None else None
    # a layer's gradients leave the switch in the compute dtype (half of float32 under --bf16/--fp16: the switch's
    # output is one layer's gradients beside the accumulators) and are widened by the in-place add
    zero_grads = jax.tree.map(
        lambda a, x: jnp.zeros(a.shape[2:], x.dtype) + jnp.zeros_like(a[0, 0], x.dtype), grads, ctx.chunks
    )
    step = LayerStep(ctx, cell, zero_grads)
    branches, index = step.branches(kinds)
    which = _branch_index(cell, index)
    backwards = (cell.kind == B_) | (cell.kind == I_)
    slots = [cell.slots[f"{pool}_slot"] for pool in ctx.record.pools]
    writes = [
        ("F" if b in ctx.record.residual_buffers else "") + ("I" if b in ctx.record.tap_buffers else "")
        for b in range(len(record))
    ]

    def body(carry, j):
        h, bufs, acc = carry
        jl = jnp.where(backwards, k - 1 - j, j)
        params_j = with_taps(jax.tree.map(lambda a: a[c, jl], ctx.chunks), taps)
        if direct:  # one kind and every cell runs it (uniform, or no idle cell in the run): no switch to copy out of
            h, values, d = branches[1](params_j, h, bufs, slots, jl)
        else:
            h, values, d = jax.lax.switch(which, branches, params_j, h, bufs, slots, jl)
        # a buffer or accumulator that no kind of this pattern writes is left alone (statically: no zeros made, no
        # masked write of a whole layer's gradient in an F tick)
        bufs = [
            buf.at[jnp.where(_writes(cell, w), slot, buf.shape[0]), jl].set(val, mode="drop") if _any(w, kinds) else buf
            for buf, slot, val, w in zip(bufs, slots, values, writes)
        ]
        acc = {
            g: {
                n: a.at[jnp.where(_writes(cell, _adders(g, n)), c, a.shape[0]), jl].add(
                    d[g][n].astype(a.dtype), mode="drop"
                )
                if _any(_adders(g, n), kinds)
                else a
                for n, a in leaves.items()
            }
            for g, leaves in acc.items()
        }
        return (h, bufs, acc), None

    (h, record, grads), _ = jax.lax.scan(body, (h, record, grads), jnp.arange(k))
    return h, record, grads


def _writes(cell: Cell, kinds: str):
    out = jnp.zeros((), bool)
    for kind in kinds:
        out = out | (cell.kind == KIND_CODES[kind])
    return out & cell.active


def _adders(group: str, name: str) -> str:
    """The kinds that add to a parameter's gradient: a kernel's in B and W, the others' in B and I."""
    return "BW" if _is_kernel(group, name) else "BI"


def _any(writers: str, kinds: str) -> bool:
    return any(k in kinds for k in writers)


# --- the ring -------------------------------------------------------------------------------------------------------


def send(ctx: Context, out, shift: int):
    """The ring, issued by every rank: `out` goes to rank + shift. With scatter/gather each tensor rank sends its 1/t
    of the hidden dim and the receivers all-gather it."""
    p = ctx.table.p
    if ctx.scatter:
        width = out.shape[-1] // ctx.scatter
        out = jax.lax.dynamic_slice_in_dim(out, jax.lax.axis_index(TENSOR) * width, width, axis=-1)
    recv = jax.lax.ppermute(out, PIPE, [(i, (i + shift) % p) for i in range(p)])
    return jax.lax.all_gather(recv, TENSOR, axis=-1, tiled=True, to="invarying") if ctx.scatter else recv


# --- a tick ---------------------------------------------------------------------------------------------------------


def tick(ctx: Context, pattern: tuple, carry: Carry, row: dict, busy: bool = False) -> Carry:
    """One tick of a static pattern (kinds, directions): module docstring, steps 1-5. `busy`: every rank runs a cell
    in this tick."""
    kinds, directions = pattern
    cell = read_cell(ctx, row, kinds)
    training = carry.grads_chunks is not None
    x_in = carry.act[cell.slots["in_slot"]]  # F: its input; B/I on the last stage: dL/d(its output)
    grads_shared, loss = carry.grads_shared, carry.loss
    h = ctx.act_like
    if "F" in kinds:
        x = jax.lax.cond(cell.embed & (cell.kind == F_), named("embed", _embed_input, ctx, cell), lambda x: x, x_in)
        h = jnp.where(cell.kind == F_, x, h) if kinds != "F" else x
    if "B" in kinds or "I" in kinds:
        # below the last stage the output gradient arrived; on it, the head's F left it in the act slot
        ct = mark_like(carry.grad[cell.slots["grad_slot"]], h)
        ct = jnp.where(is_last(ctx, cell), mark_like(x_in, h), ct)
        h = jnp.where(cell.kind == F_, h, ct) if "F" in kinds else ct
    record, grads_chunks = carry.record, carry.grads_chunks
    kept = None  # the last stage's F: dL/d(its output) from the head, kept for its B or I
    if training:
        direct = len(kinds) == 1 and (ctx.uniform or busy)
        out, record, grads_chunks = run_layers(ctx, cell, kinds, h, record, grads_chunks, direct)
        if "F" in kinds:
            kept, grads_shared, loss = jax.lax.cond(
                cell.head & (cell.kind == F_),
                named("head_backward", _head_backward, ctx, cell),
                lambda y, g, loss: (y, g, loss),
                out,
                grads_shared,
                loss,
            )
    else:
        out = _evaluate_chunk(ctx, cell, h)
        loss = jax.lax.cond(cell.head, partial(_head_loss_add, ctx, cell), lambda y, loss: loss, out, loss)
    act, grad = carry.act, carry.grad
    if ("B" in kinds or "I" in kinds) and training:
        grads_shared = jax.lax.cond(
            cell.embed & (cell.kind != F_),
            named("embed_backward", _embed_backward, ctx, cell),
            lambda g, dx: g,
            grads_shared,
            out,
        )
    if kept is not None:  # the last stage's output gradient waits for its B or I (its out_slot; else dropped)
        out_slot = jnp.where(cell.kind == F_, cell.slots["out_slot"], act.shape[0])
        act = act.at[out_slot].set(kept, mode="drop")
    for d in sorted(set(directions) | ({0} if ctx.table.spec.stage_map == "v" else set())):
        arrived = out if d == 0 else send(ctx, out, d)
        side = SIDES[d]
        act = act.at[row[f"recv_act_{side}"][ctx.rank]].set(arrived, mode="drop")
        grad = grad.at[row[f"recv_grad_{side}"][ctx.rank]].set(arrived, mode="drop")
    return carry._replace(
        act=act, grad=grad, record=record, grads_chunks=grads_chunks, grads_shared=grads_shared, loss=loss
    )


def _evaluate_chunk(ctx: Context, cell: Cell, x):
    """An F of evaluation: the chunk's layers keeping nothing (an idle cell skips them)."""
    chunk = jax.tree.map(lambda a: a[chunk_index(ctx, cell)], ctx.chunks)
    first = stage_id(ctx, cell.chunk) * ctx.layers_per_chunk
    opts = ctx.opts

    def run(chunk, x):
        return tp.run_layers(chunk, x, opts.cfg, opts.sequence_parallel, key=None, first_layer=first).astype(x.dtype)

    if ctx.uniform:
        return run(chunk, x)
    return jax.lax.cond(cell.active, named("chunk_forward", run), lambda chunk, x: x, chunk, x)


def run_table(ctx: Context, carry: Carry) -> Carry:
    """The table's ticks in order, one `lax.scan` per run of `lowering.tick_runs`."""
    cols = columns(ctx.table)
    for pattern, first, n in tick_runs(ctx.table):
        width = len(pattern)
        rows = {k: jnp.asarray(a[first : first + n * width].reshape(n, width, *a.shape[1:])) for k, a in cols.items()}

        # per position in the pattern: whether every rank works in each of the run's ticks there
        busy = [bool((cols["kind"][first + i : first + n * width : width] > 0).all()) for i in range(width)]

        def body(carry, rows, pattern=pattern, busy=busy):
            for i, pat in enumerate(pattern):
                carry = tick(ctx, pat, carry, {k: col[i] for k, col in rows.items()}, busy[i])
            return carry, None

        carry, _ = jax.lax.scan(body, carry, rows)
    return carry


# --- the step's entry points ----------------------------------------------------------------------------------------


def _context(params, batch: StepInputs, table: Table, opts: Options) -> tuple[Context, tuple]:
    t = jax.lax.psum(1, TENSOR)
    chunks = sharding.local_chunks(params["layers"])  # [v, k, ...]
    # At p = 1 nothing varies over "pipe" where the layers are unsplit (the step's accumulation table).
    ring_axes = (PIPE,) if table.p > 1 or PIPE in varying_axes(jax.tree.leaves(chunks)[0]) else ()
    rank = jax.lax.axis_index(PIPE) if ring_axes else jnp.zeros((), jnp.int32)
    shared = {k: val for k, val in params.items() if k != "layers"}
    b, S = batch.tokens.shape[1], batch.tokens.shape[2]
    sp = opts.sequence_parallel
    act_like = mark_varying(
        jnp.zeros((b, S // t if sp else S, opts.cfg.hidden_size), jnp.dtype(opts.cfg.dtype)),
        ring_axes + tuple(sorted(varying_axes(batch.tokens))),
    )
    uniform = resolve_branching(opts.branching, schedule=table.name) == "uniform"
    ctx = Context(
        opts=opts,
        table=table,
        uniform=uniform,
        rank=rank,
        chunks=gpt.cast_params(chunks, opts.cfg),
        shared=gpt.cast_params(shared, opts.cfg),
        batch=batch,
        scatter=t if opts.scatter_gather and not sp and t > 1 else 0,
        act_like=mark_varying(act_like, (TENSOR,)) if sp else act_like,
        acc_dtype=gpt.acc_dtype(jax.tree.leaves(params)[0].dtype),
    )
    return ctx, (chunks, shared)


def _slots(ctx: Context, n: int):
    """n slots typed like the activations they hold."""
    return jnp.zeros((max(n, 1), *ctx.act_like.shape), ctx.act_like.dtype) + ctx.act_like[None]


def _loss_start(ctx: Context):
    axes = varying_axes(ctx.batch.tokens) | varying_axes(ctx.act_like) - {TENSOR}
    return mark_varying(jnp.zeros((), ctx.acc_dtype), tuple(sorted(axes)))


def _accumulators(tree):
    """float32 (or float64) zero accumulators typed like `tree`'s leaves."""
    return jax.tree.map(lambda x: mark_like(jnp.zeros(x.shape, gpt.acc_dtype(x.dtype)), x), tree)


def _trace_record(ctx: Context) -> Context:
    """The record's layout: one layer's residuals (with taps where the backward splits), traced for shapes only."""
    cols = columns(ctx.table)
    example = read_cell(ctx, {k: jnp.asarray(a[0]) for k, a in cols.items()}, ctx.table.kinds[0])
    layer = layer_function(ctx, example)
    params_0 = jax.tree.map(lambda x: x[0, 0], ctx.chunks)
    j = jnp.zeros((), jnp.int32)
    # where a microbatch can wait between its I and its W (zero-bubble tables: up to p of them), W recomputes fc2's
    # input from fc1's rather than keep it: a W then holds no more than an F (docs/architecture.md, "Pipeline")
    waits = max(ctx.table.peak_w_stash, default=0) > 1
    taps = Taps.trace(layer, params_0, ctx.act_like, j, fc2_input=not waits) if ctx.table.split else None
    residuals = Residuals.trace(layer, with_taps(params_0, taps.zeros() if taps else None), ctx.act_like, j)
    record = Record.layout(residuals, taps)
    return dataclasses.replace(ctx, residuals=residuals, taps=taps, record=record)


def accumulate(params, batch: StepInputs, table: Table, opts: Options):
    """shard_map body: this device's (loss sum / total tokens, float32 gradients) over the whole table — the loss
    only on the last virtual stage's rank, embedding and output gradients only where those stages run (the caller
    sums them over "pipe" and "data"). `params["layers"]` is the local shard (`sharding.local_chunks`). With
    `opts.key`, dropout masks that do not depend on the layout: microbatch i draws from fold_in(key, i), split into
    embedding and layer streams, and layer j of the whole stack from fold_in(layer stream, j)."""
    ctx, (chunks, shared) = _context(params, batch, table, opts)
    ctx = _trace_record(ctx)
    carry = Carry(
        act=_slots(ctx, table.slots["act"]),
        grad=_slots(ctx, table.slots["grad"]),
        record=ctx.record.buffers(table.slots, ctx.layers_per_chunk),
        grads_chunks=_accumulators(chunks),
        grads_shared=_accumulators(shared),
        loss=_loss_start(ctx),
    )
    carry = run_table(ctx, carry)
    grads = {**carry.grads_shared, "layers": sharding.from_local_chunks(carry.grads_chunks)}
    return carry.loss / batch.total_tokens, grads


def loss(params, batch: StepInputs, table: Table, opts: Options):
    """shard_map body of evaluation: this device's loss sum / total tokens over a table of forwards only
    (`table.build_forward_only`), the head in the last stage's forwards; no stash, no gradients, no dropout."""
    ctx, _ = _context(params, batch, table, dataclasses.replace(opts, recompute="none", key=None))
    carry = Carry(
        act=_slots(ctx, table.slots["act"]),
        grad=_slots(ctx, table.slots["grad"]),
        record=[],
        grads_chunks=None,
        grads_shared=None,
        loss=_loss_start(ctx),
    )
    return run_table(ctx, carry).loss / batch.total_tokens
