import os

import jax
import pytest

from ptd_jax.config import ConfigError, ParallelConfig
from ptd_jax.parallel.mesh import MESH_AXES, make_mesh, set_fake_devices


def test_mesh_axes_and_tensor_innermost():
    mesh = make_mesh(
        ParallelConfig(
            data_parallel_size=2, pipeline_model_parallel_size=2, tensor_model_parallel_size=2, global_batch_size=2
        )
    )
    assert mesh.axis_names == MESH_AXES == ("data", "pipe", "tensor")
    assert dict(mesh.shape) == {"data": 2, "pipe": 2, "tensor": 2}
    ids = [[[d.id for d in row] for row in plane] for plane in mesh.devices]
    # neighbouring device ids form a tensor group (one NVLink domain on real hardware)
    assert ids[0][0] == [0, 1] and ids[0][1] == [2, 3] and ids[1][0] == [4, 5]


def test_sub_mesh_uses_first_devices():
    mesh = make_mesh(ParallelConfig(tensor_model_parallel_size=4))
    assert [d.id for d in mesh.devices.ravel()] == [0, 1, 2, 3]


def test_more_devices_than_exist():
    with pytest.raises(ConfigError, match=r"needs 16 devices but only 8 exist"):
        make_mesh(ParallelConfig(data_parallel_size=2, tensor_model_parallel_size=8, global_batch_size=2))


def test_fake_devices_too_late_is_a_clear_error():
    assert len(jax.devices()) == 8  # the backend is up (conftest asked for 8)
    set_fake_devices(8)  # asking for what exists is fine
    with pytest.raises(
        ConfigError,
        match=r"fake devices=4 requested but the JAX CPU backend is already "
        r"initialised with 8 device",
    ):
        set_fake_devices(4)
    assert "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]
