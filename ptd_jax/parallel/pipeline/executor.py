"""The lockstep pipeline executor (paper §2.2): one SPMD program runs a schedule table tick by tick.

The table (`lockstep.Schedule`) becomes integer columns before tracing (`columns.py`). Every tick has one kind for
all ranks, so the ticks are cut into runs of a static pattern (`tick_runs`: warm-up forwards, steady F/B pairs,
cool-down backwards), each one `lax.scan` whose body calls, per tick of the pattern, the tick function of its kind
(`TRAINING_TICKS`, or `EVALUATION_TICKS`) on the step's `TickContext`, the carry and the tick's row. In a tick each
pipeline rank

1. reads its cell of the row (`read_cell`: chunk, microbatch, slots) and its input from the activation or gradient
   slots, before any branch (a buffer read and written inside a `cond` is kept twice by XLA);
2. F: embeds (where virtual stage 0 runs; a `lax.cond`), then runs its chunk's layers, each under `jax.vjp`,
   writing layer j's residuals in place into the stash buffers at (its slot, j) (`stash.Residuals.forward`: the
   weights among them are not stored but put back at B); on the last stage y goes to the slot too (the head's
   input);
   B: on the last stage the head's forward and backward on y (`head_backward`, in a cond: its loss is computed
   here), then the chunk's layers' backwards in reverse from the residuals at (slot, j), each layer's input
   gradient passed on and its parameter gradients added in place to the float32 accumulators
   (`stash.Residuals.backward`), then, on stage 0, the embedding's transpose (`embed_backward`, in a cond: a
   linear map of the word and position rows, nothing stashed); what a layer's residuals hold, and so what its
   backward recomputes, is `--recompute-granularity`'s policy (`model.remat_layer`);
3. sends: y to rank + 1 over "pipe" (rank p−1 -> 0 carries it into its next chunk: the ring that makes
   interleaving work), dx to rank − 1. Every rank issues the ring on every tick, outside every branch
   (docs/architecture.md, "Pipeline");
4. writes what it received into the table's slot, after the branches.

Where the embedding and the head run, and whether an idle cell computes, is the branching strategy's choice
(`branching.py`: "uniform" or "per-rank"), made once per step. Split schedules (B and W, each rank its own kind in
a tick) run through `unit_executor.py`, which reuses this module's cell functions.

The parameters are cast to the compute dtype once per step, before the scans (with `--bf16` and float32 master
weights, a bf16 copy of the rank's layers lives through the step: half their float32 size).

Scatter/gather (§4.1): with t > 1 and no sequence parallelism, each tensor rank sends 1/t of the hidden dim; the
receivers re-assemble it with an all-gather typed tensor-invariant (`all_gather(..., to="invarying")`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig
from ptd_jax.parallel import sharding
from ptd_jax.parallel import tensor as tp
from ptd_jax.parallel.mesh import Axis
from ptd_jax.parallel.pipeline.branching import Branching, strategy
from ptd_jax.parallel.pipeline.columns import residual_slots, schedule_arrays, tick_runs, tick_work
from ptd_jax.parallel.pipeline.lockstep import Schedule
from ptd_jax.parallel.pipeline.stash import Residuals
from ptd_jax.parallel.vma import mark_like, mark_varying, varying_axes

PIPE, TENSOR = Axis.PIPE.value, Axis.TENSOR.value


# --- what every tick reads ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TickContext:
    """What every tick of one step reads: built once per step (`make_context`), before the scans."""

    cfg: ModelConfig
    p: int
    v: int
    branching: Branching
    ring_axes: tuple          # ("pipe",), or () when nothing varies over "pipe" (the p = 1 accumulation table)
    rank: jax.Array           # this device's pipeline rank (0 without a ring)
    chunks: dict              # this rank's chunks' parameters in the compute dtype, [v, k, ...]
    shared: dict              # the embeddings and the final LayerNorm in the compute dtype
    tokens: jax.Array         # [M, B, S]
    labels: jax.Array         # [M, B, S]
    mask: jax.Array           # [M, B, S]
    total_tokens: jax.Array   # the loss's denominator: unmasked tokens of the global batch
    sequence_parallel: bool
    scatter: int              # t when the ring sends 1/t of the hidden dim per tensor rank (§4.1), else 0
    recompute: str            # "none" | "selective" | "full" (`model.remat_layer`)
    key: jax.Array | None     # dropout: microbatch i draws from fold_in(key, i)
    act_like: jax.Array       # a zero activation [B, S or S/t, D], typed like the slots' contents
    acc_dtype: jnp.dtype      # loss and gradient accumulation (float32, or float64 in the exactness tests)
    residuals: Residuals | None = None  # training: the stash layout of one layer's vjp
    taps: object = None       # split schedules: the types of a layer's matmul taps (`stash.Taps`)
    v_shape: bool = False     # ZB-V: chunk 1 on rank r is virtual stage 2p − 1 − r (`schedule.stage_of`)

    @property
    def act_dtype(self):
        return jnp.dtype(self.cfg.dtype)

    @property
    def layers_per_chunk(self) -> int:
        return jax.tree.leaves(self.chunks)[0].shape[1]


class TracedCell(NamedTuple):
    """This rank's cell of one tick (`lockstep.Cell`), as traced scalars."""

    active: jax.Array
    chunk: jax.Array
    microbatch: jax.Array
    in_slot: jax.Array
    grad_slot: jax.Array
    recv_slot: jax.Array
    is_first: jax.Array  # runs virtual stage 0 (embeds)
    is_last: jax.Array   # runs the last virtual stage (output layer and loss)
    embed: jax.Array     # the embedding runs in this tick on this rank (`tick_work`)
    head: jax.Array      # the head runs in this tick on this rank: likewise


class Carry(NamedTuple):
    act: jax.Array           # [activation slots + trash, B, S or S/t, D]: chunk inputs, and on the last stage
                             # the chunk's output after its F (the head's input, read at the B)
    grad: jax.Array          # [gradient slots + trash, B, S or S/t, D]: gradients received from the next stage
    grads_chunks: dict       # float32 accumulators [v, k, ...] of this rank's chunks
    grads_shared: dict       # float32 accumulators of the embeddings and final LayerNorm
    loss: jax.Array          # sum of the last stage's token losses (accumulation dtype; / total tokens at the end)
    res: list                # [activation slots + trash, k, ...] per stashed leaf of a layer's vjp


class EvalCarry(NamedTuple):
    act: jax.Array           # [activation slots + trash, B, S or S/t, D]: chunk inputs
    loss: jax.Array          # as `Carry.loss`


def read_cell(ctx: TickContext, row: dict) -> TracedCell:
    c, active = row["chunk"][ctx.rank], row["active"][ctx.rank] > 0
    stage_id = c * ctx.p + ctx.rank
    embed, head = ctx.branching.cell_work(row, ctx.rank)
    return TracedCell(active=active, chunk=c, microbatch=row["microbatch"][ctx.rank], in_slot=row["in_slot"][ctx.rank],
                      grad_slot=row["grad_slot"][ctx.rank], recv_slot=row["recv_slot"][ctx.rank],
                      is_first=active & (stage_id == 0), is_last=active & (stage_id == ctx.p * ctx.v - 1),
                      embed=embed > 0, head=head > 0)


def chunk_index(ctx: TickContext, cell: TracedCell):
    return cell.chunk if ctx.v > 1 else 0  # with one chunk per rank the index is static: no dynamic slice


def microbatch_keys(ctx: TickContext, cell: TracedCell):
    """(embedding key, layer-stream key) of the cell's microbatch, or Nones without dropout."""
    if ctx.key is None:
        return None, None
    return jax.random.split(jax.random.fold_in(ctx.key, cell.microbatch))


def stage_id(ctx: TickContext, chunk):
    """The virtual stage of this rank's `chunk` (`schedule.stage_of`)."""
    if ctx.v_shape:
        return jnp.where(chunk == 0, ctx.rank, 2 * ctx.p - 1 - ctx.rank)
    return chunk * ctx.p + ctx.rank


def first_layer(ctx: TickContext, cell: TracedCell):
    """The index in the whole stack of the cell's chunk's first layer (its dropout stream)."""
    return stage_id(ctx, cell.chunk) * ctx.layers_per_chunk


def embed(ctx: TickContext, cell: TracedCell, shared):
    return tp.vocab_parallel_embed(shared, ctx.tokens[cell.microbatch], ctx.cfg, ctx.sequence_parallel,
                                   microbatch_keys(ctx, cell)[0])


def head_loss(ctx: TickContext, cell: TracedCell, shared, y):
    """Output layer and loss: the sum of the microbatch's masked token losses."""
    logits = tp.vocab_parallel_logits(shared, y, ctx.cfg, ctx.sequence_parallel)
    losses = tp.vocab_parallel_cross_entropy(logits, ctx.labels[cell.microbatch], ctx.cfg.vocab_size,
                                             ctx.cfg.fused_kernels)
    return jnp.sum(jnp.where(ctx.mask[cell.microbatch] > 0, losses, 0.0))


def last_stage_loss(ctx: TickContext, cell: TracedCell, loss):
    return jnp.where(cell.is_last, loss, 0.0).astype(ctx.acc_dtype)


def _transformer_layer(ctx: TickContext, layer_params, h, key):
    return tp.transformer_layer(layer_params, h, ctx.cfg, ctx.sequence_parallel, key, ctx.recompute)


def _layer_of_stack(ctx: TickContext, remat_layer, stream, first, layer_params, h, j):
    return remat_layer(layer_params, h, jax.random.fold_in(stream, first + j) if ctx.key is not None else None)


def layer_function(ctx: TickContext, cell: TracedCell):
    """Layer j of the cell's chunk as a function (its parameters, h, j) -> h, under the recompute policy, drawing
    dropout from the stream of layer first_layer + j of the whole stack (as `chunk_function` does)."""
    first = first_layer(ctx, cell)
    stream = microbatch_keys(ctx, cell)[1]
    remat_layer = gpt.remat_layer(partial(_transformer_layer, ctx), ctx.recompute)
    return partial(_layer_of_stack, ctx, remat_layer, stream, first)


def chunk_function(ctx: TickContext, cell: TracedCell, chunk_params, x):
    """The cell's chunk on x, keeping nothing for a backward (evaluation)."""
    first = first_layer(ctx, cell)
    return tp.run_layers(chunk_params, x, ctx.cfg, ctx.sequence_parallel, key=microbatch_keys(ctx, cell)[1],
                         first_layer=first)


def _add(grads, d):
    return jax.tree.map(lambda g, x: g + x.astype(g.dtype), grads, d)


# A chunk's work and the head's, each one named call in the jaxpr (tests and experiments/ count them).

def named(name: str, fn, *bound):
    """`fn(*bound, *args)` as one call named `name` in the jaxpr."""
    def call(*args):
        return fn(*bound, *args)
    call.__name__ = call.__qualname__ = name
    return jax.jit(call)


def _chunk_forward(ctx: TickContext, cell: TracedCell, chunks, x, bufs, slot):
    """-> (y, buffers with each layer's residuals at (slot, j)); layer j's parameters are sliced inside the layer
    loop: no copy of the chunk's first."""
    y, bufs = ctx.residuals.forward(layer_function(ctx, cell), chunks, chunk_index(ctx, cell), x, bufs, slot)
    return y.astype(ctx.act_dtype), bufs


def _skip_chunk_forward(chunks, x, bufs, slot):
    return jnp.zeros_like(x), bufs


def _eval_chunk_forward(ctx: TickContext, cell: TracedCell, chunk_params, x):
    return chunk_function(ctx, cell, chunk_params, x).astype(ctx.act_dtype)


def _skip_eval_chunk_forward(chunk_params, x):
    return jnp.zeros_like(x)


def _chunk_backward(ctx: TickContext, cell: TracedCell, chunks, bufs, slot, ct_y, grads):
    """-> (dx, accumulators + the chunk's parameter gradients, added layer by layer)."""
    dx, grads = ctx.residuals.backward(chunks, chunk_index(ctx, cell), bufs, slot, ct_y, grads,
                                       keep=ctx.branching.keep(cell.active))
    return dx.astype(ctx.act_dtype), grads


def _skip_chunk_backward(chunks, bufs, slot, ct_y, grads):
    return jnp.zeros_like(ct_y), grads


def _head_backward(ctx: TickContext, cell: TracedCell, y, ct_y, grads_shared, loss):
    """The head's forward and backward on y: adds its gradients and loss, and seeds the chunk's backward."""
    y = ctx.branching.only_where(cell.is_last, y)  # another rank's head runs on zeros: its zero seed gives zeros
    loss_sum, head_vjp = jax.vjp(partial(head_loss, ctx, cell), ctx.shared, y)
    seed = mark_like(jnp.where(cell.is_last, 1.0 / ctx.total_tokens, 0.0).astype(loss_sum.dtype), loss_sum)
    d_shared, dy_head = head_vjp(seed)
    grads_shared = _add(grads_shared, d_shared)
    return jnp.where(cell.is_last, dy_head.astype(ct_y.dtype), ct_y), grads_shared, loss + last_stage_loss(
        ctx, cell, loss_sum)


def _skip_head_backward(y, ct_y, grads_shared, loss):
    return ct_y, grads_shared, loss


def _embed_backward(ctx: TickContext, cell: TracedCell, grads_shared, dx):
    """The embedding's transpose (a linear function of the word and position rows: nothing stashed)."""
    (d_embed,) = jax.linear_transpose(partial(embed, ctx, cell), ctx.shared)(
        jnp.where(cell.is_first, dx, jnp.zeros_like(dx)))
    return _add(grads_shared, d_embed)


def _skip_embed_backward(grads_shared, dx):
    return grads_shared


def _ring(p: int, shift: int):
    return [(i, (i + shift) % p) for i in range(p)]


def send(ctx: TickContext, out, shift: int):
    """The ring, issued by every rank on every tick: F outputs go to rank + 1, B input-gradients to rank − 1. With
    scatter/gather each tensor rank sends its 1/t of the hidden dim and the receivers all-gather it."""
    if ctx.p == 1:
        return out
    if ctx.scatter:
        width = out.shape[-1] // ctx.scatter
        out = jax.lax.dynamic_slice_in_dim(out, jax.lax.axis_index(TENSOR) * width, width, axis=-1)
    recv = jax.lax.ppermute(out, PIPE, _ring(ctx.p, shift))
    return jax.lax.all_gather(recv, TENSOR, axis=-1, tiled=True, to="invarying") if ctx.scatter else recv


def _embed_input(ctx: TickContext, cell: TracedCell, x_in):
    return jnp.where(cell.is_first, embed(ctx, cell, ctx.shared), x_in)


def chunk_input(ctx: TickContext, cell: TracedCell, act):
    """The chunk's input: its slot, or on virtual stage 0 the embedding (a cond on the table's "embed")."""
    return jax.lax.cond(cell.embed, partial(_embed_input, ctx, cell), lambda x_in: x_in, act[cell.in_slot])


def forward_tick(ctx: TickContext, carry: Carry, row) -> Carry:
    """F: the chunk's forward, stashing each layer's residuals at the input's slot (trash for an idle cell); on
    the last stage y, the head's input, goes to that slot too."""
    cell = read_cell(ctx, row)
    trash = carry.act.shape[0] - 1
    x = chunk_input(ctx, cell, carry.act)
    y, stash = ctx.branching.chunk_work(cell.active, named("chunk_forward", _chunk_forward, ctx, cell),
                                        _skip_chunk_forward, ctx.chunks, x, carry.res, cell.in_slot)
    recv = send(ctx, y, 1)
    act = carry.act.at[jnp.where(cell.is_last, cell.in_slot, trash)].set(y)
    return carry._replace(act=act.at[cell.recv_slot].set(recv), res=stash)


def backward_tick(ctx: TickContext, carry: Carry, row) -> Carry:
    """B: the head's backward (last stage), the chunk's backward from its stash, the embedding's transpose (stage
    0); the input gradient goes to rank − 1. Per layer the chunk's backward is two steps: the vjp from the stash
    (`Residuals.layer_backward`: input and parameter gradients), then the in-place accumulation of the parameter
    gradients (`stash.add_layer_grads`), the part a zero-bubble W cell would run later. As in every tick, the slots
    are read before the branches and written after them."""
    cell = read_cell(ctx, row)
    y = carry.act[cell.in_slot]  # the chunk's output on the last stage: the head's input
    dy = carry.grad[cell.grad_slot]
    ct_y = mark_like(jnp.where(cell.active & ~cell.is_last, dy, jnp.zeros_like(dy)), y)
    ct_y, grads_shared, loss = jax.lax.cond(cell.head, named("head_backward", _head_backward, ctx, cell),
                                            _skip_head_backward, y, ct_y, carry.grads_shared, carry.loss)
    dx, grads_chunks = ctx.branching.chunk_work(cell.active, named("chunk_backward", _chunk_backward, ctx, cell),
                                                _skip_chunk_backward, ctx.chunks, carry.res, cell.in_slot, ct_y,
                                                carry.grads_chunks)
    dx = ctx.branching.only_where(cell.active, dx)
    grads_shared = jax.lax.cond(cell.embed, named("embed_backward", _embed_backward, ctx, cell),
                                _skip_embed_backward, grads_shared, dx)
    recv = send(ctx, dx, -1)
    return carry._replace(grad=carry.grad.at[cell.recv_slot].set(recv), grads_shared=grads_shared, loss=loss,
                          grads_chunks=grads_chunks)


def _head_loss_add(ctx: TickContext, cell: TracedCell, y, loss):
    return loss + last_stage_loss(ctx, cell, head_loss(ctx, cell, ctx.shared, y))


def evaluation_tick(ctx: TickContext, carry: EvalCarry, row) -> EvalCarry:
    """F of evaluation: the chunk's forward keeping nothing, then on the last stage the head's loss."""
    cell = read_cell(ctx, row)
    x = chunk_input(ctx, cell, carry.act)
    chunk_params = jax.tree.map(lambda a: a[chunk_index(ctx, cell)], ctx.chunks)
    y = ctx.branching.chunk_work(cell.active, named("chunk_forward", _eval_chunk_forward, ctx, cell),
                                 _skip_eval_chunk_forward, chunk_params, x)
    loss = jax.lax.cond(cell.head, partial(_head_loss_add, ctx, cell), lambda y, loss: loss, y, carry.loss)
    recv = send(ctx, y, 1)
    return carry._replace(act=carry.act.at[cell.recv_slot].set(recv), loss=loss)


TRAINING_TICKS = {"F": forward_tick, "B": backward_tick}
EVALUATION_TICKS = {"F": evaluation_tick}


def _run_pattern(ctx: TickContext, ticks: list, carry, rows):
    """One scan step: the pattern's ticks in order ("FB": the F first, so that the B's stash reads are ordered
    after the F's in-place writes; `tick_runs`)."""
    for i, tick in enumerate(ticks):
        carry = tick(ctx, carry, jax.tree.map(lambda a, i=i: a[i], rows))
    return carry, None


def run_table(ctx: TickContext, carry, columns: dict, kinds, ticks: dict):
    """The table's ticks in order, one `lax.scan` per run of `tick_runs`; `ticks` maps a kind to its tick."""
    for pattern, first, n in tick_runs(kinds):
        rows = {k: jnp.asarray(a[first:first + n * len(pattern)].reshape(n, len(pattern), *a.shape[1:]))
                for k, a in columns.items()}
        carry, _ = jax.lax.scan(partial(_run_pattern, ctx, [ticks[kind] for kind in pattern]), carry, rows)
    return carry


def make_context(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, *, cfg: ModelConfig,
                 sched: Schedule, sequence_parallel: bool, scatter_gather: bool, recompute: str, branching: str,
                 key) -> tuple[TickContext, dict, tuple]:
    """(the step's context, the table's columns, this rank's (chunks, shared) parameters as given: the types of the
    gradients). The parameters are cast to the compute dtype once, here."""
    t = jax.lax.psum(1, TENSOR)
    columns = {**schedule_arrays(sched), **tick_work(sched, branching)}
    chunks = sharding.local_chunks(params["layers"])  # [v, k, ...]
    # At p = 1 the ring is the identity (no ppermute), and with the layers unsplit over "pipe" (the step's
    # accumulation table, `parallel.step.accumulation_schedule`) nothing varies over "pipe".
    ring_axes = (PIPE,) if sched.p > 1 or PIPE in varying_axes(jax.tree.leaves(chunks)[0]) else ()
    rank = jax.lax.axis_index(PIPE) if ring_axes else jnp.zeros((), jnp.int32)
    shared = {k: val for k, val in params.items() if k != "layers"}
    b, S = tokens_MxBxS.shape[1], tokens_MxBxS.shape[2]
    act_like = mark_varying(jnp.zeros((b, S // t if sequence_parallel else S, cfg.hidden_size), jnp.dtype(cfg.dtype)),
                            ring_axes + tuple(sorted(varying_axes(tokens_MxBxS))))
    ctx = TickContext(
        cfg=cfg, p=sched.p, v=sched.v, branching=strategy(branching), ring_axes=ring_axes, rank=rank,
        chunks=gpt.cast_params(chunks, cfg), shared=gpt.cast_params(shared, cfg), tokens=tokens_MxBxS,
        labels=labels_MxBxS, mask=mask_MxBxS, total_tokens=total_tokens, sequence_parallel=sequence_parallel,
        scatter=t if scatter_gather and not sequence_parallel and t > 1 else 0, recompute=recompute, key=key,
        act_like=mark_varying(act_like, (TENSOR,)) if sequence_parallel else act_like,
        acc_dtype=gpt.acc_dtype(jax.tree.leaves(params)[0].dtype))
    return ctx, columns, (chunks, shared)


def _slots(ctx: TickContext, n: int):
    """n slots and the trash slot (the last), typed like the activations they hold."""
    return jnp.zeros((n + 1, *ctx.act_like.shape), ctx.act_dtype) + ctx.act_like[None]


def _loss_start(ctx: TickContext):
    return mark_varying(jnp.zeros((), ctx.acc_dtype), tuple(sorted(varying_axes(ctx.tokens) | set(ctx.ring_axes))))


def _accumulators(tree):
    """float32 (or float64) zero accumulators typed like `tree`'s leaves."""
    return jax.tree.map(lambda x: mark_like(jnp.zeros(x.shape, gpt.acc_dtype(x.dtype)), x), tree)


def pipeline_accumulate(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, *, cfg: ModelConfig,
                        sched: Schedule, sequence_parallel: bool, scatter_gather: bool = True,
                        recompute: str = "none", branching: str = "auto", key=None):
    """shard_map body: this device's (loss sum / total_tokens, float32 gradients) over the whole table — loss only
    on the last virtual stage's rank, embedding/output gradients only where those stages run (the caller sums
    them over "pipe" and "data"). `params["layers"]` is the local shard (`sharding.local_chunks`). `key` enables
    dropout with per-microbatch, per-layer masks that do not depend on the layout: microbatch i draws from
    fold_in(key, i), split into embedding and layer streams, and layer j of the whole stack from
    fold_in(layer stream, j) — the streams of the scan over microbatches at p = 1; a backward's recomputed forward
    draws its forward's masks."""
    ctx, columns, (chunks, shared) = make_context(
        params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, cfg=cfg, sched=sched,
        sequence_parallel=sequence_parallel, scatter_gather=scatter_gather, recompute=recompute,
        branching=branching, key=key)
    # The stash layout: one layer's vjp residuals, traced (shapes only) on the table's first cell.
    example = read_cell(ctx, jax.tree.map(lambda a: jnp.asarray(a[0]), columns))
    residuals = Residuals.trace(layer_function(ctx, example), jax.tree.map(lambda x: x[0, 0], ctx.chunks),
                                ctx.act_like, jnp.zeros((), jnp.int32))
    ctx = dataclasses.replace(ctx, residuals=residuals)
    carry = Carry(act=_slots(ctx, sched.num_act_slots), grad=_slots(ctx, sched.num_grad_slots),
                  grads_chunks=_accumulators(chunks), grads_shared=_accumulators(shared), loss=_loss_start(ctx),
                  res=residuals.buffers(residual_slots(sched, ctx.branching.idle_cells_run), ctx.layers_per_chunk))
    carry = run_table(ctx, carry, columns, sched.kinds, TRAINING_TICKS)
    grads = dict(carry.grads_shared)
    grads["layers"] = sharding.from_local_chunks(carry.grads_chunks)
    return carry.loss / total_tokens, grads


def pipeline_loss(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, *, cfg: ModelConfig,
                  sched: Schedule, sequence_parallel: bool, scatter_gather: bool = True, branching: str = "auto"):
    """shard_map body of evaluation: this device's loss sum / total_tokens over a table of forwards only
    (`lockstep.build_forward_only`), the head in the last stage's forwards; no stash, no gradients, no dropout."""
    ctx, columns, _ = make_context(
        params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, cfg=cfg, sched=sched,
        sequence_parallel=sequence_parallel, scatter_gather=scatter_gather, recompute="none", branching=branching,
        key=None)
    carry = run_table(ctx, EvalCarry(act=_slots(ctx, sched.num_act_slots), loss=_loss_start(ctx)), columns,
                      sched.kinds, EVALUATION_TICKS)
    return carry.loss / total_tokens
