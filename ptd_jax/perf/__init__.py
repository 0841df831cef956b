"""The paper's performance analysis (§3) as a model: the time of one iteration term by term, the memory per GPU,
and a planner that searches the PTD-P layouts of a GPU count. Pure Python, no JAX (`ptd-plan` starts at once).

    hardware.py   GPU + node presets (a100-80gb = the paper's Selene DGX, h100-sxm, h200) and collective times
    memory.py     weights, gradients, optimizer state, stashed activations per schedule and recompute policy
    timing.py     `predict()`: GEMMs, elementwise kernels, recomputation, TP all-reduce, pipeline p2p, bubble,
                  data-parallel all-reduce, optimizer step
    search.py     every layout of N GPUs that fits, ranked, and why the best one wins (the paper's takeaways)

The console script, `ptd-plan predict|search`, is `ptd_jax/cli/plan.py`.
"""

from ptd_jax.perf.hardware import HARDWARE, Hardware
from ptd_jax.perf.memory import memory_per_gpu
from ptd_jax.perf.timing import Prediction, predict

__all__ = ["HARDWARE", "Hardware", "Prediction", "memory_per_gpu", "predict"]
