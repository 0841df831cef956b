"""The lockstep pipeline executor (paper §2.2): one SPMD program runs a schedule table tick by tick.

The table (`schedule.Schedule`) is turned into integer arrays before tracing; `lax.scan` runs over its rows.
Every tick all devices take the same branch of one `lax.cond(kind == F)` (its predicate comes from the
replicated table), so collectives inside — tensor-parallel all-reduces, the vocab-parallel embedding and loss —
are issued identically everywhere (XLA:CPU deadlocks otherwise, DESIGN.md §2). In a tick each pipeline rank
reads its cell of the row:

- F: x = embedding (virtual stage 0) or the stashed activation; y = chunk(x). y travels to rank + 1 over "pipe"
  (rank p−1 -> 0 carries it into the next chunk: the ring that makes interleaving work).
- B: full recomputation — `jax.vjp` of the same stage function on the stashed input, with cotangent dy
  (received from the next virtual stage) or d loss = 1/tokens on the last stage, whose recomputed forward also
  yields the loss value; parameter gradients accumulate per chunk in float32; dx travels to rank − 1.
- Idle cells compute on a dummy and write to a trash slot; their cotangents are zero, so they add nothing.

Reads from buffers happen before the cond and writes after it (a buffer read and written inside a cond is kept
twice by XLA). The embedding (every tick) and the output layer (every backward tick) are computed by every rank
(masked): they hold tensor-parallel collectives and must be uniform. Scatter/gather (§4.1): with t > 1 and no sequence
parallelism, each tensor rank sends 1/t of the hidden dim; the receivers re-assemble it with an all-reduce of
the zero-padded slices (jax 0.10 has no public all-gather whose result is typed tensor-invariant).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ptd_jax import model as gpt
from ptd_jax import tensor_parallel as tp
from ptd_jax.config import ModelConfig
from ptd_jax.mesh import Axis
from ptd_jax.pipeline.schedule import Schedule

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


def pipeline_accumulate(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, *, cfg: ModelConfig,
                        sched: Schedule, sequence_parallel: bool, scatter_gather: bool = True,
                        recompute: str = "none", forward_only: bool = False):
    """shard_map body: this device's (loss sum / total_tokens, float32 gradients) over the whole schedule —
    loss only on the last virtual stage's rank, embedding/output gradients only where those stages run (the
    caller sums them over "pipe" and "data"). `params["layers"]` is the local shard [v, 1, k, ...].
    `forward_only` (evaluation) runs a schedule of F ticks without the backward branch."""
    p, v = sched.p, sched.v
    t = jax.lax.psum(1, TENSOR)
    rank = jax.lax.axis_index(PIPE)
    arrays = {k: jnp.asarray(a) for k, a in schedule_arrays(sched).items()}
    layers = jax.tree.map(lambda x: x[:, 0], params["layers"])  # [v, k, ...]
    shared = {k: val for k, val in params.items() if k != "layers"}
    acc = jnp.promote_types(jax.tree.leaves(params)[0].dtype, jnp.float32)
    b, S = tokens_MxBxS.shape[1], tokens_MxBxS.shape[2]
    seq_local = S // t if sequence_parallel else S
    act_shape = (b, seq_local, cfg.hidden_size)
    act_dtype = jnp.dtype(cfg.dtype)
    use_scatter = scatter_gather and not sequence_parallel and t > 1

    def stage(layers_c, shared_p, x_stash, tokens, labels, mask, is_first, with_loss=True):
        """Virtual stage function: (embedding on stage 0 | stashed input) -> chunk layers -> (y, loss sum).
        The embedding and the loss are computed on every rank (uniform collectives) and masked by the caller."""
        cast = gpt.cast_params({"shared": shared_p, "layers": layers_c}, cfg)
        emb = tp.vocab_parallel_embed(cast["shared"], tokens, cfg, sequence_parallel)
        x = jnp.where(is_first, emb, x_stash)
        y = tp.run_layers(cast["layers"], x, cfg, sequence_parallel, recompute=recompute)
        if not with_loss:
            return y, None
        logits = tp.vocab_parallel_logits(cast["shared"], y, cfg, sequence_parallel)
        losses = tp.vocab_parallel_cross_entropy(logits, labels, cfg.vocab_size, cfg.fused_kernels)
        return y, jnp.sum(jnp.where(mask > 0, losses, 0.0))

    def tick(carry, row):
        act_buf, grad_buf, grads_layers, grads_shared, loss_acc = carry
        cell = {k: row[k] if k == "kind" else row[k][rank] for k in row}
        c, mb, active = cell["chunk"], cell["microbatch"], cell["active"] > 0
        stage_id = c * p + rank
        is_first = active & (stage_id == 0)
        is_last = active & (stage_id == p * v - 1)
        # With one chunk per rank the index is static: no dynamic slice of the parameters every tick.
        layers_c = jax.tree.map(lambda x: x[c] if v > 1 else x[0], layers)
        tokens, labels, mask = tokens_MxBxS[mb], labels_MxBxS[mb], mask_MxBxS[mb]
        x_stash = act_buf[cell["in_slot"]]
        dy = grad_buf[cell["grad_slot"]]
        # one chunk's gradient: the accumulator without its chunk dim (shape and type only, no slicing)
        grad_c_like = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape[1:], g.dtype), grads_layers)

        def forward(_):
            # In training the loss is taken from the backward tick's recomputation (the output layer runs once
            # per microbatch, not twice); evaluation has no backward, so it computes the loss here.
            y, loss = stage(layers_c, shared, x_stash, tokens, labels, mask, is_first, with_loss=forward_only)
            loss = jnp.where(is_last, loss, 0.0).astype(acc) if forward_only else tp.mark_like(
                jnp.zeros((), acc), loss_acc)
            zeros = jax.tree.map(lambda d, ref: tp.mark_like(jnp.zeros(d.shape, d.dtype), ref),
                                 (grad_c_like, grads_shared), (layers_c, grads_shared))
            return y.astype(act_dtype), loss, zeros

        def backward(_):
            (y, loss), vjp = jax.vjp(lambda lc, sh, x: stage(lc, sh, x, tokens, labels, mask, is_first),
                                     layers_c, shared, x_stash)
            ct_y = tp.mark_like(jnp.where(active & ~is_last, dy, jnp.zeros_like(dy)).astype(y.dtype), y)
            ct_loss = tp.mark_like(jnp.where(is_last, 1.0 / total_tokens, 0.0).astype(loss.dtype), loss)
            d_layers, d_shared, dx = vjp((ct_y, ct_loss))
            grads = jax.tree.map(lambda g, like: g.astype(like.dtype), (d_layers, d_shared),
                                 (grad_c_like, grads_shared))
            return dx.astype(act_dtype), jnp.where(is_last, loss, 0.0).astype(acc), grads

        is_f = cell["kind"] > 0
        if forward_only:
            send, loss, (d_layers, d_shared) = forward(None)
        else:
            send, loss, (d_layers, d_shared) = jax.lax.cond(is_f, forward, backward, None)

        if use_scatter:
            send = _scatter(send, t)
        if forward_only:
            recv = jax.lax.ppermute(send, PIPE, _ring(p, 1))
        else:
            recv = jax.lax.cond(is_f, lambda z: jax.lax.ppermute(z, PIPE, _ring(p, 1)),
                                lambda z: jax.lax.ppermute(z, PIPE, _ring(p, -1)), send)
        if use_scatter:
            recv = _gather(recv, t, x_stash)
        act_buf = act_buf.at[jnp.where(is_f, cell["recv_slot"], act_buf.shape[0] - 1)].set(recv)
        grad_buf = grad_buf.at[jnp.where(is_f, grad_buf.shape[0] - 1, cell["recv_slot"])].set(recv)
        grads_layers = jax.tree.map(lambda g, d: g.at[c if v > 1 else 0].add(d), grads_layers, d_layers)
        grads_shared = jax.tree.map(jnp.add, grads_shared, d_shared)
        return (act_buf, grad_buf, grads_layers, grads_shared, loss_acc + loss), None

    act_ref = tp.mark_varying(jnp.zeros(act_shape, act_dtype), (PIPE,) + tuple(sorted(tp.varying_axes(tokens_MxBxS))))
    if sequence_parallel:
        act_ref = tp.mark_varying(act_ref, (TENSOR,))
    act_buf = jnp.zeros((sched.num_act_slots + 1, *act_shape), act_dtype) + act_ref[None]
    grad_buf = jnp.zeros((sched.num_grad_slots + 1, *act_shape), act_dtype) + act_ref[None]
    grads_layers = jax.tree.map(lambda x: tp.mark_like(jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)),
                                                       x), layers)
    grads_shared = jax.tree.map(lambda x: tp.mark_like(jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)),
                                                       x), shared)
    loss0 = tp.mark_varying(jnp.zeros((), acc), tuple(sorted(tp.varying_axes(tokens_MxBxS) | {PIPE})))
    (_, _, grads_layers, grads_shared, loss), _ = jax.lax.scan(
        tick, (act_buf, grad_buf, grads_layers, grads_shared, loss0), arrays)
    grads = dict(grads_shared)
    grads["layers"] = jax.tree.map(lambda g: g[:, None], grads_layers)  # back to [v, 1, k, ...]
    return loss / total_tokens, grads
