"""Preprocessing (`ptd-preprocess`, `cli/preprocess.py`): text files, folders or JSONL -> a Megatron .bin/.idx pair
(tokens, EOD appended).

Megatron's flag names: `--input PATH [PATH ...] --output-prefix PREFIX [--json-keys text] [--append-eod]
[--tokenizer-type {ByteTokenizer,GPT2BPETokenizer,HuggingFaceTokenizer} --vocab-file vocab.json --merge-file
merges.txt | --tokenizer-model tokenizer.json]`. Token ids are stored as uint16 when the vocabulary is under 65,500
(the byte tokenizer, GPT-2's), else int32 (Llama 3's 128,256), as Megatron does.
Like Megatron's tools/preprocess_data.py, the pair is written as PREFIX_<key>_document.{bin,idx}. A plain file is
one document; a .jsonl/.json file gives one document per line (the values of --json-keys, which must be JSON
strings); a folder is walked recursively for files with the given --extensions. The writer also stores the token
range in the stats file of the cache folder beside the output (`indexed_dataset`), so training never scans
freshly made data.

Text is UTF-8. A file is refused as binary when it holds a NUL byte (executables, archives, random bytes, UTF-16
text), and as not UTF-8 when more than 1% of its bytes are not valid UTF-8; both are checked on the first 8 KiB of
every input before anything is written, and on the whole of each file as it is read. Below that fraction, a
stray bad byte (a truncated character, one Latin-1 quote) becomes U+FFFD, as Python's errors="replace" would,
and a warning line counts them. Everything is checked before the output is touched where it can be; whatever
fails later leaves nothing behind (`IndexedDatasetWriter`).
"""

from __future__ import annotations

import codecs
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ptd_jax.data.indexed_dataset import DataError, IndexedDatasetWriter, best_dtype, bin_path, idx_path
from ptd_jax.data.tokenizer import ByteTokenizer

DEFAULT_EXTENSIONS = (".txt", ".md", ".rst", ".py", ".jsonl", ".json")
JSON_SUFFIXES = (".jsonl", ".json")
SNIFF_BYTES = 8192  # the prefix of every input checked before writing starts (git's binary test uses 8000)
MAX_INVALID_FRACTION = 0.01  # of a file's bytes that may be invalid UTF-8 (replaced by U+FFFD)
_INVALID = re.compile("[\ud800-\udfff]")  # what errors="surrogateescape" makes of bad bytes, and lone surrogates
_JSON_TYPES = {
    type(None): "null",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


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


def refuse_nul(data: bytes, where) -> None:
    if b"\x00" in data:
        raise DataError(f"{where} holds NUL bytes: a binary file (or UTF-16 text), not UTF-8 text")


def replace_invalid(text: str) -> tuple[str, int]:
    """`text` (decoded with errors="surrogateescape") with each bad byte and lone surrogate replaced by U+FFFD,
    and their count."""
    return (text, 0) if text.isascii() else _INVALID.subn("\ufffd", text)


def check_fraction(invalid: int, total: int, where) -> None:
    if invalid > MAX_INVALID_FRACTION * total:
        raise DataError(
            f"{where} is not UTF-8 text: {invalid} of {total} bytes are not valid UTF-8 (more than "
            f"{MAX_INVALID_FRACTION:.0%}); binary files and other encodings are refused"
        )


def sniff(path: Path) -> None:
    """Refuse a binary or non-UTF-8 file from its first SNIFF_BYTES, before any output is written."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    refuse_nul(head, path)
    text = codecs.getincrementaldecoder("utf-8")("surrogateescape").decode(head, final=False)  # a cut tail is fine
    check_fraction(len(_INVALID.findall(text)), len(head), path)


def json_text(value, key: str, where: str) -> str:
    """The text under `key`: only a JSON string is text (Megatron would turn null into "None")."""
    if isinstance(value, str):
        return value
    shown = json.dumps(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    what = "null" if value is None else f"{_JSON_TYPES[type(value)]} ({shown})"
    raise DataError(f"{where}: key {key!r} holds {what}, expected a string")


def iter_documents(path: Path, json_keys: list[str], invalid: dict):
    """Yield the texts of one input file; the count of bytes replaced by U+FFFD goes to `invalid[str(path)]`."""
    if path.suffix not in JSON_SUFFIXES:
        data = path.read_bytes()
        refuse_nul(data, path)
        text, count = replace_invalid(data.decode("utf-8", "surrogateescape"))
        check_fraction(count, len(data), path)
        if count:
            invalid[str(path)] = count
        yield text
        return
    count = total = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            total += len(raw)
            refuse_nul(raw, f"{path}:{line_no}")
            line = raw.decode("utf-8", "surrogateescape")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{line_no} is not valid JSON ({err.msg}); expected one JSON object per line"
                ) from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{line_no} is {_JSON_TYPES[type(record)]}, expected a JSON object")
            for key in json_keys:
                if key not in record:
                    raise DataError(f"{path}:{line_no} has no key {key!r} (keys: {sorted(record)})")
                text, bad = replace_invalid(json_text(record[key], key, f"{path}:{line_no}"))
                count += bad
                yield text
    check_fraction(count, total, path)
    if count:
        invalid[str(path)] = count


def build_indexed_dataset(
    inputs: list[str],
    output_prefix: str,
    *,
    json_keys=("text",),
    append_eod: bool = True,
    extensions=DEFAULT_EXTENSIONS,
    progress: bool = True,
    desc: str = "preprocess",
    tokenizer=None,
) -> dict:
    """Tokenize every document of `inputs` into output_prefix.{bin,idx} (`tokenizer`: default the byte
    tokenizer); returns counts. The inputs are found and sniffed before the output is opened; nothing is left on
    disk when it fails (`IndexedDatasetWriter`)."""
    tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
    files = collect_files(inputs, extensions)
    if not files:
        raise DataError(f"no input files found in {inputs} (extensions {list(extensions)})")
    if tuple(json_keys) != ("text",) and not any(path.suffix in JSON_SUFFIXES for path in files):
        raise DataError(
            f"--json-keys {' '.join(json_keys)} applies to JSON inputs ({'/'.join(sorted(JSON_SUFFIXES))}), and "
            f"{inputs} hold none (it would only rename the output)"
        )
    for path in files:
        sniff(path)
    docs = tokens = 0
    invalid: dict[str, int] = {}
    with IndexedDatasetWriter(output_prefix, dtype=best_dtype(tokenizer.vocab_size)) as writer:
        # disable=None: the bar only on a terminal, so that logs and piped stderr hold messages alone
        for path in tqdm(files, desc=desc, unit="file", disable=None if progress else True, file=sys.stderr):
            for text in iter_documents(path, list(json_keys), invalid):
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
    stats = {
        "documents": docs,
        "tokens": tokens,
        "files": len(files),
        "prefix": output_prefix,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
    }
    if invalid:
        stats.update(replaced_bytes=sum(invalid.values()), replaced_in=sorted(invalid)[:10])
    return stats


def check_output_prefix(output_prefix: str, prefix: str) -> None:
    """Refuse, naming --output-prefix, an output that cannot be written: an empty prefix or one that ends in a
    folder, a .bin/.idx destination that is a folder, a file where a folder must be, an unwritable folder."""
    flag = f"--output-prefix {output_prefix!r}"
    if not output_prefix.strip():
        raise DataError("--output-prefix is empty: give a path prefix such as data/my-corpus")
    if output_prefix.endswith(("/", os.sep)) or Path(output_prefix).name in ("", ".", ".."):
        raise DataError(
            f"{flag} names a folder, not a file prefix: give one such as {os.path.join(output_prefix, 'my-corpus')!r}"
        )
    try:
        for dst in (bin_path(prefix), idx_path(prefix)):
            if dst.is_dir():
                raise DataError(f"{flag}: the output {dst} is a folder")
        folder = Path(prefix).parent
        while not folder.exists() and not folder.is_symlink():
            folder = folder.parent
    except OSError as err:  # e.g. a name too long
        raise DataError(f"{flag}: {err.strerror}") from None
    if not folder.is_dir():
        raise DataError(f"{flag}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DataError(f"{flag}: the folder {folder} is not writable")
