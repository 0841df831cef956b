"""Named models and layouts: the paper's Table 1 rows, GPT-2 shapes, the Llama family (Llama 2 and 3, Mistral,
Qwen2.5) with Megatron's switches for them, and `--model-preset`'s table. Configuration types and their checks live
in `config.py`."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig


@dataclass(frozen=True)
class PaperRow:
    """One row of the paper's Table 1 as published (weak-scaling runs on A100s)."""

    name: str
    num_attention_heads: int
    hidden_size: int
    num_layers: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    num_gpus: int
    global_batch_size: int
    published_params_billion: float
    published_tflops_per_gpu: float


# Table 1 of arXiv 2104.04473 (vocabulary 51,200, sequence length 2,048 for all rows).
PAPER_TABLE_1: tuple[PaperRow, ...] = (
    PaperRow("1.7B", 24, 2304, 24, 1, 1, 32, 512, 1.7, 137),
    PaperRow("3.6B", 32, 3072, 30, 2, 1, 64, 512, 3.6, 138),
    PaperRow("7.5B", 32, 4096, 36, 4, 1, 128, 512, 7.5, 142),
    PaperRow("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 18.4, 135),
    PaperRow("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 39.1, 138),
    PaperRow("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 76.1, 140),
    PaperRow("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 145.6, 148),
    PaperRow("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 310.1, 155),
    PaperRow("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 529.6, 163),
    PaperRow("1T", 160, 25600, 128, 8, 64, 3072, 3072, 1008.0, 163),
)

GPT2_VOCAB_SIZE = 50257
"""GPT-2's BPE vocabulary (`--tokenizer-type GPT2BPETokenizer` on its vocab.json), the paper's tokenizer."""
PAPER_VOCAB_SIZE = 51200
"""Table 1's V: GPT-2's 50,257 padded to a multiple of 1024 = 128 · 8 (Megatron's rule at t = 8)."""
PAPER_SEQ_LENGTH = 2048


def _paper_preset(row: PaperRow) -> ModelConfig:
    """The row's model: GPT-2's 50,257, padded as Megatron pads it (a multiple of 128 · t: 50,304 at t = 1, the
    paper's 51,200 at t = 8). Table 1's formulas use the paper's V, `PAPER_VOCAB_SIZE`."""
    return ModelConfig(
        num_layers=row.num_layers,
        hidden_size=row.hidden_size,
        num_attention_heads=row.num_attention_heads,
        seq_length=PAPER_SEQ_LENGTH,
        vocab_size=GPT2_VOCAB_SIZE,
    )


LLAMA_SWITCHES = MappingProxyType(
    dict(
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
    )
)
"""Megatron's switches that make its GPT a Llama (with `num_query_groups` for grouped-query attention)."""


def _llama(layers, hidden, heads, groups, ffn, vocab, seq, **switches) -> ModelConfig:
    """A Llama-family model: RMSNorm, SwiGLU, RoPE, grouped-query attention, untied output, no biases (Megatron's
    switches for Llama; the shapes are the published configs' on the Hugging Face Hub)."""
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        seq_length=seq,
        **{**LLAMA_SWITCHES, **switches},
    )


LLAMA3_VOCAB_SIZE = 128256
LLAMA3_1_SCALING = dict(use_rope_scaling=True, rope_scaling_factor=8.0)
LLAMA3_2_SCALING = dict(use_rope_scaling=True, rope_scaling_factor=32.0, untie_embeddings_and_output_weights=False)
"""Llama 3.2 1B and 3B: RoPE scaled by 32, and the output layer tied to the embedding."""
LLAMA_PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096, rotary_base=1e4),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, LLAMA3_VOCAB_SIZE, 8192, rotary_base=5e5),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, LLAMA3_VOCAB_SIZE, 8192, rotary_base=5e5),
    "llama3.1-405b": _llama(126, 16384, 128, 8, 53248, LLAMA3_VOCAB_SIZE, 8192, rotary_base=5e5, **LLAMA3_1_SCALING),
    "llama3.2-1b": _llama(16, 2048, 32, 8, 8192, LLAMA3_VOCAB_SIZE, 8192, rotary_base=5e5, **LLAMA3_2_SCALING),
    "llama3.2-3b": _llama(
        28, 3072, 24, 8, 8192, LLAMA3_VOCAB_SIZE, 8192, rotary_base=5e5, kv_channels=128, **LLAMA3_2_SCALING
    ),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, 32000, 8192, rotary_base=1e4, window_size=4096),  # v0.1
    "qwen2.5-7b": _llama(
        28, 3584, 28, 4, 18944, 152064, 8192, rotary_base=1e6, add_qkv_bias=True, layernorm_epsilon=1e-6
    ),
}
"""seq_length is the training sequence (Megatron's --seq-length), 4096 or 8192, not the models' longest context."""


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Small enough to train to a visibly falling loss on a 2-core CPU in a few minutes.
    "tiny": ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=257),
    "gpt2-small": ModelConfig(
        num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024, vocab_size=GPT2_VOCAB_SIZE
    ),
    "1.3b": ModelConfig(
        num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=GPT2_VOCAB_SIZE
    ),
    **{f"paper-{row.name.lower()}": _paper_preset(row) for row in PAPER_TABLE_1},
    **LLAMA_PRESETS,
}


def model_preset(name: str) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"model preset {name!r} is not one of {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


def paper_parallel_config(row: PaperRow, micro_batch_size: int = 1) -> ParallelConfig:
    """The layout a Table 1 row was run with (interleaving aside)."""
    return ParallelConfig.for_devices(
        row.num_gpus,
        tensor_model_parallel_size=row.tensor_model_parallel_size,
        pipeline_model_parallel_size=row.pipeline_model_parallel_size,
        micro_batch_size=micro_batch_size,
        global_batch_size=row.global_batch_size,
    )
