"""`ptd-plan search --verify K`: the planner's best layouts compiled by XLA:GPU, the compiled memory per GPU beside
the predicted one, and any layout the planner says fits that the compiled program does not."""

from __future__ import annotations

from ptd_jax.aot.compile import compile_steps
from ptd_jax.aot.targets import target as gpu_target
from ptd_jax.config import ModelConfig, TrainConfig
from ptd_jax.perf.hardware import GIB
from ptd_jax.perf.search import make_parallel


def gpu_model_config(cfg: ModelConfig) -> ModelConfig:
    """The model as ptd-train runs it on a GPU by default: Pallas attention and fused LayerNorm/loss."""
    return cfg.replace(attention_backend="pallas", fused_kernels=True)


def verify(cfg: ModelConfig, layouts: list[dict], hardware: str, num_gpus: int, global_batch_size: int,
           recompute: str, flags: dict) -> list[dict]:
    """Each layout record with `compiled_gb_per_gpu`, `compiled_fits` and `fits_mismatch` (predicted to fit, does
    not once compiled) added; the train step is compiled for `num_gpus` of the target named like the hardware."""
    target = gpu_target(hardware)
    train_cfg = TrainConfig(recompute_granularity=recompute)
    checked = []
    for record in layouts:
        parallel = make_parallel(cfg, num_gpus, record["tensor_model_parallel_size"],
                                 record["pipeline_model_parallel_size"], record["micro_batch_size"],
                                 global_batch_size, record["num_layers_per_virtual_pipeline_stage"], **flags)
        _, (train,) = compile_steps(gpu_model_config(cfg), parallel, train_cfg, target, num_gpus, evaluation=False)
        compiled = train.memory["total"]
        checked.append({**record, "compiled_gb_per_gpu": compiled / GIB,
                        "compiled_fits": compiled <= target.memory_bytes,
                        "compile_time_s": train.compile_time_s,
                        "fits_mismatch": record["fits"] and compiled > target.memory_bytes})
    return checked
