"""Paper Figures 7, 8 and 16: the micro-batch size b (§3.4, Takeaway #3).

- Fig. 7, per-GPU throughput vs b on one device. Measured: the small model's single-device gradient step (the
  plain scan over microbatches), batch 8 sequences, b ∈ {1, 2, 4, 8}. Predicted: `ptd_jax.perf` for the paper's
  1B model (4 layers, h 4096, 128 heads) on one A100, batch 128, b ∈ {1, 2, 4, 8, 16}.
- Fig. 8, the paper's estimate t(b) = (B'/b + p − 1)·(t_f(b) + t_b(b)), normalized, from Fig. 7's per-microbatch
  times: here from the measured ones and from the predicted ones, at p = 8 (our choice) and B' ∈ {128, 512}.
- Fig. 16, throughput vs b in a pipeline. Measured: p = 4 on 4 fake CPU devices, 1F1B (`1f1b-lockstep`), batch 16, b ∈
  {1, 2, 4}. Predicted: a ~91B stand-in (72 layers, h 10240, 80 heads; about 91B by eq. 2 — the paper's shape is not in
  the text cited) at (t, p) = (8, 8) on 64 A100s, batch 128 and 512, b ∈ {1, 2, 4, 8}, full recomputation.
Paper (text): the best micro-batch size for Fig. 16's model is 2; the best b depends on the model and the batch
(it trades GEMM efficiency against the bubble).

Usage: python -m experiments.paper.fig07_08_16_microbatch [--rounds 5] [--smoke] [--out PATH]
"""

from __future__ import annotations

import json

from experiments import common
from experiments.paper import figures

PAPER_BEST_B_FIG16 = 2
PAPER_TEXT = (
    "Fig. 16 (91B, (t, p) = (8, 8), 64 GPUs, two batch sizes): the best micro-batch size is 2 for this "
    "model; Takeaway #3: the optimal micro-batch size depends on the model's throughput and memory, the "
    "pipeline depth p, the data-parallel size d and the batch size B"
)
FIG8_P, FIG8_BATCHES = 8, (128, 512)


def estimate(per_microbatch: dict, p: int, batch: int) -> dict:
    """The paper's Fig. 8 estimate: throughput ∝ B' / ((B'/b + p − 1)·(t_f(b) + t_b(b))), normalized to its max."""
    raw = {b: batch / ((batch / b + p - 1) * t) for b, t in per_microbatch.items()}
    top = max(raw.values())
    return {b: x / top for b, x in raw.items()}


def predicted() -> dict:
    one = figures.paper_model("1b")
    fig7 = {b: figures.predict(one, 1, 1, 1, b, 128) for b in (1, 2, 4, 8, 16)}
    slots = {b: r["microbatch_slot_s"] for b, r in fig7.items()}
    big = figures.paper_model("91b-standin")
    fig16 = [
        {
            "batch": batch,
            "b": b,
            "tflops_per_gpu": r["tflops_per_gpu"],
            "fits": r["fits"],
            "bubble": r["bubble_fraction"],
        }
        for batch in (128, 512)
        for b in (1, 2, 4, 8)
        for r in [figures.predict(big, 64, 8, 8, b, batch)]
    ]
    best = {
        batch: max((r for r in fig16 if r["batch"] == batch and r["fits"]), key=lambda r: r["tflops_per_gpu"])["b"]
        for batch in (128, 512)
    }
    return {
        "fig7": {
            b: {"tflops_per_gpu": r["tflops_per_gpu"], "microbatch_slot_s": r["microbatch_slot_s"]}
            for b, r in fig7.items()
        },
        "fig8": {batch: estimate(slots, FIG8_P, batch) for batch in FIG8_BATCHES},
        "fig16": fig16,
        "fig16_best_b": best,
    }


def measured(rounds, smoke) -> dict:
    single = {f"single b={b}": dict(b=b, m=8 // b) for b in (1, 2, 4, 8)}
    piped = {f"p=4 b={b}": dict(schedule=figures.PAPERS_1F1B, p=4, b=b, m=16 // b) for b in (1, 2, 4)}
    out = common.measure_layouts(common.small_model(smoke), {**single, **piped}, rounds)
    med = out["median_step_s"]
    per_mb = {b: med[f"single b={b}"] / (8 // b) for b in (1, 2, 4, 8)}
    out["fig7_sequences_per_s"] = {b: 8 / med[f"single b={b}"] for b in (1, 2, 4, 8)}
    out["fig7_per_microbatch_s"] = per_mb
    out["fig8"] = {batch: estimate(per_mb, FIG8_P, batch) for batch in FIG8_BATCHES}
    out["fig16_sequences_per_s"] = {b: 16 / med[f"p=4 b={b}"] for b in (1, 2, 4)}
    out["fig16_best_b"] = max(out["fig16_sequences_per_s"], key=out["fig16_sequences_per_s"].get)
    return out


def plot(result, plt):
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    pred, meas = result["predicted"], result["measured"]
    bs = sorted(pred["fig7"], key=int)
    axes[0][0].plot([int(b) for b in bs], [pred["fig7"][b]["tflops_per_gpu"] for b in bs], "o-")
    axes[0][0].set(
        xscale="log",
        xlabel="micro-batch size b",
        ylabel="TFLOP/s per GPU (eq. 3)",
        title="Fig. 7 predicted: 1B model, one A100",
    )
    for batch, est in pred["fig8"].items():
        ks = sorted(est, key=int)
        axes[0][1].plot([int(b) for b in ks], [est[b] for b in ks], "o-", label=f"B'={batch}")
    axes[0][1].set(
        xscale="log",
        xlabel="b",
        ylabel="normalized throughput",
        title=f"Fig. 8 estimate from predicted t_f+t_b, p={FIG8_P}",
    )
    axes[0][1].legend(fontsize=8)
    for batch in (128, 512):
        rows = [r for r in pred["fig16"] if r["batch"] == batch]
        axes[0][2].plot([r["b"] for r in rows], [r["tflops_per_gpu"] for r in rows], "o-", label=f"batch {batch}")
    axes[0][2].axvline(PAPER_BEST_B_FIG16, color="C3", ls="--", label="paper: best b = 2 (text)")
    axes[0][2].set(
        xscale="log",
        xlabel="b",
        ylabel="TFLOP/s per GPU (eq. 3)",
        title="Fig. 16 predicted: ~91B stand-in, t=8 p=8, 64 A100s",
    )
    axes[0][2].legend(fontsize=8)
    seq = meas["fig7_sequences_per_s"]
    axes[1][0].plot([int(b) for b in seq], list(seq.values()), "s-")
    axes[1][0].set(xscale="log", xlabel="b", ylabel="sequences/s", title="Fig. 7 measured: small model, one CPU device")
    for batch, est in meas["fig8"].items():
        axes[1][1].plot([int(b) for b in est], list(est.values()), "s-", label=f"B'={batch}")
    axes[1][1].set(
        xscale="log",
        xlabel="b",
        ylabel="normalized throughput",
        title=f"Fig. 8 estimate from measured t_f+t_b, p={FIG8_P}",
    )
    axes[1][1].legend(fontsize=8)
    seq = meas["fig16_sequences_per_s"]
    axes[1][2].plot([int(b) for b in seq], list(seq.values()), "s-")
    axes[1][2].set(
        xscale="log", xlabel="b", ylabel="sequences/s", title="Fig. 16 measured: p=4 1F1B, batch 16, fake CPU devices"
    )
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax in fig.axes:  # b on a log-2 axis with plain labels
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    fig.tight_layout()


def main(argv=None) -> None:
    args = figures.parse_args(__doc__.splitlines()[0], argv)
    common.fake_devices(4)
    result = {
        "predicted": predicted(),
        "measured": measured(args.rounds, args.smoke),
        "paper_text": PAPER_TEXT,
        "paper_best_b_fig16": PAPER_BEST_B_FIG16,
        "timing_note": common.TIMING_NOTE,
    }
    figures.write("fig07_08_16_microbatch", result, plot, args.out)
    meas = result["measured"]
    print(
        json.dumps(
            {
                "measured_fig7_sequences_per_s": meas["fig7_sequences_per_s"],
                "measured_fig16_best_b": meas["fig16_best_b"],
                "predicted_fig16_best_b": result["predicted"]["fig16_best_b"],
            }
        )
    )


if __name__ == "__main__":
    main()
