"""The p2p ring on the Pallas flash kernel (`parallel/context.py`) compiles with XLA:GPU (Triton) for sm_80 and sm_90:
`ptd-train --compile-only` of a grouped-query model at c = 2, bf16, every kernel compiled (not interpreted), each
visible sub-block one forward kernel and two backward ones. Needs the gpu-compile extra; no GPU."""

import json

import pytest

from ptd_jax.cli.train import main

TINY = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--group-query-attention"]
TINY += ["--num-query-groups", "2"]
TINY += ["--seq-length", "512", "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16"]


@pytest.mark.slow  # 22 s each; the default run compiles the 3-D step and the kernels alone for the GPU
@pytest.mark.parametrize("target", ["a100-80gb", "h100-sxm"])  # sm_80, sm_90
def test_the_kernel_ring_compiles_for_the_gpu(target, capsys):
    argv = [*TINY, "--context-parallel-size", "2", "--attention-backend", "pallas", "--tensor-model-parallel-size"]
    argv += ["1", "--compile-only", "--target", target, "--num-gpus", "2", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["resolved"]["attention_backend"] == "pallas" and summary["layout"]["context"] == 2
    # the layer scan's body counts once: at c = 2 the ring visits 6 sub-blocks (hop 0: two diagonals and one full;
    # hop 1: one full and two under conds, one of which runs), each a forward, a dQ and a dK/dV kernel; 2 LayerNorms per
    # layer and the final one (forward, backward), the loss (statistics, gradient)
    assert summary["kernels"]["pallas_triton"] == 6 * 3 + 2 * 2 + 2 + 2
    assert summary["collectives"]["collective-permute"]["count"] > 0
