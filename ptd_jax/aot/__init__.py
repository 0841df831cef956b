"""Ahead-of-time compilation for GPUs that are not here: XLA:GPU compiles against a described device, so "will this
layout fit on 8 H100s, and what does it run?" is answered on a CPU-only machine.

    targets.py  the GPUs we compile for (`a100-80gb`, `h100-sxm`, `h200`): XLA's device description, with sources
    compile.py  the training and evaluation steps built from shapes on a virtual topology, compiled, summarized
"""
