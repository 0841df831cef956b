"""Inference: KV-cache decoding on one device or tensor-parallel (`decode.py`) and sampling (`generate.py`)."""
