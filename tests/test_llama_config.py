"""The Llama-family switches of `ModelConfig` and `ptd-train`: the presets' parameter counts against transformers',
and bad input refused with one line and exit 2."""

import pytest

from ptd_jax.cli.train import main
from ptd_jax.config import LLAMA_PRESETS, MODEL_PRESETS

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
        (["--use-rope-scaling", "--rope-scaling-factor", "0"], "rope_scaling_factor=0.0 must be > 0"),
        (["--use-rope-scaling", "--rope-scaling-factor", "-2"], "rope_scaling_factor=-2.0 must be > 0"),
        (["--window-size", "0"], "window_size=0 must be >= 1"),
        (["--window-size", "4", "--attention-backend", "pallas"], "window_size=4 needs attention_backend='xla'"),
    ],
)
def test_bad_llama_switches_get_one_line_and_exit_2(argv, message, capsys):
    assert main(["--fake-devices", "2", "--train-iters", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
