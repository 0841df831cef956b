"""megatron-core's GPTModel state dict <-> ptd_jax: `from_megatron(state, model_cfg)` and `to_megatron(params,
model_cfg)` (numpy, no torch, t = p = 1). The params are the canonical form (layers [L, ...], the unpadded vocabulary).
"""

from __future__ import annotations

import numpy as np

from ptd_jax.config import ConfigError, ModelConfig
from ptd_jax.interop.tensors import float32_tree, tensor_getter

# megatron-core's GPTModel (learned absolute positions, tied output layer) at t = p = 1: its state-dict names and
# layouts. torch Linear weights are (out, in); the fused QKV's output rows go head by head, [q_h | k_h | v_h] (one
# query group per head), where ours are [q | k | v], each head-major. The LayerNorm before QKV and before fc1 is its
# own module in the local layer spec (`get_gpt_layer_local_spec`: input_layernorm, pre_mlp_layernorm) and is fused
# into the following linear in Transformer Engine's (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).
_MEGATRON_LN = {
    "local": {"ln1": "input_layernorm.{}", "ln2": "pre_mlp_layernorm.{}"},
    "transformer_engine": {"ln1": "self_attention.linear_qkv.layer_norm_{}", "ln2": "mlp.linear_fc1.layer_norm_{}"},
}
_LN_FIELDS = {"scale": "weight", "bias": "bias"}


def _check_gpt2(cfg: ModelConfig, direction: str) -> None:
    """Only the GPT-2 switches convert today; a Llama-family config is refused with one line, never half-mapped."""
    gpt2 = ModelConfig(num_layers=1, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads)
    switches = (
        "normalization",
        "swiglu",
        "position_embedding_type",
        "num_groups",
        "head_dim",
        "untie_embeddings_and_output_weights",
        "add_bias_linear",
        "qkv_bias",
        "window_size",
    )
    changed = [f"{n}={getattr(cfg, n)!r}" for n in switches if getattr(cfg, n) != getattr(gpt2, n)]
    if changed:
        raise ConfigError(f"{direction} converts the GPT-2 architecture only, not {', '.join(changed)}")


def to_megatron(params, model_cfg: ModelConfig, layer_spec: str = "local") -> dict[str, np.ndarray]:
    """Canonical params -> megatron-core GPTModel's state dict (t = p = 1) as float32 numpy arrays, for
    `model.load_state_dict({k: torch.from_numpy(v) ...}, strict=False)` (strict=False: it also lists
    `_extra_state` entries). `layer_spec` is "local" or "transformer_engine" (where the LayerNorms live). The word
    embedding keeps the rows it has: give megatron-core's GPTModel `vocab_size` = that many (a run's padded
    vocabulary, or the canonical V). megatron-core's softmax runs over all of them, ours over the real vocabulary
    only, so the two losses are one function only on the canonical (unpadded) embedding."""
    if layer_spec not in _MEGATRON_LN:
        raise ConfigError(f"{layer_spec=} is not one of {sorted(_MEGATRON_LN)}")
    _check_gpt2(model_cfg, "to_megatron")
    cfg = model_cfg
    L, D = cfg.num_layers, cfg.hidden_size
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    lay = params["layers"]
    out = {
        "embedding.word_embeddings.weight": f32(params["embed"]["word"]),
        "embedding.position_embeddings.weight": f32(params["embed"]["position"]),
        "decoder.final_layernorm.weight": f32(params["final_ln"]["scale"]),
        "decoder.final_layernorm.bias": f32(params["final_ln"]["bias"]),
    }
    for i in range(L):
        h = f"decoder.layers.{i}."
        for ln in ("ln1", "ln2"):
            for ours, theirs in _LN_FIELDS.items():
                out[h + _MEGATRON_LN[layer_spec][ln].format(theirs)] = f32(lay[ln][ours][i])
        a = {k: np.asarray(v[i]) for k, v in lay["attn"].items()}
        m = {k: np.asarray(v[i]) for k, v in lay["mlp"].items()}
        out.update(
            {
                # ours [D, G, R+2, K] -> Megatron's rows [G, R+2, K] (per query group: q heads, k, v)
                h + "self_attention.linear_qkv.weight": f32(a["qkv_kernel"].transpose(1, 2, 3, 0).reshape(-1, D)),
                h + "self_attention.linear_qkv.bias": f32(a["qkv_bias"].reshape(-1)),
                h + "self_attention.linear_proj.weight": f32(a["out_kernel"].reshape(D, D).T),
                h + "self_attention.linear_proj.bias": f32(a["out_bias"]),
                h + "mlp.linear_fc1.weight": f32(m["fc1_kernel"].T),
                h + "mlp.linear_fc1.bias": f32(m["fc1_bias"]),
                h + "mlp.linear_fc2.weight": f32(m["fc2_kernel"].T),
                h + "mlp.linear_fc2.bias": f32(m["fc2_bias"]),
            }
        )
    return out


def from_megatron(state: dict, model_cfg: ModelConfig) -> dict:
    """megatron-core GPTModel's state dict (t = p = 1; tensors of any float dtype, or arrays; the local or
    Transformer Engine layer spec, told apart by its names; "module." prefixes, `_extra_state` and a tied
    `output_layer.weight` equal to the word embedding ignored) -> canonical float32 numpy params: the word embedding
    cut to the real vocabulary (`model_cfg.vocab_size` rows; Megatron pads it). The inverse of `to_megatron` on
    canonical params; a missing tensor, a wrong shape or an untied output layer is a one-line `ConfigError`."""
    _check_gpt2(model_cfg, "from_megatron")
    cfg = model_cfg
    L, D, H, K, F = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.ffn_size
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
    params = {
        "embed": {
            "word": get("embedding.word_embeddings.weight", (rows, D)),
            "position": get("embedding.position_embeddings.weight", (cfg.max_positions, D)),
        },
        "final_ln": {
            "scale": get("decoder.final_layernorm.weight", (D,)),
            "bias": get("decoder.final_layernorm.bias", (D,)),
        },
    }
    head = tensors.get("output_layer.weight")
    if head is not None and not np.array_equal(np.asarray(head, np.float32), params["embed"]["word"]):
        raise ConfigError(
            "megatron state dict: output_layer.weight is not tied to the word embedding (ptd_jax's output layer is)"
        )

    def stack(name, shape):
        return np.stack([get(f"decoder.layers.{i}.{name}", shape) for i in range(L)])

    ln = {
        key: {ours: stack(_MEGATRON_LN[spec][key].format(theirs), (D,)) for ours, theirs in _LN_FIELDS.items()}
        for key in ("ln1", "ln2")
    }
    qkv_w = stack("self_attention.linear_qkv.weight", (3 * D, D))
    qkv_b = stack("self_attention.linear_qkv.bias", (3 * D,))
    params["layers"] = {
        **ln,
        "attn": {
            "qkv_kernel": qkv_w.reshape(L, H, 3, K, D).transpose(0, 4, 1, 2, 3),  # Megatron's per-head [H, 3, K]
            "qkv_bias": qkv_b.reshape(L, H, 3, K),
            "out_kernel": stack("self_attention.linear_proj.weight", (D, D)).transpose(0, 2, 1).reshape(L, H, K, D),
            "out_bias": stack("self_attention.linear_proj.bias", (D,)),
        },
        "mlp": {
            "fc1_kernel": stack("mlp.linear_fc1.weight", (F, D)).transpose(0, 2, 1),
            "fc1_bias": stack("mlp.linear_fc1.bias", (F,)),
            "fc2_kernel": stack("mlp.linear_fc2.weight", (D, F)).transpose(0, 2, 1),
            "fc2_bias": stack("mlp.linear_fc2.bias", (D,)),
        },
    }
    params["embed"]["word"] = params["embed"]["word"][: cfg.vocab_size]
    return float32_tree(params)
