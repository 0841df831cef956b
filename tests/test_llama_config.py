"""The Llama-family switches of `ModelConfig` and `ptd-train`: the presets' parameter counts against transformers',
and bad input refused with one line and exit 2."""

import pytest

from ptd_jax.cli.train import main
from ptd_jax.presets import LLAMA_PRESETS, MODEL_PRESETS

PUBLISHED = {  # transformers' num_parameters() of the published configs
    "llama2-7b": 6_738_415_616,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
    "gpt2-small": 124_439_808,
}


def test_the_presets_have_the_published_parameter_counts():
    assert set(LLAMA_PRESETS) <= set(PUBLISHED)
    assert {name: MODEL_PRESETS[name].num_parameters for name in PUBLISHED} == PUBLISHED


def test_swiglu_without_a_width_takes_megatrons_two_thirds():
    """Megatron's default F for SwiGLU: int(8h/3 / 64) · 64, the parameters of a 4h GeLU MLP in three matrices."""
    from ptd_jax.config import ModelConfig

    assert ModelConfig(hidden_size=128, swiglu=True).ffn_size == 320
    assert ModelConfig(hidden_size=128).ffn_size == 512 and ModelConfig(ffn_hidden_size=7, swiglu=True).ffn_size == 7


@pytest.mark.parametrize(
    "flags, cuda, want",
    [
        (["--model-preset", "mistral-7b"], True, "pallas"),  # float32: cuDNN takes float16/bfloat16 only
        (["--model-preset", "mistral-7b", "--bf16"], True, "cudnn"),  # the sliding window included
        (["--model-preset", "llama3-8b", "--bf16"], True, "cudnn"),
        (["--model-preset", "llama3-8b", "--bf16"], False, "pallas"),  # a ROCm GPU: no cuDNN
        (["--model-preset", "llama3-8b", "--bf16", "--kv-channels", "320"], True, "pallas"),  # over 256 (128 off-GPU)
        (["--model-preset", "llama3-8b", "--bf16", "--context-parallel-size", "2"], True, "pallas"),  # kernel ring
        (
            ["--model-preset", "llama3-8b", "--bf16", "--context-parallel-size", "2", "--cp-comm-type", "all_gather"],
            True,
            "xla",
        ),
        (["--model-preset", "mistral-7b", "--bf16", "--context-parallel-size", "2"], True, "xla"),  # the window
        (["--model-preset", "llama3-8b", "--bf16", "--attention-backend", "xla"], True, "xla"),
        (["--model-preset", "llama3-8b", "--bf16", "--attention-dropout", "0.1"], True, "xla"),  # no kernel has it
    ],
)
def test_the_default_attention_on_a_gpu(monkeypatch, flags, cuda, want):
    """Without --attention-backend a GPU run attends by cuDNN where jax's cuDNN path takes the model (faster than
    the Pallas kernel on an H200), else by the Pallas flash kernel (the sliding window included); under context
    parallelism by the ring on the Pallas kernel (XLA's blocks for all_gather or a window); `--compile-only` and
    `ptd-plan predict` resolve it the same way for an NVIDIA target."""
    from ptd_jax.cli.train import build_parser, checks, model_config_from_args
    from ptd_jax.cli.train.configs import configs_for_target, fill_defaults
    from ptd_jax.runtime import platform

    monkeypatch.setattr(platform, "gpu_present", lambda: True)
    monkeypatch.setattr(platform, "cuda_gpu_present", lambda: cuda)
    monkeypatch.setattr(checks, "local_gpu_capability", lambda: (9, 0))
    args = build_parser().parse_args(flags)
    assert model_config_from_args(args).attention_backend == want
    if want == "cudnn":  # cuDNN's flash attention needs Ampere: a T4 gets the Pallas kernel
        monkeypatch.setattr(checks, "local_gpu_capability", lambda: (7, 5))
        assert model_config_from_args(build_parser().parse_args(flags)).attention_backend == "pallas"
    if cuda:
        monkeypatch.setattr(platform, "gpu_present", lambda: False)
        args = build_parser().parse_args(flags)
        fill_defaults(args)
        assert configs_for_target(args)[0].attention_backend == want


@pytest.mark.parametrize("name", ["llama3.2-1b", "qwen2.5-7b", "mistral-7b"])
def test_the_count_equals_transformers_on_the_same_config(name):
    """Built on torch's meta device (no memory), counted by transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = MODEL_PRESETS[name]
    kind, extra = {
        "llama3.2-1b": (transformers.LlamaConfig, {}),
        "qwen2.5-7b": (transformers.Qwen2Config, {}),
        "mistral-7b": (transformers.MistralConfig, {"sliding_window": cfg.window_size}),
    }[name]
    hf = kind(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_groups,
        head_dim=cfg.head_dim,
        tie_word_embeddings=not cfg.untie_embeddings_and_output_weights,
        **extra,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert model.num_parameters() == cfg.num_parameters


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-query-groups", "2"], "num_query_groups=2 needs --group-query-attention"),
        (["--group-query-attention", "--num-query-groups", "3"], "num_attention_heads=4 is not divisible by num_query"),
        (
            ["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"],
            "num_query_groups=1 is not divisible by tensor_model_parallel_size=2",
        ),
        (["--position-embedding-type", "rope", "--kv-channels", "3"], "= 3 must be even"),
        (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "rotary_percent=1.5 must be in (0, 1]"),
        (["--position-embedding-type", "rope", "--rotary-percent", "0"], "rotary_percent=0.0 must be in (0, 1]"),
        (
            ["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "0"],
            "rope_scaling_factor=0.0 must be > 0",
        ),
        (
            ["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor", "-2"],
            "rope_scaling_factor=-2.0 must be > 0",
        ),
        (["--window-size", "0"], "window_size=0 must be >= 1"),
        (["--rotary-base", "5"], "rotary_base=5.0 needs --position-embedding-type rope"),
    ],
)
def test_bad_llama_switches_get_one_line_and_exit_2(argv, message, capsys):
    assert main(["--train-iters", "1", *argv]) == 2  # refused before anything starts (this process's devices)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
