"""The time of one training iteration of Megatron's PTD-P, term by term (paper §3, "Performance Analysis of
Parallelization Configurations"), for a layout on a `Hardware` preset. Nothing here is fitted to the paper.

Per microbatch, on the bottleneck pipeline rank (the last: its l/p layers plus the output layer):
- GEMMs: the roofline time of each matmul of a layer (QKV, scores, context, output, fc1, fc2 at their per-GPU
  shapes), backward twice the forward, the output layer 2·b·s·h·V/t forward;
- elementwise kernels, memory-bound: Megatron's fused LayerNorms, bias+dropout+residual, bias+GeLU and
  scaled-masked softmax + dropout move s b h (22 + 16/t) + 9 a s² b/t bytes per layer forward (LayerNorm and
  bias-dropout-add ÷ t with sequence parallelism), the backward twice that;
- recomputation: "full" runs each layer's forward again (GEMMs, elementwise, its tensor all-reduces),
  "selective" the attention core (scores, softmax, context);
- tensor parallelism: 2 all-reduces of b·s·h 16-bit values per layer forward and 2 backward (§3.2), a ring on
  NVLink when t fits in a node, on InfiniBand otherwise; with sequence parallelism reduce-scatter + all-gather,
  the same bytes;
- pipeline p2p: the activation forward and its gradient backward at every chunk boundary, b·s·h values (÷ t
  with scatter/gather, plus an all-gather of the slices on NVLink, §4.1), on InfiniBand when pipeline neighbours
  sit on different nodes (Megatron's rank order: tensor innermost, then data, then pipeline).
An iteration = (m + (p−1)/v) such microbatch slots (the bubble, §2.2: (p−1)/(v·m) of the ideal time; every
chunk boundary pays its p2p, v times per microbatch), then the data-parallel gradient all-reduce (16-bit, a ring
over d, not overlapped — the paper's 2021 code; reduce-scatter + all-gather with the distributed optimizer: same
bytes) and the optimizer step (memory-bound, the 18 or 6 + 12/d bytes of state read and written).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ptd_jax.config import ModelConfig, ParallelConfig
from ptd_jax.perf.hardware import Hardware, allgather_seconds, ring_allreduce_seconds
from ptd_jax.perf.memory import memory_per_gpu, state_bytes_per_param
from ptd_jax.train.flops import flops_per_iteration, hardware_flops_per_iteration, model_flops_per_iteration

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


def layer_gemm_seconds(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware) -> dict[str, float]:
    """Forward time of one layer's matmuls for one microbatch on one GPU: {"dense": ..., "attention": ...}."""
    s, b, h, f = cfg.seq_length, parallel.micro_batch_size, cfg.hidden_size, cfg.ffn_size
    t, a, d_head = parallel.tensor_model_parallel_size, cfg.num_attention_heads, cfg.head_dim
    tokens = s * b
    dense = (hw.gemm_seconds(tokens, 3 * h / t, h) + hw.gemm_seconds(tokens, h, h / t)
             + hw.gemm_seconds(tokens, f / t, h) + hw.gemm_seconds(tokens, h, f / t))
    heads = b * a / t  # batched: Q·Kᵀ (s×d_head · d_head×s) and scores·V (s×s · s×d_head) per head
    attention = hw.gemm_seconds(s, s, d_head, heads) + hw.gemm_seconds(s, d_head, s, heads)
    return {"dense": dense, "attention": attention}


def layer_elementwise_bytes(cfg: ModelConfig, parallel: ParallelConfig) -> dict[str, float]:
    """HBM bytes of one layer's forward memory-bound kernels: {"linear": ..., "softmax": ...}."""
    s, b, h, a = cfg.seq_length, parallel.micro_batch_size, cfg.hidden_size, cfg.num_attention_heads
    t = parallel.tensor_model_parallel_size
    replicated = 22 / t if parallel.sequence_parallel else 22  # 2 LayerNorms (4 sbh) + 2 bias-dropout-adds (7 sbh)
    return {"linear": s * b * h * (replicated + 16 / t), "softmax": 9 * a * s * s * b / t}


def tensor_allreduce_seconds(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware) -> float:
    """One of the layer's tensor-parallel all-reduces (b·s·h 16-bit values) over t GPUs."""
    t = parallel.tensor_model_parallel_size
    bandwidth, latency = hw.link(within_node=t <= hw.gpus_per_node)
    nbytes = HALF * cfg.seq_length * parallel.micro_batch_size * cfg.hidden_size
    return ring_allreduce_seconds(nbytes, t, bandwidth, latency)


def p2p_seconds(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware) -> float:
    """One boundary crossing (an activation or its gradient) between pipeline neighbours. The mesh is
    ("data", "pipe", "tensor"), so neighbouring stages are t devices apart and one data replica's p·t devices are
    consecutive: every boundary stays in a node when p·t fits in one, else some boundary crosses, and a lockstep
    tick waits for the slowest."""
    t, p = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    nbytes = HALF * cfg.seq_length * parallel.micro_batch_size * cfg.hidden_size
    bandwidth, latency = hw.link(within_node=t * p <= hw.gpus_per_node)
    if parallel.scatter_gather and t > 1:
        nv_bw, nv_lat = hw.link(within_node=True)
        return nbytes / t / bandwidth + latency + allgather_seconds(nbytes, t, nv_bw, nv_lat)
    return nbytes / bandwidth + latency


def data_parallel_seconds(params: float, parallel: ParallelConfig, hw: Hardware) -> float:
    """The gradient all-reduce over d of a GPU's 16-bit gradients; on InfiniBand once the ring leaves the node."""
    t, p, d = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
               parallel.data_parallel_size)
    # data-parallel peers differ in their data coordinate only, which is outermost: they are p·t devices apart
    bandwidth, latency = hw.link(within_node=t * p * d <= hw.gpus_per_node)
    return ring_allreduce_seconds(HALF * params, d, bandwidth, latency)


def predict(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware, recompute: str = "full") -> Prediction:
    """Predicted iteration time, terms, bubble and memory of `parallel` (its num_devices GPUs) training `cfg`."""
    parallel.check_model(cfg)
    t, p, v = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
               parallel.virtual_pipeline_stages)
    m, b, s = parallel.num_microbatches, parallel.micro_batch_size, cfg.seq_length
    layers = cfg.num_layers / p  # per pipeline rank, all its chunks

    gemm = layer_gemm_seconds(cfg, parallel, hw)
    elem = layer_elementwise_bytes(cfg, parallel)
    fwd_compute = gemm["dense"] + gemm["attention"] + hw.memory_seconds(elem["linear"] + elem["softmax"])
    allreduce = tensor_allreduce_seconds(cfg, parallel, hw)
    recompute_compute = {"none": 0.0, "full": fwd_compute,
                         "selective": gemm["attention"] + hw.memory_seconds(elem["softmax"])}[recompute]
    recompute_comm = 2 * allreduce if recompute == "full" else 0.0
    vocab = cfg.padded_vocab_size(t)
    head = 3 * hw.gemm_seconds(s * b, vocab / t, cfg.hidden_size) + 3 * hw.memory_seconds(4 * s * b * vocab / t)
    per_mb = {  # one microbatch on the last pipeline rank
        "gemm": layers * 3 * (gemm["dense"] + gemm["attention"]) + head,
        "elementwise": layers * 3 * hw.memory_seconds(elem["linear"] + elem["softmax"]),
        "recompute": layers * (recompute_compute + recompute_comm),
        "tensor_comm": layers * 4 * allreduce,
        "pipeline_p2p": 2 * v * p2p_seconds(cfg, parallel, hw) if p > 1 else 0.0,
    }
    slot = sum(per_mb.values())
    bubble_slots = (p - 1) / v
    params_last = memory_per_gpu(cfg, parallel, recompute)["params"]
    state_bytes = state_bytes_per_param(parallel)
    terms = {name: m * x for name, x in per_mb.items()}
    terms["bubble"] = bubble_slots * slot
    terms["data_parallel_comm"] = data_parallel_seconds(params_last, parallel, hw)
    terms["optimizer"] = hw.memory_seconds(2 * state_bytes * params_last)
    total = sum(terms.values())
    B = parallel.global_batch_size
    flops = {"model": model_flops_per_iteration(cfg, B, vocab),
             "hardware": hardware_flops_per_iteration(cfg, B, vocab, recompute),
             "eq3": flops_per_iteration(cfg, B, vocab)}
    return Prediction(iteration_time_s=total, terms=terms, bubble_fraction=bubble_slots / m,
                      memory=memory_per_gpu(cfg, parallel, recompute), flops=flops, num_gpus=parallel.num_devices,
                      details={"microbatch_slot_s": slot, "microbatches": m, "per_microbatch_s": per_mb})
