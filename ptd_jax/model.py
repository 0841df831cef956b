"""Megatron's GPTModel as pure functions over a parameter pytree: GPT-2 by default, the Llama family by switches.

GPT-2 (the defaults): learned position embeddings, pre-LayerNorm blocks, causal multi-head attention, a 4h GeLU
MLP, a final LayerNorm and an output layer tied to the word embedding (paper §2, Megatron-LM `GPTModel`). The
switches of `ModelConfig` make the same transformer Llama 2/3, Mistral or Qwen2: RMSNorm, SwiGLU, rotary position
embeddings (half-split or interleaved, Llama 3.1's scaling), grouped-query attention (G key/value heads, each
shared by R = H/G query heads), a head dim of its own, an untied output layer, no biases (or QKV biases only), a
sliding attention window.

Parameter layout (docs/architecture.md, "Parameters"): the transformer layers are *stacked* along a leading
layer dim L so that (a) one `lax.scan` runs them (on XLA:CPU, half the step time and about a quarter of the compile
time of unrolled layers), (b) the pipeline can reshape L into [v, p, k] chunks
(`parallel/sharding.py`), and (c) tensor parallelism splits a named dim of each weight without renaming anything:

    embed/word          [Vp, D]          split Vp over "tensor" (vocab-parallel embedding and tied output)
    embed/position      [S, D]           learned_absolute only
    layers/ln1/{scale,bias}   [L, D]     RMSNorm: scale only
    layers/attn/qkv_kernel    [L, D, G, R+2, K]   column-parallel: split G; per group its R query heads, then
                                                  its key and its value head (Megatron's fused-QKV layout)
    layers/attn/qkv_bias      [L, G, R+2, K]      with biases
    layers/attn/out_kernel    [L, H, K, D]      row-parallel: split H (head g·R + r is query head r of group g)
    layers/attn/out_bias      [L, D]
    layers/ln2/{scale,bias}   [L, D]
    layers/mlp/fc1_kernel     [L, D, F]         column-parallel: split F; SwiGLU: [L, D, 2, F] ([gate, up])
    layers/mlp/fc1_bias       [L, F]            SwiGLU: [L, 2, F]
    layers/mlp/fc2_kernel     [L, F, D]         row-parallel: split F
    layers/mlp/fc2_bias       [L, D]
    final_ln/{scale,bias}     [D]
    output/word               [Vp, D]           untied output layer only

Shape legend: B batch, S sequence, D hidden, F ffn, H heads, G key/value heads (query groups), R = H/G,
K head dim, V vocabulary, L layers.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ptd_jax.config import ModelConfig

Params = dict[str, Any]


def acc_dtype(dtype):
    """Accumulation dtype: float32 for 16-bit inputs, the input's own for float32/float64 (exactness tests)."""
    return jnp.promote_types(dtype, jnp.float32)


# ---------------------------------------------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------------------------------------------


def init_params(key: jax.Array, cfg: ModelConfig, tensor_parallel_size: int = 1) -> Params:
    """Megatron's init: N(0, 0.02) weights, output projections N(0, 0.02/sqrt(2l)), zero biases, unit LN scales.

    Every layer draws from its own `fold_in(key, layer)` stream, so a layer's weights do not depend on how many
    layers there are or how they are later split over devices. The word embedding has
    `cfg.padded_vocab_size(tensor_parallel_size)` rows: the V real rows are drawn independently of the padding
    and the padded rows are zero (they are never looked up and never enter the loss), so every t starts from
    the same real weights.
    """
    pdt = jnp.dtype(cfg.param_dtype)
    L, D, H, K, F = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.ffn_size
    G = cfg.num_groups
    R = H // G
    std = cfg.init_method_std
    out_std = std / math.sqrt(2.0 * L)
    k_word, k_pos, k_layers = jax.random.split(key, 3)

    def normal(k, shape, scale):
        return (scale * jax.random.normal(k, shape, dtype=jnp.float32)).astype(pdt)

    def with_bias(kernels: dict, biases: dict, add: bool) -> dict:
        return {**kernels, **biases} if add else kernels

    def one_layer(k):
        k_qkv, k_out, k_fc1, k_fc2 = jax.random.split(k, 4)
        # drawn [D, R+2, G, K] and turned to [D, G, R+2, K]: GPT-2 (G = H, R = 1) keeps its [D, 3, H, K] draws
        qkv = normal(k_qkv, (D, R + 2, G, K), std).transpose(0, 2, 1, 3)
        up = (D, 2, F) if cfg.swiglu else (D, F)
        return {
            "ln1": norm_params(D, cfg, pdt),
            "attn": with_bias({"qkv_kernel": qkv}, {"qkv_bias": jnp.zeros((G, R + 2, K), pdt)}, cfg.qkv_bias)
            | with_bias(
                {"out_kernel": normal(k_out, (H, K, D), out_std)},
                {"out_bias": jnp.zeros((D,), pdt)},
                cfg.add_bias_linear,
            ),
            "ln2": norm_params(D, cfg, pdt),
            "mlp": with_bias(
                {"fc1_kernel": normal(k_fc1, up, std), "fc2_kernel": normal(k_fc2, (F, D), out_std)},
                {"fc1_bias": jnp.zeros(up[1:], pdt), "fc2_bias": jnp.zeros((D,), pdt)},
                cfg.add_bias_linear,
            ),
        }

    layer_keys = jnp.stack([jax.random.fold_in(k_layers, i) for i in range(L)])
    padding = cfg.padded_vocab_size(tensor_parallel_size) - cfg.vocab_size

    def vocab_rows(k):
        return jnp.concatenate([normal(k, (cfg.vocab_size, D), std), jnp.zeros((padding, D), pdt)])

    embed = {"word": vocab_rows(k_word)}
    if cfg.position_embedding_type == "learned_absolute":
        embed["position"] = normal(k_pos, (cfg.max_positions, D), std)
    params = {"embed": embed, "layers": jax.vmap(one_layer)(layer_keys), "final_ln": norm_params(D, cfg, pdt)}
    if cfg.untie_embeddings_and_output_weights:
        params["output"] = {"word": vocab_rows(jax.random.fold_in(key, 1))}
    return params


def norm_params(D: int, cfg: ModelConfig, dtype) -> dict:
    """A LayerNorm's scale and bias, or an RMSNorm's scale."""
    scale = {"scale": jnp.ones((D,), dtype)}
    return scale if cfg.normalization == "RMSNorm" else {**scale, "bias": jnp.zeros((D,), dtype)}


def count_params(params: Params) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))


# ---------------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------------

_KERNEL_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("kernel_platform", default=None)


@contextlib.contextmanager
def kernels_for(platform: str):
    """Trace the Pallas kernels for `platform` ("gpu": compiled by Triton) whatever this process's backend is:
    what compiling for a GPU that is not here needs (`aot/compile.py`)."""
    token = _KERNEL_PLATFORM.set(platform)
    try:
        yield
    finally:
        _KERNEL_PLATFORM.reset(token)


def interpret_kernels() -> bool:
    """Pallas kernels run interpreted where there is no GPU to compile them for."""
    return (_KERNEL_PLATFORM.get() or jax.default_backend()) == "cpu"


def layer_norm(x_BxSxD, p, eps: float, fused: bool = False):
    """LayerNorm over the last dim, statistics in float32 whatever the compute dtype (`fused`: the Pallas
    kernel)."""
    if fused:
        from pallas_kernels import layer_norm as fused_layer_norm

        return fused_layer_norm(x_BxSxD, p["scale"], p["bias"], eps=eps, interpret=interpret_kernels())
    acc = acc_dtype(x_BxSxD.dtype)
    x = x_BxSxD.astype(acc)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(acc) + p["bias"].astype(acc)).astype(x_BxSxD.dtype)


def rms_norm(x_BxSxD, p, eps: float):
    """RMSNorm over the last dim (Llama's): x / sqrt(mean(x²) + eps) · scale, statistics in float32."""
    acc = acc_dtype(x_BxSxD.dtype)
    x = x_BxSxD.astype(acc)
    y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps)
    return (y * p["scale"].astype(acc)).astype(x_BxSxD.dtype)


def norm(x_BxSxD, p, cfg: ModelConfig):
    """The configured normalization, LayerNorm or RMSNorm (each the Pallas kernel with `fused_kernels`)."""
    if cfg.normalization == "RMSNorm":
        if cfg.fused_kernels:
            from pallas_kernels import rms_norm as fused_rms_norm

            return fused_rms_norm(x_BxSxD, p["scale"], eps=cfg.layernorm_epsilon, interpret=interpret_kernels())
        return rms_norm(x_BxSxD, p, cfg.layernorm_epsilon)
    return layer_norm(x_BxSxD, p, cfg.layernorm_epsilon, cfg.fused_kernels)


def gelu(x, approximate: bool):
    return jax.nn.gelu(x, approximate=approximate)


def rotary_frequencies(cfg: ModelConfig, dtype=jnp.float32):
    """The inverse frequencies base^(-2i/r) of the r = `rotary_dim` rotating dims, with Llama 3.1's scaling where
    asked: wavelengths longer than original_max / low_freq_factor are stretched by the factor, shorter than
    original_max / high_freq_factor kept, and those between interpolated smoothly. Computed from an iota inside the
    trace (no array constant: a layer's backward recomputes it rather than stashing it)."""
    r = cfg.rotary_dim
    inv = cfg.rotary_base ** (-(2 * jnp.arange(r // 2, dtype=dtype)) / r)
    if not cfg.use_rope_scaling:
        return inv
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_max_position
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    between = (wavelen >= old / high) & (wavelen <= old / low)
    return jnp.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def apply_rotary(x_BxSx___xK, positions_S, cfg: ModelConfig):
    """Rotate the first `rotary_dim` dims of each head by position · frequency: the two halves (x_i, x_{i+r/2})
    (HF's `rotate_half`, Megatron's default) or, with `rotary_interleaved`, adjacent pairs (x_2i, x_2i+1), as Meta's
    original code; angles and products in float32 (float64 for float64 inputs)."""
    acc = acc_dtype(x_BxSx___xK.dtype)
    r = cfg.rotary_dim
    angles_SxR = positions_S.astype(acc)[:, None] * rotary_frequencies(cfg, acc)[None, :]
    shape = (1, angles_SxR.shape[0]) + (1,) * (x_BxSx___xK.ndim - 3) + (r // 2,)
    cos, sin = jnp.cos(angles_SxR).reshape(shape), jnp.sin(angles_SxR).reshape(shape)
    x = x_BxSx___xK.astype(acc)
    rot, rest = x[..., :r], x[..., r:]
    if cfg.rotary_interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated, rest], axis=-1).astype(x_BxSx___xK.dtype)


def dropout(x, rate: float, key):
    """Inverted dropout; identity when rate == 0 or key is None (evaluation)."""
    if rate == 0.0 or key is None:
        return x
    keep = checkpoint_name(jax.random.bernoulli(key, 1.0 - rate, x.shape), DROPOUT_MASK)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def visible(q_positions, k_positions, window_size: int | None = None):
    """[Q, S] mask of the keys each query sees: causal, and within the sliding window where there is one."""
    seen = k_positions[None, :] <= q_positions[:, None]
    if window_size is not None:
        seen &= k_positions[None, :] > q_positions[:, None] - window_size
    return seen


def causal_attention(
    q_BxSxGxRxK, k_BxSxGxK, v_BxSxGxK, *, dropout_rate: float = 0.0, key=None, backend: str = "xla", window_size=None
):
    """softmax(q kᵀ / sqrt(K) + causal mask) v for the R query heads of each of G key/value heads (grouped-query
    attention; R = 1 is multi-head), scores and softmax in float32: context [B, S, G, R, K]. The XLA path reads each
    key/value head once for its R queries. backend 'pallas' runs the fused flash-attention kernel (interpreted on
    CPU), whose query head h reads key/value head h // R in place; 'cudnn' jax.nn.dot_product_attention's cuDNN
    path (grouped natively). Each backend keeps a query to the `window_size` keys ending at its own, if given."""
    B, S, G, R, K = q_BxSxGxRxK.shape
    if backend in ("pallas", "cudnn"):
        q_BxSxHxK = q_BxSxGxRxK.reshape(B, S, G * R, K)
        if backend == "pallas":
            from pallas_kernels import flash_attention

            out = flash_attention(
                q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, causal=True, window_size=window_size, interpret=interpret_kernels()
            )
        else:  # cuDNN's window counts the keys left of the query: w - 1 of them, as the query sees itself too
            window = None if window_size is None else (window_size - 1, 0)
            out = jax.nn.dot_product_attention(
                q_BxSxHxK, k_BxSxGxK, v_BxSxGxK, is_causal=True, local_window_size=window, implementation="cudnn"
            )
        return out.reshape(B, S, G, R, K)
    acc = acc_dtype(q_BxSxGxRxK.dtype)
    scores_BxGxRxSxS = jnp.einsum("bqgrk,bsgk->bgrqs", q_BxSxGxRxK, k_BxSxGxK, preferred_element_type=acc) / math.sqrt(
        K
    )
    positions = jnp.arange(S)
    scores_BxGxRxSxS = jnp.where(visible(positions, positions, window_size), scores_BxGxRxSxS, jnp.finfo(acc).min)
    probs_BxGxRxSxS = jax.nn.softmax(scores_BxGxRxSxS, axis=-1)
    probs_BxGxRxSxS = dropout(probs_BxGxRxSxS, dropout_rate, key).astype(v_BxSxGxK.dtype)
    return checkpoint_name(jnp.einsum("bgrqs,bsgk->bqgrk", probs_BxGxRxSxS, v_BxSxGxK), ATTENTION_CONTEXT)


_ATTENTION_HOOK: contextvars.ContextVar = contextvars.ContextVar("attention_hook", default=None)


@contextlib.contextmanager
def attention_hook(fn):
    """Trace `core_attention` as fn(q, k, v, cfg, key) instead of `causal_attention`: how context parallelism
    (`parallel/context.py`, a layer above this module) attends across devices while tracing a step."""
    token = _ATTENTION_HOOK.set(fn)
    try:
        yield
    finally:
        _ATTENTION_HOOK.reset(token)


def core_attention(q_BxSxGxRxK, k_BxSxGxK, v_BxSxGxK, cfg: ModelConfig, key=None, recompute: str = "none"):
    """The attention core (scores, softmax, dropout, context). Under `selective` it, and only it, is recomputed
    in the backward, as Megatron's selective recomputation does: its inputs q, k, v (and the dropout key) are
    kept, everything outside it (the weight matmuls, LayerNorms, the tensor collectives) is stored as in `none`,
    so no collective is re-issued that `none` does not re-issue. Inside a layer under `remat_layer` its policy
    decides (an enclosing checkpoint's policy governs the nested one) and recomputes the same."""

    hook = _ATTENTION_HOOK.get()

    def core(q, k, v, key):
        if hook is not None:
            return checkpoint_name(hook(q, k, v, cfg, key), ATTENTION_CONTEXT)
        return causal_attention(
            q,
            k,
            v,
            dropout_rate=cfg.attention_dropout,
            key=key,
            backend=cfg.attention_backend,
            window_size=cfg.window_size,
        )

    return (jax.checkpoint(core) if recompute == "selective" else core)(q_BxSxGxRxK, k_BxSxGxK, v_BxSxGxK, key)


def bias(p, name: str, y):
    """y + p[name] where the layer has that bias (`add_bias_linear`, `add_qkv_bias`)."""
    return y + p[name] if name in p else y


def split_qkv(qkv_BxSxGxR2xK, positions_S, cfg: ModelConfig):
    """The fused projection's output [B, S, G, R+2, K] as q [B, S, G, R, K], k and v [B, S, G, K], q and k rotated
    at `positions_S` under RoPE."""
    R = qkv_BxSxGxR2xK.shape[3] - 2
    q, k, v = qkv_BxSxGxR2xK[:, :, :, :R], qkv_BxSxGxR2xK[:, :, :, R], qkv_BxSxGxR2xK[:, :, :, R + 1]
    if cfg.position_embedding_type == "rope":
        q, k = apply_rotary(q, positions_S, cfg), apply_rotary(k, positions_S, cfg)
    return q, k, v


def attention_block(p, x_BxSxD, cfg: ModelConfig, key=None, recompute: str = "none"):
    qkv = bias(p, "qkv_bias", jnp.einsum("bsd,dgrk->bsgrk", x_BxSxD, p["qkv_kernel"]))
    q, k, v = split_qkv(qkv, jnp.arange(x_BxSxD.shape[1]), cfg)
    ctx_BxSxGxRxK = core_attention(q, k, v, cfg, key, recompute)
    B, S, G, R, K = ctx_BxSxGxRxK.shape
    return bias(p, "out_bias", jnp.einsum("bshk,hkd->bsd", ctx_BxSxGxRxK.reshape(B, S, G * R, K), p["out_kernel"]))


def activation(h, cfg: ModelConfig):
    """The MLP's nonlinearity on fc1's output: GeLU of [..., F], or SwiGLU's silu(gate) · up of [..., 2, F]."""
    if cfg.swiglu:
        return jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
    return gelu(h, cfg.gelu_approximate)


def mlp_block(p, x_BxSxD, cfg: ModelConfig):
    spec = "bsd,dtf->bstf" if cfg.swiglu else "bsd,df->bsf"
    h_BxSxF = activation(bias(p, "fc1_bias", jnp.einsum(spec, x_BxSxD, p["fc1_kernel"])), cfg)
    return bias(p, "fc2_bias", h_BxSxF @ p["fc2_kernel"])


def transformer_layer(p, x_BxSxD, cfg: ModelConfig, key=None, recompute: str = "none"):
    """One pre-norm block: x + drop(attn(norm1(x))), then + drop(mlp(norm2(x)))."""
    k_attn, k_h1, k_h2 = jax.random.split(key, 3) if key is not None else (None, None, None)
    h = attention_block(p["attn"], norm(x_BxSxD, p["ln1"], cfg), cfg, k_attn, recompute)
    x_BxSxD = x_BxSxD + dropout(h, cfg.hidden_dropout, k_h1)
    h = mlp_block(p["mlp"], norm(x_BxSxD, p["ln2"], cfg), cfg)
    return x_BxSxD + dropout(h, cfg.hidden_dropout, k_h2)


RECOMPUTED_PRIMITIVES = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "neg",
        "max",
        "min",
        "abs",
        "sign",
        "rem",
        "exp",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
        "sin",
        "cos",
        "rsqrt",
        "sqrt",
        "square",
        "integer_pow",
        "pow",
        "erf",
        "select_n",
        "clamp",
        "and",
        "or",
        "not",
        "xor",
        "shift_left",
        "shift_right_logical",
        "shift_right_arithmetic",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "convert_element_type",
        "bitcast_convert_type",
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "slice",
        "concatenate",
        "pad",
        "iota",
        "copy",
        "copy_p",
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "stop_gradient",
        "pvary",
        "pcast",
        "axis_index",
    }
)
"""Elementwise, layout and reduction primitives: what a layer recomputes in its backward under none and selective
(`remat_layer`); and `axis_index`, free to recompute (kept, a context rank's index would be a residual that varies
over "context" alone, which the pipeline's record, typed like the activations, cannot hold). Everything else is
kept: the outputs of matmuls, collectives (but the all-gather below) and random bits, and the values named below."""
REGATHERED_PRIMITIVES = frozenset({"all_gather"})
"""Sequence parallelism's all-gather (`parallel.tensor.gather_from_sequence_region`, the only all-gather inside a
layer): its output, the whole sequence [B, S, D] of a LayerNorm's output, is not kept; the backward issues it again
on the kept 1/t shard, as Megatron does (its LayerNorm output is stashed sequence-split and re-gathered before the
weight gradients of QKV and fc1). An all-gather costs a fraction of the matmul it feeds; keeping it would store
2 s b h per layer whole on every tensor rank, the memory sequence parallelism exists to split."""
DROPOUT_MASK = "dropout_mask"
"""`checkpoint_name` of a dropout mask, which none keeps (a boolean, not its random bits)."""
ATTENTION_CONTEXT = "attention_context"
"""`checkpoint_name` of the attention core's output, which selective keeps (the output projection's backward
needs it; the core's backward does not)."""


def _keep_none(prim, *_, **__) -> bool:
    return prim.name not in RECOMPUTED_PRIMITIVES and prim.name not in REGATHERED_PRIMITIVES


def _keep_selective(prim, *_, **params) -> bool:
    """none's, less the attention core: its two matmuls (the layer's only batched ones) and the dropout masks are
    recomputed (re-drawn from their keys), its output is kept."""
    if prim.name == "name":
        return params["name"] == ATTENTION_CONTEXT
    if prim.name == "dot_general":
        (_, (lhs_batch, _)) = params["dimension_numbers"]
        return not lhs_batch
    return prim.name != "random_bits" and _keep_none(prim)


def remat_layer(layer_fn, granularity: str):
    """Activation recomputation (paper §3.5), as `jax.checkpoint` policies of one layer:
    - none keeps the outputs of the layer's matmuls and collectives (and its input, its dropout masks) and recomputes
      the elementwise work between them in the backward (LayerNorms, bias adds, softmax, GeLU;
      `RECOMPUTED_PRIMITIVES`), as Megatron's fused kernels do (its bias-GeLU recomputes the GeLU from its input,
      its LayerNorm the normalised input): no matmul runs twice, no collective but sequence parallelism's
      all-gathers (`REGATHERED_PRIMITIVES`: kept as the 1/t shard, gathered again, as in Megatron), and autodiff's
      elementwise intermediates (six [B, S, F] tensors for the GeLU alone) are not stored;
    - selective also recomputes the attention core (`core_attention`): q·kᵀ, the softmax and the attention dropout
      (re-drawn from its key; the hidden dropouts' masks too), keeping q, k, v and the core's output;
    - full keeps the layer's input only and recomputes the whole layer.
    (docs/architecture.md, "Recomputation: Megatron's semantics".)"""
    if granularity == "full":
        return jax.checkpoint(layer_fn)
    return jax.checkpoint(layer_fn, policy=_keep_selective if granularity == "selective" else _keep_none)


def run_layers(layers, x_BxSxD, cfg: ModelConfig, *, key=None, recompute: str = "none", first_layer=0):
    """Scan the stacked layers [L, ...] over the residual stream. `first_layer` offsets dropout streams so a
    chunk of layers draws the same masks as the same layers inside the full stack."""
    num = jax.tree.leaves(layers)[0].shape[0]
    layer_fn = remat_layer(lambda p, x, k: transformer_layer(p, x, cfg, k, recompute), recompute)

    def body(x, xs):
        p, index = xs
        k = jax.random.fold_in(key, index) if key is not None else None
        return layer_fn(p, x, k), None

    x_BxSxD, _ = jax.lax.scan(body, x_BxSxD, (layers, first_layer + jnp.arange(num)))
    return x_BxSxD


def embed(params, tokens_BxS, cfg: ModelConfig, key=None):
    dt = jnp.dtype(cfg.dtype)
    S = tokens_BxS.shape[1]
    x_BxSxD = jnp.take(params["embed"]["word"], tokens_BxS, axis=0)
    if "position" in params["embed"]:  # learned_absolute; RoPE rotates q and k in the layers instead
        x_BxSxD = x_BxSxD + params["embed"]["position"][:S]
    return dropout(x_BxSxD.astype(dt), cfg.hidden_dropout, key)


def output_logits(params, x_BxSxD, cfg: ModelConfig):
    """Final norm and the output layer (tied to the word embedding, or untied): logits [B, S, Vp] in float32 (in
    the compute dtype with fused kernels, whose loss reads them block by block in float32)."""
    x_BxSxD = norm(x_BxSxD, params["final_ln"], cfg)
    word_VxD = output_weight(params).astype(x_BxSxD.dtype)
    return jnp.einsum("bsd,vd->bsv", x_BxSxD, word_VxD, preferred_element_type=logits_dtype(x_BxSxD.dtype, cfg))


def output_weight(params):
    """The output layer's [Vp, D] (Vl rows on a tensor rank): its own when untied, else the word embedding."""
    return params["output"]["word"] if "output" in params else params["embed"]["word"]


def logits_dtype(compute_dtype, cfg: ModelConfig):
    return compute_dtype if cfg.fused_kernels else acc_dtype(compute_dtype)


def cast_params(params: Params, cfg: ModelConfig) -> Params:
    dt = jnp.dtype(cfg.dtype)
    return jax.tree.map(lambda x: x.astype(dt), params)


def forward(params, tokens_BxS, cfg: ModelConfig, *, key=None, recompute: str = "none"):
    """Token ids [B, S] -> float32 logits [B, S, Vp]. `key` enables dropout (None = deterministic)."""
    params = cast_params(params, cfg)
    k_embed, k_layers = jax.random.split(key) if key is not None else (None, None)
    x_BxSxD = embed(params, tokens_BxS, cfg, k_embed)
    x_BxSxD = run_layers(params["layers"], x_BxSxD, cfg, key=k_layers, recompute=recompute)
    return output_logits(params, x_BxSxD, cfg)


def logits(params: Params, tokens_BxS, cfg: ModelConfig):
    """Token ids [B, S] -> float32 logits [B, S, V] over the real vocabulary, on one device, deterministic.
    `params` may hold the padded or the unpadded (canonical, e.g. `interop.from_hf`) word embedding."""
    return forward(params, jnp.asarray(tokens_BxS), cfg)[..., : cfg.vocab_size]


def cross_entropy(logits_BxSxV, labels_BxS, vocab_size: int, fused: bool = False):
    """Per-token -log softmax(logits)[label] in float32 (or float64); padded vocabulary entries (>= vocab_size)
    are excluded from the normaliser, so padding never changes the loss. `fused`: the Pallas kernel."""
    if fused:
        from pallas_kernels import softmax_cross_entropy

        B, S, V = logits_BxSxV.shape
        losses = softmax_cross_entropy(
            logits_BxSxV.reshape(B * S, V),
            labels_BxS.reshape(B * S),
            vocab_size=vocab_size,
            interpret=interpret_kernels(),
        )
        return losses.reshape(B, S)
    logits = logits_BxSxV.astype(acc_dtype(logits_BxSxV.dtype))
    valid_V = jnp.arange(logits.shape[-1]) < vocab_size
    logits = jnp.where(valid_V, logits, -jnp.inf)
    lse_BxS = jax.nn.logsumexp(logits, axis=-1)
    target_BxS = jnp.take_along_axis(logits, labels_BxS[..., None], axis=-1)[..., 0]
    return lse_BxS - target_BxS


def loss_sum(params, tokens_BxS, labels_BxS, mask_BxS, cfg: ModelConfig, *, key=None, recompute: str = "none"):
    """Sum of masked token losses (divide by the global token count outside: layout-independent averaging)."""
    logits = forward(params, tokens_BxS, cfg, key=key, recompute=recompute)
    losses_BxS = cross_entropy(logits, labels_BxS, cfg.vocab_size, cfg.fused_kernels)
    return jnp.sum(jnp.where(mask_BxS > 0, losses_BxS, 0.0))
