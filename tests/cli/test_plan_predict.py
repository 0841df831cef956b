"""`ptd-plan predict` takes ptd-train's command line: the same parser and defaults, the configs `--compile-only`
builds (`configs_for_target`), the ignored flags named, and stdout that is only JSON under --json."""

import json

import pytest

from ptd_jax.cli.plan import main as plan
from ptd_jax.cli.plan import run as plan_run


def test_ptd_trains_defaults_are_the_predictions_defaults(capsys):
    """No flags but the layout: ptd-train's tiny preset, float32, recompute none, b = 4, B = 16, h100-sxm, the
    kernels a GPU resolves (Pallas attention, fused kernels)."""
    result = plan_run(["predict", "--tensor-model-parallel-size", "2", "--json"])
    capsys.readouterr()
    assert result["recompute_granularity"] == "none"
    # --num-gpus defaults to t * p as in --compile-only: d = 1, m = B / b = 16 / 4
    assert result["micro_batch_size"] == 4 and result["num_microbatches"] == 4
    assert result["hardware"] == "h100-sxm" and result["num_gpus"] == 2
    assert result["resolved"]["attention_backend"] == "pallas" and result["resolved"]["fused_kernels"]
    assert result["resolved"]["dtype"] == "float32"


def test_flags_without_effect_are_accepted_and_named(capsys):
    argv = ["predict", "--lr", "3e-3", "--save", "/nonexistent/ckpt", "--train-iters", "7", "--bf16"]
    assert plan(argv) == 0
    out = capsys.readouterr().out
    assert "ignored (no effect on the prediction): --train-iters --lr --save" in out
    assert "bfloat16" in out  # a flag that matters is not in the list


def test_auto_prints_its_choice_on_stderr_and_json_alone_on_stdout(capsys):
    argv = ["predict", "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--pipeline-schedule", "auto"]
    assert plan([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)  # nothing else on stdout
    assert "pipeline schedule:" in err
    assert result["resolved"]["pipeline_schedule"] in ("1f1b", "interleaved", "zb-h1", "zb-v", "gpipe", "1f1b-lockstep")


def test_the_memory_terms_add_up_and_the_budget_is_jaxs(capsys, monkeypatch):
    result = plan_run(["predict", "--model-preset", "1.3b", "--bf16", "--micro-batch-size", "1", "--json"])
    capsys.readouterr()
    terms = result["memory_terms_gb"]
    parts = ("weights", "compute_copy", "gradients", "optimizer", "stash", "recompute", "logits")
    assert sum(terms[k] for k in parts) == pytest.approx(result["memory_gb_per_gpu"])
    assert result["allocator_fraction"] == 0.75
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    half = plan_run(["predict", "--model-preset", "1.3b", "--bf16", "--micro-batch-size", "1", "--json"])
    capsys.readouterr()
    assert half["usable_memory_gb"] == pytest.approx(result["usable_memory_gb"] * 0.5 / 0.75)


def test_a_search_that_nothing_satisfies_is_one_line_and_exit_1(capsys):
    argv = ["search", "--model-preset", "paper-145.6b", "--num-gpus", "8", "--global-batch-size", "8"]
    assert plan(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "no layout of num_gpus=8 GPUs fits" in err


def test_a_tokenizer_that_cannot_be_read_is_one_line_and_exit_2(capsys):
    argv = ["predict", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent", "--merge-file", "/x"]
    assert plan(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "--vocab-file" in err


def test_context_parallelism_divides_the_stash_and_the_time(capsys):
    base = ["predict", "--model-preset", "gpt2-small", "--attention-backend", "xla", "--cp-comm-type", "all_gather"]
    one, two = (plan_run([*base, "--context-parallel-size", c, "--json"]) for c in ("1", "2"))
    capsys.readouterr()
    assert two["num_gpus"] == 2 * one["num_gpus"] and not two["notes"]
    # the logits and their gradient halve; the output layer's weight gradient (h x V, float32 here) does not
    halved = 2 * (one["memory_terms_gb"]["logits"] - two["memory_terms_gb"]["logits"])
    weight_gradient = 4 * 768 * 50304 / 2**30
    assert one["memory_terms_gb"]["logits"] == pytest.approx(halved + weight_gradient)
    # each GPU runs half the tokens: the GEMMs' time halves (their roofline is compute-bound here), and the K/V
    # gather and the gradient all-reduce over the two context ranks appear
    assert two["terms_s"]["gemm"] < 0.6 * one["terms_s"]["gemm"]
    assert two["terms_s"]["context_comm"] > 0.0 == one["terms_s"]["context_comm"]
    assert two["terms_s"]["data_parallel_comm"] > 0.0 == one["terms_s"]["data_parallel_comm"]
