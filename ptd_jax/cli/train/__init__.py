"""`ptd-train`, by responsibility. Read in order:

    parser.py        every flag (Megatron-LM's names and defaults); nothing is checked there
    configs.py       the flags as ModelConfig, ParallelConfig (with `auto` resolved), TrainConfig, RunOptions
    checks.py        refusals before anything starts: flag combinations, output paths, data, kernel self-checks
    compile_only.py  --compile-only: XLA:GPU compiles for GPUs that are not here, and its report
    command.py       parse -> check -> start the backend -> train, and the exit codes

`main` is the console script; the functions below are what tests and notebooks call.
"""

from ptd_jax.cli.train.configs import (
    apply_demo_layout,
    fill_defaults,
    model_config_from_args,
    parallel_config_from_args,
    train_config_from_args,
)
from ptd_jax.cli.train.checks import apply_self_check
from ptd_jax.cli.train.command import main, run
from ptd_jax.cli.train.parser import build_parser

__all__ = [
    "apply_demo_layout",
    "apply_self_check",
    "build_parser",
    "fill_defaults",
    "main",
    "model_config_from_args",
    "parallel_config_from_args",
    "run",
    "train_config_from_args",
]
