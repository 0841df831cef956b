"""An estimate of the memory one device needs for a training run, checked before anything is allocated.

It counts what stays resident through a step:
- the state: float32 (or float64) master parameters, their gradient and Adam's two moments, i.e. 16 bytes per
  local parameter in float32; a device holds 1/(t·p) of the layers, 1/t of the word embedding and the positions;
- the activations stashed for the backward: per layer and microbatch, s·b·h·(10 + 24/t) bytes at 16 bits
  (34/t with sequence parallelism; Korthikanti et al., 2022), doubled for float32, plus the attention scores
  2·a·s²·b/t (5·a·s²·b/t with attention dropout) when the XLA backend materialises them and selective
  recomputation does not drop them; 1F1B keeps at most p microbatches in flight, GPipe m; full recomputation
  keeps only each layer's input, plus one layer's worth.

It leaves out XLA's temporaries and fragmentation, so a run it admits may still not fit; the training loop refuses
only a run whose estimate exceeds the device's memory (`--seq-length 1000000` on the tiny model, b = 4: ~239k GiB).
"""

from __future__ import annotations

import os

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig


def estimate_bytes(model_cfg: ModelConfig, parallel: ParallelConfig, train_cfg: TrainConfig) -> dict[str, float]:
    """{"state": bytes, "activations": bytes} per device."""
    L, h, a, s = model_cfg.num_layers, model_cfg.hidden_size, model_cfg.num_attention_heads, model_cfg.seq_length
    t, p, b = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size, parallel.micro_batch_size
    F = model_cfg.ffn_size
    layer_params = 4 * h * h + 2 * h * F + 9 * h + F  # qkv, out, fc1, fc2 (+ biases and two LayerNorms)
    local = L * layer_params / (t * p) + model_cfg.padded_vocab_size(t) * h / t + model_cfg.max_positions * h
    master = 8 if model_cfg.param_dtype == "float64" else 4
    d = parallel.data_parallel_size if parallel.use_distributed_optimizer else 1
    state = local * master * (1 + 3 / d)  # gradients; parameters and Adam's two moments (sharded over data: ZeRO-1)

    width = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}[model_cfg.dtype]
    per_layer = s * b * h * (34 / t if parallel.sequence_parallel else 10 + 24 / t) * width / 2
    if model_cfg.attention_backend == "xla" and train_cfg.recompute_granularity != "selective":
        scores = 5 if model_cfg.attention_dropout > 0 else 2  # softmax output (+ dropout mask and output)
        per_layer += scores * a * s * s * b / t * width / 2
    if p == 1:
        in_flight = 1  # microbatches run one after another (the 1F1B table at p = 1)
    elif parallel.pipeline_schedule == "gpipe":
        in_flight = parallel.num_microbatches
    else:
        in_flight = min(p, parallel.num_microbatches)
    layers = L / p
    if train_cfg.recompute_granularity == "full":
        activations = in_flight * layers * s * b * h * width + per_layer
    else:
        activations = in_flight * layers * per_layer
    return {"state": state, "activations": activations}


def device_memory_bytes(device, num_local_devices: int) -> tuple[float | None, str]:
    """(bytes one device may use, where the figure comes from); None when unknown."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"{device.device_kind} memory"
    if device.platform == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None, "unknown"
        return total / num_local_devices, f"host RAM / {num_local_devices} simulated device(s)"
    return None, "unknown"


def check_fits(model_cfg: ModelConfig, parallel: ParallelConfig, train_cfg: TrainConfig) -> None:
    """Refuse, with the numbers, a run whose estimate exceeds the memory of a device."""
    import jax

    need = estimate_bytes(model_cfg, parallel, train_cfg)
    have, source = device_memory_bytes(jax.local_devices()[0], jax.local_device_count())
    total = need["state"] + need["activations"]
    if have is not None and total > have:
        raise ConfigError(f"the run needs about {total / 2**30:,.1f} GiB per device (state {need['state'] / 2**30:,.1f}"
                          f" GiB, activations {need['activations'] / 2**30:,.1f} GiB) but a device has "
                          f"{have / 2**30:,.1f} GiB ({source}); use more devices, a larger t or p, a smaller micro "
                          f"batch or sequence, or --recompute-granularity full")
