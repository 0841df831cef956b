"""Context parallelism in the performance model: a layer's traffic over the "context" axis, its time (the ring
overlapped with the blocks' attention, or not when the blocks are too small) and its stash per GPU
(`parallel/context.py`). Pure Python; the planner (`perf/memory.py`, `perf/timing.py`) composes these.

Per layer and microbatch, one device, b tokens-rows, S sequence, c context ranks, G key/value heads over t, K head
dim:
- p2p: forward c − 1 hops of K and V (2·b·(S/c)·(G/t)·K in the compute dtype); backward c − 1 hops again and c hops
  of dK/dV in float32. Each hop overlaps the attention of the block in hand: what is exposed is max(0, hop − block)
  per hop (backward: the K/V and dK/dV hops against twice the block), and the last dK/dV hop.
- all_gather: forward and the backward's re-gather (c − 1)/c of 2·b·S·(G/t)·K each; the reduce-scatter of dK/dV the
  same in float32. Nothing overlaps.
Everything else in a layer is token-wise: its time and its stash are those of S/c tokens.
"""

from __future__ import annotations

from ptd_jax.config import ModelConfig, ParallelConfig
from ptd_jax.perf.hardware import Hardware

HALF, FLOAT = 2, 4


def kv_block_bytes(cfg: ModelConfig, parallel: ParallelConfig, bytes_per_element: int = HALF) -> float:
    """One rank's K and V: 2·b·(S/c)·(G/t)·K elements, the unit the ring moves per hop."""
    c, t = parallel.context_parallel_size, parallel.tensor_model_parallel_size
    b, S = parallel.micro_batch_size, cfg.seq_length
    return bytes_per_element * 2 * b * (S / c) * (cfg.num_groups / t) * cfg.head_dim


def context_bytes_per_layer(cfg: ModelConfig, parallel: ParallelConfig) -> dict[str, float]:
    """Bytes one device receives over "context" in one layer per microbatch, {"forward", "backward"}; 0 at c = 1.
    `experiments/bench/counts/context_comm.py` checks these against the compiled HLO."""
    c = parallel.context_parallel_size
    if c == 1:
        return {"forward": 0.0, "backward": 0.0}
    kv, grads = kv_block_bytes(cfg, parallel), kv_block_bytes(cfg, parallel, FLOAT)
    if parallel.cp_comm_type == "p2p":
        return {"forward": (c - 1) * kv, "backward": (c - 1) * kv + c * grads}
    gathered = (c - 1) * kv  # (c − 1)/c of the c·kv gathered
    return {"forward": gathered, "backward": gathered + (c - 1) * grads}


def attention_blocks(cfg: ModelConfig, parallel: ParallelConfig) -> tuple[float, float, float]:
    """(rows, columns, count) of the score blocks one device's attention core computes per layer, microbatch row and
    local head. c = 1: XLA's attention (and the paper's fused softmax) the whole s × s square; the flash kernels
    (Pallas, cuDNN) visit the tiles on and below the diagonal, half of it. p2p: the ring's visible sub-blocks of
    Sc = S/(2c) tokens, 2c + 1 of them per rank ((1/2 + 1/(4c)) of the (S/c) × S rectangle: every rank holds chunks
    r and 2c − 1 − r, and a sub-block is skipped only when all its keys are masked), the two diagonal ones half
    computed by a flash kernel; all_gather the whole (S/c) × S rectangle (XLA masks, skips nothing)."""
    c, S = parallel.context_parallel_size, cfg.seq_length
    flash = cfg.attention_backend != "xla"
    if c == 1:
        return S, S, 0.5 if flash else 1.0
    if parallel.cp_comm_type == "p2p":
        return S / (2 * c), S / (2 * c), 2 * c + (0 if flash else 1)
    return S / c, S, 1.0


def attention_flops_per_layer(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """Forward FLOPs of one device's attention core in one layer per microbatch: q·kᵀ and p·v over the blocks it
    computes (`attention_blocks`)."""
    rows, cols, count = attention_blocks(cfg, parallel)
    heads = parallel.micro_batch_size * cfg.num_attention_heads / parallel.tensor_model_parallel_size
    return 2 * 2 * heads * cfg.head_dim * rows * cols * count


def context_seconds_per_layer(cfg: ModelConfig, parallel: ParallelConfig, hw: Hardware) -> dict[str, float]:
    """Exposed communication seconds of one layer per microbatch, {"forward", "backward"}: p2p hides each hop behind
    the attention of the block in hand (1/c of the layer's attention forward, twice that backward) and exposes the
    rest; all_gather exposes all. The ring stays on NVLink when c·t GPUs fit in a node (context sits next to tensor
    in the mesh, `parallel/mesh.py`)."""
    c, t = parallel.context_parallel_size, parallel.tensor_model_parallel_size
    if c == 1:
        return {"forward": 0.0, "backward": 0.0}
    within = c * t <= hw.gpus_per_node
    moved = context_bytes_per_layer(cfg, parallel)
    if parallel.cp_comm_type != "p2p":
        return {k: hw.allgather_seconds(v * c / (c - 1), c, within_node=within) for k, v in moved.items()}
    block = attention_flops_per_layer(cfg, parallel) / c / (hw.peak_flops * hw.gemm_efficiency)
    kv, grads = kv_block_bytes(cfg, parallel), kv_block_bytes(cfg, parallel, FLOAT)
    hop, grad_hop = hw.p2p_seconds(kv, within), hw.p2p_seconds(grads, within)
    forward = (c - 1) * max(0.0, hop - block)
    # each step's dK/dV leave after its block and travel beside the next K/V hop; the last ones wait for nothing
    backward = (c - 1) * max(0.0, hop + grad_hop - 2 * block) + grad_hop
    return {"forward": forward, "backward": backward}


def score_block_bytes(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """The float32 scores of one block `attention_blocks` counts, over the device's b·H/t heads."""
    rows, cols, _ = attention_blocks(cfg, parallel)
    heads = parallel.micro_batch_size * cfg.num_attention_heads / parallel.tensor_model_parallel_size
    return FLOAT * heads * rows * cols


KEPT_SCORES = 1.65
"""p2p under none: what a layer keeps of its forward ring, in float32 scores of all its visible sub-blocks. The
policy keeps every matmul's output (`model._keep_none`), and inside the ring's `cond`s those are the scores q·kᵀ of
each sub-block (1.0) and the blocks' p·v; XLA:GPU's compiled step keeps 1.56 to 1.78 (per layer, from 2 to 4
layers of Llama-3.2-1B at 8k and 16k tokens, c = 2 and 4: `experiments/bench/context/cp_memory.py`)."""
WORKSPACE_SCORES = {"none": 3.0}
"""p2p under none: the float32 score blocks live at the peak beyond the stash, once per program, in units of one
layer's visible sub-blocks (2.8 to 3.1 measured like `KEPT_SCORES`: the last layer's backward beside its kept
scores). Under selective, one sub-block's backward: p, dp and ds, `SUB_BLOCK_WORKSPACE` sub-blocks."""
SUB_BLOCK_WORKSPACE = 3


def ring_kept_scores_bytes(cfg: ModelConfig, parallel: ParallelConfig) -> float:
    """p2p under none: the float32 scores one layer keeps of its forward ring (`KEPT_SCORES`); 0 otherwise."""
    if parallel.context_parallel_size == 1 or parallel.cp_comm_type != "p2p" or cfg.attention_backend != "xla":
        return 0.0  # the flash kernel's ring keeps no scores
    return KEPT_SCORES * (2 * parallel.context_parallel_size + 1) * score_block_bytes(cfg, parallel)


def ring_stash_bytes_per_layer(cfg: ModelConfig, parallel: ParallelConfig, recompute: str = "selective") -> float:
    """What context parallelism adds to one layer's stash per microbatch beyond S/c tokens' worth: p2p keeps the
    output's log-sum-exp (float32, H/t per token) and, where XLA shares the forward's received K/V blocks with the
    backward's ring (measured on XLA:GPU), those c − 1 blocks, and under none the float32 scores of its visible
    sub-blocks (`KEPT_SCORES`); all_gather's autodiff keeps the float32 scores of the local queries against the whole
    sequence."""
    c, t = parallel.context_parallel_size, parallel.tensor_model_parallel_size
    if c == 1:
        return 0.0
    b, S, heads = parallel.micro_batch_size, cfg.seq_length, cfg.num_attention_heads / t
    if parallel.cp_comm_type == "p2p":
        kept = ring_kept_scores_bytes(cfg, parallel) if recompute == "none" else 0.0
        return FLOAT * heads * b * S / c + (c - 1) * kv_block_bytes(cfg, parallel) + kept
    return FLOAT * heads * b * (S / c) * S


def ring_workspace_bytes(cfg: ModelConfig, parallel: ParallelConfig, recompute: str) -> float:
    """The p2p ring's float32 score blocks at the peak beyond the stash, once per program (`WORKSPACE_SCORES`); 0 at
    c = 1, under full recomputation (its rebuilt layer is counted as none's) and for all_gather (not measured apart)."""
    ring = parallel.context_parallel_size > 1 and parallel.cp_comm_type == "p2p"
    if not ring or recompute == "full" or cfg.attention_backend != "xla":
        return 0.0  # the flash kernel's ring keeps its blocks on chip
    blocks = (
        WORKSPACE_SCORES["none"] * (2 * parallel.context_parallel_size + 1)
        if recompute == "none"
        else SUB_BLOCK_WORKSPACE
    )
    return blocks * score_block_bytes(cfg, parallel)
