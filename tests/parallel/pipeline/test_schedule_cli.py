"""ptd-schedule on the split schedules (times, in-flight counts, plot), the schedule chooser and `ptd-train
--pipeline-schedule auto`."""

import json
import subprocess
import sys

import pytest

from ptd_jax.cli.schedule import main as schedule_main
from ptd_jax.perf.auto_schedule import choose_schedule, format_choice


def schedule_json(capsys, *args):
    assert schedule_main(["-p", "4", "-m", "8", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name, v, makespan", [("1f1b", 1, 30.0), ("zb-h1", 1, 27.0), ("zb-v", 2, 25.5)])
def test_json_of_split_schedules(capsys, name, v, makespan):
    out = schedule_json(capsys, "--schedule", name, "--f-time", "1", "--b-time", "1", "--w-time", "1")
    assert out["schedule"] == name and out["v"] == v  # zb-v defaults to v = 2
    assert out["times"] == {"f": 1.0, "b": 1.0, "w": 1.0}
    assert out["makespan"] == pytest.approx(makespan)
    assert len(out["peak_w_stash"]) == 4 and max(out["peak_w_stash"]) >= 1
    assert max(out["peak_in_flight"]) <= 4 * v  # from F until W: 1F1B's p stages at most
    slower = schedule_json(capsys, "--schedule", name, "--f-time", "1", "--b-time", "1", "--w-time", "2")
    assert slower["times"]["w"] == 2.0 and slower["makespan"] > out["makespan"]


def test_backward_ratio_still_sets_b_plus_w(capsys):
    out = schedule_json(capsys, "--schedule", "1f1b", "--backward-ratio", "3")
    assert out["times"] == {"f": 1.0, "b": 1.5, "w": 1.5} and out["backward_ratio"] == 3.0
    # on unit ticks a tick lasts its longest cell: 1F1B's I and W of 1.5 each beside the F's 1 cost a little less
    # than the fused lockstep table's (p-1)/m
    assert 2 * (4 - 1) / (3 * 8) < out["bubble_fraction"] <= 3 / 8


def test_text_summary_of_zb_v(capsys):
    assert schedule_main(["--schedule", "zb-v", "-p", "4", "-m", "8"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "no closed form" in last and "in flight from F to W [8, 8, 8, 8]" in last and "makespan 25.5" in last


def test_plot_of_zb_v(tmp_path, capsys):
    path = tmp_path / "zbv.png"
    assert schedule_main(["--schedule", "zb-v", "-p", "4", "-m", "8", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_chooser_picks_zb_v_then_falls_back_when_memory_refuses():
    name, v, rows = choose_schedule(4, None, 8, (1, 1, 1))
    assert (name, v) == ("zb-v", 2)
    by = {r["schedule"]: r for r in rows}
    assert set(by) == {"gpipe", "1f1b", "1f1b-lockstep", "interleaved", "zb-h1", "zb-v"}
    assert by["zb-v"]["makespan"] == pytest.approx(25.5) and by["zb-v"]["bubble_fraction"] == pytest.approx(1 / 16)
    assert by["zb-v"]["in_flight"] == 4 and by["zb-v"]["why"] == "the shortest simulated step"
    name, v, rows = choose_schedule(4, None, 8, (1, 1, 1), memory_ok=lambda n, v, s: n not in ("zb-v", "zb-h1"))
    assert (name, v) == ("interleaved", 2)
    assert [r["schedule"] for r in rows if not r["fits"]] == ["zb-h1", "zb-v"]
    text = format_choice(name, rows)
    assert text.splitlines()[0].startswith("pipeline schedule: interleaved (v=2)") and "does not fit" in text
    name, v, _ = choose_schedule(4, None, 8, (1, 1, 1), v_options=())  # no chunks: ZB-H1
    assert (name, v) == ("zb-h1", 1)


def test_chooser_takes_less_memory_within_its_margin():
    """A schedule within `MARGIN` of the shortest simulated step that holds less wins, and says why."""
    from ptd_jax.perf.auto_schedule import MARGIN

    gib = {"gpipe": 9.0, "1f1b": 5.0, "1f1b-lockstep": 5.5, "interleaved": 6.0, "zb-h1": 7.0, "zb-v": 6.5}
    # at 1 : 8/7 : 6/7 ZB-V (28.43) and interleaved (28.50) are within 0.3%: the smaller memory wins
    name, v, rows = choose_schedule(4, None, 8, (1, 8 / 7, 6 / 7), memory=lambda n, v, t: gib[n] * 2**30)
    assert (name, v) == ("interleaved", 2)
    chosen = next(r for r in rows if r["schedule"] == name)
    assert chosen["why"].startswith(f"within {MARGIN:.0%} of the shortest simulated step (zb-v")
    assert "6 GiB against 6.5" in chosen["why"] and "6.00 GiB" in format_choice(name, rows)
    gib["interleaved"] = 7.0  # holding more: the shortest step wins
    assert choose_schedule(4, None, 8, (1, 8 / 7, 6 / 7), memory=lambda n, v, t: gib[n] * 2**30)[0] == "zb-v"


def test_zb_v_gets_two_chunks_per_rank_in_ptd_train():
    from ptd_jax.cli import train as cli

    args = cli.build_parser().parse_args(
        [
            "--fake-devices",
            "4",
            "--pipeline-model-parallel-size",
            "4",
            "--num-layers",
            "8",
            "--pipeline-schedule",
            "zb-v",
        ]
    )
    cli.fill_defaults(args)
    parallel = cli.parallel_config_from_args(args, cli.model_config_from_args(args), 4)
    assert parallel.pipeline_schedule == "zb-v" and parallel.virtual_pipeline_stages == 2


@pytest.mark.slow  # 18 s, a training process; the default run checks auto's layout exactly (test_executor.py)
def test_ptd_train_auto_prints_its_choice():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ptd_jax.cli.train",
            "--fake-devices",
            "4",
            "--pipeline-model-parallel-size",
            "4",
            "--pipeline-schedule",
            "auto",
            "--train-iters",
            "1",
            "--global-batch-size",
            "16",
            "--micro-batch-size",
            "2",
            "--eval-iters",
            "0",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the tiny model's 4 layers do not split into 2·p chunks: no interleaved, no ZB-V; ZB-H1 is the shortest
    # F:B:W from the model's FLOPs (B: the backward but the kernels' gradients, W those): 1 : 8/7 : 6/7 here
    assert "pipeline schedule: zb-h1 (v=1), the shortest simulated step at F:B:W = 1:1.14286:0.857143" in proc.stdout
    block = proc.stdout.split("\nptd_jax:")[0]
    assert " * zb-h1" in block and "1f1b " in block and "zb-v" not in block and "interleaved" not in block
    assert json.loads(proc.stdout.splitlines()[-1])["iterations"] == 1


class _Device:
    """A device with `bytes_limit` of memory (what `perf.memory.device_memory_bytes` reads)."""

    platform, device_kind = "gpu", "test GPU"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_auto_keeps_to_the_memory_the_device_has():
    """With room for everything auto takes ZB-V; on a device just too small for ZB-V's record (the estimate
    ptd-train refuses by), the shortest schedule that fits."""
    from ptd_jax.cli import train as cli
    from ptd_jax.perf.memory import run_memory_bytes

    argv = [
        "--fake-devices",
        "4",
        "--pipeline-model-parallel-size",
        "4",
        "--num-layers",
        "8",
        "--global-batch-size",
        "16",
        "--micro-batch-size",
        "2",
        "--seq-length",
        "256",
        "--schedule-times",
        "1",
        "1",
        "1",
    ]

    def parsed(schedule):
        args = cli.build_parser().parse_args(argv + ["--pipeline-schedule", schedule])
        cli.fill_defaults(args)
        return args, cli.model_config_from_args(args)

    def choose(limit):
        args, cfg = parsed("auto")
        return cli.parallel_config_from_args(args, cfg, 4, _Device(limit), 1).pipeline_schedule

    assert choose(1e15) == "zb-v"
    need = {}
    for schedule in ("zb-v", "zb-h1", "interleaved", "1f1b", "gpipe"):
        args, cfg = parsed(schedule)
        need[schedule] = run_memory_bytes(cfg, cli.parallel_config_from_args(args, cfg, 4), "none")["total"]
    limit = need["zb-v"] - 1
    name = choose(limit)
    assert name != "zb-v" and need[name] <= limit
    assert choose(min(need.values()) - 1) == "1f1b"  # nothing fits: the ParallelConfig's default, refused later


def test_auto_under_uniform_branching_leaves_the_split_schedules_out(capsys):
    """Unit tables run per-rank only: under --pipeline-branching uniform auto does not offer them."""
    from ptd_jax.cli import train as cli

    args = cli.build_parser().parse_args(
        [
            "--fake-devices",
            "4",
            "--pipeline-model-parallel-size",
            "4",
            "--num-layers",
            "8",
            "--pipeline-schedule",
            "auto",
            "--pipeline-branching",
            "uniform",
        ]
    )
    cli.fill_defaults(args)
    parallel = cli.parallel_config_from_args(args, cli.model_config_from_args(args), 4)
    assert parallel.pipeline_schedule == "interleaved"
    block = capsys.readouterr().out
    assert "zb-" not in block and "1f1b " not in block and " * interleaved" in block


def test_auto_prefers_fused_schedules_when_b_is_much_longer_than_f():
    """A lockstep tick lasts as long as its longest cell: under full recomputation B runs the forward again (F:B:W
    = 1 : 13/7 : 6/7 from the FLOPs), the split tables' mixed ticks all last a B, and interleaving wins."""
    from ptd_jax.cli import train as cli
    from ptd_jax.perf.auto_schedule import model_times

    args = cli.build_parser().parse_args(
        [
            "--fake-devices",
            "4",
            "--pipeline-model-parallel-size",
            "4",
            "--num-layers",
            "8",
            "--pipeline-schedule",
            "auto",
            "--recompute-granularity",
            "full",
            "--global-batch-size",
            "32",
        ]
    )  # m = 8
    cli.fill_defaults(args)
    cfg = cli.model_config_from_args(args)
    assert model_times(cfg, "full") == pytest.approx((1.0, 13 / 7, 6 / 7))
    assert cli.parallel_config_from_args(args, cfg, 4).pipeline_schedule == "interleaved"
