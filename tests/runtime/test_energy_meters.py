"""Energy meters (`runtime/energy.py`): RAPL on a folder laid out like /sys/class/powercap (package zones only,
wrap-around at max_energy_range_uj), NVML through a fake, and "unavailable" with its reason, never a number."""

import pytest

from ptd_jax.runtime import energy
from tests.helpers.nvml import FakeNvml

RANGE = 262_143_328_850


def powercap(tmp_path, packages=(1_000_000, 5_000_000)):
    for k, start in enumerate(packages):
        zone = tmp_path / f"intel-rapl:{k}"
        zone.mkdir()
        (zone / "name").write_text(f"package-{k}\n")
        (zone / "energy_uj").write_text(f"{start}\n")
        (zone / "max_energy_range_uj").write_text(f"{RANGE}\n")
        sub = tmp_path / f"intel-rapl:{k}:0"  # a subzone (cores) inside the package: not added again
        sub.mkdir()
        (sub / "energy_uj").write_text("123\n")
        (sub / "max_energy_range_uj").write_text(f"{RANGE}\n")
    (tmp_path / "intel-rapl-mmio:0").mkdir()  # the same package through MMIO: not added again
    return tmp_path


def test_rapl_sums_packages_and_wraps(tmp_path):
    root = powercap(tmp_path)
    meter = energy.open_meter("cpu", root=root)
    assert meter.source.startswith("rapl (package-0, package-1")
    assert meter.read() == 0.0
    (root / "intel-rapl:0" / "energy_uj").write_text("3000000\n")  # +2 J
    (root / "intel-rapl:1" / "energy_uj").write_text("5500000\n")  # +0.5 J
    (root / "intel-rapl:0:0" / "energy_uj").write_text("999999999\n")
    assert meter.read() == pytest.approx(2.5)
    (root / "intel-rapl:0" / "energy_uj").write_text(f"{RANGE - 1_000_000}\n")
    assert meter.read() == pytest.approx(2.5 + (RANGE - 4_000_000) / 1e6)
    (root / "intel-rapl:0" / "energy_uj").write_text("2000000\n")  # wrapped: 1 J to the top, 2 J after it
    assert meter.read() == pytest.approx(2.5 + (RANGE - 4_000_000) / 1e6 + 3.0)


def test_rapl_unreadable_or_absent_is_unavailable(tmp_path):
    meter = energy.open_meter("cpu", root=tmp_path / "nothing")
    assert meter.read() is None and meter.source.startswith("unavailable: RAPL")
    root = powercap(tmp_path)
    (root / "intel-rapl:1" / "energy_uj").unlink()  # as a root-only file reads to a user: not there for us
    meter = energy.open_meter("cpu", root=root)
    assert meter.read() is None and "unavailable" in meter.source


def test_nvml_sums_local_gpus_in_joules():
    nvml = FakeNvml(gpus=3)
    meter = energy.open_meter("gpu", nvml_indices=[0, 2], nvml=nvml)
    assert meter.source.startswith("nvml") and meter.read() == 0.0
    nvml.energy_mj[0] += 1500
    nvml.energy_mj[1] += 99_000  # not this process's GPU
    nvml.energy_mj[2] += 2500
    assert meter.read() == pytest.approx(4.0)


def test_nvml_unsupported_or_absent_is_unavailable(monkeypatch):
    meter = energy.open_meter("gpu", nvml_indices=[0], nvml=FakeNvml(energy_supported=False))
    assert meter.read() is None and meter.source.startswith("unavailable: NVML's energy counter")
    monkeypatch.setattr(energy, "load_nvml", lambda: None)
    assert "nvidia-ml-py" in energy.open_meter("gpu", nvml_indices=[0]).source
    assert energy.open_meter("tpu").source == "unavailable: no energy counter known for tpu devices"


@pytest.mark.gpu
def test_nvml_on_this_gpu():
    """Where a GPU and nvidia-ml-py are present: the real counter advances while the GPU works."""
    pynvml = pytest.importorskip("pynvml")
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "gpu":
        pytest.skip("no GPU")
    meter = energy.open_meter("gpu", nvml_indices=[0], nvml=energy.load_nvml())
    assert meter.source.startswith("nvml"), meter.source
    x = jnp.ones((8192, 8192), jnp.bfloat16)
    for _ in range(50):
        x = (x @ x) / 8192
    x.block_until_ready()
    assert meter.read() > 0
    del pynvml


def test_the_job_counts_a_host_counter_once_per_host():
    rows = [[7, 10.0], [7, 10.0], [9, 4.0]]  # two processes on host 7 read the same RAPL packages
    assert energy.job_total(rows, per_host=True) == 14.0
    assert energy.job_total(rows, per_host=False) == 24.0  # NVML: each process's own GPUs
    assert energy.job_total([[7, 1.0], [9, float("nan")]], per_host=False) is None
    assert energy.RaplMeter.per_host and not energy.NvmlMeter.per_host
