"""`ptd-convert`: Hugging Face GPT-2, Llama, Mistral, Qwen2 <-> ptd_jax checkpoints (`ptd_jax/interop/` maps).

    ptd-convert from-hf --input HF_DIR --output CKPT_DIR   # then: ptd-train --load CKPT_DIR --finetune ...
    ptd-convert to-hf --input CKPT_DIR --output HF_DIR     # the newest step of any layout; params only
    ptd-convert to-hf ... --architecture LlamaForCausalLM  # else GPT-2 for learned positions, and for RoPE
                                                           # Qwen2 (QKV-only biases), Mistral (a window), or Llama

Checkpoints hold the canonical form, so a converted checkpoint loads under any (d, p, t, v). Bad input gets one
line and exit 2; nothing is written then.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ptd_jax.cli.args import OneLineParser
from ptd_jax.config import ConfigError
from ptd_jax.runtime.atomic import atomic_folder

ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""What to-hf writes (`interop.to_hf`)."""


def main(argv=None) -> int:
    from ptd_jax.cli.errors import run_tool

    return run_tool("ptd-convert", run, argv)


def run(argv) -> int:
    parser = OneLineParser(prog="ptd-convert", description=__doc__.splitlines()[0])
    parser.add_argument("direction", choices=["from-hf", "to-hf"])
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument(
        "--architecture", choices=ARCHITECTURES, help="to-hf: the HF architecture to write (default: the one that fits)"
    )
    args = parser.parse_args(argv)
    if args.architecture and args.direction != "to-hf":
        raise ConfigError(f"--architecture {args.architecture} applies to to-hf only (from-hf reads config.json)")
    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output={args.output!r} exists and is not an empty folder")
    from ptd_jax.train import checkpoint

    if args.direction == "from-hf":
        from ptd_jax.interop import from_hf

        cfg, params = from_hf(args.input)
        with atomic_folder(out) as tmp:
            checkpoint.save_params(tmp, cfg, params)
        architecture = json.loads((Path(args.input) / "config.json").read_text()).get("architectures")
    else:
        from ptd_jax.interop import to_hf

        if not Path(args.input).is_dir():
            raise ConfigError(f"input={args.input!r} is not a checkpoint folder")
        cfg, params = checkpoint.read_params(args.input, flag="--input")
        with atomic_folder(out) as tmp:
            to_hf(params, cfg, tmp, architecture=args.architecture)
        architecture = json.loads((out / "config.json").read_text())["architectures"]
    print(
        json.dumps(
            {
                "direction": args.direction,
                "output": str(out),
                "architecture": (architecture or [None])[0],
                "num_layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size,
                "vocab_size": cfg.vocab_size,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
