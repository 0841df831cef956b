"""The paper's counting formulas (§5.1, Appendix) and the FLOPs a run actually executes (device peaks:
`perf/hardware.py`).

Three figures, because they answer different questions:
- model FLOPs (what MFU divides by the peak): the forward and backward matmuls of the model, no recomputation,
  at the model's real MLP width F (`--ffn-hidden-size`): per layer and token 2(4h² + 2hF) + 4sh forward (QKV,
  out, fc1, fc2; scores and context), backward twice that; the logit layer 2hV forward. With F = 4h this is
  72 B s l h² (1 + s/(6h)) + 6 B s h V.
- hardware FLOPs: what was executed — the matmuls as the attention backend runs them (`attention_flops`: "xla"
  the dense scores and context, forward 4sh per layer and token, backward twice that; the flash kernels skip the
  key blocks above the causal diagonal, about half, and their backward recomputes Q·Kᵀ), plus recomputation
  (`--recompute-granularity`: selective recomputes Q·Kᵀ, 2sh per layer and token, under "xla" and nothing under a
  flash backend, whose output the layer keeps; full the layer's forward but fc2, as JAX's remat runs them) and, on
  a pipeline, what the lockstep table runs beyond that (`parallel/pipeline/executor.py`): under "uniform" branching
  idle cells compute on a dummy and the output layer runs on every rank of the ticks that need it (counted from the
  table; `experiments/bench/counts/pipeline_flops.py` counts the same on the traced program).
- eq. (3), the paper's "achieved teraFLOP/s" numerator, as published (full recomputation, F = 4h assumed):
      F = 96 B s l h² (1 + s/(6h) + V/(16 l h))

- eq. (2) parameters:  P = 12 l h² (1 + 13/(12h) + (V+s)/(12 l h))
- eq. (4) training time ≈ 8 T P / (n X)

V is the padded vocabulary (the compute actually done).
"""

from __future__ import annotations

from ptd_jax.config import ModelConfig
from ptd_jax.runtime.platform import resolve_branching


def num_params(cfg: ModelConfig, vocab_size: int | None = None) -> float:
    """eq. (2); excludes the final LayerNorm's 2h, as the paper does."""
    L, h, s = cfg.num_layers, cfg.hidden_size, cfg.max_positions
    V = cfg.padded_vocab_size() if vocab_size is None else vocab_size
    return 12 * L * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))


def flops_per_iteration(cfg: ModelConfig, global_batch_size: int, vocab_size: int | None = None) -> float:
    """eq. (3) as published: FLOPs of one iteration with full recomputation and an MLP of 4h, whatever the run's
    recompute flag and MLP width (the paper's 'achieved teraFLOP/s' numerator, for comparison with its tables)."""
    L, h, s, B = cfg.num_layers, cfg.hidden_size, cfg.seq_length, global_batch_size
    V = cfg.padded_vocab_size() if vocab_size is None else vocab_size
    return 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))


def layer_forward_flops(cfg: ModelConfig, tokens: float) -> float:
    """Matmul FLOPs of one transformer layer's forward over `tokens` tokens (sequences of cfg.seq_length)."""
    return layer_matmul_flops(cfg, tokens) + attention_core_flops(cfg, tokens)


def attention_width(cfg: ModelConfig) -> int:
    """H · K: the width of the attention core's matmuls (h for GPT-2; grouped-query attention shares keys and
    values between query heads, so the core's FLOPs follow the query heads)."""
    return cfg.num_attention_heads * cfg.head_dim


def attention_core_flops(cfg: ModelConfig, tokens: float) -> float:
    """Q·Kᵀ and scores·V of one layer's forward (what selective recomputation runs again): 4 s H K per token, the
    whole s × s square: causal attention is *not* halved here (the paper's eq. 3, NeMo and torchtitan count it so;
    newer Megatron-LM halves it)."""
    return 4 * tokens * cfg.seq_length * attention_width(cfg)


def head_forward_flops(cfg: ModelConfig, tokens: float, vocab_size: int) -> float:
    return 2 * tokens * cfg.hidden_size * vocab_size


def model_flops_per_iteration(cfg: ModelConfig, global_batch_size: int, vocab_size: int | None = None) -> float:
    """Model FLOPs without recomputation (MFU numerator): forward + backward (2×) of the layers and the logit layer,
    at the real MLP width; equals 72 B s l h² (1 + s/(6h)) + 6 B s h V when F = 4h."""
    V = cfg.padded_vocab_size() if vocab_size is None else vocab_size
    tokens = global_batch_size * cfg.seq_length
    return 3 * (cfg.num_layers * layer_forward_flops(cfg, tokens) + head_forward_flops(cfg, tokens, V))


def selective_recompute_flops(cfg: ModelConfig, tokens: float) -> float:
    """What "selective" runs again per layer under "xla": Q·Kᵀ (2 s h per token). The context matmul's output is not
    needed by the backward, so JAX's remat drops its recomputation (counted on the traced step,
    tests/train/test_flops.py); Megatron's checkpointed core attention reruns both. A flash backend's kernel output
    (and its log-sum-exp) is kept by the policy like any non-elementwise output: nothing is recomputed."""
    return 2 * tokens * cfg.seq_length * attention_width(cfg) if cfg.attention_backend == "xla" else 0.0


# The Pallas kernel's tiling (`pallas_kernels.flash_attention.BlockSizes` and `flash_attention`), restated without
# JAX so that the planner can count it; tests/train/test_flops.py checks it against the kernel's own.
FLASH_BLOCK, FLASH_MIN_TILE = 64, 16


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def flash_block_pairs(seq_len: int, block_q: int = FLASH_BLOCK, block_k: int = FLASH_BLOCK) -> dict:
    """The Pallas causal flash-attention kernels' work per sequence and head: the blocks and padded length
    (`BlockSizes.for_seq`), the (query block, key block) pairs that the forward and the dq kernel visit (keys up to
    the query block's end) and that the dk/dv kernel visits (queries from the key block's start)."""
    limit = max(FLASH_MIN_TILE, _next_power_of_2(seq_len))
    bq, bk = min(block_q, limit), min(block_k, limit)
    step = max(bq, bk)
    padded = -(-seq_len // step) * step
    forward = sum(-(-(i + 1) * bq // bk) for i in range(padded // bq))
    dkdv = sum(padded // bq - (j * bk) // bq for j in range(padded // bk))
    return {"block_q": bq, "block_k": bk, "padded": padded, "forward": forward, "dkdv": dkdv}


def attention_flops(cfg: ModelConfig, tokens: float) -> tuple[float, float]:
    """(forward, backward) matmul FLOPs of one layer's attention core (scores and context) as the backend executes
    them over `tokens` tokens; the model's count is "xla"'s, (4 s h, 8 s h) per token.
    - "pallas": per visited block pair of bq×bk and head width W (padded to a power of two ≥ 16), 2·bq·bk·W per
      matmul; the forward runs 2 (Q·Kᵀ, P·V), the dk/dv kernel 4 (Q·Kᵀ again, dV, dP, dK) and the dq kernel 3
      (Q·Kᵀ, dP, dQ): at s = 2048 and blocks of 64, 33/64 of the dense forward and 7/8 of its backward's 2×.
    - "cudnn": FlashAttention-2's causal kernels, counted as FlashAttention-2 counts them (its tiles are not ours
      to see): the lower half of the dense scores, 2 matmuls forward and 5 backward (Q·Kᵀ recomputed once):
      (2 s h, 5 s h) per token."""
    s, h = cfg.seq_length, attention_width(cfg)
    if cfg.attention_backend == "xla":
        return 4 * tokens * s * h, 8 * tokens * s * h
    if cfg.attention_backend == "cudnn":
        return 2 * tokens * s * h, 5 * tokens * s * h
    heads, head_dim = cfg.num_attention_heads, cfg.head_dim
    pairs = flash_block_pairs(s)
    per_pair = 2 * pairs["block_q"] * pairs["block_k"] * max(FLASH_MIN_TILE, _next_power_of_2(head_dim)) * heads
    sequences = tokens / s
    return (
        sequences * per_pair * 2 * pairs["forward"],
        sequences * per_pair * (4 * pairs["dkdv"] + 3 * pairs["forward"]),
    )


def layer_recompute_flops(cfg: ModelConfig, tokens: float, recompute: str) -> float:
    """The extra forward work of `--recompute-granularity` (paper §3.5) per layer, in the reference step and the
    pipeline alike, as the attention backend runs it: selective Q·Kᵀ ("xla" only), full the layer's forward except
    fc2, whose output the backward does not need (JAX's remat drops it)."""
    if recompute == "none":
        return 0.0
    if recompute == "selective":
        return selective_recompute_flops(cfg, tokens)
    return (
        layer_matmul_flops(cfg, tokens) - 2 * tokens * cfg.ffn_size * cfg.hidden_size + attention_flops(cfg, tokens)[0]
    )


def layer_matmul_flops(cfg: ModelConfig, tokens: float) -> float:
    """QKV, the output projection, fc1 and fc2 of one layer's forward: 2(4h² + 2hF) per token for GPT-2; in
    general 2(h (H + 2G) K + H K h + (2 if SwiGLU else 1) h F + F h): grouped-query attention's K and V
    projections are G heads wide, SwiGLU's fc1 is two F-wide matmuls (gate and up)."""
    h, f, K = cfg.hidden_size, cfg.ffn_size, cfg.head_dim
    H, G = cfg.num_attention_heads, cfg.num_groups
    up = 2 if cfg.swiglu else 1
    return 2 * tokens * (h * (H + 2 * G) * K + H * K * h + up * h * f + f * h)


def layer_executed_flops(cfg: ModelConfig, tokens: float, recompute: str) -> tuple[float, float]:
    """(forward, backward) FLOPs one layer executes over `tokens` tokens: the weight matmuls (backward 2×), the
    attention core as the backend runs it (`attention_flops`), the recomputation in the backward."""
    dense = layer_matmul_flops(cfg, tokens)
    attn_f, attn_b = attention_flops(cfg, tokens)
    return dense + attn_f, 2 * dense + attn_b + layer_recompute_flops(cfg, tokens, recompute)


def recompute_flops_per_iteration(cfg: ModelConfig, global_batch_size: int, recompute: str) -> float:
    """The extra forward work of `--recompute-granularity` in the single-stage step (p = 1)."""
    return cfg.num_layers * layer_recompute_flops(cfg, global_batch_size * cfg.seq_length, recompute)


def hardware_flops_per_iteration(
    cfg: ModelConfig,
    global_batch_size: int,
    vocab_size: int | None = None,
    recompute: str = "none",
    sched=None,
    branching: str = "auto",
) -> float:
    """FLOPs executed by all devices in one iteration, with the attention core as `cfg.attention_backend` runs it
    (`layer_executed_flops`). Without a pipeline schedule (p = 1): each layer's forward and backward (with what
    `recompute` recomputes) and the output layer's (3× its forward). With one (a `parallel.pipeline.Table`):
    summed over its ticks as the lockstep executor runs them — a forward cell runs its chunk's forwards, plus the
    output layer (forward and backward) on the last virtual stage; a backward cell its layers' backwards, each layer
    checkpointed as in the reference (a split schedule's I all but the kernels' gradients, its W those);
    under "uniform" every rank runs its tick's chunk work, idle ones on a
    dummy, and the head on the ticks where some rank needs it."""
    V = cfg.padded_vocab_size() if vocab_size is None else vocab_size
    if sched is None:  # no pipeline table: nothing to resolve (the planner stays free of JAX)
        tokens = global_batch_size * cfg.seq_length
        return cfg.num_layers * sum(layer_executed_flops(cfg, tokens, recompute)) + 3 * head_forward_flops(
            cfg, tokens, V
        )
    branching = resolve_branching(branching, schedule=sched.name)
    tokens = global_batch_size * cfg.seq_length / sched.m  # one microbatch, over all data-parallel replicas
    layers = cfg.num_layers / (sched.p * sched.v)
    chunk_f, chunk_b = (layers * x for x in layer_executed_flops(cfg, tokens, recompute))
    chunk_w = layers * layer_matmul_flops(cfg, tokens)  # a split backward's W: the kernels' gradients
    cost = {"F": chunk_f, "B": chunk_b, "I": chunk_b - chunk_w, "W": chunk_w}
    head_b = 3 * head_forward_flops(cfg, tokens, V)
    last = sched.p * sched.v - 1
    total = 0.0
    for row in sched.cells:
        busy = [(r, c.action) for r, c in enumerate(row) if c.action is not None]
        heads = sum(1 for r, a in busy if a.kind == "F" and sched.stage(a, r) == last)
        if branching == "uniform":  # one kind a tick: every rank runs it (split tables run per-rank only)
            total += sched.p * (cost[busy[0][1].kind] + (head_b if heads else 0.0))
        else:
            total += sum(cost[a.kind] for _, a in busy) + heads * head_b
    return total


def training_days(tokens: float, params: float, num_devices: int, tflops_per_device: float) -> float:
    """eq. (4): end-to-end training time ≈ 8 T P / (n X), in days."""
    return 8 * tokens * params / (num_devices * tflops_per_device * 1e12) / 86400
