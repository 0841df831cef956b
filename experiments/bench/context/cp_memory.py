"""Context parallelism's memory under XLA:GPU: `ptd-plan predict` against `ptd-train --compile-only` for a
long-sequence case at c = 1, 2, 4 (issue #36's done-when: the compiled memory falls with c as the planner predicts,
within 10%). At c = 1 the attention is the target's default (flash: no s x s scores), at c > 1 this project's XLA
blocks (`parallel/context.py`).

    PYTHONPATH=. python -m experiments.bench.context.cp_memory [--only NAME ...] [--out FILE]

Needs the gpu-compile extra (the CUDA plugin; no GPU). Writes experiments/results/cp_memory.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from experiments.bench.memory.plan_vs_compiled import measure, predict

OUT = Path(__file__).resolve().parents[2] / "results" / "cp_memory.json"
GIB = 2**30

BASE = "--model-preset llama3.2-1b --num-layers {layers} --seq-length {seq} --micro-batch-size 1 --global-batch-size 1 "
BASE += "--bf16 --recompute-granularity {recompute} --target h200"


def command(c: int, layers: int = 2, seq: int = 16384, recompute: str = "none", comm: str = "p2p", t: int = 1) -> str:
    """One ptd-train command line on c·t GPUs (d = 1), Llama-3.2-1B's layers with a 32k vocabulary (the logits, which
    do not depend on the attention, would otherwise outweigh a few layers)."""
    cmd = BASE.format(layers=layers, seq=seq, recompute=recompute) + " --vocab-size 32000"
    cmd += f" --tensor-model-parallel-size {t} --num-gpus {c * t}"
    if c > 1:
        cmd += f" --context-parallel-size {c} --cp-comm-type {comm}"
    return cmd


CASES: dict[str, str] = {
    "c1-none": command(1),
    "c1-none-4layers": command(1, layers=4),
    "c4-none-4layers": command(4, layers=4),
    "c2-none-8k-4layers": command(2, seq=8192, layers=4),
    "c2-none-allgather-4layers": command(2, comm="all_gather", layers=4),
    "c2-selective-allgather": command(2, comm="all_gather", recompute="selective"),
    "c2-selective-4layers": command(2, recompute="selective", layers=4),
    "c4-selective-4layers": command(4, recompute="selective", layers=4),
    "c1-selective-4layers": command(1, recompute="selective", layers=4),
    "c2-none": command(2),
    "c4-none": command(4),
    "c2-none-4layers": command(2, layers=4),
    "c2-none-8k": command(2, seq=8192),
    "c1-selective": command(1, recompute="selective"),
    "c2-selective": command(2, recompute="selective"),
    "c4-selective": command(4, recompute="selective"),
    "c2-none-allgather": command(2, comm="all_gather"),
    "c2-none-t2": command(2, t=2),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", help="case names (default: all)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--predict-only", action="store_true", help="keep --out's compiled figures, predict them again")
    args = ap.parse_args(argv)
    old = {r["case"]: r for r in json.loads(args.out.read_text())["rows"]} if args.out.exists() else {}
    for name in args.only or list(CASES):
        if args.predict_only:
            row = old[name]
            row["predicted_gib"] = predict(row["command"])["memory_gb_per_gpu"]
        else:
            row = measure(name, CASES[name])
        row["compiled_over_predicted"] = row["compiled_gib"] / row["predicted_gib"]
        old[name] = row
        print(
            f"{name:<22} predicted {row['predicted_gib']:7.2f} GiB  compiled {row['compiled_gib']:7.2f} GiB  "
            f"compiled/predicted {row['compiled_over_predicted']:.3f}",
            flush=True,
        )
        args.out.write_text(json.dumps({"rows": list(old.values())}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
