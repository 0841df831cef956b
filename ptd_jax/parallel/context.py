"""Context parallelism: the sequence split over the "context" mesh axis, load-balanced for causal attention, with
attention across the axis by a ring of K/V blocks (`p2p`) or by gathering K/V (`all_gather`).

Megatron-Core's `--context-parallel-size` / `--cp-comm-type` (as in TransformerEngine, MaxText and torchtitan).
Everything outside attention is token-wise, so each context rank runs the layers on its own S/c tokens and only
attention communicates:

- Load balancing. The sequence is cut into 2c chunks of Sc = S/(2c) tokens and rank r holds chunks r and 2c − 1 − r
  (`local_positions`), so under a causal mask every rank has the same attention work. The step cuts tokens, labels
  and the loss mask this way on each device (`split_sequence`: no communication, the batch is replicated over
  context as over tensor); the embedding and RoPE take the global positions; `gather_sequence` restores the natural
  order (logits, generation).
- p2p (`ring_attention`): K and V (only the G key/value heads: grouped-query attention sends G, not H) travel
  c − 1 hops around the ring by `ppermute`; each hop is issued before the current block's attention, which XLA can
  overlap. A block is four (query chunk, key chunk) sub-blocks, each skipped by a `lax.cond` when its keys are all
  masked (causal or outside the sliding window), merged by the online softmax (running max and sum, the log-sum-exp
  kept for the backward). The backward is a custom VJP: K/V ring again, and each block's dK/dV accumulate in a
  buffer that travels with it and arrives home after c hops.
  Per layer and microbatch: forward (c − 1) · 2·b·(S/c)·G·K elements sent per rank; backward (c − 1) of the same
  for K/V and c · 2·b·(S/c)·G·K for dK/dV (in the accumulation dtype).
  With attention_backend='pallas' the same ring attends each visible sub-block with the flash-attention kernel
  (the causal kernel on a diagonal, the unmasked one elsewhere, which the layout decides: `_flash_block`), merges
  the blocks' outputs by their log-sum-exps and runs the kernel's backward with the final one: no Sc × Sc scores
  in memory. Causal only: a sliding window needs XLA's blocks (`config.ParallelConfig`).
- all_gather (`gathered_attention`): K and V gathered over context (each rank receives (c − 1)/c of 2·b·S·G·K), then
  attention of the local queries under the mask of their global positions; autodiff's backward reduce-scatters
  dK and dV. It carries attention dropout (each rank its own masks) and the sliding window.

The loss is the global token mean: its sum and the token count are all-reduced over data × context, so a rank whose
tokens are all masked contributes zero, never 0/0 (`parallel/step.py`); gradients are reduced over data × context.

Nothing here runs at c = 1: the axis does not exist then (`parallel/mesh.py`) and the step traces none of this.
While a step's body is traced under `over_context`, `model.core_attention` calls `attention` through its hook.

Local shape legend: B batch, Sl = S/c local tokens (two chunks of Sc), G key/value heads (local under TP), R query
heads per group, K head dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import contextvars
import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig, ParallelConfig
from ptd_jax.parallel.mesh import Axis
from pallas_kernels.flash_attention import MIN_TILE, KernelConfig, choose_blocks
from pallas_kernels.flash_attention import dkdv as flash_dkdv
from pallas_kernels.flash_attention import dq as flash_dq
from pallas_kernels.flash_attention import forward as flash_forward
from pallas_kernels.vma import match_varying
from ptd_jax.parallel.vma import mark_varying, varying_axes

CONTEXT = Axis.CONTEXT.value
SEQ_DIM = 1  # activations are [B, S, ...]


@dataclass(frozen=True)
class ContextParallel:
    """The context layout a step is traced for."""

    size: int
    """c: ranks of the "context" axis."""
    comm_type: str = "p2p"
    """`config.CP_COMM_TYPES`."""


_ACTIVE: contextvars.ContextVar[ContextParallel | None] = contextvars.ContextVar("context_parallel", default=None)


@contextlib.contextmanager
def over_context(parallel: ParallelConfig):
    """Trace a step's body for `parallel`'s context layout: positions come from `local_positions` and
    `model.core_attention` attends across the axis (`attention`). A no-op at c = 1."""
    if parallel.context_parallel_size == 1:
        yield
        return
    cp = ContextParallel(parallel.context_parallel_size, parallel.cp_comm_type)
    token = _ACTIVE.set(cp)
    try:
        with gpt.attention_hook(partial(attention, cp=cp)):
            yield
    finally:
        _ACTIVE.reset(token)


def active() -> ContextParallel | None:
    """The context layout being traced, or None (c = 1)."""
    return _ACTIVE.get()


# ---------------------------------------------------------------------------------------------------------------
# The load-balanced layout
# ---------------------------------------------------------------------------------------------------------------


def load_balanced_order(seq_length: int, c: int) -> np.ndarray:
    """[S] token positions in context-rank-major order: rank r's S/c tokens are chunks r and 2c − 1 − r of 2c."""
    if seq_length % (2 * c):
        raise ValueError(f"{seq_length=} must be a multiple of 2 x {c=}")
    chunk = seq_length // (2 * c)
    return np.concatenate([np.arange(i * chunk, (i + 1) * chunk) for r in range(c) for i in (r, 2 * c - 1 - r)])


def restore_order(seq_length: int, c: int) -> np.ndarray:
    """The inverse permutation of `load_balanced_order`: x_natural = x_balanced[restore_order]."""
    return np.argsort(load_balanced_order(seq_length, c))


def chunk_positions(rank, c: int, n: int):
    """The global positions of the n = S/c tokens that context rank `rank` (traced or static) holds."""
    half = n // 2
    i = jnp.arange(half)
    return jnp.concatenate([rank * half + i, (2 * c - 1 - rank) * half + i])


def local_positions(n: int):
    """The global positions of this device's n tokens: `chunk_positions` of its context rank while a context layout
    is traced, else 0 .. n − 1."""
    cp = active()
    if cp is None:
        return jnp.arange(n)
    return chunk_positions(jax.lax.axis_index(CONTEXT), cp.size, n)


def split_sequence(x_MxBxS, c: int):
    """Inside shard_map: this context rank's S/c tokens of a batch replicated over context, chunks r and 2c − 1 − r
    (`load_balanced_order`); a local slice, no communication."""
    chunk = x_MxBxS.shape[-1] // (2 * c)
    r = jax.lax.axis_index(CONTEXT)
    first = jax.lax.dynamic_slice_in_dim(x_MxBxS, r * chunk, chunk, axis=-1)
    second = jax.lax.dynamic_slice_in_dim(x_MxBxS, (2 * c - 1 - r) * chunk, chunk, axis=-1)
    return jnp.concatenate([first, second], axis=-1)


def gather_sequence(x_BxSlx___, c: int, axis: int = SEQ_DIM):
    """Inside shard_map: the whole sequence in natural order from each rank's S/c (an all-gather over context and
    the inverse permutation): logits for evaluation or generation."""
    whole = jax.lax.all_gather(x_BxSlx___, CONTEXT, axis=axis, tiled=True)
    return jnp.take(whole, jnp.asarray(restore_order(whole.shape[axis], c)), axis=axis)


def per_rank_key(key):
    """A dropout key of this context rank's own (its tokens are not another rank's); None stays None."""
    if key is None or active() is None:
        return key
    return jax.random.fold_in(key, jax.lax.axis_index(CONTEXT))


# ---------------------------------------------------------------------------------------------------------------
# Attention across the context axis
# ---------------------------------------------------------------------------------------------------------------


def attention(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, cfg: ModelConfig, key=None, *, cp: ContextParallel):
    """`model.core_attention`'s hook: the local queries against every rank's keys, by `cp.comm_type`."""
    if cp.comm_type == "all_gather":
        return gathered_attention(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, cfg, key, cp.size)
    ring = Ring(cp.size, cfg.window_size, cfg.attention_backend, gpt.interpret_kernels())
    return ring_attention(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, ring)


def _scores(q_BxQxGxRxK, k_BxKvxGxK, q_pos, k_pos, window):
    """Scaled scores [B, G, R, Q, Kv] in the accumulation dtype, -inf where a key is not visible."""
    acc = gpt.acc_dtype(q_BxQxGxRxK.dtype)
    scores = jnp.einsum("bqgrk,bsgk->bgrqs", q_BxQxGxRxK, k_BxKvxGxK, preferred_element_type=acc)
    scores = scores / math.sqrt(q_BxQxGxRxK.shape[-1])
    return jnp.where(gpt.visible(q_pos, k_pos, window), scores, -jnp.inf)


def gathered_attention(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, cfg: ModelConfig, key, c: int):
    """all_gather: K and V gathered over context (rank-major, `load_balanced_order`), then the local queries'
    attention under the mask of their global positions. Backward (autodiff): dK and dV reduce-scattered."""
    n = q_BxSlxGxRxK.shape[SEQ_DIM]
    k_BxSxGxK = jax.lax.all_gather(k_BxSlxGxK, CONTEXT, axis=SEQ_DIM, tiled=True)
    v_BxSxGxK = jax.lax.all_gather(v_BxSlxGxK, CONTEXT, axis=SEQ_DIM, tiled=True)
    # the gathered keys' positions, from iotas (an array constant would be stashed, and typed unlike activations)
    k_pos = jnp.concatenate([chunk_positions(r, c, n) for r in range(c)])
    scores_BxGxRxSlxS = _scores(q_BxSlxGxRxK, k_BxSxGxK, local_positions(n), k_pos, cfg.window_size)
    probs = jax.nn.softmax(scores_BxGxRxSlxS, axis=-1)
    probs = gpt.dropout(probs, cfg.attention_dropout, per_rank_key(key)).astype(v_BxSxGxK.dtype)
    return jnp.einsum("bgrqs,bsgk->bqgrk", probs, v_BxSxGxK)


@dataclass(frozen=True)
class Ring:
    """The static description of a ring attention: c ranks, the sliding window (None: causal only), and what
    attends within a block."""

    size: int
    window: int | None = None
    backend: str = "xla"
    """'xla': each sub-block by einsums in the accumulation dtype (`_merge`, `_grad_block`); 'pallas': by the
    flash-attention kernel (`_flash_ring_forward`, `_flash_ring_backward`; causal only, no window)."""
    interpret: bool = False
    """'pallas' only: the kernel interpreted (no GPU, `model.interpret_kernels`)."""


def _send(tree, c: int):
    """One hop around the ring: rank i's blocks go to rank i + 1."""
    return jax.lax.ppermute(tree, CONTEXT, [(i, (i + 1) % c) for i in range(c)])


def _source(rank, j: int, c: int):
    """The rank whose K/V block this rank holds after j hops: (rank − j) mod c (`lax.rem`, which a layer's
    recompute policy recomputes rather than stashes, `model.RECOMPUTED_PRIMITIVES`)."""
    return jax.lax.rem(rank + (c - j), jnp.asarray(c, rank.dtype))


def _halves(x, axis: int):
    n = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, n, axis=axis), jax.lax.slice_in_dim(x, n, 2 * n, axis=axis)


def _any_visible(q_pos, k_pos, window, like):
    """Whether any key of a chunk is visible from any query of a chunk (chunks are contiguous, ascending), typed to
    vary like `like`: a recompute policy may stash a `cond`'s index, and the pipeline's record holds what varies
    over "pipe" as the activations do."""
    seen = k_pos[0] <= q_pos[-1]
    if window is not None:
        seen &= k_pos[-1] > q_pos[0] - window
    return mark_varying(seen, tuple(sorted(varying_axes(like))))


def _zeros(shape, dtype, *like):
    """Zeros typed to vary over every axis that `like` vary over (scan carries and cond branches must agree)."""
    axes = set().union(*(varying_axes(x) for x in like))
    return mark_varying(jnp.zeros(shape, dtype), tuple(sorted(axes)))


def _merge(acc, q_BxQxGxRxK, k_BxKvxGxK, v_BxKvxGxK, q_pos, k_pos, window):
    """The online softmax: one key block folded into a query chunk's (output, running max, running sum)."""
    o_BxGxRxQxK, m_BxGxRxQ, l_BxGxRxQ = acc
    scores = _scores(q_BxQxGxRxK, k_BxKvxGxK, q_pos, k_pos, window)
    m_new = jnp.maximum(m_BxGxRxQ, scores.max(-1))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # a row with nothing visible yet: exp(-inf) = 0, never NaN
    p = jnp.exp(scores - m_safe[..., None])
    correction = jnp.exp(m_BxGxRxQ - m_safe)
    l_new = l_BxGxRxQ * correction + p.sum(-1)
    pv = jnp.einsum("bgrqs,bsgk->bgrqk", p.astype(v_BxKvxGxK.dtype), v_BxKvxGxK, preferred_element_type=p.dtype)
    return o_BxGxRxQxK * correction[..., None] + pv, m_new, l_new


def _ring_forward(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, ring: Ring):
    """(output [B, Sl, G, R, K], log-sum-exp) of the local queries against every rank's K/V, by `ring.backend`."""
    if ring.backend == "pallas":
        return _flash_ring_forward(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, ring)
    return _xla_ring_forward(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, ring)


def _xla_ring_forward(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, ring: Ring):
    """(output [B, Sl, G, R, K], log-sum-exp [B, G, R, Sl]) by `_merge`."""
    c, window = ring.size, ring.window
    B, n, G, R, K = q_BxSlxGxRxK.shape
    acc = gpt.acc_dtype(q_BxSlxGxRxK.dtype)
    rank = jax.lax.axis_index(CONTEXT)
    qs, q_pos = _halves(q_BxSlxGxRxK, 1), _halves(chunk_positions(rank, c, n), 0)
    like = (q_BxSlxGxRxK, k_BxSlxGxK)
    stats = (B, G, R, n // 2)
    accs = [
        (_zeros((*stats, K), acc, *like), _zeros(stats, acc, *like) - jnp.inf, _zeros(stats, acc, *like))
        for _ in range(2)
    ]
    kv = (k_BxSlxGxK, v_BxSlxGxK)
    for j in range(c):
        arriving = _send(kv, c) if j < c - 1 else None  # issued before this block's compute: they can overlap
        k_pos = _halves(chunk_positions(_source(rank, j, c), c, n), 0)
        ks, vs = _halves(kv[0], 1), _halves(kv[1], 1)
        for a in range(2):
            for b in range(2):
                accs[a] = jax.lax.cond(
                    _any_visible(q_pos[a], k_pos[b], window, like=kv[0]),
                    partial(_merge, window=window),
                    lambda acc, *_: acc,
                    accs[a],
                    qs[a],
                    ks[b],
                    vs[b],
                    q_pos[a],
                    k_pos[b],
                )
        kv = arriving
    outs = [(o / l[..., None]).transpose(0, 3, 1, 2, 4) for o, _, l in accs]  # [B, Sc, G, R, K]
    lse = jnp.concatenate([m + jnp.log(l) for _, m, l in accs], axis=-1)  # every row sees itself: l > 0
    return jnp.concatenate(outs, axis=1).astype(q_BxSlxGxRxK.dtype), lse


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def ring_attention(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, ring: Ring):
    """p2p: softmax(q kᵀ / sqrt(K) + mask) v of the local queries over the whole sequence, K/V around the ring."""
    return _ring_forward(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, ring)[0]


def _ring_fwd(q, k, v, ring: Ring):
    out, lse = _ring_forward(q, k, v, ring)
    return out, (q, k, v, out, lse)


def _ring_bwd(ring: Ring, residuals, d_out):
    if ring.backend == "pallas":
        return _flash_ring_backward(ring, residuals, d_out)
    return _xla_ring_backward(ring, residuals, d_out)


def _grad_block(grads, q_BxQxGxRxK, k_BxKvxGxK, v_BxKvxGxK, rows, q_pos, k_pos, window):
    """One sub-block's share of (dq, dk, dv), from the forward's log-sum-exp (flash attention's backward)."""
    dq, dk, dv = grads
    do_BxQxGxRxK, lse_BxGxRxQ, delta_BxGxRxQ = rows
    acc = dq.dtype
    p = jnp.exp(_scores(q_BxQxGxRxK, k_BxKvxGxK, q_pos, k_pos, window) - lse_BxGxRxQ[..., None])
    do = do_BxQxGxRxK.astype(acc)
    dv = dv + jnp.einsum("bgrqs,bqgrk->bsgk", p, do)
    dp = jnp.einsum("bqgrk,bsgk->bgrqs", do, v_BxKvxGxK.astype(acc))
    ds = p * (dp - delta_BxGxRxQ[..., None]) / math.sqrt(q_BxQxGxRxK.shape[-1])
    dq = dq + jnp.einsum("bgrqs,bsgk->bqgrk", ds, k_BxKvxGxK.astype(acc))
    dk = dk + jnp.einsum("bgrqs,bqgrk->bsgk", ds, q_BxQxGxRxK.astype(acc))
    return dq, dk, dv


def _xla_ring_backward(ring: Ring, residuals, d_out):
    """K/V ring again; each block's dK/dV accumulate in a buffer that travels with it (c hops: back home)."""
    q, k, v, out, lse = residuals
    c, window = ring.size, ring.window
    B, n, G, R, K = q.shape
    acc = gpt.acc_dtype(q.dtype)
    rank = jax.lax.axis_index(CONTEXT)
    delta = jnp.sum(d_out.astype(acc) * out.astype(acc), axis=-1).transpose(0, 2, 3, 1)  # [B, G, R, Sl]
    qs, dos = _halves(q, 1), _halves(d_out, 1)
    lses, deltas = _halves(lse, 3), _halves(delta, 3)
    q_pos = _halves(chunk_positions(rank, c, n), 0)
    like = (q, k, d_out)
    dqs = [_zeros((B, n // 2, G, R, K), acc, *like) for _ in range(2)]
    dkv = [_zeros((B, n // 2, G, K), acc, *like) for _ in range(4)]  # dk halves, then dv halves
    kv = (k, v)
    for j in range(c):
        arriving = _send(kv, c) if j < c - 1 else None
        k_pos = _halves(chunk_positions(_source(rank, j, c), c, n), 0)
        ks, vs = _halves(kv[0], 1), _halves(kv[1], 1)
        for b in range(2):
            for a in range(2):
                dqs[a], dkv[b], dkv[2 + b] = jax.lax.cond(
                    _any_visible(q_pos[a], k_pos[b], window, like=kv[0]),
                    partial(_grad_block, window=window),
                    lambda grads, *_: grads,
                    (dqs[a], dkv[b], dkv[2 + b]),
                    qs[a],
                    ks[b],
                    vs[b],
                    (dos[a], lses[a], deltas[a]),
                    q_pos[a],
                    k_pos[b],
                )
        dkv = list(_send(tuple(dkv), c))  # after this block's compute; c hops bring each buffer home
        kv = arriving
    dq = jnp.concatenate(dqs, axis=1).astype(q.dtype)
    dk = jnp.concatenate(dkv[:2], axis=1).astype(k.dtype)
    dv = jnp.concatenate(dkv[2:], axis=1).astype(v.dtype)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------------------
# The ring on the flash-attention kernel (attention_backend='pallas')
# ---------------------------------------------------------------------------------------------------------------
#
# Each (query chunk, key chunk) sub-block is Sc × Sc and, under a causal mask, either skipped (every key later),
# fully visible (the kernel without its mask) or the diagonal (the causal kernel). The kernel's forward gives each
# visible sub-block's output and log-sum-exp, merged as o = Σ exp(lse_blk − lse) o_blk, lse = log Σ exp(lse_blk);
# its backward kernels take the final lse and delta = rowsum(dO ∘ O), with which each sub-block's share of dQ, dK, dV
# is exact (FlashAttention-2's backward: P = exp(S − lse) is already the whole row's softmax). No Sc × Sc score
# block exists in memory. The kernel's layout is [B, S, H, K] with query head h reading key/value head h // R: the
# ring's [B, Sc, G, R, K] queries are that by a reshape, and only the G key/value heads travel.


def _flash_block(j: int, a: int, b: int, rank, c: int, like):
    """(diagonal, seen) of query chunk a (0: chunk r, 1: chunk 2c − 1 − r of rank r = `rank`) against key chunk b of
    the K/V block held after j hops (rank s = (r − j) mod c's chunks s and 2c − 1 − s), from the layout alone:
    diagonal is static; seen is static or a traced bool (typed to vary like `like`, as `_any_visible`'s).

    Hop 0 is the rank's own block: (0, 0) and (1, 1) are diagonals, (1, 0) is seen whole, (0, 1) lies after it.
    Later s ≠ r: a second chunk (≥ c) sees a first chunk (< c) whole, a first never sees a second, and the rest
    depends on the ranks: chunk r sees chunk s where s < r, chunk 2c − 1 − r sees 2c − 1 − s where s > r (so each
    later hop holds exactly two visible sub-blocks on every rank: the layout's balanced work)."""
    if j == 0:
        return a == b, a >= b
    if a != b:
        return False, a > b
    s = _source(rank, j, c)
    seen = s < rank if a == 0 else s > rank
    return False, mark_varying(seen, tuple(sorted(varying_axes(like))))


def _flash_configs(n: int, head_dim: int, dtype, interpret: bool):
    """The kernel's (full, diagonal) configurations for Sc × Sc sub-blocks of n = Sc tokens, with the blocks it
    chooses for this head width, dtype and target; the padded head width (`flash_attention`'s padding)."""
    blocks, padded = choose_blocks(n, head_dim, dtype).for_seq(n)
    scale = 1.0 / math.sqrt(head_dim)
    full = KernelConfig(False, scale, blocks.block_q, blocks.block_k, padded, n, None, interpret)
    width = max(MIN_TILE, 1 << (head_dim - 1).bit_length())  # Triton's tiles: powers of two, at least 16
    return full, dataclasses.replace(full, causal=True), width


def _fit(x, rows: int, width: int | None, fill=0.0):
    """x padded at the end of dim 1 to `rows` and of the last dim to `width` (None: the rows are the last dim, as
    in [B, H, S] row vectors): zero head-dim columns change no score; padded keys are masked by the kernel
    (`KernelConfig.kv_len`); padded query rows are sliced away. A no-op where the shapes fit the kernel's tiles."""
    if width is None:
        pad = [(0, 0)] * (x.ndim - 1) + [(0, rows - x.shape[-1])]
    else:
        pad = [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 3) + [(0, width - x.shape[-1])]
    return jnp.pad(x, pad, constant_values=fill) if any(p for _, p in pad) else x


def _on_block(plan, kernels, fn, carry, *operands):
    """carry, updated by fn(carry, *operands, kernel) where `plan` = (diagonal, seen) says the sub-block is visible:
    by the causal kernel on a diagonal, else the full one (`kernels` = (full, diagonal)); under a `lax.cond` where
    `seen` is traced."""
    diagonal, seen = plan
    update = partial(fn, kernel=kernels[1] if diagonal else kernels[0])
    if isinstance(seen, bool):
        return update(carry, *operands) if seen else carry
    return jax.lax.cond(seen, update, lambda carry, *_: carry, carry, *operands)


def _flash_merge(acc, q_BxScxHxW, k_BxScxGxW, v_BxScxGxW, kernel):
    """One visible sub-block folded into a query chunk's (output, log-sum-exp) by the log-sum-exp."""
    o_BxScxHxW, lse_BxHxSc = acc
    o_blk, lse_blk = flash_forward(*match_varying(q_BxScxHxW, k_BxScxGxW, v_BxScxGxW), kernel)
    lse = jnp.logaddexp(lse_BxHxSc, lse_blk)  # the first block: log(0 + e^lse_blk) = lse_blk
    old, new = (jnp.exp(x - lse).transpose(0, 2, 1)[..., None] for x in (lse_BxHxSc, lse_blk))  # [B, Sc, H, 1]
    return o_BxScxHxW * old + o_blk.astype(o_BxScxHxW.dtype) * new, lse


def _flash_ring_forward(q_BxSlxGxRxK, k_BxSlxGxK, v_BxSlxGxK, ring: Ring):
    """(output [B, Sl, G, R, K], log-sum-exp [B, H, Sl] in float32) by the kernel, sub-block by sub-block."""
    c = ring.size
    B, n, G, R, K = q_BxSlxGxRxK.shape
    H, half = G * R, n // 2
    full, diagonal, width = _flash_configs(half, K, q_BxSlxGxRxK.dtype, ring.interpret)
    kernels = (full, diagonal)
    fit = partial(_fit, rows=full.seq_len, width=width)
    rank = jax.lax.axis_index(CONTEXT)
    qs = [fit(x.reshape(B, half, H, K)) for x in _halves(q_BxSlxGxRxK, 1)]  # [B, Scp, H, W]
    like = (q_BxSlxGxRxK, k_BxSlxGxK)
    acc = jnp.float32  # the kernel's accumulation dtype (float64 is refused with attention_backend='pallas')
    accs = [(_zeros(qs[0].shape, acc, *like), _zeros((B, H, qs[0].shape[1]), acc, *like) - jnp.inf) for _ in qs]
    kv = (k_BxSlxGxK, v_BxSlxGxK)
    for j in range(c):
        arriving = _send(kv, c) if j < c - 1 else None  # issued before this block's compute: they can overlap
        ks, vs = ([fit(x) for x in _halves(y, 1)] for y in kv)
        for a in range(2):
            for b in range(2):
                plan = _flash_block(j, a, b, rank, c, like=kv[0])
                accs[a] = _on_block(plan, kernels, _flash_merge, accs[a], qs[a], ks[b], vs[b])
        kv = arriving
    outs = [o[:, :half, :, :K].reshape(B, half, G, R, K) for o, _ in accs]
    lse = jnp.concatenate([lse[..., :half] for _, lse in accs], axis=-1)  # every row sees itself: finite
    return jnp.concatenate(outs, axis=1).astype(q_BxSlxGxRxK.dtype), lse


def _flash_grad_block(grads, q_BxScxHxW, k_BxScxGxW, v_BxScxGxW, rows, kernel):
    """One visible sub-block's share of (dq, dk, dv) by the kernel's backward, from the final lse and delta."""
    dq_BxScxHxW, dk_BxScxGxK, dv_BxScxGxK = grads
    operands = match_varying(q_BxScxHxW, k_BxScxGxW, v_BxScxGxW, *rows)  # rows: dO, lse, delta
    B, _, H, _ = q_BxScxHxW.shape
    n, G, K = dk_BxScxGxK.shape[1:]
    dq_blk = flash_dq(*operands, kernel).astype(dq_BxScxHxW.dtype)
    dk_blk, dv_blk = (  # per query head [B, Scp, H, W]: summed over each group's R heads, padding cut
        d[:, :n, :, :K].astype(dk_BxScxGxK.dtype).reshape(B, n, G, H // G, K).sum(3)
        for d in flash_dkdv(*operands, kernel)
    )
    return dq_BxScxHxW + dq_blk, dk_BxScxGxK + dk_blk, dv_BxScxGxK + dv_blk


def _flash_ring_backward(ring: Ring, residuals, d_out):
    """`_xla_ring_backward`'s ring with the kernel's dQ and dK/dV per visible sub-block."""
    q, k, v, out, lse = residuals
    c = ring.size
    B, n, G, R, K = q.shape
    H, half = G * R, n // 2
    full, diagonal, width = _flash_configs(half, K, q.dtype, ring.interpret)
    kernels = (full, diagonal)
    rows = full.seq_len
    fit = partial(_fit, rows=rows, width=width)
    rank = jax.lax.axis_index(CONTEXT)
    acc = jnp.float32
    delta = jnp.einsum("bsgrk,bsgrk->bgrs", d_out.astype(acc), out.astype(acc)).reshape(B, H, n)  # rowsum(dO ∘ O)
    qs, dos = ([fit(x.reshape(B, half, H, K)) for x in _halves(y, 1)] for y in (q, d_out))
    # padded query rows: lse = +inf makes their probabilities 0 (their dO is 0 too)
    lses = [_fit(x, rows, None, fill=jnp.inf) for x in _halves(lse, 2)]
    deltas = [_fit(x, rows, None) for x in _halves(delta, 2)]
    like = (q, k, d_out)
    dqs = [_zeros(x.shape, acc, *like) for x in qs]
    dkv = [_zeros((B, half, G, K), acc, *like) for _ in range(4)]  # dk halves, then dv halves
    kv = (k, v)
    for j in range(c):
        arriving = _send(kv, c) if j < c - 1 else None
        ks, vs = ([fit(x) for x in _halves(y, 1)] for y in kv)
        for b in range(2):
            for a in range(2):
                plan = _flash_block(j, a, b, rank, c, like=kv[0])
                dqs[a], dkv[b], dkv[2 + b] = _on_block(
                    plan,
                    kernels,
                    _flash_grad_block,
                    (dqs[a], dkv[b], dkv[2 + b]),
                    qs[a],
                    ks[b],
                    vs[b],
                    (dos[a], lses[a], deltas[a]),
                )
        dkv = list(_send(tuple(dkv), c))  # after this block's compute; c hops bring each buffer home
        kv = arriving
    dq = jnp.concatenate([x[:, :half, :, :K].reshape(B, half, G, R, K) for x in dqs], axis=1).astype(q.dtype)
    dk = jnp.concatenate(dkv[:2], axis=1).astype(k.dtype)
    dv = jnp.concatenate(dkv[2:], axis=1).astype(v.dtype)
    return dq, dk, dv


ring_attention.defvjp(_ring_fwd, _ring_bwd)
