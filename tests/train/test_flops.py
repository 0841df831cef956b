import pytest

from ptd_jax.config import model_preset
from ptd_jax.train.flops import (device_peak_tflops, flops_per_iteration, model_flops_per_iteration, num_params,
                           training_days)


def test_eq3_by_hand_for_the_paper_1_7b_preset():
    """eq. (3) for Table 1's 1.7B row (B=512, s=2048, l=24, h=2304, V=51200), evaluated by hand:
    96·B·s·l·h² = 96·512·2048·24·5,308,416 = 12,824,703,626,379,264 and
    1 + s/(6h) + V/(16lh) = 1 + 2048/13824 + 51200/884736 = 1 + 0.1481481… + 0.0578704… = 1.2060185…
    so F = 1.54668e16 FLOPs per iteration."""
    cfg = model_preset("paper-1.7b")
    assert flops_per_iteration(cfg, 512) == pytest.approx(12_824_703_626_379_264 * 1.2060185185, rel=1e-9)
    assert flops_per_iteration(cfg, 512) == pytest.approx(1.54668e16, rel=1e-5)


def test_model_flops_is_eq3_without_the_recomputed_forward():
    cfg = model_preset("paper-1t")
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200
    expected = 72 * B * s * l * h**2 * (1 + s / (6 * h)) + 6 * B * s * h * V
    assert model_flops_per_iteration(cfg, B) == pytest.approx(expected, rel=1e-12)
    assert model_flops_per_iteration(cfg, B) / flops_per_iteration(cfg, B) == pytest.approx(0.75, abs=0.01)


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
