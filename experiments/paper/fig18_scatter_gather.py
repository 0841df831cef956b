"""Paper Figure 18: the scatter/gather optimization of the pipeline's point-to-point traffic (§4.1), throughput
with and without it.

Measured: the small model's gradient step at (p, t) = (2, 2) on 4 fake CPU devices, interleaved (v = 2), b = 1,
m ∈ {4, 8}, with scatter/gather (each tensor rank sends 1/t of the activation and the receivers all-gather it) and
without (every tensor rank sends the whole activation); ratio of step times. On fake devices a "send" is a memory
copy between host buffers, so only the copied bytes differ, not any link's speed.
Predicted: `ptd_jax.perf` for the paper's setting, GPT-3 175B on 96 A100s, (t, p) = (8, 12), interleaved with
k = 4 (v = 2, our choice), b = 1, full recomputation, batch 12 ... 60.
Paper (text): scatter/gather improves throughput by up to 11% for communication-intensive schedules (large batch
with interleaving).

Usage: python -m experiments.paper.fig18_scatter_gather [--rounds 5] [--smoke] [--out PATH] [--predicted-only]
(--predicted-only: recompute the predicted part, keep the measured part of the existing JSON)
"""

from __future__ import annotations

import json

from experiments import common
from experiments.paper import figures

BATCHES = (12, 24, 36, 48, 60)
PAPER_UP_TO = 0.11
PAPER_TEXT = (
    "Fig. 18 (GPT-3 175B, 96 GPUs, interleaved): the scatter/gather optimization improves throughput by up "
    "to 11% for communication-intensive schedules (large batch size with interleaving)"
)


def predicted() -> list[dict]:
    cfg = figures.paper_model("gpt3-175b")
    rows = []
    for batch in BATCHES:
        on = figures.predict(cfg, 96, 8, 12, 1, batch, 4, scatter_gather=True)
        off = figures.predict(cfg, 96, 8, 12, 1, batch, 4, scatter_gather=False)
        rows.append(
            {
                "batch": batch,
                "with_tflops": on["tflops_per_gpu"],
                "without_tflops": off["tflops_per_gpu"],
                "speedup": on["tflops_per_gpu"] / off["tflops_per_gpu"],
                "pipeline_p2p_s": [on["terms_s"]["pipeline_p2p"], off["terms_s"]["pipeline_p2p"]],
            }
        )
    return rows


def measured(ms, rounds, smoke):
    layouts = {
        f"sg={sg} m={m}": dict(schedule="interleaved", p=2, v=2, t=2, m=m, scatter_gather=sg)
        for sg in (True, False)
        for m in ms
    }
    out = common.measure_layouts(common.small_model(smoke), layouts, rounds)
    med = out["median_step_s"]
    out["rows"] = [{"m": m, "speedup": med[f"sg=False m={m}"] / med[f"sg=True m={m}"]} for m in ms]
    return out


def plot(result, plt):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    rows = result["predicted"]
    xs = [r["batch"] for r in rows]
    a1.plot(xs, [r["with_tflops"] for r in rows], "s-", label="with scatter/gather")
    a1.plot(xs, [r["without_tflops"] for r in rows], "o-", label="without")
    a1.set(
        xlabel="batch size",
        ylabel="TFLOP/s per GPU (eq. 3)",
        title="predicted (ptd_jax.perf): GPT-3 175B, 96 A100s, t=8 p=12, interleaved v=2",
    )
    a1.legend(fontsize=8)
    a2.plot(xs, [r["speedup"] for r in rows], "^-", label="predicted speed-up (175B)")
    a2.axhline(1 + PAPER_UP_TO, color="C3", ls="--", label="paper: up to 1.11 (text)")
    meas = result["measured"]["rows"]
    a2.plot(
        [r["m"] for r in meas],
        [r["speedup"] for r in meas],
        "s-",
        label="measured, small model (x = m), p=2 t=2 v=2, fake CPU devices",
    )
    a2.axhline(1, color="gray", lw=0.6)
    a2.set(xlabel="batch size", ylabel="throughput with / without")
    a2.legend(fontsize=7)


def main(argv=None) -> None:
    args = figures.parse_args(__doc__.splitlines()[0], argv, predicted_only=True)
    ms = [4] if args.smoke else [4, 8]

    def measure() -> dict:
        common.fake_devices(4)
        return measured(ms, args.rounds, args.smoke)

    measured_part, timing_note = figures.measured_or_kept("fig18_scatter_gather", args, measure)
    result = {
        "predicted": predicted(),
        "measured": measured_part,
        "paper_text": PAPER_TEXT,
        "paper_up_to_speedup": 1 + PAPER_UP_TO,
        "timing_note": timing_note,
    }
    figures.write("fig18_scatter_gather", result, plot, args.out)
    print(
        json.dumps(
            {
                "measured": result["measured"]["rows"],
                "predicted_speedup": {r["batch"]: round(r["speedup"], 3) for r in result["predicted"]},
            }
        )
    )


if __name__ == "__main__":
    main()
