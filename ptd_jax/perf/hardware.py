"""Hardware presets for the performance model: datasheet peaks and bandwidths, with efficiencies taken from
microbenchmarks — never fitted to the paper's results.

- `a100-80gb`: the paper's Selene DGX A100 node (§5): 8 A100-80GB, 312 TFLOP/s dense bf16, 2.039 TB/s HBM2e,
  NVLink3/NVSwitch 600 GB/s per GPU (300 each way), 8 × 200 Gb/s HDR InfiniBand per node (25 GB/s per GPU each way).
- `h100-sxm`: DGX H100: 989 TFLOP/s, 3.35 TB/s HBM3, NVLink4 900 GB/s (450 each way), 8 × 400 Gb/s NDR per node.
- `h200`: DGX H200: the H100's compute and links, 141 GB of HBM3e at 4.8 TB/s.

Efficiencies (the same for every preset, from measurements, not from the paper):
- GEMM 0.80 of peak when compute-bound: a random 8192³ bf16 matmul ran at 790 of 989 TFLOP/s on an H200
  (a measurement the team made before this project; not in this repository); memory-bound GEMMs run at the
  HBM rate.
- HBM 0.90 of the datasheet: a device copy measured 4.3 of 4.8 TB/s on the same H200.
- NVLink all-reduce bus bandwidth 0.77 of the one-way link rate: nccl-tests' all_reduce_perf reports about
  230 GB/s bus bandwidth on a DGX A100 (300 GB/s each way).
- InfiniBand 0.90 of line rate (large messages, GPUDirect RDMA, one NIC per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One GPU and its node. Bandwidths are per GPU, one direction, in bytes/s."""

    name: str
    peak_flops: float
    """Dense 16-bit peak, FLOP/s."""
    memory_bytes: float
    """HBM capacity."""
    hbm_bandwidth: float
    gpus_per_node: int
    nvlink_bandwidth: float
    """Per GPU, one direction (NVSwitch: any pair of GPUs in the node at this rate)."""
    ib_bandwidth: float
    """Per GPU, one direction (one NIC per GPU)."""
    gemm_efficiency: float = 0.80
    hbm_efficiency: float = 0.90
    nvlink_efficiency: float = 0.77
    ib_efficiency: float = 0.90
    nvlink_latency_s: float = 10e-6
    """Per collective step (NCCL's small-message latency within a node)."""
    ib_latency_s: float = 25e-6
    usable_memory_fraction: float = 0.90
    """What a run may count on: the rest goes to the CUDA context, NCCL buffers, cuBLAS workspaces and the
    allocator's fragmentation."""

    def gemm_seconds(self, m: float, n: float, k: float, count: float = 1.0, bytes_per_element: int = 2) -> float:
        """Roofline time of `count` (M×K)·(K×N) GEMMs: the larger of compute at the efficient rate and the operands'
        traffic (read A and B, write C once) at the achievable HBM rate."""
        flops = 2.0 * m * n * k
        traffic = bytes_per_element * (m * k + k * n + m * n)
        return count * max(flops / (self.peak_flops * self.gemm_efficiency),
                           traffic / (self.hbm_bandwidth * self.hbm_efficiency))

    def memory_seconds(self, nbytes: float) -> float:
        """Time of a memory-bound kernel that moves `nbytes` through HBM."""
        return nbytes / (self.hbm_bandwidth * self.hbm_efficiency)

    def link(self, within_node: bool) -> tuple[float, float]:
        """(achievable bandwidth in bytes/s, latency per step in s) of the link a collective runs on."""
        if within_node:
            return self.nvlink_bandwidth * self.nvlink_efficiency, self.nvlink_latency_s
        return self.ib_bandwidth * self.ib_efficiency, self.ib_latency_s

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction


HARDWARE: dict[str, Hardware] = {
    "a100-80gb": Hardware("a100-80gb", peak_flops=312e12, memory_bytes=80 * GIB, hbm_bandwidth=2.039e12,
                          gpus_per_node=8, nvlink_bandwidth=300e9, ib_bandwidth=25e9),
    "h100-sxm": Hardware("h100-sxm", peak_flops=989e12, memory_bytes=80 * GIB, hbm_bandwidth=3.35e12,
                         gpus_per_node=8, nvlink_bandwidth=450e9, ib_bandwidth=50e9),
    "h200": Hardware("h200", peak_flops=989e12, memory_bytes=141e9, hbm_bandwidth=4.8e12,
                     gpus_per_node=8, nvlink_bandwidth=450e9, ib_bandwidth=50e9),
}


def ring_allreduce_seconds(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of `nbytes` over n ranks: 2(n−1)/n of the bytes over each link, 2(n−1) steps. A
    reduce-scatter followed by an all-gather (the distributed optimizer) moves the same bytes."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def allgather_seconds(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """All-gather of a tensor of `nbytes` in total from n equal slices (also a reduce-scatter's time)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency
