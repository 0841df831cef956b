"""Hugging Face GPT-2 <-> ptd_jax: `from_hf(path) -> (ModelConfig, params)` and `to_hf(params, model_cfg, path)`.

Megatron's GPT is GPT-2 (learned positions, pre-LN, tanh GeLU, tied output layer), so the conversion is a renaming
and a few reshapes, with no torch (the `safetensors` numpy API). HF's layout facts:
- `Conv1D` weights are (in, out): `c_attn.weight` [D, 3D] is our qkv kernel [D, 3, H, K] flattened, since its
  columns are [q | k | v], each head-major; `attn.c_proj.weight` [D, D] is our out kernel [H, K, D] flattened;
  `mlp.c_fc.weight` [D, F] and `mlp.c_proj.weight` [F, D] are fc1 and fc2 as they are;
- `lm_head.weight` is tied to `wte` (it is not stored, or stored equal);
- a GPT2LMHeadModel prefixes every tensor with "transformer.", a GPT2Model does not.

The params are the canonical form of `parallel/sharding.py` (layers [L, ...], the unpadded vocabulary), as a
checkpoint stores them: `model.logits` runs them on one device, and `ptd-convert` writes them as a checkpoint that
`ptd-train --load CKPT --finetune` loads under any layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ptd_jax.config import ConfigError, ModelConfig
from ptd_jax.interop.tensors import tensor_getter

HF_ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
_GELU = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}
_DEFAULTS = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "reorder_and_upcast_attn": False,
}
"""GPT-2 options that change the computation: a config setting another value is refused."""


def _hf_config(path: Path) -> dict:
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, expected an object")
    except FileNotFoundError:
        raise ConfigError(f"{path} has no config.json (expected a Hugging Face GPT-2 folder)") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{config_path} does not parse ({err})".splitlines()[0]) from None
    architectures = config.get("architectures") or []
    if config.get("model_type") != "gpt2" or not set(architectures) <= set(HF_ARCHITECTURES):
        raise ConfigError(
            f"{path} holds model_type={config.get('model_type')!r} architectures={architectures}; "
            f"only GPT-2 ({', '.join(HF_ARCHITECTURES)}) converts"
        )
    missing = [
        k for k in ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size") if not isinstance(config.get(k), int)
    ]
    if missing:
        raise ConfigError(f"{config_path} lacks the integer fields {missing}")
    unsupported = {k: config[k] for k, default in _DEFAULTS.items() if k in config and config[k] != default}
    if unsupported:
        raise ConfigError(
            f"{config_path} sets {unsupported}, which Megatron's GPT does not have; only the "
            f"defaults {_DEFAULTS} convert"
        )
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GELU:
        raise ConfigError(f"{config_path} has activation_function={activation!r}; one of {sorted(_GELU)} converts")
    return config


def model_config_from_hf(config: dict) -> ModelConfig:
    """ModelConfig of an HF GPT-2 config.json (sequence length = n_positions; change it with .replace)."""
    D = config["n_embd"]
    return ModelConfig(
        num_layers=config["n_layer"],
        hidden_size=D,
        num_attention_heads=config["n_head"],
        seq_length=config["n_positions"],
        max_position_embeddings=config["n_positions"],
        vocab_size=config["vocab_size"],
        ffn_hidden_size=config.get("n_inner") or 4 * D,
        layernorm_epsilon=config.get("layer_norm_epsilon", 1e-5),
        gelu_approximate=_GELU[config.get("activation_function", "gelu_new")],
        init_method_std=config.get("initializer_range", 0.02),
    )


def from_hf(path) -> tuple[ModelConfig, dict]:
    """An HF GPT-2 folder (config.json + model.safetensors) -> (ModelConfig, canonical float32 numpy params)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    cfg = model_config_from_hf(_hf_config(path))
    weights_path = path / "model.safetensors"
    try:
        raw = load_file(str(weights_path))
    except FileNotFoundError:
        raise ConfigError(f"{path} has no model.safetensors") from None
    except (SafetensorError, OSError, ValueError, TypeError) as err:
        raise ConfigError(f"{weights_path} does not parse ({err})".splitlines()[0]) from None
    tensors = {k.removeprefix("transformer."): v for k, v in raw.items()}
    L, D, H, K, F = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.ffn_size

    get = tensor_getter(tensors, str(weights_path), "config.json")

    def stack(name, shape, out_shape=None):
        return np.stack([get(f"h.{i}.{name}", shape).reshape(out_shape or shape) for i in range(L)])

    params = {
        "embed": {
            "word": get("wte.weight", (cfg.vocab_size, D)),
            "position": get("wpe.weight", (cfg.max_positions, D)),
        },
        "layers": {
            "ln1": {"scale": stack("ln_1.weight", (D,)), "bias": stack("ln_1.bias", (D,))},
            "attn": {
                # [D, 3, H, K] -> our per-head [D, H, 3, K] (`model.py`: G = H query groups of one head each)
                "qkv_kernel": stack("attn.c_attn.weight", (D, 3 * D), (D, 3, H, K)).transpose(0, 1, 3, 2, 4),
                "qkv_bias": stack("attn.c_attn.bias", (3 * D,), (3, H, K)).transpose(0, 2, 1, 3),
                "out_kernel": stack("attn.c_proj.weight", (D, D), (H, K, D)),
                "out_bias": stack("attn.c_proj.bias", (D,)),
            },
            "ln2": {"scale": stack("ln_2.weight", (D,)), "bias": stack("ln_2.bias", (D,))},
            "mlp": {
                "fc1_kernel": stack("mlp.c_fc.weight", (D, F)),
                "fc1_bias": stack("mlp.c_fc.bias", (F,)),
                "fc2_kernel": stack("mlp.c_proj.weight", (F, D)),
                "fc2_bias": stack("mlp.c_proj.bias", (D,)),
            },
        },
        "final_ln": {"scale": get("ln_f.weight", (D,)), "bias": get("ln_f.bias", (D,))},
    }
    head = raw.get("lm_head.weight")
    if head is not None and not np.array_equal(np.asarray(head, np.float32), params["embed"]["word"]):
        raise ConfigError(f"{weights_path}: lm_head.weight is not tied to wte.weight (ptd_jax's output layer is)")
    return cfg, params


def to_hf(params, model_cfg: ModelConfig, path) -> Path:
    """Canonical params (as `from_hf` returns them, or a checkpoint stores them) -> an HF GPT2LMHeadModel folder."""
    from safetensors.numpy import save_file

    cfg, path = model_cfg, Path(path)
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.ffn_size
    p = {k: {n: np.asarray(v, np.float32) for n, v in group.items()} for k, group in params.items() if k != "layers"}
    layers = {k: {n: np.asarray(v, np.float32) for n, v in group.items()} for k, group in params["layers"].items()}
    word = p["embed"]["word"][: cfg.vocab_size]  # a run's padded embedding converts too
    tensors = {
        "transformer.wte.weight": word,
        "transformer.wpe.weight": p["embed"]["position"],
        "transformer.ln_f.weight": p["final_ln"]["scale"],
        "transformer.ln_f.bias": p["final_ln"]["bias"],
    }
    for i in range(L):
        h = f"transformer.h.{i}."
        tensors.update(
            {
                h + "ln_1.weight": layers["ln1"]["scale"][i],
                h + "ln_1.bias": layers["ln1"]["bias"][i],
                h + "attn.c_attn.weight": layers["attn"]["qkv_kernel"][i].transpose(0, 2, 1, 3).reshape(D, 3 * D),
                h + "attn.c_attn.bias": layers["attn"]["qkv_bias"][i].transpose(1, 0, 2).reshape(3 * D),
                h + "attn.c_proj.weight": layers["attn"]["out_kernel"][i].reshape(D, D),
                h + "attn.c_proj.bias": layers["attn"]["out_bias"][i],
                h + "ln_2.weight": layers["ln2"]["scale"][i],
                h + "ln_2.bias": layers["ln2"]["bias"][i],
                h + "mlp.c_fc.weight": layers["mlp"]["fc1_kernel"][i].reshape(D, F),
                h + "mlp.c_fc.bias": layers["mlp"]["fc1_bias"][i],
                h + "mlp.c_proj.weight": layers["mlp"]["fc2_kernel"][i].reshape(F, D),
                h + "mlp.c_proj.bias": layers["mlp"]["fc2_bias"][i],
            }
        )
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": L,
        "n_embd": D,
        "n_head": cfg.num_attention_heads,
        "n_positions": cfg.max_positions,
        "n_ctx": cfg.max_positions,
        "vocab_size": cfg.vocab_size,
        "n_inner": F,
        "layer_norm_epsilon": cfg.layernorm_epsilon,
        "activation_function": "gelu_new" if cfg.gelu_approximate else "gelu",
        "initializer_range": cfg.init_method_std,
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "tie_word_embeddings": True,
        "bos_token_id": cfg.vocab_size - 1,
        "eos_token_id": cfg.vocab_size - 1,
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
