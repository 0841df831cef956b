"""The GPUs that `ptd-train --compile-only --target NAME` compiles for: XLA's `GpuTargetConfig` text, from the same
facts XLA's own GPU spec files hold (xla/tools/hlo_opt/gpu_specs/{a100_sxm_80,h100_sxm}.txtpb).

Sources, field by field:
- a100-80gb, h100-sxm: every `gpu_device_info` field as in XLA's spec file of that GPU (read off real devices by
  XLA's authors: SM count, shared memory per block / per block opt-in / per SM, L2, clock, memory size and
  bandwidth, compute capability 8.0 and 9.0).
- h200: XLA ships no H200 spec. The H200 is the H100 SXM's GH100 die (NVIDIA H200 datasheet: same SM count and
  compute capability 9.0), so the SM, shared-memory, register, clock and L2 fields are the H100 SXM's; the memory is
  the datasheet's 141 GB of HBM3e at 4.8 TB/s, as CUDA reports it (143,771 MiB, nvidia-smi on an H200 SXM).
The preset names are `ptd-plan --hardware`'s (`perf/hardware.py`), so one name means one GPU everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class GpuTarget:
    """One GPU as XLA:GPU's compiler sees it."""

    name: str
    description: str
    """The device kind string (what `jax.devices()[0].device_kind` says on the real GPU)."""
    compute_capability: tuple[int, int]
    sm_count: int
    fpus_per_sm: int
    shared_memory_per_block: int
    shared_memory_per_block_optin: int
    """The most shared memory one block may ask for: the limit a Triton kernel's tiles must fit."""
    shared_memory_per_sm: int
    l2_cache_bytes: int
    clock_ghz: float
    memory_bytes: int
    memory_bandwidth: float
    """Bytes/s."""

    def target_config(self) -> str:
        """XLA's `GpuTargetConfig` text proto, for `jax.experimental.topologies.get_topology_desc`."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {self.shared_memory_per_block}
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: {self.fpus_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{self.description}"
"""


_HOPPER = dict(compute_capability=(9, 0), sm_count=132, fpus_per_sm=128, shared_memory_per_block=49152,
               shared_memory_per_block_optin=232448, shared_memory_per_sm=233472, l2_cache_bytes=52428800,
               clock_ghz=1.98)

TARGETS: dict[str, GpuTarget] = {
    "a100-80gb": GpuTarget("a100-80gb", "NVIDIA A100-SXM4-80GB", compute_capability=(8, 0), sm_count=108,
                           fpus_per_sm=64, shared_memory_per_block=49152, shared_memory_per_block_optin=166912,
                           shared_memory_per_sm=167936, l2_cache_bytes=41943040, clock_ghz=1.41,
                           memory_bytes=85100068864, memory_bandwidth=2039040000000),
    "h100-sxm": GpuTarget("h100-sxm", "NVIDIA H100 80GB HBM3", memory_bytes=84978434048,
                          memory_bandwidth=3352320000000, **_HOPPER),
    "h200": GpuTarget("h200", "NVIDIA H200", memory_bytes=143771 * MIB, memory_bandwidth=4.8e12, **_HOPPER),
}


def target(name: str) -> GpuTarget:
    if name not in TARGETS:
        raise ValueError(f"target={name!r} is not one of {sorted(TARGETS)}")
    return TARGETS[name]
