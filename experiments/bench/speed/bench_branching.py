"""`--pipeline-branching` on fake CPU devices: the grad step under "uniform" and "per-rank", in alternating rounds
(medians), for the two layouts the default ("auto": per-rank on XLA:CPU) was chosen on: compare_torch's model at
p = 2 1F1B (t = 1) and the demo's d2 p2 t2 interleaved layout (tiny preset). The ratio uniform / per-rank is the
step time "auto" saves on CPU. On a GPU both are expected to take the same lockstep time (unmeasured). Uniform
branching needs one kind per tick, so the p = 2 layout runs `1f1b-lockstep` (fused backwards; "1f1b" splits them on
unit ticks and runs per-rank only); the layout keeps its name.

Usage: python -m experiments.bench.speed.bench_branching [--rounds 5] [--smoke]
       [--out experiments/results/bench_branching.json]
"""

from __future__ import annotations

import argparse

from experiments import common

LAYOUTS = {
    "compare_torch p2 1f1b": (
        dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=257),
        dict(schedule="1f1b-lockstep", p=2, v=1, t=1, d=1, b=2, m=4),
    ),
    "demo d2 p2 t2 interleaved": ("tiny", dict(schedule="interleaved", p=2, v=2, t=2, d=2, b=2, m=4)),
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--out", default=str(common.RESULTS / "bench_branching.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and one round: checks that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds = 1
    common.fake_devices(8)
    from ptd_jax.config import ModelConfig
    from ptd_jax.presets import model_preset

    result = {"rounds": args.rounds, "timing_note": common.TIMING_NOTE, "layouts": {}}
    for name, (model, layout) in LAYOUTS.items():
        cfg = model_preset(model) if isinstance(model, str) else ModelConfig(**model)
        if args.smoke:
            cfg = common.small_model(True)
        out = common.measure_layouts(
            cfg, {br: dict(layout, branching=br) for br in ("uniform", "per-rank")}, args.rounds
        )
        med = out["median_step_s"]
        result["layouts"][name] = {**out, "uniform_over_per_rank": med["uniform"] / med["per-rank"]}
        print(name, {k: round(v, 4) for k, v in med.items()}, round(med["uniform"] / med["per-rank"], 3))
    common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
