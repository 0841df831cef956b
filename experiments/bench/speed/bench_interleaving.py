"""Interleaved vs plain 1F1B on simulated devices (paper §2.2.2, Figure 12): does interleaving pay?

Four fake CPU devices, p = 4, m = 8, b = 1, s = 256, two models: the paper's vocabulary/hidden ratio (16 layers,
h 256, V 6400 = 25·h, as GPT-3's 51200/2048; the output layer costs about one chunk) and a wide model with a small
vocabulary (8 layers, h 512, V 1024). For each, the gradient step of 1F1B (v = 1) and interleaved 1F1B (v = 2)
under both `--pipeline-branching` modes, and the single-device reference step, all with the same
`--recompute-granularity` (default none: the executor stashes each layer's vjp residuals and recomputes no matmul,
as the reference's plain autodiff does). Medians of alternating rounds, ratios from the same run. On fake devices
the step time follows the work that every rank executes: "uniform" (idle cells compute masked dummies) stands for a
lockstep GPU step, whose tick lasts as long as its busiest rank; "per-rank" (idle cells compute nothing) measures
the total work. Plain 1F1B here is `1f1b-lockstep` (fused backwards, one kind per tick), the one 1F1B table that
runs under both branchings and is placed as interleaved is: the table the name "1f1b" ran before the one pipeline
(warm-up 2(p − 1 − s)), which the ratios' names keep.

Usage: python -m experiments.bench.speed.bench_interleaving [--rounds 5] [--recompute none|selective|full]
       [--out experiments/results/bench_interleaving.json]
       python -m experiments.bench.speed.bench_interleaving --smoke --out /tmp/x.json  # tiny shapes, one round (checks)
"""

from __future__ import annotations

import argparse
import json
import statistics

from experiments.common import BENCH_MODEL, alternate, fake_devices, pipeline_step, reference_step, write_json

P, M, SEQ = 4, 8, 256
MODELS = {
    "paper_ratio": {k: v for k, v in BENCH_MODEL.items() if k != "seq_length"},
    "wide_small_vocab": dict(num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=1024),
}
SMOKE_MODEL = dict(num_layers=8, hidden_size=32, num_attention_heads=4, vocab_size=257)
ONE_F_ONE_B = "1f1b-lockstep"
CASES = [
    (ONE_F_ONE_B, 1, "uniform"),
    ("interleaved", 2, "uniform"),
    (ONE_F_ONE_B, 1, "per-rank"),
    ("interleaved", 2, "per-rank"),
]


def measure(model_name, rounds, smoke=False, recompute="none"):
    from ptd_jax.config import ModelConfig

    shape, seq = (SMOKE_MODEL, 16) if smoke else (MODELS[model_name], SEQ)
    cfg = ModelConfig(seq_length=seq, **shape)
    steps = {f"{s} v={v} {b}": pipeline_step(cfg, s, v, b, recompute, p=P, m=M) for s, v, b in CASES}
    steps["reference"] = reference_step(cfg, recompute, m=M)
    times = alternate(steps, rounds)
    median = {name: statistics.median(ts["wall"]) for name, ts in times.items()}
    median_cpu = {name: statistics.median(ts["cpu"]) for name, ts in times.items()}
    ratios, ratios_cpu = {}, {}
    for out, med in ((ratios, median), (ratios_cpu, median_cpu)):
        for branching in ("uniform", "per-rank"):
            one_f_one_b = med[f"{ONE_F_ONE_B} v=1 {branching}"]
            out[f"interleaved/1f1b ({branching})"] = med[f"interleaved v=2 {branching}"] / one_f_one_b
            out[f"1f1b/reference ({branching})"] = one_f_one_b / med["reference"]
    return {
        "model": {**shape, "seq_length": seq, "p": P, "m": M, "micro_batch_size": 1},
        "recompute": recompute,
        "median_step_s": median,
        "median_cpu_s": median_cpu,
        "all_step_s": times,
        "ratios": ratios,
        "ratios_cpu_time": ratios_cpu,
        "ideal_interleaved_over_1f1b": (M + (P - 1) / 2) / (M + P - 1),
        "bubble_only_1f1b_over_reference": (M + P - 1) / M,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default="experiments/results/bench_interleaving.json")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and one round: checks that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.rounds = args.models[:1], 1
    fake_devices(P)
    result = {}
    for name in args.models:
        result[name] = measure(name, args.rounds, args.smoke, args.recompute)
        print(
            json.dumps(
                {
                    name: {
                        "median_step_s": result[name]["median_step_s"],
                        "ratios": result[name]["ratios"],
                        "ratios_cpu_time": result[name]["ratios_cpu_time"],
                    }
                }
            ),
            flush=True,
        )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
