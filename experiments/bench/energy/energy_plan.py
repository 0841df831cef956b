"""Energy at the same speed, predicted: `ptd-plan energy` on the paper's GPT-3 175B layout and a Llama-3-70B layout,
for 1F1B (the split `1f1b` and the fused `1f1b-lockstep`), interleaved and ZB-V, at ε = 0 and ε = 1%; the
time–energy frontier of each (per-rank plans, one clock for all ranks, and the per-action bound).

- GPT-3 175B as in the paper's Figs. 12 and 18: 96 layers, h 12288, 96 heads, s 2048, V 51200, 96 A100-80GB,
  (t, p) = (8, 12), b = 1, batch 48 (m = 48), fp16, full recomputation; interleaved and ZB-V with v = 2.
- Llama-3-70B (our choice): the `llama3-70b` preset (80 layers, h 8192, 64 heads, 8 KV groups, F 28672, V 128256,
  s 8192) on 64 H100 SXM, (t, p, d) = (8, 4, 2), b = 1, batch 64 (m = 32), bf16, selective recomputation.

Stage times come from the performance model (`perf.energy.stage_times`, the terms of `perf.timing.predict`), clocks
and power from `perf.hardware.CLOCK_POWER` (datasheet clocks and board power; the static share, the exponent and
the bubble power are modelling assumptions, see there). Nothing here is measured on a GPU.

Published figures, for comparison (as their abstracts state them): EnvPipe (USENIX ATC'23) 25–28% energy saved
at under 1% slowdown; Perseus (SOSP'24) up to 30% without throughput loss, by a clock per forward/backward
computation; Zeus (NSDI'23) 15.3–75.8% by tuning batch size and power limit (energy to a target accuracy, not per
step at a fixed speed).

Usage: python -m experiments.bench.energy.energy_plan [--out experiments/results/energy_plan.json] [--smoke]
"""

from __future__ import annotations

import argparse
import time

from experiments.common import RESULTS, write_json
from ptd_jax.cli.energy import add_arguments, problem_of
from ptd_jax.cli.args import OneLineParser
from ptd_jax.perf import energy

GPT3 = [
    "--model-preset", "paper-1.7b", "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
    "--num-gpus", "96", "-t", "8", "-p", "12", "--global-batch-size", "48", "--fp16",
    "--recompute-granularity", "full", "--hardware", "a100-80gb",
]  # fmt: skip
LLAMA = [
    "--model-preset", "llama3-70b", "--num-gpus", "64", "-t", "8", "-p", "4", "--global-batch-size", "64",
    "--recompute-granularity", "selective", "--hardware", "h100-sxm",
]  # fmt: skip
LAYOUTS = {"gpt3-175b": GPT3, "llama3-70b": LLAMA}
SCHEDULES = {"1f1b": [], "1f1b-lockstep": [], "interleaved": ["-v", "2"], "zb-v": ["-v", "2"]}
EPSILONS = (0.0, 0.01)
FRONTIER_NODES = 20_000
"""Search nodes per frontier point past ε = 1% (a point not proven optimal says so: `exact` false)."""
PUBLISHED = {
    "EnvPipe (USENIX ATC'23)": "25-28% energy saved at under 1% slowdown (abstract)",
    "Perseus (SOSP'24)": "up to 30% energy saved without throughput loss, a clock per computation (abstract)",
    "Zeus (NSDI'23)": "15.3-75.8% energy efficiency by batch size and power limit, to a target accuracy (abstract)",
}


def one(layout: list[str], schedule: str, extra: list[str], smoke: bool) -> dict:
    parser = OneLineParser(prog="energy_plan")
    add_arguments(parser)
    args = parser.parse_args([*layout, "--schedule", schedule, *extra])
    problem, request = problem_of(args)
    row = {**request, "plans": []}
    for eps in EPSILONS:
        start = time.perf_counter()
        best = energy.plan(problem, eps)
        bound = energy.per_action_bound(problem, eps)
        row["plans"].append(
            {
                "epsilon": eps,
                "clocks_mhz": list(best.clocks),
                "saving": best.saving,
                "slowdown": best.slowdown,
                "time_s": best.time_s,
                "energy_j": best.energy_j,
                "full_clock_time_s": best.full_time_s,
                "full_clock_energy_j": best.full_energy_j,
                "exact": best.exact,
                "search_nodes": best.nodes,
                "search_s": time.perf_counter() - start,
                "per_action_bound_saving": 1 - bound / best.full_energy_j,
            }
        )
    epsilons = (0.0, 0.05) if smoke else energy.FRONTIER_EPSILONS
    front = energy.frontier(problem, epsilons, FRONTIER_NODES)
    full = front.plans[0]
    row["frontier"] = {
        "per_rank": [
            {"epsilon": q.epsilon, "slowdown": q.slowdown, "saving": q.saving, "exact": q.exact} for q in front.plans
        ],
        "one_clock": [
            {
                "clock_mhz": u["clock_mhz"],
                "slowdown": u["time_s"] / full.full_time_s - 1,
                "saving": 1 - u["energy_j"] / full.full_energy_j,
            }
            for u in front.uniform
        ],
        "per_action_bound": [{"epsilon": e, "saving": 1 - b / full.full_energy_j} for e, b in front.bounds],
    }
    return row


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(SCHEDULES), figsize=(4 * len(SCHEDULES), 7), sharey="row")
    for row in rows:
        r = list(LAYOUTS).index(row["layout"])
        ax = axes[r][list(SCHEDULES).index(row["schedule"])]
        f = row["frontier"]
        ax.plot(
            [1 + u["slowdown"] for u in f["one_clock"]],
            [1 - u["saving"] for u in f["one_clock"]],
            ".-",
            color="0.6",
            label="one clock, all ranks",
        )
        ax.plot(
            [1 + q["slowdown"] for q in f["per_rank"]],
            [1 - q["saving"] for q in f["per_rank"]],
            "o-",
            label="one clock per rank (plan)",
        )
        ax.plot(
            [1 + b["epsilon"] for b in f["per_action_bound"]],
            [1 - b["saving"] for b in f["per_action_bound"]],
            "v--",
            label="clock per action (bound)",
        )
        ax.set_xlim(0.99, 1.32)
        ax.set_title(f"{row['layout']} {row['schedule']} (p={row['p']}, v={row['v']}, m={row['m']})", fontsize=8)
        ax.grid(alpha=0.3)
        if r == 1:
            ax.set_xlabel("step time / full clock")
    for r, name in enumerate(LAYOUTS):
        axes[r][0].set_ylabel(f"{name}: step energy / full clock")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "energy_plan.json"))
    parser.add_argument("--smoke", action="store_true", help="two frontier points, one layout")
    args = parser.parse_args()
    rows = []
    for layout, flags in LAYOUTS.items():
        for schedule, extra in SCHEDULES.items():
            row = {"layout": layout, **one(flags, schedule, extra, args.smoke)}
            rows.append(row)
            for q in row["plans"]:
                bound = q["per_action_bound_saving"]
                print(
                    f"{layout} {schedule}: eps {q['epsilon']:g}: saving {q['saving']:.2%} at slowdown "
                    f"{q['slowdown']:.2%} (exact {q['exact']}); per-action bound {bound:.2%}"
                )
        if args.smoke:
            break
    out = write_json(args.out, {"published": PUBLISHED, "rows": rows}, end="\n")
    if not args.smoke:
        plot(rows, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
