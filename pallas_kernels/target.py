"""The GPU a kernel's blocks are chosen for: its compute capability and the shared memory one block may use.

Triton stages the tiles of every `dot` through shared memory, so a flash-attention block too large for the SM does
not compile ("Shared memory size limit exceeded: requested 262144, available: 232448"). The kernels therefore pick
their blocks from the target's limit (`flash_attention.choose_blocks`). The target is, in order:
- the one set by `compile_target(...)` (`ptd_jax/aot` sets the `--target` GPU's when compiling without one);
- this process's first GPU, by its compute capability;
- `DEFAULT`, an A100 (sm_80, the paper's GPU and the smallest limit of the datacenter GPUs here), for CPU runs,
  where the kernels are interpreted and the blocks decide only the work, not whether it compiles.

`pallas_kernels` imports nothing from `ptd_jax`; `ptd_jax.perf.hardware.Chip` describes the same GPUs for XLA.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax

SHARED_MEMORY_PER_BLOCK_OPTIN = {
    (8, 0): 163 * 1024,  # A100: 166,912 bytes, XLA's a100_sxm_80 spec and its compile error ("available: 166912")
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,  # H100, H200: 232,448 bytes, XLA's h100_sxm spec and its compile error ("available: 232448")
    (10, 0): 227 * 1024,
    (12, 0): 99 * 1024,
}
"""The most shared memory one thread block may opt in to, by compute capability (CUDA C++ Programming Guide,
"Technical Specifications per Compute Capability": 163 KB on 8.0 and 8.7, 99 KB on 8.6, 8.9 and 12.0, 227 KB on 9.0
and 10.0). An unlisted capability takes the largest listed one not above it."""


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """What the block choice needs to know of a GPU."""

    compute_capability: tuple[int, int]
    shared_memory_per_block: int
    """Bytes one block may use (the opt-in maximum, `cudaDevAttrMaxSharedMemoryPerBlockOptin`)."""

    @classmethod
    def of(cls, compute_capability: tuple[int, int]) -> GpuTarget:
        known = [cc for cc in SHARED_MEMORY_PER_BLOCK_OPTIN if cc <= tuple(compute_capability)]
        if not known:
            raise ValueError(f"compute_capability={compute_capability} is older than sm_80 (Ampere)")
        return cls(tuple(compute_capability), SHARED_MEMORY_PER_BLOCK_OPTIN[max(known)])

    @property
    def hopper_or_later(self) -> bool:
        """sm_90 and later: Triton's warp-group MMAs stage more of each tile (see `flash_attention`)."""
        return self.compute_capability >= (9, 0)


DEFAULT = GpuTarget.of((8, 0))

_TARGET: contextvars.ContextVar[GpuTarget | None] = contextvars.ContextVar("pallas_gpu_target", default=None)


@contextlib.contextmanager
def compile_target(target: GpuTarget):
    """Choose the kernels' blocks for `target` inside this context (compiling for a GPU that is not here)."""
    token = _TARGET.set(target)
    try:
        yield target
    finally:
        _TARGET.reset(token)


def current_target() -> GpuTarget:
    """The target set by `compile_target`, else this process's first GPU, else `DEFAULT`."""
    chosen = _TARGET.get()
    if chosen is not None:
        return chosen
    if jax.default_backend() == "gpu":
        capability = getattr(jax.devices()[0], "compute_capability", None)
        if capability:
            return GpuTarget.of(tuple(int(x) for x in str(capability).split(".")[:2]))
    return DEFAULT
