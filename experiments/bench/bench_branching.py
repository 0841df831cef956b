"""`--pipeline-branching` on fake CPU devices: the grad step under "uniform" and "per-rank", in alternating rounds
(medians), for the two layouts the default ("auto": per-rank on XLA:CPU) was chosen on: compare_torch's model at
p = 2 1F1B (t = 1) and the demo's d2 p2 t2 interleaved layout (tiny preset). The ratio uniform / per-rank is the
step time "auto" saves on CPU. On a GPU both are expected to take the same lockstep time (unmeasured).

Usage: python -m experiments.bench_branching [--rounds 5] [--smoke] [--out experiments/results/bench_branching.json]
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments import figures

LAYOUTS = {
    "compare_torch p2 1f1b": (dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128,
                                   vocab_size=257), dict(schedule="1f1b", p=2, v=1, t=1, d=1, b=2, m=4)),
    "demo d2 p2 t2 interleaved": ("tiny", dict(schedule="interleaved", p=2, v=2, t=2, d=2, b=2, m=4)),
}


def main(argv=None) -> dict:
    args = figures.parse_args(__doc__.splitlines()[0], argv)
    figures.fake_devices(8)
    from ptd_jax.config import ModelConfig, model_preset

    result = {"rounds": args.rounds, "timing_note": figures.TIMING_NOTE, "layouts": {}}
    for name, (model, layout) in LAYOUTS.items():
        cfg = model_preset(model) if isinstance(model, str) else ModelConfig(**model)
        if args.smoke:
            cfg = figures.small_model(True)
        out = figures.measure_layouts(cfg, {br: dict(layout, branching=br) for br in ("uniform", "per-rank")},
                                      args.rounds)
        med = out["median_step_s"]
        result["layouts"][name] = {**out, "uniform_over_per_rank": med["uniform"] / med["per-rank"]}
        print(name, {k: round(v, 4) for k, v in med.items()}, round(med["uniform"] / med["per-rank"], 3))
    path = Path(args.out or figures.RESULTS / "bench_branching.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
