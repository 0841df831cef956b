"""Energy in the loop (`train/hooks.StepTimer`, `train/metrics.energy_fields`, `train/power.py`): each log record
carries joules per iteration, per token and the mean power over the same window as its step time, with their
source; an unavailable meter gives None, never a number; a clock plan for another p or GPU is refused before
anything runs."""

import json

import pytest

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.runtime import clocks, energy
from ptd_jax.train import RunOptions, train
from ptd_jax.train.hooks import StepTimer
from ptd_jax.train.metrics import energy_fields, energy_summary, log_line

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)
PARALLEL = ParallelConfig(micro_batch_size=4, global_batch_size=8)


class Counter:
    """A meter whose counter the test advances."""

    source = "test counter"

    def __init__(self):
        self.joules = 0.0

    def read(self):
        return self.joules


def test_the_window_is_the_step_timers():
    meter = Counter()
    timer = StepTimer(lambda x: x, meter=meter)
    timer.step_done({})  # the compile step
    meter.joules = 50.0
    timer.lap({})
    assert timer.window.joules == 50.0 and timer.window.steps == 1
    meter.joules = 70.0  # spent in the hooks (evaluation, saving): outside every window
    timer.exclude_hooks()
    for _ in range(4):
        timer.step_done({})
        meter.joules += 10.0
    timer.lap({})
    assert timer.window.joules == 40.0 and timer.window.steps == 4
    fields = energy_fields(timer.window, tokens_per_step=100, source=meter.source)
    assert fields["energy_j"] == 10.0 and fields["joules_per_token"] == 0.1
    assert fields["avg_power_w"] == pytest.approx(40.0 / timer.window.seconds)
    assert fields["energy_source"] == "test counter"


def test_unavailable_is_none_never_a_number():
    timer = StepTimer(lambda x: x, meter=energy.Unavailable("no counter here"))
    timer.step_done({})
    timer.lap({})
    fields = energy_fields(timer.window, 100, "unavailable: no counter here")
    assert fields["energy_j"] is fields["joules_per_token"] is fields["avg_power_w"] is None
    record = {"includes_compile": False, **fields}
    assert energy_summary([record]) == {
        "energy_j": None,
        "joules_per_token": None,
        "avg_power_w": None,
        "energy_source": "unavailable: no counter here",
    }


@pytest.mark.slow  # a training run: ~20 s of one core, 40 s on a shared machine
def test_records_and_summary_carry_energy(small_corpus, tmp_path, monkeypatch):
    class Ticking(Counter):
        source = "rapl (test)"

        def read(self):
            self.joules += 2.0
            return self.joules

    monkeypatch.setattr(energy, "open_meter", lambda platform, indices=None: Ticking())
    metrics = tmp_path / "m.jsonl"
    cfg = TrainConfig(train_iters=3, lr=1e-3, lr_warmup_iters=0, log_interval=1, eval_iters=0)
    summary = train(
        TINY,
        PARALLEL,
        cfg,
        RunOptions(
            data_path=small_corpus, progress=False, metrics_file=str(metrics), reference_step=True, peak_tflops=1.0
        ),
    )
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["energy_source"] for r in records] == ["rapl (test)"] * 3
    assert all(r["energy_j"] == 2.0 and r["joules_per_token"] == 2.0 / (8 * 32) for r in records)
    assert summary["energy_source"] == "rapl (test)" and summary["energy_j"] == 2.0
    assert "energy: 2 J/iteration" in log_line(records[-1], 3)


def test_a_clock_plan_for_another_run_is_refused_before_anything_runs(tmp_path):
    plan = {"format": clocks.PLAN_FORMAT, "hardware": "h200", "epsilon": 0.0, "max_clock_mhz": 1980}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**plan, "clocks_mhz": [1980, 1900]}))
    cfg = TrainConfig(train_iters=1)
    with pytest.raises(ConfigError, match="holds 2 clocks \\(p=2\\) but the run has pipeline_model_parallel_size=1"):
        train(TINY, PARALLEL, cfg, RunOptions(gpu_clock_plan=str(path), data_path=str(tmp_path / "none")))
    path.write_text(json.dumps({**plan, "clocks_mhz": [1980]}))
    with pytest.raises(ConfigError, match="is for hardware='h200' but this run's devices are 'cpu'"):
        train(TINY, PARALLEL, cfg, RunOptions(gpu_clock_plan=str(path), data_path=str(tmp_path / "none")))
    path.write_text("{")
    with pytest.raises(ConfigError, match="does not parse"):
        train(TINY, PARALLEL, cfg, RunOptions(gpu_clock_plan=str(path)))


@pytest.mark.slow  # two training runs: ~20 s of one core each
def test_a_clock_plan_is_locked_governed_and_reset_through_the_loop(small_corpus, tmp_path, monkeypatch):
    """With a fake NVML standing in for the driver and the CPU taken for an H200: full clock for the first windows,
    then the plan's clock, reset at the end and when the run fails."""
    from ptd_jax.perf.hardware import HARDWARE
    from ptd_jax.train import power
    from tests.helpers.nvml import FakeNvml

    nvml = FakeNvml(gpus=8)
    monkeypatch.setattr(energy, "load_nvml", lambda: nvml)
    monkeypatch.setattr(power, "for_device_kind", lambda kind: HARDWARE["h200"])
    path = tmp_path / "plan.json"
    plan = {"format": clocks.PLAN_FORMAT, "hardware": "h200", "epsilon": 0.5, "max_clock_mhz": 1980}
    path.write_text(json.dumps({**plan, "clocks_mhz": [1500]}))
    cfg = TrainConfig(train_iters=2 + clocks.WINDOW, lr=1e-3, lr_warmup_iters=0, log_interval=1, eval_iters=0)
    options = dict(data_path=small_corpus, progress=False, reference_step=True, peak_tflops=1.0)
    summary = train(TINY, PARALLEL, cfg, RunOptions(gpu_clock_plan=str(path), **options))
    (gpu,) = {call[1] for call in nvml.calls}
    assert nvml.calls == [("lock", gpu, 1980, 1980), ("lock", gpu, 1500, 1500), ("reset", gpu)]
    assert [e["event"] for e in summary["gpu_clock_events"]] == ["plan locked"]

    def fail(record):
        if record["iteration"] == 3:
            raise RuntimeError("a failed step")

    nvml.calls.clear()
    with pytest.raises(RuntimeError, match="a failed step"):
        train(TINY, PARALLEL, cfg, RunOptions(gpu_clock_plan=str(path), on_record=fail, **options))
    assert nvml.calls == [("lock", gpu, 1980, 1980), ("reset", gpu)] and nvml.locked == {}
