"""Bad input to `ptd-preprocess`, `ptd-schedule` and the .bin/.idx reader (issue #15). Every case of the tables:
exit 2, one stderr line `<tool>: error: ...` naming the flag or the file, no traceback, and nothing new on disk
(the files under the case's folder are the inputs it made, no more)."""

import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from ptd_jax.cli import preprocess
from ptd_jax.data import GPTData
from ptd_jax.data import indexed_dataset as idx
from ptd_jax.data.indexed_dataset import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from ptd_jax.data.tokenizer import ByteTokenizer
from ptd_jax.cli import schedule as schedule_cli


def write(name: str, data) -> str:
    """An input file under the current folder (the case's tmp_path); returns its name."""
    path = Path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return name


def elf_head(name: str) -> str:
    """The first 64 KiB of this interpreter's executable (an ELF binary on Linux)."""
    with open(sys.executable, "rb") as f:
        return write(name, f.read(1 << 16))


def folder(name: str) -> str:
    Path(name).mkdir(parents=True)
    return name


def jsonl(*records) -> str:
    return write("d.jsonl", "".join(r + "\n" for r in records))


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run(main, argv, capsys) -> tuple[int, list[str]]:
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse
        code = stop.code
    return code, capsys.readouterr().err.splitlines()


def pre(*inputs, prefix="out", extra=()):
    return ["--input", *inputs, "--output-prefix", prefix, "--no-progress", *extra]


def gpt2(vocab=None, merges=None, flags=("--vocab-file", "vocab.json", "--merge-file", "merges.txt")) -> list[str]:
    """--tokenizer-type GPT2BPETokenizer on a hand-made vocab.json and merges.txt in the case's folder (the byte
    alphabet, "he" and <|endoftext|>; one merge), either file's text replaced by `vocab` or `merges`."""
    from tokenizers import pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "<|endoftext|>"]
    write("vocab.json", json.dumps({s: i for i, s in enumerate(symbols)}) if vocab is None else vocab)
    write("merges.txt", "#version: 0.2\nh e\n" if merges is None else merges)
    return ["--tokenizer-type", "GPT2BPETokenizer", *flags]


ASCII = b"plain text line\n" * 600  # 9600 bytes: past the 8 KiB sniff

PREPROCESS_CASES = [
    # binary and non-UTF-8 input
    (lambda: pre(write("r.txt", np.random.default_rng(0).bytes(4096))), "r.txt holds NUL bytes: a binary file"),
    (lambda: pre(elf_head("prog")), "prog holds NUL bytes"),
    (lambda: pre(write("u16.txt", "hello".encode("utf-16"))), "u16.txt holds NUL bytes"),
    (
        lambda: pre(write("latin1.txt", "café naïve résumé\n".encode("latin-1") * 20)),
        "latin1.txt is not UTF-8 text: 80 of 360 bytes",
    ),
    (
        lambda: pre(write("late.txt", ASCII + b"\xff" * 200), prefix="new/sub/out"),  # found after the sniff
        "late.txt is not UTF-8 text: 200 of 9800 bytes",
    ),
    (
        lambda: pre(write("late.jsonl", b'{"text": "abc"}\n' * 600 + b'{"text": "\x00"}\n'), prefix="new/out"),
        "late.jsonl:601 holds NUL bytes",
    ),
    # JSONL values and records
    (lambda: pre(jsonl('{"text": null}')), "d.jsonl:1: key 'text' holds null, expected a string"),
    (lambda: pre(jsonl('{"text": "ok"}', '{"text": 12345}')), "d.jsonl:2: key 'text' holds a number (12345)"),
    (lambda: pre(jsonl('{"text": {"a": 1}}')), "key 'text' holds an object"),
    (lambda: pre(jsonl('{"text": ["a"]}')), "key 'text' holds an array"),
    (lambda: pre(jsonl('{"text": true}')), "key 'text' holds a boolean"),
    (lambda: pre(jsonl("[1, 2]")), "d.jsonl:1 is an array, expected a JSON object"),
    (lambda: pre(jsonl('{"body": "x"}')), "d.jsonl:1 has no key 'text'"),
    (lambda: pre(write("bad.jsonl", '{"text": "ok"}\n{oops\n')), "bad.jsonl:2 is not valid JSON"),
    (lambda: pre(write("bad.jsonl", '{"text": "ok"}\n{oops\n'), prefix="new/deeper/o"), "bad.jsonl:2 is not valid"),
    # the output
    (lambda: pre(write("a.txt", "x"), prefix=""), "--output-prefix is empty"),
    (lambda: pre(write("a.txt", "x"), prefix="outdir/"), "--output-prefix 'outdir/' names a folder"),
    (lambda: pre(write("a.txt", "x"), prefix="."), "--output-prefix '.' names a folder"),
    (lambda: pre(write("a.txt", "x"), prefix=write("afile", "") + "/x"), "'afile/x': afile is a file, not a folder"),
    (lambda: pre(write("a.txt", "x"), prefix=write("afile", "") + "/deeper/x"), "afile is a file, not a folder"),
    (lambda: pre(write("a.txt", "x"), prefix="x" * 300), "--output-prefix 'xxxxxxxx"),
    (lambda: pre(write("a.txt", "x"), prefix="x" * 300), "File name too long"),
    (
        lambda: [folder("out_text_document.idx"), *pre(write("a.txt", "x"))][1:],
        "the output out_text_document.idx is a folder",
    ),
    (
        lambda: [folder("out_text_document.bin"), *pre(write("a.txt", "x"))][1:],
        "the output out_text_document.bin is a folder",
    ),
    # inputs and flags (the cases of tests/data/test_preprocess.py among them)
    (lambda: pre("nope"), "input 'nope' is neither a file nor a folder"),
    (lambda: pre(write("in/empty.txt", "") and "in", prefix=folder("o") + "/x"), "is empty: 1 file(s) hold no text"),
    (lambda: pre(write("in/skip.bin", "x") and "in"), "no input files found in ['in']"),
    (lambda: ["--input", write("a.txt", "x")], "the following arguments are required: --output-prefix"),
    (lambda: pre(write("a.txt", "x"), extra=["--tokenizer-type", "gpt2"]), "argument --tokenizer-type: invalid"),
    # tokenizer files (GPT-2's vocab.json and merges.txt) that do not parse
    (
        lambda: pre(write("a.txt", "x"), extra=gpt2(vocab="{not json")),
        "--vocab-file 'vocab.json' is not valid JSON (Expecting property name enclosed in double quotes at line 1",
    ),
    (lambda: pre(write("a.txt", "x"), extra=gpt2(vocab="[1, 2]")), "--vocab-file 'vocab.json' holds list, not an"),
    (lambda: pre(write("a.txt", "x"), extra=gpt2(vocab=b"\xff\xfe{}")), "'vocab.json' is not UTF-8 text"),
    (lambda: pre(write("a.txt", "x"), extra=gpt2(vocab='{"a": 0, "b": 0}')), "ids must be the integers 0..1"),
    (lambda: pre(write("a.txt", "x"), extra=gpt2(vocab='{"a": 0}')), "lacks 255 of the 256 byte-level symbols"),
    (
        lambda: pre(write("a.txt", "x"), extra=gpt2(flags=("--vocab-file", "vocab.json", "--merge-file", "no.txt"))),
        "--merge-file 'no.txt' cannot be read: No such file or directory",
    ),
    (
        lambda: pre(write("a.txt", "x"), extra=gpt2(merges="#version: 0.2\nhello\n")),
        "--merge-file 'merges.txt' line 2 is 'hello', expected two symbols separated by one space",
    ),
    (
        lambda: pre(write("a.txt", "x"), extra=gpt2(merges="zz qq\n")),
        "--merge-file 'merges.txt' line 1 merges 'zz qq', but 'zz' is not in the vocab file",
    ),
    (
        lambda: pre(write("a.txt", "x"), extra=gpt2(merges=np.random.default_rng(0).bytes(512))),
        "--merge-file 'merges.txt' is not UTF-8 text",
    ),
    (
        lambda: pre(write("a.txt", "x"), extra=gpt2(flags=())),
        "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file",
    ),
    (
        lambda: pre(write("a.txt", "x"), extra=["--vocab-file", write("v.json", "{}")]),
        "--vocab-file belong to --tokenizer-type GPT2BPETokenizer, not ByteTokenizer",
    ),
]

SCHEDULE_CASES = [
    (lambda: ["--plot", "nodir/x.png"], "argument --plot: the folder 'nodir' of 'nodir/x.png' does not exist"),
    (lambda: ["--plot", write("afile", "") + "/x.png"], "the folder 'afile' of 'afile/x.png' is not a folder"),
    (lambda: ["--plot", "x.notanimage"], "'x.notanimage' has no image extension: name a .png, .pdf, .svg file"),
    (lambda: ["--plot", "x"], "'x' has no image extension"),
    (lambda: ["--plot", folder("plots")], "argument --plot: 'plots' is a folder"),
    (lambda: ["--plot", folder("d.png")], "'d.png' is a folder"),
    (lambda: ["--plot", ""], "argument --plot: the file name is empty"),
    (lambda: ["--plot", "x" * 300 + ".png"], "argument --plot: 'xxxxxxxx"),
    (lambda: ["--plot", "x" * 300 + ".png"], "File name too long"),
    *[
        (lambda r=r: [f"--backward-ratio={r}"], f"argument --backward-ratio: '{r}' is not a positive finite number")
        for r in ("-1", "0", "nan", "inf", "-inf")
    ],
    (lambda: ["--backward-ratio", "two"], "argument --backward-ratio: 'two' is not a number"),
    (lambda: ["-v", "0"], "argument --virtual-stages/-v: 0 is not a positive integer"),
    (lambda: ["-p", "0"], "argument --pipeline-model-parallel-size/-p: 0 is not a positive integer"),
    (lambda: ["-p", "-2"], "argument --pipeline-model-parallel-size/-p: -2 is not a positive integer"),
    (lambda: ["-m", "0"], "argument --num-microbatches/-m: 0 is not a positive integer"),
    (lambda: ["-m", "-3"], "argument --num-microbatches/-m: -3 is not a positive integer"),
    (lambda: ["-p", "abc"], "argument --pipeline-model-parallel-size/-p: 'abc' is not an integer"),
    (lambda: ["--microbatch-group-size", "0"], "argument --microbatch-group-size: 0 is not a positive integer"),
    (lambda: ["--schedule", "gpipe", "--microbatch-group-size", "4"], "G=4 needs --schedule interleaved"),
    (lambda: ["--schedule", "zb"], "argument --schedule: invalid choice: 'zb'"),
    (lambda: ["-p", "1000", "-m", "1000"], "make 2·p·v·m = 4000000 actions, more than this tool builds"),
    (lambda: ["-p", "16", "-m", "512", "--plot", "s.png"], "make 32768 actions, more than a timeline draws (8192)"),
    # the rules of the schedules (tests/parallel/pipeline/test_schedule.py's case among them)
    (lambda: ["--schedule", "interleaved", "-p", "4", "-m", "6"], "m % G == 0"),
    (lambda: ["--schedule", "1f1b", "-v", "2"], "schedule='1f1b' runs 1 model chunk(s) per rank: needs v=1, got v=2"),
    (lambda: ["--schedule", "interleaved", "-p", "1"], "schedule='interleaved' needs p >= 2 pipeline ranks, got p=1"),
    (lambda: ["-p", "4", "-m", "8", "--microbatch-group-size", "3"], "p <= G <= m"),
]


@pytest.mark.parametrize(
    "tool, make_argv, fragment",
    [("ptd-preprocess", *case) for case in PREPROCESS_CASES] + [("ptd-schedule", *case) for case in SCHEDULE_CASES],
)
def test_bad_input(tool, make_argv, fragment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = make_argv()
    before = files_under(tmp_path)
    main = preprocess.main if tool == "ptd-preprocess" else schedule_cli.main
    code, err = run(main, argv, capsys)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith(f"{tool}: error: "), err
    assert fragment in err[0]
    assert "Traceback" not in err[0]
    assert files_under(tmp_path) == before


def test_the_hand_made_gpt2_files_load(tmp_path, monkeypatch, capsys):
    """The tokenizer rows above fail on what each replaces, not on the rest of `gpt2()`'s files."""
    monkeypatch.chdir(tmp_path)
    assert preprocess.main(pre(write("a.txt", "hehe"), extra=gpt2())) == 0
    assert IndexedDataset("out_text_document")[0].tolist() == [256, 256, 257]  # "he" "he" <|endoftext|>


def test_ctrl_c_in_preprocess_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    jsonl('{"text": "one"}', '{"text": "two"}', '{"text": "three"}')
    before = files_under(tmp_path)
    calls = []
    encode = ByteTokenizer.encode

    def interrupted(self, text):
        calls.append(text)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return encode(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode", interrupted)
    code, err = run(preprocess.main, pre("d.jsonl", prefix="new/out"), capsys)
    assert code == 130 and err == ["ptd-preprocess: interrupted; nothing was written"]
    assert files_under(tmp_path) == before  # no temporaries, no new folder


def test_ctrl_c_in_schedule_plot_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def interrupted(sched, path, ratio=None, times=None):
        Path(path).write_bytes(b"half a PNG")
        raise KeyboardInterrupt

    monkeypatch.setattr(schedule_cli, "plot", interrupted)
    code, err = run(schedule_cli.main, ["--plot", "s.png"], capsys)
    assert code == 130 and err == ["ptd-schedule: interrupted; nothing was written"]
    assert files_under(tmp_path) == set()


def test_schedule_defaults_and_plot_formats(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert schedule_cli.main(["--schedule", "1f1b", "-p", "2", "-m", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["p"] == 2  # v defaults to 1 for 1f1b
    assert schedule_cli.main(["-p", "2", "-m", "2", "-v", "3", "--json", "--plot", "s.SVG"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0].count("F2.0") == 1  # -v 3 taken as given
    assert files_under(tmp_path) == {"s.SVG"} and b"<svg" in Path("s.SVG").read_bytes()[:400]


def test_a_few_bad_bytes_pass_with_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write("a.txt", b"caf\xe9 " + b"x" * 200)  # one Latin-1 byte in UTF-8 text
    jsonl('{"text": "' + "y" * 200 + '\\ud800"}')  # a lone surrogate, escaped
    assert preprocess.main(pre("a.txt", "d.jsonl")) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "ptd-preprocess: warning: 2 invalid UTF-8 byte(s) replaced by U+FFFD, e.g. in a.txt"
    ds = IndexedDataset("out_text_document")
    assert ByteTokenizer().decode(ds[0][:7]) == "caf\ufffd "
    assert not [f for f in files_under(tmp_path) if "tmp" in f or "old" in f]


def test_a_rerun_replaces_the_pair(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert preprocess.main(pre(write("a.txt", "first"))) == 0
    assert preprocess.main(pre(write("a.txt", "second"))) == 0
    assert ByteTokenizer().decode(IndexedDataset("out_text_document")[0][:-1]) == "second"
    assert sorted(f for f in files_under(tmp_path) if "/" not in f) == [
        "a.txt",
        "cache",
        "out_text_document.bin",
        "out_text_document.idx",
    ]


# The writer and the reader

DOCS = [[1, 2, 3], [256, 7]]


def write_pair(prefix, docs=DOCS, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype=dtype) as writer:
        for doc in docs:
            writer.add_document(doc)


def test_a_failed_idx_rename_restores_the_old_pair(tmp_path, monkeypatch):
    write_pair(tmp_path / "ds")
    old = {name: (tmp_path / name).read_bytes() for name in ("ds.bin", "ds.idx")}
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith(".idx"):
            raise OSError("disk on fire")
        real_replace(src, dst)

    monkeypatch.setattr(idx.os, "replace", replace)
    with pytest.raises(OSError, match="disk on fire"):
        write_pair(tmp_path / "ds", [[9, 9, 9, 9]])
    monkeypatch.undo()
    assert {name: (tmp_path / name).read_bytes() for name in old} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "ds.bin", "ds.idx"]


def test_an_idx_folder_appearing_during_the_write_leaves_nothing(tmp_path):
    with (
        pytest.raises(IndexedDatasetError, match=r"ds\.idx is a folder"),
        IndexedDatasetWriter(tmp_path / "new" / "ds") as writer,
    ):
        writer.add_document([1, 2])
        (tmp_path / "new" / "ds.idx").mkdir()
    assert files_under(tmp_path) == {"new", "new/ds.idx"}


@pytest.mark.parametrize(
    "tokens, message",
    [([-1, 2], r"token ids in \[-1, 2\] do not fit dtype=int32"), ([1.5], "dtype=float64 are not integers")],
)
def test_the_writer_refuses_negative_and_fractional_ids(tmp_path, tokens, message):
    with pytest.raises(IndexedDatasetError, match=message):
        write_pair(tmp_path / "new" / "ds", [tokens], np.int32)
    assert files_under(tmp_path) == set()
    with pytest.raises(IndexedDatasetError, match="dtype=float32 is not an integer dtype"):
        IndexedDatasetWriter(tmp_path / "ds", dtype=np.float32)


def hand_made(prefix: Path, tokens: np.ndarray, code: int) -> None:
    """A one-document pair written byte by byte (no stats file), as another tool might."""
    prefix.with_suffix(".bin").write_bytes(tokens.tobytes())
    prefix.with_suffix(".idx").write_bytes(
        b"MMIDIDX\x00\x00"
        + struct.pack("<QBQQ", 1, code, 1, 2)
        + struct.pack("<i", len(tokens))
        + struct.pack("<q", 0)
        + struct.pack("<2q", 0, 1)
    )


def test_negative_ids_in_an_int32_bin_are_refused(tmp_path):
    hand_made(tmp_path / "m", np.array([5, -3, 7], dtype="<i4"), code=4)
    ds = IndexedDataset(tmp_path / "m")  # opening reads the .idx only
    with pytest.raises(IndexedDatasetError, match=r"m\.bin holds token id -3 \(int32\): token ids must be >= 0"):
        ds.max_token()
    assert json.loads((idx.default_cache_dir(tmp_path / "m") / "m.stats.json").read_text())["min_token"] == -3
    with pytest.raises(IndexedDatasetError, match="token id -3"):  # now from the stats, without a scan
        IndexedDataset(tmp_path / "m").max_token()
    with pytest.raises(IndexedDatasetError, match=r"m\.bin holds token id -3"):  # what ptd-train meets
        GPTData(tmp_path / "m", seq_length=2, global_batch_size=1, eval_iters=0, seed=0, vocab_size=257)


@pytest.mark.parametrize("code, dtype", [(6, "<f8"), (7, "<f4")])
def test_floating_point_dtype_codes_are_refused(tmp_path, code, dtype):
    hand_made(tmp_path / "m", np.array([1.0, 2.0], dtype=dtype), code=code)
    with pytest.raises(
        IndexedDatasetError,
        match=rf"m\.idx has dtype code={code} \(float..\): token ids must be "
        r"integers",
    ):
        IndexedDataset(tmp_path / "m")


def test_stats_without_min_token_are_rescanned(tmp_path):
    write_pair(tmp_path / "ds")
    stats_file = idx.default_cache_dir(tmp_path / "ds") / "ds.stats.json"
    stats = json.loads(stats_file.read_text())
    assert (stats["min_token"], stats["max_token"]) == (1, 256)
    del stats["min_token"]
    stats_file.write_text(json.dumps({**stats, "version": 1, "max_token": 5}))  # an older stats file
    assert IndexedDataset(tmp_path / "ds").token_range() == (1, 256)


def test_ptd_schedule_into_a_closed_pipe_prints_no_traceback():
    """`ptd-schedule | head -1`: the reader closes the pipe early; exit 0 and nothing on stderr."""
    import subprocess
    import sys

    proc = subprocess.run(
        f"{sys.executable} -m ptd_jax.cli.schedule -p 8 -m 256 | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.count("\n") == 1 and proc.stderr == ""
