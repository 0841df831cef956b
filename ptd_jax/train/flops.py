"""The paper's counting formulas (§5.1, Appendix) and device peaks for MFU.

- eq. (2) parameters:  P = 12 l h² (1 + 13/(12h) + (V+s)/(12 l h))
- eq. (3) FLOPs per iteration with full activation recomputation (one extra forward):
      F = 96 B s l h² (1 + s/(6h) + V/(16 l h))
- model FLOPs (no recomputation counted, what MFU divides by peak): 72 B s l h² (1 + s/(6h)) + 6 B s h V
- eq. (4) training time ≈ 8 T P / (n X)

V is the padded vocabulary (the compute actually done); the formulas assume the MLP width is 4h.
"""

from __future__ import annotations

import time

from ptd_jax.config import ModelConfig


def num_params(cfg: ModelConfig, vocab_size: int | None = None) -> float:
    """eq. (2); excludes the final LayerNorm's 2h, as the paper does."""
    l, h, s = cfg.num_layers, cfg.hidden_size, cfg.max_positions
    V = cfg.padded_vocab_size() if vocab_size is None else vocab_size
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def flops_per_iteration(cfg: ModelConfig, global_batch_size: int, vocab_size: int | None = None) -> float:
    """eq. (3): FLOPs of one iteration with full recomputation (the paper's 'achieved teraFLOP/s' numerator)."""
    l, h, s, B = cfg.num_layers, cfg.hidden_size, cfg.seq_length, global_batch_size
    V = cfg.padded_vocab_size() if vocab_size is None else vocab_size
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def model_flops_per_iteration(cfg: ModelConfig, global_batch_size: int, vocab_size: int | None = None) -> float:
    """Model FLOPs without recomputation: 3/4 of eq. (3)'s layer terms plus the logit layer (MFU numerator)."""
    l, h, s, B = cfg.num_layers, cfg.hidden_size, cfg.seq_length, global_batch_size
    V = cfg.padded_vocab_size() if vocab_size is None else vocab_size
    return 72 * B * s * l * h**2 * (1 + s / (6 * h)) + 6 * B * s * h * V


def training_days(tokens: float, params: float, num_devices: int, tflops_per_device: float) -> float:
    """eq. (4): end-to-end training time ≈ 8 T P / (n X), in days."""
    return 8 * tokens * params / (num_devices * tflops_per_device * 1e12) / 86400


# Dense peak TFLOP/s per device: (16-bit, float32 as XLA runs it by default: TF32 on Ampere and later).
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H200": (989.0, 494.0),
    "H100": (989.0, 494.0),
    "A100": (312.0, 156.0),
    "V100": (125.0, 15.7),
    "L4": (121.0, 60.0),
    "A10G": (70.0, 35.0),
    "TPU v4": (275.0, 275.0),
    "TPU v5 lite": (197.0, 197.0),
    "TPU v5p": (459.0, 459.0),
    "TPU v6 lite": (918.0, 918.0),
}


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


def device_peak_tflops(device_kind: str, bf16: bool, override: float | None = None,
                       num_local_devices: int = 1) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it came from). Unknown devices (CPU) get a measured matmul rate, shared
    among the simulated devices of the host."""
    if override is not None:
        return override, "--peak-tflops"
    words = device_kind.lower().replace("-", " ").split()
    for name, (half, single) in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if name.lower() in device_kind.lower() and (" " in name or name.lower() in words):
            return (half if bf16 else single), f"{name} datasheet ({'bf16' if bf16 else 'fp32/tf32'} dense)"
    measured = measure_matmul_tflops() / max(num_local_devices, 1)
    return measured, (f"measured 1024^3 fp32 matmul on {device_kind} / {num_local_devices} device(s) "
                      f"(override with --peak-tflops)")
