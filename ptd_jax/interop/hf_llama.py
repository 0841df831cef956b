"""Hugging Face Llama, Mistral and Qwen2 <-> ptd_jax: the config and tensor mapping that `interop/hf.py` runs for
LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM folders (numpy only).

The three are one transformer (RMSNorm, SwiGLU, rotary embeddings in HF's `rotate_half` form, grouped-query
attention, an output layer of its own unless tied) told apart by biases and the attention window:
- Llama: `attention_bias` puts biases on q, k, v *and* o, `mlp_bias` on gate, up and down; no window.
- Mistral: no biases; `sliding_window` (a query sees itself and the W - 1 keys before it, as our `window_size`).
- Qwen2: q, k and v biases only (our add_bias_linear=False, add_qkv_bias=True); a window where
  `use_sliding_window` asks for it on the layers >= `max_window_layers` (all of them or none convert).
HF's layout facts: torch Linear weights are (out, in); `q_proj` rows are [H, K] (head-major), `k_proj` and `v_proj`
rows [G, K]; query head h uses key/value head h // R (R = H / G), so HF's q head g·R + r is query r of our group g,
and our fused kernel [D, G, R+2, K] is q_proj, k_proj, v_proj regrouped per group; `o_proj` [D, H·K] is our
out kernel [H, K, D] transposed; `gate_proj`, `up_proj` [F, D] are fc1's [D, 2, F] (0 = gate, 1 = up) and
`down_proj` [D, F] is fc2 [F, D], transposed. RoPE: `rope_theta` and the v4 `rope_scaling` or v5
`rope_parameters` dict; rope_type "default" and "llama3" (Llama 3.1's scaling) convert.
"""

from __future__ import annotations

import numpy as np

from ptd_jax.config import ConfigError, ModelConfig
from ptd_jax.interop.tensors import float32_tree, tensor_getter

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""model_type -> the causal-LM architecture that converts."""
ARCHITECTURES = tuple(FAMILIES.values())
ROPE_TYPES = ("default", "llama3")
_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
)
_LLAMA3 = {
    "rope_scaling_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_position": "original_max_position_embeddings",
}
"""ModelConfig field -> the key of HF's llama3 rope dict."""
_DEFAULT_WINDOW = 4096
"""MistralConfig's and Qwen2Config's default sliding_window (what transformers uses where config.json has none)."""


# ---------------------------------------------------------------------------------------------------------------
# config.json -> ModelConfig
# ---------------------------------------------------------------------------------------------------------------


def _rope(config: dict, where: str) -> dict:
    """ModelConfig's rotary fields of the v4 (`rope_theta` + `rope_scaling`) or v5 (`rope_parameters`) spelling."""
    spec = {}
    for key in ("rope_scaling", "rope_parameters"):  # v5's wins where a config has both
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, dict) or any(isinstance(v, dict) for v in value.values()):
            raise ConfigError(f"{where} has {key}={value!r}; one flat dict (or null) converts")
        spec.update(value)
    rope_type = spec.get("rope_type", spec.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where} has rope_type={rope_type!r}; only {ROPE_TYPES} convert")
    partial = spec.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"{where} has partial_rotary_factor={partial}; only 1.0 (the whole head rotates) converts")
    fields = {"rotary_base": float(spec.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if rope_type == "llama3":
        spec.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
        missing = [k for k in _LLAMA3.values() if not isinstance(spec.get(k), (int, float))]
        if missing:
            raise ConfigError(f"{where}: rope_type 'llama3' lacks the numbers {missing}")
        fields |= {ours: spec[theirs] for ours, theirs in _LLAMA3.items()} | {"use_rope_scaling": True}
        fields["rope_original_max_position"] = int(fields["rope_original_max_position"])
        fields["rope_scaling_factor"] = float(fields["rope_scaling_factor"])
    return fields


def _biases(config: dict, family: str, where: str) -> dict:
    """add_bias_linear / add_qkv_bias of a family's bias switches."""
    if family == "mistral":
        return {"add_bias_linear": False, "add_qkv_bias": False}
    if family == "qwen2":
        return {"add_bias_linear": False, "add_qkv_bias": True}
    attention, mlp = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
    if mlp and not attention:
        raise ConfigError(f"{where} has mlp_bias=True with attention_bias=False; ptd_jax has no MLP-only biases")
    # attention biases without MLP ones: q, k, v biases, an o_proj bias that must be zero (`params_from_hf`)
    return {"add_bias_linear": attention and mlp, "add_qkv_bias": attention}


def _window(config: dict, family: str, num_layers: int, where: str) -> int | None:
    if family == "llama":
        return None
    if family == "mistral":
        window = config.get("sliding_window", _DEFAULT_WINDOW)
    elif not config.get("use_sliding_window", False):
        return None
    else:
        window = config.get("sliding_window", _DEFAULT_WINDOW)
        first = config.get("max_window_layers", 28)
        kinds = config.get("layer_types") or [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)
        ]
        if len(set(kinds)) > 1:
            raise ConfigError(f"{where} has sliding windows on some layers only ({kinds}); all or none convert")
        if kinds[0] != "sliding_attention":
            return None
    if window is not None and not (isinstance(window, int) and window >= 1):
        raise ConfigError(f"{where} has sliding_window={window!r}; a positive integer or null converts")
    return window


def model_config_from_hf(config: dict, where: str = "config.json") -> ModelConfig:
    """ModelConfig of an HF Llama / Mistral / Qwen2 config.json (sequence length = max_position_embeddings, as for
    GPT-2; change it with .replace). A setting ptd_jax does not have is a one-line ConfigError."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"{where} has model_type={family!r}; one of {sorted(FAMILIES)} converts here")
    missing = [k for k in _REQUIRED if not isinstance(config.get(k), int)]
    if missing:
        raise ConfigError(f"{where} lacks the integer fields {missing}")
    activation = config.get("hidden_act", "silu")
    if activation not in ("silu", "swish"):
        raise ConfigError(f"{where} has hidden_act={activation!r}; only 'silu' (SwiGLU) converts")
    D, H, L = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    G = config.get("num_key_value_heads") or H
    K = config.get("head_dim") or None
    positions = config["max_position_embeddings"]
    switches = _rope(config, where) | _biases(config, family, where)
    switches["window_size"] = _window(config, family, L, where)
    try:
        return ModelConfig(
            num_layers=L,
            hidden_size=D,
            num_attention_heads=H,
            seq_length=positions,
            max_position_embeddings=positions,
            vocab_size=config["vocab_size"],
            ffn_hidden_size=config["intermediate_size"],
            layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
            init_method_std=float(config.get("initializer_range", 0.02)),
            normalization="RMSNorm",
            swiglu=True,
            position_embedding_type="rope",
            rotary_interleaved=False,  # HF's rotate_half
            num_query_groups=None if G == H else G,
            kv_channels=None if K is None or (D % H == 0 and K == D // H) else K,
            untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
            **switches,
        )
    except (TypeError, ValueError) as err:  # ConfigError included: name the file
        raise ConfigError(f"{where}: {err}".splitlines()[0]) from None


# ---------------------------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------------------------


def params_from_hf(tensors: dict, cfg: ModelConfig, source: str) -> dict:
    """HF tensors ("model." prefix removed; arrays or anything numpy converts) -> canonical float32 params."""
    L, D, H, K = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    F, V, G = cfg.ffn_size, cfg.vocab_size, cfg.num_groups
    get = tensor_getter(tensors, source, "config.json")

    def stack(name, shape):
        return np.stack([get(f"layers.{i}.{name}", shape) for i in range(L)])

    def attn(kind, shape):  # q, k, v of every layer as [L, G, R or 1, K, ...]
        out = [stack(f"self_attn.{p}_proj.{kind}", shape(n)) for p, n in (("q", H), ("k", G), ("v", G))]
        return np.concatenate([x.reshape(L, G, -1, K, *x.shape[2:]) for x in out], axis=2)

    attn_params = {
        "qkv_kernel": attn("weight", lambda n: (n * K, D)).transpose(0, 4, 1, 2, 3),  # [L, D, G, R+2, K]
        "out_kernel": stack("self_attn.o_proj.weight", (D, H * K)).transpose(0, 2, 1).reshape(L, H, K, D),
    }
    if cfg.qkv_bias:
        attn_params["qkv_bias"] = attn("bias", lambda n: (n * K,))
    if cfg.add_bias_linear:
        attn_params["out_bias"] = stack("self_attn.o_proj.bias", (D,))
    elif "layers.0.self_attn.o_proj.bias" in tensors and np.any(stack("self_attn.o_proj.bias", (D,))):
        # Llama's attention_bias without mlp_bias: converts where its o_proj bias is zero (what `to_hf` writes)
        raise ConfigError(
            f"{source}: o_proj.bias is not zero with attention_bias=True and mlp_bias=False; ptd_jax has "
            f"attention-only biases on q, k and v (add_qkv_bias) only"
        )
    mlp = {
        "fc1_kernel": np.stack(
            [stack(f"mlp.{p}_proj.weight", (F, D)).transpose(0, 2, 1) for p in ("gate", "up")], axis=2
        ),
        "fc2_kernel": stack("mlp.down_proj.weight", (D, F)).transpose(0, 2, 1),
    }
    if cfg.add_bias_linear:
        mlp["fc1_bias"] = np.stack([stack(f"mlp.{p}_proj.bias", (F,)) for p in ("gate", "up")], axis=1)
        mlp["fc2_bias"] = stack("mlp.down_proj.bias", (D,))
    params = {
        "embed": {"word": get("embed_tokens.weight", (V, D))},
        "layers": {
            "ln1": {"scale": stack("input_layernorm.weight", (D,))},
            "attn": attn_params,
            "ln2": {"scale": stack("post_attention_layernorm.weight", (D,))},
            "mlp": mlp,
        },
        "final_ln": {"scale": get("norm.weight", (D,))},
    }
    if cfg.untie_embeddings_and_output_weights:
        params["output"] = {"word": get("lm_head.weight", (V, D))}
    elif "lm_head.weight" in tensors and not np.array_equal(get("lm_head.weight", (V, D)), params["embed"]["word"]):
        raise ConfigError(f"{source}: lm_head.weight differs from embed_tokens.weight, yet tie_word_embeddings=True")
    return float32_tree(params)


# ---------------------------------------------------------------------------------------------------------------
# ptd_jax -> HF
# ---------------------------------------------------------------------------------------------------------------


def choose_architecture(cfg: ModelConfig, architecture: str | None = None) -> str:
    """The HF architecture that holds `cfg`: the one asked for, or Qwen2 for QKV-only biases, Mistral for a window
    without biases, Llama otherwise; a one-line ConfigError where the asked (or any) one cannot."""
    unfit = [
        f"{name}={getattr(cfg, name)!r}"
        for name, wanted in (
            ("normalization", "RMSNorm"),
            ("swiglu", True),
            ("position_embedding_type", "rope"),
            ("rotary_percent", 1.0),
        )
        if getattr(cfg, name) != wanted
    ]
    if unfit:
        raise ConfigError(f"{', '.join(unfit)}: HF's Llama, Mistral and Qwen2 have RMSNorm, SwiGLU and full RoPE")
    if architecture is None:
        if cfg.qkv_bias and not cfg.add_bias_linear:
            architecture = FAMILIES["qwen2"]
        elif cfg.window_size is not None:
            architecture = FAMILIES["mistral"]
        else:
            architecture = FAMILIES["llama"]
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"architecture={architecture!r} is not one of {ARCHITECTURES} (or GPT2LMHeadModel)")
    problem = {
        "LlamaForCausalLM": cfg.window_size is not None and f"window_size={cfg.window_size} (Llama has no window)",
        "MistralForCausalLM": (cfg.add_bias_linear or cfg.qkv_bias)
        and f"add_bias_linear={cfg.add_bias_linear}, add_qkv_bias={cfg.add_qkv_bias} (Mistral has no biases)",
        "Qwen2ForCausalLM": cfg.add_bias_linear and "add_bias_linear=True (Qwen2 has biases on q, k and v only)",
    }[architecture]
    if problem:
        raise ConfigError(f"{architecture} cannot hold {problem}")
    return architecture


def _half_split_order(cfg: ModelConfig) -> np.ndarray:
    """The head-dim order that turns interleaved rotary pairs (2i, 2i+1) into HF's halves (i, i + r/2): q·k is the
    same under one permutation of both, so the HF model computes what ours does."""
    r = cfg.rotary_dim
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2), np.arange(r, cfg.head_dim)])


def hf_from_params(params, cfg: ModelConfig, architecture: str | None = None) -> tuple[dict, dict]:
    """Canonical (or padded-vocabulary) params -> (HF tensors by name, config.json dict) of `architecture` (None:
    `choose_architecture`). Biases HF's architecture has and ours lacks are written as zeros."""
    architecture = choose_architecture(cfg, architecture)
    family = next(k for k, v in FAMILIES.items() if v == architecture)
    L, D, H, K = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    V, G = cfg.vocab_size, cfg.num_groups
    R = H // G
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    lay = {k: {n: f32(v) for n, v in group.items()} for k, group in params["layers"].items()}
    a, m = lay["attn"], lay["mlp"]
    qkv = a["qkv_kernel"]  # [L, D, G, R+2, K]
    qkv_b = a.get("qkv_bias")
    if cfg.rotary_interleaved:  # q and k only: v's head dim is not rotated
        order = _half_split_order(cfg)
        qkv = np.concatenate([qkv[..., : R + 1, :][..., order], qkv[..., R + 1 :, :]], axis=3)
        if qkv_b is not None:
            qkv_b = np.concatenate([qkv_b[..., : R + 1, :][..., order], qkv_b[..., R + 1 :, :]], axis=2)
    attention_bias = family == "qwen2" or (family == "llama" and (cfg.qkv_bias or cfg.add_bias_linear))
    mlp_bias = family == "llama" and cfg.add_bias_linear
    if attention_bias and qkv_b is None:
        qkv_b = np.zeros((L, G, R + 2, K), np.float32)
    out_b = a.get("out_bias", np.zeros((L, D), np.float32))
    tensors = {
        "model.embed_tokens.weight": f32(params["embed"]["word"])[:V],
        "model.norm.weight": f32(params["final_ln"]["scale"]),
    }
    if cfg.untie_embeddings_and_output_weights:
        tensors["lm_head.weight"] = f32(params["output"]["word"])[:V]
    for i in range(L):
        h = f"model.layers.{i}."
        w = qkv[i].transpose(1, 2, 3, 0)  # [G, R+2, K, D]
        tensors |= {
            h + "input_layernorm.weight": lay["ln1"]["scale"][i],
            h + "post_attention_layernorm.weight": lay["ln2"]["scale"][i],
            h + "self_attn.q_proj.weight": w[:, :R].reshape(H * K, D),
            h + "self_attn.k_proj.weight": w[:, R].reshape(G * K, D),
            h + "self_attn.v_proj.weight": w[:, R + 1].reshape(G * K, D),
            h + "self_attn.o_proj.weight": a["out_kernel"][i].reshape(H * K, D).T,
            h + "mlp.gate_proj.weight": m["fc1_kernel"][i][:, 0].T,
            h + "mlp.up_proj.weight": m["fc1_kernel"][i][:, 1].T,
            h + "mlp.down_proj.weight": m["fc2_kernel"][i].T,
        }
        if attention_bias:
            b = qkv_b[i]  # [G, R+2, K]
            tensors |= {
                h + "self_attn.q_proj.bias": b[:, :R].reshape(H * K),
                h + "self_attn.k_proj.bias": b[:, R].reshape(G * K),
                h + "self_attn.v_proj.bias": b[:, R + 1].reshape(G * K),
            }
            if family == "llama":
                tensors[h + "self_attn.o_proj.bias"] = out_b[i]
        if mlp_bias:
            tensors |= {
                h + "mlp.gate_proj.bias": m["fc1_bias"][i][0],
                h + "mlp.up_proj.bias": m["fc1_bias"][i][1],
                h + "mlp.down_proj.bias": m["fc2_bias"][i],
            }
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}, _hf_config(cfg, family, attention_bias, mlp_bias)


def _hf_config(cfg: ModelConfig, family: str, attention_bias: bool, mlp_bias: bool) -> dict:
    """config.json of `family` for `cfg`, RoPE in the v4 spelling (`rope_theta`, `rope_scaling`), which v5 reads."""
    L, D, H = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads
    config = {
        "model_type": family,
        "architectures": [FAMILIES[family]],
        "vocab_size": cfg.vocab_size,
        "hidden_size": D,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": L,
        "num_attention_heads": H,
        "num_key_value_heads": cfg.num_groups,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_method_std,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "rope_theta": cfg.rotary_base,
        "rope_scaling": None,
        "attention_dropout": cfg.attention_dropout,
        "use_cache": True,
        "bos_token_id": None,  # the tokenizer's: ptd_jax's config does not know them
        "eos_token_id": None,
        "torch_dtype": "float32",
    }
    if cfg.use_rope_scaling:
        config["rope_scaling"] = {"rope_type": "llama3"} | {
            theirs: getattr(cfg, ours) for ours, theirs in _LLAMA3.items()
        }
    if family == "llama":
        config |= {"attention_bias": attention_bias, "mlp_bias": mlp_bias, "pretraining_tp": 1}
    elif family == "mistral":
        config["sliding_window"] = cfg.window_size
    else:
        window = cfg.window_size is not None
        config |= {
            "use_sliding_window": window,
            "sliding_window": cfg.window_size,
            "max_window_layers": 0 if window else L,
        }
        if D % H == 0 and cfg.head_dim == D // H:  # Qwen2's config has no head_dim field of its own
            del config["head_dim"]
    return config
