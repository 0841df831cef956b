"""Several processes on JAX's own runtime: `jax.distributed`, and each process's share of a batch.

One process per host (or, for testing, several on one host over CPU collectives, `ptd-launch`) runs the same
program; `jax.distributed.initialize` connects them through a coordination service on process 0, and
`jax.devices()` then lists every process's devices. The mesh ("data", "pipe", "tensor") is the same as in one
process (`mesh.make_mesh` orders devices by process, tensor innermost, so a tensor group stays within a host, the
paper's §3.3), and every jit runs on all processes at once (SPMD, multi-controller).

Where the settings come from, first match wins:
- `--coordinator-address --num-processes --process-id` (all three);
- `PTD_COORDINATOR_ADDRESS`, `PTD_NUM_PROCESSES`, `PTD_PROCESS_ID` (what `ptd-launch` sets, like torchrun's
  MASTER_ADDR / WORLD_SIZE / RANK);
- SLURM (`srun` with more than one task) or Open MPI (`mpirun -n N`, N > 1): JAX's own cluster detection;
- otherwise one process, and nothing is initialised.

Stopping: SIGTERM (a preemption) or Ctrl-C in any process stops all of them after one step they agree on
(`stop_agreed`, JAX's preemption sync point), where the loop saves a checkpoint.

Faults: the coordination service declares a process dead once it misses heartbeats for `heartbeat_timeout_s`
and then stops every other process (XLA aborts them). A collective with a dead peer fails sooner, as soon as
its socket closes (`is_peer_failure`); the CLI then exits at once with one line, without the exit barrier that
would wait for the dead process.

Batches: data rank r reads only its own rows of every microbatch (`local_data_ranks`, `data.local_rows`), and
`global_batch` assembles the global [M, d·b, S] array from each process's rows without moving data between hosts.
"""

from __future__ import annotations

import math
import os
import re
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np

from ptd_jax.config import ConfigError
from ptd_jax.runtime.failures import RunError

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "PTD_COORDINATOR_ADDRESS", "PTD_NUM_PROCESSES", "PTD_PROCESS_ID"
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
"""JAX's default: a process that sends no heartbeat for this long is declared dead."""
ENV_COORDINATOR_TIMEOUT = "PTD_COORDINATOR_TIMEOUT"
DEFAULT_COORDINATOR_TIMEOUT_S = 120
"""How long a process waits for the coordinator (process 0) to answer, and process 0 for the others to join."""


@dataclass(frozen=True)
class ProcessGroup:
    """How this process joins a multi-process run. `coordinator_address` None: JAX detects the cluster."""

    num_processes: int | None
    process_id: int | None
    coordinator_address: str | None
    source: str
    """"flags", "ptd-launch", "SLURM" or "Open MPI" (for messages)."""


def _check(coordinator_address: str | None, num_processes: int, process_id: int, names: tuple[str, str, str]):
    address, count, pid = names
    if num_processes < 1:
        raise ConfigError(f"{count}={num_processes} must be positive")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"{pid}={process_id} must be in [0, {count}={num_processes})")
    if coordinator_address is not None and not re.fullmatch(r"\S+:\d{1,5}", coordinator_address):
        raise ConfigError(f"{address}={coordinator_address!r} must be host:port")


def _int_env(environ, name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ConfigError(f"{name}={environ[name]!r} is not an integer") from None


def resolve(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ=None,
) -> ProcessGroup | None:
    """The process group of this run from flags, then the environment (module docstring); None: one process."""
    environ = os.environ if environ is None else environ
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()):
        if any(v is None for v in given.values()):
            missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
            raise ConfigError(
                f"{', '.join(f'{k}={v}' for k, v in given.items())}: a multi-process run needs all "
                f"three (missing {' '.join(missing)})"
            )
        _check(coordinator_address, num_processes, process_id, ("coordinator_address", "num_processes", "process_id"))
        return ProcessGroup(num_processes, process_id, coordinator_address, "flags") if num_processes > 1 else None
    if ENV_NUM_PROCESSES in environ:
        count, pid = _int_env(environ, ENV_NUM_PROCESSES), _int_env(environ, ENV_PROCESS_ID)
        address = environ.get(ENV_COORDINATOR)
        if address is None:
            raise ConfigError(f"{ENV_NUM_PROCESSES}={count} is set but {ENV_COORDINATOR} is not")
        _check(address, count, pid, (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID))
        return ProcessGroup(count, pid, address, "ptd-launch") if count > 1 else None
    if "SLURM_STEP_NODELIST" in environ and "SLURM_JOB_ID" in environ and _int_env(environ, "SLURM_NTASKS") > 1:
        return ProcessGroup(None, None, None, "SLURM")
    if "OMPI_COMM_WORLD_SIZE" in environ and _int_env(environ, "OMPI_COMM_WORLD_SIZE") > 1:
        return ProcessGroup(None, None, None, "Open MPI")
    return None


def coordinator_timeout(flag: float | None, environ=None) -> float:
    """--coordinator-timeout, else `PTD_COORDINATOR_TIMEOUT` (what ptd-launch passes on), else the default."""
    environ = os.environ if environ is None else environ
    if flag is None and ENV_COORDINATOR_TIMEOUT in environ:
        try:
            flag = float(environ[ENV_COORDINATOR_TIMEOUT])
        except ValueError:
            raise ConfigError(
                f"{ENV_COORDINATOR_TIMEOUT}={environ[ENV_COORDINATOR_TIMEOUT]!r} is not a number"
            ) from None
    value = DEFAULT_COORDINATOR_TIMEOUT_S if flag is None else flag
    if not 0 < value < math.inf:
        raise ConfigError(f"coordinator_timeout={value} must be a positive number of seconds")
    return value


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Return once something accepts connections at `address` (host:port); RunError after `timeout_s`. JAX's own
    wait ends the process with a C++ abort and a stack dump, so the processes other than 0 knock first."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except socket.gaierror as err:
            raise ConfigError(
                f"the coordinator's host {host!r} (of {address}) does not resolve: {err.strerror}"
            ) from None
        except OSError:
            if time.monotonic() >= deadline:
                raise RunError(
                    f"the coordinator at {host}:{port} did not answer within {timeout_s:g} s (--coordinator-timeout): "
                    f"is process 0 running, and is the port reachable from here?"
                ) from None
            time.sleep(0.2)


def initialize(
    group: ProcessGroup,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
    init_timeout_s: float = DEFAULT_COORDINATOR_TIMEOUT_S,
) -> None:
    """`jax.distributed.initialize` for `group`, with CPU collectives over gloo. Must run before JAX starts its
    backend (before any JAX operation); raises ConfigError with one line if the processes cannot connect, RunError
    if the coordinator does not answer within `init_timeout_s`."""
    import jax

    if group.coordinator_address is not None and group.process_id not in (None, 0):
        wait_for_coordinator(group.coordinator_address, init_timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _quiet_native_stdout()
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator_address,
            num_processes=group.num_processes,
            process_id=group.process_id,
            initialization_timeout=math.ceil(init_timeout_s),
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            # a process that ends waits this long at the exit barrier for the others
            shutdown_timeout_seconds=heartbeat_timeout_s,
        )
    except (RuntimeError, ValueError) as err:
        raise ConfigError(
            f"jax.distributed.initialize ({group.source}: coordinator {group.coordinator_address}, "
            f"{group.num_processes} processes, this one {group.process_id}) failed: "
            f"{str(err).splitlines()[0][:300]}"
        ) from None

    def uncaught(kind, value, traceback):  # print it, then do not wait at the exit barrier for the others
        exit_if_peer_failed(value, "ptd-train")
        sys.__excepthook__(kind, value, traceback)
        end(1)

    sys.excepthook = uncaught


def _quiet_native_stdout() -> None:
    """Gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks ..." on file descriptor 1, from several threads at
    once and in pieces, into the lines of the run; native code gets /dev/null as its stdout, Python's `sys.stdout`
    keeps the real one (so the last line stays the JSON summary)."""
    sys.stdout.flush()
    real = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = os.fdopen(real, "w", buffering=1)


def end(code: int) -> int:
    """`code`, or, in a multi-process run that fails, exit with it now: a normal exit waits at JAX's shutdown
    barrier for processes that may go on training (or be gone)."""
    if code == 0 or "jax" not in sys.modules:
        return code
    import jax

    if not jax.distributed.is_initialized():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_peer_failure(err: BaseException) -> bool:
    """Whether `err` is a collective or the coordination service failing because another process went away."""
    text = str(err)  # JaxRuntimeError from a step; orbax's barriers re-raise it as ValueError
    return any(
        s in text
        for s in (
            "Gloo",
            "Connection closed",
            "Connection reset",
            "heartbeat",
            "UNAVAILABLE",
            "DEADLINE_EXCEEDED",
            "coordination service",
            "Barrier",
        )
    )


def is_primary() -> bool:
    """Whether this is process 0 (the one that prints and writes metrics); True without jax.distributed."""
    import jax

    return jax.process_index() == 0


def exit_if_peer_failed(err: BaseException, prog: str) -> None:
    """In a multi-process run, end this process at once (exit 1, one line) if `err` says another process went
    away: the normal exit would wait at JAX's shutdown barrier, and an unfinished checkpoint write at orbax's, for
    a process that is gone. The newest complete checkpoint is what a rerun resumes from."""
    import jax

    if not jax.distributed.is_initialized() or not is_peer_failure(err):
        return
    print(
        f"{prog}: error: process {jax.process_index()} of {jax.process_count()}: another process failed or "
        f"was killed ({str(err).splitlines()[0][:200]}); stopping (rerun with --load to resume from the newest "
        f"checkpoint)",
        file=sys.stderr,
    )
    end(1)


def stop_agreed(step: int) -> bool:
    """In a multi-process run, whether to stop before `step`: True on every process at the same step once any
    of them got SIGTERM (a scheduler's preemption, or a Ctrl-C, which ptd-train turns into one), by JAX's
    preemption sync point. Stopping wherever each process saw its own signal would leave the others waiting in
    a collective. False in a one-process run."""
    import jax

    if not jax.distributed.is_initialized():
        return False
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)


def process_count() -> int:
    """How many processes run (1 without jax.distributed)."""
    import jax

    return jax.process_count()


def failed_processes(ok: bool) -> list[int]:
    """The indices of the processes whose `ok` is False, the same list on every process: each must call it at the
    same point (an all-gather of one flag over the processes). In a one-process run, [] or [0] without any
    collective."""
    import jax

    if not jax.distributed.is_initialized():
        return [] if ok else [0]
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.asarray([0 if ok else 1], np.int32))).ravel()
    return [int(i) for i in np.flatnonzero(flags)]


def local_data_ranks(mesh) -> tuple[int, ...]:
    """The "data" coordinates that this process's devices hold (all of them in a one-process run)."""
    import jax

    here = jax.process_index()
    devices = mesh.devices  # [d, p, t]
    return tuple(r for r in range(devices.shape[0]) if any(dev.process_index == here for dev in devices[r].flat))


def global_batch(mesh, local: np.ndarray, data_ranks: tuple[int, ...], spec):
    """The global [M, d·b, S] array, sharded by `spec` (`sharding.BATCH_SPEC`), from this process's rows
    `local` [M, len(data_ranks)·b, S] (data rank data_ranks[k] at rows k·b ... + b)."""
    import jax

    d = mesh.shape["data"]
    b = local.shape[1] // len(data_ranks)
    position = {r: k for k, r in enumerate(data_ranks)}

    def shard(index):  # the slices of one device's block: on dim 1, the b rows of one data rank
        k = position[(index[1].start or 0) // b]
        return local[(index[0], slice(k * b, (k + 1) * b), *index[2:])]

    return jax.make_array_from_callback(
        (local.shape[0], d * b, *local.shape[2:]), jax.sharding.NamedSharding(mesh, spec), shard
    )
