"""Fused causal attention (FlashAttention-2 style) in Pallas: forward and backward, `jax.custom_vjp`; grouped
queries and a sliding window.

Shapes [batch, seq, heads, head_dim] (the layout of `ptd_jax.model`), float32 or bfloat16 inputs, float32
accumulation. The forward keeps a running max and normaliser per query row (online softmax) over key blocks, so
no [seq, seq] matrix exists in memory; it saves the log-sum-exp per row for the backward, which recomputes the
probabilities block by block: one kernel accumulates dK and dV per key block, another dQ per query block.

Grouped-query attention: query head h reads key/value head h // R in place (R query heads per key/value head).
Sliding window (Mistral): a query at position q sees the keys at q − w < k ≤ q. Each kernel visits only the block
pairs that hold a visible pair, so a window costs O(s·w) work, not O(s²) (`key_blocks`, `query_blocks`).

Blocks: Triton stages each `dot`'s tiles through shared memory, so the blocks are chosen per (head width, dtype,
target GPU) from a model of what each kernel asks for (`shared_memory_bytes`, checked against XLA:GPU's compiler
in tests/aot/test_kernels_compile.py); `choose_blocks` takes the largest that fits the target's limit
(`pallas_kernels.target`).

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
from pallas_kernels.target import GpuTarget, current_target
from pallas_kernels.vma import match_varying, out_struct

MIN_TILE = 16


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


CANDIDATES = (BlockSizes(64, 64), BlockSizes(64, 32), BlockSizes(32, 32), BlockSizes(32, 16), BlockSizes(16, 16))
"""Tried in this order by `choose_blocks`: 64 × 64 first (jax's own Pallas GPU attention default), then smaller
key blocks before smaller query blocks (a query block's rows share each key block read)."""


class NoBlockFits(ValueError):
    """No block size of `CANDIDATES` fits the target's shared memory at this head width and dtype."""


def shared_memory_bytes(kernel: str, blocks: BlockSizes, width: int, itemsize: int, target: GpuTarget) -> int:
    """Shared memory Triton asks for to run `kernel` ("forward", "dq", "dkdv") with these blocks at head width
    `width` (a power of two) and `itemsize`-byte inputs, an upper bound fitted to what XLA:GPU's Triton reports
    (the "requested N" of its limit error, measured on a target whose limit is 1 byte, 2026-12-04, jax 0.10.2):
    exact on 204 of 420 (kernel, blocks, width 16..256, dtype, sm_80/sm_90) points, never below.

    The tiles of each `dot` are staged: the kernel's own block (q; in dkdv k and v), the tiles its loop loads
    (k and v; in dkdv q and dO), and the bq × bk probabilities re-laid out for the second dot; dkdv also keeps two
    float32 row vectors (lse, delta). On sm_90, where the dots' M (bq; bk in dkdv) is at least 64, Triton's
    warp-group MMAs double-buffer the loop's tiles and read the probabilities from registers."""
    bq, bk, W, e = blocks.block_q, blocks.block_k, width, itemsize
    warpgroup = target.hopper_or_later and (bk if kernel == "dkdv" else bq) >= 64
    if kernel == "forward":
        return e * (bq * W + 4 * bk * W) if warpgroup else e * (bq * W + 2 * bk * W + bq * bk)
    if kernel == "dq":
        return e * (2 * bq * W + 4 * bk * W) if warpgroup else e * (2 * bq * W + 2 * bk * W + bq * bk)
    if kernel == "dkdv":
        tiles = 4 * bq * W + 2 * bk * W + bq * bk if warpgroup else 2 * bq * W + 2 * bk * W + bq * bk
        return e * tiles + 2 * 4 * bq
    raise ValueError(f"kernel={kernel!r} is not one of 'forward', 'dq', 'dkdv'")


def choose_blocks(seq_len: int, head_dim: int, dtype, target: GpuTarget | None = None) -> BlockSizes:
    """The first of `CANDIDATES` (as `BlockSizes.for_seq` shortens it to this sequence) whose three kernels fit the
    target's shared memory (`pallas_kernels.target.current_target()` when None); `NoBlockFits` if none does."""
    target = target or current_target()
    width = max(MIN_TILE, pl.next_power_of_2(head_dim))
    itemsize = jnp.dtype(dtype).itemsize
    for candidate in CANDIDATES:
        blocks, _ = candidate.for_seq(seq_len)
        need = max(shared_memory_bytes(k, blocks, width, itemsize, target) for k in ("forward", "dq", "dkdv"))
        if need <= target.shared_memory_per_block:
            return candidate
    smallest = max(shared_memory_bytes(k, CANDIDATES[-1], width, itemsize, target) for k in ("forward", "dq", "dkdv"))
    raise NoBlockFits(
        f"flash attention at head_dim={head_dim} (tiles of {width}) in {jnp.dtype(dtype).name} needs {smallest:,} "
        f"bytes of shared memory at its smallest blocks (16 x 16), more than the {target.shared_memory_per_block:,} "
        f"one block may use on sm_{target.compute_capability[0]}{target.compute_capability[1]}"
    )


def flash_attention_reference(q, k, v, *, causal: bool = True, sm_scale: float | None = None, window_size=None):
    """softmax(q kᵀ · scale + mask) v in float32, [B, S, H, K] -> [B, S, H, K] in q's dtype; the mask keeps key <=
    query if causal, and query − window_size < key where a window is given. k, v with G heads serve R = H / G query
    heads each (grouped-query attention)."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    R = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(a.astype(jnp.float32), R, axis=2) for a in (k, v))
    s = jnp.einsum("bqhk,bshk->bhqs", q.astype(jnp.float32), k) * scale
    S = q.shape[1]
    rows, cols = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    seen = cols <= rows if causal else jnp.ones((S, S), bool)
    if window_size is not None:
        seen &= cols > rows - window_size
    p = jax.nn.softmax(jnp.where(seen, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqs,bshk->bqhk", p, v).astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """What every kernel is specialised on (hashable: the custom VJP's non-differentiable argument)."""

    causal: bool
    scale: float
    block_q: int
    block_k: int
    seq_len: int
    """Padded: a multiple of both blocks."""
    kv_len: int
    """Real keys; those at kv_len and after are padding, masked."""
    window: int | None
    interpret: bool


def key_blocks(i, c: KernelConfig):
    """[first, end) of the key blocks that query block i sees: up to the diagonal if causal, from the window's
    start (the key q − w + 1 of its first row q) with a window."""
    end = pl.cdiv((i + 1) * c.block_q, c.block_k) if c.causal else c.seq_len // c.block_k
    first = 0 if c.window is None else jnp.maximum(i * c.block_q - c.window + 1, 0) // c.block_k
    return first, end


def query_blocks(j, c: KernelConfig):
    """[first, end) of the query blocks that see key block j: from the diagonal if causal, up to the last query
    whose window holds the block's last key (k + w − 1) with a window."""
    first = (j * c.block_k) // c.block_q if c.causal else 0
    end = c.seq_len // c.block_q
    if c.window is not None:
        end = jnp.minimum(end, pl.cdiv((j + 1) * c.block_k + c.window - 1, c.block_q))
    return first, end


def _visible(q_start, k_start, c: KernelConfig):
    """Which (query, key) pairs of a block pair may attend: key <= query if causal, query − w < key with a window,
    key < kv_len if padded. None when every pair may."""
    rows = q_start + jax.lax.broadcasted_iota(jnp.int32, (c.block_q, c.block_k), 0)
    cols = k_start + jax.lax.broadcasted_iota(jnp.int32, (c.block_q, c.block_k), 1)
    mask = rows >= cols if c.causal else None
    for extra in (
        cols > rows - c.window if c.window is not None else None,
        cols < c.kv_len if c.kv_len < c.seq_len else None,
    ):
        if extra is not None:
            mask = extra if mask is None else mask & extra
    return mask


def _fwd_kernel(ids, q_ref, k_ref, v_ref, o_ref, lse_ref, *, c: KernelConfig):
    i = ids[2]
    q = q_ref[...]  # [bq, K]
    m0 = jnp.full((c.block_q,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((c.block_q,), jnp.float32)
    acc0 = jnp.zeros((c.block_q, q.shape[-1]), jnp.float32)

    def body(j, carry):
        m, l, acc = carry
        k = k_ref[pl.ds(j * c.block_k, c.block_k), :]  # [bk, K]
        v = v_ref[pl.ds(j * c.block_k, c.block_k), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * c.scale  # [bq, bk]
        visible = _visible(i * c.block_q, j * c.block_k, c)
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        # a row that has seen no key yet (a window's first blocks, padded rows) keeps m = -inf: shift it by 0, so
        # that its probabilities are exp(-inf) = 0 and not exp(-inf + inf) = NaN
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - shift[:, None])
        alpha = jnp.exp(m - shift)
        l_new = alpha * l + p.sum(axis=-1)
        acc = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l_new, acc

    first, end = key_blocks(i, c)
    m, l, acc = jax.lax.fori_loop(first, end, body, (m0, l0, acc0))
    empty = l == 0.0  # padded query rows past a window: no key at all; output 0, and +inf makes the backward's p 0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(l))


def _dkdv_kernel(ids, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, c: KernelConfig):
    j = ids[2]
    k = k_ref[...]  # [bk, K]
    v = v_ref[...]
    dk0 = jnp.zeros(k.shape, jnp.float32)
    dv0 = jnp.zeros(v.shape, jnp.float32)

    def body(i, carry):
        dk, dv = carry
        q = q_ref[pl.ds(i * c.block_q, c.block_q), :]  # [bq, K]
        do = do_ref[pl.ds(i * c.block_q, c.block_q), :]
        lse = lse_ref[pl.ds(i * c.block_q, c.block_q)]
        delta = delta_ref[pl.ds(i * c.block_q, c.block_q)]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * c.scale
        p = jnp.exp(s - lse[:, None])
        visible = _visible(i * c.block_q, j * c.block_k, c)
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        dv = dv + jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None]) * c.scale
        dk = dk + jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)
        return dk, dv

    first, end = query_blocks(j, c)
    dk, dv = jax.lax.fori_loop(first, end, body, (dk0, dv0))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(ids, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, c: KernelConfig):
    i = ids[2]
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]

    def body(j, dq):
        k = k_ref[pl.ds(j * c.block_k, c.block_k), :]
        v = v_ref[pl.ds(j * c.block_k, c.block_k), :]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * c.scale
        p = jnp.exp(s - lse[:, None])
        visible = _visible(i * c.block_q, j * c.block_k, c)
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None]) * c.scale
        return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    first, end = key_blocks(i, c)
    dq = jax.lax.fori_loop(first, end, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _specs(S, K, c: KernelConfig, group: int = 1):
    """BlockSpecs over the grid (batch, query head, block): a block of rows, the whole sequence, per-row vectors.
    `group` R query heads share one key/value head (grouped-query attention): the key/value specs (`rows_kv`,
    `whole_kv`) read head h // R, so no repeated copy of K and V exists."""
    rows_q = pl.BlockSpec((None, c.block_q, None, K), lambda b, h, i: (b, i, h, 0))
    rows_k = pl.BlockSpec((None, c.block_k, None, K), lambda b, h, i: (b, i, h, 0))
    whole = pl.BlockSpec((None, S, None, K), lambda b, h, i: (b, 0, h, 0))
    if group == 1:  # multi-head attention: the key/value specs are the query side's (the index maps stay plain)
        rows_kv, whole_kv = rows_k, whole
    else:
        rows_kv = pl.BlockSpec((None, c.block_k, None, K), lambda b, h, i: (b, i, h // group, 0))
        whole_kv = pl.BlockSpec((None, S, None, K), lambda b, h, i: (b, 0, h // group, 0))
    vec_q = pl.BlockSpec((None, None, c.block_q), lambda b, h, i: (b, h, i))
    vec_whole = pl.BlockSpec((None, None, S), lambda b, h, i: (b, h, 0))
    return rows_q, rows_k, rows_kv, whole, whole_kv, vec_q, vec_whole


def _warps(head_dim):
    """Triton warps per program: 4 for head_dim <= 64, else 8 (the split jax's own GPU attention uses)."""
    return 4 if head_dim <= 64 else 8


def _check(q, k, v, causal, window_size):
    if q.ndim != 4 or k.shape != v.shape or q.shape[:2] + q.shape[3:] != k.shape[:2] + k.shape[3:]:
        raise ValueError(
            f"q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim] must agree, got {q.shape=}, "
            f"{k.shape=}, {v.shape=}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"the {q.shape[2]} query heads do not split into groups of the {k.shape[2]} key/value heads")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype=}, {k.dtype=}, {v.dtype=}")
    if window_size is not None and (not causal or int(window_size) < 1):
        raise ValueError(f"window_size={window_size} needs causal attention and must be at least 1, got {causal=}")


def forward(q, k, v, c: KernelConfig):
    """(o, lse): the output [B, S, H, K] and the log-sum-exp per row [B, H, S]."""
    B, S, H, K = q.shape
    rows_q, _, _, _, whole_kv, vec_q, _ = _specs(S, K, c, H // k.shape[2])
    return pallas_call(
        functools.partial(_fwd_kernel, c=c),
        grid=(B, H, S // c.block_q),
        in_specs=[rows_q, whole_kv, whole_kv],
        out_specs=[rows_q, vec_q],
        out_shape=[out_struct(q.shape, q.dtype, q), out_struct((B, H, S), jnp.float32, q)],
        interpret=c.interpret,
        num_warps=_warps(K),
        name="flash_attention_fwd",
    )(q, k, v)


def dkdv(q, k, v, do, lse, delta, c: KernelConfig):
    """(dk, dv) per query head [B, S, H, K]: float32 where a group of several query heads will sum them."""
    B, S, H, K = q.shape
    G = k.shape[2]
    _, rows_k, rows_kv, whole, _, _, vec_whole = _specs(S, K, c, H // G)
    return pallas_call(
        functools.partial(_dkdv_kernel, c=c),
        grid=(B, H, S // c.block_k),
        in_specs=[whole, rows_kv, rows_kv, whole, vec_whole, vec_whole],
        out_specs=[rows_k, rows_k],
        out_shape=[
            out_struct(q.shape, k.dtype if G == H else jnp.float32, k),
            out_struct(q.shape, v.dtype if G == H else jnp.float32, v),
        ],
        interpret=c.interpret,
        num_warps=_warps(K),
        name="flash_attention_dkdv",
    )(q, k, v, do, lse, delta)


def dq(q, k, v, do, lse, delta, c: KernelConfig):
    B, S, H, K = q.shape
    rows_q, _, _, _, whole_kv, vec_q, _ = _specs(S, K, c, H // k.shape[2])
    return pallas_call(
        functools.partial(_dq_kernel, c=c),
        grid=(B, H, S // c.block_q),
        in_specs=[rows_q, whole_kv, whole_kv, rows_q, vec_q, vec_q],
        out_specs=rows_q,
        out_shape=out_struct(q.shape, q.dtype, q),
        interpret=c.interpret,
        num_warps=_warps(K),
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta)


def _backward(c: KernelConfig, residuals, do):
    """(dq, dk, dv) from the forward's residuals (q, k, v, o, lse) and the output's cotangent `do`."""
    q, k, v, o, lse = residuals
    B, S, H, K = q.shape
    G = k.shape[2]
    delta = jnp.einsum("bshk,bshk->bhs", o.astype(jnp.float32), do.astype(jnp.float32))  # rowsum(dO ∘ O)
    dk, dv = dkdv(q, k, v, do, lse, delta, c)
    if G != H:  # per query head, summed over each group's R heads
        dk, dv = (d.reshape(B, S, G, H // G, K).sum(3).astype(x.dtype) for d, x in ((dk, k), (dv, v)))
    return dq(q, k, v, do, lse, delta, c), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q, k, v, c: KernelConfig):
    return forward(q, k, v, c)[0]


def _flash_fwd(q, k, v, c: KernelConfig):
    o, lse = forward(q, k, v, c)
    return o, (q, k, v, o, lse)


_flash.defvjp(_flash_fwd, _backward)


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    window_size: int | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
):
    """Causal (or full) attention of q [batch, seq, heads, head_dim] over k, v [batch, seq, kv_heads, head_dim]
    (grouped-query attention: heads = R · kv_heads, query head h reads key/value head h // R in place), within a
    sliding window of `window_size` keys (the query's own and the w − 1 before it) if given; differentiable
    (custom VJP). `block_sizes` None: `choose_blocks` for this head width, dtype and target GPU."""
    _check(q, k, v, causal, window_size)
    q, k, v = match_varying(q, k, v)
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    _, seq_len, _, head_dim = q.shape
    if block_sizes is None:
        block_sizes = choose_blocks(seq_len, head_dim, q.dtype)
    blocks, padded = block_sizes.for_seq(seq_len)
    window = None if window_size is None or window_size >= seq_len else int(window_size)
    c = KernelConfig(causal, scale, blocks.block_q, blocks.block_k, padded, seq_len, window, interpret)
    width = max(MIN_TILE, pl.next_power_of_2(head_dim))  # zero head-dim columns change no score, give zero output
    if (padded, width) == (seq_len, head_dim):
        return _flash(q, k, v, c)
    pad = [(0, 0), (0, padded - seq_len), (0, 0), (0, width - head_dim)]
    out = _flash(*(jnp.pad(a, pad) for a in (q, k, v)), c)
    return out[:, :seq_len, :, :head_dim]
