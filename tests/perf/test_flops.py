"""FLOP counts (`ptd_jax/perf/flops.py`): the paper's eq. (2)-(4), model and hardware FLOPs per recompute policy,
schedule and attention backend, against hand counts and the traced programs; the GPU peaks table."""

import pytest

from ptd_jax.presets import PAPER_VOCAB_SIZE, model_preset
from ptd_jax.perf.flops import (
    flops_per_iteration,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    num_params,
    training_days,
)
from ptd_jax.perf.hardware import device_peak_tflops


def test_eq3_by_hand_for_the_paper_1_7b_preset():
    """eq. (3) for Table 1's 1.7B row (B=512, s=2048, l=24, h=2304, V=51200), evaluated by hand:
    96·B·s·l·h² = 96·512·2048·24·5,308,416 = 12,824,703,626,379,264 and
    1 + s/(6h) + V/(16lh) = 1 + 2048/13824 + 51200/884736 = 1 + 0.1481481… + 0.0578704… = 1.2060185…
    so F = 1.54668e16 FLOPs per iteration."""
    cfg = model_preset("paper-1.7b")
    assert flops_per_iteration(cfg, 512, PAPER_VOCAB_SIZE) == pytest.approx(
        12_824_703_626_379_264 * 1.2060185185, rel=1e-9
    )
    assert flops_per_iteration(cfg, 512, PAPER_VOCAB_SIZE) == pytest.approx(1.54668e16, rel=1e-5)


def test_model_flops_is_eq3_without_the_recomputed_forward():
    cfg = model_preset("paper-1t")
    B, s, L, h, V = 3072, 2048, 128, 25600, 51200
    expected = 72 * B * s * L * h**2 * (1 + s / (6 * h)) + 6 * B * s * h * V
    Vp = cfg.padded_vocab_size(8)  # the row's t = 8 pads GPT-2's 50,257 to 51,200
    assert model_flops_per_iteration(cfg, B, Vp) == pytest.approx(expected, rel=1e-12)
    assert model_flops_per_iteration(cfg, B, Vp) / flops_per_iteration(cfg, B, Vp) == pytest.approx(0.75, abs=0.01)


def test_eq4_training_time_for_gpt3_175b():
    """The paper's §5.1 example: GPT-3 175B on 300B tokens, 1024 A100s at 140 TFLOP/s -> about 34 days."""
    assert training_days(300e9, 175e9, 1024, 140) == pytest.approx(34, abs=1)


def test_eq2_parameters_of_gpt2_small_architecture():
    cfg = model_preset("gpt2-small")
    assert num_params(cfg, vocab_size=50257) == pytest.approx(124.4e6, rel=0.01)  # GPT-2 small: 124M


def test_peak_table_and_override():
    assert device_peak_tflops("NVIDIA H200", bf16=True)[0] == 989.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB", bf16=True)[0] == 312.0
    assert device_peak_tflops("cpu", bf16=False, override=1.5) == (1.5, "--peak-tflops")
    peak, source = device_peak_tflops("cpu", bf16=False)
    assert peak > 0 and source.startswith("measured")


def test_peaks_tell_h100_pcie_from_sxm():
    assert device_peak_tflops("NVIDIA H100 PCIe", bf16=True)[0] == 756.0
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", bf16=True)[0] == 989.0  # the SXM part's device kind
    assert device_peak_tflops("NVIDIA H100 NVL", bf16=False)[0] == 418.0
    assert device_peak_tflops("NVIDIA A100 80GB PCIe", bf16=True)[0] == 312.0


def test_model_flops_follow_the_ffn_width():
    """fc1 and fc2 are 2·h·F each per token forward: doubling F from 4h to 8h adds 3·2·2·h·4h per layer-token."""
    cfg = model_preset("gpt2-small")
    wide = cfg.replace(ffn_hidden_size=8 * cfg.hidden_size)
    tokens, h, L = 8 * cfg.seq_length, cfg.hidden_size, cfg.num_layers
    assert model_flops_per_iteration(wide, 8) - model_flops_per_iteration(cfg, 8) == pytest.approx(
        3 * 4 * h * 4 * h * tokens * L, rel=1e-12
    )


def test_hardware_flops_by_recompute_policy():
    """Matmul FLOPs of jax.grad of model.loss_sum (2 layers, h 256, s 256, V 6400, B 2), counted on its jaxpr with
    ptd_jax.analysis.jaxpr.dot_flops: none 10,670,309,376; selective 10,804,527,104 (+ Q·Kᵀ, 2·s·h per
    token-layer: remat drops the context matmul, whose output the backward does not need); full 12,012,486,656
    (+ the layer's forward but fc2, for the same reason)."""
    from ptd_jax.config import ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=6400, seq_length=256)
    assert (
        hardware_flops_per_iteration(cfg, 2, 6400, "none") == 10_670_309_376 == model_flops_per_iteration(cfg, 2, 6400)
    )
    assert hardware_flops_per_iteration(cfg, 2, 6400, "selective") == 10_804_527_104
    assert hardware_flops_per_iteration(cfg, 2, 6400, "full") == 12_012_486_656


BENCH = dict(num_layers=16, hidden_size=256, num_attention_heads=8, vocab_size=6400, seq_length=256)


@pytest.mark.parametrize(
    "case",
    [
        # Matmul FLOPs counted on the traced executor's jaxpr by experiments/bench/counts/pipeline_flops.py
        # (recompute full: results/pipeline_flops.json; none and selective: the same `measure` with the step's
        # recompute set), per device: (model, schedule, p, v, m, t, recompute, uniform per rank, per-rank per rank)
        (BENCH, "1f1b-lockstep", 4, 1, 8, 1, "full", 96905199616.0, [55834574848.0] * 3 + [75967234048.0]),
        (BENCH, "interleaved", 4, 2, 8, 1, "full", 86436216832.0, [55834574848.0] * 3 + [75967234048.0]),
        ("1.3b", "1f1b-lockstep", 4, 1, 16, 2, "full", 61074434949120.0, [42880953483264.0] * 3 + [53034256171008.0]),
        (BENCH, "1f1b-lockstep", 4, 1, 8, 1, "none", 82141249536.0, [45097156608.0] * 3 + [65229815808.0]),
        (BENCH, "1f1b-lockstep", 4, 1, 8, 1, "selective", 83617644544.0, [46170898432.0] * 3 + [66303557632.0]),
    ],
)
def test_pipeline_hardware_flops_equal_the_traced_executor(case):
    from ptd_jax.config import ModelConfig
    from ptd_jax.parallel.pipeline import build

    model, schedule, p, v, m, t, recompute, uniform, per_rank = case
    cfg = model_preset(model) if isinstance(model, str) else ModelConfig(**model)
    sched = build(schedule, p, v, m)
    V = cfg.padded_vocab_size(t)
    assert hardware_flops_per_iteration(cfg, m, V, recompute, sched, "uniform") == pytest.approx(
        uniform * p * t, rel=1e-12
    )
    assert hardware_flops_per_iteration(cfg, m, V, recompute, sched, "per-rank") == pytest.approx(
        sum(per_rank) * t, rel=1e-12
    )


@pytest.mark.parametrize(
    "schedule, v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("1f1b-lockstep", 1), ("zb-h1", 1), ("zb-v", 2)]
)
def test_per_rank_pipeline_runs_the_model_flops_plus_the_recomputation_only(schedule, v):
    """Under "per-rank" branching no idle cell computes, so a pipeline executes what one device would: the model
    FLOPs, plus the recomputation of the policy (none: the stashed vjp residuals, nothing again; selective and full:
    each layer checkpointed as in the reference)."""
    from ptd_jax.parallel.pipeline import build

    cfg = model_preset("gpt2-small")
    sched = build(schedule, 4, v, 8)
    for recompute in ("none", "selective", "full"):
        assert hardware_flops_per_iteration(cfg, 16, None, recompute, sched, "per-rank") == pytest.approx(
            hardware_flops_per_iteration(cfg, 16, None, recompute), rel=1e-12
        )
    if sched.spec.rows == "lockstep":  # unit tables run per-rank only
        assert hardware_flops_per_iteration(cfg, 16, None, "none", sched, "uniform") > model_flops_per_iteration(
            cfg, 16
        )


SMALL = dict(num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=6400, seq_length=256)


def test_hardware_flops_count_what_the_attention_backend_executes():
    """The small model of `test_hardware_flops_by_recompute_policy` (B 2, so 2 sequences and 512 tokens) by hand.
    Pallas, blocks of 64 over s = 256 (n = 4 query and key blocks), head width 32: 10 causal block pairs per head
    for the forward and the dq kernel (1+2+3+4), 10 for the dk/dv kernel (4+3+2+1); a block pair's matmul is
    2·64·64·32 = 262,144 FLOPs, 2,097,152 over the 8 heads. Per sequence: forward 2 matmuls × 10 pairs =
    41,943,040 (dense: 4·s²·h = 67,108,864), backward (4 + 3) × 10 pairs = 146,800,640 (dense: 134,217,728).
    Per layer over 2 sequences: 377,487,360 against xla's 12·512·256·256 = 402,653,184, so none is
    10,670,309,376 − 2·25,165,824 = 10,619,977,728; selective the same (the kernel's output is kept: nothing is
    recomputed); full adds per layer QKV, out and fc1 (805,306,368 − 268,435,456) and the kernel's forward
    (83,886,080): + 2·620,756,992 = 11,861,491,712.
    cuDNN, FlashAttention-2's count: forward 2·512·256·256 = 67,108,864, backward 5·512·256·256 = 167,772,160 per
    layer: none 10,670,309,376 − 2·(402,653,184 − 234,881,024) = 10,334,765,056; full + 2·(536,870,912 +
    67,108,864) = 11,542,724,608. The model FLOPs (MFU's numerator) stay the model's whatever the backend."""
    from ptd_jax.config import ModelConfig
    from ptd_jax.perf.flops import attention_flops

    xla = ModelConfig(**SMALL)
    pallas, cudnn = xla.replace(attention_backend="pallas"), xla.replace(attention_backend="cudnn")
    assert attention_flops(pallas, 256) == (41_943_040, 146_800_640)
    assert attention_flops(xla, 256) == (67_108_864, 134_217_728)
    expected = {
        pallas: (10_619_977_728, 10_619_977_728, 11_861_491_712),
        cudnn: (10_334_765_056, 10_334_765_056, 11_542_724_608),
        xla: (10_670_309_376, 10_804_527_104, 12_012_486_656),
    }
    for cfg, counts in expected.items():
        got = tuple(hardware_flops_per_iteration(cfg, 2, 6400, r) for r in ("none", "selective", "full"))
        assert got == counts, cfg.attention_backend
        assert model_flops_per_iteration(cfg, 2, 6400) == 10_670_309_376


def test_flash_tiling_is_the_kernels():
    """`flash_block_pairs` restates the kernel's tiling without JAX: its blocks and padded length are
    `BlockSizes.for_seq`'s; at s = 2048, n = 32 blocks: n(n+1)/2 = 528 pairs, 33/64 of the dense forward."""
    from pallas_kernels.flash_attention import BlockSizes

    from ptd_jax.perf.flops import flash_block_pairs

    for s in (8, 16, 100, 256, 1000, 2048):
        blocks, padded = BlockSizes().for_seq(s)
        got = flash_block_pairs(s)
        assert (got["block_q"], got["block_k"], got["padded"]) == (blocks.block_q, blocks.block_k, padded)
    assert flash_block_pairs(2048)["forward"] == flash_block_pairs(2048)["dkdv"] == 528
    assert flash_block_pairs(100) == {"block_q": 64, "block_k": 64, "padded": 128, "forward": 3, "dkdv": 3}
    assert flash_block_pairs(256, 64, 32)["forward"] == 2 + 4 + 6 + 8
    assert flash_block_pairs(256, 64, 32)["dkdv"] == sum(4 - j * 32 // 64 for j in range(8))


def test_the_flash_kernels_run_per_recompute_policy():
    """What the count above assumes, on the traced gradient of the model with the Pallas backend (2 layers): one
    forward kernel and the two backward kernels per layer under none and selective (the policy keeps the kernel's
    output), the forward kernel twice under full."""
    from collections import Counter

    import jax
    import jax.numpy as jnp

    from ptd_jax import model as gpt
    from ptd_jax.analysis.jaxpr import tally
    from ptd_jax.config import ModelConfig

    cfg = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=2, vocab_size=128, seq_length=128, attention_backend="pallas"
    )
    params = gpt.init_params(jax.random.key(0), cfg)
    tokens = jnp.zeros((2, 128), jnp.int32)

    def kernels(eqn):
        if eqn.primitive.name != "pallas_call":
            return None
        return Counter({str(eqn.params["name"]).split()[0]: 1})

    for recompute, forwards in (("none", 2), ("selective", 2), ("full", 4)):
        jaxpr = jax.make_jaxpr(
            jax.grad(lambda p, r=recompute: gpt.loss_sum(p, tokens, tokens, tokens + 1, cfg, recompute=r))
        )(params)
        assert dict(tally(jaxpr.jaxpr, kernels)) == {
            "flash_attention_fwd": forwards,
            "flash_attention_dkdv": 2,
            "flash_attention_dq": 2,
        }, recompute
