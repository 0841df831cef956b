"""Fused softmax cross-entropy in Pallas that never materialises the float32 softmax, vocab-parallel aware.

Forward: one kernel streams each row block's logits over vocabulary blocks and keeps three numbers per row —
running max, sum of exponentials relative to it, and the target logit (if the label falls in this shard).
Under tensor parallelism those three are combined across the vocabulary shards with one pmax and two psums
(the same reduction as `ptd_jax.parallel.tensor.vocab_parallel_cross_entropy`), so composing is just passing
`axis_name`. Backward: a second kernel writes d logits = (softmax − one-hot) · d loss block by block from the
saved log-sum-exp. Padded vocabulary columns (global id >= vocab_size) never enter the normaliser.

`softmax_cross_entropy(logits [N, V], labels [N], *, vocab_size=None, vocab_start=0, axis_name=None,
interpret=False)` -> per-row loss [N] in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import pallas_call, pltriton
from pallas_kernels.vma import match_varying, out_struct


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows per program and vocabulary columns per inner step, both powers of two (Triton's tiles). Rows that do
    not fill the last block are padded. The vocabulary step is the largest power of two <= block_vocab dividing
    the shard's width when that is at least 64 (Megatron pads the vocabulary to a multiple of 128·t); otherwise
    block_vocab with a masked last step."""

    block_rows: int = 32
    block_vocab: int = 256

    def for_shape(self, rows: int, vocab: int) -> tuple[int, int]:
        for name, value in (("block_rows", self.block_rows), ("block_vocab", self.block_vocab)):
            if value <= 0 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a positive power of two")
        bv = min(self.block_vocab, pl.next_power_of_2(vocab))
        whole = math.gcd(bv, vocab)  # a power of two: whole steps need no masked loads
        return min(self.block_rows, pl.next_power_of_2(rows)), whole if whole >= min(bv, 64) else bv


def _columns(ref, j, block_vocab, vocab):
    """Step j's columns [rows, block_vocab] and their ids; ids >= vocab (a partial last step) read -inf."""
    cols = j * block_vocab + jax.lax.broadcasted_iota(jnp.int32, (ref.shape[0], block_vocab), 1)
    view = ref.at[:, pl.ds(j * block_vocab, block_vocab)]
    if vocab % block_vocab == 0:
        return view[...], cols
    return pltriton.load(view, mask=cols < vocab, other=-jnp.inf), cols


def cross_entropy_reference(logits, labels, *, vocab_size=None):
    """-log softmax(logits)[label] in float32 over the columns < vocab_size."""
    logits = logits.astype(jnp.float32)
    if vocab_size is not None:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]


def _stats_kernel(_, logits_ref, labels_ref, valid_ref, max_ref, sum_ref, target_ref, *, block_vocab, vocab):
    labels = labels_ref[...]  # [br] local label (may be out of range)
    valid = valid_ref[0]  # columns < valid are real vocabulary
    rows = labels.shape[0]

    def body(j, carry):
        m, s, t = carry
        x, cols = _columns(logits_ref, j, block_vocab, vocab)  # [br, bv]
        x = jnp.where(cols < valid, x.astype(jnp.float32), -jnp.inf)
        m_new = jnp.maximum(m, x.max(axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        s = s * jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf)) + jnp.exp(x - safe[:, None]).sum(axis=-1)
        t = t + jnp.where(cols == labels[:, None], x, 0.0).sum(axis=-1)
        return m_new, s, t

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.float32))
    m, s, t = jax.lax.fori_loop(0, pl.cdiv(vocab, block_vocab), body, init)
    max_ref[...] = m
    sum_ref[...] = s
    target_ref[...] = t


def _grad_kernel(_, logits_ref, labels_ref, valid_ref, lse_ref, g_ref, dlogits_ref, *, block_vocab, vocab):
    labels = labels_ref[...]
    valid = valid_ref[0]
    lse = lse_ref[...]
    g = g_ref[...]

    def body(j, _):
        x, cols = _columns(logits_ref, j, block_vocab, vocab)
        p = jnp.where(cols < valid, jnp.exp(x.astype(jnp.float32) - lse[:, None]), 0.0)
        d = ((p - (cols == labels[:, None]).astype(jnp.float32)) * g[:, None]).astype(dlogits_ref.dtype)
        view = dlogits_ref.at[:, pl.ds(j * block_vocab, block_vocab)]
        if vocab % block_vocab == 0:
            view[...] = d
        else:
            pltriton.store(view, d, mask=cols < vocab)
        return 0

    jax.lax.fori_loop(0, pl.cdiv(vocab, block_vocab), body, 0)


def _specs(rows, vocab, br):
    return (
        pl.BlockSpec((br, vocab), lambda i: (i, 0)),
        pl.BlockSpec((br,), lambda i: (i,)),
        pl.BlockSpec((1,), lambda i: (0,)),
    )


def shard_statistics(logits, local_labels, valid, blocks, interpret):
    """One vocabulary shard's per-row (max, sum of exp(logit - max), target logit or 0): what the three
    all-reduces of the vocab-parallel loss combine. `valid` [1] holds how many of the shard's columns are real."""
    rows, vocab = logits.shape
    br, bv = blocks.for_shape(rows, vocab)
    mat, vec, scalar = _specs(rows, vocab, br)
    out = out_struct((rows,), jnp.float32, logits)
    return pallas_call(
        functools.partial(_stats_kernel, block_vocab=bv, vocab=vocab),
        grid=(rows // br,),
        in_specs=[mat, vec, scalar],
        out_specs=[vec, vec, vec],
        out_shape=[out, out, out],
        interpret=interpret,
        name="cross_entropy_stats",
    )(logits, local_labels, valid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _cross_entropy(logits, local_labels, valid, axis_name, blocks, interpret):
    return _cross_entropy_fwd(logits, local_labels, valid, axis_name, blocks, interpret)[0]


def _cross_entropy_fwd(logits, local_labels, valid, axis_name, blocks, interpret):
    row_max, sum_exp, target = shard_statistics(logits, local_labels, valid, blocks, interpret)
    if axis_name is not None:  # combine the vocabulary shards: max, rescaled sum of exponentials, target
        global_max = jax.lax.pmax(row_max, axis_name)
        scale = jnp.where(jnp.isfinite(row_max), jnp.exp(row_max - global_max), 0.0)
        sum_exp = jax.lax.psum(sum_exp * scale, axis_name)
        target = jax.lax.psum(target, axis_name)
        row_max = global_max
    lse = row_max + jnp.log(sum_exp)
    return lse - target, (logits, local_labels, valid, lse)


def _cross_entropy_bwd(axis_name, blocks, interpret, residuals, g):
    logits, local_labels, valid, lse = residuals
    rows, vocab = logits.shape
    br, bv = blocks.for_shape(rows, vocab)
    mat, vec, scalar = _specs(rows, vocab, br)
    dlogits = pallas_call(
        functools.partial(_grad_kernel, block_vocab=bv, vocab=vocab),
        grid=(rows // br,),
        in_specs=[mat, vec, scalar, vec, vec],
        out_specs=mat,
        out_shape=out_struct(logits.shape, logits.dtype, logits),
        interpret=interpret,
        name="cross_entropy_grad",
    )(logits, local_labels, valid, *match_varying(lse, g.astype(jnp.float32), logits)[:2])
    return dlogits, None, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def softmax_cross_entropy(
    logits,
    labels,
    *,
    vocab_size: int | None = None,
    vocab_start=0,
    axis_name: str | None = None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool = False,
):
    """Per-row -log softmax(logits)[label] for logits [N, V] (this device's vocabulary shard when axis_name is
    given; vocab_start is the shard's first global id). Differentiable in logits (custom VJP)."""
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V] and labels [N], got {logits.shape=} and {labels.shape=}")
    vocab = logits.shape[1]
    limit = vocab_size if vocab_size is not None else vocab_start + vocab
    valid = jnp.clip(jnp.asarray(limit - vocab_start, jnp.int32), 0, vocab).reshape(1)
    local_labels = (labels - vocab_start).astype(jnp.int32)
    logits, local_labels, valid = match_varying(logits, local_labels, valid)
    rows = logits.shape[0]
    br, _ = block_sizes.for_shape(rows, vocab)
    padded = -(-rows // br) * br  # zero rows: a finite loss, sliced off, no gradient
    if padded != rows:
        logits = jnp.pad(logits, ((0, padded - rows), (0, 0)))
        local_labels = jnp.pad(local_labels, (0, padded - rows))
    return _cross_entropy(logits, local_labels, valid, axis_name, block_sizes, interpret)[:rows]
