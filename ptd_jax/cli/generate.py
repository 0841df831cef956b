"""`ptd-generate`: text from a checkpoint, with the tokenizer it records (`inference/generate.py` does the work).

ptd-generate --load CKPT --prompt TEXT --max-new-tokens N [--temperature T --top-k K --top-p P --seed S]
             [--tokenizer-type {ByteTokenizer,GPT2BPETokenizer,HuggingFaceTokenizer} --vocab-file F --merge-file F
              | --tokenizer-model tokenizer.json]
             [--tensor-model-parallel-size T --fake-devices N]
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from ptd_jax.config import ConfigError, ModelConfig
from ptd_jax.inference.generate import Sampling, generate


def pick_tokenizer(args, cfg: ModelConfig, meta: dict):
    """--tokenizer-type's tokenizer, else the one the checkpoint records (ptd-train's data), else the byte
    tokenizer for V = 257; its vocabulary must be the model's."""
    from ptd_jax.data.tokenizer import ByteTokenizer, build_tokenizer, from_description

    if args.tokenizer_type is not None:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model)
    elif args.vocab_file or args.merge_file:
        raise ConfigError("--vocab-file and --merge-file need --tokenizer-type GPT2BPETokenizer")
    elif args.tokenizer_model:
        raise ConfigError("--tokenizer-model needs --tokenizer-type HuggingFaceTokenizer")
    elif meta.get("tokenizer"):
        tokenizer = from_description(meta["tokenizer"])
    elif cfg.vocab_size == ByteTokenizer.vocab_size:
        tokenizer = ByteTokenizer()
    else:
        raise ConfigError(
            f"--load {args.load} records no tokenizer and has vocab_size={cfg.vocab_size}: give "
            f"--tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ..., --tokenizer-type "
            f"HuggingFaceTokenizer --tokenizer-model ..., or --prompt-ids"
        )
    if tokenizer.vocab_size != cfg.vocab_size:
        raise ConfigError(
            f"the {tokenizer.name} has {tokenizer.vocab_size} tokens but --load {args.load} has "
            f"vocab_size={cfg.vocab_size}"
        )
    return tokenizer


def tensor_parallel_size(args, cfg: ModelConfig, meta: dict) -> int:
    """--tensor-model-parallel-size, else the checkpoint's t where this machine has the devices (else 1)."""
    if args.tensor_model_parallel_size is not None:
        if args.tensor_model_parallel_size < 1:
            raise ConfigError(f"tensor_model_parallel_size={args.tensor_model_parallel_size} must be positive")
        return args.tensor_model_parallel_size
    saved = (meta.get("parallel") or {}).get("tensor_model_parallel_size", 1)
    if saved > 1 and len(jax.devices()) < saved:
        print(
            f"ptd-generate: the checkpoint was trained at tensor_model_parallel_size={saved}; {len(jax.devices())}"
            f" device(s) here: generating on one device (--fake-devices {saved} simulates them on CPU)",
            file=sys.stderr,
        )
        return 1
    return saved


def prompt_ids(text: str, vocab_size: int) -> np.ndarray:
    """--prompt-ids "1,2,3" as int32 ids in [0, vocab_size); an empty field ("1,,2") is refused."""
    fields = text.split(",")
    try:
        if not all(x.strip() for x in fields):
            raise ValueError
        ids = np.asarray([int(x) for x in fields], np.int32)
    except (ValueError, OverflowError):
        raise ConfigError(f"prompt_ids={text!r} is not a comma-separated list of ids") from None
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ConfigError(f"prompt_ids hold ids outside [0, {vocab_size})")
    return ids


def main(argv=None) -> int:
    from ptd_jax.cli.errors import run_tool

    return run_tool("ptd-generate", run, argv)


def run(argv) -> int:
    from ptd_jax.cli.args import OneLineParser, finite_float
    from ptd_jax.cli.args import add_tokenizer_args
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
    add_tokenizer_args(
        parser, default=None, help_default="default: the checkpoint's (as ptd-train recorded it), else ByteTokenizer"
    )
    parser.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        help="t: heads and KV cache split over t devices (default: the checkpoint's t, if present)",
    )
    parser.add_argument("--fake-devices", type=int, help="simulate N CPU devices (before JAX starts)")
    args = parser.parse_args(argv)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    sampling.check()  # before the checkpoint is read
    if args.fake_devices is not None:
        set_fake_devices(args.fake_devices)
    cfg, params = checkpoint.read_params(args.load)
    meta = checkpoint.read_meta(args.load, checkpoint.latest_step(args.load))
    tokenizer = pick_tokenizer(args, cfg, meta) if args.prompt is not None else None
    if tokenizer is not None:
        ids = tokenizer.encode(args.prompt)
    else:
        ids = prompt_ids(args.prompt_ids, cfg.vocab_size)
    out = generate(
        params,
        ids[None],
        cfg,
        args.max_new_tokens,
        sampling,
        tensor_parallel_size=tensor_parallel_size(args, cfg, meta),
    )[0]
    new = out[len(ids) :]
    if tokenizer is not None:
        print(tokenizer.decode(out))
    print(json.dumps({"prompt_tokens": int(len(ids)), "new_tokens": [int(t) for t in new]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
