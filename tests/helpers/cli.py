"""Running `ptd-train` from a test: in a new process (`run_train`), in this one (`exit_code`), and signalling a
running one once it has logged (`signal_after_logged`)."""

import subprocess
import sys
import time

TRAIN = [sys.executable, "-m", "ptd_jax.cli.train"]
"""`ptd-train` in a new process of this interpreter."""


def run_train(*args, cwd=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`ptd-train ARGS` in a new process; its exit code, stdout and stderr (text)."""
    return subprocess.run([*TRAIN, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def exit_code(main, argv) -> int:
    """`main(argv)`'s exit code, whether it returns it or raises SystemExit (argparse's errors)."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def signal_after_logged(proc, metrics, records: int, signum, timeout_s: float = 300) -> tuple[str, str]:
    """Send `signum` to a training process once its --metrics-file holds `records` lines (or it ended, or the
    timeout passed); (stdout, stderr) after it exits. A process still alive at the end is killed."""
    try:
        deadline = time.monotonic() + timeout_s
        while (
            time.monotonic() < deadline
            and proc.poll() is None
            and not (metrics.exists() and metrics.read_text().count("\n") >= records)
        ):
            time.sleep(0.05)
        proc.send_signal(signum)
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
