"""Tokenizers, by Megatron's names: `--tokenizer-type {ByteTokenizer, GPT2BPETokenizer}` with `--vocab-file` and
`--merge-file`.

- `ByteTokenizer`: token i < 256 is byte i, token 256 is end-of-document (EOD). No vocabulary file, no download:
  every text has a lossless encoding.
- `GPT2BPETokenizer`: GPT-2's byte-level BPE from its vocab.json and merges.txt, through Hugging Face's
  `tokenizers` (GPT-2's pre-tokenizing regex, no prefix space, the byte-to-unicode alphabet); EOD is
  `<|endoftext|>`, V is the vocabulary's size (GPT-2's: 50,257), as in Megatron's `_GPT2BPETokenizer`. Text that
  spells `<|endoftext|>` is encoded as plain text, not as EOD.

The model pads V to a multiple of 128·t (Megatron's --make-vocab-size-divisible-by); padded ids are never
produced. A tokenizer file that does not parse raises `TokenizerError`, one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ptd_jax.data.indexed_dataset import DataError

TOKENIZER_TYPES = ("ByteTokenizer", "GPT2BPETokenizer")
GPT2_EOD = "<|endoftext|>"


class TokenizerError(DataError):
    """A tokenizer file or flag that cannot work; the message is one line naming it."""


class ByteTokenizer:
    name = "ByteTokenizer"
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def describe(self) -> dict:
        """What a checkpoint records to rebuild this tokenizer (`from_description`)."""
        return {"type": self.name, "vocab_size": self.vocab_size}


def _read_vocab(path: Path) -> dict[str, int]:
    flag = f"--vocab-file {str(path)!r}"
    try:
        vocab = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as err:
        raise TokenizerError(f"{flag} cannot be read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise TokenizerError(f"{flag} is not UTF-8 text (a GPT-2 vocab.json is JSON)") from None
    except json.JSONDecodeError as err:
        raise TokenizerError(
            f"{flag} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
            f"expected GPT-2's vocab.json: an object of token -> id"
        ) from None
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerError(
            f"{flag} holds {type(vocab).__name__ if vocab else 'nothing'}, not an object of "
            f"token -> id (GPT-2's vocab.json)"
        )
    ids = list(vocab.values())
    bad = next((f"{k!r}: {v!r}" for k, v in vocab.items() if type(v) is not int or not 0 <= v < len(vocab)), None)
    if bad is not None or len(set(ids)) != len(ids):
        raise TokenizerError(
            f"{flag}: ids must be the integers 0..{len(vocab) - 1}, each once "
            f"({'e.g. ' + bad if bad else 'some id is repeated'})"
        )
    from tokenizers import pre_tokenizers

    missing = sorted(set(pre_tokenizers.ByteLevel.alphabet()) - set(vocab))
    if missing:
        raise TokenizerError(
            f"{flag} lacks {len(missing)} of the 256 byte-level symbols (e.g. {missing[0]!r}): "
            f"not a byte-level BPE vocabulary"
        )
    if GPT2_EOD not in vocab:
        raise TokenizerError(f"{flag} has no {GPT2_EOD!r} token (GPT-2's end of document)")
    return vocab


def _read_merges(path: Path, vocab: dict[str, int]) -> list[tuple[str, str]]:
    flag = f"--merge-file {str(path)!r}"
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise TokenizerError(f"{flag} cannot be read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise TokenizerError(f"{flag} is not UTF-8 text (a GPT-2 merges.txt is)") from None
    merges = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip() or (line_no == 1 and line.startswith("#version")):
            continue
        pair = line.split(" ")
        if len(pair) != 2 or not all(pair):
            shown = line if len(line) <= 40 else line[:37] + "..."
            raise TokenizerError(
                f"{flag} line {line_no} is {shown!r}, expected two symbols separated by one space (GPT-2's merges.txt)"
            )
        unknown = [s for s in (*pair, "".join(pair)) if s not in vocab]
        if unknown:
            raise TokenizerError(f"{flag} line {line_no} merges {line!r}, but {unknown[0]!r} is not in the vocab file")
        merges.append((pair[0], pair[1]))
    return merges


class GPT2BPETokenizer:
    """GPT-2's byte-level BPE (Megatron's `GPT2BPETokenizer`) from a vocab.json and a merges.txt."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file, merge_file):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        self.vocab_file, self.merge_file = str(Path(vocab_file).absolute()), str(Path(merge_file).absolute())
        vocab = _read_vocab(Path(vocab_file))
        merges = _read_merges(Path(merge_file), vocab)
        try:
            tokenizer = Tokenizer(models.BPE(vocab, merges))
        except Exception as err:  # tokenizers raises plain Exception; the checks above should leave none
            raise TokenizerError(
                f"--vocab-file {str(vocab_file)!r} and --merge-file {str(merge_file)!r} do not "
                f"load: {err}".splitlines()[0]
            ) from None
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        self._tokenizer = tokenizer
        self.vocab_size = len(vocab)
        self.eod = vocab[GPT2_EOD]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        """Text of `ids`; bytes that do not form UTF-8 become U+FFFD, as in Megatron (errors="replace")."""
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def describe(self) -> dict:
        return {
            "type": self.name,
            "vocab_size": self.vocab_size,
            "vocab_file": self.vocab_file,
            "merge_file": self.merge_file,
        }


def build_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None):
    """Megatron's `build_tokenizer`: the tokenizer of `tokenizer_type` with its files."""
    if tokenizer_type == "ByteTokenizer":
        given = [f for f, v in (("--vocab-file", vocab_file), ("--merge-file", merge_file)) if v is not None]
        if given:
            raise TokenizerError(
                f"{' and '.join(given)} belong to --tokenizer-type GPT2BPETokenizer, not ByteTokenizer"
            )
        return ByteTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        missing = [f for f, v in (("--vocab-file", vocab_file), ("--merge-file", merge_file)) if v is None]
        if missing:
            raise TokenizerError(
                f"--tokenizer-type GPT2BPETokenizer needs {' and '.join(missing)} (GPT-2's vocab.json and merges.txt)"
            )
        return GPT2BPETokenizer(vocab_file, merge_file)
    raise TokenizerError(f"tokenizer_type={tokenizer_type!r} is not one of {TOKENIZER_TYPES}")


def from_description(description: dict):
    """The tokenizer a checkpoint recorded (`describe()`); GPT-2's files must still be where they were."""
    kind = description.get("type")
    if kind == "GPT2BPETokenizer":
        for flag, key in (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file")):
            if not Path(description.get(key) or "").is_file():
                raise TokenizerError(
                    f"the checkpoint's tokenizer file {description.get(key)!r} is gone: give "
                    f"--tokenizer-type GPT2BPETokenizer {flag} ..."
                )
        return GPT2BPETokenizer(description["vocab_file"], description["merge_file"])
    return build_tokenizer(kind)


def training_tokenizer(tokenizer_type: str | None, vocab_file=None, merge_file=None, vocab_size: int | None = None):
    """ptd-train's rule: V is --tokenizer-type's vocabulary size; without the flag, --vocab-size gives V of data
    tokenized elsewhere (no tokenizer: None), and otherwise the byte tokenizer is the data's."""
    if tokenizer_type is not None and vocab_size is not None:
        raise TokenizerError(
            f"give one of --vocab-size {vocab_size} and --tokenizer-type {tokenizer_type} (which decides V), not both"
        )
    if tokenizer_type is None and (vocab_file or merge_file):
        raise TokenizerError("--vocab-file and --merge-file need --tokenizer-type GPT2BPETokenizer")
    if tokenizer_type is None:
        return None if vocab_size is not None else ByteTokenizer()
    return build_tokenizer(tokenizer_type, vocab_file, merge_file)
