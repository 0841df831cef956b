"""The performance model and planner (ptd_jax/perf/, `ptd-plan`): closed forms it must reproduce (bubble, state bytes
per parameter, Korthikanti et al.'s activation formula, ring all-reduce), the search's exclusion of layouts that do
not fit, the CLI's JSON keys and its bad-input contract. Pure Python: nothing here imports JAX."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ptd_jax.config import ModelConfig, model_preset
from ptd_jax.perf import HARDWARE, cli, predict
from ptd_jax.perf.hardware import ring_allreduce_seconds
from ptd_jax.perf.memory import activation_bytes_per_layer, memory_per_gpu, stashed_layers
from ptd_jax.perf.search import make_parallel, search
from ptd_jax.perf.timing import tensor_allreduce_seconds

ROOT = Path(__file__).resolve().parents[1]
A100 = HARDWARE["a100-80gb"]
GPT3 = ModelConfig(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, vocab_size=51200)


@pytest.mark.parametrize("p, k, m", [(4, None, 8), (8, None, 64), (4, 3, 16), (8, 1, 32)])
def test_bubble_is_the_papers_closed_form(p, k, m):
    """(p−1)/m for 1F1B and (p−1)/(v·m) interleaved; the bubble term is that many microbatch slots."""
    cfg = model_preset("paper-1.7b")  # 24 layers
    parallel = make_parallel(cfg, p, 1, p, 1, m, k)
    v = 1 if k is None else cfg.num_layers // (p * k)
    pred = predict(cfg, parallel, A100)
    assert pred.bubble_fraction == pytest.approx((p - 1) / (v * m), rel=1e-12)
    assert pred.terms["bubble"] == pytest.approx((p - 1) / v * pred.details["microbatch_slot_s"], rel=1e-12)


def test_state_is_18_bytes_per_parameter_or_6_plus_12_over_d():
    cfg = model_preset("paper-39.1b")
    plain = memory_per_gpu(cfg, make_parallel(cfg, 512, 8, 2, 1, 1536))
    assert plain["state"] == pytest.approx(18 * plain["params"], rel=1e-12)
    sharded = memory_per_gpu(cfg, make_parallel(cfg, 512, 8, 2, 1, 1536, use_distributed_optimizer=True))
    assert sharded["state"] == pytest.approx((6 + 12 / 32) * sharded["params"], rel=1e-12)  # d = 512/16 = 32


def test_parameters_per_gpu_add_up_to_eq2():
    """t·p GPUs of one replica hold eq. (2)'s parameters once, plus the last stage's copy of the embedding."""
    from ptd_jax.train.flops import num_params

    cfg = model_preset("paper-1.7b")
    one = memory_per_gpu(cfg, make_parallel(cfg, 1, 1, 1, 1, 8))
    assert one["params"] == pytest.approx(num_params(cfg) + 2 * cfg.hidden_size, rel=1e-12)  # + final LayerNorm


def test_activation_formula_by_hand():
    """Korthikanti et al. (2022), s b h (34 + 5 a s / h) per layer at t = 1, for s=2048, b=1, h=2304, a=24:
    s b h = 4,718,592; 5·24·2048/2304 = 106.666…; 4,718,592 × 140.666… = 663,748,608 bytes.
    ÷ 8 with t = 8 and sequence parallelism: 82,968,576. Selective at t = 2 (no SP): s b h (10 + 24/2) =
    103,809,024. Full: the layer input, 2 s b h = 9,437,184."""
    cfg = model_preset("paper-1.7b")
    assert activation_bytes_per_layer(cfg, make_parallel(cfg, 1, 1, 1, 1, 8), "none") == pytest.approx(663_748_608)
    sp = make_parallel(cfg, 8, 8, 1, 1, 8, sequence_parallel=True)
    assert activation_bytes_per_layer(cfg, sp, "none") == pytest.approx(82_968_576)
    assert activation_bytes_per_layer(cfg, make_parallel(cfg, 2, 2, 1, 1, 8), "selective") == pytest.approx(
        103_809_024)
    assert activation_bytes_per_layer(cfg, make_parallel(cfg, 1, 1, 1, 1, 8), "full") == pytest.approx(9_437_184)


def test_stashed_layers_per_schedule():
    """First stage: 1F1B holds p microbatches of l/p layers = l; interleaved l (1 + (p−1)/(p v)); GPipe m l/p."""
    cfg = model_preset("paper-1.7b")  # l = 24
    assert stashed_layers(cfg, make_parallel(cfg, 4, 1, 4, 1, 16)) == 24
    assert stashed_layers(cfg, make_parallel(cfg, 4, 1, 4, 1, 16, 3)) == pytest.approx(24 * (1 + 3 / 8))  # v = 2
    gpipe = make_parallel(cfg, 4, 1, 4, 1, 16).replace(pipeline_schedule="gpipe")
    assert stashed_layers(cfg, gpipe) == 16 * 24 / 4
    assert stashed_layers(cfg, make_parallel(cfg, 4, 1, 4, 1, 16), rank=3) == 24 / 4  # the last stage: one


def test_ring_allreduce_and_tensor_parallelism_leaving_the_node():
    assert ring_allreduce_seconds(8e9, 8, 100e9, 0.0) == pytest.approx(2 * 7 / 8 * 8e9 / 100e9)
    cfg = GPT3
    inside = tensor_allreduce_seconds(cfg, make_parallel(cfg, 1024, 8, 16, 1, 1536), A100)
    across = tensor_allreduce_seconds(cfg, make_parallel(cfg, 1024, 16, 8, 1, 1536), A100)
    assert across > 5 * inside  # t = 16 runs on InfiniBand (25 GB/s) instead of NVLink (300 GB/s)


def test_search_excludes_what_does_not_fit_and_ranks_the_rest():
    result = search(GPT3, 1024, 1536, A100)
    layout = lambda r: (r["tensor_model_parallel_size"], r["pipeline_model_parallel_size"], r["micro_batch_size"],  # noqa: E731
                        r["num_layers_per_virtual_pipeline_stage"])
    assert (2, 1, 1, None) in {layout(r) for r in result["excluded"]}  # 175B × 18 bytes on two GPUs
    assert (2, 1, 1, None) not in {layout(r) for r in result["layouts"]}
    assert all(r["memory_gb_per_gpu"] * 2**30 <= A100.usable_memory_bytes for r in result["layouts"])
    assert all(not r["fits"] and r["excluded_because"] for r in result["excluded"])
    times = [r["iteration_time_s"] for r in result["layouts"]]
    assert times == sorted(times) and len(times) > 10
    assert len(result["why"]) == 4


PREDICT = ["predict", "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
           "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
           "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "1", "--global-batch-size", "1536",
           "--num-gpus", "1024", "--hardware", "a100-80gb", "--json"]
SEARCH_KEYS = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size", "micro_batch_size",
               "num_layers_per_virtual_pipeline_stage", "tflops_per_gpu", "memory_gb_per_gpu"}


def test_cli_json_keys(capsys):
    assert cli.main(PREDICT) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"tflops_per_gpu", "iteration_time_s", "bubble_fraction", "memory_gb_per_gpu"} <= set(out)
    assert out["bubble_fraction"] == pytest.approx(15 / (3 * 192))  # v = 96/(16·2) = 3, m = 1536/8
    assert cli.main(["search", "--num-gpus", "64", "--global-batch-size", "128", "--model-preset", "paper-18.4b",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert rows and all(SEARCH_KEYS <= set(r) for r in rows)
    assert [r["iteration_time_s"] for r in rows] == sorted(r["iteration_time_s"] for r in rows)


def test_cli_text_output(capsys):
    assert cli.main(PREDICT[:-1]) == 0
    assert "TFLOP/s per GPU (paper eq. 3)" in capsys.readouterr().out
    assert cli.main(["search", "--num-gpus", "64", "--global-batch-size", "128"]) == 0
    out = capsys.readouterr().out
    assert "rank" in out and "wins:" in out and "Takeaway #1" in out


BAD = [  # (argv, a word the one error line must contain)
    (["predict", "--num-gpus", "0", "--global-batch-size", "8"], "--num-gpus: 0"),
    (["predict", "--num-gpus", "many", "--global-batch-size", "8"], "'many'"),
    (["predict", "--num-gpus", "8", "--global-batch-size", "8", "--hardware", "tpu"], "'tpu'"),
    (["predict", "--num-gpus", "8", "--global-batch-size", "8", "--tensor-model-parallel-size", "3"],
     "tensor_model_parallel_size=3"),
    (["predict", "--num-gpus", "16", "--global-batch-size", "8", "--tensor-model-parallel-size", "16"],
     "num_attention_heads=24"),
    (["predict", "--num-gpus", "2", "--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "5"], "num_layers_per_virtual_pipeline_stage=5"),
    (["predict", "--num-gpus", "8", "--global-batch-size", "12"], "global_batch_size=12"),
    (["predict", "--num-gpus", "8", "--global-batch-size", "8", "--hidden-size", "100"], "hidden_size=100"),
    (["search", "--num-gpus", "7", "--global-batch-size", "3"], "num_gpus=7"),
    (["search", "--num-gpus", str(1 << 30), "--global-batch-size", "8"], f"num_gpus={1 << 30} is more than"),
    (["search", "--global-batch-size", "8"], "--num-gpus"),
    ([], "command"),
]


@pytest.mark.parametrize("argv, word", BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(argv, word, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse
        code = stop.code
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2 and len(lines) == 1 and re.match(r"ptd-plan( predict| search)?: error: ", lines[0]), captured.err
    assert word in lines[0]
    assert captured.out == ""


def test_the_planner_imports_no_jax():
    code = "import sys, ptd_jax.perf.cli; print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_table1_script_cites_the_papers_numbers_and_predicts_through_the_cli():
    from experiments.table1_plan import PUBLISHED_TFLOPS_PER_GPU, predict_row
    from ptd_jax.config import PAPER_TABLE_1

    assert PUBLISHED_TFLOPS_PER_GPU == {r.name: r.published_tflops_per_gpu for r in PAPER_TABLE_1}
    row = predict_row(PAPER_TABLE_1[0])
    assert row["num_gpus"] == 32 and row["tensor_model_parallel_size"] == 1 and row["tflops_per_gpu"] > 0
