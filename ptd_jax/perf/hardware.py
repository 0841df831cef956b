"""The one GPU catalogue: every fact about a device the project uses, in one table (`CATALOGUE`).

Each entry names a device (as `ptd-plan --hardware` and `ptd-train --compile-only --target` spell it), the words
that identify it in JAX's `device_kind`, its dense 16-bit and float32 peaks (for MFU), and, where known, its node and
links (the performance model: `PRESETS`, the planner's `--hardware` choices) and its chip as XLA:GPU compiles for it
(`Chip`: `TARGETS`, the `--target` choices). Datasheet peaks and bandwidths, with efficiencies and latencies taken
from microbenchmarks and NVIDIA's own collective model — never fitted to the paper's results.

- `a100-80gb`: the paper's Selene DGX A100 node (§5): 8 A100-80GB SXM (NVIDIA A100 datasheet: 312 TFLOP/s dense
  FP16/BF16 Tensor Core, 80 GB HBM2e at 2,039 GB/s, NVLink3 600 GB/s per GPU = 300 each way through NVSwitch),
  8 × 200 Gb/s HDR InfiniBand per node (paper §5: one HCA per GPU, 25 GB/s per GPU each way).
- `h100-sxm`: DGX H100: 989 TFLOP/s, 3.35 TB/s HBM3, NVLink4 900 GB/s (450 each way), 8 × 400 Gb/s NDR per node.
- `h200`: DGX H200: the H100's compute and links, 141 GB of HBM3e at 4.8 TB/s.

Efficiencies (from measurements, not from the paper):
- GEMM 0.80 of peak when compute-bound: a random 8192³ bf16 matmul ran at 790 of 989 TFLOP/s on an H200
  (a measurement the team made before this project; not in this repository). For the A100 the best published
  microbenchmark is higher: 267.9 of 312 TFLOP/s = 0.859 at its best shape (6912×16384×2048, CUDA 12.1; Stas
  Bekman's ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"),
  a best case over shapes with a 2023 cuBLAS; the paper's runs used CUDA 11 (Megatron-LM's
  examples/pretrain_gpt3_175B.sh: container nvcr.io/nvidia/pytorch:20.12-py3), so 0.80 is kept for every preset.
  The efficiency does not depend on the GEMM's shape here: at the paper's shapes the per-GPU GEMMs are large, and
  a smaller t only makes them larger, so no term of the t = 4 vs t = 8 comparison comes from it. Table 1 depends on
  it: 0.859 raises every prediction and takes the largest error past the ±15% goal
  (experiments/paper/table1_plan.py with a changed preset shows it).
- HBM 0.90 of the datasheet: a device copy measured 4.3 of 4.8 TB/s on the same H200.
- NVLink all-reduce bus bandwidth: on A100 (sm80) NCCL's own cost model caps a collective's bus bandwidth at
  235 GB/s (NVIDIA/nccl, src/graph/tuning.cc, NCCL 2.7.5: `if (compCap80) busBw = std::min(busBw, 235.0f)`), i.e.
  0.783 of the 300 GB/s each way; NVSwitch gives every GPU the same links whatever the group size, so 4 and 8 GPUs
  of a node see the same bus bandwidth. The dataclass default (Hopper presets) is 0.77, unmeasured there.
- Collective latency: NCCL's model for a ring with the Simple protocol (the one used for large messages), same
  file: a base of 8.4 µs plus 3.4 µs per ring step on NVLink and 9.6 µs per step on the network; an all-reduce
  over n ranks has 2(n−1) steps, an all-gather or a reduce-scatter n−1.
- InfiniBand 0.90 of line rate (large messages, GPUDirect RDMA, one NIC per GPU).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ptd_jax.config import ConfigError

GIB = 2**30
MIB = 2**20

DEFAULT_ALLOCATOR_FRACTION = 0.75
"""JAX's GPU allocator preallocates this fraction of the device's memory and allocates within it
(`XLA_PYTHON_CLIENT_MEM_FRACTION` sets another): the one budget of `ptd-plan`, `ptd-train` and `--compile-only`."""


def allocator_fraction() -> float:
    """The fraction of a GPU's memory a JAX program may use: `XLA_PYTHON_CLIENT_MEM_FRACTION`, else JAX's 0.75."""
    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        fraction = float(value) if value else DEFAULT_ALLOCATOR_FRACTION
    except ValueError:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} is not a number") from None
    if not 0 < fraction <= 1:
        raise ConfigError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r} must be in (0, 1]")
    return fraction


@dataclass(frozen=True)
class Chip:
    """A GPU as XLA:GPU's compiler sees it (`Hardware.target_config`). Sources, field by field:
    - A100 80GB, H100 SXM: every field as in XLA's own spec file of that GPU
      (xla/tools/hlo_opt/gpu_specs/{a100_sxm_80,h100_sxm}.txtpb, read off real devices by XLA's authors);
    - H200: XLA ships no H200 spec. It is the H100 SXM's GH100 die (NVIDIA H200 datasheet: same SM count and
      compute capability 9.0), so these fields are the H100 SXM's."""

    compute_capability: tuple[int, int]
    sm_count: int
    fpus_per_sm: int
    shared_memory_per_block: int
    shared_memory_per_block_optin: int
    """The most shared memory one block may ask for: the limit a kernel's tiles must fit."""
    shared_memory_per_sm: int
    l2_cache_bytes: int
    clock_ghz: float


AMPERE_A100 = Chip((8, 0), 108, 64, 49152, 166912, 167936, 41943040, 1.41)
HOPPER_GH100 = Chip((9, 0), 132, 128, 49152, 232448, 233472, 52428800, 1.98)


@dataclass(frozen=True)
class Hardware:
    """One GPU and its node. Bandwidths are per GPU, one direction, in bytes/s."""

    name: str
    device_kind: str
    """Words that JAX's `device_kind` of this device contains ("H100 PCIe"); the first catalogue entry whose words
    all occur wins, so form-factor entries come before the plain name."""
    peak_flops: float
    """Dense 16-bit peak, FLOP/s."""
    peak_flops_fp32: float
    """Dense float32 peak as XLA runs it by default (TF32 on Ampere and later), FLOP/s."""
    memory_bytes: float = 0.0
    """HBM capacity as CUDA reports it (the figure XLA compiles against); 0 where the catalogue has no node."""
    hbm_bandwidth: float = 0.0
    gpus_per_node: int = 0
    nvlink_bandwidth: float = 0.0
    """Per GPU, one direction (NVSwitch: any pair of GPUs in the node at this rate)."""
    ib_bandwidth: float = 0.0
    """Per GPU, one direction (one NIC per GPU)."""
    chip: Chip | None = None
    """Set where `ptd-train --compile-only --target` can compile for it."""
    reported_kind: str = ""
    """The device kind string JAX reports on the real GPU, where it is more than "NVIDIA " + `device_kind`."""
    gemm_efficiency: float = 0.80
    hbm_efficiency: float = 0.90
    nvlink_efficiency: float = 0.77
    ib_efficiency: float = 0.90
    nvlink_latency_s: float = 3.4e-6
    """Per ring step on NVLink (NCCL 2.7.5's hwLat, Ring/Simple)."""
    ib_latency_s: float = 9.6e-6
    """Per ring step on the network (NCCL 2.7.5's hwLat, Ring/Simple)."""
    collective_base_latency_s: float = 8.4e-6
    """Once per collective or send/recv (NCCL 2.7.5's baseLat, Ring/Simple)."""

    def gemm_seconds(self, m: float, n: float, k: float, count: float = 1.0, bytes_per_element: int = 2) -> float:
        """Roofline time of `count` (M×K)·(K×N) GEMMs: the larger of compute at the efficient rate and the operands'
        traffic (read A and B, write C once) at the achievable HBM rate."""
        flops = 2.0 * m * n * k
        traffic = bytes_per_element * (m * k + k * n + m * n)
        return count * max(
            flops / (self.peak_flops * self.gemm_efficiency), traffic / (self.hbm_bandwidth * self.hbm_efficiency)
        )

    def memory_seconds(self, nbytes: float) -> float:
        """Time of a memory-bound kernel that moves `nbytes` through HBM."""
        return nbytes / (self.hbm_bandwidth * self.hbm_efficiency)

    def link(self, within_node: bool) -> tuple[float, float]:
        """(achievable bandwidth in bytes/s, latency per step in s) of the link a collective runs on."""
        if within_node:
            return self.nvlink_bandwidth * self.nvlink_efficiency, self.nvlink_latency_s
        return self.ib_bandwidth * self.ib_efficiency, self.ib_latency_s

    def allreduce_seconds(self, nbytes: float, n: int, within_node: bool) -> float:
        bandwidth, latency = self.link(within_node)
        return ring_allreduce_seconds(nbytes, n, bandwidth, latency, self.collective_base_latency_s)

    def allgather_seconds(self, nbytes: float, n: int, within_node: bool) -> float:
        bandwidth, latency = self.link(within_node)
        return allgather_seconds(nbytes, n, bandwidth, latency, self.collective_base_latency_s)

    def p2p_seconds(self, nbytes: float, within_node: bool) -> float:
        """One send/recv between two GPUs: the bytes at the link's rate plus one ring step and NCCL's base."""
        bandwidth, latency = self.link(within_node)
        return nbytes / bandwidth + latency + self.collective_base_latency_s

    @property
    def usable_memory_bytes(self) -> float:
        """What a JAX run may allocate on this GPU (`allocator_fraction`), the budget every tool checks against."""
        return self.memory_bytes * allocator_fraction()

    @property
    def description(self) -> str:
        """The device kind string JAX reports on the real GPU."""
        return self.reported_kind or f"NVIDIA {self.device_kind}"

    def target_config(self) -> str:
        """XLA's `GpuTargetConfig` text proto, for `jax.experimental.topologies.get_topology_desc`."""
        c = self.chip
        if c is None:
            raise ValueError(f"target={self.name!r} has no chip description to compile for")
        major, minor = c.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {c.shared_memory_per_block}
  shared_memory_per_core: {c.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {c.sm_count}
  fpus_per_core: {c.fpus_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.hbm_bandwidth)}
  l2_cache_size: {c.l2_cache_bytes}
  clock_rate_ghz: {c.clock_ghz}
  device_memory_size: {int(self.memory_bytes)}
  shared_memory_per_block_optin: {c.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{self.description}"
"""


def _peak(name: str, kind: str, half_tflops: float, single_tflops: float) -> Hardware:
    """An entry known by its peaks only (MFU on that device; no node, no compile target)."""
    return Hardware(name, kind, half_tflops * 1e12, single_tflops * 1e12)


_NODE8_HOPPER = dict(gpus_per_node=8, nvlink_bandwidth=450e9, ib_bandwidth=50e9, chip=HOPPER_GH100)

CATALOGUE: tuple[Hardware, ...] = (
    # Dense (no sparsity) datasheet peaks, 16-bit and float32 (TF32 on Ampere and later).
    _peak("h100-pcie", "H100 PCIe", 756, 378),
    _peak("h100-nvl", "H100 NVL", 835, 418),
    Hardware(
        "h100-sxm",
        "H100",  # SXM5: JAX reports "NVIDIA H100 80GB HBM3"
        989e12,
        494e12,
        memory_bytes=84_978_434_048,
        hbm_bandwidth=3.35232e12,  # XLA's spec file (datasheet: 3.35 TB/s)
        reported_kind="NVIDIA H100 80GB HBM3",
        **_NODE8_HOPPER,
    ),
    _peak("h200-nvl", "H200 NVL", 835, 418),
    # the memory as CUDA reports it on an H200 SXM (nvidia-smi: 143,771 MiB) of the datasheet's 141 GB at 4.8 TB/s
    Hardware("h200", "H200", 989e12, 494e12, memory_bytes=143_771 * MIB, hbm_bandwidth=4.8e12, **_NODE8_HOPPER),
    _peak("gh200", "GH200", 989, 494),
    _peak("h800-pcie", "H800 PCIe", 756, 378),
    _peak("h800", "H800", 989, 494),
    _peak("b200", "B200", 2250, 1100),
    Hardware(
        "a100-80gb",
        "A100",  # SXM4 and PCIe alike in peak
        312e12,
        156e12,
        memory_bytes=85_100_068_864,
        hbm_bandwidth=2.03904e12,  # XLA's spec file (datasheet: 2,039 GB/s)
        gpus_per_node=8,
        nvlink_bandwidth=300e9,
        ib_bandwidth=25e9,
        nvlink_efficiency=235e9 / 300e9,
        chip=AMPERE_A100,
        reported_kind="NVIDIA A100-SXM4-80GB",
    ),
    _peak("a800", "A800", 312, 156),
    _peak("l40s", "L40S", 362, 183),
    _peak("l4", "L4", 121, 60),
    _peak("a10g", "A10G", 70, 35),
    _peak("v100", "V100", 125, 15.7),
    _peak("tpu-v4", "TPU v4", 275, 275),
    _peak("tpu-v5e", "TPU v5 lite", 197, 197),
    _peak("tpu-v5p", "TPU v5p", 459, 459),
    _peak("tpu-v6e", "TPU v6 lite", 918, 918),
)

HARDWARE: dict[str, Hardware] = {h.name: h for h in CATALOGUE if h.gpus_per_node}
"""The entries with a node: what the performance model and `ptd-plan --hardware` take (the paper's Selene DGX
A100 first)."""
HARDWARE = dict(sorted(HARDWARE.items(), key=lambda kv: kv[0] != "a100-80gb"))
TARGETS: dict[str, Hardware] = {h.name: h for h in CATALOGUE if h.chip is not None}
"""The entries XLA:GPU can compile for (`ptd-train --compile-only --target`)."""


def target(name: str) -> Hardware:
    if name not in TARGETS:
        raise ValueError(f"target={name!r} is not one of {sorted(TARGETS)}")
    return TARGETS[name]


def _words(text: str) -> list[str]:
    return text.lower().replace("-", " ").replace("_", " ").split()


def for_device_kind(device_kind: str) -> Hardware | None:
    """The catalogue entry for a JAX device kind ("NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"), or None."""
    words = _words(device_kind)
    return next((h for h in CATALOGUE if all(w in words for w in _words(h.device_kind))), None)


def measure_matmul_tflops(size: int = 1024, repeats: int = 5) -> float:
    """Achieved float32 matmul TFLOP/s of the first device (used as the 'peak' on unknown devices such as CPU)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((size, size), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def device_peak_tflops(
    device_kind: str, bf16: bool, override: float | None = None, num_local_devices: int = 1
) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it came from). Unknown devices (CPU) get a measured matmul rate, shared
    among the simulated devices of the host."""
    if override is not None:
        return override, "--peak-tflops"
    hw = for_device_kind(device_kind)
    if hw is not None:
        peak = (hw.peak_flops if bf16 else hw.peak_flops_fp32) / 1e12
        return peak, f"{hw.device_kind} datasheet ({'bf16' if bf16 else 'fp32/tf32'} dense)"
    measured = measure_matmul_tflops() / max(num_local_devices, 1)
    return measured, (
        f"measured 1024^3 fp32 matmul on {device_kind} / {num_local_devices} device(s) (override with --peak-tflops)"
    )


def ring_allreduce_seconds(nbytes: float, n: int, bandwidth: float, latency: float, base: float = 0.0) -> float:
    """Ring all-reduce of `nbytes` over n ranks: 2(n−1)/n of the bytes over each link (`bandwidth` is the bus
    bandwidth), 2(n−1) steps of `latency`, plus `base` once (NCCL's model)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency + base


def allgather_seconds(nbytes: float, n: int, bandwidth: float, latency: float, base: float = 0.0) -> float:
    """All-gather of a tensor of `nbytes` in total from n equal slices (also a reduce-scatter's time)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency + base


@dataclass(frozen=True)
class ClockPower:
    """How a GPU's speed and power follow its SM clock f (`perf/energy.py` plans one clock per pipeline rank with
    it). An action's compute-bound time scales with max_mhz / f, its memory-bound time does not (the HBM clock is
    not the SM clock); a busy GPU draws static_w + dynamic_w · (f / max_mhz)^exponent, one waiting in a bubble
    idle_w. `points`, where given (a measured sweep: `ptd-plan energy --profile`), replace the formula: busy power is
    interpolated between the measured (MHz, W) pairs and the plan's clocks are the measured ones."""

    name: str
    max_mhz: float
    min_mhz: float
    """The lowest clock the planner tries. Half the maximum: lower, the voltage stops falling with the clock and the
    power curve flattens, which `exponent` does not describe."""
    step_mhz: float
    """The spacing of the clocks the driver accepts (`nvidia-smi -q -d SUPPORTED_CLOCKS`)."""
    static_w: float
    dynamic_w: float
    exponent: float
    idle_w: float
    source: str = ""
    points: tuple[tuple[float, float], ...] = ()

    def clocks(self) -> list[float]:
        """The clocks a plan may use, highest first."""
        if self.points:
            return sorted((mhz for mhz, _ in self.points), reverse=True)
        n = int((self.max_mhz - self.min_mhz) // self.step_mhz)
        return [self.max_mhz - i * self.step_mhz for i in range(n + 1)]

    def busy_w(self, mhz: float) -> float:
        """Power (W) of a busy GPU at SM clock `mhz`."""
        if not self.points:
            return self.static_w + self.dynamic_w * (mhz / self.max_mhz) ** self.exponent
        pts = sorted(self.points)
        if mhz <= pts[0][0]:
            return pts[0][1]
        for (f0, w0), (f1, w1) in zip(pts, pts[1:]):
            if mhz <= f1:
                return w0 + (w1 - w0) * (mhz - f0) / (f1 - f0)
        return pts[-1][1]


def _clock_power(name: str, max_mhz: float, tdp_w: float, source: str) -> ClockPower:
    """The catalogue's model: busy power at the maximum clock = the datasheet's board power (dense GEMMs run at the
    power limit); 30% of it does not scale with the clock (HBM, leakage, board), the rest as f³ (CMOS dynamic power
    C·V²·f with the voltage following f over the DVFS range); a rank blocked in a bubble, clock held, draws 22% of
    it. The shares and the exponent are modelling assumptions, not measurements of ours: replace them with a
    measured sweep (`ptd-plan energy --profile`, docs/architecture.md, "Energy")."""
    return ClockPower(name, max_mhz, max_mhz / 2, 15.0, 0.3 * tdp_w, 0.7 * tdp_w, 3.0, 0.22 * tdp_w, source)


CLOCK_POWER: dict[str, ClockPower] = {
    "a100-80gb": _clock_power("a100-80gb", 1410, 400, "NVIDIA A100 datasheet: SXM4 400 W, boost clock 1410 MHz"),
    "h100-sxm": _clock_power("h100-sxm", 1980, 700, "NVIDIA H100 datasheet: SXM5 up to 700 W, boost 1980 MHz"),
    "h200": _clock_power("h200", 1980, 700, "NVIDIA H200 datasheet: SXM up to 700 W; the H100's GH100 die"),
}
"""Clock and power models of the catalogue's GPUs that `ptd-plan energy --hardware` takes."""
