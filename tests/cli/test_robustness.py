"""Issue #38: damaged checkpoints, empty splits, unreachable coordinators, run-time I/O and silently accepted inputs
each get one stderr line (`<tool>: error: ...`), the expected exit status, and leave nothing written. The tools run
in this process (their `main`), on the 8 simulated devices; a few cases need a process of their own (signals, a
closed pipe, a coordinator that never answers: loopback addresses only)."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ptd_jax.cli import convert, generate, launch, preprocess
from ptd_jax.cli import schedule as schedule_cli
from ptd_jax.cli.train import main as train_main
from ptd_jax.train import checkpoint
from tests.helpers.cli import exit_code

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32"]
QUIET = ["--no-progress", "--eval-iters", "0"]
ONE = ["--fake-devices", "1", "--micro-batch-size", "2", "--global-batch-size", "2"]
D8 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1"]
D8 += ["--global-batch-size", "8"]


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in Path(root).rglob("*")}


def one_line(main, argv, capsys, code: int, prog: str) -> str:
    """Run `main(argv)`; assert the exit code and a single `<prog>: error:` line without a traceback; the line."""
    capsys.readouterr()
    got = exit_code(main, argv)
    err = capsys.readouterr().err
    assert got == code, err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), err
    assert "Traceback" not in err and len(err) <= 320, err
    return err


# Damaged checkpoints: a truncated file in each part of a step


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A run of the tiny model saved at steps 2 and 4 (d = 8)."""
    ckpt = tmp_path_factory.mktemp("run") / "ckpt"
    assert train_main([*TINY, *QUIET, *D8, "--train-iters", "4", "--save", str(ckpt), "--save-interval", "2"]) == 0
    assert checkpoint.all_steps(ckpt) == [2, 4]
    return ckpt


def largest(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


PARTS = {
    "params": lambda step: largest(step / "params" / "ocdbt.process_0"),
    "optimizer state": lambda step: largest(step / "opt_state" / "ocdbt.process_0"),
    "metadata": lambda step: step / "meta" / "metadata",
    "array metadata": lambda step: step / "params" / "_METADATA",
    "orbax manifest": lambda step: step / "params" / "manifest.ocdbt",
    "file list": lambda step: step / checkpoint.FILES_RECORD,
}
TOOLS = {
    "ptd-train": lambda ck: (train_main, [*TINY, *QUIET, *D8, "--train-iters", "6", "--load", ck]),
    "ptd-generate": lambda ck: (generate.main, ["--load", ck, "--prompt-ids", "1,2", "--max-new-tokens", "2"]),
    "ptd-convert": lambda ck: (convert.main, ["to-hf", "--input", ck, "--output", "hf"]),
}


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("tool", TOOLS)
def test_a_truncated_file_is_refused_in_one_line_naming_the_step(part, tool, two_steps, tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_steps, ckpt)
    victim = PARTS[part](ckpt / "4")
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    monkeypatch.chdir(tmp_path)
    before = files_under(tmp_path)
    main, argv = TOOLS[tool]("ckpt")
    err = one_line(main, argv, capsys, 2, tool)
    flag = "--input" if tool == "ptd-convert" else "--load"
    assert f"{flag} ckpt step 4 is damaged: " in err, err
    assert "step 2 is intact: move ckpt/4 aside to use it" in err, err
    assert files_under(tmp_path) == before
    cfg, params = checkpoint.read_params(ckpt, step=2)  # the earlier step still loads
    assert cfg.num_layers == 2 and params


def test_the_earlier_step_loads_once_the_damaged_one_is_moved_aside(two_steps, tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_steps, ckpt)
    victim = PARTS["params"](ckpt / "4")
    victim.write_bytes(victim.read_bytes()[:100])
    (ckpt / "4").rename(tmp_path / "damaged-4")
    monkeypatch.chdir(tmp_path)
    assert generate.main(["--load", "ckpt", "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 0
    assert train_main([*TINY, *QUIET, *D8, "--train-iters", "3", "--load", "ckpt"]) == 0
    assert "ptd-generate: error" not in capsys.readouterr().err


def test_a_step_saved_without_a_file_list_still_gets_one_line(two_steps, tmp_path, monkeypatch, capsys):
    """A step written before the file lists (or by a crash between the commit and the list): orbax's own error,
    cut to one line, and none of its "Event loop is closed" tracebacks after it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_steps, ckpt)
    (ckpt / "4" / checkpoint.FILES_RECORD).unlink()
    victim = PARTS["params"](ckpt / "4")
    victim.write_bytes(victim.read_bytes()[:100])
    monkeypatch.chdir(tmp_path)
    for tool in TOOLS:
        main, argv = TOOLS[tool]("ckpt")
        assert "step 4" in one_line(main, argv, capsys, 2, tool)
