"""Fused LayerNorm over the last dim in Pallas: mean, variance, scale and shift in one pass; the backward computes
dx in one pass per row block and reduces the weight and bias gradients (per-block partial sums, summed after).

`layer_norm(x, weight, bias, *, eps=1e-5, interpret=False)`; statistics in float32 whatever the input dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import match_varying, out_struct, pallas_call


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows per program. A row count that is not a multiple gets a partial last block (its extra rows are
    computed on padding, never stored, and masked out of the weight and bias gradients)."""

    block_rows: int = 128

    def for_rows(self, rows: int) -> int:
        if self.block_rows <= 0:
            raise ValueError(f"block_rows={self.block_rows} must be positive")
        return min(self.block_rows, rows)


def layer_norm_reference(x, weight, bias, *, eps: float = 1e-5):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)
            + bias.astype(jnp.float32)).astype(x.dtype)


def _fwd_kernel(ids, x_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref, *, eps):
    x = x_ref[...].astype(jnp.float32)                        # [rows, D]
    mean = x.mean(axis=-1)
    xc = x - mean[:, None]
    rstd = jax.lax.rsqrt((xc * xc).mean(axis=-1) + eps)
    y = xc * rstd[:, None] * w_ref[...].astype(jnp.float32) + b_ref[...].astype(jnp.float32)
    y_ref[...] = y.astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _bwd_kernel(ids, x_ref, w_ref, mean_ref, rstd_ref, dy_ref, dx_ref, dw_ref, db_ref, *, rows):
    x = x_ref[...].astype(jnp.float32)
    block = x.shape[0]
    in_range = ids[0] * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0) < rows
    dy = jnp.where(in_range, dy_ref[...].astype(jnp.float32), 0.0)  # rows past the end add nothing to dw, db
    rstd = rstd_ref[...]
    xhat = (x - mean_ref[...][:, None]) * rstd[:, None]
    g = dy * w_ref[...].astype(jnp.float32)
    dx = rstd[:, None] * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    dx_ref[...] = dx.astype(dx_ref.dtype)
    dw_ref[...] = jnp.where(in_range, dy * xhat, 0.0).sum(axis=0)[None, :]
    db_ref[...] = dy.sum(axis=0)[None, :]


def _specs(rows, D, block):
    return (pl.BlockSpec((block, D), lambda i: (i, 0)), pl.BlockSpec((D,), lambda i: (0,)),
            pl.BlockSpec((block,), lambda i: (i,)), pl.BlockSpec((1, D), lambda i: (i, 0)))


def _forward(x2, w, b, eps, block, interpret):
    rows, D = x2.shape
    mat, vec_d, vec_rows, _ = _specs(rows, D, block)
    return pallas_call(
        functools.partial(_fwd_kernel, eps=eps), grid=(pl.cdiv(rows, block),),
        in_specs=[mat, vec_d, vec_d], out_specs=[mat, vec_rows, vec_rows],
        out_shape=[out_struct(x2.shape, x2.dtype, x2), out_struct((rows,), jnp.float32, x2),
                   out_struct((rows,), jnp.float32, x2)],
        interpret=interpret, name="layer_norm_fwd",
    )(x2, w, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer_norm(x2, w, b, eps, block, interpret):
    return _forward(x2, w, b, eps, block, interpret)[0]


def _layer_norm_fwd(x2, w, b, eps, block, interpret):
    y, mean, rstd = _forward(x2, w, b, eps, block, interpret)
    return y, (x2, w, b, mean, rstd)


def _layer_norm_bwd(eps, block, interpret, residuals, dy):
    x2, w, b, mean, rstd = residuals
    rows, D = x2.shape
    mat, vec_d, vec_rows, partial = _specs(rows, D, block)
    n = pl.cdiv(rows, block)
    dx, dw_parts, db_parts = pallas_call(
        functools.partial(_bwd_kernel, rows=rows), grid=(n,),
        in_specs=[mat, vec_d, vec_rows, vec_rows, mat], out_specs=[mat, partial, partial],
        out_shape=[out_struct(x2.shape, x2.dtype, x2), out_struct((n, D), jnp.float32, x2),
                   out_struct((n, D), jnp.float32, x2)],
        interpret=interpret, name="layer_norm_bwd",
    )(x2, w, mean, rstd, dy)
    return dx, dw_parts.sum(0).astype(w.dtype), db_parts.sum(0).astype(b.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def layer_norm(x, weight, bias, *, eps: float = 1e-5, block_sizes: BlockSizes = BlockSizes(),
               interpret: bool = False):
    """LayerNorm of x [..., D] with weight and bias [D]; differentiable (custom VJP)."""
    D = x.shape[-1]
    if weight.shape != (D,) or bias.shape != (D,):
        raise ValueError(f"weight.shape={weight.shape} and bias.shape={bias.shape} must be ({D},) for {x.shape=}")
    x, weight, bias = match_varying(x, weight, bias)
    x2 = x.reshape(-1, D)
    block = block_sizes.for_rows(x2.shape[0])
    return _layer_norm(x2, weight, bias, float(eps), block, interpret).reshape(x.shape)
