"""The Llama family against Hugging Face's own implementations (issue "Llama family", interop): tiny random
LlamaForCausalLM (grouped-query attention, Llama 3.1 RoPE scaling, untied output), Qwen2ForCausalLM (QKV biases, tied)
and MistralForCausalLM (a sliding window shorter than the sequence, head_dim != hidden / heads) through
`interop.from_hf` / `to_hf` and `ptd-convert`: logits in float32 within 1e-5, to_hf folders that transformers loads
with every key matched, greedy generation token for token. transformers and torch come with the test extra."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ptd_jax import model as gpt  # noqa: E402
from ptd_jax.config import ConfigError, ModelConfig  # noqa: E402
from ptd_jax.interop import from_hf, model_config_from_hf, to_hf  # noqa: E402

V, S = 101, 24
COMMON = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=V,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    attention_dropout=0.0,
)
CASES = {
    # (a) GQA (4 query heads on 2 key/value heads), Llama 3.1 scaling, untied output. head_dim 8 rotates at
    # wavelengths 2π·10^{0,1,2,3}/... = 6.3, 63, 628, 6283: with original_max_position_embeddings 64 and factors 1
    # and 4, the first is kept (< 16), the second interpolated (16..64), the last two divided by the factor (> 64)
    "llama": (
        "LlamaForCausalLM",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # (b) biases on q, k and v only, tied output
    "qwen2": ("Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0)),
    # (c) a window of 5 on 24 tokens, head_dim 12 (hidden / heads = 8), one key/value head for all four queries
    "mistral": (
        "MistralForCausalLM",
        dict(num_key_value_heads=1, head_dim=12, sliding_window=5, tie_word_embeddings=False, rope_theta=10000.0),
    ),
}


def _config(kind):
    architecture, fields = CASES[kind]
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}.get(
        kind, transformers.MistralConfig
    )
    return architecture, config_class(**COMMON, **fields)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(kind, folder) of a random model of each kind: every tensor perturbed (norm scales and biases included)."""
    kind = request.param
    architecture, config = _config(kind)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path, safe_serialization=True)
    return kind, path


def _tokens(batch=3, length=S):
    return np.random.RandomState(0).randint(0, V, size=(batch, length))


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _their_logits(path, tokens):
    with torch.no_grad():
        return _hf(path)(torch.tensor(tokens)).logits.numpy()


def _our_logits(params, cfg, tokens):
    return np.asarray(gpt.logits(jax.tree.map(jnp.asarray, params), tokens, cfg))


def test_config_maps_every_switch(case):
    kind, path = case
    cfg, params = from_hf(path)
    want = {
        "llama": dict(
            num_query_groups=2,
            kv_channels=None,
            untie_embeddings_and_output_weights=True,
            add_bias_linear=False,
            add_qkv_bias=False,
            window_size=None,
            use_rope_scaling=True,
            rope_scaling_factor=8.0,
            rope_low_freq_factor=1.0,
            rope_high_freq_factor=4.0,
            rope_original_max_position=64,
            rotary_base=10000.0,
        ),
        "qwen2": dict(
            num_query_groups=2,
            untie_embeddings_and_output_weights=False,
            add_bias_linear=False,
            add_qkv_bias=True,
            window_size=None,
            use_rope_scaling=False,
            rotary_base=1e6,
        ),
        "mistral": dict(
            num_query_groups=1,
            kv_channels=12,
            untie_embeddings_and_output_weights=True,
            add_bias_linear=False,
            add_qkv_bias=False,
            window_size=5,
            use_rope_scaling=False,
        ),
    }[kind]
    assert {k: getattr(cfg, k) for k in want} == want
    common = (cfg.normalization, cfg.swiglu, cfg.position_embedding_type, cfg.rotary_interleaved)
    assert common == ("RMSNorm", True, "rope", False)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.ffn_hidden_size) == (2, 32, 4, 48)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.seq_length, cfg.layernorm_epsilon) == (V, 128, 128, 1e-5)
    assert ("output" in params) == cfg.untie_embeddings_and_output_weights
    assert ("qkv_bias" in params["layers"]["attn"]) == (kind == "qwen2")


def test_logits_equal_transformers(case):
    """float32 on both sides within 1e-5 of each other; and each case's special switch matters (without it the
    logits are far off), so the agreement is not vacuous."""
    kind, path = case
    cfg, params = from_hf(path)
    tokens = _tokens()
    theirs = _their_logits(path, tokens)
    ours = _our_logits(params, cfg, tokens)
    assert ours.shape == theirs.shape == (3, S, V)
    print(f"{kind}: max |logit difference| = {np.abs(ours - theirs).max():.3g}")
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
    without = {"llama": {"use_rope_scaling": False}, "qwen2": {}, "mistral": {"window_size": None}}[kind]
    if without:
        assert np.abs(_our_logits(params, cfg.replace(**without), tokens) - theirs).max() > 1e-3
    if kind == "qwen2":
        no_bias = jax.tree.map(np.zeros_like, params["layers"]["attn"]["qkv_bias"])
        altered = {**params, "layers": {**params["layers"], "attn": {**params["layers"]["attn"], "qkv_bias": no_bias}}}
        assert np.abs(_our_logits(altered, cfg, tokens) - theirs).max() > 1e-3


def test_to_hf_loads_in_transformers_with_the_same_weights_and_logits(case, tmp_path):
    kind, path = case
    cfg, params = from_hf(path)
    to_hf(params, cfg, tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == [CASES[kind][0]] and config["model_type"] == kind
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == CASES[kind][0]
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original = _hf(path).state_dict()
    back = model.state_dict()
    assert set(original) == set(back)
    for name in original:
        assert torch.equal(original[name], back[name]), name
    tokens = _tokens()
    with torch.no_grad():
        theirs = model.eval()(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(_our_logits(params, cfg, tokens), theirs, rtol=0, atol=1e-5)
    assert from_hf(tmp_path / "back")[0] == cfg


def test_greedy_generation_equals_transformers_generate(case):
    from ptd_jax.inference.generate import generate

    kind, path = case
    cfg, params = from_hf(path)
    prompt = _tokens(batch=2, length=4)
    ours = generate(params, prompt, cfg, 12)  # 16 positions: past Mistral's window of 5
    with torch.no_grad():
        theirs = (
            _hf(path)
            .generate(
                torch.tensor(prompt),
                attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                max_new_tokens=12,
                do_sample=False,
                num_beams=1,
                eos_token_id=None,
                pad_token_id=0,
            )
            .numpy()
        )
    np.testing.assert_array_equal(ours, theirs)


def test_ptd_convert_round_trips_bit_exactly(case, tmp_path, capsys):
    from ptd_jax.cli.convert import main as convert
    from ptd_jax.train.checkpoint import read_params

    kind, path = case
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert convert(["from-hf", "--input", str(path), "--output", str(ckpt)]) == 0
    assert convert(["to-hf", "--input", str(ckpt), "--output", str(back)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[-1])["architecture"] == CASES[kind][0]
    original, converted = _hf(path).state_dict(), _hf(back).state_dict()
    assert set(original) == set(converted)
    for name in original:
        assert torch.equal(original[name], converted[name]), name
    assert read_params(ckpt)[0] == from_hf(path)[0]


# ---------------------------------------------------------------------------------------------------------------
# config.json spellings and refusals
# ---------------------------------------------------------------------------------------------------------------


def _llama_config_json() -> dict:
    _, config = _config("llama")
    return json.loads(config.to_json_string())


def _v4_and_v5(config: dict) -> tuple[dict, dict]:
    """The same RoPE in transformers v4's spelling (`rope_theta` + `rope_scaling`) and v5's (`rope_parameters`)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", config.get("rope_theta"))
    base = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    v4 = base | {"rope_theta": theta, "rope_scaling": rope or None}
    v5 = base | {"rope_parameters": rope | {"rope_theta": theta}}
    return v4, v5


def test_v5_rope_parameters_parse_as_v4_rope_scaling():
    v4, v5 = _v4_and_v5(_llama_config_json())
    assert "rope_parameters" not in v4 and "rope_scaling" not in v5 and "rope_theta" not in v5
    assert model_config_from_hf(v4) == model_config_from_hf(v5)
    assert model_config_from_hf(v5).use_rope_scaling and model_config_from_hf(v5).rope_original_max_position == 64
    # the old key "type", and a "default" rope, too
    old = v4 | {"rope_scaling": {k if k != "rope_type" else "type": v for k, v in v4["rope_scaling"].items()}}
    assert model_config_from_hf(old) == model_config_from_hf(v4)
    plain4, plain5 = v4 | {"rope_scaling": None}, v5 | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert not model_config_from_hf(plain4).use_rope_scaling
    assert model_config_from_hf(plain4) == model_config_from_hf(plain5)


def test_rope_scaling_changes_the_frequencies():
    """The llama3 case's numbers scale some frequencies, keep others (the test above is not vacuous)."""
    cfg = model_config_from_hf(_llama_config_json())
    scaled, plain = (np.asarray(gpt.rotary_frequencies(c)) for c in (cfg, cfg.replace(use_rope_scaling=False)))
    assert scaled[0] == plain[0] and scaled[-1] == pytest.approx(plain[-1] / 8) and plain[1] / 8 < scaled[1] < plain[1]


def _write(tmp_path, config: dict):
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["rope_parameters"].update(rope_type="yarn"), "rope_type='yarn'"),
        (lambda d: d.update(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}), "'linear'"),
        (
            lambda d: d.update(model_type="falcon", architectures=["FalconForCausalLM"]),
            "model_type='falcon' architectures=['FalconForCausalLM']; only GPT-2",
        ),
        (lambda d: d.update(architectures=["LlamaForSequenceClassification"]), "LlamaForSequenceClassification"),
        (lambda d: d.update(hidden_act="gelu"), "hidden_act='gelu'"),
        (lambda d: d.update(mlp_bias=True), "mlp_bias=True with attention_bias=False"),
        (lambda d: d.pop("num_hidden_layers"), "lacks the integer fields ['num_hidden_layers']"),
        (lambda d: d.update(num_key_value_heads=3), "num_attention_heads=4 is not divisible by num_query_groups=3"),
    ],
)
def test_a_config_that_does_not_convert_is_one_line(tmp_path, capsys, change, message):
    from ptd_jax.cli.convert import main as convert

    config = _llama_config_json()
    change(config)
    folder = _write(tmp_path, config)
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        from_hf(folder)
    assert "\n" not in str(err.value)
    assert convert(["from-hf", "--input", str(folder), "--output", str(tmp_path / "out")]) == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and message in stderr
    assert not (tmp_path / "out").exists()


def test_qwen2_windows_on_some_layers_only_are_refused(tmp_path):
    _, config = _config("qwen2")
    config = json.loads(config.to_json_string())
    config |= {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None}
    with pytest.raises(ConfigError, match=re.escape("sliding windows on some layers only")):
        model_config_from_hf(config)
    assert model_config_from_hf(config | {"max_window_layers": 0}).window_size == 8
    assert model_config_from_hf(config | {"use_sliding_window": False}).window_size is None


# ---------------------------------------------------------------------------------------------------------------
# ptd_jax models HF reads: interleaved RoPE, biases HF's architecture lacks, bfloat16 shards
# ---------------------------------------------------------------------------------------------------------------


def _random_params(cfg, seed=0):
    params = gpt.init_params(jax.random.key(seed), cfg)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return jax.tree.map(np.asarray, jax.tree.unflatten(tree, noisy))


LLAMA_CFG = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    seq_length=S,
    vocab_size=V,
    ffn_hidden_size=48,
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
)


# The default run: the first (Meta's rotation); -m slow: the rest (each architecture's to_hf runs by default in
# test_to_hf_loads_in_transformers_with_the_same_weights_and_logits above)
@pytest.mark.parametrize(
    "changes, architecture",
    [
        ({"rotary_interleaved": True}, "LlamaForCausalLM"),  # Meta's pairs, permuted into HF's halves
        pytest.param(
            {"rotary_interleaved": True, "add_qkv_bias": True, "window_size": 7},
            "Qwen2ForCausalLM",
            marks=pytest.mark.slow,
        ),
        pytest.param({"add_bias_linear": True}, "LlamaForCausalLM", marks=pytest.mark.slow),  # attention and mlp bias
        # q, k, v biases written as zero
        pytest.param({"add_bias_linear": True, "add_qkv_bias": False}, "LlamaForCausalLM", marks=pytest.mark.slow),
        pytest.param({"window_size": 7, "kv_channels": 12}, "MistralForCausalLM", marks=pytest.mark.slow),
    ],
)
def test_to_hf_of_ptd_jax_models(tmp_path, changes, architecture):
    cfg = LLAMA_CFG.replace(**changes)
    params = _random_params(cfg)
    to_hf(params, cfg, tmp_path / "hf")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == architecture
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = _tokens()
    with torch.no_grad():
        theirs = model.eval()(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(_our_logits(params, cfg, tokens), theirs, rtol=0, atol=1e-5)
    back_cfg, back = from_hf(tmp_path / "hf")  # and back: the same function (interleaving became HF's halves)
    np.testing.assert_allclose(_our_logits(back, back_cfg, tokens), theirs, rtol=0, atol=1e-5)


def test_llama_attention_bias_without_mlp_bias_converts_where_o_bias_is_zero(tmp_path):
    """Qwen2's biases written as a Llama (zero o_proj bias) convert back to add_qkv_bias; a nonzero one is refused."""
    from safetensors.numpy import load_file, save_file

    cfg = LLAMA_CFG.replace(add_qkv_bias=True)
    to_hf(_random_params(cfg), cfg, tmp_path / "m", architecture="LlamaForCausalLM")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["attention_bias"], config["mlp_bias"]) == (True, False)
    back = from_hf(tmp_path / "m")[0]
    assert (back.add_bias_linear, back.add_qkv_bias) == (False, True)
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.bias"] += 1.0
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ConfigError, match="o_proj.bias is not zero"):
        from_hf(tmp_path / "m")


@pytest.mark.parametrize(
    "changes, architecture, message",
    [
        ({"window_size": 7}, "LlamaForCausalLM", "LlamaForCausalLM cannot hold window_size=7"),
        ({"add_qkv_bias": True}, "MistralForCausalLM", "Mistral has no biases"),
        ({"add_bias_linear": True}, "Qwen2ForCausalLM", "Qwen2 has biases on q, k and v only"),
        ({"rotary_percent": 0.5}, None, "rotary_percent=0.5"),
        ({}, "GPT2LMHeadModel", "GPT2LMHeadModel cannot hold normalization='RMSNorm'"),
        ({}, "FalconForCausalLM", "architecture='FalconForCausalLM' is not one of"),
    ],
)
def test_to_hf_refuses_what_the_architecture_cannot_hold(tmp_path, changes, architecture, message):
    cfg = LLAMA_CFG.replace(**changes)
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        to_hf(_random_params(cfg), cfg, tmp_path / "hf", architecture=architecture)
    assert "\n" not in str(err.value) and not (tmp_path / "hf").exists()


def test_bfloat16_shards_read_as_transformers_reads_them(case, tmp_path):
    """A bfloat16 model saved in shards (model.safetensors.index.json), as real checkpoints come: the same logits as
    transformers' float32 upcast of it."""
    kind, path = case
    _hf(path).to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    assert len(list((tmp_path / "bf16").glob("model-*.safetensors"))) > 1
    cfg, params = from_hf(tmp_path / "bf16")
    tokens = _tokens()
    np.testing.assert_allclose(
        _our_logits(params, cfg, tokens), _their_logits(tmp_path / "bf16", tokens), rtol=0, atol=1e-5
    )
