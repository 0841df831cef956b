"""Fused causal multi-head attention (FlashAttention-2 style) in Pallas: forward and backward, `jax.custom_vjp`.

Shapes [batch, seq, heads, head_dim] (the layout of `ptd_jax.model`), float32 or bfloat16 inputs, float32
accumulation. The forward keeps a running max and normaliser per query row (online softmax) over key blocks, so
no [seq, seq] matrix exists in memory; it saves the log-sum-exp per row for the backward, which recomputes the
probabilities block by block: one kernel accumulates dK and dV per key block, another dQ per query block.

Written with the generic `pl.pallas_call` + `BlockSpec` API so that `interpret=True` runs it on CPU
(docs/architecture.md, "Pallas kernels"); `flash_attention_reference` is the pure-jnp definition it is tested
against.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import pallas_call
from pallas_kernels.vma import match_varying, out_struct


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query/key block lengths, powers of two (Triton's tiles). A sequence that is not a multiple of both is padded
    at the end and the padded keys are masked out; a shorter one uses one block of at least 16 (the smallest
    tile Triton's dot takes)."""

    block_q: int = 64
    block_k: int = 64

    def for_seq(self, seq_len: int) -> tuple[BlockSizes, int]:
        """The blocks for this sequence and the padded length the kernels run on."""
        if any(b <= 0 or b & (b - 1) for b in (self.block_q, self.block_k)):
            raise ValueError(f"block_q={self.block_q} and block_k={self.block_k} must be positive powers of two")
        limit = max(MIN_TILE, pl.next_power_of_2(seq_len))
        blocks = BlockSizes(min(self.block_q, limit), min(self.block_k, limit))
        step = max(blocks.block_q, blocks.block_k)  # both are powers of two: the larger is a multiple of the other
        return blocks, -(-seq_len // step) * step


MIN_TILE = 16


def flash_attention_reference(q, k, v, *, causal: bool = True, sm_scale: float | None = None):
    """softmax(q kᵀ · scale + causal mask) v in float32, [B, S, H, K] -> [B, S, H, K] in q's dtype."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bqhk,bshk->bhqs", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if causal:
        S = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqs,bshk->bqhk", p, v.astype(jnp.float32)).astype(q.dtype)


def _visible(q_start, k_start, block_q, block_k, causal, kv_len, seq_len):
    """Which (query, key) pairs of a block pair may attend: key <= query if causal, key < kv_len if padded.
    None when every pair may."""
    rows = q_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    cols = k_start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    mask = rows >= cols if causal else None
    if kv_len < seq_len:
        mask = cols < kv_len if mask is None else mask & (cols < kv_len)
    return mask


def _fwd_kernel(ids, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, causal, block_q, block_k, seq_len, kv_len):
    i = ids[2]
    q = q_ref[...]  # [bq, K]
    m0 = jnp.full((block_q,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_q,), jnp.float32)
    acc0 = jnp.zeros((block_q, q.shape[-1]), jnp.float32)

    def body(j, carry):
        m, l, acc = carry
        k = k_ref[pl.ds(j * block_k, block_k), :]  # [bk, K]
        v = v_ref[pl.ds(j * block_k, block_k), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale  # [bq, bk]
        visible = _visible(i * block_q, j * block_k, block_q, block_k, causal, kv_len, seq_len)
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        l_new = alpha * l + p.sum(axis=-1)
        acc = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l_new, acc

    num_k = pl.cdiv((i + 1) * block_q, block_k) if causal else seq_len // block_k
    m, l, acc = jax.lax.fori_loop(0, num_k, body, (m0, l0, acc0))
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dkdv_kernel(
    ids,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    causal,
    block_q,
    block_k,
    seq_len,
    kv_len,
):
    j = ids[2]
    k = k_ref[...]  # [bk, K]
    v = v_ref[...]
    dk0 = jnp.zeros(k.shape, jnp.float32)
    dv0 = jnp.zeros(v.shape, jnp.float32)

    def body(i, carry):
        dk, dv = carry
        q = q_ref[pl.ds(i * block_q, block_q), :]  # [bq, K]
        do = do_ref[pl.ds(i * block_q, block_q), :]
        lse = lse_ref[pl.ds(i * block_q, block_q)]
        delta = delta_ref[pl.ds(i * block_q, block_q)]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        p = jnp.exp(s - lse[:, None])
        visible = _visible(i * block_q, j * block_k, block_q, block_k, causal, kv_len, seq_len)
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        dv = dv + jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None]) * scale
        dk = dk + jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)
        return dk, dv

    first = (j * block_k) // block_q if causal else 0
    dk, dv = jax.lax.fori_loop(first, seq_len // block_q, body, (dk0, dv0))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    ids, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, causal, block_q, block_k, seq_len, kv_len
):
    i = ids[2]
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]

    def body(j, dq):
        k = k_ref[pl.ds(j * block_k, block_k), :]
        v = v_ref[pl.ds(j * block_k, block_k), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        p = jnp.exp(s - lse[:, None])
        visible = _visible(i * block_q, j * block_k, block_q, block_k, causal, kv_len, seq_len)
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None]) * scale
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    num_k = pl.cdiv((i + 1) * block_q, block_k) if causal else seq_len // block_k
    dq = jax.lax.fori_loop(0, num_k, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _specs(B, S, H, K, blocks, group: int = 1):
    """BlockSpecs over the grid (batch, query head, block): a block of rows, the whole sequence, per-row vectors.
    `group` R query heads share one key/value head (grouped-query attention): the key/value specs (`rows_kv`,
    `whole_kv`) read head h // R, so no repeated copy of K and V exists."""
    rows_q = pl.BlockSpec((None, blocks.block_q, None, K), lambda b, h, i: (b, i, h, 0))
    rows_k = pl.BlockSpec((None, blocks.block_k, None, K), lambda b, h, i: (b, i, h, 0))
    whole = pl.BlockSpec((None, S, None, K), lambda b, h, i: (b, 0, h, 0))
    if group == 1:  # multi-head attention: the key/value specs are the query side's (the index maps stay plain)
        rows_kv, whole_kv = rows_k, whole
    else:
        rows_kv = pl.BlockSpec((None, blocks.block_k, None, K), lambda b, h, i: (b, i, h // group, 0))
        whole_kv = pl.BlockSpec((None, S, None, K), lambda b, h, i: (b, 0, h // group, 0))
    vec_q = pl.BlockSpec((None, None, blocks.block_q), lambda b, h, i: (b, h, i))
    vec_whole = pl.BlockSpec((None, None, S), lambda b, h, i: (b, h, 0))
    return rows_q, rows_k, rows_kv, whole, whole_kv, vec_q, vec_whole


def _warps(head_dim):
    """Triton warps per program: 4 for head_dim <= 64, else 8 (the split jax's own GPU attention uses)."""
    return 4 if head_dim <= 64 else 8


def _check(q, k, v):
    if q.ndim != 4 or k.shape != v.shape or q.shape[:2] + q.shape[3:] != k.shape[:2] + k.shape[3:]:
        raise ValueError(
            f"q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim] must agree, got {q.shape=}, "
            f"{k.shape=}, {v.shape=}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"the {q.shape[2]} query heads do not split into groups of the {k.shape[2]} key/value heads")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}")


def _forward(q, k, v, causal, scale, blocks, kv_len, interpret):
    B, S, H, K = q.shape
    rows_q, _, _, _, whole_kv, vec_q, _ = _specs(B, S, H, K, blocks, H // k.shape[2])
    kernel = functools.partial(
        _fwd_kernel,
        scale=scale,
        causal=causal,
        block_q=blocks.block_q,
        block_k=blocks.block_k,
        seq_len=S,
        kv_len=kv_len,
    )
    return pallas_call(
        kernel,
        grid=(B, H, S // blocks.block_q),
        in_specs=[rows_q, whole_kv, whole_kv],
        out_specs=[rows_q, vec_q],
        out_shape=[out_struct(q.shape, q.dtype, q), out_struct((B, H, S), jnp.float32, q)],
        interpret=interpret,
        num_warps=_warps(K),
        name="flash_attention_fwd",
    )(q, k, v)


def _backward(residuals, do, causal, scale, blocks, kv_len, interpret):
    """(dq, dk, dv) from the forward's residuals (q, k, v, o, lse) and the output's cotangent `do`."""
    q, k, v, o, lse = residuals
    B, S, H, K = q.shape
    G = k.shape[2]
    rows_q, rows_k, rows_kv, whole, whole_kv, vec_q, vec_whole = _specs(B, S, H, K, blocks, H // G)
    delta = jnp.einsum("bshk,bshk->bhs", o.astype(jnp.float32), do.astype(jnp.float32))  # rowsum(dO ∘ O)
    common = dict(scale=scale, causal=causal, block_q=blocks.block_q, block_k=blocks.block_k, seq_len=S, kv_len=kv_len)
    dk, dv = pallas_call(
        functools.partial(_dkdv_kernel, **common),
        grid=(B, H, S // blocks.block_k),
        in_specs=[whole, rows_kv, rows_kv, whole, vec_whole, vec_whole],
        out_specs=[rows_k, rows_k],
        # per query head (float32 where a group sums several), then summed over each group's R heads
        out_shape=[
            out_struct(q.shape, k.dtype if G == H else jnp.float32, k),
            out_struct(q.shape, v.dtype if G == H else jnp.float32, v),
        ],
        interpret=interpret,
        num_warps=_warps(K),
        name="flash_attention_dkdv",
    )(q, k, v, do, lse, delta)
    if G != H:
        dk, dv = (d.reshape(B, S, G, H // G, K).sum(3).astype(x.dtype) for d, x in ((dk, k), (dv, v)))
    dq = pallas_call(
        functools.partial(_dq_kernel, **common),
        grid=(B, H, S // blocks.block_q),
        in_specs=[rows_q, whole_kv, whole_kv, rows_q, vec_q, vec_q],
        out_specs=rows_q,
        out_shape=out_struct(q.shape, q.dtype, q),
        interpret=interpret,
        num_warps=_warps(K),
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _flash(q, k, v, causal, scale, blocks, kv_len, interpret):
    return _forward(q, k, v, causal, scale, blocks, kv_len, interpret)[0]


def _flash_fwd(q, k, v, causal, scale, blocks, kv_len, interpret):
    o, lse = _forward(q, k, v, causal, scale, blocks, kv_len, interpret)
    return o, (q, k, v, o, lse)


def _flash_bwd(causal, scale, blocks, kv_len, interpret, residuals, do):
    return _backward(residuals, do, causal, scale, blocks, kv_len, interpret)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
):
    """Causal (or full) attention of q [batch, seq, heads, head_dim] over k, v [batch, seq, kv_heads, head_dim]
    (grouped-query attention: heads = R · kv_heads, query head h reads key/value head h // R in place);
    differentiable (custom VJP)."""
    _check(q, k, v)
    q, k, v = match_varying(q, k, v)
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    _, seq_len, _, head_dim = q.shape
    blocks, padded = block_sizes.for_seq(seq_len)
    width = max(MIN_TILE, pl.next_power_of_2(head_dim))  # zero head-dim columns change no score, give zero output
    if (padded, width) == (seq_len, head_dim):
        return _flash(q, k, v, causal, scale, blocks, seq_len, interpret)
    pad = [(0, 0), (0, padded - seq_len), (0, 0), (0, width - head_dim)]
    out = _flash(*(jnp.pad(a, pad) for a in (q, k, v)), causal, scale, blocks, seq_len, interpret)
    return out[:, :seq_len, :, :head_dim]
