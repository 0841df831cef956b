"""Configuration: frozen dataclasses validated on construction (the named models are in `presets.py`).

Three configs travel through the whole system (docs/architecture.md, "Data flow"):
- `ModelConfig`: the GPT architecture (Megatron GPT = GPT-2: learned positions, pre-LayerNorm, tied output).
- `ParallelConfig`: the PTD-P layout (data × pipe × tensor), microbatching and the pipeline schedule.
- `TrainConfig`: optimizer, learning-rate schedule, iterations, logging and evaluation cadence.

Every inconsistency raises `ConfigError` with a one-line message that names the offending values; the CLI turns
it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleSpec:
    """A pipeline schedule's properties, as data (`SCHEDULE_SPECS`): nothing else in the project names a schedule.
    The pipeline package builds each rank's order of actions from `orders`, places them on ticks by `rows`, and the
    one executor runs the table (docs/architecture.md, "Pipeline")."""

    name: str
    orders: str
    """The order builder (`parallel.pipeline.schedule.ORDERS`)."""
    split: bool
    """Backwards split into I (input gradient) and W (weight gradients); else one fused B."""
    rows: str
    """"lockstep": one kind per tick (a tick lasts its longest cell; right for F and a fused B ≈ 2F); "unit": each
    rank runs its next ready action, whatever its kind (right when F ≈ I ≈ W: the asynchronous timeline)."""
    chunks: int | None
    """Model chunks per rank: fixed (1, or 2 for the V), or None: set by --num-layers-per-virtual-pipeline-stage."""
    stage_map: str = "round-robin"
    """"round-robin": chunk c on rank r is virtual stage c·p + r; "v": chunk 1 runs back up (stage 2p − 1 − r)."""
    min_p: int = 1
    grouped: bool = False
    """Takes Megatron's microbatch group size G (interleaving)."""
    bubble_formula: str | None = "(p-1)/(v*m)"
    """The closed-form bubble, None where the paper gives none."""


SCHEDULE_SPECS = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", orders="gpipe", split=False, rows="lockstep", chunks=1),
        ScheduleSpec("1f1b", orders="1f1b", split=True, rows="unit", chunks=1),
        ScheduleSpec("1f1b-lockstep", orders="1f1b-lockstep", split=False, rows="lockstep", chunks=1),
        ScheduleSpec(
            "interleaved", orders="interleaved", split=False, rows="lockstep", chunks=None, min_p=2, grouped=True
        ),
        ScheduleSpec(
            "zb-h1", orders="zb-h1", split=True, rows="unit", chunks=1, bubble_formula="(p-1)(f+b-w)/(m(f+b+w))"
        ),
        ScheduleSpec(
            "zb-v", orders="zero-bubble", split=True, rows="unit", chunks=2, stage_map="v", min_p=2, bubble_formula=None
        ),
    )
}
PIPELINE_SCHEDULES = tuple(SCHEDULE_SPECS)
RETIRED_SCHEDULES = {"1f1b-split": "'1f1b' now splits its backwards and holds Megatron's stash p - s"}
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
PIPELINE_BRANCHINGS = ("auto", "uniform", "per-rank")
CP_COMM_TYPES = ("p2p", "all_gather")
"""How attention crosses the "context" axis (Megatron's --cp-comm-type): a ring of K/V blocks, or K/V gathered."""


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of schedule `name`, or a ConfigError naming the known ones."""
    if name in RETIRED_SCHEDULES:
        raise ConfigError(f"schedule={name!r} is retired: {RETIRED_SCHEDULES[name]}")
    _check(name in SCHEDULE_SPECS, f"schedule={name!r} is not one of {PIPELINE_SCHEDULES}")
    return SCHEDULE_SPECS[name]


LR_DECAY_STYLES = ("constant", "linear", "cosine")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
DTYPES = ("float32", "bfloat16", "float16", "float64")
ATTENTION_BACKENDS = ("xla", "pallas", "cudnn")


class ConfigError(ValueError):
    """An invalid or inconsistent configuration; the message is one line naming the values."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def pad_vocab_size(vocab_size: int, divisible_by: int = 128, tensor_parallel_size: int = 1) -> int:
    """Megatron's `--make-vocab-size-divisible-by`: pad V to a multiple of divisible_by · t."""
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def check_pipeline_request(schedule: str, p: int, v: int, m: int, group: int | None = None) -> int:
    """The rules a pipeline schedule request must meet (schedule name, p, v, m and the interleaved group G);
    returns the effective G. `ParallelConfig` and the schedule builders both check them here."""
    spec = schedule_spec(schedule)
    _check(p >= 1 and v >= 1 and m >= 1, f"p={p}, v={v} and m={m} must be positive")
    _check(p >= spec.min_p, f"schedule={schedule!r} needs p >= {spec.min_p} pipeline ranks, got p={p}")
    if spec.chunks is not None:
        _check(
            v == spec.chunks,
            f"schedule={schedule!r} runs {spec.chunks} model chunk(s) per rank: needs v={spec.chunks}, got v={v}",
        )
    if not spec.grouped:
        _check(
            group is None,
            f"microbatch_group_size={group} applies to grouped schedules (interleaved) only, got schedule={schedule!r}",
        )
        return 1
    g = p if group is None else group
    _check(p <= g <= m, f"schedule={schedule!r} needs p <= G <= m (Megatron's rule), got p={p}, G={g}, m={m}")
    _check(
        not (m % g and m % g < p),
        f"schedule={schedule!r} needs m % G == 0 or m % G >= p (Megatron's rule), "
        f"got m={m}, G={g}, m % G={m % g}, p={p}",
    )
    return g


@dataclass(frozen=True)
class ModelConfig:
    """The transformer: GPT-2 by default, and the Llama family (Llama 2/3, Mistral, Qwen2) by Megatron's switches
    (normalization, swiglu, position_embedding_type, num_query_groups, kv_channels, untied output, biases, window),
    as megatron-core's one GPTModel. Sizes use the paper's letters: l layers, h hidden, a heads, s sequence,
    V vocabulary."""

    num_layers: int = 4
    """l: number of transformer layers."""
    hidden_size: int = 128
    """h: model width."""
    num_attention_heads: int = 4
    """a: attention heads; head dim = h / a."""
    seq_length: int = 128
    """s: tokens per training sample."""
    max_position_embeddings: int | None = None
    """Rows of the learned position table; defaults to seq_length."""
    vocab_size: int = 257
    """V before padding (the tokenizer's size); the embedding holds padded_vocab_size rows."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this (times the tensor-parallel size), as Megatron does."""
    ffn_hidden_size: int | None = None
    """MLP inner width; defaults to 4h."""
    gelu_approximate: bool = True
    """GeLU with the tanh approximation (GPT-2/OpenAI); False uses the exact erf form."""
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    """Std of the normal init; output projections (attention out, fc2) use std / sqrt(2 l)."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP outputs and on embeddings (Megatron's default is 0.1)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities (Megatron's default is 0.1)."""
    attention_backend: str = "xla"
    """xla (einsum + softmax), pallas (fused flash attention, pallas_kernels/; interpret mode on CPU) or cudnn
    (jax.nn.dot_product_attention on GPU)."""
    fused_kernels: bool = False
    """LayerNorm and the (vocab-parallel) cross-entropy by the Pallas kernels of pallas_kernels/ (interpret mode
    on CPU); the output layer then emits logits in the compute dtype and the loss kernel reads them in blocks."""
    dtype: str = "float32"
    """Compute dtype for activations and matmuls (`--bf16` bfloat16, `--fp16` float16 with loss scaling); softmax
    and loss stay float32."""
    param_dtype: str = "float32"
    """Storage dtype of the master parameters (float64 for exactness tests under jax_enable_x64)."""
    normalization: str = "LayerNorm"
    """LayerNorm (scale and bias) or RMSNorm (scale only; Llama's), with `layernorm_epsilon` (--norm-epsilon)."""
    swiglu: bool = False
    """The MLP as SwiGLU: silu(x W_gate) * (x W_up), then W_down; fc1 holds [gate, up] ([D, 2, F])."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute (a learned [S, D] table, GPT-2's) or rope (rotary embeddings on q and k, Llama's)."""
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    """The share of each head's dims that rotate (the first int(K · percent)); the rest pass through."""
    rotary_interleaved: bool = False
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... (Meta's original Llama code) instead of the two halves
    (x_i, x_{i+K/2}) (Hugging Face's `rotate_half`, Megatron's default)."""
    use_rope_scaling: bool = False
    """Llama 3.1's frequency scaling of RoPE (`rope_type: llama3`), with the four numbers below."""
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    num_query_groups: int | None = None
    """G: key/value heads (grouped-query attention); None: one per query head (multi-head attention)."""
    kv_channels: int | None = None
    """K: the head dim; None: hidden / heads (Mistral sets it apart from them)."""
    untie_embeddings_and_output_weights: bool = False
    """An output layer of its own ([Vp, D]) instead of the word embedding's transpose."""
    add_bias_linear: bool = True
    """Biases in every linear layer (GPT-2); False: none (Llama)."""
    add_qkv_bias: bool | None = None
    """Biases in the QKV projection only (Qwen2: True with add_bias_linear False); None: as add_bias_linear."""
    window_size: int | None = None
    """Sliding-window attention (Mistral): a query sees itself and the window_size − 1 keys before it."""

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, f"{name}={value!r} must be a positive integer")
        _check(
            self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
            f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads} "
            f"(give kv_channels for a head dim of its own)",
        )
        self._check_llama_switches()
        _check(
            self.max_position_embeddings is None or self.max_position_embeddings >= self.seq_length,
            f"max_position_embeddings={self.max_position_embeddings} is smaller than seq_length={self.seq_length}",
        )
        _check(
            self.ffn_hidden_size is None or self.ffn_hidden_size > 0,
            f"ffn_hidden_size={self.ffn_hidden_size} must be positive",
        )
        _check(
            self.make_vocab_size_divisible_by > 0,
            f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be positive",
        )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            _check(0.0 <= value < 1.0, f"{name}={value} must be in [0, 1)")
        for name in ("init_method_std", "layernorm_epsilon"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value > 0, f"{name}={value} must be a positive finite number")
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend={self.attention_backend!r} is not one of {ATTENTION_BACKENDS}",
        )
        _check(
            self.attention_backend == "xla" or self.attention_dropout == 0.0,
            f"attention_dropout={self.attention_dropout} needs attention_backend='xla', got "
            f"{self.attention_backend!r} (the fused kernels have no dropout)",
        )
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            _check(value in DTYPES, f"{name}={value!r} is not one of {DTYPES}")
        _check(
            self.dtype != "float64" or (self.attention_backend == "xla" and not self.fused_kernels),
            f"dtype='float64' needs attention_backend='xla' and fused_kernels=False, got attention_backend="
            f"{self.attention_backend!r}, fused_kernels={self.fused_kernels} (the kernels accumulate in float32)",
        )

    def _check_llama_switches(self) -> None:
        _check(
            self.normalization in NORMALIZATIONS, f"normalization={self.normalization!r} is not one of {NORMALIZATIONS}"
        )
        _check(
            self.position_embedding_type in POSITION_EMBEDDINGS,
            f"position_embedding_type={self.position_embedding_type!r} is not one of {POSITION_EMBEDDINGS}",
        )
        for name in ("num_query_groups", "kv_channels", "window_size"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and value >= 1), f"{name}={value!r} must be >= 1")
        G = self.num_groups
        _check(
            self.num_attention_heads % G == 0,
            f"num_attention_heads={self.num_attention_heads} is not divisible by num_query_groups={G}",
        )
        _check(0 < self.rotary_percent <= 1, f"rotary_percent={self.rotary_percent} must be in (0, 1]")
        _check(math.isfinite(self.rotary_base) and self.rotary_base > 0, f"rotary_base={self.rotary_base} must be > 0")
        if self.position_embedding_type == "rope":
            _check(
                self.rotary_dim >= 2 and self.rotary_dim % 2 == 0,
                f"the rotary dimension int(kv_channels={self.head_dim} x rotary_percent={self.rotary_percent}) = "
                f"{self.rotary_dim} must be even and at least 2",
            )
        for name in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value > 0, f"{name}={value} must be > 0")
        _check(
            self.rope_high_freq_factor > self.rope_low_freq_factor,
            f"rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
            f"rope_low_freq_factor={self.rope_low_freq_factor}",
        )
        _check(
            self.rope_original_max_position >= 1,
            f"rope_original_max_position={self.rope_original_max_position} must be >= 1",
        )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_groups(self) -> int:
        """G: key/value heads (H without grouped-query attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear if self.add_qkv_bias is None else self.add_qkv_bias

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_percent)

    @property
    def ffn_size(self) -> int:
        """F: `ffn_hidden_size`, else 4h, or with SwiGLU Megatron's int(8h/3 / 64) · 64 (the same parameters as
        4h in two matrices)."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def layer_parameters(self) -> int:
        """One layer's parameters: two norms, QKV (H + 2G heads of K), the output projection and the MLP (two
        F-wide inputs with SwiGLU), with biases where switched on."""
        D, H, G, K, F = self.hidden_size, self.num_attention_heads, self.num_groups, self.head_dim, self.ffn_size
        bias = self.add_bias_linear
        qkv = (D + self.qkv_bias) * (H + 2 * G) * K
        mlp = (2 if self.swiglu else 1) * (D + bias) * F + F * D + bias * D
        return 2 * self.norm_parameters + qkv + H * K * D + bias * D + mlp

    @property
    def norm_parameters(self) -> int:
        return self.hidden_size * (1 if self.normalization == "RMSNorm" else 2)

    @property
    def num_parameters(self) -> int:
        """Exactly the parameters of the model over the real vocabulary (as transformers counts them): embeddings,
        the layers (`layer_parameters`), the final norm and an untied output layer."""
        D, V = self.hidden_size, self.vocab_size
        position = self.max_positions * D if self.position_embedding_type == "learned_absolute" else 0
        output = V * D if self.untie_embeddings_and_output_weights else 0
        return V * D + position + self.num_layers * self.layer_parameters + self.norm_parameters + output

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        return pad_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tensor_parallel_size)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ParallelConfig:
    """PTD-P layout, with context parallelism. Devices = data · pipe · context · tensor; tensor is the innermost mesh
    axis, context the next (`parallel/mesh.py` says why)."""

    tensor_model_parallel_size: int = 1
    """t: tensor-parallel group size (within a node in the paper)."""
    pipeline_model_parallel_size: int = 1
    """p: pipeline stages."""
    data_parallel_size: int = 1
    """d: data-parallel replicas; Megatron derives it as devices / (t · p) (see `for_devices`)."""
    virtual_pipeline_stages: int = 1
    """v: model chunks per pipeline rank (interleaved schedule)."""
    pipeline_schedule: str = "1f1b"
    """A name in `SCHEDULE_SPECS`: gpipe, 1f1b, interleaved (v > 1), zb-h1, zb-v (v = 2)."""
    micro_batch_size: int = 1
    """b: samples per microbatch per data-parallel rank."""
    global_batch_size: int = 8
    """B: samples per iteration across all data-parallel ranks."""
    microbatch_group_size: int | None = None
    """G of the interleaved schedule (--microbatch-group-size-per-virtual-pipeline-stage); defaults to p."""
    sequence_parallel: bool = False
    scatter_gather: bool = True
    """Paper §4.1: send 1/t of each pipeline boundary activation per tensor rank and re-assemble it after."""
    use_distributed_optimizer: bool = False
    context_parallel_size: int = 1
    """c: the sequence split over the "context" axis, Megatron's load-balanced 2c chunks (`parallel/context.py`)."""
    cp_comm_type: str = "p2p"
    """`CP_COMM_TYPES`: p2p (a ring of K/V blocks, overlapped with the blocks' attention) or all_gather."""
    pipeline_branching: str = "auto"
    """How pipeline cells branch: "uniform" (every rank the same branch each tick; the embedding and the output
    layer run masked on all ranks, only on the ticks that need them) or "per-rank" (each rank its own branch:
    only the ranks that need them embed or run the head, idle cells run no layer), or "auto"
    (`runtime.platform.resolve_branching`: per-rank on XLA:CPU and for unit-tick schedules (1f1b, zb-h1, zb-v)
    everywhere, uniform for lockstep ones on accelerators). "per-rank" puts tensor collectives in pipe-divergent
    branches, measured correct on XLA:CPU only."""

    def __post_init__(self):
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "data_parallel_size",
            "virtual_pipeline_stages",
            "micro_batch_size",
            "global_batch_size",
            "context_parallel_size",
        ):
            value = getattr(self, name)
            _check(isinstance(value, int) and value > 0, f"{name}={value!r} must be a positive integer")
        spec = schedule_spec(self.pipeline_schedule)
        _check(self.cp_comm_type in CP_COMM_TYPES, f"cp_comm_type={self.cp_comm_type!r} is not one of {CP_COMM_TYPES}")
        _check(
            self.context_parallel_size == 1
            or self.cp_comm_type != "p2p"
            or self.pipeline_model_parallel_size == 1
            or (spec.rows == "lockstep" and self.pipeline_branching != "per-rank"),
            f"cp_comm_type='p2p' with pipeline_model_parallel_size={self.pipeline_model_parallel_size} needs a "
            f"lockstep schedule under uniform branching (the ring's collective-permute over context gives wrong "
            f"values in pipe-divergent branches on XLA:CPU), got pipeline_schedule={self.pipeline_schedule!r}, "
            f"pipeline_branching={self.pipeline_branching!r}; cp_comm_type='all_gather' runs every schedule",
        )
        _check(
            self.pipeline_branching in PIPELINE_BRANCHINGS,
            f"pipeline_branching={self.pipeline_branching!r} is not one of {PIPELINE_BRANCHINGS}",
        )
        per_step = self.micro_batch_size * self.data_parallel_size
        _check(
            self.global_batch_size % per_step == 0,
            f"global_batch_size={self.global_batch_size} is not divisible by micro_batch_size="
            f"{self.micro_batch_size} x data_parallel_size={self.data_parallel_size}",
        )
        if self.virtual_pipeline_stages > 1:
            _check(
                spec.chunks is None or spec.chunks == self.virtual_pipeline_stages,
                f"virtual_pipeline_stages={self.virtual_pipeline_stages} does not apply to pipeline_schedule="
                f"{self.pipeline_schedule!r} ({spec.chunks} chunk(s) per rank)",
            )
        _check(
            spec.rows == "lockstep" or self.pipeline_branching != "uniform" or self.pipeline_model_parallel_size == 1,
            f"pipeline_schedule={self.pipeline_schedule!r} runs different kinds (F, I, W) on different ranks in "
            f"one tick: it needs pipeline_branching='per-rank' (or 'auto'), got 'uniform'",
        )
        _check(
            self.microbatch_group_size is None or spec.grouped,
            f"microbatch_group_size={self.microbatch_group_size} applies to grouped schedules (interleaved) "
            f"only, got {self.pipeline_schedule!r}",
        )
        _check(
            self.pipeline_model_parallel_size >= spec.min_p,
            f"the {self.pipeline_schedule} schedule needs pipeline_model_parallel_size >= {spec.min_p}, got "
            f"{self.pipeline_model_parallel_size}",
        )
        if self.pipeline_model_parallel_size > 1:
            check_pipeline_request(
                self.pipeline_schedule,
                self.pipeline_model_parallel_size,
                self.virtual_pipeline_stages,
                self.num_microbatches,
                self.microbatch_group_size,
            )

    @classmethod
    def for_devices(cls, num_devices: int, **kwargs) -> ParallelConfig:
        """Megatron's rule: data-parallel size = devices / (t · p · c)."""
        t = kwargs.get("tensor_model_parallel_size", 1)
        p = kwargs.get("pipeline_model_parallel_size", 1)
        c = kwargs.get("context_parallel_size", 1)
        _check(t > 0 and p > 0, f"tensor_model_parallel_size={t} and pipeline_model_parallel_size={p} must be positive")
        _check(c > 0, f"context_parallel_size={c} must be positive")
        cp = f" x context_parallel_size={c}" if c > 1 else ""
        _check(
            t * p * c <= num_devices,
            f"tensor_model_parallel_size={t} x pipeline_model_parallel_size={p}{cp} needs {t * p * c} devices but "
            f"only num_devices={num_devices} exist (on CPU, simulate more with --fake-devices)",
        )
        _check(
            num_devices % (t * p * c) == 0,
            f"tensor_model_parallel_size={t} x pipeline_model_parallel_size={p}{cp} does not divide "
            f"num_devices={num_devices}",
        )
        return cls(data_parallel_size=num_devices // (t * p * c), **kwargs)

    @property
    def num_devices(self) -> int:
        return (
            self.data_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
            * self.tensor_model_parallel_size
        )

    @property
    def num_microbatches(self) -> int:
        """m: microbatches per pipeline per iteration = B / (b · d)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    def check_model(self, model: ModelConfig) -> None:
        """Cross-checks between the layout and the architecture (one-line errors naming the values)."""
        t, p, v = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.virtual_pipeline_stages
        _check(
            model.num_layers % (p * v) == 0,
            f"num_layers={model.num_layers} is not divisible by pipeline_model_parallel_size={p} x "
            f"virtual_pipeline_stages={v}",
        )
        _check(
            model.num_attention_heads % t == 0,
            f"num_attention_heads={model.num_attention_heads} is not divisible by tensor_model_parallel_size={t}",
        )
        _check(
            model.num_groups % t == 0,
            f"num_query_groups={model.num_groups} is not divisible by tensor_model_parallel_size={t} (each tensor "
            f"rank holds whole query groups, as in Megatron)",
        )
        _check(
            model.ffn_size % t == 0,
            f"ffn_hidden_size={model.ffn_size} is not divisible by tensor_model_parallel_size={t}",
        )
        if self.sequence_parallel:
            _check(
                model.seq_length % t == 0,
                f"seq_length={model.seq_length} is not divisible by tensor_model_parallel_size={t} "
                f"(needed by sequence parallelism)",
            )
        if self.context_parallel_size > 1:
            self._check_context(model)

    def _check_context(self, model: ModelConfig) -> None:
        """Context parallelism's rules: 2c load-balanced chunks of the sequence, each rank's S/c tokens split over
        tensor under sequence parallelism, and attention by XLA's blocks or (p2p, no window) the flash kernel
        (`parallel/context.py`)."""
        c, t = self.context_parallel_size, self.tensor_model_parallel_size
        _check(
            model.seq_length % (2 * c) == 0,
            f"seq_length={model.seq_length} is not divisible by 2 x context_parallel_size={c} (the sequence is cut "
            f"into 2c chunks, rank r holding chunks r and 2c-1-r)",
        )
        _check(
            not self.sequence_parallel or (model.seq_length // c) % t == 0,
            f"seq_length={model.seq_length} / context_parallel_size={c} is not divisible by "
            f"tensor_model_parallel_size={t} (needed by sequence parallelism)",
        )
        _check(
            model.attention_backend != "cudnn",
            f"context_parallel_size={c} needs attention_backend='xla' or 'pallas', got 'cudnn' (the ring merges "
            f"per-block log-sum-exps, which jax's cuDNN attention does not return)",
        )
        _check(
            model.attention_backend != "pallas" or self.cp_comm_type == "p2p",
            f"cp_comm_type={self.cp_comm_type!r} with context_parallel_size={c} needs attention_backend='xla', got "
            f"'pallas' (the kernel attends by the p2p ring only)",
        )
        _check(
            model.attention_backend != "pallas" or model.window_size is None,
            f"window_size={model.window_size}: a sliding window under context parallelism needs "
            f"attention_backend='xla' (cp_comm_type 'p2p' or 'all_gather'), got 'pallas' (the kernel's window has "
            f"no offset for the ring's sub-blocks)",
        )
        _check(
            self.cp_comm_type == "all_gather" or model.attention_dropout == 0.0,
            f"attention_dropout={model.attention_dropout} with context_parallel_size={c} needs "
            f"cp_comm_type='all_gather', got {self.cp_comm_type!r} (the ring's backward re-draws no masks)",
        )

    def replace(self, **changes) -> ParallelConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TrainConfig:
    """Optimizer (AdamW), learning-rate schedule and loop cadence, with Megatron's defaults where it has them."""

    train_iters: int = 200
    lr: float = 1e-3
    """Peak learning rate after warm-up."""
    min_lr: float = 0.0
    """Floor of the decay."""
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    """Iterations over which to decay (including warm-up, as Megatron counts); defaults to train_iters."""
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.01
    """Decoupled (AdamW) decay; biases and LayerNorm parameters are not decayed, as in Megatron."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (0 disables)."""
    seed: int = 1234
    recompute_granularity: str = "none"
    """none, selective (recompute attention scores) or full (recompute each layer in the backward)."""
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 10
    save_interval: int | None = None
    exit_interval: int | None = None
    """Stop when the iteration is a multiple of this, after saving a checkpoint (Megatron's --exit-interval)."""
    loss_scale: float | None = None
    """float16 only: a static loss scale; None = Megatron's dynamic scaler (the four fields below)."""
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    """Double the dynamic scale after this many iterations without overflow."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale is halved (reset when it grows), as Megatron's."""
    max_skipped_iters: int = 50
    """Stop after this many consecutive iterations skipped for non-finite loss or gradients (every precision;
    more than the 33 overflows that take the dynamic scale from 2^32 to 1)."""

    def __post_init__(self):
        _check(self.train_iters > 0, f"train_iters={self.train_iters} must be positive")
        _check(self.lr >= 0 and self.min_lr >= 0, f"lr={self.lr} and min_lr={self.min_lr} must be >= 0")
        _check(self.min_lr <= self.lr, f"min_lr={self.min_lr} is larger than lr={self.lr}")
        _check(self.lr_warmup_iters >= 0, f"lr_warmup_iters={self.lr_warmup_iters} must be >= 0")
        _check(
            self.lr_decay_style in LR_DECAY_STYLES,
            f"lr_decay_style={self.lr_decay_style!r} is not one of {LR_DECAY_STYLES}",
        )
        _check(
            self.decay_iters >= self.lr_warmup_iters,
            f"lr_decay_iters={self.decay_iters} is smaller than lr_warmup_iters={self.lr_warmup_iters}",
        )
        for name in ("lr", "min_lr", "clip_grad", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps"):
            _check(math.isfinite(getattr(self, name)), f"{name}={getattr(self, name)} must be finite")
        _check(isinstance(self.seed, int) and 0 <= self.seed < 2**32, f"seed={self.seed} must be in [0, 2**32)")
        _check(self.clip_grad >= 0, f"clip_grad={self.clip_grad} must be >= 0")
        _check(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            _check(0.0 <= getattr(self, name) < 1.0, f"{name}={getattr(self, name)} must be in [0, 1)")
        _check(self.adam_eps > 0, f"adam_eps={self.adam_eps} must be positive")
        _check(
            self.recompute_granularity in RECOMPUTE_GRANULARITIES,
            f"recompute_granularity={self.recompute_granularity!r} is not one of {RECOMPUTE_GRANULARITIES}",
        )
        for name in ("log_interval", "eval_interval"):
            _check(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be positive")
        _check(self.eval_iters >= 0, f"eval_iters={self.eval_iters} must be >= 0")
        for name in ("initial_loss_scale", "min_loss_scale", "loss_scale"):
            value = getattr(self, name)
            _check(value is None or (math.isfinite(value) and value > 0), f"{name}={value} must be positive")
        _check(
            self.min_loss_scale <= self.initial_loss_scale,
            f"min_loss_scale={self.min_loss_scale} is larger than initial_loss_scale={self.initial_loss_scale}",
        )
        for name in ("loss_scale_window", "hysteresis", "max_skipped_iters"):
            _check(getattr(self, name) > 0, f"{name}={getattr(self, name)} must be positive")
        for name in ("save_interval", "exit_interval"):
            _check(
                getattr(self, name) is None or getattr(self, name) > 0, f"{name}={getattr(self, name)} must be positive"
            )

    @property
    def decay_iters(self) -> int:
        return self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)


__all__ = [
    "ConfigError",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "pad_vocab_size",
]
