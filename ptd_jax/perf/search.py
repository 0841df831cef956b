"""The layout planner: every PTD-P layout of N GPUs for a model and a global batch, predicted (`timing.predict`),
the ones that fit in memory ranked by iteration time, and why the best one wins — the paper's takeaways made
numeric by comparing the best layout with its neighbours that differ in one knob only:

- Takeaway #1 (§3.2): tensor parallelism up to the GPUs of a node, pipeline parallelism across nodes (t);
- Takeaway #2 (§3.3): a model-parallel size t·p just large enough for the model to fit, data parallelism beyond (p);
- Takeaway #3 (§3.4): the best micro-batch size trades GEMM efficiency against the bubble and memory (b);
- §2.2.2: interleaving (v model chunks per rank) divides the bubble by v at v times the pipeline p2p (v).
"""

from __future__ import annotations

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig
from ptd_jax.perf.hardware import GIB, Hardware
from ptd_jax.perf.timing import Prediction, predict

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
KNOBS = {
    "tensor_model_parallel_size": "Takeaway #1 (§3.2): tensor parallelism within a node",
    "pipeline_model_parallel_size": "Takeaway #2 (§3.3): model-parallel size t·p just large enough to fit",
    "micro_batch_size": "Takeaway #3 (§3.4): micro-batch size",
    "num_layers_per_virtual_pipeline_stage": "§2.2.2: interleaved schedule",
}
SHORT = {"tensor_model_parallel_size": "t", "pipeline_model_parallel_size": "p", "data_parallel_size": "d",
         "micro_batch_size": "b", "num_layers_per_virtual_pipeline_stage": "k"}


def divisors(n: int) -> list[int]:
    small = [i for i in range(1, int(n**0.5) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


def make_parallel(cfg: ModelConfig, num_gpus: int, t: int, p: int, b: int, global_batch_size: int,
                  layers_per_virtual_stage: int | None = None, *, sequence_parallel: bool = False,
                  use_distributed_optimizer: bool = False, scatter_gather: bool = True) -> ParallelConfig:
    """A `ParallelConfig` the way ptd-train builds one from Megatron's flags (raises ConfigError naming values)."""
    v = 1
    if layers_per_virtual_stage is not None:
        if layers_per_virtual_stage < 1 or cfg.num_layers % (layers_per_virtual_stage * p):
            raise ConfigError(f"num_layers={cfg.num_layers} is not divisible by num_layers_per_virtual_pipeline_"
                              f"stage={layers_per_virtual_stage} x pipeline_model_parallel_size={p}")
        v = cfg.num_layers // (layers_per_virtual_stage * p)
    schedule = "interleaved" if layers_per_virtual_stage is not None else "1f1b"
    parallel = ParallelConfig.for_devices(
        num_gpus, tensor_model_parallel_size=t, pipeline_model_parallel_size=p, virtual_pipeline_stages=v,
        pipeline_schedule=schedule, micro_batch_size=b, global_batch_size=global_batch_size,
        sequence_parallel=sequence_parallel and t > 1, use_distributed_optimizer=use_distributed_optimizer,
        scatter_gather=scatter_gather)
    parallel.check_model(cfg)
    return parallel


def layout_record(cfg: ModelConfig, parallel: ParallelConfig, pred: Prediction, hw: Hardware) -> dict:
    """The JSON row of one layout (the keys of docs/architecture.md, "Interfaces", and more)."""
    v = parallel.virtual_pipeline_stages
    return {
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "data_parallel_size": parallel.data_parallel_size,
        "micro_batch_size": parallel.micro_batch_size,
        "num_layers_per_virtual_pipeline_stage": (cfg.num_layers // (parallel.pipeline_model_parallel_size * v)
                                                  if parallel.pipeline_schedule == "interleaved" else None),
        "virtual_pipeline_stages": v,
        "pipeline_schedule": parallel.pipeline_schedule,
        "num_microbatches": parallel.num_microbatches,
        "tflops_per_gpu": pred.tflops_per_gpu("eq3"),
        "model_tflops_per_gpu": pred.tflops_per_gpu("model"),
        "hardware_tflops_per_gpu": pred.tflops_per_gpu("hardware"),
        "mfu": pred.tflops_per_gpu("model") * 1e12 / hw.peak_flops,
        "iteration_time_s": pred.iteration_time_s,
        "bubble_fraction": pred.bubble_fraction,
        "memory_gb_per_gpu": pred.memory["total"] / GIB,
        "memory_breakdown_gb": {k: pred.memory[k] / GIB for k in ("state", "activations")},
        "fits": pred.memory["total"] <= hw.usable_memory_bytes,
        "terms_s": dict(pred.terms),
    }


def candidates(cfg: ModelConfig, num_gpus: int, global_batch_size: int):
    """(t, p, b, k) of every layout the flags allow: t | heads and ffn, p | layers, d = N/(t·p) | B, b | B/d,
    k = layers per virtual stage (None: plain 1F1B) with v = l/(p·k) >= 2."""
    for t in divisors(num_gpus):
        if cfg.num_attention_heads % t or cfg.ffn_size % t:
            continue
        for p in divisors(num_gpus // t):
            if cfg.num_layers % p:
                continue
            d = num_gpus // (t * p)
            if global_batch_size % d:
                continue
            for b in MICRO_BATCH_SIZES:
                if (global_batch_size // d) % b:
                    continue
                yield t, p, b, None
                if p > 1:
                    for k in divisors(cfg.num_layers // p):
                        if cfg.num_layers // (p * k) >= 2:
                            yield t, p, b, k


def search(cfg: ModelConfig, num_gpus: int, global_batch_size: int, hw: Hardware, recompute: str = "full",
           **flags) -> dict:
    """{"layouts": fitting layouts fastest first, "excluded": the ones that do not fit (with why), "why": lines}."""
    fits, excluded = [], []
    for t, p, b, k in candidates(cfg, num_gpus, global_batch_size):
        try:
            parallel = make_parallel(cfg, num_gpus, t, p, b, global_batch_size, k, **flags)
        except ConfigError:
            continue  # e.g. the interleaved schedule's rules on m
        record = layout_record(cfg, parallel, predict(cfg, parallel, hw, recompute), hw)
        if record["fits"]:
            fits.append(record)
        else:
            record["excluded_because"] = (f"needs {record['memory_gb_per_gpu']:.1f} GiB per GPU, "
                                          f"{hw.usable_memory_bytes / GIB:.1f} GiB usable")
            excluded.append(record)
    fits.sort(key=lambda r: r["iteration_time_s"])
    excluded.sort(key=lambda r: r["memory_gb_per_gpu"])
    return {"layouts": fits, "excluded": excluded, "why": explain(fits, excluded) if fits else []}


def describe(r: dict) -> str:
    return " ".join(f"{SHORT[k]}={r[k] if r[k] is not None else '-'}" for k in SHORT)


def explain(fits: list[dict], excluded: list[dict]) -> list[str]:
    """For each knob, the best layout against the fastest one that differs from it in that knob alone (d follows
    from t and p); the terms that changed most say why."""
    best = fits[0]
    lines = []
    for knob, takeaway in KNOBS.items():
        others = [k for k in KNOBS if k != knob]

        def same_elsewhere(r):
            return r[knob] != best[knob] and all(r[o] == best[o] for o in others)

        rivals = [r for r in fits if same_elsewhere(r)]
        unfit = [r for r in excluded if same_elsewhere(r)]
        if rivals:
            rival = rivals[0]
            slower = rival["iteration_time_s"] / best["iteration_time_s"] - 1
            deltas = {name: rival["terms_s"][name] - best["terms_s"][name] for name in best["terms_s"]}
            top = sorted(deltas.items(), key=lambda kv: -abs(kv[1]))[:3]
            because = ", ".join(f"{name} {delta:+.2f} s" for name, delta in top)
            lines.append(f"{takeaway}: {SHORT[knob]}={best[knob] if best[knob] is not None else '-'} beats "
                         f"{describe(rival)} by {slower:.1%} ({because})"
                         + (f"; {len(unfit)} other {SHORT[knob]} do not fit" if unfit else ""))
        elif unfit:
            lines.append(f"{takeaway}: every other {SHORT[knob]} with the rest of the best layout does not fit "
                         f"(e.g. {describe(unfit[0])}: {unfit[0]['excluded_because']})")
    return lines
