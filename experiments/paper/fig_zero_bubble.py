"""Zero-bubble schedules next to 1F1B and interleaved 1F1B (Qi et al., "Zero Bubble Pipeline Parallelism",
Figure 3 style): the four timelines stacked at p = 4, m = 8 and f = b = w = 1, simulated on ptd_jax's tables
(`ptd_jax/parallel/pipeline/table.py`, placed by each spec's row rule: lockstep ticks for interleaved, unit ticks
for 1F1B, ZB-H1 and ZB-V, whose backwards split into I and W).

Writes experiments/results/fig_zero_bubble.png and experiments/results/fig_zero_bubble.json (per schedule:
ticks, makespan, bubble_fraction, formula_bubble, and per rank peak_stash (F to I or B), peak_in_flight (F to
W) and peak_w_stash (I to W)).

Usage: python -m experiments.paper.fig_zero_bubble [--out-dir DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments import common

P, M = 4, 8
TIMES = (1.0, 1.0, 1.0)
SCHEDULES = [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2), ("interleaved", 2)]


def tables() -> dict:
    from ptd_jax.parallel.pipeline import build, validate

    out = {}
    for name, v in SCHEDULES:
        sched = build(name, P, v, M)
        validate(sched)
        out[name] = sched
    return out


def summary(scheds: dict) -> dict:
    rows = {}
    for name, sched in scheds.items():
        sim = sched.simulate(times=TIMES)
        rows[name] = {
            "v": sched.v,
            "ticks": sched.ticks,
            "makespan": sim["makespan"],
            "bubble_fraction": sim["bubble_fraction"],
            "formula_bubble": sched.formula_bubble(TIMES),
            "peak_stash": sched.peak_stash,
            "peak_in_flight": sched.peak_in_flight,
            "peak_w_stash": sched.peak_w_stash,
            "slots": sched.slots,
        }
    return {
        "p": P,
        "m": M,
        "times": {"f": TIMES[0], "b": TIMES[1], "w": TIMES[2]},
        "note": "simulated: a tick lasts as long as its longest cell; bubble = (makespan - m(f+b+w)) / m(f+b+w); "
        "peak_stash in chunk-microbatches per rank (a ZB-V or interleaved chunk is half a stage)",
        "schedules": rows,
    }


def figure(scheds: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ptd_jax.parallel.pipeline.plot import draw

    makespan = max(s.simulate(times=TIMES)["makespan"] for s in scheds.values())
    fig, axes = plt.subplots(len(scheds), 1, figsize=(14, 2.1 * len(scheds)), sharex=True)
    for ax, (name, sched) in zip(axes, scheds.items()):
        sim = sched.simulate(times=TIMES)
        formula = sched.formula_bubble(TIMES)
        draw(
            ax,
            sched,
            TIMES,
            title=f"{name} (v={sched.v}): makespan {sim['makespan']:g}, bubble "
            f"{sim['bubble_fraction']:.3f}"
            + ("" if formula is None else f" (formula {formula:.3f})")
            + f", peak stash {max(sched.peak_stash)} chunk-microbatches",
        )
        ax.set_xlim(0, makespan)
    axes[-1].set_xlabel("time (one stage: F = B = W = 1); light = F, dark = B or I, xx = W, // = second chunk")
    fig.suptitle(f"p={P}, m={M}, f=b=w=1: 1F1B, ZB-H1, ZB-V and interleaved 1F1B (zero-bubble paper Figure 3 style)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args(argv)
    scheds = tables()
    json_path = common.write_json(args.out_dir / "fig_zero_bubble.json", summary(scheds), end="\n")
    figure(scheds, args.out_dir / "fig_zero_bubble.png")
    print(f"wrote {json_path} and {args.out_dir / 'fig_zero_bubble.png'}")


if __name__ == "__main__":
    main()
