"""Sampling text from a trained GPT with a KV cache, on one device or tensor-parallel: `generate()` (the CLI is
`ptd_jax/cli/generate.py`).

The prompt runs once through the model (prefill), filling each layer's keys and values [B, P_max, H, K]; each new
token then costs one position's worth of work, attending to the cache. Temperature 0 is greedy (argmax); otherwise
the logits are divided by T, cut to the top K and to the smallest set whose probability reaches P (nucleus), and
sampled. The weights are a checkpoint's canonical parameters (`train/checkpoint.read_params`), any layout; the
tokenizer is the one ptd-train recorded in the checkpoint unless flags name one. Under tensor parallelism (the
checkpoint's t by default, when the devices exist) each device holds its heads' slice of the weights and of the
KV cache (`inference/decode.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ptd_jax.config import ConfigError, ModelConfig
from ptd_jax.inference.decode import TensorParallelDecoder, single_device_step


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


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits (Megatron's and HF's flags): temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def check(self) -> None:
        """One line naming the first value out of range."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not 0 <= t < math.inf:
            raise ConfigError(f"temperature={t} must be a finite number >= 0 (0: greedy)")
        if k is not None and k < 1:
            raise ConfigError(f"top_k={k} must be >= 1")
        if p is not None and not 0 < p <= 1:
            raise ConfigError(f"top_p={p} must be in (0, 1]")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed={self.seed} must be in [0, 2**32)")


def generate(
    params,
    prompt_BxP,
    cfg: ModelConfig,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    *,
    tensor_parallel_size: int = 1,
    devices=None,
    return_logits: bool = False,
):
    """Prompt ids [B, P] -> [B, P + max_new_tokens] (float32 compute, no dropout), tokens drawn by `sampling`;
    with `return_logits`, also the logits [B, max_new_tokens, V] each new token was drawn from.
    `tensor_parallel_size` t > 1 runs the steps on t of `devices` (default: jax.devices()), heads and the KV cache
    split over them (`inference/decode.py`)."""
    prompt = np.asarray(prompt_BxP, np.int32)
    B, P = prompt.shape
    total = P + max_new_tokens
    if P < 1 or max_new_tokens < 0:
        raise ConfigError(f"the prompt has {P} tokens and max_new_tokens={max_new_tokens}; need >= 1 and >= 0")
    if total > cfg.max_positions:
        raise ConfigError(
            f"the prompt of {P} tokens + max_new_tokens={max_new_tokens} = {total} exceeds the "
            f"model's {cfg.max_positions} positions"
        )
    sampling.check()
    cfg = cfg.replace(
        dtype="float32", fused_kernels=False, attention_backend="xla", hidden_dropout=0.0, attention_dropout=0.0
    )
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    shape = (cfg.num_layers, B, total, cfg.num_groups, cfg.head_dim)  # grouped-query attention caches G heads
    if tensor_parallel_size > 1:
        decoder = TensorParallelDecoder(cfg, params, tensor_parallel_size, devices)
        step, caches = decoder.step, decoder.zeros_cache(shape, jnp.float32)
    else:
        on_device = jax.tree.map(jnp.asarray, params)
        caches = (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))

        def step(tokens, caches, pos):
            return single_device_step(on_device, tokens, caches, pos, cfg)

    tokens, drawn_from = [prompt], []
    logits, caches = step(jnp.asarray(prompt), caches, 0)
    key = jax.random.key(sampling.seed)
    for i in range(max_new_tokens):
        key, k = jax.random.split(key)
        drawn_from.append(np.asarray(logits))
        nxt = np.asarray(sample(logits, k, sampling.temperature, sampling.top_k, sampling.top_p), np.int32)[:, None]
        tokens.append(nxt)
        if i + 1 < max_new_tokens:
            logits, caches = step(jnp.asarray(nxt), caches, P + i)
    out = np.concatenate(tokens, axis=1)
    if not return_logits:
        return out
    return out, np.stack(drawn_from, axis=1) if drawn_from else np.zeros((B, 0, cfg.vocab_size), np.float32)
