"""`ptd-plan energy` (`cli/energy.py`): a plan written for `ptd-train --gpu-clock-plan`, the frontier's PNG, and bad
input as one line with exit 2."""

import json

import pytest

from ptd_jax.cli.energy import PLAN_FORMAT, main
from tests.helpers.cli import exit_code


def test_plan_file_and_frontier(tmp_path, capsys):
    plan, png = tmp_path / "plan.json", tmp_path / "frontier.png"
    argv = ["--schedule", "zb-v", "-p", "3", "-m", "4", "--b-time", "1.3", "--epsilon", "0.01"]
    assert main([*argv, "--output", str(plan), "--plot", str(png), "--max-nodes", "5000"]) == 0
    out = capsys.readouterr().out
    assert "clock per pipeline rank (MHz)" in out and "per action could save at most" in out
    record = json.loads(plan.read_text())
    assert record["format"] == PLAN_FORMAT and record["p"] == 3 and record["hardware"] == "a100-80gb"
    assert len(record["clocks_mhz"]) == 3 and record["predicted"]["slowdown"] <= 0.01
    assert record["predicted"]["per_action_bound_saving"] >= record["predicted"]["saving"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert [row["epsilon"] for row in record["frontier"]][:2] == [0.0, 0.0025]


def test_a_model_layout(capsys):
    argv = ["--schedule", "interleaved", "-v", "2", "-p", "4", "-t", "2", "--num-gpus", "16", "--num-layers", "24"]
    assert main([*argv, "--global-batch-size", "16", "--epsilon", "0.01", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["m"] == 8 and record["predicted"]["full_clock_time_s"] > 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--epsilon", "-0.01"], "epsilon=-0.01"),
        (["--epsilon", "nan"], "epsilon=nan"),
        (["--hardware", "tpu-v4"], "hardware='tpu-v4'"),
        (["--profile", "{bad}"], "--profile"),
        (["--plot", "frontier.pdf"], "must name a .png"),
        (["--num-gpus", "8"], "needs --global-batch-size"),
    ],
)
def test_bad_input_one_line_exit_2(tmp_path, capsys, argv, words):
    if argv[0] == "--profile":
        (tmp_path / "bad.json").write_text("{not json")
        argv = ["--profile", str(tmp_path / "bad.json")]
    assert exit_code(main, argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


@pytest.mark.parametrize(
    "clocks_mhz, words",
    [([1980, 1900], "holds 2 clocks (p=2) but the run has pipeline_model_parallel_size=1"), ([1980], "'cpu'")],
)
def test_ptd_train_refuses_a_plan_for_another_run(tmp_path, capsys, clocks_mhz, words):
    """ptd-train --gpu-clock-plan: a plan for another p or GPU stops before training with one line, exit 2."""
    from ptd_jax.cli.train import main as train_main

    plan = tmp_path / "plan.json"
    fields = {"format": PLAN_FORMAT, "hardware": "h200", "epsilon": 0.01, "max_clock_mhz": 1980}
    plan.write_text(json.dumps({**fields, "clocks_mhz": clocks_mhz}))
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32"]
    layout = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1"]
    layout += ["--global-batch-size", "8", "--no-progress", "--mock-data"]
    assert exit_code(train_main, [*model, *layout, "--gpu-clock-plan", str(plan)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_ptd_plan_registers_energy(capsys):
    from ptd_jax.cli.plan import main as plan_main

    assert plan_main(["energy", "--schedule", "1f1b", "-p", "2", "-m", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == PLAN_FORMAT
    assert exit_code(plan_main, ["energy", "--hardware", "tpu-v4"]) == 2
    assert "hardware='tpu-v4'" in capsys.readouterr().err
