"""Paper Figures 13-15: tensor vs pipeline (13), pipeline vs data (14) and tensor vs data parallelism (15) at a
fixed number of GPUs.

Measured: the small model's gradient step on 4 fake CPU devices, batch 16 sequences, b = 1, 1F1B (`1f1b-lockstep`: fused
backwards on lockstep ticks), uniform branching, at (t, p, d) = (1,4,1) (2,2,1) (4,1,1) [Fig. 13], (1,4,1) (1,2,2)
(1,1,4) [Fig. 14] and (4,1,1) (2,1,2) (1,1,4) [Fig. 15]: throughput relative to the best of each figure. On fake devices
every rank's work shares the host's cores, so pipeline parallelism pays for its bubble's dummy cells and tensor/data
parallelism for copies; no link is slower than another.
Predicted: `ptd_jax.perf` at the paper's scale on A100-80GB nodes, fp16 mixed precision (the paper's runs: 20 bytes
per parameter, fp16 gradients), full recomputation, b = 1, plain 1F1B:
- Fig. 13: the paper's 161B model as §5.4.1 states it ("32 transformer layers to support pipeline-parallel size of
  32, 128 attention heads, hidden size of 20480"; eq. 2 gives 161.1B) on 64 GPUs, (t, p) = (2,32) (4,16) (8,8)
  (16,4) (32,2), batch 32 and 128. (The first version used a 96-layer, h 11776, 64-head stand-in: at h 11776 a
  layer's tensor all-reduces cost 20480/11776 = 1.74x more per FLOP, which made t = 4 win at batch 128.);
- Figs. 14, 15: the paper's 5.9B model (32 layers, h 3840, 32 heads) on 64 GPUs, (p, d) and (t, d) ∈ (2,32) (4,16)
  (8,8) (16,4) (32,2), batch 32, 128 and 512 (layouts that do not fit in 80 GB are marked).
Paper (text, qualitative): tensor parallelism is best within a node (t up to 8) and pipeline parallelism across
nodes (Takeaway #1, Fig. 13's best is t = 8); for a model that fits, throughput falls as the pipeline size (Fig. 14)
or the tensor size (Fig. 15) grows at the expense of data parallelism (Takeaway #2).

Usage: python -m experiments.paper.fig13_15_parallelism [--rounds 5] [--smoke] [--out PATH] [--predicted-only]
(--predicted-only recomputes the predicted half and keeps the measured half of the existing JSON.)
"""

from __future__ import annotations

import json

from experiments import common
from experiments.paper import figures

MEASURED = {
    "fig13": [(1, 4, 1), (2, 2, 1), (4, 1, 1)],
    "fig14": [(1, 4, 1), (1, 2, 2), (1, 1, 4)],
    "fig15": [(4, 1, 1), (2, 1, 2), (1, 1, 4)],
}
PAIRS = [(2, 32), (4, 16), (8, 8), (16, 4), (32, 2)]
PAPER_TEXT = {
    "fig13": "tensor vs pipeline, 162.2B on 64 GPUs: tensor parallelism is best within a node (t = 8), pipeline "
    "parallelism across nodes (Takeaway #1)",
    "fig14": "pipeline vs data, 5.9B on 64 GPUs: throughput decreases as the pipeline-parallel size grows "
    "(Takeaway #2)",
    "fig15": "tensor vs data, 5.9B on 64 GPUs: throughput decreases as the tensor-parallel size grows (Takeaway #2)",
}


def layout_name(t, p, d):
    return f"t={t} p={p} d={d}"


FIG13_SHAPE = {"num_layers": 32, "hidden_size": 20480, "num_attention_heads": 128}
"""Paper §5.4.1: the 161-billion-parameter model of Fig. 13."""


def fig13_model():
    return figures.paper_model("5.9b").replace(**FIG13_SHAPE, dtype="float16")


def predicted() -> dict:
    out = {}
    big, small = fig13_model(), figures.paper_model("5.9b").replace(dtype="float16")
    specs = {
        "fig13": (big, (32, 128), lambda a, b: (a, b, 1)),
        "fig14": (small, (32, 128, 512), lambda a, b: (1, a, b)),
        "fig15": (small, (32, 128, 512), lambda a, b: (a, 1, b)),
    }
    for fig, (cfg, batches, tpd) in specs.items():
        rows = []
        for batch in batches:
            for a, b in PAIRS:
                t, p, d = tpd(a, b)
                r = figures.predict(cfg, 64, t, p, 1, batch)
                rows.append(
                    {
                        "batch": batch,
                        "t": t,
                        "p": p,
                        "d": d,
                        "tflops_per_gpu": r["tflops_per_gpu"],
                        "fits": r["fits"],
                        "memory_gb_per_gpu": r["memory_gb_per_gpu"],
                    }
                )
        out[fig] = rows
    return out


def measured(rounds, smoke):
    layouts = {}
    for configs in MEASURED.values():
        for t, p, d in configs:
            layouts[layout_name(t, p, d)] = dict(schedule=figures.PAPERS_1F1B, t=t, p=p, d=d, m=16 // d)
    out = common.measure_layouts(common.small_model(smoke), layouts, rounds)
    med = out["median_step_s"]
    out["relative_throughput"] = {}
    for fig, configs in MEASURED.items():
        names = [layout_name(*c) for c in configs]
        best = min(med[n] for n in names)
        out["relative_throughput"][fig] = {n: best / med[n] for n in names}
    return out


def plot(result, plt):
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    labels = {"fig13": ("t", "p"), "fig14": ("p", "d"), "fig15": ("t", "d")}
    for col, name in enumerate(("fig13", "fig14", "fig15")):
        ax = axes[0][col]
        rows = result["predicted"][name]
        x1, x2 = labels[name]
        for batch in sorted({r["batch"] for r in rows}):
            rs = [r for r in rows if r["batch"] == batch]
            xs = [f"({r[x1]},{r[x2]})" for r in rs]
            ax.plot(xs, [r["tflops_per_gpu"] for r in rs], "o-", label=f"batch {batch}")
            for xi, r in zip(xs, rs):
                if not r["fits"]:
                    ax.plot([xi], [r["tflops_per_gpu"]], "kx", ms=9)
        ax.set(
            xlabel=f"({x1}, {x2})",
            ylabel="TFLOP/s per GPU (eq. 3)",
            title=f"{name}: predicted, 64 A100s (x: does not fit)",
        )
        ax.legend(fontsize=7)
        ax.text(0.01, 0.01, "paper: " + PAPER_TEXT[name][:70] + "...", transform=ax.transAxes, fontsize=6)
        ax = axes[1][col]
        rel = result["measured"]["relative_throughput"][name]
        ax.bar(list(rel), list(rel.values()))
        ax.set(ylabel="throughput / best", ylim=(0, 1.1), title=f"{name}: measured, 4 fake CPU devices")
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()


def main(argv=None) -> None:
    args = figures.parse_args(__doc__.splitlines()[0], argv, predicted_only=True)

    def measure():
        common.fake_devices(4)
        return measured(args.rounds, args.smoke)

    measured_half, timing_note = figures.measured_or_kept("fig13_15_parallelism", args, measure)
    result = {
        "predicted": predicted(),
        "measured": measured_half,
        "paper_text": PAPER_TEXT,
        "timing_note": timing_note,
        "fig13_model": {**FIG13_SHAPE, "source": "paper §5.4.1"},
    }
    figures.write("fig13_15_parallelism", result, plot, args.out)
    best = {
        fig: max(rows, key=lambda r: r["tflops_per_gpu"] if r["fits"] else -1)
        for fig, rows in result["predicted"].items()
    }
    print(
        json.dumps(
            {
                "measured": result["measured"]["relative_throughput"],
                "predicted_best": {f: f"t={r['t']} p={r['p']} d={r['d']} batch={r['batch']}" for f, r in best.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
