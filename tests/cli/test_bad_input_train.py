"""Bad input to `ptd-train` (issue #15's contract): one stderr line naming the flag, file or values; exit 2; no
traceback; no new files; refused before training. One table, run in this process on the 8 simulated devices."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ptd_jax.cli.train import main
from ptd_jax.train import checkpoint
from tests.helpers.cli import exit_code

QUIET = ["--no-progress", "--eval-iters", "0"]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", *QUIET]
MODEL = TINY[:8]
D8 = [
    "--tensor-model-parallel-size",
    "1",
    "--pipeline-model-parallel-size",
    "1",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
]

CASES = [
    # layouts and sizes (the cases the CLI smoke tests had)
    (
        ["--hidden-size", "100", "--num-attention-heads", "3"],
        "hidden_size=100 is not divisible by num_attention_heads=3",
    ),
    (
        ["--num-layers", "3", "--pipeline-model-parallel-size", "2", "--global-batch-size", "64"],
        "num_layers=3 is not divisible by pipeline_model_parallel_size=2",
    ),
    (
        ["--global-batch-size", "10", "--micro-batch-size", "4", "--fake-devices", "8"],
        "global_batch_size=10 is not divisible by micro_batch_size=4 x data_parallel_size=8",
    ),
    (
        ["--global-batch-size", "10"],  # the demo layout: d = 8 / (t=2 · p=2) = 2, b = 2
        "global_batch_size=10 is not divisible by micro_batch_size=2 x data_parallel_size=2",
    ),
    (["--tensor-model-parallel-size", "16"], "needs 16 devices but only num_devices=8 exist"),
    (["--tensor-model-parallel-size", "3"], "does not divide num_devices=8"),
    (
        ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "3", "--pipeline-model-parallel-size", "2"],
        "num_layers=4 is not divisible by num_layers_per_virtual_pipeline_stage=3",
    ),
    (["--lr", "0.1", "--min-lr", "1.0"], "min_lr=1.0 is larger than lr=0.1"),
    (
        [
            "--pipeline-model-parallel-size",
            "2",
            "--global-batch-size",
            "64",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--pipeline-schedule",
            "1f1b",
        ],
        "virtual_pipeline_stages=2 does not apply to pipeline_schedule='1f1b'",
    ),
    (
        [
            "--pipeline-model-parallel-size",
            "4",
            "--global-batch-size",
            "6",
            "--micro-batch-size",
            "1",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--pipeline-schedule",
            "interleaved",
        ],
        "p <= G <= m (Megatron's rule), got p=4, G=4, m=3",
    ),
    (
        ["--tensor-model-parallel-size", "8", "--num-attention-heads", "4"],
        "num_attention_heads=4 is not divisible by tensor_model_parallel_size=8",
    ),
    (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "33", "--global-batch-size", "32"],
        "seq_length=33 is not divisible by tensor_model_parallel_size=2",
    ),
    (["--num-layers-per-virtual-pipeline-stage", "0"], "num_layers_per_virtual_pipeline_stage=0 and "),
    (
        ["--pipeline-model-parallel-size", "0", "--num-layers-per-virtual-pipeline-stage", "1"],
        "pipeline_model_parallel_size=0 must be positive",
    ),
    (["--vocab-size", "0"], "vocab_size=0 must be a positive integer"),
    (["--seed", "-1"], "seed=-1 must be in [0, 2**32)"),
    (
        [
            "--tensor-model-parallel-size",
            "1",
            "--pipeline-model-parallel-size",
            "2",
            "--pipeline-schedule",
            "1f1b",
            "--microbatch-group-size-per-virtual-pipeline-stage",
            "2",
        ],
        "microbatch_group_size=2 applies to grouped schedules (interleaved) only, got '1f1b'",
    ),
    # several processes (jax.distributed), refused before anything connects
    (
        ["--coordinator-address", "localhost:1234", "--num-processes", "2", "--process-id", "2"],
        "process_id=2 must be in [0, num_processes=2)",
    ),
    (["--num-processes", "2"], "a multi-process run needs all three (missing --coordinator-address --process-id)"),
    (
        ["--coordinator-address", "nohost", "--num-processes", "2", "--process-id", "0"],
        "coordinator_address='nohost' must be host:port",
    ),
    (["--heartbeat-timeout", "0"], "heartbeat_timeout=0 must be at least 1 (seconds)"),
    # devices and backends
    (["--fake-devices", "4096"], "fake_devices=4096 must be in [1, 256]"),
    (["--fake-devices", "1024"], "fake_devices=1024 must be in [1, 256]"),
    (["--fake-devices", "0"], "fake_devices=0 must be in [1, 256]"),
    (["--attention-backend", "cudnn"], "attention_backend='cudnn' needs a GPU"),
    # memory, estimated before anything is allocated
    (["--seq-length", "1000000", "--max-position-embeddings", "1000000"], "GiB per device"),
    (["--model-preset", "paper-1t", *D8], "GiB per device"),
    # numbers: finite, in range
    (["--peak-tflops", "nan"], "argument --peak-tflops: 'nan' is not a finite number"),
    (["--lr", "inf"], "argument --lr: 'inf' is not a finite number"),
    (["--clip-grad=-inf"], "argument --clip-grad: '-inf' is not a finite number"),
    (["--peak-tflops", "0"], "peak_tflops=0.0 must be positive"),
    (["--adam-beta1", "1.0"], "adam_beta1=1.0 must be in [0, 1)"),
    (["--adam-beta2", "-0.1"], "adam_beta2=-0.1 must be in [0, 1)"),
    (["--adam-eps", "0"], "adam_eps=0.0 must be positive"),
    (["--init-method-std", "0"], "init_method_std=0.0 must be a positive finite number"),
    (["--layernorm-epsilon=-1e-5"], "layernorm_epsilon=-1e-05 must be a positive finite number"),
    (["--hidden-dropout", "1.0"], "hidden_dropout=1.0 must be in [0, 1)"),
    # precision and the NaN/inf guards
    (["--fp16", "--bf16"], "bf16=True and fp16=True: give one of --bf16 and --fp16"),
    (["--loss-scale", "128"], "loss_scale=128.0 needs --fp16 (loss scaling is for float16 only)"),
    (["--hysteresis", "3"], "hysteresis=3 needs --fp16"),
    (["--fp16", "--loss-scale=-1"], "loss_scale=-1.0 must be positive"),
    (["--fp16", "--initial-loss-scale", "0"], "initial_loss_scale=0.0 must be positive"),
    (["--fp16", "--loss-scale", "inf"], "argument --loss-scale: 'inf' is not a finite number"),
    (
        ["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"],
        "min_loss_scale=8.0 is larger than initial_loss_scale=4.0",
    ),
    (["--fp16", "--loss-scale-window", "0"], "loss_scale_window=0 must be positive"),
    (["--fp16", "--hysteresis", "0"], "hysteresis=0 must be positive"),
    (["--max-skipped-iters", "0"], "max_skipped_iters=0 must be positive"),
    (["--train-iters", "abc"], "argument --train-iters: invalid int value: 'abc'"),
    (["--train-iters", "0"], "train_iters=0 must be positive"),
    (["--keep-checkpoints", "0"], "keep_checkpoints=0 must be at least 1"),
    (["--split", "nan,1,1"], "split='nan,1,1' needs at most three finite weights"),
    (["--split", "1,2,3,4"], "split='1,2,3,4' needs at most three finite weights"),
    (["--split", "a,b"], "split='a,b' is not a comma-separated list of numbers"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--finetune"], "finetune=True needs --load"),
    (["--no-load-optim"], "no_load_optim=True needs --load"),
    # output paths, checked before training
    (["--save", "afile/ckpt"], "save='afile/ckpt' cannot be created: "),
    (["--plot-dir", "afile/plots"], "plot_dir='afile/plots' cannot be created: "),
    (["--metrics-file", "afile/m.jsonl"], "metrics_file='afile/m.jsonl' cannot be created: "),
    (["--data-cache-path", "afile/cache"], "data_cache_path='afile/cache' cannot be created: "),
    (["--save", "afile"], "save='afile' exists and is not a folder"),
    (["--plot-dir", "afile"], "plot_dir='afile' exists and is not a folder"),
    (["--metrics-file", "adir"], "metrics_file='adir' is a folder"),
    (["--load", "afile"], "load='afile' exists and is not a folder"),
    # the tokenizer: flags and files that do not parse ({vocab}, {merges}: a tiny GPT-2 vocab.json and merges.txt)
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    (
        ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "afile", "--merge-file", "{merges}"],
        "--vocab-file 'afile' is not valid JSON (Expecting value at line 1 column 1)",
    ),
    (
        ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{vocab}", "--merge-file", "nope.txt"],
        "--merge-file 'nope.txt' cannot be read: No such file or directory",
    ),
    (
        ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{vocab}", "--merge-file", "afile"],
        "--merge-file 'afile' line 1 is 'a regular file', expected two symbols separated by one space",
    ),
    (
        ["--tokenizer-type", "ByteTokenizer", "--vocab-size", "300"],
        "give one of --vocab-size 300 and --tokenizer-type ByteTokenizer (which decides V), not both",
    ),
    (["--vocab-file", "{vocab}"], "--vocab-file and --merge-file need --tokenizer-type GPT2BPETokenizer"),
    (["--tokenizer-type", "gpt2"], "argument --tokenizer-type: invalid choice: 'gpt2'"),
    # data
    (["--data-path", "nothing"], "missing file"),
    (["--data-path", "corrupt", *D8], "has 100 bytes but"),
    # checkpoints: garbage, another run, another model, past the end, another data configuration
    (["--load", "adir", *D8], "--load adir holds no checkpoint"),  # below: the saved run's model, {ckpt}
    (["--load", "junk", *D8], "--load junk step 5 has no readable metadata"),
    ([*MODEL, "--load", "{ckpt}", "--train-iters", "1", *D8], "--load {ckpt} is at iteration 2, past train_iters=1"),
    ([*MODEL, "--save", "{ckpt}", *D8], "--save {ckpt} already holds checkpoints of another run (steps [2])"),
    ([*MODEL, "--load", "{ckpt}", "--hidden-size", "64", *D8], "'hidden_size': (32, 64)"),
    ([*MODEL, "--load", "{ckpt}", "--seed", "7", *D8], "'seed': (1234, 7)"),
    (
        [
            *MODEL,
            "--load",
            "{ckpt}",
            "--global-batch-size",
            "16",
            "--micro-batch-size",
            "2",
            "--tensor-model-parallel-size",
            "1",
            "--pipeline-model-parallel-size",
            "1",
        ],
        "'global_batch_size': (8, 16)",
    ),
    ([*MODEL, "--load", "{ckpt}", "--split", "90,10,0", *D8], "'split': ('969,30,1', '90,10,0')"),
    ([*MODEL, "--load", "{ckpt}", "--data-path", "{corpus}", *D8], "'data_name': ('stdlib-"),
]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-iteration run of the tiny model on the default corpus at d = 8, saved at step 2."""
    ckpt = tmp_path_factory.mktemp("saved") / "ckpt"
    assert main([*TINY, *D8, "--train-iters", "2", "--save", str(ckpt)]) == 0
    assert checkpoint.all_steps(ckpt) == [2]
    return ckpt


def _files(root: Path) -> set:
    return {p.relative_to(root) for p in root.rglob("*")}


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    args, message, saved_run, small_corpus, gpt2_files, tmp_path, monkeypatch, capsys
):
    (tmp_path / "afile").write_text("a regular file")
    (tmp_path / "adir").mkdir()
    (tmp_path / "junk" / "5").mkdir(parents=True)
    (tmp_path / "junk" / "5" / "x").write_text("not a checkpoint")
    (tmp_path / "corrupt.bin").write_bytes(Path(small_corpus + ".bin").read_bytes()[:100])
    (tmp_path / "corrupt.idx").write_bytes(Path(small_corpus + ".idx").read_bytes())
    monkeypatch.chdir(tmp_path)
    fill = {"ckpt": str(saved_run), "corpus": small_corpus, "vocab": gpt2_files[0], "merges": gpt2_files[1]}
    argv = [a.format(**fill) for a in args]
    before, saved_before = _files(tmp_path), _files(saved_run)
    capsys.readouterr()
    code = exit_code(main, [*QUIET, *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("ptd-train: error: "), err
    assert message.format(**fill) in err and "Traceback" not in err
    assert _files(tmp_path) == before and _files(saved_run) == saved_before


def test_sequence_parallel_without_tensor_parallelism_warns_and_runs_without_it(monkeypatch, capsys):
    import ptd_jax.train

    seen = {}

    def fake_train(model_cfg, parallel, train_cfg, options):
        seen["sequence_parallel"] = parallel.sequence_parallel
        return {"iterations": 0}

    monkeypatch.setattr(ptd_jax.train, "train", fake_train)
    assert main([*TINY, *D8, "--sequence-parallel"]) == 0
    err = capsys.readouterr().err
    assert "--sequence-parallel has no effect with tensor_model_parallel_size=1" in err
    assert seen == {"sequence_parallel": False}


def test_ctrl_c_before_training_says_so(monkeypatch, capsys):
    import ptd_jax.train

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(ptd_jax.train, "train", interrupted)
    assert main([*TINY, *D8]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "ptd-train: interrupted (Ctrl-C) before training started"


@pytest.mark.slow  # 21 s; the default run stops a training process by SIGTERM (tests/train/test_interrupt.py)
def test_ctrl_c_stops_cleanly_with_exit_130_and_keeps_the_last_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ptd_jax.cli.train",
            *TINY,
            "--fake-devices",
            "1",
            "--micro-batch-size",
            "8",
            "--global-batch-size",
            "8",
            "--train-iters",
            "100000",
            "--save",
            str(ckpt),
            "--save-interval",
            "3",
            "--log-interval",
            "1",
            "--metrics-file",
            str(metrics),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and len(checkpoint.all_steps(ckpt)) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ptd-train: interrupted (Ctrl-C) after iteration ") and "Traceback" not in err
    steps = checkpoint.all_steps(ckpt)
    assert f"newest checkpoint: step {steps[-1]} in {ckpt}" in last
    assert not list(ckpt.glob("*.orbax-checkpoint-tmp*"))
    meta = checkpoint.read_meta(ckpt, steps[-1])
    assert meta["iteration"] == steps[-1] and meta["consumed_samples"] == 8 * steps[-1]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line is whole JSON
    assert records and out == ""  # no summary on an interrupted run
