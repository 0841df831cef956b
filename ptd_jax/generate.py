"""Sampling text from a trained GPT with a KV cache, on one device: `generate()` and `ptd-generate`.

    ptd-generate --load CKPT --prompt TEXT --max-new-tokens N [--temperature T --top-k K --top-p P --seed S]

The prompt runs once through the model (prefill), filling each layer's keys and values [B, P_max, H, K]; each new
token then costs one position's worth of work, attending to the cache. Temperature 0 is greedy (argmax); otherwise
the logits are divided by T, cut to the top K and to the smallest set whose probability reaches P (nucleus), and
sampled. The weights are a checkpoint's canonical parameters (`train/checkpoint.read_params`), any layout.
"""

from __future__ import annotations

import json
import math
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ptd_jax import model as gpt
from ptd_jax.config import ConfigError, ModelConfig


def _cached_layer(p, x_BxTxD, cache, pos, cfg: ModelConfig):
    """One pre-LN block for T new positions pos..pos+T-1, reading and extending this layer's cache."""
    k_cache_BxPxHxK, v_cache_BxPxHxK = cache
    h = gpt.layer_norm(x_BxTxD, p["ln1"], cfg.layernorm_epsilon)
    qkv_BxTx3xHxK = jnp.einsum("btd,dshk->btshk", h, p["attn"]["qkv_kernel"]) + p["attn"]["qkv_bias"]
    q, k, v = (qkv_BxTx3xHxK[:, :, i] for i in range(3))
    k_cache_BxPxHxK = jax.lax.dynamic_update_slice(k_cache_BxPxHxK, k.astype(k_cache_BxPxHxK.dtype), (0, pos, 0, 0))
    v_cache_BxPxHxK = jax.lax.dynamic_update_slice(v_cache_BxPxHxK, v.astype(v_cache_BxPxHxK.dtype), (0, pos, 0, 0))
    T, P, K = x_BxTxD.shape[1], k_cache_BxPxHxK.shape[1], q.shape[-1]
    scores_BxHxTxP = jnp.einsum("bthk,bphk->bhtp", q, k_cache_BxPxHxK,
                                preferred_element_type=jnp.float32) / math.sqrt(K)
    visible_TxP = jnp.arange(P)[None, :] <= pos + jnp.arange(T)[:, None]  # causal, and only what is filled
    scores_BxHxTxP = jnp.where(visible_TxP, scores_BxHxTxP, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxHxTxP, axis=-1).astype(v_cache_BxPxHxK.dtype)
    ctx_BxTxHxK = jnp.einsum("bhtp,bphk->bthk", probs, v_cache_BxPxHxK)
    x_BxTxD = x_BxTxD + jnp.einsum("bthk,hkd->btd", ctx_BxTxHxK, p["attn"]["out_kernel"]) + p["attn"]["out_bias"]
    x_BxTxD = x_BxTxD + gpt.mlp_block(p["mlp"], gpt.layer_norm(x_BxTxD, p["ln2"], cfg.layernorm_epsilon), cfg)
    return x_BxTxD, (k_cache_BxPxHxK, v_cache_BxPxHxK)


@partial(jax.jit, static_argnames="cfg", donate_argnames="caches")
def _step(params, tokens_BxT, caches, pos, cfg: ModelConfig):
    """Logits [B, V] of the last of T new tokens at positions pos.., and the extended caches [L, B, P, H, K]."""
    T = tokens_BxT.shape[1]
    positions = jax.lax.dynamic_slice_in_dim(params["embed"]["position"], pos, T)
    x_BxTxD = jnp.take(params["embed"]["word"], tokens_BxT, axis=0) + positions

    def body(x, layer):
        p, cache = layer
        x, cache = _cached_layer(p, x, cache, pos, cfg)
        return x, cache

    x_BxTxD, caches = jax.lax.scan(body, x_BxTxD, (params["layers"], caches))
    logits_BxV = gpt.output_logits(params, x_BxTxD[:, -1:], cfg)[:, 0, :cfg.vocab_size]
    return logits_BxV, caches


def sample(logits_BxV, key, temperature: float, top_k: int | None, top_p: float | None):
    """Next token ids [B]: argmax at temperature 0, else top-k / top-p (nucleus) sampling at `temperature`."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1)
    logits = logits_BxV / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)  # ties at the k-th value stay, as in HF and Megatron
    if top_p is not None and top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        before = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1) - jax.nn.softmax(sorted_logits, -1)
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)  # the first token is always kept
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1)


def generate(cfg: ModelConfig, params, prompt_BxP, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0) -> np.ndarray:
    """Prompt ids [B, P] -> [B, P + max_new_tokens] (float32 compute, no dropout)."""
    prompt = np.asarray(prompt_BxP, np.int32)
    B, P = prompt.shape
    total = P + max_new_tokens
    if P < 1 or max_new_tokens < 0:
        raise ConfigError(f"the prompt has {P} tokens and max_new_tokens={max_new_tokens}; need >= 1 and >= 0")
    if total > cfg.max_positions:
        raise ConfigError(f"the prompt of {P} tokens + max_new_tokens={max_new_tokens} = {total} exceeds the "
                          f"model's {cfg.max_positions} positions")
    if not 0 <= temperature < math.inf or (top_p is not None and not 0 < top_p <= 1) or (top_k is not None
                                                                                          and top_k < 1):
        raise ConfigError(f"temperature={temperature} must be >= 0, top_k={top_k} >= 1 and top_p={top_p} in (0, 1]")
    cfg = cfg.replace(dtype="float32", fused_kernels=False, attention_backend="xla", hidden_dropout=0.0,
                      attention_dropout=0.0)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    L, H, K = cfg.num_layers, cfg.num_attention_heads, cfg.head_dim
    caches = (jnp.zeros((L, B, total, H, K), jnp.float32), jnp.zeros((L, B, total, H, K), jnp.float32))
    tokens = [prompt]
    logits, caches = _step(params, jnp.asarray(prompt), caches, 0, cfg)
    key = jax.random.key(seed)
    for i in range(max_new_tokens):
        key, k = jax.random.split(key)
        nxt = np.asarray(sample(logits, k, temperature, top_k, top_p), np.int32)[:, None]
        tokens.append(nxt)
        if i + 1 < max_new_tokens:
            logits, caches = _step(params, jnp.asarray(nxt), caches, P + i, cfg)
    return np.concatenate(tokens, axis=1)


def main(argv=None) -> int:
    from ptd_jax.argparsing import OneLineParser, finite_float
    from ptd_jax.data.tokenizer import ByteTokenizer
    from ptd_jax.train import checkpoint

    parser = OneLineParser(prog="ptd-generate", description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="a checkpoint folder (its newest step, any layout)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, byte-tokenized")
    prompt.add_argument("--prompt-ids", help="token ids, comma-separated (models of another tokenizer)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=finite_float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=finite_float)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        cfg, params = checkpoint.read_params(args.load)
        tokenizer = ByteTokenizer()
        if args.prompt is not None:
            if cfg.vocab_size != tokenizer.vocab_size:
                raise ConfigError(f"--load {args.load} has vocab_size={cfg.vocab_size}, not the byte tokenizer's "
                                  f"{tokenizer.vocab_size}: give --prompt-ids")
            ids = tokenizer.encode(args.prompt)
        else:
            try:
                ids = np.asarray([int(x) for x in args.prompt_ids.split(",") if x.strip()], np.int32)
            except ValueError:
                raise ConfigError(f"prompt_ids={args.prompt_ids!r} is not a comma-separated list of ids") from None
            if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
                raise ConfigError(f"prompt_ids hold ids outside [0, {cfg.vocab_size})")
        out = generate(cfg, params, ids[None], args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed)[0]
    except ConfigError as err:
        print(f"ptd-generate: error: {err}", file=sys.stderr)
        return 2
    new = out[len(ids):]
    if args.prompt is not None:
        print(args.prompt + tokenizer.decode(new))
    print(json.dumps({"prompt_tokens": int(len(ids)), "new_tokens": [int(t) for t in new]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
