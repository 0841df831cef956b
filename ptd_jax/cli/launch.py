"""`ptd-launch --nproc N -- ptd-train ...`: N local processes of one multi-process run (like torchrun).

Each child gets the coordinator's address and its place in the environment (`PTD_COORDINATOR_ADDRESS`,
`PTD_NUM_PROCESSES`, `PTD_PROCESS_ID`; ptd-train passes them to `jax.distributed.initialize`, see
`runtime/multiprocess.py`) and runs in its own session, so that a terminal's Ctrl-C reaches it once, forwarded
from here. On CPU the processes talk over gloo: with `--fake-devices K` each simulates K devices, N·K in all.

When a child fails (exit code != 0, or killed by a signal), the launcher says which in one line, stops the others
(SIGTERM, then SIGKILL after `--grace-period` seconds) and exits with that child's code (128 + the signal's number
for a signal). SIGINT and SIGTERM are forwarded to every child (SIGHUP as SIGTERM: ptd-train stops on that), and
the launcher then waits for them to stop (ptd-train: all at one agreed step, `multiprocess.stop_agreed`); once one
has exited, the others get `--grace-period` seconds before SIGTERM and SIGKILL, so a child stuck in a collective
with a dead peer cannot hang the launcher. Pure Python: JAX runs in the children only.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import subprocess
import sys
import time

from ptd_jax.cli.args import OneLineParser, positive_float, positive_int
from ptd_jax.runtime.multiprocess import DEFAULT_COORDINATOR_TIMEOUT_S, ENV_COORDINATOR_TIMEOUT

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PROG = "ptd-launch"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Run N local processes of one multi-process ptd-train run.",
        usage="ptd-launch --nproc N [options] -- COMMAND [ARGS ...]",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=positive_int, required=True, help="number of processes")
    p.add_argument("--coordinator-host", default="127.0.0.1", help="where process 0's coordination service listens")
    p.add_argument("--coordinator-port", type=int, default=0, help="its port (0: a free one)")
    p.add_argument(
        "--coordinator-timeout",
        type=positive_float,
        default=DEFAULT_COORDINATOR_TIMEOUT_S,
        help="seconds each process waits for the coordinator and the others to join (PTD_COORDINATOR_TIMEOUT)",
    )
    p.add_argument(
        "--grace-period",
        type=positive_float,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping the others after a failure",
    )
    return p


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_coordinator(host: str, port: int) -> int:
    """The port process 0's coordination service will listen on (a free one for 0), once `host` is known to
    resolve to an address of this machine (every process runs here) and the port to be free: one line otherwise."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise LaunchError(f"argument --coordinator-host: {host!r} does not resolve ({err.strerror})") from None
    with socket.socket(family, kind) as s:
        try:
            s.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise LaunchError(f"argument --coordinator-port: {host}:{port} is in use by another program") from None
            raise LaunchError(
                f"argument --coordinator-host: {host!r} ({address[0]}) is not an address of this machine, where "
                f"ptd-launch starts every process ({err.strerror})"
            ) from None
        return s.getsockname()[1]


class LaunchError(Exception):
    """Bad input found before any process starts: one line, exit 2."""


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def run(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:
        parser = build_parser()
        parser.parse_args(argv)  # --help, or a bad flag: argparse's line
        parser.error("no command given: ptd-launch --nproc N [options] -- COMMAND [ARGS ...]")
    split = argv.index("--")
    args, command = build_parser().parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        build_parser().error("no command given after --")
    if not 0 <= args.coordinator_port < 65536:
        build_parser().error(f"--coordinator-port {args.coordinator_port} is not in [0, 65536)")
    try:
        port = check_coordinator(args.coordinator_host, args.coordinator_port)
    except LaunchError as err:
        build_parser().error(str(err))
    address = f"{args.coordinator_host}:{port}"
    children: list[subprocess.Popen] = []

    signalled = []

    def forward(signum, frame):
        signalled.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        for rank in range(args.nproc):
            env = {
                **os.environ,
                "PTD_COORDINATOR_ADDRESS": address,
                "PTD_NUM_PROCESSES": str(args.nproc),
                "PTD_PROCESS_ID": str(rank),
                ENV_COORDINATOR_TIMEOUT: str(args.coordinator_timeout),
            }
            try:
                children.append(subprocess.Popen(command, env=env, start_new_session=True))
            except OSError as err:
                print(f"{PROG}: error: cannot start {command[0]!r}: {err.strerror}", file=sys.stderr)
                _stop(children, args.grace_period)
                return 2
        return _watch(children, args.grace_period, signalled)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _watch(children: list[subprocess.Popen], grace: float, signalled: list) -> int:
    """Wait for every child; on the first failure, stop the rest and return its code. After a forwarded signal
    the children stop by themselves (ptd-train: at one agreed step): wait for all, and return the first non-zero
    code."""
    while True:
        codes = [child.poll() for child in children]
        if signalled:
            if any(code is not None for code in codes):  # one has stopped: the rest get the grace period
                _wait_or_stop(children, grace)
                return next((_exit_code(c.returncode) for c in children if c.returncode), 0)
            time.sleep(0.05)
            continue
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                others = sum(c is None for c in codes)
                print(
                    f"{PROG}: error: process {rank} (pid {children[rank].pid}) {_describe(code)}"
                    + (f"; stopping the other {others}" if others else ""),
                    file=sys.stderr,
                )
                _stop(children, grace)
                return _exit_code(code)
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


def _wait_or_stop(children: list[subprocess.Popen], grace: float) -> None:
    """Wait up to `grace` seconds for every child, then stop those still running."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(child.poll() is None for child in children):
        time.sleep(0.05)
    _stop(children, grace)


def _stop(children: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to each child's process group (what the child started goes too), SIGKILL to the groups of those
    still running after `grace` seconds; a group whose child has exited but whose members live is killed too."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(child, signal.SIGKILL)
            child.wait()
    for child in children:  # the members that outlived their child (a rank's own helpers)
        _signal_group(child, signal.SIGKILL)


def _signal_group(child: subprocess.Popen, signum) -> None:
    """`signum` to the process group the child leads (its own session: `start_new_session`)."""
    try:
        os.killpg(child.pid, signum)
    except (ProcessLookupError, PermissionError):  # the group is gone
        pass


def main(argv=None) -> int:
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
