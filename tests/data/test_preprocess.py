import json
import subprocess
import sys

import numpy as np

from ptd_jax.data.indexed_dataset import IndexedDataset
from ptd_jax.cli.preprocess import main
from ptd_jax.data.tokenizer import ByteTokenizer


def test_folder_text_and_jsonl(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("héllo")
    (src / "sub" / "b.md").write_text("world")
    (src / "skip.bin").write_bytes(b"\x00\x01")
    (src / "c.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert main(["--input", str(src), "--output-prefix", str(tmp_path / "out"), "--no-progress"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["documents"] == 4 and stats["files"] == 3
    ds = IndexedDataset(tmp_path / "out_text_document")
    tok = ByteTokenizer()
    texts = sorted(tok.decode(ds[i]) for i in range(len(ds)))
    assert texts == sorted(["héllo", "world", "one", "two"])
    assert all(ds[i][-1] == tok.eod for i in range(len(ds)))  # --append-eod is Megatron's GPT default here
    assert ds.dtype == np.uint16


def test_json_keys(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "abc"}) + "\n")
    assert (
        main(
            [
                "--input",
                str(tmp_path / "d.jsonl"),
                "--output-prefix",
                str(tmp_path / "o"),
                "--json-keys",
                "body",
                "--no-append-eod",
                "--no-progress",
            ]
        )
        == 0
    )
    np.testing.assert_array_equal(IndexedDataset(tmp_path / "o_body_document")[0], [97, 98, 99])


def test_empty_corpus_exits_2_and_writes_nothing(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ptd_jax.cli.preprocess",
            "--input",
            str(tmp_path / "in"),
            "--output-prefix",
            str(out / "x"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "is empty: 1 file(s) hold no text" in proc.stderr
    assert list(out.iterdir()) == []


def test_missing_input_and_bad_json(tmp_path, capsys):
    assert main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "is neither a file nor a folder" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    assert main(["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "bad.jsonl:2 is not valid JSON" in capsys.readouterr().err
    assert not list(tmp_path.glob("o*"))


def test_gpt2_bpe_tokens_as_uint16(gpt2_files, tmp_path, capsys):
    """--tokenizer-type GPT2BPETokenizer: each document is the tokenizer's encoding plus its <|endoftext|>, stored
    as uint16 (V < 65,500, Megatron's rule), and the hint names the flags ptd-train needs."""
    from ptd_jax.data.tokenizer import GPT2BPETokenizer

    texts = ["def fibonacci(n):\n    return a", "héllo wörld ✓"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1]]
    assert (
        main(["--input", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "o"), "--no-progress", *flags])
        == 0
    )
    out, err = capsys.readouterr()
    tok = GPT2BPETokenizer(*gpt2_files)
    assert json.loads(out.splitlines()[-1])["tokenizer"] == "GPT2BPETokenizer"
    assert f"--tokenizer-type GPT2BPETokenizer --vocab-file {tok.vocab_file} --merge-file {tok.merge_file}" in err
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert ds.dtype == np.uint16 and len(ds) == 2
    for i, text in enumerate(texts):
        np.testing.assert_array_equal(ds[i], [*tok.encode(text), tok.eod])
        assert tok.decode(ds[i][:-1]) == text
