"""Pipeline bubble vs number of microbatches for GPipe, 1F1B and interleaved 1F1B (paper §2.2, Figs. 3-4 and the
formulas (p−1)/m and (p−1)/(v·m)): simulated on ptd_jax's lockstep tables, and measured on fake CPU devices.

Simulated: `ptd_jax.parallel.pipeline` (`table.build` + `Table.simulate`, backward = 2 forwards) at p = 4, next to the
formula. 1F1B is the paper's on lockstep ticks, `1f1b-lockstep` (`figures.PAPERS_1F1B`: fused backwards, (p−1)/m at any
B/F); "1f1b" itself splits its backwards on unit ticks and cannot run under uniform branching. Measured: the small
model's gradient step (`common.pipeline_step`, uniform branching) at p = 4 on 4 fake devices for each m; per schedule
the step times are fitted as T(m) = c + m·t_mb (least squares), and the measured bubble at m is (T(m) −
m·t_mb)/(m·t_mb), the paper's t_pb/t_id (the same split as the loop's measured bubble, `ptd_jax/train/bubble.py`; c also
holds per-step fixed costs, so it is an upper bound).

Usage: python -m experiments.paper.fig_bubble [--rounds 5] [--ms 4 8 16 24] [--smoke] [--out PATH]
"""

from __future__ import annotations

import json

from experiments import common
from experiments.paper import figures

P, V = 4, 2
SCHEDULES = [("gpipe", 1), (figures.PAPERS_1F1B, 1), ("interleaved", V)]


def simulated(ms=range(1, 33)) -> dict:
    from ptd_jax.parallel.pipeline import ScheduleError, build

    out = {}
    for schedule, v in SCHEDULES:
        rows = []
        for m in ms:
            try:
                sched = build(schedule, P, v, m)
            except ScheduleError:
                continue  # interleaved: m a multiple of p (Megatron's rule with G = p)
            rows.append(
                {
                    "m": m,
                    "bubble": sched.simulate()["bubble_fraction"],
                    "formula": sched.formula_bubble(),
                    "ticks": sched.ticks,
                }
            )
        out[f"{schedule} v={v}"] = rows
    return out


def fit_line(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def measured(ms, rounds: int, smoke: bool) -> dict:
    layouts = {f"{s} v={v} m={m}": dict(schedule=s, p=P, v=v, m=m) for s, v in SCHEDULES for m in ms}
    out = {**common.measure_layouts(common.small_model(smoke), layouts, rounds), "p": P, "ms": list(ms), "fits": {}}
    for schedule, v in SCHEDULES:
        name = f"{schedule} v={v}"
        ts = [out["median_step_s"][f"{name} m={m}"] for m in ms]
        c, t_mb = fit_line(list(ms), ts)
        out["fits"][name] = {
            "fixed_s": c,
            "per_microbatch_s": t_mb,
            "bubble": [{"m": m, "measured": (t - m * t_mb) / (m * t_mb)} for m, t in zip(ms, ts)],
        }
    return out


def plot(result, plt):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    colors = {"gpipe v=1": "C0", f"{figures.PAPERS_1F1B} v=1": "C1", f"interleaved v={V}": "C2"}
    for name, rows in result["simulated"].items():
        ms = [r["m"] for r in rows]
        a1.plot(ms, [r["bubble"] for r in rows], "o-", ms=3, color=colors[name], label=f"{name}: lockstep simulated")
        a1.plot(ms, [r["formula"] for r in rows], ":", color=colors[name], label=f"{name}: formula")
    a1.set(
        xlabel="microbatches m",
        ylabel="bubble fraction t_pb / t_id",
        ylim=(-0.4, 1.6),
        title=f"simulated, p={P} (GPipe and 1F1B coincide)",
    )
    a1.legend(fontsize=7)
    meas = result["measured"]
    for name, fit in meas["fits"].items():
        rows = fit["bubble"]
        a2.plot(
            [r["m"] for r in rows],
            [r["measured"] for r in rows],
            "s-",
            color=colors[name],
            label=f"{name}: measured (fit T = c + m·t_mb)",
        )
        sim = {r["m"]: r["bubble"] for r in result["simulated"][name]}
        a2.plot(
            [r["m"] for r in rows],
            [sim.get(r["m"]) for r in rows],
            "x:",
            color=colors[name],
            label=f"{name}: simulated",
        )
    a2.axhline(0, color="gray", lw=0.6)
    a2.set(xlabel="microbatches m", title=f"measured on {P} fake CPU devices (uniform branching)")
    a2.legend(fontsize=7)
    fig.suptitle(
        "Pipeline bubble vs microbatches (paper §2.2: (p−1)/m for GPipe and 1F1B, (p−1)/(v·m) interleaved)", fontsize=10
    )


def main(argv=None) -> None:
    args = figures.parse_args(
        __doc__.splitlines()[0],
        argv,
        extra=lambda parser: parser.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16, 24]),
    )
    if args.smoke:
        args.ms = [4, 8]
    common.fake_devices(P)
    result = {
        "simulated": simulated(),
        "measured": measured(args.ms, args.rounds, args.smoke),
        "timing_note": common.TIMING_NOTE,
        "paper": "bubble (p−1)/m (GPipe, 1F1B) and (p−1)/(v·m) (interleaved), §2.2.1-2.2.2",
    }
    figures.write("fig_bubble", result, plot, args.out)
    fits = result["measured"]["fits"]
    summary = {name: [round(r["measured"], 3) for r in fit["bubble"]] for name, fit in fits.items()}
    print(json.dumps({"ms": args.ms, "measured_bubble": summary}))


if __name__ == "__main__":
    main()
