"""What the command-line tools share: argparse that fails with one line, and number types that refuse nan/inf.

Every tool (ptd-train, ptd-preprocess, ptd-schedule, ptd-convert, ptd-generate) reports bad input as one line
`<tool>: error: ...` and exit 2; argparse's own errors follow the same contract through `OneLineParser`.
"""

from __future__ import annotations

import argparse
import math

from ptd_jax.data.tokenizer import TOKENIZER_TYPES


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag gets one line (`<prog>: error: ...`) and exit 2, without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(text: str, ok, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def finite_float(text: str) -> float:
    return _number(text, math.isfinite, "a finite number")


def positive_float(text: str) -> float:
    return _number(text, lambda v: math.isfinite(v) and v > 0, "a positive finite number")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def add_tokenizer_args(parser, default: str | None = "ByteTokenizer", help_default: str = "") -> None:
    """Megatron's tokenizer flags on an argparse parser."""
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=default, help=help_default or None)
    parser.add_argument("--vocab-file", help="GPT-2's vocab.json (GPT2BPETokenizer)")
    parser.add_argument("--merge-file", help="GPT-2's merges.txt (GPT2BPETokenizer)")
    parser.add_argument(
        "--tokenizer-model", help="a Hugging Face tokenizer.json, or a folder holding one (HuggingFaceTokenizer)"
    )
