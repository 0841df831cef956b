"""Megatron's GPT (= GPT-2 architecture) as pure functions over a parameter pytree.

Learned position embeddings, pre-LayerNorm blocks, causal multi-head attention, a 4h GeLU MLP, a final
LayerNorm and an output layer tied to the word embedding (paper §2, Megatron-LM `GPTModel`).

Parameter layout (docs/architecture.md, "Parameters"): the transformer layers are *stacked* along a leading
layer dim L so that (a) one `lax.scan` runs them (on XLA:CPU, half the step time and about a quarter of the compile
time of unrolled layers), (b) the pipeline can reshape L into [v, p, k] chunks
(`parallel/sharding.py`), and (c) tensor parallelism splits a named dim of each weight without renaming anything:

    embed/word          [Vp, D]          split Vp over "tensor" (vocab-parallel embedding and tied output)
    embed/position      [S, D]
    layers/ln1/{scale,bias}   [L, D]
    layers/attn/qkv_kernel    [L, D, 3, H, K]   column-parallel: split H
    layers/attn/qkv_bias      [L, 3, H, K]
    layers/attn/out_kernel    [L, H, K, D]      row-parallel: split H
    layers/attn/out_bias      [L, D]
    layers/ln2/{scale,bias}   [L, D]
    layers/mlp/fc1_kernel     [L, D, F]         column-parallel: split F
    layers/mlp/fc1_bias       [L, F]
    layers/mlp/fc2_kernel     [L, F, D]         row-parallel: split F
    layers/mlp/fc2_bias       [L, D]
    final_ln/{scale,bias}     [D]

Shape legend: B batch, S sequence, D hidden, F ffn, H heads, K head dim, V vocabulary, L layers.
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
    std = cfg.init_method_std
    out_std = std / math.sqrt(2.0 * L)
    k_word, k_pos, k_layers = jax.random.split(key, 3)

    def normal(k, shape, scale):
        return (scale * jax.random.normal(k, shape, dtype=jnp.float32)).astype(pdt)

    def one_layer(k):
        k_qkv, k_out, k_fc1, k_fc2 = jax.random.split(k, 4)
        return {
            "ln1": {"scale": jnp.ones((D,), pdt), "bias": jnp.zeros((D,), pdt)},
            "attn": {
                "qkv_kernel": normal(k_qkv, (D, 3, H, K), std),
                "qkv_bias": jnp.zeros((3, H, K), pdt),
                "out_kernel": normal(k_out, (H, K, D), out_std),
                "out_bias": jnp.zeros((D,), pdt),
            },
            "ln2": {"scale": jnp.ones((D,), pdt), "bias": jnp.zeros((D,), pdt)},
            "mlp": {
                "fc1_kernel": normal(k_fc1, (D, F), std),
                "fc1_bias": jnp.zeros((F,), pdt),
                "fc2_kernel": normal(k_fc2, (F, D), out_std),
                "fc2_bias": jnp.zeros((D,), pdt),
            },
        }

    layer_keys = jnp.stack([jax.random.fold_in(k_layers, i) for i in range(L)])
    padding = cfg.padded_vocab_size(tensor_parallel_size) - cfg.vocab_size
    word = jnp.concatenate([normal(k_word, (cfg.vocab_size, D), std), jnp.zeros((padding, D), pdt)])
    return {
        "embed": {
            "word": word,
            "position": normal(k_pos, (cfg.max_positions, D), std),
        },
        "layers": jax.vmap(one_layer)(layer_keys),
        "final_ln": {"scale": jnp.ones((D,), pdt), "bias": jnp.zeros((D,), pdt)},
    }


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


def gelu(x, approximate: bool):
    return jax.nn.gelu(x, approximate=approximate)


def dropout(x, rate: float, key):
    """Inverted dropout; identity when rate == 0 or key is None (evaluation)."""
    if rate == 0.0 or key is None:
        return x
    keep = checkpoint_name(jax.random.bernoulli(key, 1.0 - rate, x.shape), DROPOUT_MASK)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def causal_attention(q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, *, dropout_rate: float = 0.0, key=None, backend: str = "xla"):
    """softmax(q kᵀ / sqrt(K) + causal mask) v, scores and softmax in float32. backend 'pallas' runs the fused
    flash-attention kernel (interpreted on CPU), 'cudnn' jax.nn.dot_product_attention's cuDNN path."""
    if backend == "pallas":
        from pallas_kernels import flash_attention

        return flash_attention(q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, causal=True, interpret=interpret_kernels())
    if backend == "cudnn":
        return jax.nn.dot_product_attention(q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, is_causal=True, implementation="cudnn")
    S, K = q_BxSxHxK.shape[1], q_BxSxHxK.shape[-1]
    acc = acc_dtype(q_BxSxHxK.dtype)
    scores_BxHxSxS = jnp.einsum("bqhk,bshk->bhqs", q_BxSxHxK, k_BxSxHxK, preferred_element_type=acc) / math.sqrt(K)
    causal_SxS = jnp.tril(jnp.ones((S, S), dtype=bool))
    scores_BxHxSxS = jnp.where(causal_SxS, scores_BxHxSxS, jnp.finfo(acc).min)
    probs_BxHxSxS = jax.nn.softmax(scores_BxHxSxS, axis=-1)
    probs_BxHxSxS = dropout(probs_BxHxSxS, dropout_rate, key).astype(v_BxSxHxK.dtype)
    return checkpoint_name(jnp.einsum("bhqs,bshk->bqhk", probs_BxHxSxS, v_BxSxHxK), ATTENTION_CONTEXT)


def core_attention(q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, cfg: ModelConfig, key=None, recompute: str = "none"):
    """The attention core (scores, softmax, dropout, context). Under `selective` it, and only it, is recomputed
    in the backward, as Megatron's selective recomputation does: its inputs q, k, v (and the dropout key) are
    kept, everything outside it (the weight matmuls, LayerNorms, the tensor collectives) is stored as in `none`,
    so no collective is re-issued that `none` does not re-issue. Inside a layer under `remat_layer` its policy
    decides (an enclosing checkpoint's policy governs the nested one) and recomputes the same."""

    def core(q, k, v, key):
        return causal_attention(q, k, v, dropout_rate=cfg.attention_dropout, key=key, backend=cfg.attention_backend)

    return (jax.checkpoint(core) if recompute == "selective" else core)(q_BxSxHxK, k_BxSxHxK, v_BxSxHxK, key)


def attention_block(p, x_BxSxD, cfg: ModelConfig, key=None, recompute: str = "none"):
    qkv_BxSx3xHxK = jnp.einsum("bsd,dthk->bsthk", x_BxSxD, p["qkv_kernel"]) + p["qkv_bias"]
    q, k, v = (qkv_BxSx3xHxK[:, :, i] for i in range(3))
    ctx_BxSxHxK = core_attention(q, k, v, cfg, key, recompute)
    return jnp.einsum("bshk,hkd->bsd", ctx_BxSxHxK, p["out_kernel"]) + p["out_bias"]


def mlp_block(p, x_BxSxD, cfg: ModelConfig):
    h_BxSxF = gelu(x_BxSxD @ p["fc1_kernel"] + p["fc1_bias"], cfg.gelu_approximate)
    return h_BxSxF @ p["fc2_kernel"] + p["fc2_bias"]


def transformer_layer(p, x_BxSxD, cfg: ModelConfig, key=None, recompute: str = "none"):
    """One pre-LN block: x + drop(attn(ln1(x))), then + drop(mlp(ln2(x)))."""
    k_attn, k_h1, k_h2 = jax.random.split(key, 3) if key is not None else (None, None, None)
    h = attention_block(
        p["attn"], layer_norm(x_BxSxD, p["ln1"], cfg.layernorm_epsilon, cfg.fused_kernels), cfg, k_attn, recompute
    )
    x_BxSxD = x_BxSxD + dropout(h, cfg.hidden_dropout, k_h1)
    h = mlp_block(p["mlp"], layer_norm(x_BxSxD, p["ln2"], cfg.layernorm_epsilon, cfg.fused_kernels), cfg)
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
        "exp",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
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
    }
)
"""Elementwise, layout and reduction primitives: what a layer recomputes in its backward under none and selective
(`remat_layer`). Everything else is kept: the outputs of matmuls, collectives (but the all-gather below) and random
bits, and the values named below."""
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
    x_BxSxD = jnp.take(params["embed"]["word"], tokens_BxS, axis=0) + params["embed"]["position"][:S]
    return dropout(x_BxSxD.astype(dt), cfg.hidden_dropout, key)


def output_logits(params, x_BxSxD, cfg: ModelConfig):
    """Final LayerNorm and the output layer tied to the word embedding: logits [B, S, Vp] in float32 (in the
    compute dtype with fused kernels, whose loss reads them block by block in float32)."""
    x_BxSxD = layer_norm(x_BxSxD, params["final_ln"], cfg.layernorm_epsilon, cfg.fused_kernels)
    word_VxD = params["embed"]["word"].astype(x_BxSxD.dtype)
    return jnp.einsum("bsd,vd->bsv", x_BxSxD, word_VxD, preferred_element_type=logits_dtype(x_BxSxD.dtype, cfg))


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
