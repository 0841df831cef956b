"""megatron-core's GPTModel state dict <-> ptd_jax: `from_megatron(state, model_cfg)` and `to_megatron(params,
model_cfg)` (numpy, no torch, t = p = 1). The params are the canonical form (layers [L, ...], the unpadded vocabulary).
GPT-2 and the Llama switches that megatron-core's GPTModel has: RMSNorm, SwiGLU (`gated_linear_unit=True,
activation_func=F.silu`), RoPE (no position table; half-split or `rotary_interleaved`, Llama 3.1's scaling with
low/high/original = 1/4/8192 via GPTModel's `rope_scaling`, `rope_scaling_factor`), grouped-query attention
(`num_query_groups`), `kv_channels`, an untied output layer, no linear biases, QKV biases only (`add_qkv_bias`).
"""

from __future__ import annotations

import numpy as np

from ptd_jax.config import ConfigError, ModelConfig
from ptd_jax.interop.tensors import float32_tree, tensor_getter

# megatron-core's GPTModel at t = p = 1: its state-dict names and layouts. torch Linear weights are (out, in); the
# fused QKV's output rows go per query group g: its R = H/G query heads, then its key head, then its value head,
# K rows each, which is our qkv_kernel [D, G, R+2, K] transposed (GPT-2: G = H, R = 1, [q_h | k_h | v_h]). With
# SwiGLU its fc1 rows are [gate; up] (F each), our fc1 [D, 2, F] transposed. The norm before QKV and before fc1 is
# its own module in the local layer spec (`get_gpt_layer_local_spec`: input_layernorm, pre_mlp_layernorm) and is
# fused into the following linear in Transformer Engine's (`linear_qkv.layer_norm_weight`,
# `linear_fc1.layer_norm_weight`). RMSNorm has a weight only.
_MEGATRON_LN = {
    "local": {"ln1": "input_layernorm.{}", "ln2": "pre_mlp_layernorm.{}"},
    "transformer_engine": {"ln1": "self_attention.linear_qkv.layer_norm_{}", "ln2": "mlp.linear_fc1.layer_norm_{}"},
}
_LN_FIELDS = {"scale": "weight", "bias": "bias"}
# megatron-core's `_apply_scaling` fixes these three of Llama 3.1's four numbers; only the factor is an argument.
_MEGATRON_ROPE_SCALING = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_max_position": 8192}


def _check_supported(cfg: ModelConfig, direction: str) -> None:
    """What megatron-core's GPTModel cannot express (or this converter does not map) is refused with one line,
    never half-mapped."""
    if cfg.window_size is not None:
        raise ConfigError(f"{direction} does not convert window_size={cfg.window_size} (sliding-window attention)")
    if cfg.use_rope_scaling:
        fixed = [f"{n}={getattr(cfg, n)!r}" for n, v in _MEGATRON_ROPE_SCALING.items() if getattr(cfg, n) != v]
        if fixed:
            raise ConfigError(
                f"{direction}: megatron-core's RoPE scaling fixes low/high/original to 1/4/8192, not {', '.join(fixed)}"
            )


def _ln_fields(cfg: ModelConfig) -> dict[str, str]:
    return {"scale": "weight"} if cfg.normalization == "RMSNorm" else _LN_FIELDS


def to_megatron(params, model_cfg: ModelConfig, layer_spec: str = "local") -> dict[str, np.ndarray]:
    """Canonical params -> megatron-core GPTModel's state dict (t = p = 1) as float32 numpy arrays, for
    `model.load_state_dict({k: torch.from_numpy(v) ...}, strict=False)` (strict=False: it also lists
    `_extra_state` entries). `layer_spec` is "local" or "transformer_engine" (where the norms live). The word
    embedding (and an untied output layer) keeps the rows it has: give megatron-core's GPTModel `vocab_size` = that
    many (a run's padded vocabulary, or the canonical V). megatron-core's softmax runs over all of them, ours over
    the real vocabulary only, so the two losses are one function only on the canonical (unpadded) embedding."""
    if layer_spec not in _MEGATRON_LN:
        raise ConfigError(f"{layer_spec=} is not one of {sorted(_MEGATRON_LN)}")
    _check_supported(model_cfg, "to_megatron")
    cfg = model_cfg
    L, D = cfg.num_layers, cfg.hidden_size
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    lay = params["layers"]
    out = {"embedding.word_embeddings.weight": f32(params["embed"]["word"])}
    if cfg.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = f32(params["embed"]["position"])
    for ours, theirs in _ln_fields(cfg).items():
        out[f"decoder.final_layernorm.{theirs}"] = f32(params["final_ln"][ours])
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = f32(params["output"]["word"])
    for i in range(L):
        h = f"decoder.layers.{i}."
        for ln in ("ln1", "ln2"):
            for ours, theirs in _ln_fields(cfg).items():
                out[h + _MEGATRON_LN[layer_spec][ln].format(theirs)] = f32(lay[ln][ours][i])
        a = {k: np.asarray(v[i]) for k, v in lay["attn"].items()}
        m = {k: np.asarray(v[i]) for k, v in lay["mlp"].items()}
        fc1 = m["fc1_kernel"]  # [D, F] or SwiGLU's [D, 2, F] -> [F, D] or [2F, D] ([gate; up])
        # ours [D, G, R+2, K] -> Megatron's rows [G, R+2, K] (per query group: its q heads, k, v)
        out[h + "self_attention.linear_qkv.weight"] = f32(a["qkv_kernel"].transpose(1, 2, 3, 0).reshape(-1, D))
        out[h + "self_attention.linear_proj.weight"] = f32(a["out_kernel"].reshape(-1, D).T)
        out[h + "mlp.linear_fc1.weight"] = f32(np.moveaxis(fc1, 0, -1).reshape(-1, D))
        out[h + "mlp.linear_fc2.weight"] = f32(m["fc2_kernel"].T)
        if cfg.qkv_bias:
            out[h + "self_attention.linear_qkv.bias"] = f32(a["qkv_bias"].reshape(-1))
        if cfg.add_bias_linear:
            out[h + "self_attention.linear_proj.bias"] = f32(a["out_bias"])
            out[h + "mlp.linear_fc1.bias"] = f32(m["fc1_bias"].reshape(-1))
            out[h + "mlp.linear_fc2.bias"] = f32(m["fc2_bias"])
    return out


def from_megatron(state: dict, model_cfg: ModelConfig) -> dict:
    """megatron-core GPTModel's state dict (t = p = 1; tensors of any float dtype, or arrays; the local or
    Transformer Engine layer spec, told apart by its names; "module." prefixes, `_extra_state` and, for a tied
    config, an `output_layer.weight` equal to the word embedding ignored) -> canonical float32 numpy params: the
    word embedding (and an untied output layer) cut to the real vocabulary (`model_cfg.vocab_size` rows; Megatron
    pads it). The inverse of `to_megatron` on canonical params; a missing tensor, a wrong shape or, for a tied
    config, an output layer that is not the word embedding is a one-line `ConfigError`."""
    _check_supported(model_cfg, "from_megatron")
    cfg = model_cfg
    L, D, H, K, F = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.ffn_size
    G = cfg.num_groups
    R = H // G
    tensors = {}
    for name, value in state.items():
        name = name.removeprefix("module.")
        if not name.endswith("_extra_state"):
            # via float32: numpy has no bfloat16, the dtype most Megatron checkpoints hold
            tensors[name] = (
                value.detach().float().cpu().numpy() if hasattr(value, "detach") else np.asarray(value, np.float32)
            )
    spec = (
        "transformer_engine" if "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in tensors else "local"
    )

    get = tensor_getter(tensors, f"megatron state dict ({spec} layer spec)", "the config")

    word = tensors.get("embedding.word_embeddings.weight")
    rows = cfg.vocab_size if word is None else word.shape[0]
    if rows < cfg.vocab_size:
        raise ConfigError(f"megatron state dict: the word embedding has {rows} rows, fewer than {cfg.vocab_size=}")
    fields = _ln_fields(cfg)
    params = {
        "embed": {"word": get("embedding.word_embeddings.weight", (rows, D))},
        "final_ln": {ours: get(f"decoder.final_layernorm.{theirs}", (D,)) for ours, theirs in fields.items()},
    }
    if cfg.position_embedding_type == "learned_absolute":
        params["embed"]["position"] = get("embedding.position_embeddings.weight", (cfg.max_positions, D))
    head = tensors.get("output_layer.weight")
    if cfg.untie_embeddings_and_output_weights:
        params["output"] = {"word": get("output_layer.weight", (rows, D))[: cfg.vocab_size]}
    elif head is not None and not np.array_equal(np.asarray(head, np.float32), params["embed"]["word"]):
        raise ConfigError(
            "megatron state dict: output_layer.weight is not tied to the word embedding "
            "(set untie_embeddings_and_output_weights=True for an output layer of its own)"
        )

    def stack(name, shape):
        return np.stack([get(f"decoder.layers.{i}.{name}", shape) for i in range(L)])

    ln = {
        key: {ours: stack(_MEGATRON_LN[spec][key].format(theirs), (D,)) for ours, theirs in fields.items()}
        for key in ("ln1", "ln2")
    }
    up = 2 * F if cfg.swiglu else F
    fc1 = stack("mlp.linear_fc1.weight", (up, D))  # [L, F, D] or [L, 2F, D] ([gate; up])
    fc1 = fc1.reshape(L, 2, F, D).transpose(0, 3, 1, 2) if cfg.swiglu else fc1.transpose(0, 2, 1)
    attn = {
        # Megatron's rows [G, R+2, K] (per query group) -> ours [D, G, R+2, K]
        "qkv_kernel": stack("self_attention.linear_qkv.weight", (G * (R + 2) * K, D))
        .reshape(L, G, R + 2, K, D)
        .transpose(0, 4, 1, 2, 3),
        "out_kernel": stack("self_attention.linear_proj.weight", (D, H * K)).transpose(0, 2, 1).reshape(L, H, K, D),
    }
    mlp = {"fc1_kernel": fc1, "fc2_kernel": stack("mlp.linear_fc2.weight", (D, F)).transpose(0, 2, 1)}
    if cfg.qkv_bias:
        attn["qkv_bias"] = stack("self_attention.linear_qkv.bias", (G * (R + 2) * K,)).reshape(L, G, R + 2, K)
    if cfg.add_bias_linear:
        attn["out_bias"] = stack("self_attention.linear_proj.bias", (D,))
        mlp["fc1_bias"] = stack("mlp.linear_fc1.bias", (up,)).reshape((L, 2, F) if cfg.swiglu else (L, F))
        mlp["fc2_bias"] = stack("mlp.linear_fc2.bias", (D,))
    params["layers"] = {**ln, "attn": attn, "mlp": mlp}
    params["embed"]["word"] = params["embed"]["word"][: cfg.vocab_size]
    return float32_tree(params)
