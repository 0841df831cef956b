"""`ptd-plan predict` against the H200's measured 1.3B step (experiments/results/bench_kernels_gpu_steps.json: one
GPU, b = 4, s = 2048, bf16, selective recomputation, V = 50257, each attention backend with the fused kernels).

    PYTHONPATH=. python experiments/bench/speed/plan_vs_h200.py     # writes experiments/results/plan_vs_h200.json
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from ptd_jax.cli import plan

RESULTS = Path(__file__).resolve().parents[2] / "results"
FLAGS = "--model-preset 1.3b --micro-batch-size 4 --global-batch-size 4 --bf16 --target h200 --vocab-size 50257"
FLAGS += " --recompute-granularity selective"


def predicted_step_s(backend: str, fused: bool) -> float:
    argv = [
        "predict",
        *FLAGS.split(),
        "--attention-backend",
        backend,
        "--fused-kernels" if fused else "--no-fused-kernels",
    ]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert plan.main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())["iteration_time_s"]


def main() -> None:
    measured = json.loads((RESULTS / "bench_kernels_gpu_steps.json").read_text())["training_step"]
    rows = []
    for row in measured:
        if "step_s" not in row:
            continue
        backend = row["attention_backend"]
        predicted = predicted_step_s(backend, row["fused_kernels"])
        rows.append(
            {
                "attention_backend": backend,
                "fused_kernels": row["fused_kernels"],
                "measured_step_s": row["step_s"],
                "predicted_step_s": predicted,
                "measured_over_predicted": row["step_s"] / predicted,
            }
        )
        ratio = rows[-1]["measured_over_predicted"]
        fused = row["fused_kernels"]
        print(f"{backend:7s} {fused=!s:5s} measured {row['step_s']:.4f} s, predicted {predicted:.4f} s: {ratio:.3f}")
    out = {"flags": FLAGS, "device": "NVIDIA H200", "rows": rows}
    (RESULTS / "plan_vs_h200.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
