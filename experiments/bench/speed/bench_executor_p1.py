"""The pipeline executor forced to p = 1 against the reference step, with the same recomputation policy: what the
executor's machinery (the tick scans, the stash, the conds, the accumulators) costs when there is no pipeline.

One device, the 1F1B table at p = 1 (the F and the B of each microbatch in turn),
8 layers, h 128, s 128, b 1, m 8 (the model of `bench_pipeline.py`). For each of `--recompute` none and full:
the executor's gradient step and `train.reference.accumulate_gradients`, medians of alternating rounds.
Prints and writes {"<policy>": {"executor_s", "reference_s", "reference_over_executor",
"reference_over_executor_cpu_time"}} (wall and process CPU time; the CPU time follows the work executed on a loaded
machine): the issue's target is a ratio ≥ 0.95.

Usage: python -m experiments.bench.speed.bench_executor_p1 [--rounds 7]
       [--out experiments/results/bench_executor_p1.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from experiments.common import alternate, pipeline_step, reference_step, write_json

MODEL = dict(num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=128)
M = 8


def steps(recompute: str):
    """{"executor": (compiled, args), "reference": (compiled, args)} for the policy."""
    from ptd_jax.config import ModelConfig

    cfg = ModelConfig(**MODEL)
    return {
        "executor": pipeline_step(cfg, "1f1b", 1, "uniform", recompute, p=1, m=M),
        "reference": reference_step(cfg, recompute, m=M),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--recompute", nargs="+", default=["none", "full"], choices=["none", "selective", "full"])
    parser.add_argument("--out", default="experiments/results/bench_executor_p1.json")
    args = parser.parse_args(argv)
    compiled = {(r, name): step for r in args.recompute for name, step in steps(r).items()}
    times = alternate(compiled, args.rounds)
    result = {"model": {**MODEL, "m": M, "micro_batch_size": 1}, "rounds": args.rounds}
    for r in args.recompute:
        ex, ref = (statistics.median(times[(r, n)]["wall"]) for n in ("executor", "reference"))
        ex_cpu, ref_cpu = (statistics.median(times[(r, n)]["cpu"]) for n in ("executor", "reference"))
        result[r] = {
            "executor_s": ex,
            "reference_s": ref,
            "reference_over_executor": ref / ex,
            "executor_cpu_s": ex_cpu,
            "reference_cpu_s": ref_cpu,
            "reference_over_executor_cpu_time": ref_cpu / ex_cpu,
            "all_executor": times[(r, "executor")],
            "all_reference": times[(r, "reference")],
        }
        print(
            json.dumps(
                {
                    r: {
                        k: result[r][k]
                        for k in (
                            "executor_s",
                            "reference_s",
                            "reference_over_executor",
                            "reference_over_executor_cpu_time",
                        )
                    }
                }
            )
        )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
