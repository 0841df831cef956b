"""Shared pieces of the figure scripts (`fig_*.py`): the small model measured on fake CPU devices, timing in
alternating rounds, the performance model (`ptd_jax.perf`, `ptd-plan`'s) at the paper's scale, the paper's models,
and writing JSON + PNG under experiments/results/. No library logic: the steps come from
`experiments/bench_interleaving.py` (`pipeline_step`), the timing from `ptd_jax/train/bubble.py`.

Measured figures are ratios of step times taken in the same run, medians of alternating rounds: the development
machine has 2 cores shared with other jobs, so absolute times are noisy, and on fake devices (which share those
cores) a step's time follows the work that every rank executes, not a GPU's critical path.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PAPER = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM "
         "(arXiv 2104.04473)")
TIMING_NOTE = ("fake CPU devices sharing a 2-core host with other jobs: medians of alternating rounds, ratios within "
               "one run; step time follows the work every rank executes (idle cells' dummies under uniform branching)")
SMALL = dict(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512)
"""The measured model (fast defaults: a step takes tens of milliseconds on fake devices)."""
SMOKE = dict(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=128)


def fake_devices(n: int) -> None:
    from ptd_jax.parallel.mesh import set_fake_devices

    set_fake_devices(n)


def small_model(smoke: bool = False, **overrides):
    from ptd_jax.config import ModelConfig

    return ModelConfig(**{**(SMOKE if smoke else SMALL), **overrides})


def grad_step(cfg, *, schedule="1f1b", p=1, v=1, m=4, t=1, d=1, b=1, recompute="none", branching="uniform",
              **fields):
    """`bench_interleaving.pipeline_step` with keyword arguments: (compiled grad step, its arguments)."""
    from experiments.bench_interleaving import pipeline_step

    return pipeline_step(cfg, schedule, v, branching, recompute, p=p, m=m, t=t, d=d, b=b, **fields)


def time_steps(steps: dict, rounds: int) -> dict:
    """{"median_step_s", "all_step_s"} of each compiled `(fn, args)`, alternating rounds after one warm-up call."""
    from ptd_jax.train.bubble import time_alternating

    times = time_alternating(steps, rounds)
    return {"median_step_s": {k: statistics.median(v) for k, v in times.items()}, "all_step_s": times}


def measure_layouts(cfg, layouts: dict, rounds: int) -> dict:
    """Compile `grad_step(cfg, **layout)` for each named layout, time them all in alternating rounds. The record
    keeps each layout and the model, which `calibrate_fake_devices.py` reads back, and XLA's temp bytes per
    device of each compiled step."""
    import dataclasses

    steps, temp = {}, {}
    for name, layout in layouts.items():
        compiled, args = grad_step(cfg, **layout)
        steps[name] = (compiled, args)
        memory = compiled.memory_analysis()
        temp[name] = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    model = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
             if f.name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")}
    return {"model": model, "layouts": layouts, "temp_bytes_per_device": temp, "rounds": rounds,
            **time_steps(steps, rounds)}


def paper_model(name: str):
    """The paper's models used by its figures (bfloat16, s = 2048, GPT-2's vocabulary padded as Megatron pads).
    Shapes the paper states: "gpt3-175b" (96 layers, h 12288, 96 heads: Figs. 12, 18), "5.9b" (32 layers, h 3840,
    32 heads: Figs. 14, 15), "1b" (4 layers, h 4096, 128 heads: Figs. 7, 8), "145b" (80 layers, h 12288, 96 heads:
    Fig. 17). Stand-ins whose shape the paper does not give (our choice, about the stated size by eq. 2):
    "162b-standin" (Fig. 13) and "91b-standin" (Fig. 16)."""
    from ptd_jax.config import model_preset

    shapes = {"gpt3-175b": (96, 12288, 96), "5.9b": (32, 3840, 32), "1b": (4, 4096, 128), "145b": (80, 12288, 96),
              "162b-standin": (96, 11776, 64), "91b-standin": (72, 10240, 80)}
    layers, hidden, heads = shapes[name]
    return model_preset("paper-1.7b").replace(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                              dtype="bfloat16")


def predict(cfg, num_gpus: int, t: int, p: int, b: int, global_batch_size: int, k: int | None = None,
            recompute: str = "full", hardware: str = "a100-80gb", **flags) -> dict:
    """The planner's record of one layout at the paper's scale (`ptd-plan predict`'s numbers): tflops_per_gpu
    (eq. 3), iteration_time_s, bubble_fraction, memory_gb_per_gpu, fits, terms_s, ...; sequences_per_s and
    microbatch_slot_s (one microbatch's forward and backward on the last stage) added."""
    from ptd_jax.perf import HARDWARE
    from ptd_jax.perf import predict as perf_predict
    from ptd_jax.perf.search import layout_record, make_parallel

    hw = HARDWARE[hardware]
    parallel = make_parallel(cfg, num_gpus, t, p, b, global_batch_size, k, **flags)
    pred = perf_predict(cfg, parallel, hw, recompute)
    record = layout_record(cfg, parallel, pred, hw)
    record["sequences_per_s"] = global_batch_size / record["iteration_time_s"]
    record["microbatch_slot_s"] = pred.details["microbatch_slot_s"]
    return record


def write(name: str, result: dict, plot, out: str | None = None) -> Path:
    """Write `result` to results/<name>.json (or `out`) and `plot(result, png_path)` beside it; returns the JSON."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"figure_script": f"experiments/{name}.py", "paper": PAPER, **result}
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the plot first, then both files replaced whole: an error leaves the old pair, which for --predicted-only
    # holds the only copy of the measured part
    plot(result, plt)
    png, tmp_png, tmp_json = path.with_suffix(".png"), path.with_suffix(".tmp.png"), path.with_suffix(".tmp")
    plt.savefig(tmp_png, dpi=110, bbox_inches="tight")
    plt.close("all")
    tmp_json.write_text(json.dumps(result, indent=1))
    os.replace(tmp_png, png)
    os.replace(tmp_json, path)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path


PREDICTED_ONLY_SCRIPTS = ("fig12_interleaved", "fig13_15_parallelism", "fig18_scatter_gather")
"""The scripts that implement --predicted-only (the others refuse it rather than measure)."""


def parse_args(description: str, argv=None, rounds: int = 5, extra=None, predicted_only: bool = False):
    """The scripts' common flags: --rounds, --out, --smoke (tiny shapes and one round: checks that it runs),
    --predicted-only (recompute the predicted part from ptd_jax.perf, keep the measured part of the JSON that --out
    names, default results/<name>.json, and rewrite JSON + PNG: `measured_or_kept`), which a script refuses unless
    it passes `predicted_only=True` (and which takes no --rounds or --smoke); `extra(parser)` adds a script's own
    flags (its own --predicted-only, if any, replaces this one)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=None, help=f"alternating rounds (default {rounds})")
    parser.add_argument("--out", default=None, help="JSON path (the PNG goes beside it)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and one round: checks that it runs")
    if extra is not None:
        extra(parser)
    try:
        parser.add_argument("--predicted-only", action="store_true",
                            help="recompute the predicted part (ptd_jax.perf) and keep the measured part of the "
                                 "existing JSON (--out, default experiments/results/<name>.json); measures nothing")
    except argparse.ArgumentError:  # the script defines its own
        predicted_only = True
    args = parser.parse_args(argv)
    if args.predicted_only and not predicted_only:
        parser.error(f"--predicted-only is not implemented by this script (only by {', '.join(PREDICTED_ONLY_SCRIPTS)})")
    if args.predicted_only and (args.smoke or args.rounds is not None):
        parser.error(f"--predicted-only measures nothing: drop {'--smoke' if args.smoke else f'--rounds {args.rounds}'}")
    if args.rounds is None:
        args.rounds = rounds
    if args.smoke:
        args.rounds = 1
    return args


def kept_results(name: str, out: str | None) -> dict:
    """The JSON that --predicted-only rewrites (`out`, default results/<name>.json); exits with one line naming the
    file when it is missing or has no measured part."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"{name}: error: --predicted-only keeps the measured part of {path}, which does not exist "
                         f"(run without --predicted-only first)")
    old = json.loads(path.read_text())
    if not old.get("measured"):
        raise SystemExit(f"{name}: error: {path} has no measured part for --predicted-only to keep")
    return old


def measured_or_kept(name: str, args, measure) -> tuple[dict, str]:
    """(the measured part, its timing note): `measure()`'s, or with --predicted-only the existing JSON's unchanged."""
    if args.predicted_only:
        old = kept_results(name, args.out)
        return old["measured"], old.get("timing_note", TIMING_NOTE)
    return measure(), TIMING_NOTE
