"""The pipeline executor (paper §2.2): one SPMD program runs any schedule's table, tick by tick.

The table (`table.Table`) becomes integer columns before tracing (`lowering.columns`), and its ticks runs of a static
pattern (`lowering.tick_runs`: the kinds a tick's cells run and the ring directions they send in), each run one
`lax.scan`. In a tick each pipeline rank

1. reads its cell (kind, chunk, microbatch, slots) and its inputs from the activation and gradient slots, before any
   branch;
2. prepares the layers' input: an F's activation (on virtual stage 0 the embedding, in a `lax.cond`), or a B's or
   I's output gradient (on the last stage the one its F left in the act slot);
3. runs the chunk's layers, one loop over them per kind the tick's pattern runs (`run_layers`): k trips where the
   cell runs that kind, none elsewhere, so under "per-rank" a rank does only its own cell's work and an idle cell
   none (`cells.LayerStep`):
   - F: the layer under `jax.vjp`, its residuals to the record (`stash.Record`) at (slot, j);
   - B: the layer's vjp from its record: the input gradient passed down, every parameter gradient added;
   - I: the same with taps beside the matmuls: the input gradient and the small parameters' gradients, the taps
     to the record for the W;
   - W: the kernels' gradients from the taps;
   F and W run the layers forwards, B and I backwards. A kind's loop carries only the record buffers and the
   float32 accumulators it writes, updated in place, and reads the rest as constants. Loops, not conditionals:
   XLA gives a conditional's outputs new buffers, so a `lax.switch` on the kind made every rank write a layer's
   worth of zero gradients and blank rows that its kind does not produce, and conditionals that write the stash
   copied it (docs/architecture.md, "Conditionals against loops, measured");
4. on stage 0 after a B or I, the embedding's transpose (a `lax.cond`); on the last stage after an F, the head's
   forward and backward (a `lax.cond`: the loss added, the output layer's gradients added, and dL/d(output) kept
   in the act slot for the chunk's B or I);
5. sends its output (an F's activation, a B's or I's input gradient) over "pipe" in each direction the tick's
   pattern uses, issued by every rank outside every branch, and writes what arrived to the slot the table names.

"per-rank" branching (`ParallelConfig.pipeline_branching`) follows each cell's own kind: an idle cell runs no
layer, only the rank that needs it embeds or runs the head; tensor collectives then sit in loops and branches whose
trip counts and predicates differ over "pipe" (never within a tensor group),
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
from ptd_jax.runtime.platform import resolve_branching
from ptd_jax.parallel import sharding
from ptd_jax.parallel import tensor as tp
from ptd_jax.parallel.mesh import Axis
from ptd_jax.parallel.pipeline.cells import (
    Cell,
    Context,
    LayerStep,
    Options,
    StepInputs,
    chunk_index,
    embed_backward,
    embed_input,
    head_backward,
    head_loss_add,
    is_kernel,
    is_last,
    layer_function,
    named,
    read_cell,
    stage_id,
)
from ptd_jax.parallel.pipeline.lowering import KIND_CODES, SIDES, columns, tick_runs
from ptd_jax.parallel.pipeline.stash import Record, Residuals, Taps, with_taps
from ptd_jax.parallel.pipeline.table import Table
from ptd_jax.parallel.vma import mark_like, mark_varying, varying_axes

PIPE, TENSOR = Axis.PIPE.value, Axis.TENSOR.value
F_ = KIND_CODES["F"]


class Carry(NamedTuple):
    act: jax.Array  # [act slots, B, S or S/t, D]: chunk inputs from arrival to F; on the last stage, the gradients of
    # its outputs from its F (which runs the head) to its B or I
    grad: jax.Array  # [grad slots, B, S or S/t, D]: output gradients from arrival to B/I
    record: list  # per buffer [slots of its pool, k, ...] (`stash.Record`); empty in evaluation
    grads_chunks: dict | None  # float32 accumulators [v, k, ...] of this rank's chunks; None in evaluation
    grads_shared: dict | None  # float32 accumulators of the embeddings and final LayerNorm
    loss: jax.Array  # sum of the last stage's token losses (accumulation dtype)


def run_layers(ctx: Context, cell: Cell, kinds: str, h, record: list, grads, direct: bool = False):
    """The chunk's layers (module docstring, step 3): -> (h, record, grads). One loop over the layers per kind the
    tick's pattern runs: k trips where the cell runs that kind (every cell when `direct`), none elsewhere."""
    k = ctx.layers_per_chunk
    c = chunk_index(ctx, cell)
    taps = ctx.taps.zeros() if ctx.taps is not None else None
    # a layer's gradients in the compute dtype, widened by the in-place add
    zero_grads = jax.tree.map(
        lambda a, x: jnp.zeros(a.shape[2:], x.dtype) + jnp.zeros_like(a[0, 0], x.dtype), grads, ctx.chunks
    )
    step = LayerStep(ctx, cell, zero_grads)
    slots = [cell.slots[f"{pool}_slot"] for pool in ctx.record.pools]
    writers = [
        ("F" if b in ctx.record.residual_buffers else "") + ("I" if b in ctx.record.tap_buffers else "")
        for b in range(len(record))
    ]

    def write_rows(bufs: dict, rows: dict, jl) -> dict:
        # the masks drop the writes of an idle cell under "uniform" branching (its slots are out of bounds too)
        return {
            b: buf.at[jnp.where(_writes(cell, writers[b]), slots[b], buf.shape[0]), jl].set(rows[b], mode="drop")
            if b in rows
            else buf
            for b, buf in bufs.items()
        }

    def add_grads(acc: dict, d: dict, jl) -> dict:
        return {
            g: {
                n: a.at[jnp.where(_writes(cell, _adders(g, n)), c, a.shape[0]), jl].add(
                    d[g][n].astype(a.dtype), mode="drop"
                )
                for n, a in leaves.items()
            }
            for g, leaves in acc.items()
        }

    for kind in kinds:
        work = step.of_kind(kind)
        # The loop's carry holds only the record buffers and accumulators this kind writes, updated in place; the
        # others it reads as constants. An I's taps for the rows its residuals held ("hold" buffers, read and written
        # by the same loop) wait in the carry and are written at the start of the next layer, before any row is
        # read: written at once, beside reads of the same buffer, XLA:CPU copied the whole buffer every layer.
        held = {b for b, pool in enumerate(ctx.record.pools) if pool == "hold" and kind == "I"}
        read = record

        def body(j, carry, work=work, held=held, read=read, kind=kind):
            h, mine, acc, (pending, pending_jl) = carry
            mine = write_rows(mine, pending, pending_jl)
            bufs = [mine.get(b, buf) for b, buf in enumerate(read)]
            jl = k - 1 - j if kind in "BI" else j  # F and W run the layers forwards, B and I backwards
            params_j = with_taps(jax.tree.map(lambda leaf: leaf[c, jl], ctx.chunks), taps)
            h, rows, d = work(params_j, h, bufs, slots, jl)
            mine = write_rows(mine, {b: rows[b] for b in mine if b not in held}, jl)
            return h, mine, add_grads(acc, d, jl), ({b: rows[b] for b in held}, jl)

        mine = {b: buf for b, buf in enumerate(record) if kind in writers[b]}
        acc = {g: {n: a for n, a in leaves.items() if kind in _adders(g, n)} for g, leaves in grads.items()}
        # before the first layer, the "pending" rows are the first layer's own (written back unchanged): read from the
        # buffers here, XLA schedules them with the loop, where zero rows were hoisted and all kept at once
        first = k - 1 if kind in "BI" else 0
        none_yet = ({b: record[b][slots[b], first] for b in held}, jnp.asarray(first))
        trips = k if direct else jnp.where(cell.kind == KIND_CODES[kind], k, 0)
        h, mine, acc, (pending, pending_jl) = jax.lax.fori_loop(0, trips, body, (h, mine, acc, none_yet))
        mine = write_rows(mine, pending, pending_jl)
        record = [mine.get(b, buf) for b, buf in enumerate(record)]
        grads = {g: {n: acc[g].get(n, a) for n, a in leaves.items()} for g, leaves in grads.items()}
        # Every record buffer's next use waits for this loop (its last layer index): a later loop that writes a
        # buffer this one only read runs after it. Unordered, XLA:GPU kept a copy of the buffer for the reader
        # (1.3B at p = 4, 1f1b: 9.7 GiB of temporaries against 5.7).
        record = [jax.lax.optimization_barrier((buf, pending_jl))[0] for buf in record]
    return h, record, grads


def _writes(cell: Cell, kinds: str):
    out = jnp.zeros((), bool)
    for kind in kinds:
        out = out | (cell.kind == KIND_CODES[kind])
    return out & cell.active


def _adders(group: str, name: str) -> str:
    """The kinds that add to a parameter's gradient: a kernel's in B and W, the others' in B and I."""
    return "BW" if is_kernel(group, name) else "BI"


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
        x = jax.lax.cond(cell.embed & (cell.kind == F_), named("embed", embed_input, ctx, cell), lambda x: x, x_in)
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
                named("head_backward", head_backward, ctx, cell),
                lambda y, g, loss: (y, g, loss),
                out,
                grads_shared,
                loss,
            )
    else:
        out = _evaluate_chunk(ctx, cell, h)
        loss = jax.lax.cond(cell.head, partial(head_loss_add, ctx, cell), lambda y, loss: loss, out, loss)
    act, grad = carry.act, carry.grad
    if ("B" in kinds or "I" in kinds) and training:
        grads_shared = jax.lax.cond(
            cell.embed & (cell.kind != F_),
            named("embed_backward", embed_backward, ctx, cell),
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
