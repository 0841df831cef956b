"""`--tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json` (`ptd_jax/data/tokenizer.py`) on small
tokenizers trained here with the `tokenizers` library on a few sentences (nothing is downloaded): the round trip,
V and EOD as Megatron takes them, `ptd-preprocess`'s tokens, bad files and flags, the checkpoint's record, and (slow,
once ptd-train passes the flag on) ptd-train then ptd-generate."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ptd_jax.cli.generate import main as generate_main
from ptd_jax.cli.generate import pick_tokenizer
from ptd_jax.cli.preprocess import main as preprocess_main
from ptd_jax.config import ConfigError
from ptd_jax.data.indexed_dataset import IndexedDataset
from ptd_jax.data.tokenizer import (
    HuggingFaceTokenizer,
    TokenizerError,
    build_tokenizer,
    from_description,
    training_tokenizer,
)
from tests.helpers.cli import exit_code

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    a, b = 0, 1\n    return a",
    "héllo wörld ✓ 日本語 🙂",
    "  two  spaces,\ttab\n\nand 'quotes' don't",
]


def llama_like(folder: Path, bos_template: bool = True) -> Path:
    """A byte-level BPE with Llama 2's specials (<unk>, <s>, </s>) and a BOS post-processor, as tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        min_frequency=1,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 3, trainer)
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def word_level(path: Path, specials=("[UNK]",), added=()) -> Path:
    """A WordLevel tokenizer on whitespace, with `added` special tokens appended after training."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=list(specials), show_progress=False))
    tok.add_special_tokens(list(added))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture
def llama_file(tmp_path):
    return llama_like(tmp_path / "llama")


def test_round_trip_bos_and_eod(llama_file):
    """Documents are encoded with the tokenizer's special tokens (BOS, as Megatron's tokenizer(text).input_ids);
    the text after BOS decodes to itself; EOD is </s>; V is the tokenizer's size."""
    theirs = Tokenizer.from_file(str(llama_file))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(llama_file))
    assert isinstance(tok, HuggingFaceTokenizer)
    assert (tok.vocab_size, tok.eod) == (theirs.get_vocab_size(with_added_tokens=True), theirs.token_to_id("</s>"))
    for text in SENTENCES + [""]:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.tolist() == theirs.encode(text).ids
        assert ids[0] == theirs.token_to_id("<s>") and tok.decode(ids[1:]) == text
    assert len(tok.encode(SENTENCES[0])) < len(SENTENCES[0]) * 2 / 3  # the merges apply: fewer tokens than bytes
    assert tok.decode(tok.encode("hi")) == "<s>hi"  # special tokens decode, as in Megatron's detokenize


def test_a_folder_holding_tokenizer_json_and_its_config_eos(tmp_path):
    """--tokenizer-model may name the folder (Megatron passes it to from_pretrained); a tokenizer_config.json
    beside the file names the eos token, as transformers reads it."""
    path = llama_like(tmp_path / "m")
    assert HuggingFaceTokenizer(tmp_path / "m").tokenizer_model == str(path.absolute())
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<unk>"}}))
    assert HuggingFaceTokenizer(path).eod == Tokenizer.from_file(str(path)).token_to_id("<unk>")
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<not-there>"}))
    assert HuggingFaceTokenizer(path).eod == Tokenizer.from_file(str(path)).token_to_id("</s>")


def test_vocab_size_counts_added_tokens_and_eos_names(tmp_path):
    """V is get_vocab_size(with_added_tokens=True), Megatron's len(tokenizer); Llama 3's <|end_of_text|> is EOD."""
    path = word_level(tmp_path / "w" / "tokenizer.json", added=["<|begin_of_text|>", "<|end_of_text|>"])
    theirs = Tokenizer.from_file(str(path))
    assert theirs.get_vocab_size(with_added_tokens=True) > theirs.get_vocab_size(with_added_tokens=False)
    tok = HuggingFaceTokenizer(path)
    assert tok.vocab_size == theirs.get_vocab_size(with_added_tokens=True)
    assert tok.eod == theirs.token_to_id("<|end_of_text|>") == tok.vocab_size - 1
    gpt = HuggingFaceTokenizer(word_level(tmp_path / "g" / "tokenizer.json", specials=("[UNK]", "<|endoftext|>")))
    assert gpt.eod == 1


def test_no_eos_is_refused_naming_the_file(tmp_path):
    path = word_level(tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match=r"^tokenizer_model='.*tokenizer.json' has no end-of-text token") as err:
        HuggingFaceTokenizer(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "content, why",
    [
        (None, r"cannot be read \(No such file or directory\)"),
        (b"", r"does not parse as a Hugging Face tokenizer \(EOF while parsing"),
        (b"not json", r"does not parse as a Hugging Face tokenizer \("),
        (b'{"model": 3}', r"does not parse as a Hugging Face tokenizer \("),
        (b"[1, 2]", r"does not parse as a Hugging Face tokenizer \("),
        (b"\xff\xfe\x00binary", r"does not parse as a Hugging Face tokenizer \(not UTF-8 text\)"),
    ],
)
def test_bad_files_stop_with_one_line(tmp_path, content, why):
    path = tmp_path / "x.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TokenizerError, match=rf"^tokenizer_model='{path}' {why}") as err:
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    assert "\n" not in str(err.value)


def test_a_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match=r"is a folder without a tokenizer.json"):
        HuggingFaceTokenizer(tmp_path)


def test_flags_pair_up(llama_file, tmp_path):
    """--tokenizer-model belongs to HuggingFaceTokenizer, which needs it; GPT-2's files do not mix in."""
    with pytest.raises(TokenizerError, match=r"^--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model \("):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(TokenizerError, match="--tokenizer-model belong to --tokenizer-type HuggingFaceTokenizer, not"):
        build_tokenizer("ByteTokenizer", tokenizer_model=str(llama_file))
    with pytest.raises(TokenizerError, match="--vocab-file belong to --tokenizer-type GPT2BPETokenizer, not Hugging"):
        build_tokenizer("HuggingFaceTokenizer", vocab_file="v.json", tokenizer_model=str(llama_file))
    with pytest.raises(TokenizerError, match="^--tokenizer-model needs --tokenizer-type HuggingFaceTokenizer$"):
        training_tokenizer(None, tokenizer_model=str(llama_file))
    tok = training_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(llama_file))
    assert tok.vocab_size == Tokenizer.from_file(str(llama_file)).get_vocab_size(with_added_tokens=True)
    assert training_tokenizer("ByteTokenizer").vocab_size == 257  # the callers without the keyword: unchanged


def test_ptd_generate_picks_the_flags_or_the_checkpoints_record(llama_file):
    tok = HuggingFaceTokenizer(llama_file)
    cfg = SimpleNamespace(vocab_size=tok.vocab_size)
    flags = dict(tokenizer_type=None, vocab_file=None, merge_file=None, tokenizer_model=None, load="ckpt")
    meta = {"tokenizer": tok.describe()}
    assert pick_tokenizer(SimpleNamespace(**flags), cfg, meta).sha256 == tok.sha256
    both = SimpleNamespace(**{**flags, "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(llama_file)})
    assert pick_tokenizer(both, cfg, {}).vocab_size == tok.vocab_size
    alone = SimpleNamespace(**{**flags, "tokenizer_model": str(llama_file)})
    with pytest.raises(ConfigError, match="--tokenizer-model needs --tokenizer-type HuggingFaceTokenizer"):
        pick_tokenizer(alone, cfg, meta)
    with pytest.raises(ConfigError, match="has 257 tokens but --load ckpt"):
        pick_tokenizer(SimpleNamespace(**{**flags, "tokenizer_type": "ByteTokenizer"}), cfg, meta)


def test_description_rebuilds_it_and_notices_a_changed_or_gone_file(tmp_path):
    path = llama_like(tmp_path / "m")
    tok = HuggingFaceTokenizer(path)
    record = json.loads(json.dumps(tok.describe()))
    assert record["type"] == "HuggingFaceTokenizer" and record["tokenizer_model"] == str(path.absolute())
    assert (record["vocab_size"], record["eod"]) == (tok.vocab_size, tok.eod) and len(record["sha256"]) == 64
    assert from_description(record).encode(SENTENCES[2]).tolist() == tok.encode(SENTENCES[2]).tolist()
    llama_like(tmp_path / "m", bos_template=False)  # the same vocabulary, another post-processor
    with pytest.raises(TokenizerError, match=r"tokenizer file '.*tokenizer.json' has changed since training"):
        from_description(record)
    path.unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer file '.*tokenizer.json' is gone: give --tokenizer-type Hug"):
        from_description(record)


def test_ptd_preprocess_writes_the_tokenizers_encoding_plus_eod(llama_file, tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in SENTENCES))
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(llama_file)]
    argv = ["--input", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "o"), "--no-progress", *flags]
    assert preprocess_main(argv) == 0
    out, err = capsys.readouterr()
    theirs = Tokenizer.from_file(str(llama_file))
    stats = json.loads(out.splitlines()[-1])
    assert stats["tokenizer"] == "HuggingFaceTokenizer"
    assert stats["vocab_size"] == theirs.get_vocab_size(with_added_tokens=True)
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {llama_file.absolute()}" in err
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert ds.dtype == np.uint16 and len(ds) == len(SENTENCES)
    for i, text in enumerate(SENTENCES):
        assert ds[i].tolist() == [*theirs.encode(text).ids, theirs.token_to_id("</s>")]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{bad}"], "{bad}' does not parse as a Hug"),
        (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{gone}"], "{gone}' cannot be read"),
        (["--tokenizer-type", "HuggingFaceTokenizer"], "HuggingFaceTokenizer needs --tokenizer-model"),
        (["--tokenizer-model", "{bad}"], "--tokenizer-model belong to --tokenizer-type HuggingFaceTokenizer, not Byte"),
    ],
)
def test_ptd_preprocess_bad_tokenizer_exits_2_with_one_line(tmp_path, capsys, flags, message):
    names = {"bad": str(tmp_path / "x.json"), "gone": str(tmp_path / "gone.json")}
    (tmp_path / "x.json").write_text("not json")
    (tmp_path / "d.txt").write_text("text")
    flags = [f.format(**names) for f in flags]
    argv = ["--input", str(tmp_path / "d.txt"), "--output-prefix", str(tmp_path / "o"), "--no-progress", *flags]
    assert exit_code(preprocess_main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ptd-preprocess: error: ") and message.format(**names) in err
    assert not list(tmp_path.glob("o*"))


def _train_passes_the_flag() -> bool:
    from ptd_jax.cli.train import command

    return "tokenizer_model" in Path(command.__file__).read_text()


@pytest.mark.slow
@pytest.mark.skipif(not _train_passes_the_flag(), reason="ptd-train does not pass --tokenizer-model on yet")
def test_train_then_generate_with_a_hugging_face_tokenizer(llama_file, tmp_path, capsys):
    """ptd-train takes V from the tokenizer.json and records it; ptd-generate reopens it from the checkpoint, and
    refuses it once the file has changed."""
    from tests.helpers.cli import run_train

    from ptd_jax.train import checkpoint

    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(llama_file)]
    (tmp_path / "corpus.txt").write_text("\n\n".join(SENTENCES) * 40)
    prefix = tmp_path / "d"
    assert preprocess_main(["--input", str(tmp_path / "corpus.txt"), "--output-prefix", str(prefix), *flags]) == 0
    small = "--fake-devices 1 --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16"
    run = "--train-iters 2 --global-batch-size 2 --micro-batch-size 1 --eval-iters 0 --no-progress --split 1,0,0"
    done = run_train(
        *small.split(), *run.split(), "--data-path", f"{prefix}_text_document", "--save", str(tmp_path / "ck"), *flags
    )
    assert done.returncode == 0, done.stderr
    tok = HuggingFaceTokenizer(llama_file)
    cfg, _ = checkpoint.read_params(tmp_path / "ck")
    assert cfg.vocab_size == tok.vocab_size
    capsys.readouterr()
    assert generate_main(["--load", str(tmp_path / "ck"), "--prompt", "The quick", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[-1])["prompt_tokens"] == len(tok.encode("The quick")) and out[0].startswith("<s>The quick")
    llama_like(tmp_path / "llama", bos_template=False)
    argv = ["--load", str(tmp_path / "ck"), "--prompt", "The quick", "--max-new-tokens", "3"]
    assert exit_code(generate_main, argv) == 2
    assert "has changed since training" in capsys.readouterr().err
