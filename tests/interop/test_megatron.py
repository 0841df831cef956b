"""The reference model against megatron-core's own GPTModel (the local layer spec, t = p = 1) on CPU: logits and
every gradient of the loss in float64, through `interop.to_megatron` / `from_megatron`. megatron-core and torch come
with the test extra. megatron-core allocates a few buffers on `torch.cuda.current_device()` and forks a CUDA RNG
state around attention dropout; on CPU, for these tests only, the first is pointed at "cpu" and the second (no
dropout here) is a no-op: megatron-core's math is unchanged."""

import contextlib
import dataclasses
import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from ptd_jax import model as gpt  # noqa: E402
from ptd_jax.config import ConfigError, ModelConfig  # noqa: E402
from ptd_jax.interop import from_megatron, to_megatron  # noqa: E402

V, S, B = 101, 16, 3
CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=S,
    vocab_size=V,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def megatron():
    """megatron-core initialised for one CPU process (gloo), t = p = 1; yields a float64 GPTModel builder."""
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
                approximate = "tanh" if cfg.gelu_approximate else "none"
                config = TransformerConfig(
                    num_layers=cfg.num_layers,
                    hidden_size=cfg.hidden_size,
                    num_attention_heads=cfg.num_attention_heads,
                    ffn_hidden_size=cfg.ffn_size,
                    hidden_dropout=0.0,
                    attention_dropout=0.0,
                    layernorm_epsilon=cfg.layernorm_epsilon,
                    activation_func=lambda x: torch.nn.functional.gelu(x, approximate=approximate),
                    bias_activation_fusion=False,
                    bias_dropout_fusion=False,
                    masked_softmax_fusion=False,
                    gradient_accumulation_fusion=False,
                    persist_layer_norm=False,
                    use_cpu_initialization=True,
                    params_dtype=torch.float64,
                )
                return GPTModel(
                    config,
                    get_gpt_layer_local_spec(),
                    vocab_size=vocab_rows,
                    max_sequence_length=cfg.max_positions,
                    share_embeddings_and_output_weights=True,
                    position_embedding_type="learned_absolute",
                ).double()

            yield build
        finally:
            parallel_state.destroy_model_parallel()
            if created and dist.is_initialized():
                dist.destroy_process_group()


def _params():
    """Our init with every tensor perturbed (biases and LayerNorms too), float32-exact values."""
    params = gpt.init_params(jax.random.key(0), CFG)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(
        tree, [np.asarray(x + 0.05 * jax.random.normal(k, x.shape), np.float32) for x, k in zip(leaves, keys)]
    )


def _tokens():
    return np.random.RandomState(0).randint(0, V, size=(B, S))


def _loaded(build, params):
    model = build(CFG, params["embed"]["word"].shape[0])
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(v).double() for k, v in to_megatron(params, CFG).items()}, strict=False
    )
    assert unexpected == [] and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return model


def _megatron_forward(model, tokens):
    t = torch.tensor(tokens)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]  # True = masked (Megatron's convention)
    return model(t, torch.arange(S).expand(t.shape[0], S), mask)


def test_logits_equal_megatron_cores_gptmodel(megatron):
    """float64 both sides from the same float32-exact weights (our padded embedding: megatron-core's logits over the
    padded rows are cut off); a wrong QKV row order or a 1% LayerNorm epsilon fails every test of this file."""
    params = _params()
    with torch.no_grad():
        theirs = _megatron_forward(_loaded(megatron, params), _tokens()).numpy()[..., :V]
    with jax.enable_x64(True):
        cfg64 = dataclasses.replace(CFG, dtype="float64", param_dtype="float64")
        ours = np.asarray(gpt.logits(jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params), _tokens(), cfg64))
    assert ours.shape == theirs.shape == (B, S, V) and theirs.dtype == np.float64
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)


def test_loss_gradients_equal_megatron_cores_gptmodel(megatron):
    """d(mean next-token loss)/d(every weight): ours (jax.grad, mapped to megatron-core's names by to_megatron) vs
    torch autograd through megatron-core's GPTModel. The loss is taken by hand from its float64 logits: its own
    loss casts the logits to float32 (`compute_language_model_loss`), as HF's does. The embedding is the
    unpadded one, since ours leaves padded rows out of the softmax and megatron-core's vocabulary is all its rows."""
    params = _params()
    params["embed"]["word"] = params["embed"]["word"][:V]
    tokens = _tokens()
    model = _loaded(megatron, params)
    logits = _megatron_forward(model, tokens)
    their_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), torch.tensor(tokens[:, 1:]).reshape(-1)
    )
    their_loss.backward()
    theirs = {k: p.grad.numpy() for k, p in model.named_parameters()}

    with jax.enable_x64(True):
        cfg64 = dataclasses.replace(CFG, dtype="float64", param_dtype="float64")

        def loss(p):
            return gpt.loss_sum(p, tokens[:, :-1], tokens[:, 1:], np.ones_like(tokens[:, 1:]), cfg64) / (B * (S - 1))

        value, grads = jax.value_and_grad(loss)(jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params))
        grads = jax.tree.map(lambda x: np.asarray(x, np.float64), grads)
    assert float(value) == pytest.approx(float(their_loss.detach()), rel=1e-12)
    ours = to_megatron(grads, CFG)  # float32: ours rounded once (relative 6e-8)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for name, g in ours.items():
        np.testing.assert_allclose(g, theirs[name], rtol=1e-7, atol=1e-12, err_msg=name)


def test_from_megatron_inverts_to_megatron_and_reads_megatrons_own_init(megatron):
    """to_megatron then from_megatron is bit-exact, for both layer specs' names; a GPTModel initialised by
    megatron-core itself converts to params whose logits are its logits; bad input is one line."""
    params = _params()
    params["embed"]["word"] = params["embed"]["word"][:V]  # canonical: the real vocabulary
    for spec in ("local", "transformer_engine"):
        back = from_megatron(to_megatron(params, CFG, layer_spec=spec), CFG)
        jax.tree.map(np.testing.assert_array_equal, back, params)
    padded = _params()  # a run's padded embedding comes back cut to the real vocabulary
    assert from_megatron(to_megatron(padded, CFG), CFG)["embed"]["word"].shape == (V, CFG.hidden_size)
    bf16 = {k: torch.from_numpy(v).bfloat16() for k, v in to_megatron(params, CFG).items()}  # Megatron's usual dtype
    back = from_megatron(bf16, CFG)
    np.testing.assert_array_equal(
        back["layers"]["attn"]["qkv_kernel"],
        from_megatron({k: v.float() for k, v in bf16.items()}, CFG)["layers"]["attn"]["qkv_kernel"],
    )
    torch.manual_seed(0)
    model = megatron(CFG, V).float()
    with torch.no_grad():
        theirs = _megatron_forward(model, _tokens()).numpy()
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    ours = np.asarray(gpt.logits(from_megatron(state, CFG), _tokens(), CFG))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    state = to_megatron(params, CFG)
    with pytest.raises(ConfigError, match="has no tensor 'decoder.layers.1.mlp.linear_fc2.bias'"):
        from_megatron({k: v for k, v in state.items() if k != "decoder.layers.1.mlp.linear_fc2.bias"}, CFG)
    with pytest.raises(ConfigError, match="output_layer.weight is not tied"):
        from_megatron({**state, "output_layer.weight": state["embedding.word_embeddings.weight"] + 1}, CFG)
    with pytest.raises(ConfigError, match="layer_spec='te' is not one of"):
        to_megatron(params, CFG, layer_spec="te")
