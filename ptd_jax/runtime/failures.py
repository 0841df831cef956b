"""Run-time failures that are not bad input: a write that fails mid-run (a full disk), a damaged file met after the
start-up checks, a coordinator that never answers. The command-line tools report them in one line with exit 1
(`ptd_jax/cli/errors.py`); bad input (`ConfigError`, `DataError`) gets exit 2."""

from __future__ import annotations


class RunError(RuntimeError):
    """A run-time failure; the message is one line that names the flag and the path (or host and port)."""


def write_failed(flag: str, path, err: OSError) -> RunError:
    """The RunError for a write to `path` (given by `flag`) that failed with `err`: `--metrics-file m.jsonl: cannot
    write: No space left on device`."""
    why = err.strerror or str(err) or type(err).__name__
    return RunError(f"{flag} {path}: cannot write: {why}")
