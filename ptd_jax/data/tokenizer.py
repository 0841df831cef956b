"""Tokenizers, by Megatron's names: `--tokenizer-type {ByteTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer}` with
`--vocab-file` and `--merge-file` (GPT-2's) or `--tokenizer-model` (a Hugging Face tokenizer.json).

- `ByteTokenizer`: token i < 256 is byte i, token 256 is end-of-document (EOD). No vocabulary file, no download:
  every text has a lossless encoding.
- `GPT2BPETokenizer`: GPT-2's byte-level BPE from its vocab.json and merges.txt, through Hugging Face's
  `tokenizers` (GPT-2's pre-tokenizing regex, no prefix space, the byte-to-unicode alphabet); EOD is
  `<|endoftext|>`, V is the vocabulary's size (GPT-2's: 50,257), as in Megatron's `_GPT2BPETokenizer`. Text that
  spells `<|endoftext|>` is encoded as plain text, not as EOD.
- `HuggingFaceTokenizer`: any Hugging Face `tokenizer.json` (Llama's, Mistral's, GPT-NeoX's...), or a folder
  holding one, through `tokenizers`. As in Megatron's `_HuggingFaceTokenizer`, V is the tokenizer's size with its
  added tokens, a document is encoded with the tokenizer's special tokens (Llama's BOS), ids decode with theirs,
  and EOD is the eos token: the `eos_token` of a tokenizer_config.json beside the file, else the first of
  EOS_NAMES in the vocabulary. `describe()` records the file's path and SHA-256, so a changed file is noticed.

The model pads V to a multiple of 128·t (Megatron's --make-vocab-size-divisible-by); padded ids are never
produced. A tokenizer file that does not parse raises `TokenizerError`, one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ptd_jax.data.indexed_dataset import DataError

TOKENIZER_TYPES = ("ByteTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer")
GPT2_EOD = "<|endoftext|>"
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
"""End-of-text tokens (Llama 2 / Mistral, GPT-2 / NeoX / Qwen, Llama 3, Gemma) taken as EOD when no
tokenizer_config.json names the eos token."""
TOKENIZER_FILES = {
    "ByteTokenizer": (),
    "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
    "HuggingFaceTokenizer": ("--tokenizer-model",),
}
"""The file flags each --tokenizer-type takes (all of them required)."""


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


def _config_eos(folder: Path) -> str | None:
    """The eos token a tokenizer_config.json in `folder` names (transformers' source of eos_token_id), if any."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):  # an AddedToken written out: {"content": "</s>", ...}
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer.json (Megatron's `HuggingFaceTokenizer`, `--tokenizer-model`), through `tokenizers`."""

    name = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model):
        from tokenizers import Tokenizer

        flag = f"tokenizer_model={str(tokenizer_model)!r}"
        path = Path(tokenizer_model)
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise TokenizerError(f"{flag} is a folder without a tokenizer.json (a Hugging Face tokenizer's file)")
            path = path / "tokenizer.json"
        try:
            data = path.read_bytes()
        except OSError as err:
            raise TokenizerError(
                f"{flag} cannot be read ({err.strerror}): give a Hugging Face tokenizer.json or a folder holding one"
            ) from None
        try:
            tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # tokenizers raises Exception, or pyo3's PanicException (a BaseException)
            why = (str(err).strip().splitlines() or [type(err).__name__])[0]
            if isinstance(err, UnicodeDecodeError):
                why = "not UTF-8 text"
            raise TokenizerError(f"{flag} does not parse as a Hugging Face tokenizer ({why})") from None
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        eos = _config_eos(path.parent)
        eos = eos if eos in vocab else next((name for name in EOS_NAMES if name in vocab), None)
        if eos is None:
            raise TokenizerError(
                f"{flag} has no end-of-text token for EOD (no tokenizer_config.json eos_token beside it, none of "
                f"{', '.join(EOS_NAMES)} in its vocabulary)"
            )
        self._tokenizer = tokenizer
        self.tokenizer_model = str(path.absolute())
        self.sha256 = hashlib.sha256(data).hexdigest()
        # Megatron's len(tokenizer); ids past it (a vocabulary with holes) would overflow the embedding
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        self.eod = vocab[eos]

    def encode(self, text: str) -> np.ndarray:
        """`text`'s ids with the tokenizer's special tokens (Llama's BOS), as Megatron's `tokenizer(text).input_ids`."""
        return np.asarray(self._tokenizer.encode(text).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def describe(self) -> dict:
        return {
            "type": self.name,
            "vocab_size": self.vocab_size,
            "tokenizer_model": self.tokenizer_model,
            "sha256": self.sha256,
            "eod": self.eod,
        }


def build_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None, tokenizer_model=None):
    """Megatron's `build_tokenizer`: the tokenizer of `tokenizer_type` with its files (`TOKENIZER_FILES`)."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise TokenizerError(f"tokenizer_type={tokenizer_type!r} is not one of {TOKENIZER_TYPES}")
    given = {"--vocab-file": vocab_file, "--merge-file": merge_file, "--tokenizer-model": tokenizer_model}
    wanted = TOKENIZER_FILES[tokenizer_type]
    extra = [flag for flag, value in given.items() if value is not None and flag not in wanted]
    if extra:
        owners = " / ".join(dict.fromkeys(kind for kind, flags in TOKENIZER_FILES.items() for f in extra if f in flags))
        raise TokenizerError(f"{' and '.join(extra)} belong to --tokenizer-type {owners}, not {tokenizer_type}")
    missing = [flag for flag in wanted if given[flag] is None]
    if missing:
        what = {
            "GPT2BPETokenizer": "GPT-2's vocab.json and merges.txt",
            "HuggingFaceTokenizer": "a Hugging Face tokenizer.json, or a folder holding one",
        }[tokenizer_type]
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {' and '.join(missing)} ({what})")
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    return ByteTokenizer()


def from_description(description: dict):
    """The tokenizer a checkpoint recorded (`describe()`); its files must still be where they were (and a Hugging
    Face tokenizer.json unchanged)."""
    kind = description.get("type")
    if kind == "GPT2BPETokenizer":
        for flag, key in (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file")):
            if not Path(description.get(key) or "").is_file():
                raise TokenizerError(
                    f"the checkpoint's tokenizer file {description.get(key)!r} is gone: give "
                    f"--tokenizer-type GPT2BPETokenizer {flag} ..."
                )
        return GPT2BPETokenizer(description["vocab_file"], description["merge_file"])
    if kind == "HuggingFaceTokenizer":
        path = description.get("tokenizer_model")
        retry = "give --tokenizer-type HuggingFaceTokenizer --tokenizer-model ..."
        if not Path(path or "").is_file():
            raise TokenizerError(f"the checkpoint's tokenizer file {path!r} is gone: {retry}")
        tokenizer = HuggingFaceTokenizer(path)
        if description.get("sha256") not in (None, tokenizer.sha256):
            raise TokenizerError(
                f"the checkpoint's tokenizer file {path!r} has changed since training (sha256 "
                f"{description['sha256'][:12]}... then, {tokenizer.sha256[:12]}... now): {retry} to use it anyway"
            )
        return tokenizer
    return build_tokenizer(kind)


def training_tokenizer(
    tokenizer_type: str | None,
    vocab_file=None,
    merge_file=None,
    vocab_size: int | None = None,
    *,
    tokenizer_model=None,
):
    """ptd-train's rule: V is --tokenizer-type's vocabulary size; without the flag, --vocab-size gives V of data
    tokenized elsewhere (no tokenizer: None), and otherwise the byte tokenizer is the data's."""
    if tokenizer_type is not None and vocab_size is not None:
        raise TokenizerError(
            f"give one of --vocab-size {vocab_size} and --tokenizer-type {tokenizer_type} (which decides V), not both"
        )
    if tokenizer_type is None and (vocab_file or merge_file):
        raise TokenizerError("--vocab-file and --merge-file need --tokenizer-type GPT2BPETokenizer")
    if tokenizer_type is None and tokenizer_model:
        raise TokenizerError("--tokenizer-model needs --tokenizer-type HuggingFaceTokenizer")
    if tokenizer_type is None:
        return None if vocab_size is not None else ByteTokenizer()
    return build_tokenizer(tokenizer_type, vocab_file, merge_file, tokenizer_model)
