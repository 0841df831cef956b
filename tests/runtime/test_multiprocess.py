"""Several processes (`runtime/multiprocess.py`, `ptd-launch`): who joins how, each process's share of the data,
two processes equal one, checkpoints across process counts, and a killed process ending the run, never a hang.

The runs start real processes on this machine (gloo collectives over localhost), each simulating its own CPU
devices; the ones that compile the 3-D step take minutes on 2 cores and are marked slow."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from ptd_jax.config import ConfigError, ParallelConfig
from ptd_jax.data import GPTData, local_rows, microbatches
from ptd_jax.runtime import multiprocess
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.sharding import BATCH_SPEC
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
    "--log-interval",
    "1",
    "--lr-warmup-iters",
    "1",
    "--peak-tflops",
    "1",
]
LAYOUT_3D = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "8",
]
TRAIN = [sys.executable, "-m", "ptd_jax.cli.train"]
LAUNCH = [sys.executable, "-m", "ptd_jax.cli.launch"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PTD_NUM", "PTD_PROCESS", "PTD_COORD"))}
    env.pop("XLA_FLAGS", None)  # each child sets its own device count (--fake-devices)
    return {**env, **extra}


# --- who joins how -----------------------------------------------------------------------------------------------


def test_flags_then_ptd_launch_then_slurm_and_open_mpi_decide_the_process_group():
    assert multiprocess.resolve(environ={}) is None
    assert multiprocess.resolve("h:1", 2, 1, environ={}) == multiprocess.ProcessGroup(2, 1, "h:1", "flags")
    assert multiprocess.resolve("h:1", 1, 0, environ={}) is None  # one process: nothing to join
    launch = {"PTD_COORDINATOR_ADDRESS": "127.0.0.1:5", "PTD_NUM_PROCESSES": "4", "PTD_PROCESS_ID": "3"}
    assert multiprocess.resolve(environ=launch) == multiprocess.ProcessGroup(4, 3, "127.0.0.1:5", "ptd-launch")
    assert multiprocess.resolve("h:1", 2, 0, environ=launch).source == "flags"  # flags win
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    assert multiprocess.resolve(environ=slurm) == multiprocess.ProcessGroup(None, None, None, "SLURM")
    assert multiprocess.resolve(environ={**slurm, "SLURM_NTASKS": "1"}) is None  # sbatch's one task
    assert multiprocess.resolve(environ={"OMPI_COMM_WORLD_SIZE": "2"}).source == "Open MPI"


@pytest.mark.parametrize(
    "args, environ, message",
    [
        (("h:1", 2, 2), {}, "process_id=2 must be in [0, num_processes=2)"),
        (("h:1", 0, 0), {}, "num_processes=0 must be positive"),
        (("nohost", 2, 0), {}, "coordinator_address='nohost' must be host:port"),
        ((None, 2, None), {}, "a multi-process run needs all three (missing --coordinator-address --process-id)"),
        (
            (),
            {"PTD_COORDINATOR_ADDRESS": "h:1", "PTD_NUM_PROCESSES": "2", "PTD_PROCESS_ID": "-1"},
            "PTD_PROCESS_ID=-1 must be in [0, PTD_NUM_PROCESSES=2)",
        ),
        (
            (),
            {"PTD_NUM_PROCESSES": "2", "PTD_PROCESS_ID": "0"},
            "PTD_NUM_PROCESSES=2 is set but PTD_COORDINATOR_ADDRESS",
        ),
        ((), {"PTD_NUM_PROCESSES": "two", "PTD_PROCESS_ID": "0"}, "PTD_NUM_PROCESSES='two' is not an integer"),
    ],
)
def test_an_impossible_process_group_is_one_line_naming_the_values(args, environ, message):
    with pytest.raises(ConfigError, match=None) as err:
        multiprocess.resolve(*args, environ=environ)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- each process's share of the data ----------------------------------------------------------------------------


def test_each_data_rank_reads_only_its_rows_and_together_they_make_the_global_batch(small_corpus):
    """d = 4, b = 2, m = 2: the rows of ranks {0, 1} and {2, 3} (two processes) are disjoint, cover the batch, and
    each process's microbatches are its ranks' columns of the global [M, d·b, S] ones."""
    parallel = ParallelConfig(data_parallel_size=4, micro_batch_size=2, global_batch_size=16)
    data = GPTData(small_corpus, seq_length=16, global_batch_size=16, eval_iters=1, seed=3, split="90,10,0")
    first = 37  # any count of consumed samples
    whole = microbatches(data.train_samples(first, 16), parallel)
    halves = [(0, 1), (2, 3)]
    rows = [local_rows(parallel, ranks) for ranks in halves]
    assert not set(rows[0]) & set(rows[1]) and sorted([*rows[0], *rows[1]]) == list(range(16))
    for ranks, r in zip(halves, rows):
        part = microbatches(data.train_samples(first, 16, r), parallel, len(ranks))
        for got, want in zip(part, whole):
            np.testing.assert_array_equal(got, want[:, ranks[0] * 2 : (ranks[-1] + 1) * 2])
        valid = next(data.valid_batches(r))
        np.testing.assert_array_equal(valid.tokens, next(data.valid_batches()).tokens[r])


def test_the_global_batch_is_assembled_from_each_data_ranks_rows():
    parallel = ParallelConfig(
        data_parallel_size=2,
        pipeline_model_parallel_size=2,
        tensor_model_parallel_size=2,
        micro_batch_size=2,
        global_batch_size=8,
    )
    mesh = make_mesh(parallel)
    assert multiprocess.local_data_ranks(mesh) == (0, 1)  # one process holds both
    whole = np.arange(2 * 4 * 3, dtype=np.int32).reshape(2, 4, 3)  # [M, d·b, S]
    array = multiprocess.global_batch(mesh, whole, (0, 1), BATCH_SPEC)
    np.testing.assert_array_equal(np.asarray(array), whole)
    for shard in array.addressable_shards:  # data rank r's devices hold its rows r·b ... + b
        rank = int(np.argwhere(mesh.devices == shard.device)[0][0])
        assert shard.index[1] == slice(rank * 2, rank * 2 + 2)
        np.testing.assert_array_equal(np.asarray(shard.data), whole[:, rank * 2 : (rank + 1) * 2])


@pytest.mark.slow
def test_a_save_converted_on_the_devices_is_the_host_paths_checkpoint(tmp_path):
    """What a multi-process save does (the canonical form taken on the devices, each process writing its shards),
    here in one process: the same canonical arrays as the host path, bitwise, restoring into another layout."""
    from ptd_jax.config import TrainConfig
    from ptd_jax.optimizer import make_optimizer
    from ptd_jax.parallel import sharding
    from ptd_jax.parallel.step import init_sharded_state
    from tests.helpers.checkpoints import MODEL, layout, random_state

    optimizer = make_optimizer(TrainConfig())
    source = layout(2, 2, 2, 1)
    state, mesh = random_state(source, optimizer)
    meta = checkpoint.run_meta(
        MODEL, source, TrainConfig(), consumed_samples=0, rng_key=jax.random.key(0), data_config={}
    )
    for name, on_devices in (("host", False), ("devices", True)):
        with checkpoint.Checkpointer(
            tmp_path / name, optimizer=optimizer, model_cfg=MODEL, parallel=source, mesh=mesh, on_devices=on_devices
        ) as saver:
            saver.save(1, state, meta)
    host, devices = (checkpoint.read_params(tmp_path / name)[1] for name in ("host", "devices"))
    jax.tree.map(np.testing.assert_array_equal, host, devices)
    dest = layout(1, 4, 2, 2)
    dest_mesh = make_mesh(dest)
    like = init_sharded_state(jax.random.key(9), MODEL, optimizer, dest_mesh, dest)
    restored = checkpoint.restore(
        tmp_path / "devices", 1, like, optimizer=optimizer, model_cfg=MODEL, parallel=dest, mesh=dest_mesh
    )
    want = sharding.to_canonical(optimizer, state, MODEL.vocab_size, True)
    have = sharding.to_canonical(optimizer, restored, MODEL.vocab_size, True)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), want, have)


# --- ptd-launch ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "2"], "ptd-launch: error: no command given"),
        (["--nproc", "0", "--", "true"], "argument --nproc: 0 is not a positive integer"),
        (["--nproc", "2", "--"], "no command given after --"),
        (["--nproc", "1", "--", "/no/such/program"], "ptd-launch: error: cannot start '/no/such/program'"),
    ],
)
def test_ptd_launch_bad_input_is_one_line_and_exit_2(argv, message):
    out = subprocess.run([*LAUNCH, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


def test_ptd_launch_stops_the_others_and_exits_with_the_failed_childs_code(tmp_path):
    """Child 1 exits 3 at once; child 0 would sleep for a minute: it is stopped, and the launcher's code is 3,
    with one line naming process 1. Each child sees its place in the environment."""
    script = (
        "import os, sys, time\n"
        "rank = os.environ['PTD_PROCESS_ID']\n"
        f"open(os.path.join({str(tmp_path)!r}, rank), 'w').write(os.environ['PTD_NUM_PROCESSES'] + ' ' + "
        "os.environ['PTD_COORDINATOR_ADDRESS'] + ' ' + str(os.getpid()))\n"
        "if rank == '1':\n    time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    out = subprocess.run(
        [*LAUNCH, "--nproc", "2", "--grace-period", "2", "--", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 3 and time.monotonic() - start < 20, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert (
        "ptd-launch: error: process 1 (pid " in out.stderr and "exited with code 3; stopping the other 1" in out.stderr
    )
    seen = [(tmp_path / r).read_text().split() for r in ("0", "1")]
    assert seen[0][:2] == seen[1][:2] and seen[0][0] == "2" and seen[0][1].startswith("127.0.0.1:")
    with pytest.raises(ProcessLookupError):  # child 0 is gone
        os.kill(int(seen[0][2]), 0)


# --- runs of several processes ------------------------------------------------------------------------------------


def _losses(path, kind="train"):
    key = "lm_loss" if kind == "train" else "valid_lm_loss"
    return [r[key] for r in map(json.loads, open(path)) if r.get("kind") == kind]


def _run(argv, nproc=1, timeout=900):
    command = [*LAUNCH, "--nproc", str(nproc), "--", *TRAIN, *argv] if nproc > 1 else [*TRAIN, *argv]
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_a_killed_process_ends_the_other_within_60_s_and_the_run_resumes(small_corpus, tmp_path, victim):
    """Two processes started as a cluster scheduler would (no launcher to clean up), d = 2, one device each, are
    training when one is SIGKILLed; the other exits != 0 within 60 s. When process 1 dies, process 0's collective
    fails at once and it says so in one line. When process 0 dies, the coordination service goes with it: process
    1 ends by the collective's error or by XLA's abort on the lost service (its own lines); then a one-process run
    resumes from the newest checkpoint."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = [
        *TINY,
        "--data-path",
        small_corpus,
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--save",
        str(ckpt),
        "--load",
        str(ckpt),
    ]
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [
                *TRAIN,
                *common,
                "--fake-devices",
                "1",
                "--train-iters",
                "100000",
                "--save-interval",
                "2",
                "--heartbeat-timeout",
                "10",
                "--metrics-file",
                str(metrics),
            ],
            env=_env(PTD_COORDINATOR_ADDRESS=address, PTD_NUM_PROCESSES="2", PTD_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    survivor = procs[1 - victim]
    try:
        deadline = time.monotonic() + 300
        while (
            time.monotonic() < deadline
            and all(p.poll() is None for p in procs)
            and not (checkpoint.all_steps(ckpt) if victim == 0 else metrics.exists() and metrics.read_text())
        ):
            time.sleep(0.1)
        assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-3000:]
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = survivor.communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert survivor.returncode not in (0, None) and took < 60, (survivor.returncode, took, err[-3000:])
    last = [line for line in err.splitlines() if line.strip() and "[Gloo]" not in line][-1]
    ours = f"ptd-train: error: process {1 - victim} of 2: another process failed or was killed"
    if victim == 1:
        assert last.startswith(ours) and err.count(ours) == 1, err[-3000:]
        return
    assert ours in err or "Terminating process because the JAX distributed service detected fatal errors" in err
    steps = checkpoint.all_steps(ckpt)
    resumed = _run([*common, "--fake-devices", "2", "--train-iters", str(steps[-1] + 1)])
    assert f"resuming from iteration {steps[-1]}" in resumed.stderr
    assert json.loads(resumed.stdout.splitlines()[-1])["last_iteration"] == steps[-1] + 1


@pytest.mark.slow
def test_ctrl_c_to_ptd_launch_stops_every_process_after_the_same_step(small_corpus, tmp_path):
    """SIGINT to the launcher reaches each process once; they agree on a step (JAX's preemption sync point), save
    it and both stop there with exit 130 (each says so, naming the same iteration); the launcher exits 130."""
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [
            *LAUNCH,
            "--nproc",
            "2",
            "--",
            *TRAIN,
            *TINY,
            "--data-path",
            small_corpus,
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "8",
            "--fake-devices",
            "1",
            "--train-iters",
            "100000",
            "--save",
            str(tmp_path / "ckpt"),
            "--save-interval",
            "1000",
            "--metrics-file",
            str(metrics),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    out, err = signal_after_logged(proc, metrics, 2, signal.SIGINT)
    assert proc.returncode == 130, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("ptd-train: interrupted (Ctrl-C) after iteration ")]
    assert len(said) == 2 and said[0].split(";")[0] == said[1].split(";")[0], err[-3000:]
    stopped = int(said[0].split(";")[0].rsplit(" ", 1)[1])
    assert checkpoint.all_steps(tmp_path / "ckpt")[-1] == stopped  # saved where both stopped
    assert out == ""  # no summary from an interrupted run, and no gloo notices


def _free_port():
    from ptd_jax.cli.launch import free_port

    return free_port("127.0.0.1")


@pytest.mark.slow
def test_two_processes_give_one_processs_loss_trace_and_checkpoints_load_across_process_counts(small_corpus, tmp_path):
    """(d, p, t) = (2, 2, 2): `ptd-launch --nproc 2` with 4 devices each == one process with 8 (loss trace, rtol
    1e-5, and the saved parameters). A step written by 2 processes resumes in 1 and one written by 1 in 2, each
    continuing the trace of the uninterrupted run (the second under uniform branching, the others per-rank); the
    metrics file is process 0's alone."""
    common = [
        *TINY,
        *LAYOUT_3D,
        "--data-path",
        small_corpus,
        "--train-iters",
        "4",
        "--save-interval",
        "2",
        "--eval-iters",
        "1",
        "--eval-interval",
        "2",
        "--split",
        "80,20,0",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    _run([*common, "--fake-devices", "8", "--save", str(one), "--metrics-file", str(tmp_path / "one.jsonl")])
    out = _run(
        [*common, "--fake-devices", "4", "--save", str(two), "--metrics-file", str(tmp_path / "two.jsonl")], nproc=2
    )
    assert out.stdout.count("\n") == 1 and json.loads(out.stdout)["num_devices"] == 8  # process 0 prints, alone
    trace = _losses(tmp_path / "one.jsonl")
    assert len(trace) == 4
    np.testing.assert_allclose(_losses(tmp_path / "two.jsonl"), trace, rtol=1e-5)
    valid = _losses(tmp_path / "one.jsonl", "valid")
    assert len(valid) == 2
    np.testing.assert_allclose(_losses(tmp_path / "two.jsonl", "valid"), valid, rtol=1e-5)
    _, p_one = checkpoint.read_params(one, 4)
    _, p_two = checkpoint.read_params(two, 4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p_one, p_two)  # weights ~1e-2

    # the 1-to-2 resume runs uniform branching (the GPU default): it continues the per-rank ("auto" on CPU) trace
    for source, nproc, devices, name, branching in ((two, 1, "8", "2to1", "auto"), (one, 2, "4", "1to2", "uniform")):
        resumed = tmp_path / name
        shutil.copytree(source, resumed)
        for step in checkpoint.all_steps(resumed)[1:]:  # keep step 2 only
            shutil.rmtree(resumed / str(step))
        metrics = tmp_path / f"{name}.jsonl"
        out = _run(
            [
                *common,
                "--fake-devices",
                devices,
                "--save",
                str(resumed),
                "--load",
                str(resumed),
                "--metrics-file",
                str(metrics),
                "--pipeline-branching",
                branching,
            ],
            nproc=nproc,
        )
        np.testing.assert_allclose(_losses(metrics)[-2:], trace[2:], rtol=1e-5)


FAIL_BUBBLE_IN_PROCESS_1 = """
import os, sys
import ptd_jax.train.loop  # binds the run's own step builder before it is broken below
import ptd_jax.parallel.step
from ptd_jax.train import bubble
bubble.AUTO_MIN_ITERATIONS = 1  # measure in a short run
if os.environ["PTD_PROCESS_ID"] == "1":  # the 2m step cannot be built here only (as if it did not fit)
    def fail(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: injected in process 1")
    ptd_jax.parallel.step.make_parallel_train_step = fail
from ptd_jax.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # about a minute: two processes compile a p = 2 step
def test_a_bubble_measurement_failing_in_one_process_is_skipped_by_all(small_corpus, tmp_path):
    """p = 2 over two processes; building the 2m step fails in process 1 only. The processes agree on the outcome
    (`bubble.after_first_step`): both skip the measurement and training finishes, where process 0 alone going on to
    run the 2m step would leave their collectives unpaired, a hang with live heartbeats."""
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [
            *LAUNCH,
            "--nproc",
            "2",
            "--",
            sys.executable,
            "-c",
            FAIL_BUBBLE_IN_PROCESS_1,
            *TINY,
            "--data-path",
            small_corpus,
            "--pipeline-model-parallel-size",
            "2",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "8",
            "--fake-devices",
            "1",
            "--train-iters",
            "3",
            "--metrics-file",
            str(metrics),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # the hang: end the launcher and its children
            _kill_with_children(proc.pid)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    skipped = [line for line in err.splitlines() if line.startswith("pipeline: measured bubble skipped")]
    assert skipped == ["pipeline: measured bubble skipped (failed in process 1 of 2)"], err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["measured_bubble"] is None
    assert [r["iteration"] for r in map(json.loads, open(metrics)) if r.get("kind") == "train"] == [1, 2, 3]


def _kill_with_children(pid: int) -> None:
    """SIGKILL `pid` and its children (ptd-launch starts each child in a session of its own: its group misses them)."""
    try:
        children = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        children = []
    for target in (*children, pid):
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
