"""The time of one training iteration of Megatron's PTD-P, term by term (paper §3, "Performance Analysis of
Parallelization Configurations"), for a layout on a `Hardware` preset. Nothing here is fitted to the paper.

Per microbatch, on the bottleneck pipeline rank (the last: its l/p layers plus the output layer):
- GEMMs: the roofline time of each matmul of a layer (QKV, scores, context, output, fc1, fc2 at their per-GPU
  shapes), backward twice the forward, the output layer 2·b·s·h·V/t forward;
- elementwise kernels, memory-bound: Megatron's fused LayerNorms, bias+dropout+residual, bias+GeLU and
  scaled-masked softmax + dropout move s b h (22 + 16/t) + 9 a s² b/t bytes per layer forward (LayerNorm and
  bias-dropout-add ÷ t with sequence parallelism), the backward twice that;
- recomputation: "full" runs each layer's forward again (GEMMs, elementwise, its tensor all-reduces: Megatron's
  checkpoint re-runs the layer's forward, g operators included), "selective" the attention core (scores, softmax,
  context). Its FLOPs per GPU do not depend on t; what does is the elementwise part that every tensor rank repeats
  (LayerNorms, bias-dropout-adds: 22 s·b·h bytes whatever t, run m = B/(b·d) times, and d = N/(t·p)) and its two
  all-reduces. `details["recompute_split_s"]` gives the three parts;
- tensor parallelism: 2 all-reduces of b·s·h 16-bit values per layer forward and 2 backward (§3.2), plus the
  output layer's backward all-reduce (its f operator) on the last stage (and the embedding's at p = 1), a ring on
  NVLink when t fits in a node, on InfiniBand otherwise, at NCCL's bus bandwidth and latency (hardware.py); with
  sequence parallelism reduce-scatter + all-gather, the same bytes, and under none and selective 2 all-gathers
  more per layer backward (the LayerNorm outputs are stashed as 1/t shards and gathered again, as in Megatron);
- gradient accumulation: each microbatch's weight gradients are added into the gradient buffer, a memory-bound
  pass over all of the GPU's parameters (Megatron-LM's DDP hook `param.main_grad.add_(param.grad.data)`, or
  PyTorch's AccumulateGrad without contiguous buffers): read the new gradient (2 bytes) and the buffer, write the
  buffer (fp16: 2 + 2 + 2 bytes per parameter; bf16 with fp32 gradients: 2 + 4 + 4), m times per iteration;
  m·params per GPU = B·P/(b·N): the same for every (t, p), smaller with a larger b (Megatron's later
  `--gradient-accumulation-fusion` writes the GEMM's output into the buffer and removes it; not modelled);
- pipeline p2p: the activation forward and its gradient backward at every chunk boundary, b·s·h values (÷ t
  with scatter/gather, plus an all-gather of the slices on NVLink, §4.1), on InfiniBand when pipeline neighbours
  sit on different nodes (the rank order modelled is ptd_jax's mesh, ("data", "pipe", "tensor"): tensor
  innermost, then pipeline, data outermost; Megatron's default puts data between them — same result for the
  layouts of Table 1 and Fig. 13, where t = 8 fills a node).
An iteration = (m + (p−1)/v) such microbatch slots (the bubble, §2.2: (p−1)/(v·m) of the ideal time; every
chunk boundary pays its p2p, v times per microbatch), then the data-parallel gradient all-reduce (a ring over d, not
overlapped — the paper's 2021 code — of the gradient buffer: fp16 under --fp16, fp32 under --bf16; with the
distributed optimizer a reduce-scatter of it and an all-gather of the 16-bit weights) and the optimizer step
(memory-bound, the state bytes of memory.py read and written).

Context parallelism (c, `perf/context.py`): every token-wise term (dense GEMMs, elementwise kernels, tensor-parallel
collectives, pipeline p2p, the output layer) runs on S/c tokens; the attention core on the score blocks a GPU
computes (the ring's visible sub-blocks, (1/2 + 1/(4c)) of its (S/c) × S rectangle; all_gather the whole rectangle);
"context_comm" is the K/V traffic left exposed behind those blocks (forward and backward, and the forward again
under recomputation); the gradient reduction runs over data × context, d·c GPUs. The world is d·p·c·t GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ptd_jax.config import SCHEDULE_SPECS, ModelConfig, ParallelConfig
from ptd_jax.perf.context import attention_blocks, context_seconds_per_layer
from ptd_jax.perf.hardware import Hardware
from ptd_jax.perf.memory import grad_bytes_per_param, run_memory_bytes, state_bytes_per_param
from ptd_jax.perf.flops import flops_per_iteration, hardware_flops_per_iteration, model_flops_per_iteration

HALF = 2  # bytes per 16-bit value


@dataclass(frozen=True)
class Prediction:
    """One iteration's predicted time, its terms (seconds, on the critical path) and the memory per GPU."""

    iteration_time_s: float
    terms: dict[str, float]
    bubble_fraction: float
    memory: dict[str, float]
    flops: dict[str, float]
    num_gpus: int
    details: dict = field(default_factory=dict)

    def tflops_per_gpu(self, which: str = "eq3") -> float:
        return self.flops[which] / self.iteration_time_s / self.num_gpus / 1e12


def local_tokens(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """The sequence positions one GPU runs the token-wise work of: S/c (context parallelism splits the sequence)."""
    return cfg.seq_length / parallel.context_parallel_size


FLASH_KERNEL_SLOWDOWN = {"cudnn": 2.0, "pallas": 4.7}
"""A flash kernel's attention time over the roofline of its GEMMs (the visited tiles at `gemm_efficiency`), measured
on one H200 at the 1.3B shape (b = 4, 16 heads of 128, bf16, forward and backward;
experiments/results/bench_kernels_gpu_attention.json): cuDNN 2.6 at s = 2048 and 1.5 at 4096, the Pallas kernel 5.0
and 4.5; the geometric means. The online softmax, the backward's recomputed scores and the tiles' occupancy are in
it. XLA's attention keeps the paper's model (its GEMMs and the softmax's HBM bytes): Table 1's runs used Megatron's
fused softmax, and on the H200 XLA's float32-score attention took 4.2 times that model (not applied)."""


def layer_gemm_seconds(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware) -> dict[str, float]:
    """Forward time of one layer's matmuls for one microbatch on one GPU: {"dense": ..., "attention": ...}; the dense
    ones over S/c tokens, the attention core over the score blocks the GPU computes (`context.attention_blocks`)."""
    s, b, h, f = local_tokens(cfg, parallel), parallel.micro_batch_size, cfg.hidden_size, cfg.ffn_size
    t, a, d_head = parallel.tensor_model_parallel_size, cfg.num_attention_heads, cfg.head_dim
    tokens = s * b
    qkv = (a + 2 * cfg.num_groups) * d_head  # 3h for GPT-2; grouped-query attention's K and V are G heads
    core = a * d_head
    up = 2 if cfg.swiglu else 1  # SwiGLU's gate and up
    dense = (
        hw.gemm_seconds(tokens, qkv / t, h)
        + hw.gemm_seconds(tokens, h, core / t)
        + hw.gemm_seconds(tokens, up * f / t, h)
        + hw.gemm_seconds(tokens, h, f / t)
    )
    rows, cols, count = attention_blocks(cfg, parallel)
    heads = b * a / t * count  # batched: Q·Kᵀ (rows×d_head · d_head×cols) and scores·V (rows×cols · cols×d_head)
    attention = hw.gemm_seconds(rows, cols, d_head, heads) + hw.gemm_seconds(rows, d_head, cols, heads)
    return {"dense": dense, "attention": attention * FLASH_KERNEL_SLOWDOWN.get(cfg.attention_backend, 1.0)}


def layer_elementwise_bytes(cfg: ModelConfig, parallel: ParallelConfig) -> dict[str, float]:
    """HBM bytes of one layer's forward memory-bound kernels: {"linear": ..., "softmax": ...}."""
    s, b, h, a = local_tokens(cfg, parallel), parallel.micro_batch_size, cfg.hidden_size, cfg.num_attention_heads
    t = parallel.tensor_model_parallel_size
    rows, cols, count = attention_blocks(cfg, parallel)
    replicated = 22 / t if parallel.sequence_parallel else 22  # 2 LayerNorms (4 sbh) + 2 bias-dropout-adds (7 sbh)
    # the MLP activation reads fc1's output and writes fc2's input, 2 bytes each: GeLU F + F (16 sbh/t at F = 4h),
    # SwiGLU 2F + F
    split = (6 if cfg.swiglu else 4) * cfg.ffn_size / h / t
    # XLA's softmax reads and writes the scores in HBM; a flash kernel keeps them on chip (its time is its GEMMs')
    softmax = 0.0 if cfg.attention_backend != "xla" else 9 * a * rows * cols * count * b / t
    return {"linear": s * b * h * (replicated + split), "softmax": softmax}


def tensor_allreduce_seconds(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware) -> float:
    """One of the layer's tensor-parallel all-reduces (b·s·h 16-bit values) over t GPUs."""
    t = parallel.tensor_model_parallel_size
    nbytes = HALF * local_tokens(cfg, parallel) * parallel.micro_batch_size * cfg.hidden_size
    return hw.allreduce_seconds(nbytes, t, within_node=t <= hw.gpus_per_node)


def regather_seconds(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware, recompute: str) -> float:
    """Sequence parallelism's all-gathers issued again in one layer's backward (none and selective: the stash
    holds the LayerNorm outputs' 1/t shards; full recomputes the whole forward, counted with it): 2 of b·s·h."""
    t = parallel.tensor_model_parallel_size
    if not parallel.sequence_parallel or recompute == "full" or t == 1:
        return 0.0
    nbytes = HALF * local_tokens(cfg, parallel) * parallel.micro_batch_size * cfg.hidden_size
    return 2 * hw.allgather_seconds(nbytes, t, within_node=t <= hw.gpus_per_node)


def p2p_seconds(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware) -> float:
    """One boundary crossing (an activation or its gradient) between pipeline neighbours. The mesh is
    ("data", "pipe", "tensor"), so neighbouring stages are t devices apart and one data replica's p·t devices are
    consecutive: every boundary stays in a node when p·t fits in one, else some boundary crosses, and a lockstep
    tick waits for the slowest."""
    t, p = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    nbytes = HALF * local_tokens(cfg, parallel) * parallel.micro_batch_size * cfg.hidden_size
    within = t * p <= hw.gpus_per_node
    if parallel.scatter_gather and t > 1:
        return hw.p2p_seconds(nbytes / t, within) + hw.allgather_seconds(nbytes, t, within_node=True)
    return hw.p2p_seconds(nbytes, within)


def data_parallel_seconds(params: float, parallel: ParallelConfig, hw: Hardware, grad_bytes: int = 4) -> float:
    """The gradient all-reduce over data × context (d·c GPUs: context ranks hold the same weights and saw other
    tokens) of a GPU's gradient buffer (`grad_bytes` per parameter); with the distributed optimizer, sharded over d
    only (`parallel/distributed_optimizer.py`), an all-reduce over c, a reduce-scatter over d and an all-gather of
    the 16-bit weights over d. On InfiniBand once the ring leaves the node."""
    t, p, d = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size, parallel.data_parallel_size)
    c = parallel.context_parallel_size
    # the mesh is (data, pipe, context, tensor): context peers are t devices apart, data peers p·c·t
    within = t * p * c * d <= hw.gpus_per_node
    if parallel.use_distributed_optimizer:  # a reduce-scatter takes an all-gather's time (hardware.py)
        context = hw.allreduce_seconds(grad_bytes * params, c, c * t <= hw.gpus_per_node) if c > 1 else 0.0
        return (
            context
            + hw.allgather_seconds(grad_bytes * params, d, within)
            + hw.allgather_seconds(HALF * params, d, within)
        )
    return hw.allreduce_seconds(grad_bytes * params, d * c, within)


@lru_cache(maxsize=4096)
def _split_bubble(name: str, p: int, v: int, m: int, b: float) -> float:
    from ptd_jax.parallel.pipeline import build  # pure Python, no JAX

    return build(name, p, v, m).simulate(times=(1.0, b, 1.0))["bubble_fraction"]


def split_bubble_slots(parallel: ParallelConfig, recompute: str) -> float:
    """A split schedule's bubble in microbatch slots: its unit table simulated with F = W = 1 and B = 1 (2 under
    full recomputation, whose B runs the forward again), there being no closed form for ZB-V."""
    p, v, m = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_stages, parallel.num_microbatches
    if p == 1:
        return 0.0
    return _split_bubble(parallel.pipeline_schedule, p, v, m, 2.0 if recompute == "full" else 1.0) * m


def predict(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware, recompute: str = "full") -> Prediction:
    """Predicted iteration time, terms, bubble and memory of `parallel` (its num_devices GPUs) training `cfg`."""
    parallel.check_model(cfg)
    t, p, v = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_stages,
    )
    m, b, s = parallel.num_microbatches, parallel.micro_batch_size, local_tokens(cfg, parallel)
    layers = cfg.num_layers / p  # per pipeline rank, all its chunks

    gemm = layer_gemm_seconds(cfg, parallel, hw)
    elem = layer_elementwise_bytes(cfg, parallel)
    allreduce = tensor_allreduce_seconds(cfg, parallel, hw)
    ring = context_seconds_per_layer(cfg, parallel, hw)  # exposed; zero at c = 1
    recompute_split = {  # one layer's recomputed forward: its GEMMs, its elementwise kernels, its all-reduces, and
        # (both policies rerun the attention core) its K/V ring or gather
        "none": {"gemm": 0.0, "elementwise": 0.0, "tensor_comm": 0.0, "context_comm": 0.0},
        "full": {
            "gemm": gemm["dense"] + gemm["attention"],
            "elementwise": hw.memory_seconds(elem["linear"] + elem["softmax"]),
            "tensor_comm": 2 * allreduce,
            "context_comm": ring["forward"],
        },
        "selective": {
            "gemm": gemm["attention"],
            "elementwise": hw.memory_seconds(elem["softmax"]),
            "tensor_comm": 0.0,
            "context_comm": ring["forward"],
        },
    }[recompute]
    memory = run_memory_bytes(cfg, parallel, recompute)  # the program's bytes (what ptd-train compiles)
    params_last = memory["params"]  # the bottleneck stage's (the fuller of the first and the last)
    grad_bytes = grad_bytes_per_param(cfg)
    vocab = cfg.padded_vocab_size(t)
    head = 3 * hw.gemm_seconds(s * b, vocab / t, cfg.hidden_size) + 3 * hw.memory_seconds(4 * s * b * vocab / t)
    per_mb = {  # one microbatch on the last pipeline rank
        "gemm": layers * 3 * (gemm["dense"] + gemm["attention"]) + head,
        "elementwise": layers * 3 * hw.memory_seconds(elem["linear"] + elem["softmax"]),
        "recompute": layers * sum(recompute_split.values()),
        # + the output layer's input-gradient all-reduce (its f operator), and at p = 1 also the vocab-parallel
        # embedding's forward all-reduce (on the first stage otherwise, off the bottleneck rank)
        "tensor_comm": (layers * 4 + (2 if p == 1 else 1)) * allreduce
        + layers * regather_seconds(cfg, parallel, hw, recompute),
        "context_comm": layers * (ring["forward"] + ring["backward"]),
        "pipeline_p2p": 2 * v * p2p_seconds(cfg, parallel, hw) if p > 1 else 0.0,
        "grad_accumulation": hw.memory_seconds((HALF + 2 * grad_bytes) * params_last),
    }
    slot = sum(per_mb.values())
    bubble_slots = (
        split_bubble_slots(parallel, recompute) if SCHEDULE_SPECS[parallel.pipeline_schedule].split else ((p - 1) / v)
    )
    state_bytes = state_bytes_per_param(parallel, cfg)
    terms = {name: m * x for name, x in per_mb.items()}
    terms["bubble"] = bubble_slots * slot
    terms["data_parallel_comm"] = data_parallel_seconds(params_last, parallel, hw, grad_bytes)
    terms["optimizer"] = hw.memory_seconds(2 * state_bytes * params_last)
    total = sum(terms.values())
    B = parallel.global_batch_size
    flops = {
        "model": model_flops_per_iteration(cfg, B, vocab),
        "hardware": hardware_flops_per_iteration(cfg, B, vocab, recompute),
        "eq3": flops_per_iteration(cfg, B, vocab),
    }
    return Prediction(
        iteration_time_s=total,
        terms=terms,
        bubble_fraction=bubble_slots / m,
        memory=memory,
        flops=flops,
        num_gpus=parallel.num_devices,
        details={
            "microbatch_slot_s": slot,
            "microbatches": m,
            "per_microbatch_s": per_mb,
            "recompute_split_s": {k: m * layers * x for k, x in recompute_split.items()},
        },
    )
