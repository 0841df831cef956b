"""Clock plans (`runtime/clocks.py`) with a fake NVML: locked on entry, reset on every exit (return, error,
SIGTERM), one line without the permission, and the governor that raises the clocks when the step is too slow.
No real clock is ever changed here."""

import json
import subprocess
import sys
import textwrap

import pytest

from ptd_jax.runtime import clocks
from ptd_jax.runtime.clocks import ClockError, ClockLocks, ClockPlan, Governor
from tests.helpers.nvml import FakeNvml
from tests.helpers.repo import ROOT


def write_plan(path, **changes):
    plan = {"format": clocks.PLAN_FORMAT, "hardware": "h200", "epsilon": 0.01, "max_clock_mhz": 1980}
    plan["clocks_mhz"] = [1800, 1980]
    plan.update(changes)
    path.write_text(json.dumps(plan))
    return path


def test_read_plan(tmp_path):
    plan = clocks.read_plan(write_plan(tmp_path / "plan.json"))
    assert plan.p == 2 and plan.clocks_mhz == (1800.0, 1980.0) and plan.hardware == "h200"
    cases = [("{", "does not parse"), ("[]", "is not a plan")]
    cases += [([1800, "fast"], "must be positive numbers"), ([0, 1800], "positive"), ([1800, 99999], "up to max")]
    for bad, words in cases:
        path = tmp_path / "bad.json"
        if isinstance(bad, list):
            write_plan(path, clocks_mhz=bad)
        else:
            path.write_text(bad)
        with pytest.raises(ClockError, match=words) as err:
            clocks.read_plan(path)
        assert "\n" not in str(err.value)


def test_locked_then_reset_on_return_and_on_error():
    nvml = FakeNvml(gpus=2)
    with ClockLocks(nvml, {0: 1980, 1: 1980}):
        assert nvml.locked == {0: (1980, 1980), 1: (1980, 1980)}
    assert nvml.locked == {}
    with pytest.raises(ZeroDivisionError), ClockLocks(nvml, {1: 1500}):
        assert nvml.locked == {1: (1500, 1500)}
        raise ZeroDivisionError("a failed step")
    assert nvml.locked == {} and nvml.calls[-1] == ("reset", 1)


def test_no_permission_is_one_line_and_leaves_nothing_locked():
    nvml = FakeNvml(gpus=2, permission=False)
    with pytest.raises(ClockError, match="no permission") as err, ClockLocks(nvml, {0: 1980}):
        pytest.fail("entered without the permission")
    assert "\n" not in str(err.value) and nvml.locked == {}


def test_sigterm_resets_the_clocks(tmp_path):
    """A process holding locks is sent SIGTERM: it resets them and exits 143."""
    log = tmp_path / "calls.json"
    script = textwrap.dedent(
        f"""
        import json, os, signal, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from ptd_jax.runtime.clocks import ClockLocks
        from tests.helpers.nvml import FakeNvml
        nvml = FakeNvml(gpus=1)
        try:
            with ClockLocks(nvml, {{0: 1200}}):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
        finally:
            open({str(log)!r}, "w").write(json.dumps(nvml.calls))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert done.returncode == 143, done.stderr
    assert json.loads(log.read_text()) == [["lock", 0, 1200, 1200], ["reset", 0]]


def test_governor_measures_the_target_at_full_clock_then_raises_when_slow():
    nvml = FakeNvml(gpus=2)
    plan = ClockPlan((1500.0, 1200.0), "h200", 0.01, 1980.0)
    said = []
    with ClockLocks(nvml, {0: 1980, 1: 1980}) as locks:
        governor = Governor(locks, {0: 1500.0, 1: 1200.0}, plan, said.append)
        governor.observe(9.0, includes_compile=True)
        for k in range(clocks.WINDOW):
            governor.observe(1.0, iteration=k)
        assert governor.target_s == 1.0 and nvml.locked == {0: (1500, 1500), 1: (1200, 1200)}
        for k in range(clocks.WINDOW):  # within (1 + eps) x target: nothing changes
            governor.observe(1.005, iteration=10 + k)
        assert nvml.locked[1] == (1200, 1200)
        for k in range(clocks.WINDOW):  # 10% slower: clocks up by 1.1 / 1.01, to the 15 MHz step
            governor.observe(1.1, iteration=20 + k)
        assert nvml.locked == {0: (1635, 1635), 1: (1320, 1320)}
        assert [e["event"].split(":")[-1].strip() for e in governor.events] == ["plan locked", "clocks raised"]
        assert "clocks raised" in said[-1] and "iteration 22" in said[-1]  # the median turned at the third slow window
    assert nvml.locked == {}


def test_nvml_index_follows_cuda_visible_devices():
    assert clocks.nvml_index(1, "4,6") == 6
    assert clocks.nvml_index(1, "") == 1
    assert clocks.nvml_index(0, "GPU-5d7c") == 0
