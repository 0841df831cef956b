"""The GPU the kernels choose their blocks for: set by `compile_target`, else this process's GPU, else an A100."""

import pytest

from pallas_kernels import BlockSizes, GpuTarget, choose_blocks, compile_target, current_target
from pallas_kernels.target import DEFAULT


def test_shared_memory_per_block_by_compute_capability():
    """CUDA's opt-in limits per block: 163 KiB on sm_80, 99 KiB on sm_86/sm_89 (and unlisted 8.x between take the
    last listed below them), 227 KiB on sm_90; older than Ampere is refused."""
    assert [GpuTarget.of(cc).shared_memory_per_block for cc in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (8, 8)]] == [
        166_912,
        101_376,
        101_376,
        232_448,
        232_448,
        166_912,
    ]
    assert GpuTarget.of((9, 0)).hopper_or_later and not GpuTarget.of((8, 9)).hopper_or_later
    with pytest.raises(ValueError, match=r"compute_capability=\(7, 0\) is older than sm_80"):
        GpuTarget.of((7, 0))


def test_the_context_sets_the_target_and_the_blocks_follow_it():
    """On CPU the default is the A100; inside `compile_target` the blocks are chosen for that GPU: float32 at head
    dim 128 keeps 64 x 64 on an A100 (147,968 bytes of 166,912) but takes 32 x 32 on a 99 KiB sm_86."""
    assert current_target() == DEFAULT == GpuTarget.of((8, 0))
    assert choose_blocks(2048, 128, "float32") == BlockSizes(64, 64)
    with compile_target(GpuTarget.of((8, 6))) as small:
        assert current_target() == small
        assert choose_blocks(2048, 128, "float32") == BlockSizes(32, 32)
    assert current_target() == DEFAULT
