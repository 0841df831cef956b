"""`ptd-train`'s precision flags (Megatron's names): `--fp16` and its loss scaler, and the NaN/inf guard's
`--max-skipped-iters` (the mechanism: `ptd_jax/loss_scale.py`)."""

from __future__ import annotations

from ptd_jax.cli.args import finite_float
from ptd_jax.config import ConfigError, TrainConfig

SCALER_FLAGS = ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")


def add_precision_args(group) -> None:
    group.add_argument("--fp16", action="store_true", help="float16 compute with loss scaling, float32 master "
                       "weights")
    group.add_argument("--loss-scale", type=finite_float, help="--fp16: a static loss scale (default: dynamic)")
    group.add_argument("--initial-loss-scale", type=finite_float, help="--fp16: first dynamic scale (default 2^32)")
    group.add_argument("--min-loss-scale", type=finite_float, help="--fp16: floor of the dynamic scale (default 1)")
    group.add_argument("--loss-scale-window", type=int, help="--fp16: double the scale after this many iterations "
                       "without overflow (default 1000)")
    group.add_argument("--hysteresis", type=int, help="--fp16: overflows tolerated before the scale halves "
                       "(default 2)")
    group.add_argument("--max-skipped-iters", type=int, default=TrainConfig.max_skipped_iters,
                       help="stop after this many iterations in a row skipped for a non-finite loss or gradients")


def compute_dtype(args) -> str:
    """float32, or bfloat16 / float16 from --bf16 / --fp16 (not both)."""
    if args.bf16 and args.fp16:
        raise ConfigError("bf16=True and fp16=True: give one of --bf16 and --fp16")
    given = [name for name in SCALER_FLAGS if getattr(args, name) is not None]
    if given and not args.fp16:
        raise ConfigError(f"{given[0]}={getattr(args, given[0])} needs --fp16 (loss scaling is for float16 only)")
    return "bfloat16" if args.bf16 else "float16" if args.fp16 else "float32"


def train_config_fields(args) -> dict:
    """The TrainConfig fields the flags set (unset ones keep TrainConfig's defaults, Megatron's)."""
    fields = {name: getattr(args, name) for name in SCALER_FLAGS if getattr(args, name) is not None}
    return {**fields, "max_skipped_iters": args.max_skipped_iters}
