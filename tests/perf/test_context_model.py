"""Context parallelism in the performance model (`perf/context.py`): the bytes per layer equal the compiled HLO's
formula, the ring hides behind long blocks and not behind short ones, and the stash terms."""

import pytest

from ptd_jax.config import ParallelConfig, model_preset
from ptd_jax.perf.context import (
    context_bytes_per_layer,
    context_seconds_per_layer,
    kv_block_bytes,
    ring_stash_bytes_per_layer,
)
from ptd_jax.perf.hardware import HARDWARE

LLAMA = model_preset("llama3-8b")  # G = 8 key/value heads of K = 128


def layout(c, comm="p2p", t=1):
    return ParallelConfig(context_parallel_size=c, cp_comm_type=comm, tensor_model_parallel_size=t)


def test_bytes_per_layer_are_the_formulas_of_the_compiled_hlo():
    cfg = LLAMA.replace(seq_length=8192)
    kv = 2 * 2 * 1 * 4096 * 8 * 128  # bf16 K and V of one rank's 4096 tokens
    assert kv_block_bytes(cfg, layout(2)) == kv
    assert context_bytes_per_layer(cfg, layout(2)) == {"forward": kv, "backward": kv + 2 * 2 * kv}
    assert context_bytes_per_layer(cfg, layout(2, "all_gather")) == {"forward": kv, "backward": kv + 2 * kv}
    assert context_bytes_per_layer(cfg, layout(1)) == {"forward": 0.0, "backward": 0.0}
    assert kv_block_bytes(cfg, layout(2, t=2)) == kv / 2  # only the rank's G/t key/value heads travel


def test_the_ring_hides_behind_long_blocks_only():
    hw = HARDWARE["h200"]
    long = context_seconds_per_layer(LLAMA.replace(seq_length=131072), layout(8), hw)
    short = context_seconds_per_layer(LLAMA.replace(seq_length=2048), layout(8), hw)
    assert long["forward"] == 0.0  # 16k-token blocks: the attention outlasts the hop
    assert short["forward"] > 0.0
    gathered = context_seconds_per_layer(LLAMA.replace(seq_length=131072), layout(8, "all_gather"), hw)
    assert gathered["forward"] > long["forward"]


@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_the_stash_terms(comm):
    cfg = LLAMA.replace(seq_length=8192)
    assert ring_stash_bytes_per_layer(cfg, layout(1, comm)) == 0.0
    extra = ring_stash_bytes_per_layer(cfg, layout(4, comm))
    if comm == "p2p":
        assert extra == 4 * 32 * 2048 + 3 * kv_block_bytes(cfg, layout(4))
    else:
        assert extra == 4 * 32 * 2048 * 8192
