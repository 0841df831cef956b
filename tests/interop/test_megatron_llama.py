"""`interop.to_megatron` / `from_megatron` for the Llama switches against megatron-core's own GPTModel (the local
layer spec, t = p = 1) on CPU: RMSNorm, SwiGLU, RoPE (half-split, interleaved, Llama 3.1's scaling), grouped-query
attention, kv_channels, an untied output layer, no linear biases, QKV biases only (Qwen2). float32 both sides:
megatron-core computes its rotary frequencies in float32 whatever the params dtype, so a float64 comparison would
only measure that. Set up as tests/interop/test_megatron.py (gloo, world size 1, buffers on "cpu", no CUDA RNG
fork)."""

import contextlib
import dataclasses
import socket

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from ptd_jax import model as gpt  # noqa: E402
from ptd_jax.config import ConfigError, ModelConfig  # noqa: E402
from ptd_jax.interop import from_megatron, to_megatron  # noqa: E402
from ptd_jax.presets import LLAMA_SWITCHES  # noqa: E402

V, S, B = 101, 16, 3
LLAMA = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=48,
    seq_length=S,
    vocab_size=V,
    **LLAMA_SWITCHES,
    layernorm_epsilon=1e-6,
)
CASES = {
    "llama": LLAMA,
    "qwen2": dataclasses.replace(LLAMA, add_qkv_bias=True, rotary_base=1e6),
    "interleaved_partial": dataclasses.replace(LLAMA, rotary_interleaved=True, rotary_percent=0.5),
    "llama31_scaling": dataclasses.replace(LLAMA, use_rope_scaling=True, rope_scaling_factor=8.0, rotary_base=5e5),
    "mha_biases": dataclasses.replace(LLAMA, num_query_groups=None, kv_channels=None, add_bias_linear=True),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def megatron():
    """megatron-core initialised for one CPU process (gloo), t = p = 1; yields a float32 GPTModel builder."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        if created:
            patch.setenv("MASTER_ADDR", "127.0.0.1")
            patch.setenv("MASTER_PORT", str(_free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        try:
            parallel_state.initialize_model_parallel(1, 1)
            patch.setattr(tensor_parallel.get_cuda_rng_tracker(), "fork", lambda *a, **k: contextlib.nullcontext())

            def build(cfg: ModelConfig, vocab_rows: int):
                config = TransformerConfig(
                    num_layers=cfg.num_layers,
                    hidden_size=cfg.hidden_size,
                    num_attention_heads=cfg.num_attention_heads,
                    num_query_groups=cfg.num_query_groups,
                    kv_channels=cfg.kv_channels,
                    ffn_hidden_size=cfg.ffn_size,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                    normalization=cfg.normalization,
                    layernorm_epsilon=cfg.layernorm_epsilon,
                    gated_linear_unit=cfg.swiglu,
                    activation_func=torch.nn.functional.silu,
                    add_bias_linear=cfg.add_bias_linear,
                    add_qkv_bias=cfg.qkv_bias,
                    rotary_interleaved=cfg.rotary_interleaved,
                    apply_rope_fusion=False,
                    bias_activation_fusion=False,
                    bias_dropout_fusion=False,
                    masked_softmax_fusion=False,
                    gradient_accumulation_fusion=False,
                    persist_layer_norm=False,
                    use_cpu_initialization=True,
                    params_dtype=torch.float32,
                )
                return GPTModel(
                    config,
                    get_gpt_layer_local_spec(normalization=cfg.normalization),
                    vocab_size=vocab_rows,
                    max_sequence_length=cfg.max_positions,
                    share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
                    position_embedding_type=cfg.position_embedding_type,
                    rotary_percent=cfg.rotary_percent,
                    rotary_base=cfg.rotary_base,
                    rope_scaling=cfg.use_rope_scaling,
                    rope_scaling_factor=cfg.rope_scaling_factor,
                ).float()

            yield build
        finally:
            parallel_state.destroy_model_parallel()
            if created and dist.is_initialized():
                dist.destroy_process_group()


def _params(cfg):
    """Our init with every tensor perturbed (norm scales and biases too), canonical (the real vocabulary)."""
    params = gpt.init_params(jax.random.key(0), cfg)
    params["embed"]["word"] = params["embed"]["word"][:V]
    if "output" in params:
        params["output"]["word"] = params["output"]["word"][:V]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(
        tree, [np.asarray(x + 0.05 * jax.random.normal(k, x.shape), np.float32) for x, k in zip(leaves, keys)]
    )


def _tokens():
    return np.random.RandomState(0).randint(0, V, size=(B, S))


def _loaded(build, params, cfg):
    model = build(cfg, V)
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in to_megatron(params, cfg).items()}, strict=False
    )
    assert unexpected == [] and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return model


def _megatron_forward(model, tokens):
    t = torch.tensor(tokens)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]  # True = masked (Megatron's convention)
    return model(t, torch.arange(S).expand(t.shape[0], S), mask)


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_equal_megatron_cores_gptmodel(megatron, name):
    """float32 both sides from the same weights; a wrong GQA row order, [gate; up] order or RoPE layout fails."""
    cfg = CASES[name]
    params = _params(cfg)
    with torch.no_grad():
        theirs = _megatron_forward(_loaded(megatron, params, cfg), _tokens()).numpy()
    ours = np.asarray(gpt.logits(params, _tokens(), cfg))
    assert ours.shape == theirs.shape == (B, S, V)
    print(f"{name}: max |dlogit| = {np.abs(ours - theirs).max():.3g}")
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_from_megatron_inverts_to_megatron(megatron, name):
    """Bit-exact round trip for both layer specs' names, and megatron-core's own init read back to its logits."""
    cfg = CASES[name]
    params = _params(cfg)
    for spec in ("local", "transformer_engine"):
        state = to_megatron(params, cfg, layer_spec=spec)
        assert "embedding.position_embeddings.weight" not in state and "output_layer.weight" in state
        assert not any(k.endswith("layernorm.bias") or k.endswith("layer_norm_bias") for k in state)
        back = from_megatron(state, cfg)
        assert jax.tree.structure(back) == jax.tree.structure(params)
        jax.tree.map(np.testing.assert_array_equal, back, params)
    torch.manual_seed(0)
    model = megatron(cfg, V)
    with torch.no_grad():
        for p in model.parameters():  # megatron-core inits norms to 1 and biases to 0: perturb them all
            p.add_(0.05 * torch.randn_like(p))
        theirs = _megatron_forward(model, _tokens()).numpy()
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    ours = np.asarray(gpt.logits(from_megatron(state, cfg), _tokens(), cfg))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)


def test_refusals_are_one_line():
    params = _params(LLAMA)
    state = to_megatron(params, LLAMA)
    with pytest.raises(ConfigError, match="does not convert window_size=8"):
        to_megatron(params, dataclasses.replace(LLAMA, window_size=8))
    with pytest.raises(ConfigError, match="does not convert window_size=8"):
        from_megatron(state, dataclasses.replace(LLAMA, window_size=8))
    odd = dataclasses.replace(LLAMA, use_rope_scaling=True, rope_high_freq_factor=2.0)
    with pytest.raises(ConfigError, match="fixes low/high/original to 1/4/8192, not rope_high_freq_factor=2.0"):
        to_megatron(params, odd)
    with pytest.raises(ConfigError, match="has no tensor 'output_layer.weight'"):
        from_megatron({k: v for k, v in state.items() if k != "output_layer.weight"}, LLAMA)
    with pytest.raises(ConfigError, match="linear_qkv.weight"):  # a GQA state read as MHA: wrong shape
        from_megatron(state, dataclasses.replace(LLAMA, num_query_groups=None))
