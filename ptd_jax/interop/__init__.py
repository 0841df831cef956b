"""Interop with the PyTorch ecosystem, numpy only (no torch at run time).

hf.py        Hugging Face folders (config.json + safetensors, sharded too): `from_hf`, `to_hf` for GPT-2, and the
             dispatch to the Llama family
hf_llama.py  LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM: config fields (v4 `rope_scaling` and v5
             `rope_parameters`) and tensors
megatron.py  megatron-core GPTModel state dicts: `from_megatron`, `to_megatron` (GPT-2 and the Llama switches)
tensors.py   what both share
"""

from ptd_jax.interop.hf import from_hf, model_config_from_hf, to_hf
from ptd_jax.interop.megatron import from_megatron, to_megatron

__all__ = ["from_hf", "from_megatron", "model_config_from_hf", "to_hf", "to_megatron"]
