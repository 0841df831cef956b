"""`ptd-plan search --verify K`: the planner's best layouts compiled by XLA:GPU, the compiled memory per GPU beside
the predicted one, and any layout the planner says fits that the compiled program does not."""

from __future__ import annotations

from ptd_jax.aot.compile import compile_steps
from ptd_jax.perf.hardware import target as gpu_target
from ptd_jax.config import ModelConfig, TrainConfig
from ptd_jax.perf.hardware import GIB, HARDWARE
from ptd_jax.perf.search import make_parallel


def gpu_model_config(cfg: ModelConfig) -> ModelConfig:
    """The model with the Pallas kernels (flash attention, fused LayerNorm/loss), as the memory benchmarks recorded
    it; ptd-train's default attention on an NVIDIA GPU is cuDNN's where it applies
    (`cli/train/checks.default_attention_backend`)."""
    return cfg.replace(attention_backend="pallas", fused_kernels=True)


def planned_model_config(cfg: ModelConfig) -> ModelConfig:
    """The model the planner predicted for, compiled as a GPU runs it: its attention backend as planned (XLA's
    materialises the scores, which the prediction counts), the fused LayerNorm/loss kernels as a GPU defaults."""
    return cfg.replace(fused_kernels=True)


def verify(
    cfg: ModelConfig,
    layouts: list[dict],
    hardware: str,
    num_gpus: int,
    global_batch_size: int,
    flags: dict,
) -> list[dict]:
    """Each layout record with `compiled_gb_per_gpu`, `compiled_fits` and `fits_mismatch` (predicted to fit, does
    not once compiled) added; the train step is compiled for `num_gpus` of the target named like the hardware, and
    both figures are held against the planner's usable memory (`Hardware.usable_memory_bytes`)."""
    target = gpu_target(hardware)
    usable = HARDWARE[hardware].usable_memory_bytes
    checked = []
    for record in layouts:
        train_cfg = TrainConfig(recompute_granularity=record["recompute_granularity"])
        c = record.get("context_parallel_size", 1)
        model = cfg if c == 1 else cfg.replace(attention_backend=record["attention_backend"])
        parallel = make_parallel(
            model,
            num_gpus,
            record["tensor_model_parallel_size"],
            record["pipeline_model_parallel_size"],
            record["micro_batch_size"],
            global_batch_size,
            record["num_layers_per_virtual_pipeline_stage"],
            schedule=record["pipeline_schedule"],
            context_parallel_size=c,
            **flags,
        )
        _, programs = compile_steps(planned_model_config(model), parallel, train_cfg, target, num_gpus)
        compiled = max(p.memory["total"] for p in programs)  # as --compile-only: the train or the eval step
        train = programs[0]
        checked.append(
            {
                **record,
                "compiled_gb_per_gpu": compiled / GIB,
                "compiled_fits": compiled <= usable,
                "compile_time_s": train.compile_time_s,
                "fits_mismatch": record["fits"] and compiled > usable,
            }
        )
    return checked
