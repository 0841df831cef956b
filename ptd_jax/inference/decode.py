"""KV-cache decoding steps for sampling (`inference/generate.py`), on one device or tensor-parallel (paper §2.3).

One step takes T new tokens at positions pos..pos+T-1 (the whole prompt at prefill, then one token), writes their
keys and values into each layer's cache [B, P_max, G, K] (G key/value heads: all H without grouped-query attention)
and returns the logits of the last one. Under tensor parallelism the step runs inside `shard_map` over "tensor",
with the training layout of `sharding.py`: each rank holds its G/t query groups (QKV column-parallel, the output
projection row-parallel), F/t of the MLP and Vp/t rows of the word embedding, and the cache is split by key/value
heads, so a rank's cache [L, B, P_max, G/t, K] holds the keys and values of its own query groups. Communication per
step: Megatron's `g` (one all-reduce of [B, T, D]) after the attention output and after fc2 in every layer, one
all-reduce for the vocab-parallel embedding, and one all-gather of the last position's logits [B, Vp/t] -> [B, Vp]
(the step's output is split over "tensor" by vocabulary, and the jit around it slices the real V, which gathers);
`f` is the identity in a forward-only pass.

Local shape legend: B batch, T new positions, P cache positions, D hidden, G key/value heads (Gl = G/t local),
R query heads per key/value head, K head dim, V vocabulary (Vl = Vp/t local).
"""

from __future__ import annotations

import functools
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig, ParallelConfig
from ptd_jax.parallel import sharding, tensor
from ptd_jax.parallel.mesh import make_mesh

CACHE_SPEC = P(None, None, None, tensor.TENSOR, None)  # [L, B, P, G, K]: split by key/value heads


def _identity(x):
    return x


def cached_layer(p, x_BxTxD, cache, pos, cfg: ModelConfig, tensor_parallel: bool):
    """One pre-norm block for T new positions, reading and extending this layer's cache of (local) key/value
    heads."""
    enter, leave = (
        (tensor.copy_to_tensor_region, tensor.reduce_from_tensor_region) if tensor_parallel else (_identity, _identity)
    )
    k_cache_BxPxGlxK, v_cache_BxPxGlxK = cache
    T, P_max = x_BxTxD.shape[1], k_cache_BxPxGlxK.shape[1]
    positions_T = pos + jnp.arange(T)
    h_BxTxD = enter(gpt.norm(x_BxTxD, p["ln1"], cfg))
    qkv = gpt.bias(p["attn"], "qkv_bias", jnp.einsum("btd,dgrk->btgrk", h_BxTxD, p["attn"]["qkv_kernel"]))
    q_BxTxGlxRxK, k, v = gpt.split_qkv(qkv, positions_T, cfg)
    k_cache_BxPxGlxK = jax.lax.dynamic_update_slice(k_cache_BxPxGlxK, k.astype(k_cache_BxPxGlxK.dtype), (0, pos, 0, 0))
    v_cache_BxPxGlxK = jax.lax.dynamic_update_slice(v_cache_BxPxGlxK, v.astype(v_cache_BxPxGlxK.dtype), (0, pos, 0, 0))
    B, _, Gl, R, K = q_BxTxGlxRxK.shape
    scores_BxGlxRxTxP = jnp.einsum(
        "btgrk,bpgk->bgrtp", q_BxTxGlxRxK, k_cache_BxPxGlxK, preferred_element_type=jnp.float32
    ) / math.sqrt(K)
    visible_TxP = gpt.visible(positions_T, jnp.arange(P_max), cfg.window_size)  # causal: only what is filled
    scores_BxGlxRxTxP = jnp.where(visible_TxP, scores_BxGlxRxTxP, jnp.finfo(jnp.float32).min)
    probs_BxGlxRxTxP = jax.nn.softmax(scores_BxGlxRxTxP, axis=-1).astype(v_cache_BxPxGlxK.dtype)
    ctx_BxTxGlxRxK = jnp.einsum("bgrtp,bpgk->btgrk", probs_BxGlxRxTxP, v_cache_BxPxGlxK)
    partial_BxTxD = jnp.einsum("bthk,hkd->btd", ctx_BxTxGlxRxK.reshape(B, T, Gl * R, K), p["attn"]["out_kernel"])
    x_BxTxD = x_BxTxD + gpt.bias(p["attn"], "out_bias", leave(partial_BxTxD))
    h_BxTxD = gpt.norm(x_BxTxD, p["ln2"], cfg)
    mlp = tensor.mlp(p["mlp"], h_BxTxD, cfg, False) if tensor_parallel else gpt.mlp_block(p["mlp"], h_BxTxD, cfg)
    return x_BxTxD + mlp, (k_cache_BxPxGlxK, v_cache_BxPxGlxK)


def decode_step(params, tokens_BxT, caches, pos, cfg: ModelConfig, tensor_parallel: bool = False):
    """Logits [B, Vp] ([B, Vl] of this rank's rows under tensor parallelism) of the last of T new tokens at
    positions pos.., and the extended caches [L, B, P, H or Hl, K]."""
    T = tokens_BxT.shape[1]
    embed = {"word": params["embed"]["word"]}
    if "position" in params["embed"]:  # learned positions pos..pos+T-1 (RoPE rotates q and k in the layers)
        embed["position"] = jax.lax.dynamic_slice_in_dim(params["embed"]["position"], pos, T)
    if tensor_parallel:  # the vocab-parallel lookup of training
        x_BxTxD = tensor.vocab_parallel_embed({"embed": embed}, tokens_BxT, cfg, False)
    else:
        x_BxTxD = gpt.embed({"embed": embed}, tokens_BxT, cfg)

    def body(x, layer):
        p, cache = layer
        return cached_layer(p, x, cache, pos, cfg, tensor_parallel)

    x_BxTxD, caches = jax.lax.scan(body, x_BxTxD, (params["layers"], caches))
    if tensor_parallel:
        return tensor.vocab_parallel_logits(params, x_BxTxD[:, -1:], cfg, False)[:, 0], caches
    return gpt.output_logits(params, x_BxTxD[:, -1:], cfg)[:, 0], caches


@partial(jax.jit, static_argnames="cfg", donate_argnames="caches")
def single_device_step(params, tokens_BxT, caches, pos, cfg: ModelConfig):
    """`decode_step` on one device: logits [B, V] of the real vocabulary, and the caches."""
    logits_BxVp, caches = decode_step(params, tokens_BxT, caches, pos, cfg)
    return logits_BxVp[:, : cfg.vocab_size], caches


@functools.lru_cache(maxsize=8)
def _tensor_parallel_step(cfg: ModelConfig, mesh):
    """The jitted shard_map step of one model on one mesh (cached: a second generate() compiles nothing)."""
    specs = sharding.param_specs(jax.eval_shape(lambda: gpt.init_params(jax.random.key(0), cfg)))
    body = partial(decode_step, cfg=cfg, tensor_parallel=True)
    stepped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, P(), (CACHE_SPEC, CACHE_SPEC), P()),
        out_specs=(P(None, tensor.TENSOR), (CACHE_SPEC, CACHE_SPEC)),
    )

    def real_vocab(params, tokens_BxT, caches, pos):
        logits_BxVp, caches = stepped(params, tokens_BxT, caches, pos)
        return logits_BxVp[:, : cfg.vocab_size], caches

    cache = jax.sharding.NamedSharding(mesh, CACHE_SPEC)
    return jax.jit(real_vocab, donate_argnums=2, out_shardings=(jax.sharding.NamedSharding(mesh, P()), (cache, cache)))


class TensorParallelDecoder:
    """The step on a (1, 1, t) mesh: canonical params padded to Vp = padded_vocab_size(t) and split as in training,
    caches split by heads. `step(tokens_BxT, caches, pos)` as `decode_step`, logits [B, V] replicated."""

    def __init__(self, cfg: ModelConfig, params, tensor_parallel_size: int, devices=None):
        layout = ParallelConfig(tensor_model_parallel_size=tensor_parallel_size)
        layout.check_model(cfg)
        self.mesh = make_mesh(layout, devices)
        padded = sharding.from_canonical(None, {"params": params}, cfg.padded_vocab_size(tensor_parallel_size), 1, 1)[
            "params"
        ]
        self.params = jax.device_put(padded, sharding.named(self.mesh, sharding.param_specs(padded)))
        self.cache_sharding = jax.sharding.NamedSharding(self.mesh, CACHE_SPEC)
        self._step = _tensor_parallel_step(cfg, self.mesh)

    def zeros_cache(self, shape, dtype):
        return tuple(jax.device_put(jnp.zeros(shape, dtype), self.cache_sharding) for _ in range(2))

    def step(self, tokens_BxT, caches, pos):
        return self._step(self.params, tokens_BxT, caches, jnp.asarray(pos, jnp.int32))
