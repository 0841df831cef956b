"""`ptd-plan predict` against `ptd-train --compile-only` on a grid of layouts: the same command line given to both, the
predicted bytes per GPU beside XLA:GPU's compiled total (train step; the evaluation step is smaller in every case).

Each case is one ptd-train command line (no data flags: V is the preset's). The grid spans GPT and Llama presets,
t in {1, 2, 4, 8}, p in {1, 2, 4}, v in {1, 2}, micro-batch 1, 2, 4, each recompute policy, sequence parallelism and
the distributed optimizer on and off, the fused and the zero-bubble schedules, and the three compile targets.

    PYTHONPATH=. python experiments/bench/memory/plan_vs_compiled.py [--only NAME ...] [--out FILE]

Needs the gpu-compile extra (the CUDA plugin; no GPU). Writes experiments/results/plan_vs_compiled.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

GIB = 2**30
OUT = Path(__file__).resolve().parents[2] / "results" / "plan_vs_compiled.json"

BF16 = "--bf16 --global-batch-size 32"
CASES: dict[str, str] = {
    # the case: 1.3B, t = 4, p = 2, b = 2, B = 32, bf16, 8 x H200
    "1.3b-t4p2-b2-h200": f"--model-preset 1.3b --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 "
    f"--micro-batch-size 2 {BF16} --num-gpus 8 --target h200",
    "1.3b-t1p4-b1-zbh1": f"--model-preset 1.3b --pipeline-model-parallel-size 4 --micro-batch-size 1 {BF16} "
    "--num-gpus 8 --target h100-sxm --pipeline-schedule zb-h1",
    "1.3b-t1p4-b1-zbv": f"--model-preset 1.3b --pipeline-model-parallel-size 4 --micro-batch-size 1 {BF16} "
    "--num-gpus 8 --target h100-sxm --pipeline-schedule zb-v",
    "1.3b-t1p4-b1-1f1b": f"--model-preset 1.3b --pipeline-model-parallel-size 4 --micro-batch-size 1 {BF16} "
    "--num-gpus 8 --target h100-sxm",
    "1.3b-t2p4-b2-interleaved": f"--model-preset 1.3b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
    f"--num-layers-per-virtual-pipeline-stage 3 --pipeline-schedule interleaved --micro-batch-size 2 {BF16} "
    "--num-gpus 8 --target a100-80gb",
    "1.3b-t2p2-b4-sp-selective": f"--model-preset 1.3b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    f"--micro-batch-size 4 --sequence-parallel --recompute-granularity selective {BF16} --num-gpus 8 "
    "--target h100-sxm",
    "1.3b-t2p2-b2-full-do": f"--model-preset 1.3b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    f"--micro-batch-size 2 --recompute-granularity full --use-distributed-optimizer {BF16} --num-gpus 8 "
    "--target a100-80gb",
    "1.3b-t8p1-b1-sp": f"--model-preset 1.3b --tensor-model-parallel-size 8 --micro-batch-size 1 --sequence-parallel "
    f"{BF16} --num-gpus 8 --target h200",
    "1.3b-t1p1-b1-do": f"--model-preset 1.3b --micro-batch-size 1 --use-distributed-optimizer {BF16} --num-gpus 8 "
    "--target h100-sxm",
    "1.3b-t4p1-b4-selective": f"--model-preset 1.3b --tensor-model-parallel-size 4 --micro-batch-size 4 "
    f"--recompute-granularity selective {BF16} --num-gpus 8 --target a100-80gb",
    "gpt2-small-t2p2-b4-zbh1-sp": "--model-preset gpt2-small --tensor-model-parallel-size 2 "
    f"--pipeline-model-parallel-size 2 --micro-batch-size 4 --sequence-parallel --pipeline-schedule zb-h1 {BF16} "
    "--num-gpus 8 --target h100-sxm",
    "gpt2-small-t1p2-b4-gpipe": "--model-preset gpt2-small --pipeline-model-parallel-size 2 --micro-batch-size 4 "
    f"--pipeline-schedule gpipe {BF16} --num-gpus 8 --target a100-80gb",
    "gpt2-small-t1p1-b2-fp32": "--model-preset gpt2-small --micro-batch-size 2 --global-batch-size 32 --num-gpus 8 "
    "--target h100-sxm",
    "paper-3.6b-t4p2-b1-full": "--model-preset paper-3.6b --tensor-model-parallel-size 4 "
    f"--pipeline-model-parallel-size 2 --micro-batch-size 1 --recompute-granularity full {BF16} --num-gpus 8 "
    "--target a100-80gb",
    "paper-7.5b-t8p1-b1-sp-selective": "--model-preset paper-7.5b --tensor-model-parallel-size 8 --micro-batch-size 1 "
    f"--sequence-parallel --recompute-granularity selective {BF16} --num-gpus 8 --target h200",
    "paper-7.5b-t2p2-b2-zbv-do": "--model-preset paper-7.5b --tensor-model-parallel-size 2 "
    f"--pipeline-model-parallel-size 2 --micro-batch-size 2 --pipeline-schedule zb-v --use-distributed-optimizer "
    f"{BF16} --num-gpus 16 --target h100-sxm",
    "llama3.2-1b-t2p2-b1": "--model-preset llama3.2-1b --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
    f"--micro-batch-size 1 {BF16} --num-gpus 8 --target h200",
    "llama3.2-1b-t4p1-b2-sp-selective": "--model-preset llama3.2-1b --tensor-model-parallel-size 4 "
    f"--micro-batch-size 2 --sequence-parallel --recompute-granularity selective {BF16} --num-gpus 8 --target h200",
    "llama3.2-1b-t1p4-b1-zbh1": "--model-preset llama3.2-1b --pipeline-model-parallel-size 4 --micro-batch-size 1 "
    f"--pipeline-schedule zb-h1 --seq-length 4096 {BF16} --num-gpus 8 --target h100-sxm",
    "llama3.2-3b-t2p2-b1-full-do": "--model-preset llama3.2-3b --tensor-model-parallel-size 2 "
    "--pipeline-model-parallel-size 2 --micro-batch-size 1 --recompute-granularity full --use-distributed-optimizer "
    f"{BF16} --num-gpus 8 --target a100-80gb",
    "llama3.2-3b-t4p2-b2-interleaved-sp": "--model-preset llama3.2-3b --tensor-model-parallel-size 4 "
    "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 7 --pipeline-schedule interleaved "
    f"--micro-batch-size 2 --sequence-parallel --seq-length 4096 {BF16} --num-gpus 8 --target h200",
    "llama3-8b-t8p1-b1-sp-full": "--model-preset llama3-8b --tensor-model-parallel-size 8 --micro-batch-size 1 "
    f"--sequence-parallel --recompute-granularity full {BF16} --num-gpus 8 --target h200",
    "llama3-8b-t4p2-b1-sp": "--model-preset llama3-8b --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 "
    f"--micro-batch-size 1 --sequence-parallel --seq-length 4096 {BF16} --num-gpus 8 --target h100-sxm",
    "mistral-7b-t4p2-b1-sp-xla": "--model-preset mistral-7b --tensor-model-parallel-size 4 "
    f"--pipeline-model-parallel-size 2 --micro-batch-size 1 --sequence-parallel --seq-length 4096 {BF16} "
    "--num-gpus 8 --target h100-sxm",
    "qwen2.5-7b-t4p2-b2-selective-do": "--model-preset qwen2.5-7b --tensor-model-parallel-size 4 "
    "--pipeline-model-parallel-size 2 --micro-batch-size 2 --recompute-granularity selective "
    f"--use-distributed-optimizer --seq-length 2048 {BF16} --num-gpus 16 --target a100-80gb",
    "llama2-7b-t2p4-b4-1f1b-sp": "--model-preset llama2-7b --tensor-model-parallel-size 2 "
    f"--pipeline-model-parallel-size 4 --micro-batch-size 4 --sequence-parallel --seq-length 2048 {BF16} "
    "--num-gpus 8 --target h200",
}


def _quiet(fn, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(argv)
    return out.getvalue()


def predict(command: str) -> dict:
    from ptd_jax.cli import plan

    return json.loads(_quiet(plan.run, ["predict", *command.split(), "--json"]).strip().splitlines()[-1])


def measure(name: str, command: str) -> dict:
    from ptd_jax.cli.train import command as train

    argv = command.split()
    predicted = predict(command)
    start = time.perf_counter()
    compiled = json.loads(_quiet(train.run, ["--compile-only", *argv, "--json"]).strip().splitlines()[-1])
    train_step = compiled["memory"]["train_step"]
    ratio = compiled["memory_bytes_per_gpu"] / (predicted["memory_gb_per_gpu"] * GIB)
    return {
        "case": name,
        "command": command,
        "predicted_gib": predicted["memory_gb_per_gpu"],
        "predicted_terms_gib": predicted["memory_terms_gb"],
        "compiled_gib": compiled["memory_bytes_per_gpu"] / GIB,
        "compiled_train_step_gib": {k: v / GIB for k, v in train_step.items()},
        "compiled_eval_step_gib": compiled["memory"]["eval_step"]["total"] / GIB,
        "compiled_over_predicted": ratio,
        "resolved": compiled["resolved"],
        "layout": compiled["layout"],
        "seconds": time.perf_counter() - start,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="case names (default: all)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--predict-only",
        action="store_true",
        help="keep --out's compiled figures and predict them again with the current model (the program unchanged)",
    )
    args = ap.parse_args(argv)
    if args.predict_only:
        rows = json.loads(args.out.read_text())["rows"]
        for row in rows:
            predicted = predict(row["command"])
            row["predicted_gib"], row["predicted_terms_gib"] = (
                predicted["memory_gb_per_gpu"],
                predicted["memory_terms_gb"],
            )
            row["compiled_over_predicted"] = row["compiled_gib"] / row["predicted_gib"]
            print(f"{row['case']:<36} compiled/predicted {row['compiled_over_predicted']:.3f}")
        print(json.dumps(write(args.out, rows)))
        return 0
    names = args.only or list(CASES)
    rows = []
    for name in names:
        try:
            row = measure(name, CASES[name])
        except Exception as err:  # one case's failure is reported, the others still run
            print(f"{name:<36} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
            continue
        rows.append(row)
        print(
            f"{name:<36} predicted {row['predicted_gib']:7.2f} GiB  compiled {row['compiled_gib']:7.2f} GiB  "
            f"compiled/predicted {row['compiled_over_predicted']:.3f}",
            flush=True,
        )
        write(args.out, rows)  # after every case: a long grid keeps what it has measured
    print(json.dumps(write(args.out, rows)))
    return 0


def write(path: Path, rows: list[dict]) -> dict:
    errors = [abs(r["compiled_over_predicted"] - 1) for r in rows]
    summary = {
        "cases": len(rows),
        "median_abs_error": statistics.median(errors) if errors else None,
        "max_abs_error": max(errors, default=None),
        "within_10_percent": sum(e <= 0.10 for e in errors),
    }
    path.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    sys.exit(main())
