"""The lockstep pipeline executor (paper §2.2): one SPMD program runs a schedule table tick by tick.

The table (`lockstep.Schedule`) is turned into integer arrays before tracing; `lax.scan` runs over its rows. One
tick reads like the schedule: each pipeline rank

1. reads its cell of the row and its inputs from the stash (before the switch: a buffer read and written inside a
   conditional is kept twice by XLA);
2. runs the cell (a branch of `lax.switch`, see below):
   - F: x = embedding (virtual stage 0) or the stashed activation; y = chunk(x);
   - B: full recomputation — `jax.vjp` of the same stage function on the stashed input, with cotangent dy
     (received from the next virtual stage) or d loss = 1/tokens on the last stage, whose recomputed forward also
     yields the loss value; parameter gradients accumulate per chunk in float32;
   - idle cells compute nothing ("per-rank") or a masked dummy ("uniform"); either way they write to a trash slot
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
receivers re-assemble it with an all-reduce of the zero-padded slices (jax 0.10 has no public all-gather whose
result is typed tensor-invariant).
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
    takes. In training the loss comes from the backward's recomputation, so forwards never run the head."""
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
    act: jax.Array           # [activation slots + trash, B, S or S/t, D]: chunk inputs (the stash)
    grad: jax.Array          # [gradient slots + trash, B, S or S/t, D]: gradients received from the next stage
    grads_chunks: dict       # float32 accumulators [v, k, ...] of this rank's chunks
    grads_shared: dict       # float32 accumulators of the embeddings and final LayerNorm
    loss: jax.Array          # sum of the last stage's token losses (accumulation dtype; / total tokens at the end)


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


def _gather(slice_BxSxDt, t: int, like):
    """Re-assemble the hidden dim from the t slices (all-reduce of zero-padded slices: tensor-invariant result)."""
    width = slice_BxSxDt.shape[-1]
    padded = jnp.zeros(like.shape, like.dtype)
    padded = jax.lax.dynamic_update_slice_in_dim(padded, slice_BxSxDt, jax.lax.axis_index(TENSOR) * width, -1)
    return jax.lax.psum(padded, TENSOR)


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
    # The stash holds chunk inputs, so every backward recomputes its chunk's forward once: that already is
    # recompute="full" (Megatron recomputes each layer once). Checkpointing each layer inside that vjp as well would
    # recompute it a second time, so "full" runs the layers plainly; "selective" keeps its per-layer policy.
    layer_recompute = "none" if recompute == "full" else recompute
    use_scatter = scatter_gather and not sequence_parallel and t > 1
    # Shapes and dtypes of one tick's gradients: a chunk's (the accumulator without its chunk dim) and the shared.
    grad_structs = (_grad_structs(chunks, drop_leading=True), _grad_structs(shared))

    def chunk_index(cell: Cell):
        return cell.chunk if v > 1 else 0  # with one chunk per rank the index is static: no dynamic slice

    def stage(chunk_params, shared_p, x_stash, cell: Cell, variant: Variant):
        """Virtual stage function: (embedding on stage 0 | stashed input) -> chunk layers -> (y, loss sum or None).
        Under "uniform" branching the embedding and the loss run on every rank and are masked here and by the
        caller; under "per-rank" the masks select what this rank computes anyway."""
        mb = cell.microbatch
        k_embed, k_layers = jax.random.split(jax.random.fold_in(key, mb)) if key is not None else (None, None)
        x = x_stash
        if variant.embed:
            emb = tp.vocab_parallel_embed(shared_p, tokens_MxBxS[mb], cfg, sequence_parallel, k_embed)
            x = jnp.where(cell.is_first, emb, x_stash)
        first_layer = (cell.chunk * p + rank) * layers_per_chunk  # this virtual stage's first layer in the stack
        y = tp.run_layers(chunk_params, x, cfg, sequence_parallel, key=k_layers, recompute=layer_recompute,
                          first_layer=first_layer)
        if not variant.head:
            return y, None
        logits = tp.vocab_parallel_logits(shared_p, y, cfg, sequence_parallel)
        losses = tp.vocab_parallel_cross_entropy(logits, labels_MxBxS[mb], cfg.vocab_size, cfg.fused_kernels)
        return y, jnp.sum(jnp.where(mask_MxBxS[mb] > 0, losses, 0.0))

    def no_loss(loss_like):
        return mark_like(jnp.zeros((), acc), loss_like)

    def last_stage_loss(cell: Cell, loss):
        return jnp.where(cell.is_last, loss, 0.0).astype(acc)

    def make_forward(variant: Variant):
        def forward(cell: Cell, chunk_params, x_in, dy, loss_like):
            y, loss = stage(chunk_params, shared_c, x_in, cell, variant)
            loss = last_stage_loss(cell, loss) if variant.head else no_loss(loss_like)
            return y.astype(act_dtype), loss, _zeros_like_typed(grad_structs, (chunk_params, shared))
        return forward

    def make_backward(variant: Variant):
        uses_shared = variant.embed or variant.head  # else the shared parameters are not differentiated at all

        def backward(cell: Cell, chunk_params, x_in, dy, loss_like):
            def f(lc, sh, x):
                y, loss = stage(lc, sh, x, cell, variant)
                return (y, loss) if variant.head else y

            if uses_shared:
                out, vjp = jax.vjp(f, chunk_params, shared_c, x_in)
            else:
                out, vjp = jax.vjp(lambda lc, x: f(lc, shared_c, x), chunk_params, x_in)
            y = out[0] if variant.head else out
            ct_y = mark_like(jnp.where(cell.active & ~cell.is_last, dy, jnp.zeros_like(dy)).astype(y.dtype), y)
            if variant.head:
                ct_loss = mark_like(jnp.where(cell.is_last, 1.0 / total_tokens, 0.0).astype(out[1].dtype), out[1])
                cotangents, loss = vjp((ct_y, ct_loss)), last_stage_loss(cell, out[1])
            else:
                cotangents, loss = vjp(ct_y), no_loss(loss_like)
            if uses_shared:
                d_chunk, d_shared, dx = cotangents
            else:
                (d_chunk, dx), d_shared = cotangents, _zeros_like_typed(grad_structs[1], shared)
            grads = jax.tree.map(lambda g, like: g.astype(like.dtype), (d_chunk, d_shared), grad_structs)
            return dx.astype(act_dtype), loss, grads
        return backward

    def idle(cell: Cell, chunk_params, x_in, dy, loss_like):
        return (mark_like(jnp.zeros(x_in.shape, act_dtype), x_in), no_loss(loss_like),
                _zeros_like_typed(grad_structs, (chunk_params, shared)))

    branches = [idle if vr.kind == "idle" else make_forward(vr) if vr.kind == "F" else make_backward(vr)
                for vr in variants]

    def run_cell(which, cell: Cell, chunk_params, x_in, dy, loss_like):
        # Under "uniform" an idle cell runs its tick's branch on chunk 0, microbatch 0 and a trash slot; its
        # cotangent is a `where`-zero, so nothing reaches the sums while the trash stays finite.
        return jax.lax.switch(which, branches, cell, chunk_params, x_in, dy, loss_like)

    def send(out, cell: Cell, like):
        """The ring, issued by every rank on every tick: F outputs go to rank + 1, B input-gradients to rank − 1."""
        if use_scatter:
            out = _scatter(out, t)
        if forward_only:
            recv = jax.lax.ppermute(out, PIPE, _ring(p, 1))
        else:
            recv = jax.lax.cond(cell.is_forward, lambda z: jax.lax.ppermute(z, PIPE, _ring(p, 1)),
                                lambda z: jax.lax.ppermute(z, PIPE, _ring(p, -1)), out)
        return _gather(recv, t, like) if use_scatter else recv

    def write(carry: Carry, cell: Cell, recv, loss, d_chunk, d_shared) -> Carry:
        trash_act, trash_grad = carry.act.shape[0] - 1, carry.grad.shape[0] - 1
        c = chunk_index(cell)
        return Carry(
            act=carry.act.at[jnp.where(cell.is_forward, cell.recv_slot, trash_act)].set(recv),
            grad=carry.grad.at[jnp.where(cell.is_forward, trash_grad, cell.recv_slot)].set(recv),
            grads_chunks=jax.tree.map(lambda g, d: g.at[c].add(d), carry.grads_chunks, d_chunk),
            grads_shared=jax.tree.map(jnp.add, carry.grads_shared, d_shared),
            loss=carry.loss + loss)

    def tick(carry: Carry, row):
        cell = read_cell(row, rank, p, v)
        which = row["variant"] if branching == "uniform" else row["variant"][rank]
        chunk_params = jax.tree.map(lambda x: x[chunk_index(cell)], chunks_c)
        x_in, dy = carry.act[cell.in_slot], carry.grad[cell.grad_slot]
        out, loss, (d_chunk, d_shared) = run_cell(which, cell, chunk_params, x_in, dy, carry.loss)
        recv = send(out, cell, like=x_in)
        return write(carry, cell, recv, loss, d_chunk, d_shared), None

    act_ref = mark_varying(jnp.zeros(act_shape, act_dtype), (PIPE,) + tuple(sorted(varying_axes(tokens_MxBxS))))
    if sequence_parallel:
        act_ref = mark_varying(act_ref, (TENSOR,))
    carry = Carry(
        act=jnp.zeros((sched.num_act_slots + 1, *act_shape), act_dtype) + act_ref[None],
        grad=jnp.zeros((sched.num_grad_slots + 1, *act_shape), act_dtype) + act_ref[None],
        grads_chunks=_accumulators(chunks), grads_shared=_accumulators(shared),
        loss=mark_varying(jnp.zeros((), acc), tuple(sorted(varying_axes(tokens_MxBxS) | {PIPE}))))
    carry, _ = jax.lax.scan(tick, carry, table)
    grads = dict(carry.grads_shared)
    grads["layers"] = sharding.from_local_chunks(carry.grads_chunks)
    return carry.loss / total_tokens, grads
