"""`ptd-preprocess`: text files, folders or JSONL -> a Megatron .bin/.idx pair (byte-level tokens, EOD appended).

Megatron's flag names: `--input PATH [PATH ...] --output-prefix PREFIX [--json-keys text] [--append-eod]`.
Like Megatron's tools/preprocess_data.py, the pair is written as PREFIX_<key>_document.{bin,idx}. A plain file is
one document; a .jsonl/.json file gives one document per line (the values of --json-keys); a folder is walked
recursively for files with the given --extensions. The writer also stores the largest token id in the stats
file of the cache folder beside the output (`indexed_dataset`), so training never scans freshly made data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ptd_jax.data.indexed_dataset import DataError, IndexedDatasetError, IndexedDatasetWriter, best_dtype
from ptd_jax.data.tokenizer import ByteTokenizer

DEFAULT_EXTENSIONS = (".txt", ".md", ".rst", ".py", ".jsonl", ".json")


def collect_files(inputs: list[str], extensions=DEFAULT_EXTENSIONS) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in extensions))
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"input {item!r} is neither a file nor a folder")
    return files


def iter_documents(path: Path, json_keys: list[str]):
    """Yield the texts of one input file."""
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{line_no} is not valid JSON ({err.msg})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{line_no} is a JSON {type(record).__name__}, expected an object")
                for key in json_keys:
                    if key not in record:
                        raise DataError(f"{path}:{line_no} has no key {key!r} (keys: {sorted(record)})")
                    yield str(record[key])
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def build_indexed_dataset(inputs: list[str], output_prefix: str, *, json_keys=("text",), append_eod: bool = True,
                          extensions=DEFAULT_EXTENSIONS, progress: bool = True, desc: str = "preprocess") -> dict:
    """Tokenize every document of `inputs` into output_prefix.{bin,idx}; returns counts. Nothing is left on disk
    when it fails (the writer renames temporary files only at the end)."""
    tokenizer = ByteTokenizer()
    files = collect_files(inputs, extensions)
    if not files:
        raise DataError(f"no input files found in {inputs} (extensions {list(extensions)})")
    docs = tokens = 0
    with IndexedDatasetWriter(output_prefix, dtype=best_dtype(tokenizer.vocab_size)) as writer:
        for path in tqdm(files, desc=desc, unit="file", disable=not progress, file=sys.stderr):
            for text in iter_documents(path, list(json_keys)):
                ids = tokenizer.encode(text)
                if len(ids) == 0:
                    continue
                if append_eod:
                    ids = np.append(ids, np.int32(tokenizer.eod))
                writer.add_document(ids)
                docs += 1
                tokens += len(ids)
        if docs == 0:
            raise DataError(f"the corpus {inputs} is empty: {len(files)} file(s) hold no text")
    return {"documents": docs, "tokens": tokens, "files": len(files), "prefix": output_prefix}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ptd-preprocess", description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="text/JSONL files or folders")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--extensions", nargs="+", default=list(DEFAULT_EXTENSIONS),
                        help="file suffixes taken from folders")
    parser.add_argument("--tokenizer-type", default="byte", choices=["byte"])
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    key = "_".join(args.json_keys)
    prefix = f"{args.output_prefix}_{key}_document"
    try:
        stats = build_indexed_dataset(args.input, prefix, json_keys=args.json_keys, append_eod=args.append_eod,
                                      extensions=tuple(args.extensions), progress=not args.no_progress)
    except (DataError, IndexedDatasetError, OSError) as err:
        print(f"ptd-preprocess: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(stats))
    print(f"train with: ptd-train --data-path {prefix}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
