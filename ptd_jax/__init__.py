"""ptd_jax: Megatron-LM's PTD-P training (tensor, pipeline and data parallelism) on JAX. README.md has the reading
order; docs/architecture.md the design.

On a machine without an NVIDIA GPU, the CUDA plugin (the gpu-compile extra, which compiles for GPUs that are not
here) would print a traceback from its driver check at JAX's start-up; with no GPU there is nothing to check, so
the check is skipped (set before any JAX backend starts; a value set by the user wins).
"""

import glob as _glob
import os as _os

if not (_os.path.exists("/dev/nvidiactl") or _glob.glob("/dev/nvidia[0-9]*")):
    _os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
