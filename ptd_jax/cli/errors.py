"""The one place where every command-line tool turns a failure into its line (issues #15 and #38).

- bad input (`ConfigError`, `DataError`, `IndexedDatasetError`, a file that cannot be read): one stderr line
  `<tool>: error: ...` naming the flag and the path, exit 2;
- a run-time failure (`RunError`: a write that failed mid-run, a coordinator that never answered; anything
  unexpected): one line, exit 1;
- Ctrl-C: exit 130; SIGTERM: exit 143, after the same clean-up; a closed stdout (`ptd-train ... | head -1`):
  a quiet end, exit 0.

A line is at most `MAX_CHARS` characters: a library's multi-line message is cut to its first line. No traceback
unless `PTD_DEBUG=1`, which also lets the libraries' own log lines through (orbax's absl warnings, XLA's C++ log).
"""

from __future__ import annotations

import logging
import os
import sys

from ptd_jax.config import ConfigError
from ptd_jax.data.indexed_dataset import DataError, IndexedDatasetError
from ptd_jax.runtime.atomic import Terminated, terminate_as_interrupt
from ptd_jax.runtime.failures import RunError

MAX_CHARS = 300
"""The longest message a tool prints (a long path or a library's message is cut with "...")."""
INPUT_ERRORS = (ConfigError, DataError, IndexedDatasetError)
EXIT_RUNTIME, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143


def debug() -> bool:
    """`PTD_DEBUG=1`: tracebacks and the libraries' log lines are shown."""
    return os.environ.get("PTD_DEBUG") == "1"


def one_line(text) -> str:
    """`text`'s first non-empty line, cut to MAX_CHARS."""
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 3] + "..."


def quiet_libraries() -> None:
    """Orbax's absl warnings ("Metadata file does not exist") and XLA's C++ log up to its errors, which are advice
    to XLA's developers ("Very slow compile? If you want to file a bug ...", "Constant folding an instruction is
    taking > 1s"): a failure reaches Python as an exception, and our own line says what happened. A process of a
    multi-process run keeps the C++ errors (NCCL's and the coordination service's can be the only word before an
    abort). XLA reads its level when it starts, so this takes effect only before JAX's backend starts; PTD_DEBUG=1
    shows them all."""
    if debug():
        return
    logging.getLogger("absl").setLevel(logging.ERROR)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2" if _several_processes() else "3")


def _several_processes() -> bool:
    """This process is one of several (ptd-launch's, Slurm's or Open MPI's variables, or --coordinator-address)."""
    env = os.environ
    sizes = (env.get("PTD_NUM_PROCESSES"), env.get("SLURM_NTASKS"), env.get("OMPI_COMM_WORLD_SIZE"))
    launched = any(size not in (None, "", "1") for size in sizes)
    return launched or any(arg.startswith("--coordinator-address") for arg in sys.argv)
    sys.unraisablehook = _unraisable


def _unraisable(hook_args) -> None:
    """After a failed orbax restore, its pending reads call back into a closed asyncio loop ("Event loop is
    closed", up to 20 tracebacks after the one line): dropped. Anything else is printed as Python does."""
    if isinstance(hook_args.exc_value, RuntimeError) and "Event loop is closed" in str(hook_args.exc_value):
        return
    sys.__unraisablehook__(hook_args)


def close_stdout_quietly() -> None:
    """The reader of stdout went away: point stdout at /dev/null, so that the exit's flush raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor (a test's capture): nothing to flush at exit
        pass


def report(prog: str, err: BaseException) -> int:
    """Print `err` as `prog`'s one line; its exit code."""
    if isinstance(err, INPUT_ERRORS):
        code, text = EXIT_INPUT, str(err)
    elif isinstance(err, RunError):
        code, text = EXIT_RUNTIME, str(err)
    elif isinstance(err, OSError):  # a path a flag named that cannot be read or written
        code = EXIT_INPUT
        text = f"{err.filename}: {err.strerror}" if err.filename and err.strerror else str(err) or type(err).__name__
    else:
        code = EXIT_RUNTIME
        text = f"{type(err).__name__}: {one_line(err)} (PTD_DEBUG=1 shows the traceback)"
    print(f"{prog}: error: {one_line(text)}", file=sys.stderr)
    return code


def run_tool(prog: str, body, argv=None, interrupted: str = "interrupted") -> int:
    """`body(argv)`'s exit code, every failure turned into one line (the module docstring); `interrupted`: what
    Ctrl-C prints after `<prog>: `."""
    quiet_libraries()
    try:
        with terminate_as_interrupt():  # SIGTERM runs Ctrl-C's clean-up: no temporary file is left
            code = body(argv)
            sys.stdout.flush()  # a closed stdout fails here, not in the interpreter's exit
            return code
    except SystemExit:  # argparse's one line, or a tool's own exit
        raise
    except Terminated:
        print(f"{prog}: terminated (SIGTERM); nothing was written", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        close_stdout_quietly()
        return 0
    except Exception as err:
        if debug():
            raise
        return report(prog, err)
