"""The energy planner (`perf/energy.py`): its choice equals brute force over every combination of clocks on small
tables (p <= 3, m <= 4, every schedule), its fast evaluation equals the one simulator, the per-action bound lies
below every per-rank plan, stage times add up to `perf.timing`'s microbatch, and measured profiles parse or are
refused with one line."""

import json
from dataclasses import replace

import pytest

from ptd_jax.config import PIPELINE_SCHEDULES, SCHEDULE_SPECS, ConfigError, ParallelConfig
from ptd_jax.presets import model_preset
from ptd_jax.parallel.pipeline import ScheduleError, build
from ptd_jax.perf import energy
from ptd_jax.perf.energy import Problem, StageTimes, Work
from ptd_jax.perf.hardware import CLOCK_POWER, HARDWARE
from ptd_jax.perf.timing import predict

COARSE = replace(CLOCK_POWER["a100-80gb"], step_mhz=235.0)  # 4 clocks: 1410, 1175, 940, 705
TIMES = StageTimes(
    Work(0.9, 0.1), Work(1.1, 0.3), Work(0.8, 0.1), head=Work(0.6, 0.1), tail_busy=Work(0.0, 0.2), tail_wait_s=0.3
)


def small_tables():
    for name in PIPELINE_SCHEDULES:
        spec = SCHEDULE_SPECS[name]
        for p in (2, 3):
            for m in (2, 4):
                try:
                    yield name, build(name, p, spec.chunks or 2, m)
                except ScheduleError:  # e.g. interleaved needs m >= p
                    continue


@pytest.mark.parametrize("epsilon", [0.0, 0.02, 0.15])
def test_plan_equals_brute_force_on_small_tables(epsilon):
    tables = list(small_tables())
    assert {name for name, _ in tables} == set(PIPELINE_SCHEDULES)
    for name, table in tables:
        problem = Problem(table, TIMES, COARSE)
        best = energy.plan(problem, epsilon)
        clocks, brute = energy.brute_force(problem, epsilon)
        where = f"{name} p={table.p} m={table.m} epsilon={epsilon}"
        assert best.exact, where
        assert best.energy_j == pytest.approx(brute, rel=1e-9), (where, best.clocks, clocks)
        assert best.clocks == clocks, where  # ties go to the higher clocks in both
        assert best.time_s <= best.full_time_s * (1 + epsilon) * (1 + 1e-9), where


def test_plan_with_a_measured_profile_equals_brute_force(tmp_path):
    path = tmp_path / "sweep.json"
    points = [{"sm_mhz": 1410, "busy_w": 390}, {"sm_mhz": 1200, "busy_w": 300}, {"sm_mhz": 900, "busy_w": 230}]
    path.write_text(
        json.dumps({"format": energy.PROFILE_FORMAT, "hardware": "a100-80gb", "idle_w": 80, "points": points})
    )
    power = energy.load_profile(path, CLOCK_POWER["a100-80gb"])
    assert power.clocks() == [1410, 1200, 900] and power.busy_w(1305) == pytest.approx(345)
    problem = Problem(build("zb-v", 3, 2, 4), TIMES, power)
    for epsilon in (0.0, 0.1):
        assert energy.plan(problem, epsilon).energy_j == pytest.approx(energy.brute_force(problem, epsilon)[1])


def test_search_equals_the_simulator_and_the_bound_lies_below():
    problem = Problem(build("1f1b", 3, 1, 4), TIMES, COARSE)
    best = energy.plan(problem, 0.1)
    assert best.clocks != (1410.0,) * 3  # a real choice, checked through Table.simulate inside plan()
    step = problem.step(list(best.clocks))
    assert step["time_s"] == pytest.approx(best.time_s) and step["energy_j"] == pytest.approx(best.energy_j)
    sim = problem.table.simulate(duration=problem.duration(list(best.clocks)))
    assert step["time_s"] == pytest.approx(sim["makespan"] + max(0.2 * 1410 / f for f in [1410]) + 0.3)
    for epsilon in (0.0, 0.1):
        assert energy.per_action_bound(problem, epsilon) <= energy.plan(problem, epsilon).energy_j * (1 + 1e-9)
    # at full clock and eps = 0 on a table with no slack anywhere, nothing is saved
    flat = Problem(build("gpipe", 2, 1, 2), StageTimes(Work(1.0), Work(1.0), Work(1.0)), COARSE)
    assert energy.plan(flat, 0.0).saving == pytest.approx(0.0)
    assert energy.per_action_bound(flat, 0.0) == pytest.approx(energy.plan(flat, 0.0).energy_j)


@pytest.mark.parametrize("name, v, head_rank", [("1f1b", 1, 2), ("gpipe", 1, 2), ("zb-v", 2, 0)])
def test_the_rank_with_the_output_layer_keeps_the_highest_clock(name, v, head_rank):
    """At eps = 0 every rank is on the critical path somewhere (stage 0 alone runs the first forward, and equal
    cells tie), so nothing slows; with slack to share, the ranks without the output layer slow most (ZB-V's last
    virtual stage is on rank 0)."""
    times = StageTimes(Work(1.0), Work(1.0), Work(1.0), head=Work(1.5))
    problem = Problem(build(name, 3, v, 4), times, CLOCK_POWER["a100-80gb"])
    assert energy.plan(problem, 0.0).clocks == (1410.0,) * 3
    best = energy.plan(problem, 0.05)
    others = [f for r, f in enumerate(best.clocks) if r != head_rank]
    assert best.clocks[head_rank] > max(others), best.clocks
    assert 0 < best.slowdown <= 0.05 and best.saving > 0.03


def test_stage_times_add_up_to_the_timing_model():
    cfg = model_preset("paper-1.7b").replace(num_layers=24, dtype="float16")
    parallel = ParallelConfig.for_devices(
        32, tensor_model_parallel_size=2, pipeline_model_parallel_size=4, global_batch_size=64
    )
    hw = HARDWARE["a100-80gb"]
    times = energy.stage_times(cfg, parallel, hw, "full")
    slot = predict(cfg, parallel, hw, "full").details["microbatch_slot_s"]
    assert (times.f + times.b + times.w + times.head).total == pytest.approx(slot, rel=0.02)
    assert times.f.compute > times.f.memory > 0


def test_bad_input():
    problem = Problem(build("1f1b", 2, 1, 2), TIMES, COARSE)
    with pytest.raises(ConfigError, match="epsilon=-0.01"):
        energy.plan(problem, -0.01)
    with pytest.raises(ConfigError, match="hardware='tpu-v4'"):
        energy.clock_power("tpu-v4")


@pytest.mark.parametrize(
    "text, match",
    [
        ("{", "does not parse"),
        ('{"points": []}', "is not a clock profile"),
        (f'{{"format": "{energy.PROFILE_FORMAT}", "idle_w": 50, "points": [{{"sm_mhz": 1000, "busy_w": 1}}]}}', "two"),
        (
            f'{{"format": "{energy.PROFILE_FORMAT}", "idle_w": 50, "points": [{{"sm_mhz": 1000, "busy_w": -1}}, 2]}}',
            "points\\[0\\]",
        ),
        (
            f'{{"format": "{energy.PROFILE_FORMAT}", "hardware": "h200", "idle_w": 5, "points": '
            '[{"sm_mhz": 1000, "busy_w": 1}, {"sm_mhz": 900, "busy_w": 1}]}',
            "hardware='h200'",
        ),
    ],
)
def test_profile_refused_with_one_line(tmp_path, text, match):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        energy.load_profile(path, CLOCK_POWER["a100-80gb"])
    assert "\n" not in str(err.value)
