"""Sampling text from a trained GPT with a KV cache, on one device or tensor-parallel: `generate()` and
`ptd-generate`.

    ptd-generate --load CKPT --prompt TEXT --max-new-tokens N [--temperature T --top-k K --top-p P --seed S]
                 [--tokenizer-type {ByteTokenizer,GPT2BPETokenizer} --vocab-file F --merge-file F]
                 [--tensor-model-parallel-size T --fake-devices N]

The prompt runs once through the model (prefill), filling each layer's keys and values [B, P_max, H, K]; each new
token then costs one position's worth of work, attending to the cache. Temperature 0 is greedy (argmax); otherwise
the logits are divided by T, cut to the top K and to the smallest set whose probability reaches P (nucleus), and
sampled. The weights are a checkpoint's canonical parameters (`train/checkpoint.read_params`), any layout; the
tokenizer is the one ptd-train recorded in the checkpoint unless flags name one. Under tensor parallelism (the
checkpoint's t by default, when the devices exist) each device holds its heads' slice of the weights and of the
KV cache (`parallel/decode.py`).
"""

from __future__ import annotations

import json
import math
import sys
import jax
import jax.numpy as jnp
import numpy as np

from ptd_jax.config import ConfigError, ModelConfig
from ptd_jax.parallel.decode import TensorParallelDecoder, single_device_step


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
             top_k: int | None = None, top_p: float | None = None, seed: int = 0, tensor_parallel_size: int = 1,
             devices=None, return_logits: bool = False):
    """Prompt ids [B, P] -> [B, P + max_new_tokens] (float32 compute, no dropout); with `return_logits`, also the
    logits [B, max_new_tokens, V] each new token was drawn from. `tensor_parallel_size` t > 1 runs the steps on t
    of `devices` (default: jax.devices()), heads and the KV cache split over them (`parallel/decode.py`)."""
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
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    shape = (cfg.num_layers, B, total, cfg.num_attention_heads, cfg.head_dim)
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
    key = jax.random.key(seed)
    for i in range(max_new_tokens):
        key, k = jax.random.split(key)
        drawn_from.append(np.asarray(logits))
        nxt = np.asarray(sample(logits, k, temperature, top_k, top_p), np.int32)[:, None]
        tokens.append(nxt)
        if i + 1 < max_new_tokens:
            logits, caches = step(jnp.asarray(nxt), caches, P + i)
    out = np.concatenate(tokens, axis=1)
    if not return_logits:
        return out
    return out, np.stack(drawn_from, axis=1) if drawn_from else np.zeros((B, 0, cfg.vocab_size), np.float32)


def pick_tokenizer(args, cfg: ModelConfig, meta: dict):
    """--tokenizer-type's tokenizer, else the one the checkpoint records (ptd-train's data), else the byte
    tokenizer for V = 257; its vocabulary must be the model's."""
    from ptd_jax.data.tokenizer import ByteTokenizer, build_tokenizer, from_description

    if args.tokenizer_type is not None:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
    elif args.vocab_file or args.merge_file:
        raise ConfigError("--vocab-file and --merge-file need --tokenizer-type GPT2BPETokenizer")
    elif meta.get("tokenizer"):
        tokenizer = from_description(meta["tokenizer"])
    elif cfg.vocab_size == ByteTokenizer.vocab_size:
        tokenizer = ByteTokenizer()
    else:
        raise ConfigError(f"--load {args.load} records no tokenizer and has vocab_size={cfg.vocab_size}: give "
                          f"--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ..., or --prompt-ids")
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ConfigError(f"the {tokenizer.name} has {tokenizer.vocab_size} tokens but --load {args.load} has "
                          f"vocab_size={cfg.vocab_size}")
    return tokenizer


def tensor_parallel_size(args, cfg: ModelConfig, meta: dict) -> int:
    """--tensor-model-parallel-size, else the checkpoint's t where this machine has the devices (else 1)."""
    if args.tensor_model_parallel_size is not None:
        if args.tensor_model_parallel_size < 1:
            raise ConfigError(f"tensor_model_parallel_size={args.tensor_model_parallel_size} must be positive")
        return args.tensor_model_parallel_size
    saved = (meta.get("parallel") or {}).get("tensor_model_parallel_size", 1)
    if saved > 1 and len(jax.devices()) < saved:
        print(f"ptd-generate: the checkpoint was trained at tensor_model_parallel_size={saved}; {len(jax.devices())}"
              f" device(s) here: generating on one device (--fake-devices {saved} simulates them on CPU)",
              file=sys.stderr)
        return 1
    return saved


def main(argv=None) -> int:
    from ptd_jax.argparsing import OneLineParser, finite_float
    from ptd_jax.data.indexed_dataset import DataError
    from ptd_jax.data.tokenizer import add_tokenizer_args
    from ptd_jax.parallel.mesh import set_fake_devices
    from ptd_jax.train import checkpoint

    parser = OneLineParser(prog="ptd-generate", description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="a checkpoint folder (its newest step, any layout)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, encoded by the tokenizer")
    prompt.add_argument("--prompt-ids", help="token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=finite_float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=finite_float)
    parser.add_argument("--seed", type=int, default=0)
    add_tokenizer_args(parser, default=None, help_default="default: the checkpoint's (as ptd-train recorded it), "
                       "else ByteTokenizer")
    parser.add_argument("--tensor-model-parallel-size", type=int,
                        help="t: heads and KV cache split over t devices (default: the checkpoint's t, if present)")
    parser.add_argument("--fake-devices", type=int, help="simulate N CPU devices (before JAX starts)")
    args = parser.parse_args(argv)
    try:
        if args.fake_devices is not None:
            set_fake_devices(args.fake_devices)
        cfg, params = checkpoint.read_params(args.load)
        meta = checkpoint.read_meta(args.load, checkpoint.latest_step(args.load))
        tokenizer = pick_tokenizer(args, cfg, meta) if args.prompt is not None else None
        if tokenizer is not None:
            ids = tokenizer.encode(args.prompt)
        else:
            try:
                ids = np.asarray([int(x) for x in args.prompt_ids.split(",") if x.strip()], np.int32)
            except ValueError:
                raise ConfigError(f"prompt_ids={args.prompt_ids!r} is not a comma-separated list of ids") from None
            if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
                raise ConfigError(f"prompt_ids hold ids outside [0, {cfg.vocab_size})")
        out = generate(cfg, params, ids[None], args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                       tensor_parallel_size=tensor_parallel_size(args, cfg, meta))[0]
    except (ConfigError, DataError) as err:
        print(f"ptd-generate: error: {err}", file=sys.stderr)
        return 2
    new = out[len(ids):]
    if tokenizer is not None:
        print(tokenizer.decode(out))
    print(json.dumps({"prompt_tokens": int(len(ids)), "new_tokens": [int(t) for t in new]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
