"""Shared pieces of the figure scripts (`paper/fig*.py`, `paper/calibrate_fake_devices.py`): the performance model
(`ptd_jax.perf`, `ptd-plan`'s) at the paper's scale, the paper's models, the common flags (--predicted-only among
them) and writing JSON + PNG under experiments/results/. The measured half (the small model on fake CPU devices,
alternating rounds) comes from `experiments/common.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.common import RESULTS, TIMING_NOTE

PAPER = (
    "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM "
    "(arXiv 2104.04473)"
)


def paper_model(name: str):
    """The paper's models used by its figures (bfloat16, s = 2048, GPT-2's vocabulary padded as Megatron pads).
    Shapes the paper states: "gpt3-175b" (96 layers, h 12288, 96 heads: Figs. 12, 18), "5.9b" (32 layers, h 3840,
    32 heads: Figs. 14, 15), "1b" (4 layers, h 4096, 128 heads: Figs. 7, 8), "145b" (80 layers, h 12288, 96 heads:
    Fig. 17). Stand-ins whose shape the paper does not give (our choice, about the stated size by eq. 2):
    "162b-standin" (Fig. 13) and "91b-standin" (Fig. 16)."""
    from ptd_jax.presets import model_preset

    shapes = {
        "gpt3-175b": (96, 12288, 96),
        "5.9b": (32, 3840, 32),
        "1b": (4, 4096, 128),
        "145b": (80, 12288, 96),
        "162b-standin": (96, 11776, 64),
        "91b-standin": (72, 10240, 80),
    }
    layers, hidden, heads = shapes[name]
    return model_preset("paper-1.7b").replace(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, dtype="bfloat16"
    )


PAPERS_1F1B = "1f1b-lockstep"


def predict(
    cfg,
    num_gpus: int,
    t: int,
    p: int,
    b: int,
    global_batch_size: int,
    k: int | None = None,
    recompute: str = "full",
    hardware: str = "a100-80gb",
    **flags,
) -> dict:
    """The planner's record of one layout at the paper's scale (`ptd-plan predict`'s numbers): tflops_per_gpu
    (eq. 3), iteration_time_s, bubble_fraction, memory_gb_per_gpu, fits, terms_s, ...; sequences_per_s and
    microbatch_slot_s (one microbatch's forward and backward on the last stage) added."""
    from ptd_jax.perf import HARDWARE
    from ptd_jax.perf import predict as perf_predict
    from ptd_jax.perf.search import layout_record, make_parallel

    hw = HARDWARE[hardware]
    # the paper's plain 1F1B is Megatron's asynchronous one, (p - 1)/m whatever B/F is: ours on lockstep ticks
    flags.setdefault("schedule", None if k else PAPERS_1F1B)
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
    result = {"figure_script": f"experiments/paper/{name}.py", "paper": PAPER, **result}
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
        parser.add_argument(
            "--predicted-only",
            action="store_true",
            help="recompute the predicted part (ptd_jax.perf) and keep the measured part of the "
            "existing JSON (--out, default experiments/results/<name>.json); measures nothing",
        )
    except argparse.ArgumentError:  # the script defines its own
        predicted_only = True
    args = parser.parse_args(argv)
    if args.predicted_only and not predicted_only:
        parser.error(
            f"--predicted-only is not implemented by this script (only by {', '.join(PREDICTED_ONLY_SCRIPTS)})"
        )
    if args.predicted_only and (args.smoke or args.rounds is not None):
        dropped = "--smoke" if args.smoke else f"--rounds {args.rounds}"
        parser.error(f"--predicted-only measures nothing: drop {dropped}")
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
        raise SystemExit(
            f"{name}: error: --predicted-only keeps the measured part of {path}, which does not exist "
            f"(run without --predicted-only first)"
        )
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
