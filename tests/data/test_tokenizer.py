"""Tokenizers (`ptd_jax/data/tokenizer.py`): the byte tokenizer, and GPT-2's byte-level BPE on a tiny GPT-2-format
vocab.json + merges.txt made by the `gpt2_files` fixture, checked against transformers' GPT2Tokenizer (slow, pure
Python: an implementation that is not the `tokenizers` library) on the same files."""

import json

import numpy as np
import pytest

from ptd_jax.data.tokenizer import ByteTokenizer, GPT2BPETokenizer, TokenizerError, build_tokenizer, from_description

TEXTS = [
    "def fibonacci(n):\n    return a",
    "  two  spaces,\ttab\n\nand 'quotes' don't",
    "héllo wörld ✓ 日本語 🙂",
    "The quick brown fox jumps over the lazy dog.",
    "x = [1, 2, 3]  # numbers 12345",
    "",
]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert (tok.vocab_size, tok.eod) == (257, 256) and tok.decode([104, 256, 105]) == "hi"


def test_gpt2_bpe_round_trip_and_merges(gpt2_files):
    tok = GPT2BPETokenizer(*gpt2_files)
    vocab = json.load(open(gpt2_files[0]))
    assert (tok.vocab_size, tok.eod) == (len(vocab), vocab["<|endoftext|>"]) and 300 < tok.vocab_size <= 400
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and tok.decode(ids) == text
    ids = tok.encode(TEXTS[0])
    assert len(ids) < len(TEXTS[0].encode()) / 2  # the merges apply: fewer tokens than bytes
    assert list(tok.encode("<|endoftext|>")) != [tok.eod]  # the text is text, as Megatron encodes documents
    assert tok.decode(tok.encode("✓")[:1]) == "\ufffd"  # a cut UTF-8 character: replaced, as Megatron decodes


def test_gpt2_bpe_equals_transformers_gpt2_tokenizer(gpt2_files):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.GPT2Tokenizer(*gpt2_files)  # the slow tokenizer: its own Python BPE
    assert type(theirs).__name__ == "GPT2Tokenizer"
    ours = GPT2BPETokenizer(*gpt2_files)
    for text in TEXTS:
        assert ours.encode(text).tolist() == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))


def test_description_rebuilds_the_tokenizer(gpt2_files, tmp_path):
    tok = GPT2BPETokenizer(*gpt2_files)
    again = from_description(json.loads(json.dumps(tok.describe())))
    assert again.encode(TEXTS[2]).tolist() == tok.encode(TEXTS[2]).tolist()
    assert isinstance(from_description(ByteTokenizer().describe()), ByteTokenizer)
    gone = {**tok.describe(), "merge_file": str(tmp_path / "moved.txt")}
    with pytest.raises(
        TokenizerError,
        match=r"tokenizer file '.*moved.txt' is gone: give --tokenizer-type "
        r"GPT2BPETokenizer --merge-file",
    ):
        from_description(gone)


def test_flags_that_do_not_fit(gpt2_files):
    with pytest.raises(TokenizerError, match="GPT2BPETokenizer needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", gpt2_files[0])
    with pytest.raises(TokenizerError, match="--vocab-file belong to --tokenizer-type GPT2BPETokenizer"):
        build_tokenizer("ByteTokenizer", gpt2_files[0])
