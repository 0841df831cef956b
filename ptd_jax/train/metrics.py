"""Training metrics: a progress bar on a terminal (elsewhere, Megatron-style lines at each log interval), JSONL
records, a final summary and a loss-curve PNG.

One record per logged iteration carries at least iteration, lm_loss, grad_norm, lr, step_time_s, tokens_per_s,
tflops_per_device and mfu (docs/architecture.md, "Interfaces") — later tools parse these names. Throughput comes
three ways (perf/flops.py): `tflops_per_device` and `mfu` count model FLOPs (no recomputation) and MFU divides
them by the device's dense peak; `hardware_tflops_per_device` counts what was executed (recomputation, the
pipeline's extra work); `eq3_tflops_per_device` is the paper's eq. (3), comparable with its tables.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ptd_jax.runtime.failures import write_failed

MEDIANS = ("tokens_per_s", "tflops_per_device", "mfu", "hardware_tflops_per_device", "eq3_tflops_per_device")
"""The throughput figures a run's summary gives as medians over its logged windows."""


def medians(records: list[dict]) -> dict[str, float | None]:
    """{name: median over the records whose window excludes compilation} for `MEDIANS`; None without one."""
    timed = [r for r in records if not r["includes_compile"]]
    return {k: float(np.median([r[k] for r in timed])) if timed else None for k in MEDIANS}


def energy_fields(window, tokens_per_step: int, source: str) -> dict:
    """A log record's energy (`runtime/energy.py`): joules per iteration, per token, and the mean power over the
    timing window; None where the source is unavailable (`energy_source` says why), never an estimate."""
    joules = None if window is None or window.joules is None else window.joules / window.steps
    return {
        "energy_source": source,
        "energy_j": joules,
        "joules_per_token": None if joules is None else joules / tokens_per_step,
        "avg_power_w": None if joules is None or window.seconds <= 0 else window.joules / window.seconds,
    }


def energy_summary(records: list[dict]) -> dict:
    """The run's energy: medians over the timed records that measured it, and the source."""
    timed = [r for r in records if not r["includes_compile"] and r.get("energy_j") is not None]
    out = {k: float(np.median([r[k] for r in timed])) if timed else None for k in ENERGY_MEDIANS}
    out["energy_source"] = records[-1].get("energy_source") if records else None
    return out


ENERGY_MEDIANS = ("energy_j", "joules_per_token", "avg_power_w")


def _records_up_to(path, iteration: int) -> list[str]:
    """The JSONL lines of `path` whose iteration is at most `iteration` (unparsable lines are dropped)."""
    if not Path(path).is_file():
        return []
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("iteration", 0) <= iteration:
                kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def log_line(record: dict, total_iters: int, consumed_samples: int | None = None) -> str:
    """A logged iteration as one line, Megatron's way (its `training_log`), for output that is not a terminal."""
    fields = [f" iteration {record['iteration']:8d}/{total_iters:8d}"]
    if consumed_samples is not None:
        fields.append(f"consumed samples: {consumed_samples:12d}")
    fields += [
        f"elapsed time per iteration (ms): {record['step_time_s'] * 1000:.1f}",
        f"learning rate: {record['lr']:.6E}",
        f"lm loss: {record['lm_loss']:.6E}",
        f"grad norm: {record['grad_norm']:.3f}",
    ]
    if "loss_scale" in record:
        fields.append(f"loss scale: {record['loss_scale']:g}")
    if "skipped_iters" in record:
        fields.append(f"number of skipped iterations: {record['skipped_iters']:3d}")
    fields += [
        f"tokens/s: {record['tokens_per_s']:.0f}",
        f"TFLOP/s/device: model {record['tflops_per_device']:.3g} hardware "
        f"{record['hardware_tflops_per_device']:.3g} eq3 {record['eq3_tflops_per_device']:.3g}",
        f"MFU: {record['mfu']:.1%}",
    ]
    if record.get("energy_j") is not None:
        fields.append(f"energy: {record['energy_j']:.4g} J/iteration, {record['avg_power_w']:.4g} W")
    return " | ".join(fields) + " |"


def _open_metrics(metrics_file, start_iter: int):
    """The metrics file, open for appending; a resumed run's file cut back to its resume step first."""
    Path(metrics_file).parent.mkdir(parents=True, exist_ok=True)
    if start_iter:  # a resumed run cuts the file back to its resume step: no iteration twice
        tmp = Path(f"{metrics_file}.tmp{os.getpid()}")
        try:
            tmp.write_text("".join(_records_up_to(metrics_file, start_iter)))
            os.replace(tmp, metrics_file)  # atomically: a crash now keeps the history
        finally:
            tmp.unlink(missing_ok=True)
    return open(metrics_file, "a" if start_iter else "w")  # noqa: SIM115 - closed by MetricsLogger.close()


class MetricsLogger:
    def __init__(
        self,
        total_iters: int,
        *,
        start_iter: int = 0,
        metrics_file: str | None = None,
        progress: bool = True,
        quiet: bool = False,
    ):
        """`quiet`: no messages (the processes of a multi-process run other than process 0)."""
        self.records: list[dict] = []
        self._quiet = quiet
        self.eval_records: list[dict] = []
        self.test_record: dict | None = None
        self._file = None
        if metrics_file:
            try:
                self._file = _open_metrics(metrics_file, start_iter)
            except OSError as err:
                raise write_failed("--metrics-file", metrics_file, err) from None
        self._total = total_iters
        # a terminal gets the bar; a file or a pipe gets one line per log interval (a bar there is a stream of
        # carriage-return updates)
        self._lines = progress and not _is_terminal(sys.stderr)
        self._bar = tqdm(
            total=total_iters,
            initial=start_iter,
            desc="train",
            unit="it",
            file=sys.stderr,
            disable=not progress or self._lines,
            dynamic_ncols=True,
        )

    def _write(self, record: dict) -> None:
        if self._file:
            try:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
            except OSError as err:  # a full disk, a lost mount: one line naming the flag and the file
                raise write_failed("--metrics-file", self._file.name, err) from None

    def advance(self, n: int = 1) -> None:
        self._bar.update(n)

    def log_train(self, record: dict, consumed_samples: int | None = None) -> None:
        self.records.append(record)
        self._write(record)
        if self._lines:
            self.message(log_line(record, self._total, consumed_samples))
            return
        self._bar.set_postfix(
            loss=f"{record['lm_loss']:.4f}",
            lr=f"{record['lr']:.2e}",
            tok_s=f"{record['tokens_per_s']:.0f}",
            TFLOPs=f"model {record['tflops_per_device']:.3g} hw "
            f"{record['hardware_tflops_per_device']:.3g} eq3 "
            f"{record['eq3_tflops_per_device']:.3g}",
            MFU=f"{record['mfu']:.1%}",
        )

    def log_eval(self, record: dict) -> None:
        """A validation ("kind": "valid") or test ("kind": "test") record: {kind}_lm_loss, {kind}_ppl."""
        kind = record["kind"]
        if kind == "valid":
            self.eval_records.append(record)
        else:
            self.test_record = record
        self._write(record)
        self.message(
            f"iteration {record['iteration']}: {'validation' if kind == 'valid' else kind} lm loss "
            f"{record[f'{kind}_lm_loss']:.4f} (ppl {record[f'{kind}_ppl']:.2f})"
        )

    def message(self, text: str) -> None:
        if not self._quiet:
            tqdm.write(text, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
        if self._file:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as err:
                raise write_failed("--metrics-file", file.name, err) from None

    def plot(self, plot_dir: str) -> str:
        """Write loss_curve.png (train and validation loss against iteration); returns its path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        try:
            Path(plot_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise write_failed("--plot-dir", plot_dir, err) from None
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["iteration"] for r in self.records], [r["lm_loss"] for r in self.records], label="train")
        if self.eval_records:
            ax.plot(
                [r["iteration"] for r in self.eval_records],
                [r["valid_lm_loss"] for r in self.eval_records],
                "o-",
                label="validation",
            )
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        path = os.path.join(plot_dir, "loss_curve.png")
        tmp = path + ".tmp.png"
        try:
            fig.savefig(tmp, dpi=120, bbox_inches="tight")
            os.replace(tmp, path)
        except OSError as err:
            Path(tmp).unlink(missing_ok=True)
            raise write_failed("--plot-dir", plot_dir, err) from None
        finally:
            plt.close(fig)
        return path
