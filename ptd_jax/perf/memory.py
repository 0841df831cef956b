"""Memory per GPU of a Megatron PTD-P run: weights, gradients and optimizer state, and the activations the
pipeline schedule stashes under a recompute policy (paper §3.5; Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4).

State (mixed-precision Adam), Megatron-LM's documented bytes per parameter (README, "Distributed Optimizer"; d the
data-parallel size):
    fp16 params, fp16 grads (`--fp16`, the paper's runs)   20    distributed optimizer  4 + 16/d
    bf16 params, fp32 grads (`--bf16`)                     18                           6 + 12/d
fp16: weights 2 + gradients 2 + the optimizer's fp32 master weights 4, fp32 gradient copy 4, Adam's moments 4 + 4.
bf16: weights 2 + fp32 gradients 4 (Megatron's arguments.py forces `accumulate_allreduce_grads_in_fp32` for bf16)
+ master weights 4 + moments 8. `ModelConfig.dtype` "float16" selects fp16; any other dtype is planned as bf16
mixed precision (the presets' peaks are 16-bit).

Activations at 16 bits, per layer and microbatch, per GPU (Korthikanti et al., Table 2; s sequence, b micro batch,
h hidden, a heads, t tensor-parallel size):
    no recomputation       s b h (10 + 24/t + 5 a s/(h t))        with sequence parallelism  s b h (34 + 5 a s/h)/t
    selective              s b h (10 + 24/t)                                                 34 s b h / t
    full                   2 s b h (each layer's input only)                                 2 s b h / t
  plus, under "full", one layer's activations without recomputation (rebuilt during its backward).
Stashed layers on the first stage (Megatron's asynchronous schedules): one microbatch of all l layers at p = 1;
1F1B: min(p, m) microbatches of l/p layers (l layers' worth whatever p); GPipe: m of l/p; interleaved:
min(p·v + p − 1, m·v) chunks of l/(p·v) layers = l (1 + (p−1)/(p v)). The last stage adds the fp32 logits of the
loss, 4 s b V/t. The model leaves out the CUDA context, NCCL buffers and fragmentation (`Hardware.usable_memory`).
"""

from __future__ import annotations

from ptd_jax.config import ModelConfig, ParallelConfig


def layer_params(cfg: ModelConfig) -> float:
    """Weights of one layer: QKV and output 4h², MLP 2hF, biases and the two LayerNorms 9h + F (12h² + 13h at F=4h)."""
    h, f = cfg.hidden_size, cfg.ffn_size
    return 4 * h * h + 2 * h * f + 9 * h + f


def params_per_gpu(cfg: ModelConfig, parallel: ParallelConfig) -> dict[str, float]:
    """Parameters held by a GPU of the first and of the last pipeline stage (the same GPU when p = 1): l/(p t)
    layers; the word embedding's V/t rows on the first stage and (tied output layer) on the last; positions and
    the final LayerNorm where they are used."""
    t, p = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    h = cfg.hidden_size
    layers = cfg.num_layers / p * layer_params(cfg) / t
    embedding = cfg.padded_vocab_size(t) * h / t
    first = layers + embedding + cfg.max_positions * h
    last = layers + embedding + 2 * h
    if p == 1:
        first = last = layers + embedding + cfg.max_positions * h + 2 * h
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
    """Bytes one layer keeps for its backward, per microbatch and GPU (the table in the module docstring)."""
    s, b, h, a = cfg.seq_length, parallel.micro_batch_size, cfg.hidden_size, cfg.num_attention_heads
    t, sp = parallel.tensor_model_parallel_size, parallel.sequence_parallel
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    linear = 34 / t if sp else 10 + 24 / t
    scores = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
    return s * b * h * (linear + scores)


def stashed_layers(cfg: ModelConfig, parallel: ParallelConfig, rank: int = 0) -> float:
    """Layers' worth of one microbatch's activations pipeline rank `rank` holds at its peak: Megatron's warm-up
    forwards plus the one in flight (1F1B: p−1−r; interleaved: 2(p−1−r) + (v−1)·G, G = p by default)."""
    p, v, m = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_stages, parallel.num_microbatches
    L = cfg.num_layers
    if p == 1:
        return L
    if parallel.pipeline_schedule == "gpipe":
        return m * L / p
    if parallel.pipeline_schedule == "1f1b":
        return min(p - rank, m) * L / p
    group = parallel.microbatch_group_size or p
    return min(2 * (p - 1 - rank) + (v - 1) * group + 1, m * v) * L / (p * v)


def memory_per_gpu(cfg: ModelConfig, parallel: ParallelConfig, recompute: str = "full") -> dict[str, float]:
    """Bytes per GPU on the fuller of the first and the last stage: {"params", "state", "activations", "total"}
    ("state" = weights + gradients + optimizer state of the stage's parameters)."""
    t, b, s = parallel.tensor_model_parallel_size, parallel.micro_batch_size, cfg.seq_length
    params = params_per_gpu(cfg, parallel)
    per_param = state_bytes_per_param(parallel, cfg)
    layer = activation_bytes_per_layer(cfg, parallel, recompute)
    # the layer being recomputed under "full" holds its full activations meanwhile
    extra = activation_bytes_per_layer(cfg, parallel, "none") if recompute == "full" else 0.0
    logits = 4 * s * b * cfg.padded_vocab_size(t) / t
    last_rank = parallel.pipeline_model_parallel_size - 1
    stages = {"first": (params["first"], stashed_layers(cfg, parallel, 0) * layer + extra),
              "last": (params["last"], stashed_layers(cfg, parallel, last_rank) * layer + extra + logits)}
    if last_rank == 0:
        stages = {"first": (params["first"], stages["first"][1] + logits)}
    name, (n, a) = max(stages.items(), key=lambda kv: kv[1][0] * per_param + kv[1][1])
    return {"stage": name, "params": n, "state": n * per_param, "activations": a, "total": n * per_param + a}
