"""The layout planner: every PTD-P layout of N GPUs for a model and a global batch, predicted (`timing.predict`),
the ones that fit in memory ranked by iteration time, and why the best one wins — the paper's takeaways made
numeric by comparing the best layout with the fastest layout of each other value of one knob (`explain`):

- Takeaway #1 (§3.2): tensor parallelism up to the GPUs of a node, pipeline parallelism across nodes (t);
- Takeaway #2 (§3.3): a model-parallel size t·p just large enough for the model to fit, data parallelism beyond (p);
- Takeaway #3 (§3.4): the best micro-batch size trades GEMM efficiency against the bubble and memory (b);
- §2.2.2: interleaving (v model chunks per rank) divides the bubble by v at v times the pipeline p2p (v).

What it says for GPT-3 175B on 1,024 A100-80GB, batch 1,536, fp16: t = 4, p = 16, b = 1, k = 1 first (179.1
TFLOP/s per GPU). The best t = 8 at the same t·p = 64 (p = 8, b = 2, k = 2: 171.5) takes 4.4% longer per
iteration; the layout of Megatron-LM's examples/pretrain_gpt3_175B.sh (t = 8, p = 16, b = 1, plain 1F1B: 160.1)
11.9% longer (the paper, §5.1, reports 140 for 175B on 1,024 GPUs at batch 1,536, without naming the layout). Why:
at a fixed t·p (the same d and m), t = 8 holds twice the layers per GPU, so it runs (12 layers × 2·7/8) / (6 ×
2·3/4) = 2.33x the all-reduced bytes of t = 4 (6 all-reduces of b·s·h per layer and microbatch with full
recomputation) and twice the LayerNorms and bias-dropout-adds that every tensor rank repeats (22·s·b·h bytes per
layer, whatever t). At h = 12288 that outweighs what t = 8 saves (bubble, p2p); the compute per all-reduced byte
grows with h, and at Fig. 13's h = 20480 the model puts t = 8 first at both batch sizes, as the paper measured.
"""

from __future__ import annotations

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig
from ptd_jax.perf.hardware import GIB, Hardware
from ptd_jax.perf.timing import Prediction, predict

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
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
        "recompute_split_s": dict(pred.details["recompute_split_s"]),
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
    return {"layouts": fits, "excluded": excluded,
            "why": explain(fits, excluded, hw.gpus_per_node) if fits else []}


def describe(r: dict) -> str:
    return " ".join(f"{SHORT[k]}={r[k] if r[k] is not None else '-'}" for k in SHORT)


def _tp(r: dict) -> int:
    return r["tensor_model_parallel_size"] * r["pipeline_model_parallel_size"]


def _because(best: dict, rival: dict) -> str:
    """The three terms that moved most from `best` to `rival`; recomputation split into its three parts."""
    deltas = {name: rival["terms_s"][name] - best["terms_s"][name] for name in best["terms_s"]}
    parts = []
    for name, delta in sorted(deltas.items(), key=lambda kv: -abs(kv[1]))[:3]:
        text = f"{name} {delta:+.2f} s"
        if name == "recompute" and "recompute_split_s" in best:
            split = {k: rival["recompute_split_s"][k] - best["recompute_split_s"][k] for k in best["recompute_split_s"]}
            text += " [its " + ", ".join(f"{k} {v:+.2f}" for k, v in split.items()) + "]"
        parts.append(text)
    return ", ".join(parts)


def _versus(best: dict, rival: dict) -> str:
    slower = rival["iteration_time_s"] / best["iteration_time_s"] - 1
    return f"{describe(rival)} {rival['tflops_per_gpu']:.1f} TFLOP/s, {slower:+.1%} time ({_because(best, rival)})"


def _fastest(rows: list[dict], key) -> dict:
    """The first (fastest) row of each key value, in the order the values first appear."""
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), r)
    return out


def explain(fits: list[dict], excluded: list[dict], gpus_per_node: int = 8) -> list[str]:
    """The paper's takeaways as numbers: the best layout against the fastest layout of every other value of one
    knob, the others held where the takeaway holds them:
    - Takeaway #1, t: the same model-parallel size t·p (so the same d and m), every other t (t > gpus_per_node:
      across nodes);
    - Takeaway #2, t·p: the fastest layout of every model-parallel size, and the sizes where nothing fits;
    - Takeaway #3, b: the same (t, p), any k;
    - §2.2.2, interleaving: the same (t, p, b), plain 1F1B and every k."""
    best = fits[0]
    t, p, b, k = (best["tensor_model_parallel_size"], best["pipeline_model_parallel_size"], best["micro_batch_size"],
                  best["num_layers_per_virtual_pipeline_stage"])
    lines = [(f"best: {describe(best)} at {best['tflops_per_gpu']:.1f} TFLOP/s per GPU, "
              f"{best['iteration_time_s']:.2f} s per iteration (m={best['num_microbatches']}, "
              f"bubble {best['bubble_fraction']:.3f}, {best['memory_gb_per_gpu']:.1f} GiB)")]
    same_tp = [r for r in fits if _tp(r) == t * p]
    for other_t, r in sorted(_fastest(same_tp, lambda r: r["tensor_model_parallel_size"]).items()):
        if other_t != t:
            where = "across nodes" if other_t > gpus_per_node else "within a node"
            lines.append(f"Takeaway #1 (§3.2) t within a node, same t·p={t * p}: t={other_t} ({where}): "
                         + _versus(best, r))
    unfit_t = sorted({r["tensor_model_parallel_size"] for r in excluded if _tp(r) == t * p}
                     - {r["tensor_model_parallel_size"] for r in same_tp})
    if unfit_t:
        lines.append(f"Takeaway #1 (§3.2): at t·p={t * p}, t in {unfit_t} does not fit")
    by_t = _fastest(fits, lambda r: r["tensor_model_parallel_size"])
    lines.append("Takeaway #1 (§3.2): the fastest layout of each t, any t·p: " + ", ".join(
        f"t={x} {by_t[x]['tflops_per_gpu']:.1f}" for x in sorted(by_t)) + " TFLOP/s")
    head = "Takeaway #2 (§3.3) t·p just large enough to fit"
    by_tp = _fastest(fits, _tp)
    smallest = min(by_tp)
    unfit_sizes = sorted({_tp(r) for r in excluded} - by_tp.keys())
    below = [x for x in unfit_sizes if x < smallest]
    if below:
        tightest = min((r for r in excluded if _tp(r) == below[-1]), key=lambda r: r["memory_gb_per_gpu"])
        lines.append(f"{head}: t·p <= {below[-1]}: nothing fits ({describe(tightest)} "
                     f"{tightest['excluded_because']})")
    lines.append(f"{head}: the smallest t·p that fits is {smallest}; the best layout's is {t * p}")
    larger = [x for x in sorted(by_tp) if x != t * p]
    for size in [x for x in larger if x < t * p] + [x for x in larger if x > t * p][:2]:
        lines.append(f"{head}: t·p={size}: " + _versus(best, by_tp[size]))
    same_t_p = [r for r in fits if r["tensor_model_parallel_size"] == t and r["pipeline_model_parallel_size"] == p]
    for other_b, r in sorted(_fastest(same_t_p, lambda r: r["micro_batch_size"]).items()):
        if other_b != b:
            lines.append(f"Takeaway #3 (§3.4) micro-batch size, same t, p: b={other_b}: " + _versus(best, r))
    same_b = [r for r in same_t_p if r["micro_batch_size"] == b]
    for other_k, r in _fastest(same_b, lambda r: r["num_layers_per_virtual_pipeline_stage"]).items():
        if other_k != k:
            name = "plain 1F1B" if other_k is None else f"k={other_k} (v={r['virtual_pipeline_stages']})"
            lines.append(f"§2.2.2 interleaved schedule, same t, p, b: {name}: " + _versus(best, r))
    return lines
