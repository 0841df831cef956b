"""Stopping on a signal (`ptd_jax/train/interrupt.py`): SIGTERM to a one-process run stops it after the current step,
saves that step, finishes the write and exits 143 with one line (Ctrl-C's version: tests/cli/test_bad_input_train.py;
several processes: tests/runtime/test_multiprocess.py)."""

import json
import signal
import subprocess
import sys

import jax
import numpy as np

from ptd_jax.train import checkpoint
from tests.helpers.cli import signal_after_logged

TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--no-progress",
    "--eval-iters",
    "0",
    "--fake-devices",
    "1",
    "--micro-batch-size",
    "8",
    "--global-batch-size",
    "8",
]


def test_sigterm_saves_the_step_it_stops_at_and_exits_143(small_corpus, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ptd_jax.cli.train",
            *TINY,
            "--data-path",
            small_corpus,
            "--train-iters",
            "100000",
            "--save",
            str(ckpt),
            "--save-interval",
            "100000",
            "--log-interval",
            "1",
            "--metrics-file",
            str(metrics),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = signal_after_logged(proc, metrics, 1, signal.SIGTERM)  # after the first logged step
    assert proc.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    steps = checkpoint.all_steps(ckpt)
    assert last.startswith("ptd_jax: stopped by SIGTERM after iteration ") and "Traceback" not in err, err[-3000:]
    stopped = int(last.split(";")[0].rsplit(" ", 1)[1])
    assert steps == [stopped] and f"newest checkpoint: step {stopped} in {ckpt}" in last  # saved where it stopped
    assert not list(ckpt.glob("*.orbax-checkpoint-tmp*"))  # the asynchronous write finished
    meta = checkpoint.read_meta(ckpt, stopped)
    assert meta["iteration"] == stopped and meta["consumed_samples"] == 8 * stopped
    _, params = checkpoint.read_params(ckpt, stopped)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["iteration"] == stopped and out == ""  # no summary from a stopped run
