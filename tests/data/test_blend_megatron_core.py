"""Our blend index against megatron-core's own: `megatron.core.datasets.helpers.build_blending_indices` (its compiled
C++, shipped in the wheel as helpers_cpp) fills the dataset index and the dataset-sample index for the weights as
megatron-core's `normalize` makes them; ours, built by blocks, must equal both arrays element for element."""

import numpy as np
import pytest

pytest.importorskip("torch")
helpers = pytest.importorskip("megatron.core.datasets.helpers_cpp")
mcore_utils = pytest.importorskip("megatron.core.datasets.utils")

from ptd_jax.data.blend import BlendIndex, normalize  # noqa: E402

WEIGHT_SETS = [
    [0.3, 0.7],
    [1, 2, 3],
    [5, 0, 1, 1e-3],
    [1] * 9,
    [0.1, 0.2, 0.3, 0.15, 0.25, 0.01, 0.7, 0.3, 0.9, 0.05],
    [1e-6, 1.0],
    [17, 4, 93, 2, 2],
]


@pytest.mark.parametrize("weights", WEIGHT_SETS, ids=str)
def test_blend_index_equals_megatron_cores_build_blending_indices(weights, tmp_path):
    size = 70_000  # past our first block: the continuation from the counts is checked too
    theirs_weights = np.asarray(mcore_utils.normalize(weights), np.float64)
    np.testing.assert_array_equal(normalize(weights), theirs_weights)
    dataset_index = np.zeros(size, np.int16)
    dataset_sample_index = np.zeros(size, np.int64)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, theirs_weights, len(weights), size, False)
    ours = BlendIndex(weights, tmp_path)
    got_index, got_sample_index = ours.indices(0, size)
    np.testing.assert_array_equal(got_index, dataset_index)
    np.testing.assert_array_equal(got_sample_index, dataset_sample_index)
    again = BlendIndex(weights, tmp_path).indices(size - 1000, 1000)  # from the cached blocks
    np.testing.assert_array_equal(again[0], dataset_index[-1000:])
    np.testing.assert_array_equal(again[1], dataset_sample_index[-1000:])
