import pytest

from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, pad_vocab_size
from ptd_jax.presets import PAPER_TABLE_1, PAPER_VOCAB_SIZE, model_preset, paper_parallel_config
from ptd_jax.perf.flops import num_params
from ptd_jax.runtime.platform import resolve_branching


def test_heads_must_divide_hidden():
    with pytest.raises(ConfigError, match=r"hidden_size=100 is not divisible by num_attention_heads=3"):
        ModelConfig(hidden_size=100, num_attention_heads=3)


def test_layers_must_divide_by_pipeline_and_virtual_stages():
    parallel = ParallelConfig(
        pipeline_model_parallel_size=2, virtual_pipeline_stages=2, pipeline_schedule="interleaved"
    )
    with pytest.raises(
        ConfigError,
        match=r"num_layers=6 is not divisible by pipeline_model_parallel_size=2 x "
        r"virtual_pipeline_stages=2",
    ):
        parallel.check_model(ModelConfig(num_layers=6))
    parallel.check_model(ModelConfig(num_layers=8))


def test_heads_and_ffn_must_divide_by_tensor_size():
    with pytest.raises(ConfigError, match=r"num_attention_heads=4 is not divisible by tensor_model_parallel_size=8"):
        ParallelConfig(tensor_model_parallel_size=8).check_model(ModelConfig(num_attention_heads=4))


def test_global_batch_must_divide_by_micro_times_data():
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size=10 is not divisible by micro_batch_size=2 x "
        r"data_parallel_size=2",
    ):
        ParallelConfig(global_batch_size=10, micro_batch_size=2, data_parallel_size=2)
    assert ParallelConfig(global_batch_size=12, micro_batch_size=2, data_parallel_size=2).num_microbatches == 3


def test_devices_must_divide_by_tensor_times_pipe():
    with pytest.raises(
        ConfigError,
        match=r"tensor_model_parallel_size=4 x pipeline_model_parallel_size=2 needs "
        r"8 devices but only num_devices=4 exist",
    ):
        ParallelConfig.for_devices(4, tensor_model_parallel_size=4, pipeline_model_parallel_size=2)
    with pytest.raises(
        ConfigError,
        match=r"tensor_model_parallel_size=3 x pipeline_model_parallel_size=1 does "
        r"not divide num_devices=4",
    ):
        ParallelConfig.for_devices(4, tensor_model_parallel_size=3)
    layout = ParallelConfig.for_devices(
        8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, global_batch_size=8
    )
    assert (layout.data_parallel_size, layout.num_devices) == (2, 8)


def test_interleaving_rules():
    with pytest.raises(ConfigError, match=r"virtual_pipeline_stages=2 does not apply to pipeline_schedule='1f1b'"):
        ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_stages=2, pipeline_schedule="1f1b")
    with pytest.raises(ConfigError, match=r"pipeline_model_parallel_size >= 2, got 1"):
        ParallelConfig(pipeline_schedule="interleaved")


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"train_iters": 0}, r"train_iters=0"),
        ({"min_lr": 1.0, "lr": 0.1}, r"min_lr=1.0 is larger than lr=0.1"),
        ({"lr_decay_style": "exp"}, r"lr_decay_style='exp'"),
        ({"lr_warmup_iters": 50, "lr_decay_iters": 10}, r"lr_decay_iters=10 is smaller than lr_warmup_iters=50"),
        ({"recompute_granularity": "some"}, r"recompute_granularity='some'"),
    ],
)
def test_train_config_errors_name_values(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        TrainConfig(**changes)


def test_errors_are_one_line():
    with pytest.raises(ConfigError) as info:
        ModelConfig(hidden_size=100, num_attention_heads=3)
    assert "\n" not in str(info.value)


def test_ffn_must_divide_by_tensor_size():
    with pytest.raises(ConfigError, match=r"ffn_hidden_size=100 is not divisible by tensor_model_parallel_size=8"):
        ParallelConfig(tensor_model_parallel_size=8).check_model(
            ModelConfig(num_attention_heads=8, ffn_hidden_size=100)
        )


def test_zero_parallel_sizes():
    with pytest.raises(
        ConfigError,
        match=r"tensor_model_parallel_size=0 and pipeline_model_parallel_size=1 must "
        r"be positive",
    ):
        ParallelConfig.for_devices(8, tensor_model_parallel_size=0)


def test_vocab_padding_is_megatrons():
    assert pad_vocab_size(257) == 384
    assert pad_vocab_size(50257) == 50304
    assert pad_vocab_size(50257, 128, 8) == 51200  # multiple of 128 * t
    assert ModelConfig(vocab_size=257).padded_vocab_size(tensor_parallel_size=4) == 512


@pytest.mark.parametrize("row", PAPER_TABLE_1, ids=[r.name for r in PAPER_TABLE_1])
def test_table1_presets_match_published_parameter_counts(row):
    """eq. (2) on our transcription of heads/hidden/layers gives the paper's published parameter count."""
    cfg = model_preset(f"paper-{row.name.lower()}")
    assert (cfg.num_attention_heads, cfg.hidden_size, cfg.num_layers) == (
        row.num_attention_heads,
        row.hidden_size,
        row.num_layers,
    )
    # GPT-2's vocabulary, padded as Megatron pads it: 128 · t, the paper's 51,200 at t = 8, at every row's t
    assert (cfg.vocab_size, cfg.padded_vocab_size(8), cfg.seq_length) == (50257, PAPER_VOCAB_SIZE, 2048)
    assert [cfg.padded_vocab_size(k) for k in (1, 2, 4)] == [50304, 50432, 50688]
    assert abs(num_params(cfg, PAPER_VOCAB_SIZE) / 1e9 - row.published_params_billion) <= 0.051
    layout = paper_parallel_config(row)
    assert layout.num_devices == row.num_gpus
    layout.check_model(cfg)


def test_other_presets():
    assert model_preset("gpt2-small").padded_vocab_size() == 50304
    assert model_preset("gpt2-small").vocab_size == model_preset("1.3b").vocab_size == 50257
    assert model_preset("1.3b").num_layers == 24
    with pytest.raises(ConfigError, match="model preset 'gpt5'"):
        model_preset("gpt5")


def test_pipeline_branching_is_checked():
    assert ParallelConfig().pipeline_branching == "auto"
    with pytest.raises(
        ConfigError, match=r"pipeline_branching='diverge' is not one of \('auto', 'uniform', 'per-rank'\)"
    ):
        ParallelConfig(pipeline_branching="diverge")


def test_auto_branching_is_per_rank_on_cpu_and_uniform_on_accelerators():
    assert resolve_branching("auto", "cpu") == "per-rank"
    assert resolve_branching("auto", "gpu") == resolve_branching("auto", "tpu") == "uniform"
    assert resolve_branching("auto") == "per-rank"  # these tests run on XLA:CPU
    assert resolve_branching("uniform", "cpu") == "uniform" and resolve_branching("per-rank", "gpu") == "per-rank"
