"""Issue #38: damaged checkpoints, empty splits, unreachable coordinators, run-time I/O and silently accepted inputs
each get one stderr line (`<tool>: error: ...`), the expected exit status, and leave nothing written. The tools run
in this process (their `main`), on the 8 simulated devices; a few cases need a process of their own (signals, a
closed pipe, a coordinator that never answers: loopback addresses only)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ptd_jax.cli import convert, errors, generate, launch, preprocess
from ptd_jax.cli import schedule as schedule_cli
from ptd_jax.cli.train import main as train_main
from ptd_jax.train import checkpoint
from ptd_jax.runtime import multiprocess
from tests.helpers.cli import exit_code, run_train

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32"]
QUIET = ["--no-progress", "--eval-iters", "0"]
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
    assert "Traceback" not in err, err
    # the message is cut to MAX_CHARS whatever the length of the temporary path inside it; the prefix comes on top
    assert len(err) <= len(f"{prog}: error: ") + errors.MAX_CHARS + 1, err
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


# ptd-train: inputs that were accepted silently, or failed late, refused up front (exit 2, one line, nothing written)

P2 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
TRAIN_CASES = [
    # the data splits, checked before the model is built
    ([*D8, "--split", "0,100,0", "--save", "ck", "--metrics-file", "m.jsonl"], "split='0,100,0' leaves the training"),
    ([*D8, "--split", "1,2000,0"], "split='1,2000,0' leaves the training split empty: 0 of"),
    (
        [*D8[:-1], "100000", "--split", "1,400,0"],  # two documents of the demo corpus: a few hundred samples
        "split='1,400,0': the training split holds ",
    ),
    (["--split", ""], "split='' has an empty weight"),
    (["--split", "1,,1"], "split='1,,1' has an empty weight"),
    # sizes nothing checked up front
    (["--train-iters", "100000000000000000000"], "train_iters=100000000000000000000 is more than 2147483647"),
    (["--global-batch-size", "1000000000000", "--micro-batch-size", "1"], "GiB of token ids a batch"),
    (["--global-batch-size", "200000000", "--micro-batch-size", "2"], "GiB of token ids a batch"),
    (
        [*P2, "--global-batch-size", "8000000", "--micro-batch-size", "1"],
        "2000000 microbatches a step (global_batch_size=8000000 / (micro_batch_size=1 x data_parallel_size=4)) at "
        "pipeline_model_parallel_size=2 make 8000000 forward and backward actions, more than ptd-train schedules",
    ),
    (
        ["--pipeline-schedule", "auto", "--schedule-times", "1e308", "1e308", "1e308"],
        "--schedule-times 1e+308 1e+308 1e+308 are too large",
    ),
    # flags that meant nothing in the run
    ([*D8, "--schedule-times", "1", "2", "1"], "--schedule-times applies to --pipeline-schedule auto only, got None"),
    (["--lr-decay-iters", "0"], "lr_decay_iters=0 must be positive"),
    (["--keep-checkpoints", "2"], "--keep-checkpoints need --save"),
    (["--save-interval", "5", "--keep-checkpoints", "2"], "--save-interval and --keep-checkpoints need --save"),
    (
        [*P2, "--pipeline-schedule", "interleaved"],
        "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage",
    ),
    (
        [*P2, "--pipeline-schedule", "zb-v"],
        "--pipeline-schedule zb-v runs 2 model chunks per rank: num_layers=2 is not divisible by 2 x "
        "pipeline_model_parallel_size=2",
    ),
    (["--compile-only", "--save", "ck"], "--compile-only trains nothing and writes no --save: drop it"),
    (["--compile-only", "--metrics-file", "m", "--load", "x"], "writes no --load, --metrics-file"),
    (["--compile-only", "--num-gpus", "0"], "argument --num-gpus: 0 is not a positive integer"),
    (["--compile-only", "--num-gpus", "-4"], "argument --num-gpus: -4 is not a positive integer"),
    (["--compile-only", "--data-path", "nothing"], "missing file"),
    # output paths that cannot be written, though os.access says yes (to root)
    (["--plot-dir", "/proc/ptd-plots"], "plot_dir='/proc/ptd-plots' cannot be written: /proc: "),
    (["--save", "/proc/ptd/ckpt"], "save='/proc/ptd/ckpt' cannot be written: /proc: "),
    (["--metrics-file", "/proc/m.jsonl"], "metrics_file='/proc/m.jsonl' cannot be written: /proc: "),
]


@pytest.mark.parametrize("args, message", TRAIN_CASES, ids=[" ".join(a)[:50] for a, _ in TRAIN_CASES])
def test_ptd_train_refuses_up_front(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = one_line(train_main, [*TINY, *QUIET, *args], capsys, 2, "ptd-train")
    assert message in err, err
    assert files_under(tmp_path) == set()


def test_a_schedule_at_p1_warns_that_it_has_no_effect(monkeypatch, capsys):
    import ptd_jax.train

    monkeypatch.setattr(ptd_jax.train, "train", lambda *args: {"iterations": 0})
    assert train_main([*TINY, *QUIET, *D8, "--pipeline-schedule", "zb-h1"]) == 0
    err = capsys.readouterr().err
    assert "warning: --pipeline-schedule zb-h1 has no effect at pipeline_model_parallel_size=1" in err


@pytest.mark.slow  # about 40 s: a compiled step
def test_a_full_disk_for_the_metrics_names_the_flag_and_keeps_the_checkpoint(tmp_path, monkeypatch, capsys):
    """/dev/full: every write fails with ENOSPC. The run stops at its first record with exit 1, one line naming
    --metrics-file and the path; the checkpoint written before it is whole."""
    monkeypatch.chdir(tmp_path)
    argv = [*TINY, *QUIET, *D8, "--train-iters", "2", "--log-interval", "2", "--save", "ck", "--save-interval", "1"]
    assert train_main([*argv, "--metrics-file", "/dev/full"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "ptd-train: error: --metrics-file /dev/full: cannot write: No space left on device"
    assert "Traceback" not in err
    steps = checkpoint.all_steps(tmp_path / "ck")
    assert steps and all(checkpoint.damage(tmp_path / "ck", s) is None for s in steps)


# ptd-launch: the coordinator checked before any process starts; a failed rank's whole process group stopped


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_refuses_a_host_that_does_not_resolve(monkeypatch, capsys):
    def no_such_name(*args, **kwargs):  # no name lookup leaves this machine in a test
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    err = one_line(launch.main, ["--nproc", "2", "--coordinator-host", "nohost", "--", "true"], capsys, 2, "ptd-launch")
    assert "argument --coordinator-host: 'nohost' does not resolve (Name or service not known)" in err


def test_launch_refuses_a_host_that_is_not_this_machine(capsys):
    """192.0.2.1 (TEST-NET-1, RFC 5737) is no address of this machine: binding to it fails; nothing is sent."""
    err = one_line(
        launch.main, ["--nproc", "2", "--coordinator-host", "192.0.2.1", "--", "true"], capsys, 2, "ptd-launch"
    )
    assert "'192.0.2.1' (192.0.2.1) is not an address of this machine, where ptd-launch starts every process" in err


def test_launch_refuses_a_port_in_use(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["--nproc", "2", "--coordinator-host", "127.0.0.1", "--coordinator-port", str(port), "--", "true"]
        err = one_line(launch.main, argv, capsys, 2, "ptd-launch")
    assert f"argument --coordinator-port: 127.0.0.1:{port} is in use by another program" in err


def test_launch_passes_the_coordinator_timeout_on(tmp_path, capsys):
    argv = [
        "--nproc",
        "2",
        "--coordinator-timeout",
        "7",
        "--",
        "sh",
        "-c",
        f"echo $PTD_COORDINATOR_TIMEOUT > {tmp_path}/t",
    ]
    assert launch.main(argv) == 0
    assert (tmp_path / "t").read_text().strip() == "7.0"
    assert multiprocess.coordinator_timeout(None, {"PTD_COORDINATOR_TIMEOUT": "7.0"}) == 7.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_launch_stops_what_the_ranks_started(tmp_path, capsys):
    """Each rank starts a `sleep` of its own; rank 1 then fails. Both sleeps end with the ranks."""
    script = (
        f"sleep 300 & echo $! > {tmp_path}/$PTD_PROCESS_ID; if [ $PTD_PROCESS_ID = 1 ]; then sleep 1; exit 3; fi; wait"
    )
    assert launch.main(["--nproc", "2", "--grace-period", "2", "--", "sh", "-c", script]) == 3
    assert "process 1" in capsys.readouterr().err
    pids = [int((tmp_path / str(rank)).read_text()) for rank in (0, 1)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


def test_ptd_train_gives_up_on_a_coordinator_that_never_answers():
    """Process 1 of 2, and nothing listens at the coordinator's port (loopback): one line naming host and port after
    --coordinator-timeout, exit 1 (JAX's own wait would end in a C++ abort)."""
    port = free_port()
    proc = run_train(
        "--coordinator-address",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "--coordinator-timeout",
        "2",
        "--fake-devices",
        "1",
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"ptd-train: error: the coordinator at 127.0.0.1:{port} did not answer within 2 s (--coordinator-timeout): "
        f"is process 0 running, and is the port reachable from here?"
    ]


# ptd-convert: every tensor used, a config that disagrees with the weights refused


def test_from_hf_refuses_a_config_with_fewer_layers_than_the_weights(two_steps, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    step2 = tmp_path / "step2"
    shutil.copytree(two_steps, step2)
    shutil.rmtree(step2 / "4")
    assert convert.main(["to-hf", "--input", "step2", "--output", "hf"]) == 0
    config = json.loads(Path("hf/config.json").read_text())
    Path("hf/config.json").write_text(json.dumps({**config, "n_layer": 1}))
    before = files_under(tmp_path)
    err = one_line(convert.main, ["from-hf", "--input", "hf", "--output", "new/ck"], capsys, 2, "ptd-convert")
    assert (
        "hf/model.safetensors holds 12 tensor(s) that hf/config.json does not account for, e.g. 'transformer.h.1."
        in err
    )
    assert "the config and the weights disagree (num_layers=1)" in err
    assert files_under(tmp_path) == before


# Signals and a closed stdout, in processes of their own

TOOL_MODULES = {
    "ptd-preprocess": "ptd_jax.cli.preprocess",
    "ptd-generate": "ptd_jax.cli.generate",
    "ptd-convert": "ptd_jax.cli.convert",
    "ptd-train": "ptd_jax.cli.train",
}


def run_into_a_closed_pipe(module: str, *args, cwd) -> subprocess.CompletedProcess:
    """`python -m module ARGS` whose stdout is a pipe nobody reads (closed before the tool starts)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", module, *args], stdout=write, stderr=subprocess.PIPE, text=True, cwd=cwd, timeout=300
        )
    finally:
        os.close(write)


@pytest.mark.parametrize(
    "tool",
    [
        "ptd-preprocess",
        "ptd-generate",
        "ptd-convert",
        pytest.param("ptd-train", marks=pytest.mark.slow),  # about 30 s: a compiled step
    ],
)
def test_a_closed_stdout_ends_quietly(tool, two_steps, tmp_path):
    Path(tmp_path / "a.txt").write_text("some text\n")
    args = {
        "ptd-preprocess": ["--input", "a.txt", "--output-prefix", "out", "--no-progress"],
        "ptd-generate": ["--load", str(two_steps), "--prompt-ids", "1,2", "--max-new-tokens", "2"],
        "ptd-convert": ["to-hf", "--input", str(two_steps), "--output", "hf"],
        "ptd-train": [*TINY, *QUIET, "--fake-devices", "1", "--micro-batch-size", "1", "--global-batch-size", "1"]
        + ["--train-iters", "1"],
    }[tool]
    proc = run_into_a_closed_pipe(TOOL_MODULES[tool], *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert "WARNING:absl" not in proc.stderr, proc.stderr  # orbax's "Metadata file does not exist"


def test_sigterm_in_preprocess_leaves_nothing(tmp_path):
    """A scheduler's `timeout` sends SIGTERM: the temporaries and the new folder go, exit 143, one line."""
    (tmp_path / "big.txt").write_text("plain text line, repeated to take a while\n" * 400_000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ptd_jax.cli.preprocess", "--input", "big.txt", "--output-prefix", "new/out"]
        + ["--no-progress"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not list(tmp_path.glob("new/*.tmp*")):
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.splitlines() == ["ptd-preprocess: terminated (SIGTERM); nothing was written"]
    assert files_under(tmp_path) == {"big.txt"}


# ptd-generate and ptd-preprocess: inputs accepted silently, messages that named every condition at once

GENERATE_CASES = [
    (["--seed", "-1"], "seed=-1 must be in [0, 2**32)"),
    (["--temperature", "1.0", "--top-k", "0"], "ptd-generate: error: top_k=0 must be >= 1\n"),
    (["--temperature=-1"], "ptd-generate: error: temperature=-1.0 must be a finite number >= 0 (0: greedy)\n"),
    (["--top-p", "1.5"], "ptd-generate: error: top_p=1.5 must be in (0, 1]\n"),
]


@pytest.mark.parametrize("args, message", GENERATE_CASES, ids=[" ".join(a) for a, _ in GENERATE_CASES])
def test_ptd_generate_refuses(args, message, two_steps, capsys):
    argv = ["--load", str(two_steps), "--prompt-ids", "1,2", "--max-new-tokens", "2", *args]
    assert message in one_line(generate.main, argv, capsys, 2, "ptd-generate")


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ""])
def test_ptd_generate_refuses_empty_prompt_ids(ids, two_steps, capsys):
    argv = ["--load", str(two_steps), "--prompt-ids", ids, "--max-new-tokens", "2"]
    err = one_line(generate.main, argv, capsys, 2, "ptd-generate")
    assert f"prompt_ids={ids!r} is not a comma-separated list of ids" in err


def test_preprocess_refuses_json_keys_without_json_input(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("a.txt").write_text("some text")
    argv = ["--input", "a.txt", "--output-prefix", "out", "--json-keys", "body", "--no-progress"]
    err = one_line(preprocess.main, argv, capsys, 2, "ptd-preprocess")
    assert "--json-keys body applies to JSON inputs (.json/.jsonl), and ['a.txt'] hold none" in err
    assert files_under(tmp_path) == {"a.txt"}


def test_an_unexpected_failure_is_one_line_and_ptd_debug_shows_the_traceback(monkeypatch, capsys):
    def broken(argv):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(schedule_cli, "run", broken)
    err = one_line(schedule_cli.main, [], capsys, 1, "ptd-schedule")
    assert err == "ptd-schedule: error: ZeroDivisionError: division by zero (PTD_DEBUG=1 shows the traceback)\n"
    monkeypatch.setenv("PTD_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        schedule_cli.main([])


def test_xlas_cpp_log_is_silenced_unless_debugging(monkeypatch):
    """XLA's C++ ERROR lines are advice to XLA's developers ("Very slow compile? If you want to file a bug"): the
    tools set XLA's level to FATAL before the backend starts, unless PTD_DEBUG=1 or the process is one of several;
    a level the user set is kept."""
    from ptd_jax.cli import errors

    for name in ("PTD_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for debug, preset, want in ((None, None, "3"), ("1", None, None), (None, "0", "0")):
        monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # restored after the test
        for name, value in (("PTD_DEBUG", debug), ("TF_CPP_MIN_LOG_LEVEL", preset)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        errors.quiet_libraries()
        assert os.environ.get("TF_CPP_MIN_LOG_LEVEL") == want
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    monkeypatch.setenv("PTD_NUM_PROCESSES", "2")  # one of several: NCCL's and the coordinator's errors are kept
    errors.quiet_libraries()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "2"
