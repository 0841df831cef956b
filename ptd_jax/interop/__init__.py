"""Interop with the PyTorch ecosystem, numpy only (no torch at run time).

hf.py        Hugging Face GPT-2 folders (config.json + model.safetensors): `from_hf`, `to_hf`
megatron.py  megatron-core GPTModel state dicts: `from_megatron`, `to_megatron`
tensors.py   what both share
"""

from ptd_jax.interop.hf import from_hf, model_config_from_hf, to_hf
from ptd_jax.interop.megatron import from_megatron, to_megatron

__all__ = ["from_hf", "from_megatron", "model_config_from_hf", "to_hf", "to_megatron"]
