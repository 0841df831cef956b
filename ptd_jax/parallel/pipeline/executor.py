"""The lockstep pipeline executor (paper §2.2): one SPMD program runs a schedule table tick by tick.

The table (`lockstep.Schedule`) is turned into integer arrays before tracing. Every tick has one kind for all ranks
(F or B), so the ticks are cut into runs of a static pattern (`tick_runs`: the warm-up's forwards, the steady
state's F/B pairs, the cool-down's backwards) and each run is one `lax.scan` whose body knows each tick's kind: a
forward tick builds no gradients and reads no stash, a backward tick writes none, and the ring's direction is
fixed. In a tick each pipeline rank

1. reads its cell of the row (chunk, microbatch, slots) and its input from the activation or gradient slots;
2. F: embeds (where virtual stage 0 runs; a `lax.cond`), then runs its chunk's layers, each under `jax.vjp`,
   writing layer j's residuals in place into the stash buffers at (its slot, j) (`stash.Residuals.forward`: the
   weights among them are not stored but put back at B); on the last stage y goes to the slot too (the head's
   input);
   B: on the last stage the head's forward and backward on y (`head_backward`, in a cond: its loss is computed
   here), then the chunk's layers' backwards in reverse from the residuals at (slot, j), each layer's parameter
   gradient added in place to the float32 accumulator (`stash.Residuals.backward`), then, on stage 0, the
   embedding's transpose (`embed_backward`, in a cond: a linear map of the word and position rows, nothing
   stashed);
   `--recompute-granularity` (`model.remat_layer`'s policies): none recomputes no matmul and no collective (only the
   elementwise work between them, as Megatron's fused kernels do); selective also recomputes the attention core
   (`model.core_attention`) inside each layer; full checkpoints each layer, so its residuals are its input and its
   backward runs its forward once more (Megatron's uniform method, one layer per checkpoint);
3. sends: y to rank + 1 over "pipe" (rank p−1 -> 0 carries it into its next chunk: the ring that makes
   interleaving work), dx to rank − 1. Every rank issues the ring on every tick (docs/architecture.md,
   "Pipeline");
4. writes what it received into the table's slot.

Where the embedding and the head run is decided before tracing, from the table (`tick_work`). Two ways to branch
(`ParallelConfig.pipeline_branching`):
- "uniform": the predicates are per tick, the same on every rank: the embedding and the head run on every rank,
  masked, but only on the ticks where some rank needs them, and an idle cell runs its tick's chunk work on trash
  slots (selected away after). No collective ever sits in a pipe-divergent branch.
- "per-rank": the predicates are per cell: only the rank of virtual stage 0 embeds, only the last stage's rank runs
  the head, and an idle cell runs no layer (a `lax.cond` on the cell's activity). Its tensor-parallel collectives
  sit in pipe-divergent branches, which XLA:CPU runs correctly (measured; docs/architecture.md, "Pipeline"); the
  ring stays outside every cond, uniform.
On a GPU both are expected to take about the same lockstep wall time (a tick lasts as long as its busiest rank;
not yet measured); on fake CPU devices, which share the cores, "per-rank" does less total work, so "auto" (the
default, `config.resolve_branching`) is "per-rank" on XLA:CPU and "uniform" elsewhere.

The parameters are cast to the compute dtype once per step, before the scans (with `--bf16` and float32 master
weights, a bf16 copy of the rank's layers lives through the step: half their float32 size).

Scatter/gather (§4.1): with t > 1 and no sequence parallelism, each tensor rank sends 1/t of the hidden dim; the
receivers re-assemble it with an all-gather typed tensor-invariant (`all_gather(..., to="invarying")`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ptd_jax import model as gpt
from ptd_jax.config import PIPELINE_BRANCHINGS, ModelConfig, resolve_branching
from ptd_jax.parallel import sharding
from ptd_jax.parallel import tensor as tp
from ptd_jax.parallel.mesh import Axis
from ptd_jax.parallel.pipeline.lockstep import Schedule
from ptd_jax.parallel.pipeline.stash import Residuals
from ptd_jax.parallel.vma import mark_like, mark_varying, varying_axes

PIPE, TENSOR = Axis.PIPE.value, Axis.TENSOR.value


def schedule_arrays(sched: Schedule) -> dict[str, np.ndarray]:
    """Table rows as int32 arrays per rank [T, p]: active, chunk, microbatch, in_slot, grad_slot, recv_slot (each
    tick's kind is static: `tick_runs`). Missing slots point at the trash slot (index num_slots)."""
    T, p = sched.ticks, sched.p
    trash_act, trash_grad = sched.num_act_slots, sched.num_grad_slots
    out = {name: np.zeros((T, p), np.int32) for name in
           ("active", "chunk", "microbatch", "in_slot", "grad_slot", "recv_slot")}
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


def tick_runs(kinds) -> list[tuple[str, int, int]]:
    """The table's ticks as runs that one `lax.scan` each executes, with the kind of every tick static:
    (pattern, first tick, repeats), the pattern "F" or "B" (a run of one kind) or "FB" (an alternation, as pairs).
    GPipe is two runs; 1F1B and interleaving four: the warm-up forwards, the steady state's first backward, its
    F/B pairs, the cool-down backwards. Pairs start with the F: then the B reads the stash after the F has written
    it in place (with B first, XLA kept a second copy of the whole stash: the two ticks are independent, so the
    F's in-place writes were not ordered after the B's reads: the bench model's 1F1B step held 942 MB of temp
    memory per device, against 488 MB)."""
    kinds = "".join(kinds)
    runs, i, T = [], 0, len(kinds)
    while i < T:
        j = i
        while j < T and kinds[j] == kinds[i]:
            j += 1
        if j - i == 1 and j < T and kinds[i] == "F":  # an alternation starts here
            pattern, n = "FB", 0
            while kinds[i + 2 * n:i + 2 * n + 2] == pattern:
                n += 1
            runs.append((pattern, i, n))
            i += 2 * n
        else:
            runs.append((kinds[i], i, j - i))
            i = j
    return runs


def tick_work(sched: Schedule, branching: str, forward_only: bool = False) -> dict[str, np.ndarray]:
    """Where the embedding and the head (output layer and loss) run: {"embed", "head"} as bool arrays, [T, p] per
    cell ("per-rank": the rank of virtual stage 0 embeds, in its F and B; the last virtual stage's rank runs the
    head in its B, or in its F in evaluation) or [T] per tick ("uniform": every rank runs them, masked, on the
    ticks where some rank needs them)."""
    if branching not in PIPELINE_BRANCHINGS:
        raise ValueError(f"pipeline_branching={branching!r} is not one of {PIPELINE_BRANCHINGS}")
    branching = resolve_branching(branching)
    T, p, last = sched.ticks, sched.p, sched.p * sched.v - 1
    embed, head = np.zeros((T, p), bool), np.zeros((T, p), bool)
    for t, (kind, row) in enumerate(zip(sched.kinds, sched.cells)):
        for r, cell in enumerate(row):
            if cell.action is not None:
                stage = sched.stage(cell.action, r)
                embed[t, r] = stage == 0
                head[t, r] = stage == last and (kind == "B" or forward_only)
    if branching == "uniform":
        return {"embed": embed.any(axis=1), "head": head.any(axis=1)}
    return {"embed": embed, "head": head}


class Cell(NamedTuple):
    """This rank's cell of one tick, as traced scalars."""

    active: jax.Array
    chunk: jax.Array
    microbatch: jax.Array
    in_slot: jax.Array
    grad_slot: jax.Array
    recv_slot: jax.Array
    is_first: jax.Array  # runs virtual stage 0 (embeds)
    is_last: jax.Array   # runs the last virtual stage (output layer and loss)
    embed: jax.Array     # the embedding runs in this tick: is_first ("per-rank"), or on some rank ("uniform")
    head: jax.Array      # the head runs in this tick: likewise


class Carry(NamedTuple):
    act: jax.Array           # [activation slots + trash, B, S or S/t, D]: chunk inputs, and on the last stage
                             # the chunk's output after its F (the head's input, read at the B)
    grad: jax.Array          # [gradient slots + trash, B, S or S/t, D]: gradients received from the next stage
    grads_chunks: dict       # float32 accumulators [v, k, ...] of this rank's chunks
    grads_shared: dict       # float32 accumulators of the embeddings and final LayerNorm
    loss: jax.Array          # sum of the last stage's token losses (accumulation dtype; / total tokens at the end)
    res: list                # [activation slots + trash, k, ...] per stashed leaf of a layer's vjp (training)


def read_cell(row: dict, rank, p: int, v: int, uniform: bool) -> Cell:
    c, active = row["chunk"][rank], row["active"][rank] > 0
    stage_id = c * p + rank
    embed, head = (row["embed"], row["head"]) if uniform else (row["embed"][rank], row["head"][rank])
    return Cell(active=active, chunk=c, microbatch=row["microbatch"][rank], in_slot=row["in_slot"][rank],
                grad_slot=row["grad_slot"][rank], recv_slot=row["recv_slot"][rank],
                is_first=active & (stage_id == 0), is_last=active & (stage_id == p * v - 1), embed=embed > 0,
                head=head > 0)


def _ring(p: int, shift: int):
    return [(i, (i + shift) % p) for i in range(p)]


def _scatter(x_BxSxD, t: int):
    """This tensor rank's 1/t of the hidden dim."""
    width = x_BxSxD.shape[-1] // t
    return jax.lax.dynamic_slice_in_dim(x_BxSxD, jax.lax.axis_index(TENSOR) * width, width, axis=-1)


def _gather(slice_BxSxDt):
    """Re-assemble the hidden dim from the t slices: an all-gather typed tensor-invariant, (t−1)/t·bsh bytes."""
    return jax.lax.all_gather(slice_BxSxDt, TENSOR, axis=-1, tiled=True, to="invarying")


def _accumulators(tree):
    """float32 (or float64) zero accumulators typed like `tree`'s leaves."""
    return jax.tree.map(lambda x: mark_like(jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), x), tree)


def pipeline_accumulate(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, *, cfg: ModelConfig,
                        sched: Schedule, sequence_parallel: bool, scatter_gather: bool = True,
                        recompute: str = "none", forward_only: bool = False, branching: str = "auto",
                        key=None):
    """shard_map body: this device's (loss sum / total_tokens, float32 gradients) over the whole schedule —
    loss only on the last virtual stage's rank, embedding/output gradients only where those stages run (the
    caller sums them over "pipe" and "data"). `params["layers"]` is the local shard (`sharding.local_chunks`).
    `forward_only` (evaluation) runs a schedule of F ticks only, with the head in the last stage's forwards. `key`
    enables dropout with per-microbatch, per-layer masks that do not depend on the layout: microbatch i draws from
    fold_in(key, i), split into embedding and layer streams, and layer j of the whole stack from
    fold_in(layer stream, j) — the streams of the scan over microbatches at p = 1; a backward's recomputed forward
    draws its forward's masks."""
    p, v = sched.p, sched.v
    t = jax.lax.psum(1, TENSOR)
    branching = resolve_branching(branching)
    uniform = branching == "uniform"
    table = {**schedule_arrays(sched), **tick_work(sched, branching, forward_only)}
    chunks = sharding.local_chunks(params["layers"])  # [v, k, ...]
    # At p = 1 the ring is the identity (no ppermute), and with the layers unsplit over "pipe" (the step's
    # accumulation table, `parallel.step.accumulation_schedule`) nothing varies over "pipe".
    ring_axes = (PIPE,) if p > 1 or PIPE in varying_axes(jax.tree.leaves(chunks)[0]) else ()
    rank = jax.lax.axis_index(PIPE) if ring_axes else jnp.zeros((), jnp.int32)
    shared = {k: val for k, val in params.items() if k != "layers"}
    chunks_c, shared_c = gpt.cast_params(chunks, cfg), gpt.cast_params(shared, cfg)  # once per step
    acc = jnp.promote_types(jax.tree.leaves(params)[0].dtype, jnp.float32)
    b, S = tokens_MxBxS.shape[1], tokens_MxBxS.shape[2]
    act_shape = (b, S // t if sequence_parallel else S, cfg.hidden_size)
    act_dtype = jnp.dtype(cfg.dtype)
    layers_per_chunk = jax.tree.leaves(chunks)[0].shape[1]
    # An F stashes each layer's vjp residuals (`stash.Residuals`); the B recomputes no matmul ("none"), the attention
    # core ("selective": `model.core_attention` is checkpointed) or each layer ("full": the layer is checkpointed, so
    # its residuals are its input, and the B runs its forward once more: Megatron's uniform method, one layer).
    use_scatter = scatter_gather and not sequence_parallel and t > 1

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
                                           first_layer=first_layer)

    def head(shared_p, y, cell: Cell):
        """Output layer and loss: the sum of the microbatch's masked token losses."""
        logits = tp.vocab_parallel_logits(shared_p, y, cfg, sequence_parallel)
        losses = tp.vocab_parallel_cross_entropy(logits, labels_MxBxS[cell.microbatch], cfg.vocab_size,
                                                 cfg.fused_kernels)
        return jnp.sum(jnp.where(mask_MxBxS[cell.microbatch] > 0, losses, 0.0))

    def last_stage_loss(cell: Cell, loss):
        return jnp.where(cell.is_last, loss, 0.0).astype(acc)

    def only_if(pred, fn, skip, *args):
        """`fn(*args)` where `pred`, else `skip(*args)`: a `lax.cond` (the one place a tick branches)."""
        return jax.lax.cond(pred, fn, skip, *args)

    def active_only(cell: Cell, fn, skip, *args):
        """A chunk's work: under "uniform" every rank runs it (an idle cell on trash slots, selected away after);
        under "per-rank" only an active cell does."""
        return fn(*args) if uniform else only_if(cell.active, fn, skip, *args)

    def layer(cell: Cell):
        """One layer of the cell's chunk as a function of (its parameters, h, its index j in the chunk), drawing
        dropout from the stream of layer first_layer + j of the whole stack (as `layers` does)."""
        first_layer = (cell.chunk * p + rank) * layers_per_chunk
        stream = keys(cell)[1]
        fn = gpt.remat_layer(lambda lp, h, k: tp.transformer_layer(lp, h, cfg, sequence_parallel, k, recompute),
                             recompute)
        return lambda lp, h, j: fn(lp, h, jax.random.fold_in(stream, first_layer + j) if key is not None else None)

    # A chunk's work and the head's, each one named call in the jaxpr (the tests and pipeline_flops.py count them).
    def named(name: str, fn):
        fn.__name__ = fn.__qualname__ = name
        return jax.jit(fn)

    def chunk_forward(cell: Cell):
        """(chunks, x, buffers, slot) -> (y, buffers with each layer's residuals at (slot, j))."""
        def fn(chunks, x, bufs, slot):
            y, bufs = residuals.forward(layer(cell), chunks, chunk_index(cell), x, bufs, slot)
            return y.astype(act_dtype), bufs

        def skip(chunks, x, bufs, slot):
            return jnp.zeros_like(x), bufs
        return named("chunk_forward", fn), skip

    def plain_forward(cell: Cell):
        """(lc, x) -> y, keeping nothing (evaluation)."""
        def fn(lc, x):
            return layers(cell)(lc, x).astype(act_dtype)

        def skip(lc, x):
            return jnp.zeros_like(x)
        return named("chunk_forward", fn), skip

    def chunk_backward(cell: Cell):
        """(chunks, buffers, slot, dy, accumulators) -> (dx, accumulators + the chunk's gradients, layer by
        layer)."""
        def fn(chunks, bufs, slot, ct_y, grads):
            dx, grads = residuals.backward(chunks, chunk_index(cell), bufs, slot, ct_y, grads,
                                           keep=cell.active if uniform else None)
            return dx.astype(act_dtype), grads

        def skip(chunks, bufs, slot, ct_y, grads):
            return jnp.zeros_like(ct_y), grads
        return named("chunk_backward", fn), skip

    def head_backward(cell: Cell):
        def fn(y, ct_y, grads_shared, loss):
            """The head's forward and backward on y; adds its gradients and loss, and seeds the chunk's backward."""
            if uniform:  # another rank's head runs on its own slot or the trash: on zeros, so that its zero seed gives
                y = jnp.where(cell.is_last, y, jnp.zeros_like(y))  # exact zeros (never 0 times a non-finite value)
            loss_sum, head_vjp = jax.vjp(lambda sh, y: head(sh, y, cell), shared_c, y)
            seed = mark_like(jnp.where(cell.is_last, 1.0 / total_tokens, 0.0).astype(loss_sum.dtype), loss_sum)
            d_shared, dy_head = head_vjp(seed)
            grads_shared = jax.tree.map(lambda g, d: g + d.astype(g.dtype), grads_shared, d_shared)
            return (jnp.where(cell.is_last, dy_head.astype(ct_y.dtype), ct_y), grads_shared,
                    loss + last_stage_loss(cell, loss_sum))
        return named("head_backward", fn)

    def embed_backward(cell: Cell):
        def fn(grads_shared, dx):
            """The embedding's transpose (a linear function of the word and position rows: nothing stashed)."""
            (d_embed,) = jax.linear_transpose(lambda sh: embed(sh, cell), shared_c)(
                jnp.where(cell.is_first, dx, jnp.zeros_like(dx)))
            return jax.tree.map(lambda g, d: g + d.astype(g.dtype), grads_shared, d_embed)
        return named("embed_backward", fn)

    def send(out, shift: int):
        """The ring, issued by every rank on every tick: F outputs go to rank + 1, B input-gradients to rank − 1."""
        if p == 1:
            return out
        if use_scatter:
            out = _scatter(out, t)
        recv = jax.lax.ppermute(out, PIPE, _ring(p, shift))
        return _gather(recv) if use_scatter else recv

    def forward_tick(carry: Carry, row) -> Carry:
        cell = read_cell(row, rank, p, v, uniform)
        trash = carry.act.shape[0] - 1
        x_in = carry.act[cell.in_slot]
        x = only_if(cell.embed, lambda x_in: jnp.where(cell.is_first, embed(shared_c, cell), x_in), lambda x_in: x_in,
                    x_in)
        if forward_only:
            lc = jax.tree.map(lambda a: a[chunk_index(cell)], chunks_c)
            y, stash = active_only(cell, *plain_forward(cell), lc, x), carry.res
        else:  # layer j's parameters are sliced inside the layer loop: no copy of the chunk's first
            y, stash = active_only(cell, *chunk_forward(cell), chunks_c, x, carry.res, cell.in_slot)
        loss = carry.loss
        if forward_only:
            loss = only_if(cell.head, lambda y, loss: loss + last_stage_loss(cell, head(shared_c, y, cell)),
                           lambda y, loss: loss, y, loss)
        recv = send(y, 1)
        act = carry.act
        if not forward_only:  # the residuals went to the input's slot (trash for an idle cell); on the last stage y,
            act = act.at[jnp.where(cell.is_last, cell.in_slot, trash)].set(y)  # the head's input, goes there too
        return carry._replace(act=act.at[cell.recv_slot].set(recv), res=stash, loss=loss)

    def backward_tick(carry: Carry, row) -> Carry:
        cell = read_cell(row, rank, p, v, uniform)
        y = carry.act[cell.in_slot]  # the chunk's output on the last stage: the head's input
        dy = carry.grad[cell.grad_slot]
        ct_y = mark_like(jnp.where(cell.active & ~cell.is_last, dy, jnp.zeros_like(dy)), y)
        ct_y, grads_shared, loss = only_if(cell.head, head_backward(cell), lambda y, ct, g, loss: (ct, g, loss),
                                           y, ct_y, carry.grads_shared, carry.loss)
        dx, grads_chunks = active_only(cell, *chunk_backward(cell), chunks_c, carry.res, cell.in_slot, ct_y,
                                       carry.grads_chunks)
        if uniform:
            # An idle cell ran on the trash slot's residuals, which may still be the initial zeros (a LayerNorm's
            # 1/sqrt backward then gives inf·0): its dx and (in `chunk_backward`) chunk gradients are selected away.
            dx = jnp.where(cell.active, dx, jnp.zeros_like(dx))
        grads_shared = only_if(cell.embed, embed_backward(cell), lambda g, dx: g, grads_shared, dx)
        recv = send(dx, -1)
        return carry._replace(grad=carry.grad.at[cell.recv_slot].set(recv), grads_shared=grads_shared, loss=loss,
                              grads_chunks=grads_chunks)

    act_ref = mark_varying(jnp.zeros(act_shape, act_dtype), ring_axes + tuple(sorted(varying_axes(tokens_MxBxS))))
    if sequence_parallel:
        act_ref = mark_varying(act_ref, (TENSOR,))
    if not forward_only:
        example = read_cell(jax.tree.map(lambda a: jnp.asarray(a[0]), table), rank, p, v, uniform)
        residuals = Residuals.trace(layer(example), jax.tree.map(lambda x: x[0, 0], chunks_c), act_ref,
                                    jnp.zeros((), jnp.int32))

    carry = Carry(
        act=jnp.zeros((sched.num_act_slots + 1, *act_shape), act_dtype) + act_ref[None],
        grad=jnp.zeros((sched.num_grad_slots + 1, *act_shape), act_dtype) + act_ref[None],
        grads_chunks=_accumulators(chunks), grads_shared=_accumulators(shared),
        loss=mark_varying(jnp.zeros((), acc), tuple(sorted(varying_axes(tokens_MxBxS) | set(ring_axes)))),
        res=[] if forward_only else residuals.buffers(sched.num_act_slots + 1, layers_per_chunk))
    for pattern, first, n in tick_runs(sched.kinds):
        ticks = [forward_tick if kind == "F" else backward_tick for kind in pattern]
        rows = {k: jnp.asarray(a[first:first + n * len(pattern)].reshape(n, len(pattern), *a.shape[1:]))
                for k, a in table.items()}

        def run(carry, rows, ticks=ticks):
            for i, tick in enumerate(ticks):
                carry = tick(carry, jax.tree.map(lambda a: a[i], rows))
            return carry, None

        carry, _ = jax.lax.scan(run, carry, rows)
    grads = dict(carry.grads_shared)
    grads["layers"] = sharding.from_local_chunks(carry.grads_chunks)
    return carry.loss / total_tokens, grads
