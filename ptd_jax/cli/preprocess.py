"""`ptd-preprocess`: text files, folders or JSONL -> a Megatron .bin/.idx pair (`data/preprocess.py` does the work).

Megatron's flag names: `--input PATH [PATH ...] --output-prefix PREFIX [--json-keys text] [--append-eod]
[--tokenizer-type {ByteTokenizer,GPT2BPETokenizer,HuggingFaceTokenizer} --vocab-file vocab.json
--merge-file merges.txt | --tokenizer-model tokenizer.json]`.
"""

from __future__ import annotations

import argparse
import json
import sys

from ptd_jax.cli.args import OneLineParser, add_tokenizer_args
from ptd_jax.cli.errors import run_tool
from ptd_jax.data.indexed_dataset import DataError, IndexedDatasetError
from ptd_jax.data.preprocess import DEFAULT_EXTENSIONS, build_indexed_dataset, check_output_prefix
from ptd_jax.data.tokenizer import build_tokenizer


def main(argv=None) -> int:
    return run_tool("ptd-preprocess", run, argv, interrupted="interrupted; nothing was written")


def run(argv) -> int:
    parser = OneLineParser(prog="ptd-preprocess", description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="text/JSONL files or folders")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--extensions",
        nargs="+",
        default=list(DEFAULT_EXTENSIONS),
        help="file suffixes taken from folders (the dot is optional)",
    )
    add_tokenizer_args(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (shown on a terminal only)")
    args = parser.parse_args(argv)
    key = "_".join(args.json_keys)
    prefix = f"{args.output_prefix}_{key}_document"
    extensions = tuple(e if e.startswith(".") else f".{e}" for e in args.extensions)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model)
        check_output_prefix(args.output_prefix, prefix)
        stats = build_indexed_dataset(
            args.input,
            prefix,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            extensions=extensions,
            progress=not args.no_progress,
            tokenizer=tokenizer,
        )
    except (DataError, IndexedDatasetError, OSError) as err:
        print(f"ptd-preprocess: error: {err}", file=sys.stderr)
        return 2
    if "replaced_bytes" in stats:
        print(
            f"ptd-preprocess: warning: {stats['replaced_bytes']} invalid UTF-8 byte(s) replaced by U+FFFD, "
            f"e.g. in {stats['replaced_in'][0]}",
            file=sys.stderr,
        )
    print(json.dumps(stats))
    files = ""
    if tokenizer.name == "GPT2BPETokenizer":
        files = f" --vocab-file {tokenizer.vocab_file} --merge-file {tokenizer.merge_file}"
    elif tokenizer.name == "HuggingFaceTokenizer":
        files = f" --tokenizer-model {tokenizer.tokenizer_model}"
    files = f" --tokenizer-type {tokenizer.name}{files}" if files else ""
    print(f"train with: ptd-train --data-path {prefix}{files}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
