"""Fused LayerNorm and RMSNorm over the last dim in Pallas: mean, variance, scale and shift in one pass; the
backward computes dx in one pass per row block and reduces the weight and bias gradients (per-block partial sums,
summed after). RMSNorm (Llama's) is the same kernels without the centring and the shift. A width D that is not a
power of two is read with masked loads over the next power of two (Triton's tiles).

`layer_norm(x, weight, bias, *, eps=1e-5, interpret=False)`, `rms_norm(x, weight, *, eps=1e-5, interpret=False)`;
statistics in float32 whatever the input dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._common import pallas_call, pltriton
from pallas_kernels.vma import match_varying, out_struct


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows per program (a power of two, as Triton needs), capped so that a block holds at most `max_elements`
    values of the row width rounded up to a power of two. Rows that do not fill the last block are padded."""

    block_rows: int = 128
    max_elements: int = 16384

    def for_shape(self, rows: int, width: int) -> int:
        if self.block_rows <= 0 or self.block_rows & (self.block_rows - 1) or self.max_elements <= 0:
            raise ValueError(
                f"block_rows={self.block_rows} must be a positive power of two and max_elements="
                f"{self.max_elements} positive"
            )
        fit = max(1, self.max_elements // width)
        return min(self.block_rows, 1 << (fit.bit_length() - 1), pl.next_power_of_2(rows))  # powers of two


def layer_norm_reference(x, weight, bias, *, eps: float = 1e-5):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(
        x.dtype
    )


def rms_norm_reference(x, weight, *, eps: float = 1e-5):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + eps) * weight.astype(jnp.float32)).astype(
        x.dtype
    )


def _row_block(ref, width):
    """The block's rows over `width` >= D columns (a power of two, as Triton needs): columns past D read 0."""
    D = ref.shape[-1]
    if width == D:
        return ref[...]
    cols = jax.lax.broadcasted_iota(jnp.int32, (ref.shape[0], width), 1)
    return pltriton.load(ref.at[:, pl.ds(0, width)], mask=cols < D, other=0)


def _vector(ref, width):
    D = ref.shape[0]
    if width == D:
        return ref[...]
    return pltriton.load(ref.at[pl.ds(0, width)], mask=jnp.arange(width) < D, other=0)


def _store_rows(ref, value, width):
    if width == ref.shape[-1]:
        ref[...] = value
    else:
        cols = jax.lax.broadcasted_iota(jnp.int32, value.shape, 1)
        pltriton.store(ref.at[:, pl.ds(0, width)], value, mask=cols < ref.shape[-1])


def _fwd_kernel(ids, x_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref, *, eps, width, rms):
    D = x_ref.shape[-1]
    x = _row_block(x_ref, width).astype(jnp.float32)  # [rows, width], zero past D
    real = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < D
    mean = jnp.zeros(x.shape[:1], jnp.float32) if rms else x.sum(axis=-1) / D  # RMSNorm: no centring
    xc = jnp.where(real, x - mean[:, None], 0.0)
    rstd = jax.lax.rsqrt((xc * xc).sum(axis=-1) / D + eps)
    y = xc * rstd[:, None] * _vector(w_ref, width).astype(jnp.float32) + _vector(b_ref, width).astype(jnp.float32)
    _store_rows(y_ref, y.astype(y_ref.dtype), width)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def _bwd_kernel(ids, x_ref, w_ref, mean_ref, rstd_ref, dy_ref, dx_ref, dw_ref, db_ref, *, width, rms):
    D = x_ref.shape[-1]
    x = _row_block(x_ref, width).astype(jnp.float32)
    dy = _row_block(dy_ref, width).astype(jnp.float32)  # zero on padded rows (and past D)
    rstd = rstd_ref[...]
    xhat = (x - mean_ref[...][:, None]) * rstd[:, None]
    g = dy * _vector(w_ref, width).astype(jnp.float32)  # zero past D (dy is)
    centred = 0.0 if rms else g.sum(axis=-1, keepdims=True) / D  # the mean's gradient (LayerNorm only)
    dx = rstd[:, None] * (g - centred - xhat * (g * xhat).sum(axis=-1, keepdims=True) / D)
    _store_rows(dx_ref, dx.astype(dx_ref.dtype), width)
    _store_rows(dw_ref, (dy * xhat).sum(axis=0)[None, :], width)
    _store_rows(db_ref, dy.sum(axis=0)[None, :], width)


def _specs(rows, D, block):
    return (
        pl.BlockSpec((block, D), lambda i: (i, 0)),
        pl.BlockSpec((D,), lambda i: (0,)),
        pl.BlockSpec((block,), lambda i: (i,)),
        pl.BlockSpec((1, D), lambda i: (i, 0)),
    )


def _forward(x2, w, b, eps, block, interpret, rms=False):
    rows, D = x2.shape
    mat, vec_d, vec_rows, _ = _specs(rows, D, block)
    return pallas_call(
        functools.partial(_fwd_kernel, eps=eps, width=pl.next_power_of_2(D), rms=rms),
        grid=(rows // block,),
        in_specs=[mat, vec_d, vec_d],
        out_specs=[mat, vec_rows, vec_rows],
        out_shape=[
            out_struct(x2.shape, x2.dtype, x2),
            out_struct((rows,), jnp.float32, x2),
            out_struct((rows,), jnp.float32, x2),
        ],
        interpret=interpret,
        name="rms_norm_fwd" if rms else "layer_norm_fwd",
    )(x2, w, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _layer_norm(x2, w, b, eps, block, interpret, rms):
    return _forward(x2, w, b, eps, block, interpret, rms)[0]


def _layer_norm_fwd(x2, w, b, eps, block, interpret, rms):
    y, mean, rstd = _forward(x2, w, b, eps, block, interpret, rms)
    return y, (x2, w, b, mean, rstd)


def _layer_norm_bwd(eps, block, interpret, rms, residuals, dy):
    x2, w, b, mean, rstd = residuals
    rows, D = x2.shape
    mat, vec_d, vec_rows, partial = _specs(rows, D, block)
    n = rows // block
    dx, dw_parts, db_parts = pallas_call(
        functools.partial(_bwd_kernel, width=pl.next_power_of_2(D), rms=rms),
        grid=(n,),
        in_specs=[mat, vec_d, vec_rows, vec_rows, mat],
        out_specs=[mat, partial, partial],
        out_shape=[
            out_struct(x2.shape, x2.dtype, x2),
            out_struct((n, D), jnp.float32, x2),
            out_struct((n, D), jnp.float32, x2),
        ],
        interpret=interpret,
        name="rms_norm_bwd" if rms else "layer_norm_bwd",
    )(x2, w, mean, rstd, dy)
    return dx, dw_parts.sum(0).astype(w.dtype), db_parts.sum(0).astype(b.dtype)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def layer_norm(x, weight, bias, *, eps: float = 1e-5, block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
    """LayerNorm of x [..., D] with weight and bias [D]; differentiable (custom VJP)."""
    D = x.shape[-1]
    if weight.shape != (D,) or bias.shape != (D,):
        raise ValueError(f"weight.shape={weight.shape} and bias.shape={bias.shape} must be ({D},) for {x.shape=}")
    x, weight, bias = match_varying(x, weight, bias)
    x2 = x.reshape(-1, D)
    rows = x2.shape[0]
    block = block_sizes.for_shape(rows, pl.next_power_of_2(D))
    padded = -(-rows // block) * block  # zero rows: normalised harmlessly, sliced off, no gradient
    if padded != rows:
        x2 = jnp.pad(x2, ((0, padded - rows), (0, 0)))
    return _layer_norm(x2, weight, bias, float(eps), block, interpret, False)[:rows].reshape(x.shape)


def rms_norm(x, weight, *, eps: float = 1e-5, block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
    """RMSNorm of x [..., D] with weight [D]: x / sqrt(mean(x²) + eps) · weight (Llama's); differentiable. The
    LayerNorm kernels without the centring, with a zero shift (whose gradient is dropped)."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight.shape={weight.shape} must be ({D},) for {x.shape=}")
    x, weight = match_varying(x, weight)
    x2 = x.reshape(-1, D)
    rows = x2.shape[0]
    block = block_sizes.for_shape(rows, pl.next_power_of_2(D))
    padded = -(-rows // block) * block
    if padded != rows:
        x2 = jnp.pad(x2, ((0, padded - rows), (0, 0)))
    shift = jnp.zeros_like(weight)
    return _layer_norm(x2, weight, shift, float(eps), block, interpret, True)[:rows].reshape(x.shape)
