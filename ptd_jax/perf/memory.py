"""Memory per GPU of a PTD-P run: weights, gradients and optimizer state, and the activations the pipeline
executor stashes under a recompute policy (paper §3.5; Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", §4). The one memory model of the project: `ptd-plan` ranks layouts by it and
`ptd-train` refuses, before allocating anything, a run it puts over a device's memory (`check_fits`).

State (mixed-precision Adam), Megatron-LM's documented bytes per parameter (README, "Distributed Optimizer"; d the
data-parallel size):
    fp16 params, fp16 grads (`--fp16`, the paper's runs)   20    distributed optimizer  4 + 16/d
    bf16 params, fp32 grads (`--bf16`)                     18                           6 + 12/d
fp16: weights 2 + gradients 2 + the optimizer's fp32 master weights 4, fp32 gradient copy 4, Adam's moments 4 + 4.
bf16: weights 2 + fp32 gradients 4 (Megatron's arguments.py forces `accumulate_allreduce_grads_in_fp32` for bf16)
+ master weights 4 + moments 8. `ModelConfig.dtype` "float16" selects fp16; any other dtype is planned as bf16
mixed precision (the presets' peaks are 16-bit).

Activations per layer and microbatch, per GPU, as the program stores them (s sequence, b micro batch, h hidden,
a heads, t tensor-parallel size; 2-byte compute dtype), measured on XLA:GPU's compiled steps
(`experiments/bench/memory/aot_memory.py`) and compared with Korthikanti et al.'s Table 2 for Megatron:
    policy      this program, flash attention     with sequence parallelism     Megatron (no SP)
    none        s b h (8 + 16/t) + 4 a s b/t      s b h 24/t + 4 a s b/t        s b h (10 + 24/t + 5as/(ht))
    selective   as none (no scores to drop)       as none                       s b h (10 + 24/t)
    full        2 s b h (each layer's input)      2 s b h / t                   2 s b h
  `none` keeps the outputs of matmuls and collectives only (the GeLU, LayerNorms and dropouts are recomputed), so
  it stores less than Megatron at t = 1 but keeps the whole residual stream and LayerNorm outputs (8 s b h) on every
  tensor rank; with sequence parallelism all of them are 1/t: the LayerNorm outputs are kept as the rank's
  sequence shard and all-gathered again in the backward (`model.REGATHERED_PRIMITIVES`, as Megatron does), so
  everything a layer stashes is split over t (`experiments/bench/memory/sp_stash.py`: exactly 1/t of t = 1's stash at
  t = 2, 4, 8). With the XLA attention backend the float32 scores 4 a s²b/t replace the attention output. Under
  "full", one layer's activations without recomputation are added (rebuilt during its backward).
Stashed activations: the executor keeps each layer's record (`parallel.pipeline.stash.Record`) in slot buffers on
every pipeline rank (one SPMD program, one shape), each slot one microbatch through one model chunk of l/(p v)
layers; the slot counts are the table's (`stash_slots`). A fused backward frees its slot at the B. A split one keeps
what W needs from F to W: its taps take the place of the residuals they match, so a microbatch waiting for its W
costs about what it cost before its I (`record_bytes`). The last stage adds the logits of the loss and their
gradient, 4 s b V/(t c) bytes at 16 bits, and the output layer's 16-bit weight gradient, 2 h V/t (measured: 4 + 2h/s
bytes per logit).
The model leaves out the CUDA context, NCCL buffers and fragmentation; it is held against the budget of JAX's
allocator (`hardware.allocator_fraction`, 0.75 of the GPU by default), the figure ptd-train and --compile-only use.
Checked against XLA:GPU's compiled programs on a grid of 26 layouts (`experiments/bench/memory/plan_vs_compiled.py`).
"""

from __future__ import annotations

from functools import lru_cache

from ptd_jax.config import SCHEDULE_SPECS, ConfigError, ModelConfig, ParallelConfig
from ptd_jax.perf.context import ring_kept_scores_bytes, ring_stash_bytes_per_layer, ring_workspace_bytes
from ptd_jax.perf.hardware import GIB


def layer_params(cfg: ModelConfig) -> float:
    """Weights of one layer: for GPT-2 QKV and output 4h², MLP 2hF, biases and the two LayerNorms 9h + F (12h² + 13h
    at F=4h); in general what `ModelConfig.num_parameters` counts per layer (grouped QKV, SwiGLU, the switches'
    biases and norms)."""
    return float(cfg.layer_parameters)


def _widths(cfg: ModelConfig) -> dict[str, float]:
    """Per token, in units of h: the QKV projection's output ((H + 2G) K), the attention core's output (H K), fc1's
    output (F, SwiGLU's gate and up 2F)."""
    h = cfg.hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_groups) * cfg.head_dim / h
    core = cfg.num_attention_heads * cfg.head_dim / h
    fc1 = (2 if cfg.swiglu else 1) * cfg.ffn_size / h
    return {"qkv": qkv, "core": core, "fc1": fc1}


def params_per_gpu(cfg: ModelConfig, parallel: ParallelConfig) -> dict[str, float]:
    """Parameters held by a GPU of the first and of the last pipeline stage (the same GPU when p = 1): l/(p t)
    layers; the word embedding's V/t rows on the first stage and (tied output layer) on the last; positions and
    the final LayerNorm where they are used."""
    t, p = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    h = cfg.hidden_size
    layers = cfg.num_layers / p * layer_params(cfg) / t
    embedding = cfg.padded_vocab_size(t) * h / t
    positions = cfg.max_positions * h if cfg.position_embedding_type == "learned_absolute" else 0
    final_norm = h if cfg.normalization == "RMSNorm" else 2 * h
    # everything but the layers is replicated over "pipe" (`sharding.param_spec`): every stage holds the embedding,
    # an untied output layer, the positions and the final norm, and the stages that use them get their gradients
    output = embedding if cfg.untie_embeddings_and_output_weights else 0
    first = last = layers + embedding + output + positions + final_norm
    return {"first": first, "last": last}


def is_fp16(cfg: ModelConfig) -> bool:
    return cfg.dtype == "float16"


def grad_bytes_per_param(cfg: ModelConfig) -> int:
    """The gradient buffer Megatron accumulates and all-reduces: fp16 under --fp16, fp32 under --bf16."""
    return 2 if is_fp16(cfg) else 4


def state_bytes_per_param(parallel: ParallelConfig, cfg: ModelConfig | None = None) -> float:
    """fp16: 20 bytes, 4 + 16/d with the distributed optimizer; bf16 (the default without `cfg`): 18, 6 + 12/d."""
    d = parallel.data_parallel_size
    if cfg is not None and is_fp16(cfg):
        return 4 + 16 / d if parallel.use_distributed_optimizer else 20.0
    return 6 + 12 / d if parallel.use_distributed_optimizer else 18.0


def activation_bytes_per_layer(cfg: ModelConfig, parallel: ParallelConfig, recompute: str) -> float:
    """Bytes one layer stashes for its backward, per microbatch and GPU: what `model.remat_layer`'s policies keep
    in the executor's stash (the module docstring's table), at the compute dtype's 2 bytes. Under context
    parallelism (c > 1) each rank holds s/c tokens and attends by blocks (`parallel/context.py`): no s x s scores,
    and what the ring or the gather adds (`perf.context.ring_stash_bytes_per_layer`)."""
    c = parallel.context_parallel_size
    s, b, h, a = cfg.seq_length / c, parallel.micro_batch_size, cfg.hidden_size, cfg.num_attention_heads
    t, sp = parallel.tensor_model_parallel_size, parallel.sequence_parallel
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    w = _widths(cfg)
    if c > 1:
        stream = 8 / t if sp else 8
        return sbh * (stream + 2 * (w["qkv"] + w["core"] + w["fc1"]) / t) + ring_stash_bytes_per_layer(
            cfg, parallel, recompute
        )
    # q, k, v, the attention output and fc1's output, split over the heads / the ffn dim (16/t for GPT-2)
    split = 2 * (w["qkv"] + w["core"] + w["fc1"]) / t
    # the layer's input, the residual after attention and the two LayerNorm outputs: whole without sequence
    # parallelism; with it all four are the rank's 1/t of the sequence (the all-gathers are issued again in the
    # backward, not kept)
    stream = 8 / t if sp else 8
    if cfg.attention_backend == "xla":
        if recompute == "selective":  # the attention core's output is kept by name, beside the projection's input
            return sbh * (stream + split + 2 * w["core"] / t)
        # the float32 scores are kept, the attention output is recomputed
        return sbh * (stream + split - 2 * w["core"] / t) + 4 * a * s * s * b / t
    # the flash kernels keep their output and float32 log-sum-exp (4 a s b / t), and nothing of the s x s square:
    # "selective" keeps what "none" keeps (measured, `experiments/bench/memory/sp_stash.py`)
    return sbh * (stream + split) + 4 * a * s * b / t


def stash_slots(parallel: ParallelConfig) -> dict[str, int]:
    """Slots of the executor's record buffers on each pipeline rank (`parallel.pipeline.table.record_slots`): "rec"
    (F to B or I), "hold" (F to W) and "w" (I to W); p = 1: one (microbatches one after another)."""
    p, v, m = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_stages, parallel.num_microbatches
    if p == 1:
        return {"rec": 1, "hold": 0, "w": 0}
    return _record_slots(parallel.pipeline_schedule, p, v, m, parallel.microbatch_group_size or p)


@lru_cache(maxsize=4096)
def _record_slots(schedule: str, p: int, v: int, m: int, group: int) -> dict[str, int]:
    from ptd_jax.parallel.pipeline.table import record_slots  # pure Python, no JAX

    return record_slots(SCHEDULE_SPECS[schedule], p, v, m, group)


def tap_bytes_per_layer(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """Bytes one layer's taps hold per microbatch (split backwards): each matmul's input and output gradient
    (`parallel.tensor.dot`'s tap), at 2 bytes: QKV h + 3h/t, the projection h/t + h (its output before the
    all-reduce or reduce-scatter), fc1 h + F/t, fc2 F/t + h, per token of the whole sequence (the inputs of QKV
    and fc1 are the gathered LayerNorm outputs under sequence parallelism): 2 s b (4h + 4h/t + 2F/t), with the
    MLP width F = 4h: 2 s b h (4 + 12/t)."""
    t, h = parallel.tensor_model_parallel_size, cfg.hidden_size
    w = _widths(cfg)
    # QKV's and fc1's outputs, the projection's input, fc2's input (F: after SwiGLU's product) split over t
    split = h * (w["qkv"] + w["core"] + w["fc1"]) + cfg.ffn_size
    tokens = cfg.seq_length / parallel.context_parallel_size * parallel.micro_batch_size
    return 2 * tokens * (4 * h + split / t)


def record_bytes(cfg: ModelConfig, parallel: ParallelConfig, recompute: str) -> float:
    """The record buffers of a pipeline rank, per layer of a chunk (`stash.Record`, `table.record_slots`): the "rec"
    slots hold what only the backward reads, the "hold" slots what the taps share with the residuals, the "w" slots
    the taps without a partner. Under none and selective every tap takes a residual's buffer (the four replicated
    taps are typed like the residual stream), so a microbatch waiting for its I or its W holds its F's residuals; the
    "w" slots hold what W needs beyond them: fc2's input (F/t per token) where W follows I at once (1F1B: one "w"
    slot; where microbatches wait for W, W recomputes it from fc1's), and with sequence parallelism the four
    replicated taps whole beside their 1/t residuals. Under full recomputation the taps find no residual to share
    (the layer's input is all it keeps) and are modelled as before: they share all residuals but the four
    tensor-invariant ones. Checked on XLA:GPU's compiled record buffers (`experiments/bench/memory/
    one_pipeline_memory.py`, `plan_vs_compiled.py`)."""
    slots = stash_slots(parallel)
    layers = cfg.num_layers / (parallel.pipeline_model_parallel_size * parallel.virtual_pipeline_stages)
    a = activation_bytes_per_layer(cfg, parallel, recompute)
    if not slots["hold"]:
        return slots["rec"] * layers * a
    t, h = parallel.tensor_model_parallel_size, cfg.hidden_size
    sb2 = 2 * cfg.seq_length / parallel.context_parallel_size * parallel.micro_batch_size
    if recompute != "full":
        w_only = sb2 * cfg.ffn_size / t if slots["w"] <= 1 else 0.0
        if parallel.sequence_parallel:
            w_only += sb2 * 4 * h * (1 - 1 / t)
        if not cfg.fused_kernels:  # XLA's LayerNorm outputs are no residuals: two h-sized taps of their own
            w_only += sb2 * 2 * h
        return layers * (slots["hold"] * a + slots["w"] * w_only)
    tap = tap_bytes_per_layer(cfg, parallel)
    invariant = 4 * sb2 * h / (t if parallel.sequence_parallel else 1)
    shared = max(min(a - invariant, tap), 0.0)
    return layers * (slots["hold"] * shared + slots["rec"] * (a - shared) + slots["w"] * (tap - shared))


def stashed_layers(cfg: ModelConfig, parallel: ParallelConfig, recompute: str = "none") -> float:
    """Layers' worth of one microbatch's activations a pipeline rank stashes (`record_bytes` in units of one layer's
    activations)."""
    return record_bytes(cfg, parallel, recompute) / activation_bytes_per_layer(cfg, parallel, recompute)


def memory_per_gpu(cfg: ModelConfig, parallel: ParallelConfig, recompute: str = "full") -> dict[str, float]:
    """Bytes per GPU on the fuller of the first and the last stage, in Megatron's 16-bit terms: {"stage",
    "params", "state" (weights + gradients + optimizer state of the stage's parameters), "stash" (the pipeline's
    record buffers), "recompute" (the layer rebuilt under full recomputation), "logits" (the last stage's
    logits, their gradient and the output layer's weight gradient), "workspace" (the context ring's float32 score
    blocks at the peak, `perf.context.ring_workspace_bytes`), "activations" (their sum), "total"}."""
    t, b, s = parallel.tensor_model_parallel_size, parallel.micro_batch_size, cfg.seq_length
    params = params_per_gpu(cfg, parallel)
    per_param = state_bytes_per_param(parallel, cfg)
    stash = record_bytes(cfg, parallel, recompute)
    # the layer being recomputed under "full" holds its full activations meanwhile
    # (no policy inside: the ring's custom VJP keeps its own residuals, not none's scores; not measured)
    rebuilt = 0.0
    if recompute == "full":
        rebuilt = activation_bytes_per_layer(cfg, parallel, "none") - ring_kept_scores_bytes(cfg, parallel)
    # the logits: 4 bytes per element (the 16-bit logits and their gradient), and the output layer's weight gradient
    # in the compute dtype before it joins the float32 buffer, h x V/t. Changing V alone on XLA:GPU (Llama 3.2 1B,
    # h = 2048, 2 layers, bf16) moved the temporaries by 6.0, 4.5 and 4.1 bytes per logit at s = 2048, 8192 and
    # 32768: 4 + 2h/s (`experiments/README.md`, "The planner against the compiler")
    vocab = cfg.padded_vocab_size(t) / t
    logits = 4 * s * b * vocab / parallel.context_parallel_size + 2 * cfg.hidden_size * vocab
    stages = {"first": (params["first"], 0.0), "last": (params["last"], logits)}
    if parallel.pipeline_model_parallel_size == 1:
        stages = {"first": (params["first"], logits)}
    elif SCHEDULE_SPECS[parallel.pipeline_schedule].stage_map == "v":  # rank 0 holds the first and the last stage
        stages = {"first": (params["first"] + 2 * cfg.hidden_size, logits)}
    name, (n, head) = max(stages.items(), key=lambda kv: kv[1][0] * per_param + kv[1][1])
    workspace = ring_workspace_bytes(cfg, parallel, recompute)  # float32 whatever the compute dtype
    activations = stash + rebuilt + head + workspace
    return {
        "stage": name,
        "params": n,
        "state": n * per_param,
        "stash": stash,
        "recompute": rebuilt,
        "logits": head,
        "workspace": workspace,
        "activations": activations,
        "total": n * per_param + activations,
    }


def device_memory_bytes(device, num_local_devices: int) -> tuple[float | None, str]:
    """(bytes one device may use, where the figure comes from) for a JAX device; None when unknown. On CPU the
    simulated devices share the host's RAM."""
    import os

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


def run_memory_bytes(cfg: ModelConfig, parallel: ParallelConfig, recompute: str) -> dict[str, float]:
    """`memory_per_gpu` for the widths a run actually has (c compute, w master weights, g = max(4, w) the gradient
    accumulators), term by term: "weights" w per parameter (+ "compute_copy" c where c ≠ w), "gradients" g,
    "optimizer" 2w (Adam's moments); with the distributed optimizer the weights, moments and master copy are 1/d
    ("weights" c, the gathered copy, "optimizer" 3w/d); activations scaled from 16 bits to c. bf16 or fp16 compute
    on float32 weights gives Megatron's 18 and 6 + 12/d (ptd-train keeps float32 gradients under --fp16 too)."""
    need = dict(memory_per_gpu(cfg, parallel, recompute))
    c, w = _BYTES.get(cfg.dtype, 4), _BYTES.get(cfg.param_dtype, 4)
    g = max(4, w)
    n = need["params"]
    if parallel.use_distributed_optimizer:
        terms = {"weights": c, "compute_copy": 0, "gradients": g, "optimizer": 3 * w / parallel.data_parallel_size}
    else:
        terms = {"weights": w, "compute_copy": c if c != w else 0, "gradients": g, "optimizer": 2 * w}
    need.update({k: n * v for k, v in terms.items()})
    for name in ("stash", "recompute"):
        need[name] *= c / 2
    need["logits"] *= c / 2  # the logits, their gradient and the output layer's weight gradient: the compute dtype
    need["activations"] = need["stash"] + need["recompute"] + need["logits"] + need["workspace"]
    need["state"] = n * sum(terms.values())
    need["total"] = need["state"] + need["activations"]
    return need


_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def check_fits(cfg: ModelConfig, parallel: ParallelConfig, recompute: str, device, num_local_devices: int) -> None:
    """Refuse, with the numbers, a run whose estimate (`run_memory_bytes`) exceeds the memory of `device` (a JAX
    device)."""
    need = run_memory_bytes(cfg, parallel, recompute)
    have, source = device_memory_bytes(device, num_local_devices)
    if have is not None and need["total"] > have:
        raise ConfigError(
            f"the run needs about {need['total'] / GIB:,.1f} GiB per device (state "
            f"{need['state'] / GIB:,.1f} GiB, activations {need['activations'] / GIB:,.1f} GiB) but a "
            f"device has {have / GIB:,.1f} GiB ({source}); use more devices, a larger t or p, a smaller "
            f"micro batch or sequence, or --recompute-granularity full"
        )
