"""The executor of split schedules (1F1B-split, ZB-H1, ZB-V): unit ticks where each rank runs its own kind.

A tick (`unit_tick`) runs this rank's cell — idle, F, B (input gradient) or W (weight gradients), each layer's work
in a conditional on the kind (`split.py`) — then the ring in both directions,
issued by every rank on every tick outside every branch: what a rank's cell produced (an F's output, a B's input
gradient) goes to rank + 1 and to rank − 1, and each receiver keeps what its table says arrives from that side
(`Cell.recv`), in the activation or the gradient slot it names; ZB-V's turn (rank p − 1 feeding itself) is kept
without a send. Only per-rank branching runs these tables (`config.SPLIT_SCHEDULES`): under uniform branching every
rank would run F, B and W each tick.

The split backward (`split.py`: `forward`, `input_backward`, `weight_backward`): B runs each layer's vjp from the F's
residuals with a tap beside every matmul (`tensor.dot`), which computes the input gradient and hands the tap the
matmul's input and output gradient instead of computing the kernel's gradient; B adds the small parameters'
gradients and stashes the taps; W turns the taps into the kernels' gradients, added in place. So no matmul runs
twice, and the F's residuals are freed at the B.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ptd_jax.parallel import sharding
from ptd_jax.parallel.pipeline import executor as ex
from ptd_jax.parallel.pipeline.lockstep import Schedule
from ptd_jax.parallel.pipeline import split
from ptd_jax.parallel.pipeline.split import Taps, with_taps
from ptd_jax.parallel.pipeline.stash import Residuals
from ptd_jax.parallel.vma import mark_like

KINDS = {None: 0, "F": 1, "B": 2, "W": 3}
DIRECTIONS = {1: "left", -1: "right", 0: "self"}  # +1 arrives from rank − 1 (the left), −1 from rank + 1


def unit_arrays(sched: Schedule) -> dict[str, np.ndarray]:
    """A unit table as int32 arrays [T, p]: kind, chunk, microbatch, slots, embed/head, and per direction the
    activation and gradient slots an arriving tensor goes to (trash where nothing arrives)."""
    T, p, last = sched.ticks, sched.p, sched.p * sched.v - 1
    trash = {"act": sched.num_act_slots, "grad": sched.num_grad_slots}
    names = ["kind", "chunk", "microbatch", "in_slot", "grad_slot", "w_slot", "embed", "head"] + [
        f"recv_{buf}_{side}" for side in DIRECTIONS.values() for buf in ("act", "grad")]
    out = {n: np.zeros((T, p), np.int32) for n in names}
    head_kind = "F" if sched.forward_only else "B"
    for t, row in enumerate(sched.cells):
        for r, cell in enumerate(row):
            a = cell.action
            stage = sched.stage(a, r) if a else -1
            out["kind"][t, r] = KINDS[a.kind if a else None]
            out["chunk"][t, r], out["microbatch"][t, r] = (a.chunk, a.microbatch) if a else (0, 0)
            out["in_slot"][t, r] = cell.in_slot if cell.in_slot >= 0 else trash["act"]
            out["grad_slot"][t, r] = cell.grad_slot if cell.grad_slot >= 0 else trash["grad"]
            out["w_slot"][t, r] = max(cell.w_slot, 0)
            out["embed"][t, r] = a is not None and a.kind in "FB" and stage == 0
            out["head"][t, r] = a is not None and a.kind == head_kind and stage == last
            for d, side in DIRECTIONS.items():
                for buf in ("act", "grad"):
                    got = cell.recv.get(d)
                    out[f"recv_{buf}_{side}"][t, r] = got[1] if got and got[0] == buf else trash[buf]
    return out


class UnitCarry(NamedTuple):
    act: jax.Array        # as `executor.Carry`
    grad: jax.Array
    grads_chunks: dict
    grads_shared: dict
    loss: jax.Array
    res: list             # the F's residuals [activation slots, k, ...] per leaf (read by the B)
    taps: list            # the W stash [W slots, k, ...] per tap leaf (written by the B, read by the W)


def _cell(ctx: ex.TickContext, row: dict) -> ex.TracedCell:
    r = ctx.rank
    c, active = row["chunk"][r], row["kind"][r] > 0
    stage = ex.stage_id(ctx, c)
    return ex.TracedCell(active=active, chunk=c, microbatch=row["microbatch"][r], in_slot=row["in_slot"][r],
                         grad_slot=row["grad_slot"][r], recv_slot=row["in_slot"][r],
                         is_first=active & (stage == 0), is_last=active & (stage == ctx.p * ctx.v - 1),
                         embed=row["embed"][r] > 0, head=row["head"][r] > 0)


def _input(ctx, cell, x):
    """The chunk's input: x, or on virtual stage 0 the embedding."""
    return jax.lax.cond(cell.embed, partial(ex._embed_input, ctx, cell), lambda x: x, x)


def _forward(ctx, cell, run, x, res):
    """F: the chunk's layers, each layer's residuals (taps beside its matmuls) to the stash at (in_slot, j)."""
    x = jax.lax.cond(run, partial(_input, ctx, cell), lambda x: x, x)
    y, res = split.forward(ctx.residuals, ctx.taps, ex.layer_function(ctx, cell), ctx.chunks,
                           ex.chunk_index(ctx, cell), x, res, cell.in_slot, run)
    return y.astype(ctx.act_dtype), res


def _input_backward(ctx, cell, run, y, dy, carry: UnitCarry, w_slot):
    """B: the head (last stage), the layers' input gradients (their taps to the W stash), the embedding's transpose
    (stage 0)."""
    ct_y = mark_like(jnp.where(cell.is_last, jnp.zeros_like(dy), dy), y)
    ct_y, grads_shared, loss = jax.lax.cond(cell.head, ex.named("head_backward", ex._head_backward, ctx, cell),
                                            ex._skip_head_backward, y, ct_y, carry.grads_shared, carry.loss)
    dx, grads_chunks, taps = split.input_backward(ctx.residuals, ctx.taps, ctx.chunks, ex.chunk_index(ctx, cell),
                                                  carry.res, cell.in_slot, ct_y, carry.grads_chunks, carry.taps,
                                                  w_slot, run)
    dx = dx.astype(ctx.act_dtype)
    grads_shared = jax.lax.cond(cell.embed & run, ex.named("embed_backward", ex._embed_backward, ctx, cell),
                                ex._skip_embed_backward, grads_shared, dx)  # "embed" marks stage 0's F's too
    return dx, carry._replace(grads_chunks=grads_chunks, grads_shared=grads_shared, loss=loss, taps=taps)


def training_tick(ctx: ex.TickContext, carry: UnitCarry, row) -> tuple[jax.Array, UnitCarry]:
    """F, B and W of this rank's cell (one of them runs: `split.py`, each layer's work in a conditional on the
    kind, the slot buffers read and written outside it). Returns (what the cell sends, the carry)."""
    cell, kind, w_slot = _cell(ctx, row), row["kind"][ctx.rank], row["w_slot"][ctx.rank]
    x, dy = carry.act[cell.in_slot], carry.grad[cell.grad_slot]
    y, res = _forward(ctx, cell, kind == KINDS["F"], x, carry.res)
    dx, carry = _input_backward(ctx, cell, kind == KINDS["B"], x, dy, carry._replace(res=res), w_slot)
    grads_chunks = split.weight_backward(ctx.taps, ctx.chunks, ex.chunk_index(ctx, cell), carry.taps, w_slot,
                                         carry.grads_chunks, kind == KINDS["W"])
    return jnp.where(kind == KINDS["F"], y, dx), carry._replace(grads_chunks=grads_chunks)


def _eval_forward(ctx, cell, chunks, x, loss):
    chunk_params = jax.tree.map(lambda a: a[ex.chunk_index(ctx, cell)], chunks)
    out = ex._eval_chunk_forward(ctx, cell, chunk_params, _input(ctx, cell, x))
    loss = jax.lax.cond(cell.head, partial(ex._head_loss_add, ctx, cell), lambda y, loss: loss, out, loss)
    return out, loss


def evaluation_tick(ctx: ex.TickContext, carry, row):
    cell = _cell(ctx, row)
    out, loss = jax.lax.cond(row["kind"][ctx.rank] == KINDS["F"], partial(_eval_forward, ctx, cell),
                             lambda chunks, x, loss: (jnp.zeros_like(x), loss), ctx.chunks,
                             carry.act[cell.in_slot], carry.loss)
    return out, carry._replace(loss=loss)


def unit_tick(ctx: ex.TickContext, work, carry, row):
    """One unit tick: this rank's work (`training_tick` or `evaluation_tick`), then the ring both ways, issued by
    every rank outside every branch, and the writes of what arrived."""
    out, carry = work(ctx, carry, row)
    cell = _cell(ctx, row)
    trash = carry.act.shape[0] - 1
    is_f = row["kind"][ctx.rank] == KINDS["F"]
    act = carry.act.at[jnp.where(cell.is_last & is_f, cell.in_slot, trash)].set(out)  # the head's input
    grad = carry.grad
    arrived = {"left": ex.send(ctx, out, 1), "right": ex.send(ctx, out, -1), "self": out}
    for side, value in arrived.items():
        act = act.at[row[f"recv_act_{side}"][ctx.rank]].set(value)
        grad = grad.at[row[f"recv_grad_{side}"][ctx.rank]].set(value)
    return carry._replace(act=act, grad=grad)


def run_unit_table(ctx: ex.TickContext, carry, columns: dict, work):
    """All ticks in one `lax.scan` (every tick has the same body: the kinds are in the table)."""
    def body(carry, row):
        return unit_tick(ctx, work, carry, row), None

    carry, _ = jax.lax.scan(body, carry, {k: jnp.asarray(a) for k, a in columns.items()})
    return carry


class UnitEvalCarry(NamedTuple):
    act: jax.Array
    grad: jax.Array       # nothing arrives here in evaluation: one (trash) slot, for the tick's uniform writes
    loss: jax.Array


def _context(params, tokens, labels, mask, total_tokens, *, cfg, sched: Schedule, **kw):
    ctx, _, (chunks, shared) = ex.make_context(params, tokens, labels, mask, total_tokens, cfg=cfg, sched=sched,
                                               branching="per-rank", **kw)
    return dataclasses.replace(ctx, v_shape=sched.name == "zb-v"), unit_arrays(sched), chunks, shared


def split_accumulate(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, *, cfg, sched: Schedule,
                     sequence_parallel: bool, scatter_gather: bool = True, recompute: str = "none",
                     branching: str = "auto", key=None):
    """`executor.pipeline_accumulate` for a split schedule (`Schedule.split`): this device's (loss sum / total
    tokens, float32 gradients). Per-rank branching whatever `branching` says (`config` refuses "uniform")."""
    ctx, columns, chunks, shared = _context(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, cfg=cfg,
                                            sched=sched, sequence_parallel=sequence_parallel,
                                            scatter_gather=scatter_gather, recompute=recompute, key=key)
    return _accumulate(ctx, sched, columns, chunks, shared, total_tokens)


def split_loss(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, *, cfg, sched: Schedule,
               sequence_parallel: bool, scatter_gather: bool = True, branching: str = "auto"):
    """`executor.pipeline_loss` on a unit table of forwards (ZB-V's evaluation)."""
    ctx, columns, _, _ = _context(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, total_tokens, cfg=cfg,
                                  sched=sched, sequence_parallel=sequence_parallel, scatter_gather=scatter_gather,
                                  recompute="none", key=None)
    carry = UnitEvalCarry(act=ex._slots(ctx, sched.num_act_slots), grad=ex._slots(ctx, 0), loss=ex._loss_start(ctx))
    return run_unit_table(ctx, carry, columns, evaluation_tick).loss / total_tokens


def _accumulate(ctx: ex.TickContext, sched: Schedule, columns: dict, chunks, shared, total_tokens):
    example = _cell(ctx, jax.tree.map(lambda a: jnp.asarray(a[0]), columns))
    layer = ex.layer_function(ctx, example)
    params_0 = jax.tree.map(lambda x: x[0, 0], ctx.chunks)
    taps = Taps.trace(layer, params_0, ctx.act_like, jnp.zeros((), jnp.int32))
    ctx = dataclasses.replace(ctx, taps=taps)
    residuals = Residuals.trace(layer, with_taps(params_0, taps.zeros()), ctx.act_like, jnp.zeros((), jnp.int32))
    ctx = dataclasses.replace(ctx, residuals=residuals)
    k = ctx.layers_per_chunk
    carry = UnitCarry(act=ex._slots(ctx, sched.num_act_slots), grad=ex._slots(ctx, sched.num_grad_slots),
                      grads_chunks=ex._accumulators(chunks), grads_shared=ex._accumulators(shared),
                      loss=ex._loss_start(ctx), res=residuals.buffers(sched.num_act_slots, k),
                      taps=taps.buffers(max(sched.num_w_slots, 1), k))
    carry = run_unit_table(ctx, carry, columns, training_tick)
    grads = dict(carry.grads_shared)
    grads["layers"] = sharding.from_local_chunks(carry.grads_chunks)
    return carry.loss / total_tokens, grads
