"""Tensor (intra-layer) model parallelism, paper §2.3, written explicitly for `jax.shard_map` bodies.

Everything here runs on one device's shard; the only communication is over the "tensor" mesh axis:
- Megatron's `f` (identity forward, all-reduce backward) before each column-parallel linear and `g` (all-reduce
  forward, identity backward) after each row-parallel linear: 2 all-reduces per layer forward, 2 backward.
- Attention heads split over tensor (QKV column-parallel, output projection row-parallel); MLP fc1
  column-parallel, fc2 row-parallel.
- Vocab-parallel embedding (each rank holds Vp/t rows, out-of-range ids masked, one all-reduce) and
  vocab-parallel cross-entropy (max, sum-exp and target logit reduced over tensor; full logits never gathered).
- Sequence parallelism (Korthikanti et al. 2022): LayerNorm/dropout regions hold S/t tokens; `f` becomes an
  all-gather along the sequence (reduce-scatter backward) and `g` a reduce-scatter (all-gather backward).

The f/g operators lean on shard_map's varying-manual-axes typing (`vma.py`): `psum` of a tensor-varying value
transposes to a no-op, and marking an invariant value varying (`pcast`) transposes to a `psum`. They are written
as named functions so that each collective the paper names appears once, by name, in this file.

Local shape legend: B batch, S sequence (S/t under sequence parallelism: "Sl"), D hidden, H heads (H/t local:
"Hl"), K head dim, F ffn (F/t local: "Fl"), V vocabulary (Vp/t local: "Vl").
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig
from ptd_jax.parallel import context
from ptd_jax.parallel.mesh import Axis
from ptd_jax.parallel.vma import mark_varying, varying_axes

TENSOR = Axis.TENSOR.value
SEQ_DIM = 1  # activations are [B, S, D]


# ---------------------------------------------------------------------------------------------------------------
# Megatron's conjugate operators (paper §2.3, Figure 3)
# ---------------------------------------------------------------------------------------------------------------


def copy_to_tensor_region(x_BxSxD):
    """`f`: identity in the forward pass, all-reduce over tensor in the backward pass (enters a TP region)."""
    return mark_varying(x_BxSxD, (TENSOR,))


def reduce_from_tensor_region(x_BxSxD):
    """`g`: all-reduce over tensor in the forward pass, identity in the backward pass (leaves a TP region)."""
    return jax.lax.psum(x_BxSxD, TENSOR)


def gather_from_sequence_region(x_BxSlxD):
    """Sequence-parallel `f`: all-gather the sequence forward, reduce-scatter it backward."""
    return jax.lax.all_gather(x_BxSlxD, TENSOR, axis=SEQ_DIM, tiled=True)


def reduce_scatter_to_sequence_region(x_BxSxD):
    """Sequence-parallel `g`: reduce-scatter along the sequence forward, all-gather backward."""
    return jax.lax.psum_scatter(x_BxSxD, TENSOR, scatter_dimension=SEQ_DIM, tiled=True)


def enter_tensor_region(x, sequence_parallel: bool):
    return gather_from_sequence_region(x) if sequence_parallel else copy_to_tensor_region(x)


def leave_tensor_region(x, sequence_parallel: bool):
    return reduce_scatter_to_sequence_region(x) if sequence_parallel else reduce_from_tensor_region(x)


# ---------------------------------------------------------------------------------------------------------------
# Layers on local shards
# ---------------------------------------------------------------------------------------------------------------

# A layer's four matmuls, by name: the einsum of each (input, kernel). `dot` runs one; with a tap in the parameters
# (`<name>_tap`, a split backward's) its backward gives the input gradient only, and hands the tap what the kernel's
# gradient needs (`tap_weight_grads` makes it later: a zero-bubble W): "x", the matmul's input, and "g", its output
# gradient. Without sequence parallelism both are taken where they are replicated over tensor, as the residual
# stream is: a column-parallel matmul's input before `f`, a row-parallel one's output gradient after `g` (the same
# values, typed like the layer's saved activations, so that the pipeline keeps them in the same buffers). A tap
# without "x" on fc2 makes W recompute fc2's input from fc1's (`fc2_input`).
DOTS = {"qkv": "bsd,dgrk->bsgrk", "out": "bshk,hkd->bsd", "fc1": "bsd,df->bsf", "fc2": "bsf,fd->bsd"}
SWIGLU_FC1 = "bsd,dtf->bstf"
"""fc1 of a SwiGLU MLP: the kernel [D, 2, F] gives [gate, up] at once."""


def dot_spec(name: str, kernel) -> str:
    """The einsum of matmul `name` for this kernel (SwiGLU's fc1 kernel has one dim more)."""
    return SWIGLU_FC1 if name == "fc1" and kernel.ndim == 3 else DOTS[name]


def spec_operands(spec: str) -> tuple[str, str, str]:
    """(input, kernel, output) index strings of a matmul's einsum "input,kernel->output"."""
    x_spec, rest = spec.split(",")
    kernel_spec, out_spec = rest.split("->")
    return x_spec, kernel_spec, out_spec


TAP_SHAPES: dict | None = None
"""Set to {} by `pipeline.stash.Taps.trace` while it traces a layer: name -> {"x", "g"} -> the type each tap takes."""


def _record_tap(name: str, key: str, a) -> None:
    if TAP_SHAPES is not None:  # types only: `a` may belong to an inner trace (a checkpointed layer's)
        struct = jax.ShapeDtypeStruct(a.shape, a.dtype)
        TAP_SHAPES.setdefault(name, {})[key] = (struct, tuple(sorted(varying_axes(a))))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tapped_dot(spec, keys, x, w, kept, tap):
    return jnp.einsum(spec, x, w)


def _tapped_dot_fwd(spec, keys, x, w, kept, tap):
    return jnp.einsum(spec, x, w), (w, kept if "x" in keys else None)  # fc2 without "x" keeps only its kernel


def _tapped_dot_bwd(spec, keys, res, g):
    w, kept = res
    inputs, out = spec.split("->")
    x_dims, w_dims = inputs.split(",")
    dx = jnp.einsum(f"{out},{w_dims}->{x_dims}", g, w)  # the input gradient alone; the kernel's waits for W
    taken = {"x": kept, "g": g}
    return dx, jnp.zeros_like(w), None if kept is None else jnp.zeros_like(kept), {k: taken[k] for k in keys}


_tapped_dot.defvjp(_tapped_dot_fwd, _tapped_dot_bwd)


@jax.custom_vjp
def _gradient_tap(y, tap):
    return y


def _gradient_tap_fwd(y, tap):
    return y, None


def _gradient_tap_bwd(_, g):
    return g, g


_gradient_tap.defvjp(_gradient_tap_fwd, _gradient_tap_bwd)


def dot(p, name: str, x, tap_x=None, tap_g: bool = True):
    """Matmul `name` of the layer (`DOTS`) on x with `p[name + "_kernel"]`, tapped where `p` holds a tap. `tap_x`:
    the value the tap keeps as the input (default x itself); `tap_g`: the tap takes the output gradient here (else
    the caller takes it, with `gradient_tap`)."""
    tap, kernel = p.get(f"{name}_tap"), p[f"{name}_kernel"]
    kept = x if tap_x is None else tap_x
    _record_tap(name, "x", kept)
    if tap is None:
        y = jnp.einsum(dot_spec(name, kernel), x, kernel)
    else:
        keys = tuple(k for k in ("x", "g") if k in tap and (k == "x" or tap_g))
        y = _tapped_dot(dot_spec(name, kernel), keys, x, kernel, kept, {k: tap[k] for k in keys})
    if tap_g:
        _record_tap(name, "g", y)
    return y


def gradient_tap(p, name: str, y, here: bool = True):
    """y; where `here` and `p` holds matmul `name`'s tap, the tap takes y's cotangent as the output gradient."""
    if not here:
        return y
    _record_tap(name, "g", y)
    tap = p.get(f"{name}_tap")
    return y if tap is None else _gradient_tap(y, tap["g"])


def tap_weight_grad(name: str, tap, kernel):
    """The kernel gradient of matmul `name` from its tap's (input, output gradient): what its backward skipped."""
    spec = dot_spec(name, kernel)
    # a gradient taken after `g` is replicated; the matmul's own output gradient is the same value, typed varying
    g = mark_varying(tap["g"], tuple(sorted(varying_axes(tap["x"]) | varying_axes(kernel))))
    # The einsum of the input and the output gradient written out, not `jax.linear_transpose` of the forward one:
    # the same sum, but XLA:CPU ran the transpose's operand order as a plain dot at half the speed of its fast
    # matmul (experiments/README.md, "Zero-bubble step time"). Summed, as the transpose does, over the mesh axes x
    # varies over and the kernel does not; an output gradient varying elsewhere is a typing error, as it was there.
    x_spec, kernel_spec, out_spec = spec_operands(spec)
    d = jnp.einsum(f"{x_spec},{out_spec}->{kernel_spec}", tap["x"], g)
    over = tuple(sorted(varying_axes(tap["x"]) - varying_axes(kernel)))
    assert varying_axes(d) - varying_axes(kernel) == set(over), f"{name}'s output gradient varies where x does not"
    return (jax.lax.psum(d, over) if over else d).astype(kernel.dtype)


def mlp_hidden(p, fc1_out, cfg: ModelConfig):
    """fc2's input from fc1's output: its bias and the activation."""
    return gpt.activation(gpt.bias(p, "fc1_bias", fc1_out), cfg)


def fc2_input(p, fc1_x, cfg: ModelConfig):
    """fc2's input recomputed from fc1's (a W whose fc2 tap keeps no input: one matmul instead of F/t per token)."""
    kernel = p["fc1_kernel"]
    return mlp_hidden(p, jnp.einsum(dot_spec("fc1", kernel), fc1_x, kernel), cfg)


def tap_weight_grads(p, taps: dict, cfg: ModelConfig, groups: dict) -> dict:
    """Every tapped kernel's gradient, {group: {"<name>_kernel": ...}}, from a layer's taps (`groups`: matmul name ->
    its parameter group)."""
    out = {g: {} for g in groups.values()}
    for name, group in groups.items():
        tap = taps[name]
        x = tap["x"] if "x" in tap else fc2_input(p["mlp"], taps["fc1"]["x"], cfg)
        out[group][f"{name}_kernel"] = tap_weight_grad(name, {"x": x, "g": tap["g"]}, p[group][f"{name}_kernel"])
    return out


def attention(p, x, cfg: ModelConfig, sequence_parallel: bool, key=None, recompute: str = "none"):
    """Column-parallel QKV (local query groups), causal attention on local heads, row-parallel output projection."""
    x_BxSxD = enter_tensor_region(x, sequence_parallel)
    qkv_BxSxGlxR2xK = gpt.bias(p, "qkv_bias", dot(p, "qkv", x_BxSxD, None if sequence_parallel else x))
    q, k, v = gpt.split_qkv(qkv_BxSxGlxR2xK, context.local_positions(x_BxSxD.shape[SEQ_DIM]), cfg)
    key = _per_tensor_rank(key)  # each rank holds other heads: its own dropout stream, as Megatron's RNG tracker
    ctx_BxSxGlxRxK = gpt.core_attention(q, k, v, cfg, key, recompute)
    B, S, Gl, R, K = ctx_BxSxGlxRxK.shape
    partial_BxSxD = dot(p, "out", ctx_BxSxGlxRxK.reshape(B, S, Gl * R, K), tap_g=sequence_parallel)
    y_BxSxD = gradient_tap(p, "out", leave_tensor_region(partial_BxSxD, sequence_parallel), not sequence_parallel)
    return gpt.bias(p, "out_bias", y_BxSxD)


def mlp(p, x, cfg: ModelConfig, sequence_parallel: bool):
    """Column-parallel fc1 (F/t local columns; SwiGLU: F/t of the gate and of the up projection) + the activation,
    row-parallel fc2."""
    x_BxSxD = enter_tensor_region(x, sequence_parallel)
    h_BxSxFl = mlp_hidden(p, dot(p, "fc1", x_BxSxD, None if sequence_parallel else x), cfg)
    y_BxSxD = leave_tensor_region(dot(p, "fc2", h_BxSxFl, tap_g=sequence_parallel), sequence_parallel)
    return gpt.bias(p, "fc2_bias", gradient_tap(p, "fc2", y_BxSxD, not sequence_parallel))


def _per_tensor_rank(key):
    return None if key is None else jax.random.fold_in(key, jax.lax.axis_index(TENSOR))


def transformer_layer(p, x, cfg: ModelConfig, sequence_parallel: bool, key=None, recompute: str = "none"):
    """The pre-LN block of `model.transformer_layer` with TP attention and MLP ([B, S or Sl, D] in and out).
    Hidden dropout acts on replicated activations (same mask on every tensor rank) or, under sequence
    parallelism, on a rank's own tokens (its own mask)."""
    k_attn, k_h1, k_h2 = jax.random.split(key, 3) if key is not None else (None, None, None)
    if sequence_parallel:
        k_h1, k_h2 = _per_tensor_rank(k_h1), _per_tensor_rank(k_h2)
    k_h1, k_h2 = context.per_rank_key(k_h1), context.per_rank_key(k_h2)  # a context rank's own tokens
    h = attention(p["attn"], gpt.norm(x, p["ln1"], cfg), cfg, sequence_parallel, k_attn, recompute)
    x = x + gpt.dropout(h, cfg.hidden_dropout, k_h1)
    h = mlp(p["mlp"], gpt.norm(x, p["ln2"], cfg), cfg, sequence_parallel)
    return x + gpt.dropout(h, cfg.hidden_dropout, k_h2)


def run_layers(
    layers, x, cfg: ModelConfig, sequence_parallel: bool, *, key=None, recompute: str = "none", first_layer=0
):
    """Scan the stacked local layer shards, with the same recomputation options as the reference. Layer j draws
    its dropout masks from fold_in(key, first_layer + j), so a pipeline chunk draws the masks of the same layers
    in the whole stack."""
    num = jax.tree.leaves(layers)[0].shape[0]
    layer_fn = gpt.remat_layer(lambda p, h, k: transformer_layer(p, h, cfg, sequence_parallel, k, recompute), recompute)

    def body(h, xs):
        p, index = xs
        return layer_fn(p, h, jax.random.fold_in(key, index) if key is not None else None), None

    x, _ = jax.lax.scan(body, x, (layers, first_layer + jnp.arange(num)))
    return x


def vocab_parallel_embed(params, tokens_BxS, cfg: ModelConfig, sequence_parallel: bool, key=None):
    """Word rows [Vl, D] of this rank: look up ids in [rank·Vl, (rank+1)·Vl), zero the others, all-reduce
    (reduce-scatter along the sequence under sequence parallelism); then add positions."""
    word_VlxD = params["embed"]["word"]
    vocab_local = word_VlxD.shape[0]
    local_ids_BxS = tokens_BxS - jax.lax.axis_index(TENSOR) * vocab_local
    in_range_BxS = (local_ids_BxS >= 0) & (local_ids_BxS < vocab_local)
    rows_BxSxD = jnp.take(word_VlxD, jnp.where(in_range_BxS, local_ids_BxS, 0), axis=0)
    rows_BxSxD = jnp.where(in_range_BxS[..., None], rows_BxSxD, jnp.zeros_like(rows_BxSxD))
    S = tokens_BxS.shape[1]
    learned = "position" in params["embed"]  # RoPE rotates q and k in the layers instead
    position_SxD = params["embed"]["position"][:S] if learned else None
    if learned and context.active() is not None:  # this context rank's chunks (`context.local_positions`)
        position_SxD = jnp.take(params["embed"]["position"], context.local_positions(S), axis=0)
    if sequence_parallel:
        x = reduce_scatter_to_sequence_region(rows_BxSxD)
        seq_local = x.shape[SEQ_DIM]
        if learned:
            x = x + jax.lax.dynamic_slice_in_dim(position_SxD, jax.lax.axis_index(TENSOR) * seq_local, seq_local)
    else:
        x = reduce_from_tensor_region(rows_BxSxD)
        if learned:
            x = x + position_SxD
    key = context.per_rank_key(_per_tensor_rank(key) if sequence_parallel else key)
    return gpt.dropout(x.astype(jnp.dtype(cfg.dtype)), cfg.hidden_dropout, key)


def vocab_parallel_logits(params, x, cfg: ModelConfig, sequence_parallel: bool):
    """Final norm, then the output layer (tied or untied) on this rank's vocabulary rows: logits [B, S, Vl]."""
    x = gpt.norm(x, params["final_ln"], cfg)
    x_BxSxD = enter_tensor_region(x, sequence_parallel)
    word_VlxD = gpt.output_weight(params).astype(x_BxSxD.dtype)
    return jnp.einsum("bsd,vd->bsv", x_BxSxD, word_VlxD, preferred_element_type=gpt.logits_dtype(x_BxSxD.dtype, cfg))


def vocab_parallel_cross_entropy(logits_BxSxVl, labels_BxS, vocab_size: int, fused: bool = False):
    """-log softmax(logits)[label] with the vocabulary split over tensor: three all-reduces of B·S scalars
    (max, sum of exponentials, target logit). Padded ids (>= vocab_size) never enter the normaliser.
    `fused`: the Pallas kernel computes the three per-shard statistics, the same three all-reduces combine them."""
    vocab_local = logits_BxSxVl.shape[-1]
    start = jax.lax.axis_index(TENSOR) * vocab_local
    if fused:
        from pallas_kernels import softmax_cross_entropy

        B, S = labels_BxS.shape
        losses = softmax_cross_entropy(
            logits_BxSxVl.reshape(B * S, vocab_local),
            labels_BxS.reshape(B * S),
            vocab_size=vocab_size,
            vocab_start=start,
            axis_name=TENSOR,
            interpret=gpt.interpret_kernels(),
        )
        return losses.reshape(B, S)
    logits = logits_BxSxVl.astype(gpt.acc_dtype(logits_BxSxVl.dtype))
    valid_Vl = start + jnp.arange(vocab_local) < vocab_size
    logits = jnp.where(valid_Vl, logits, -jnp.inf)
    # The max only stabilises exp(); it has no gradient (the result does not depend on it).
    max_BxS = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), TENSOR)
    sum_exp_BxS = jax.lax.psum(jnp.sum(jnp.exp(logits - max_BxS[..., None]), axis=-1), TENSOR)
    local_labels_BxS = labels_BxS - start
    in_range_BxS = (local_labels_BxS >= 0) & (local_labels_BxS < vocab_local)
    target_BxS = jnp.take_along_axis(logits, jnp.where(in_range_BxS, local_labels_BxS, 0)[..., None], -1)[..., 0]
    target_BxS = jax.lax.psum(jnp.where(in_range_BxS, target_BxS, 0.0), TENSOR)
    return jnp.log(sum_exp_BxS) + max_BxS - target_BxS


def loss_sum(
    params,
    tokens_BxS,
    labels_BxS,
    mask_BxS,
    cfg: ModelConfig,
    *,
    sequence_parallel: bool = False,
    key=None,
    recompute: str = "none",
):
    """Sum of masked token losses of this data rank's microbatch, computed tensor-parallel on local shards.
    Equals `model.loss_sum` on the unsharded parameters."""
    params = gpt.cast_params(params, cfg)
    k_embed, k_layers = jax.random.split(key) if key is not None else (None, None)
    x = vocab_parallel_embed(params, tokens_BxS, cfg, sequence_parallel, k_embed)
    x = run_layers(params["layers"], x, cfg, sequence_parallel, key=k_layers, recompute=recompute)
    logits_BxSxVl = vocab_parallel_logits(params, x, cfg, sequence_parallel)
    losses_BxS = vocab_parallel_cross_entropy(logits_BxSxVl, labels_BxS, cfg.vocab_size, cfg.fused_kernels)
    return jnp.sum(jnp.where(mask_BxS > 0, losses_BxS, 0.0))
