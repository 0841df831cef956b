"""Hugging Face causal LMs <-> ptd_jax: `from_hf(path) -> (ModelConfig, params)` and `to_hf(params, model_cfg, path)`
for GPT-2 (here) and Llama, Mistral and Qwen2 (the mapping in `interop/hf_llama.py`).

Megatron's GPT is GPT-2 (learned positions, pre-LN, tanh GeLU, tied output layer), so the conversion is a renaming
and a few reshapes, with no torch (numpy and the safetensors file format). HF's GPT-2 layout facts:
- `Conv1D` weights are (in, out): `c_attn.weight` [D, 3D] is our qkv kernel [D, 3, H, K] flattened, since its
  columns are [q | k | v], each head-major; `attn.c_proj.weight` [D, D] is our out kernel [H, K, D] flattened;
  `mlp.c_fc.weight` [D, F] and `mlp.c_proj.weight` [F, D] are fc1 and fc2 as they are;
- `lm_head.weight` is tied to `wte` (it is not stored, or stored equal);
- a GPT2LMHeadModel prefixes every tensor with "transformer.", a GPT2Model does not.

A folder is what `save_pretrained` writes: config.json and model.safetensors, or shards named by
model.safetensors.index.json; tensors of any float dtype (bfloat16 included) are read lazily from the mapped files
and converted to float32 one at a time. `to_hf` writes one float32 model.safetensors.

The params are the canonical form of `parallel/sharding.py` (layers [L, ...], the unpadded vocabulary), as a
checkpoint stores them: `model.logits` runs them on one device, and `ptd-convert` writes them as a checkpoint that
`ptd-train --load CKPT --finetune` loads under any layout.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np

from ptd_jax.config import ConfigError, ModelConfig
from ptd_jax.interop import hf_llama
from ptd_jax.interop.tensors import tensor_getter

HF_ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
"""The GPT-2 architectures; `hf_llama.ARCHITECTURES` the Llama family's."""
_GELU = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}
_DEFAULTS = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "reorder_and_upcast_attn": False,
}
"""GPT-2 options that change the computation: a config setting another value is refused."""


def _read_config(path: Path) -> dict:
    """config.json as a dict, checked to be a GPT-2 or a Llama-family model."""
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, expected an object")
    except FileNotFoundError:
        raise ConfigError(f"{path} has no config.json (expected a Hugging Face model folder)") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{config_path} does not parse ({err})".splitlines()[0]) from None
    architectures = config.get("architectures") or []
    family = config.get("model_type")
    known = {"gpt2": HF_ARCHITECTURES} | {k: (v,) for k, v in hf_llama.FAMILIES.items()}
    if family not in known or not set(architectures) <= set(known[family]):
        raise ConfigError(
            f"{path} holds model_type={family!r} architectures={architectures}; only GPT-2 "
            f"({', '.join(HF_ARCHITECTURES)}), {', '.join(hf_llama.ARCHITECTURES)} convert"
        )
    return config


def _check_gpt2(config: dict, config_path) -> None:
    """Refuses a GPT-2 config.json that Megatron's GPT does not compute."""
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


def model_config_from_hf(config: dict, where="config.json") -> ModelConfig:
    """ModelConfig of an HF config.json: GPT-2 (sequence length = n_positions) or the Llama family (sequence length
    = max_position_embeddings; `hf_llama.model_config_from_hf`). Change the sequence length with .replace."""
    if config.get("model_type") != "gpt2":
        return hf_llama.model_config_from_hf(config, str(where))
    _check_gpt2(config, where)
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


# ---------------------------------------------------------------------------------------------------------------
# safetensors files, read without torch
# ---------------------------------------------------------------------------------------------------------------

_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}
"""safetensors dtype codes numpy has (BF16 through ml_dtypes, which JAX brings)."""


def _dtype(code: str):
    if code == "BF16":
        try:
            import ml_dtypes
        except ImportError:
            return None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_DTYPES[code]) if code in _DTYPES else np.dtype(bool) if code == "BOOL" else None


class _Stored:
    """One tensor of a memory-mapped safetensors file, copied out when numpy asks for it (`np.asarray(t, dtype)`):
    a model converts one tensor at a time, whatever its size on disk."""

    def __init__(self, data, name: str, info: dict, begin: int, source: str):
        self.data, self.name, self.code, self.begin, self.source = data, name, info["dtype"], begin, source
        self.shape = tuple(info["shape"])
        self.used = False  # read by the conversion: `from_hf` refuses weights that no config field accounts for

    def __array__(self, dtype=None, copy=None):
        self.used = True
        stored = _dtype(self.code)
        if stored is None:
            raise ConfigError(f"{self.source}: tensor {self.name!r} has dtype {self.code}, which does not convert")
        count = int(np.prod(self.shape, dtype=np.int64))
        return np.array(np.frombuffer(self.data, stored, count, self.begin).reshape(self.shape), dtype=dtype)


def _read_file(file: Path) -> dict:
    """{name: _Stored} of one safetensors file (its header checked against its size)."""
    try:
        with open(file, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ConfigError(f"{file.parent} has no {file.name}") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"{file} does not parse ({err})".splitlines()[0]) from None
    try:
        n = int.from_bytes(data[:8], "little")
        if len(data) < 8 or n > len(data) - 8:
            raise ValueError(f"a header of {n} bytes in a file of {len(data)}")
        header = json.loads(bytes(data[8 : 8 + n]))
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            dtype = _dtype(info["dtype"])
            size = int(np.prod(info["shape"], dtype=np.int64)) * (dtype.itemsize if dtype is not None else 0)
            if not 0 <= begin <= end <= len(data) - 8 - n or (dtype is not None and end - begin != size):
                raise ValueError(f"tensor {name!r} has data_offsets {[begin, end]} for {info['shape']}")
            tensors[name] = _Stored(data, name, info, 8 + n + begin, str(file))
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{file} does not parse ({type(err).__name__}: {err})".splitlines()[0]) from None
    return tensors


def _read_tensors(path: Path) -> tuple[dict, str]:
    """(every tensor of the folder by name, what error messages call it): model.safetensors, or the shards that
    model.safetensors.index.json names."""
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").exists() or not index.exists():
        return _read_file(path / "model.safetensors"), str(path / "model.safetensors")
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"{index} does not parse ({type(err).__name__}: {err})".splitlines()[0]) from None
    tensors = {}
    for shard in shards:
        tensors |= _read_file(path / shard)
    return tensors, str(index)


# ---------------------------------------------------------------------------------------------------------------
# HF -> ptd_jax
# ---------------------------------------------------------------------------------------------------------------


def from_hf(path) -> tuple[ModelConfig, dict]:
    """An HF GPT-2, Llama, Mistral or Qwen2 folder (config.json + safetensors) -> (ModelConfig, canonical float32
    numpy params). Anything that does not convert is a one-line ConfigError."""
    path = Path(path)
    config = _read_config(path)
    cfg = model_config_from_hf(config, path / "config.json")
    raw, source = _read_tensors(path)
    if config["model_type"] != "gpt2":
        params = hf_llama.params_from_hf({k.removeprefix("model."): v for k, v in raw.items()}, cfg, source)
    else:
        params = _gpt2_params(raw, cfg, source)
    unused = sorted(name for name, tensor in raw.items() if not tensor.used and not name.endswith(BUFFERS))
    if unused:
        raise ConfigError(
            f"{source} holds {len(unused)} tensor(s) that {path / 'config.json'} does not account for, e.g. "
            f"{unused[0]!r}: the config and the weights disagree (num_layers={cfg.num_layers})"
        )
    return cfg, params


BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
"""Tensors some HF checkpoints store that are not weights (GPT-2's causal mask, RoPE's frequencies)."""


def _gpt2_params(raw: dict, cfg: ModelConfig, weights_path: str) -> dict:
    tensors = {k.removeprefix("transformer."): v for k, v in raw.items()}
    L, D, H, K, F = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.ffn_size

    get = tensor_getter(tensors, weights_path, "config.json")

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
        raise ConfigError(f"{weights_path}: lm_head.weight is not tied to wte.weight (GPT-2's output layer is)")
    return params


# ---------------------------------------------------------------------------------------------------------------
# ptd_jax -> HF
# ---------------------------------------------------------------------------------------------------------------


def to_hf(params, model_cfg: ModelConfig, path, architecture: str | None = None) -> Path:
    """Canonical params (as `from_hf` returns them, or a checkpoint stores them; a padded vocabulary is cut) -> an HF
    folder (config.json + one float32 model.safetensors) that `AutoModelForCausalLM.from_pretrained` loads.
    `architecture`: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM; None picks GPT-2
    for learned positions, else `hf_llama.choose_architecture`'s. A config it cannot hold is a one-line
    ConfigError, and nothing is written then."""
    from safetensors.numpy import save_file

    path = Path(path)
    if architecture in HF_ARCHITECTURES or (
        architecture is None and model_cfg.position_embedding_type == "learned_absolute"
    ):
        tensors, config = _gpt2_to_hf(params, model_cfg)
    else:
        tensors, config = hf_llama.hf_from_params(params, model_cfg, architecture)
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _gpt2_to_hf(params, cfg: ModelConfig) -> tuple[dict, dict]:
    """(tensors, config.json) of a GPT2LMHeadModel, or a ConfigError naming what GPT-2 does not have."""
    D, H = cfg.hidden_size, cfg.num_attention_heads
    gpt2 = {
        "normalization": "LayerNorm",
        "swiglu": False,
        "position_embedding_type": "learned_absolute",
        "num_groups": H,
        "head_dim": D // H,
        "untie_embeddings_and_output_weights": False,
        "add_bias_linear": True,
        "qkv_bias": True,
        "window_size": None,
    }
    unfit = [f"{k}={getattr(cfg, k)!r}" for k, v in gpt2.items() if getattr(cfg, k) != v]
    if D % H:
        unfit.append(f"hidden_size={D} not divisible by num_attention_heads={H}")
    if unfit:
        raise ConfigError(f"GPT2LMHeadModel cannot hold {', '.join(unfit)} (GPT-2 is {gpt2})")
    L, F = cfg.num_layers, cfg.ffn_size
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
    return tensors, config
