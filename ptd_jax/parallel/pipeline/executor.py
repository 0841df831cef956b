"""The lockstep pipeline executor (paper §2.2): one SPMD program runs a schedule table tick by tick.

The table (`lockstep.Schedule`) is turned into integer arrays before tracing; `lax.scan` runs over its rows. One
tick reads like the schedule: each pipeline rank

1. reads its cell of the row and its inputs from the stash (before the switch: a buffer read and written inside a
   conditional is kept twice by XLA);
2. runs the cell (a branch of `lax.switch`, see below). With `--recompute-granularity` none or selective
   (Megatron's default, nothing or only the attention core recomputed):
   - F: x = embedding (virtual stage 0) or the received activation; y, vjp = `jax.vjp(chunk, x)`; the vjp's
     residuals go to the cell's stash slot (`stash.Residuals`: the weights among them are not stored but put back
     at B), and y into its input's slot (on the last stage, the head's input);
   - B: the last stage runs the head's forward and backward on y (its loss value is computed here), every stage
     rebuilds the chunk's vjp from its residuals and applies it to the cotangent dy (received from the next
     virtual stage, or the head's), and stage 0 transposes the embedding (a linear map of the word and position
     rows: nothing stashed); parameter gradients accumulate per chunk in float32;
   With `full` the stash holds chunk inputs and a B is `jax.vjp` of the whole stage on it: its chunk's forward
   recomputed once (with the loss on the last stage).
   Idle cells compute nothing ("per-rank") or a masked dummy ("uniform"); either way they write to a trash slot
   and add nothing;
3. sends: y to rank + 1 over "pipe" (rank p−1 -> 0 carries it into its next chunk: the ring that makes
   interleaving work), dx to rank − 1. Every rank issues the ring on every tick (docs/architecture.md, "Pipeline");
4. writes what it received into the table's slot, and adds its gradients to the chunk's accumulator.

What a cell computes is decided per cell kind (`cell_variants`), before tracing, from the table: the embedding
only where virtual stage 0 runs, the output layer and loss only where the last virtual stage runs its backward
(or, in evaluation, its forward). Two ways to branch (`ParallelConfig.pipeline_branching`):
- "uniform": one branch per tick for all ranks (its index comes from the replicated table): the embedding and the
  head run on every rank, masked, but only on the ticks where some rank needs them; idle cells compute a masked
  dummy. No collective ever sits in a pipe-divergent branch.
- "per-rank": each rank takes its own branch of a `lax.switch`: only the rank of virtual stage 0 embeds, only the
  last stage's rank runs the head, and an idle cell runs no layer (it still returns zero gradients, which are
  added to the accumulators like every cell's). Its tensor-parallel collectives sit in
  pipe-divergent branches, which XLA:CPU runs correctly (measured; docs/architecture.md, "Pipeline"); the ring
  stays outside the switch, uniform.
On a GPU both are expected to take about the same lockstep wall time (a tick lasts as long as its busiest rank;
not yet measured); on fake CPU devices, which share the cores, "per-rank" does less total work.

The parameters are cast to the compute dtype once per step, before the scan (with `--bf16` and float32 master
weights, a bf16 copy of the rank's layers lives through the step: half their float32 size).

Scatter/gather (§4.1): with t > 1 and no sequence parallelism, each tensor rank sends 1/t of the hidden dim; the
receivers re-assemble it with an all-gather typed tensor-invariant (`all_gather(..., to="invarying")`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ptd_jax import model as gpt
from ptd_jax.config import PIPELINE_BRANCHINGS, ModelConfig
from ptd_jax.parallel import sharding
from ptd_jax.parallel import tensor as tp
from ptd_jax.parallel.mesh import Axis
from ptd_jax.parallel.pipeline.lockstep import Schedule
from ptd_jax.parallel.pipeline.stash import Residuals
from ptd_jax.parallel.vma import mark_like, mark_varying, varying_axes

PIPE, TENSOR = Axis.PIPE.value, Axis.TENSOR.value


def schedule_arrays(sched: Schedule) -> dict[str, np.ndarray]:
    """Table rows as int32 arrays: kind [T] (1 = F), and per rank [T, p]: active, chunk, microbatch, in_slot,
    grad_slot, recv_slot. Missing slots point at the trash slot (index num_slots)."""
    T, p = sched.ticks, sched.p
    trash_act, trash_grad = sched.num_act_slots, sched.num_grad_slots
    out = {name: np.zeros((T, p), np.int32) for name in
           ("active", "chunk", "microbatch", "in_slot", "grad_slot", "recv_slot")}
    out["kind"] = np.array([1 if k == "F" else 0 for k in sched.kinds], np.int32)
    for t, row in enumerate(sched.cells):
        is_f = sched.kinds[t] == "F"
        for r, cell in enumerate(row):
            a = cell.action
            out["active"][t, r] = a is not None
            out["chunk"][t, r] = a.chunk if a else 0
            out["microbatch"][t, r] = a.microbatch if a else 0
            out["in_slot"][t, r] = cell.in_slot if cell.in_slot >= 0 else trash_act
            out["grad_slot"][t, r] = cell.grad_slot if cell.grad_slot >= 0 else trash_grad
            trash = trash_act if is_f else trash_grad
            out["recv_slot"][t, r] = cell.recv_slot if cell.recv_slot >= 0 else trash
    return out


@dataclass(frozen=True, order=True)
class Variant:
    """What one branch of the tick computes: kind "F", "B" or "idle"; with the embedding (virtual stage 0) and/or
    the output layer and loss (the last virtual stage: its backward in training, its forward in evaluation)."""

    kind: str
    embed: bool = False
    head: bool = False


def cell_variants(sched: Schedule, branching: str, forward_only: bool = False) -> tuple[list[Variant], np.ndarray]:
    """The branches a schedule needs and which one each tick ([T], "uniform") or each cell ([T, p], "per-rank")
    takes. In training the head runs in the last stage's backward (its forward and backward there), never in a
    forward."""
    if branching not in PIPELINE_BRANCHINGS:
        raise ValueError(f"pipeline_branching={branching!r} is not one of {PIPELINE_BRANCHINGS}")
    p, last = sched.p, sched.p * sched.v - 1

    def needs(kind, cell, rank):
        if cell.action is None:
            return Variant("idle")
        stage = sched.stage(cell.action, rank)
        return Variant(kind, embed=stage == 0, head=stage == last and (kind == "B" or forward_only))

    per_cell = [[needs(kind, cell, r) for r, cell in enumerate(row)] for kind, row in zip(sched.kinds, sched.cells)]
    if branching == "uniform":
        chosen = [Variant(kind, embed=any(c.embed for c in row), head=any(c.head for c in row))
                  for kind, row in zip(sched.kinds, per_cell)]
    else:
        chosen = [c for row in per_cell for c in row]
    variants = sorted(set(chosen))
    index = np.array([variants.index(c) for c in chosen], np.int32)
    return variants, index if branching == "uniform" else index.reshape(sched.ticks, p)


class Cell(NamedTuple):
    """This rank's cell of one tick, as traced scalars."""

    is_forward: jax.Array
    active: jax.Array
    chunk: jax.Array
    microbatch: jax.Array
    in_slot: jax.Array
    grad_slot: jax.Array
    recv_slot: jax.Array
    is_first: jax.Array  # runs virtual stage 0 (embeds)
    is_last: jax.Array   # runs the last virtual stage (output layer and loss)


class Carry(NamedTuple):
    act: jax.Array           # [activation slots + trash, B, S or S/t, D]: chunk inputs (none/selective: the
                             # chunk's output after its F, which the last stage's head reads at the B)
    grad: jax.Array          # [gradient slots + trash, B, S or S/t, D]: gradients received from the next stage
    grads_chunks: dict       # float32 accumulators [v, k, ...] of this rank's chunks
    grads_shared: dict       # float32 accumulators of the embeddings and final LayerNorm
    loss: jax.Array          # sum of the last stage's token losses (accumulation dtype; / total tokens at the end)
    res: list                # recompute none/selective: [activation slots + trash, ...] per stashed vjp residual


def read_cell(row: dict, rank, p: int, v: int) -> Cell:
    c, active = row["chunk"][rank], row["active"][rank] > 0
    stage_id = c * p + rank
    return Cell(is_forward=row["kind"] > 0, active=active, chunk=c, microbatch=row["microbatch"][rank],
                in_slot=row["in_slot"][rank], grad_slot=row["grad_slot"][rank], recv_slot=row["recv_slot"][rank],
                is_first=active & (stage_id == 0), is_last=active & (stage_id == p * v - 1))


def _ring(p: int, shift: int):
    return [(i, (i + shift) % p) for i in range(p)]


def _scatter(x_BxSxD, t: int):
    """This tensor rank's 1/t of the hidden dim."""
    width = x_BxSxD.shape[-1] // t
    return jax.lax.dynamic_slice_in_dim(x_BxSxD, jax.lax.axis_index(TENSOR) * width, width, axis=-1)


def _gather(slice_BxSxDt):
    """Re-assemble the hidden dim from the t slices: an all-gather typed tensor-invariant, (t−1)/t·bsh bytes."""
    return jax.lax.all_gather(slice_BxSxDt, TENSOR, axis=-1, tiled=True, to="invarying")


def _zeros_like_typed(structs, like):
    """Zeros of the shapes/dtypes in `structs`, typed varying like the leaves of `like`."""
    return jax.tree.map(lambda d, ref: mark_like(jnp.zeros(d.shape, d.dtype), ref), structs, like)


def _accumulators(tree):
    """float32 (or float64) zero accumulators typed like `tree`'s leaves."""
    return jax.tree.map(lambda x: mark_like(jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), x), tree)


def _grad_structs(tree, drop_leading: bool = False):
    """Shapes and accumulation dtypes of `tree`'s gradients (without the leading dim: one chunk of [v, k, ...])."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:] if drop_leading else x.shape,
                                                       jnp.promote_types(x.dtype, jnp.float32)), tree)


def pipeline_accumulate(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, *, cfg: ModelConfig,
                        sched: Schedule, sequence_parallel: bool, scatter_gather: bool = True,
                        recompute: str = "none", forward_only: bool = False, branching: str = "uniform",
                        key=None):
    """shard_map body: this device's (loss sum / total_tokens, float32 gradients) over the whole schedule —
    loss only on the last virtual stage's rank, embedding/output gradients only where those stages run (the
    caller sums them over "pipe" and "data"). `params["layers"]` is the local shard (`sharding.local_chunks`).
    `forward_only` (evaluation) runs a schedule of F ticks without backward branches. `key` enables dropout with
    per-microbatch, per-layer masks that do not depend on the layout: microbatch i draws from fold_in(key, i),
    split into embedding and layer streams, and layer j of the whole stack from fold_in(layer stream, j) — the
    streams of the scan over microbatches at p = 1; a backward's recomputed forward draws its forward's masks."""
    p, v = sched.p, sched.v
    t = jax.lax.psum(1, TENSOR)
    rank = jax.lax.axis_index(PIPE)
    variants, variant_index = cell_variants(sched, branching, forward_only)
    table = {k: jnp.asarray(a) for k, a in schedule_arrays(sched).items()}
    table["variant"] = jnp.asarray(variant_index)
    chunks = sharding.local_chunks(params["layers"])  # [v, k, ...]
    shared = {k: val for k, val in params.items() if k != "layers"}
    chunks_c, shared_c = gpt.cast_params(chunks, cfg), gpt.cast_params(shared, cfg)  # once per step
    acc = jnp.promote_types(jax.tree.leaves(params)[0].dtype, jnp.float32)
    b, S = tokens_MxBxS.shape[1], tokens_MxBxS.shape[2]
    act_shape = (b, S // t if sequence_parallel else S, cfg.hidden_size)
    act_dtype = jnp.dtype(cfg.dtype)
    layers_per_chunk = jax.tree.leaves(chunks)[0].shape[1]
    # recompute="full": the stash holds chunk inputs and every backward recomputes its chunk's forward once inside
    # its vjp (Megatron recomputes each layer once; checkpointing each layer inside that vjp as well would recompute
    # it twice, so the layers run plainly). "none" and "selective": the forward's vjp residuals are stashed
    # (`stash.Residuals`) and the backward recomputes nothing, or only the attention core.
    stash_residuals = recompute != "full" and not forward_only
    layer_recompute = "none" if recompute == "full" else recompute
    use_scatter = scatter_gather and not sequence_parallel and t > 1
    # Shapes and dtypes of one tick's gradients: a chunk's (the accumulator without its chunk dim) and the shared.
    grad_structs = (_grad_structs(chunks, drop_leading=True), _grad_structs(shared))

    def chunk_index(cell: Cell):
        return cell.chunk if v > 1 else 0  # with one chunk per rank the index is static: no dynamic slice

    def keys(cell: Cell):
        """(embedding key, layer-stream key) of the cell's microbatch, or Nones without dropout."""
        return jax.random.split(jax.random.fold_in(key, cell.microbatch)) if key is not None else (None, None)

    def embed(shared_p, cell: Cell):
        return tp.vocab_parallel_embed(shared_p, tokens_MxBxS[cell.microbatch], cfg, sequence_parallel,
                                       keys(cell)[0])

    def layers(cell: Cell):
        """The chunk's layers as a function of (chunk parameters, input), with its layers' dropout streams."""
        first_layer = (cell.chunk * p + rank) * layers_per_chunk  # this virtual stage's first layer in the stack
        return lambda lc, x: tp.run_layers(lc, x, cfg, sequence_parallel, key=keys(cell)[1],
                                           recompute=layer_recompute, first_layer=first_layer)

    def head(shared_p, y, cell: Cell):
        """Output layer and loss: the sum of the microbatch's masked token losses."""
        logits = tp.vocab_parallel_logits(shared_p, y, cfg, sequence_parallel)
        losses = tp.vocab_parallel_cross_entropy(logits, labels_MxBxS[cell.microbatch], cfg.vocab_size,
                                                 cfg.fused_kernels)
        return jnp.sum(jnp.where(mask_MxBxS[cell.microbatch] > 0, losses, 0.0))

    def stage(chunk_params, shared_p, x_stash, cell: Cell, variant: Variant):
        """Virtual stage function: (embedding on stage 0 | stashed input) -> chunk layers -> (y, loss sum or None).
        Under "uniform" branching the embedding and the loss run on every rank and are masked here and by the
        caller; under "per-rank" the masks select what this rank computes anyway."""
        x = jnp.where(cell.is_first, embed(shared_p, cell), x_stash) if variant.embed else x_stash
        y = layers(cell)(chunk_params, x)
        return (y, head(shared_p, y, cell)) if variant.head else (y, None)

    def no_loss(loss_like):
        return mark_like(jnp.zeros((), acc), loss_like)

    def last_stage_loss(cell: Cell, loss):
        return jnp.where(cell.is_last, loss, 0.0).astype(acc)

    def loss_seed(cell: Cell, like):
        """d loss / d (loss sum): 1/tokens on the last stage, 0 elsewhere."""
        return mark_like(jnp.where(cell.is_last, 1.0 / total_tokens, 0.0).astype(like.dtype), like)

    def downstream(cell: Cell, dy, like):
        """The gradient received from the next virtual stage, zero where there is none (last stage, idle)."""
        return mark_like(jnp.where(cell.active & ~cell.is_last, dy, jnp.zeros_like(dy)).astype(like.dtype), like)

    def zero_grads(chunk_params):
        return _zeros_like_typed(grad_structs, (chunk_params, shared))

    def as_grads(d_chunk, d_shared):
        return jax.tree.map(lambda g, like: g.astype(like.dtype), (d_chunk, d_shared), grad_structs)

    def make_forward(variant: Variant):
        def forward(cell: Cell, chunk_params, x_in, dy, loss_like, res_in):
            y, loss = stage(chunk_params, shared_c, x_in, cell, variant)
            loss = last_stage_loss(cell, loss) if variant.head else no_loss(loss_like)
            return y.astype(act_dtype), loss, zero_grads(chunk_params), []
        return forward

    def make_backward(variant: Variant):
        uses_shared = variant.embed or variant.head  # else the shared parameters are not differentiated at all

        def backward(cell: Cell, chunk_params, x_in, dy, loss_like, res_in):
            def f(lc, sh, x):
                y, loss = stage(lc, sh, x, cell, variant)
                return (y, loss) if variant.head else y

            if uses_shared:
                out, vjp = jax.vjp(f, chunk_params, shared_c, x_in)
            else:
                out, vjp = jax.vjp(lambda lc, x: f(lc, shared_c, x), chunk_params, x_in)
            y = out[0] if variant.head else out
            ct_y = downstream(cell, dy, y)
            if variant.head:
                cotangents, loss = vjp((ct_y, loss_seed(cell, out[1]))), last_stage_loss(cell, out[1])
            else:
                cotangents, loss = vjp(ct_y), no_loss(loss_like)
            if uses_shared:
                d_chunk, d_shared, dx = cotangents
            else:
                (d_chunk, dx), d_shared = cotangents, _zeros_like_typed(grad_structs[1], shared)
            return dx.astype(act_dtype), loss, as_grads(d_chunk, d_shared), []
        return backward

    def make_forward_stash(variant: Variant):
        """F with the vjp residuals stashed; the head waits for the backward (the loss is computed there)."""
        def forward(cell: Cell, chunk_params, x_in, dy, loss_like, res_in):
            x = jnp.where(cell.is_first, embed(shared_c, cell), x_in) if variant.embed else x_in
            y, vjp = jax.vjp(layers(cell), chunk_params, x)
            return y.astype(act_dtype), no_loss(loss_like), zero_grads(chunk_params), residuals.split(vjp, chunk_params)
        return forward

    def make_backward_stash(variant: Variant):
        """B from the stashed residuals: the head's forward and backward (its input, the chunk's output, was
        written into the input slot at the F tick), the chunk's vjp, and the embedding's transpose (a linear
        function of the word and position rows: nothing of it is stashed or recomputed)."""
        def backward(cell: Cell, chunk_params, x_in, dy, loss_like, res_in):
            chunk_vjp = residuals.join(chunk_params, res_in)
            ct_y, loss = downstream(cell, dy, x_in), no_loss(loss_like)
            d_shared = _zeros_like_typed(grad_structs[1], shared)
            if variant.head:
                loss_sum, head_vjp = jax.vjp(lambda sh, y: head(sh, y, cell), shared_c, x_in)
                d_shared, dy_head = head_vjp(loss_seed(cell, loss_sum))
                ct_y = jnp.where(cell.is_last, dy_head.astype(ct_y.dtype), ct_y)
                loss = last_stage_loss(cell, loss_sum)
            d_chunk, dx = chunk_vjp(ct_y)
            # An idle cell under "uniform" ran on the trash slot's residuals, which may still be the initial zeros (a
            # LayerNorm's 1/sqrt backward then gives inf·0): its dx and chunk gradients are selected away.
            dx = jnp.where(cell.active, dx, jnp.zeros_like(dx))
            if variant.embed:
                (d_embed,) = jax.linear_transpose(lambda sh: embed(sh, cell), shared_c)(
                    jnp.where(cell.is_first, dx, jnp.zeros_like(dx)))
                d_shared = jax.tree.map(jnp.add, d_shared, d_embed)
            # what it read goes back (to the trash slot): fewer copies than writing zeros (139 against 168 in the
            # compiled p = 1 step, 5% faster)
            return dx.astype(act_dtype), loss, as_grads(d_chunk, d_shared), list(res_in)
        return backward

    def idle(cell: Cell, chunk_params, x_in, dy, loss_like, res_in):
        return (mark_like(jnp.zeros(x_in.shape, act_dtype), x_in), no_loss(loss_like), zero_grads(chunk_params),
                list(res_in))

    act_ref = mark_varying(jnp.zeros(act_shape, act_dtype), (PIPE,) + tuple(sorted(varying_axes(tokens_MxBxS))))
    if sequence_parallel:
        act_ref = mark_varying(act_ref, (TENSOR,))
    if stash_residuals:
        example = read_cell(jax.tree.map(lambda a: a[0], table), rank, p, v)
        residuals = Residuals.trace(layers(example), jax.tree.map(lambda x: x[0], chunks_c), act_ref)
    forward_fn, backward_fn = (make_forward_stash, make_backward_stash) if stash_residuals else (make_forward,
                                                                                                   make_backward)
    branches = [idle if vr.kind == "idle" else forward_fn(vr) if vr.kind == "F" else backward_fn(vr)
                for vr in variants]

    def run_cell(which, cell: Cell, chunk_params, x_in, dy, loss_like, res_in):
        # Under "uniform" an idle cell runs its tick's branch on chunk 0, microbatch 0 and trash slots; its
        # cotangent is a `where`-zero and its dx and chunk gradients (stash mode) are selected away, so nothing
        # reaches the sums. The activation trash only ever holds finite values (received activations and
        # gradients, dummy outputs), which the head's masked vjp needs.
        return jax.lax.switch(which, branches, cell, chunk_params, x_in, dy, loss_like, res_in)

    def send(out, cell: Cell):
        """The ring, issued by every rank on every tick: F outputs go to rank + 1, B input-gradients to rank − 1."""
        if use_scatter:
            out = _scatter(out, t)
        if forward_only:
            recv = jax.lax.ppermute(out, PIPE, _ring(p, 1))
        else:
            recv = jax.lax.cond(cell.is_forward, lambda z: jax.lax.ppermute(z, PIPE, _ring(p, 1)),
                                lambda z: jax.lax.ppermute(z, PIPE, _ring(p, -1)), out)
        return _gather(recv) if use_scatter else recv

    def write(carry: Carry, cell: Cell, out, recv, loss, d_chunk, d_shared, res_out) -> Carry:
        trash_act, trash_grad = carry.act.shape[0] - 1, carry.grad.shape[0] - 1
        c = chunk_index(cell)
        act = carry.act
        res = carry.res
        if stash_residuals:  # an F keeps its residuals, and its output (the head's input) in its input's slot
            own = jnp.where(cell.is_forward, cell.in_slot, trash_act)
            res = [buf.at[own].set(r) for buf, r in zip(carry.res, res_out, strict=True)]
            act = act.at[own].set(out)
        return Carry(
            act=act.at[jnp.where(cell.is_forward, cell.recv_slot, trash_act)].set(recv),
            grad=carry.grad.at[jnp.where(cell.is_forward, trash_grad, cell.recv_slot)].set(recv),
            grads_chunks=jax.tree.map(lambda g, d: g.at[c].add(jnp.where(cell.active, d, 0) if stash_residuals
                                                               else d), carry.grads_chunks, d_chunk),
            grads_shared=jax.tree.map(jnp.add, carry.grads_shared, d_shared),
            loss=carry.loss + loss, res=res)

    def tick(carry: Carry, row):
        cell = read_cell(row, rank, p, v)
        which = row["variant"] if branching == "uniform" else row["variant"][rank]
        chunk_params = jax.tree.map(lambda x: x[chunk_index(cell)], chunks_c)
        x_in, dy = carry.act[cell.in_slot], carry.grad[cell.grad_slot]
        res_in = [buf[cell.in_slot] for buf in carry.res]
        out, loss, (d_chunk, d_shared), res_out = run_cell(which, cell, chunk_params, x_in, dy, carry.loss, res_in)
        recv = send(out, cell)
        return write(carry, cell, out, recv, loss, d_chunk, d_shared, res_out), None

    carry = Carry(
        act=jnp.zeros((sched.num_act_slots + 1, *act_shape), act_dtype) + act_ref[None],
        grad=jnp.zeros((sched.num_grad_slots + 1, *act_shape), act_dtype) + act_ref[None],
        grads_chunks=_accumulators(chunks), grads_shared=_accumulators(shared),
        loss=mark_varying(jnp.zeros((), acc), tuple(sorted(varying_axes(tokens_MxBxS) | {PIPE}))),
        res=residuals.buffers(sched.num_act_slots + 1) if stash_residuals else [])
    carry, _ = jax.lax.scan(tick, carry, table)
    grads = dict(carry.grads_shared)
    grads["layers"] = sharding.from_local_chunks(carry.grads_chunks)
    return carry.loss / total_tokens, grads
