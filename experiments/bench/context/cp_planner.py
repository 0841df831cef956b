"""Issue #36's planner questions: Llama-3-8B at 128k tokens on 8 x H200, and the sequence length at which context
parallelism (c > 1) starts to win. Every layout of 8 GPUs (t, p, c, b, k, schedule, recompute none / selective /
full) is predicted by `perf.timing` and held against the memory model (`perf.search.search`), bf16; at c = 1 the
attention is cuDNN's flash kernel (ptd-train's default on an H200), at c > 1 the p2p ring on the Pallas flash kernel
(the default under context parallelism; cuDNN's attention returns no log-sum-exp for the ring's merge).

    PYTHONPATH=. python -m experiments.bench.context.cp_planner [--out FILE]

Writes experiments/results/cp_planner.json: (a) the best layout at 131,072 tokens, the best with c = 1 (or why none
fits); (b) for S = 4k .. 512k the best layout with c = 1 and with c > 1 (global batch: 8 sequences for every S), and
the crossover, the shortest S from which c > 1 stays first wherever anything fits. Measured: c = 1 wins up to 128k
(the kernel ring's Pallas attention is 2.35 x slower per FLOP than cuDNN's, `perf/timing.FLASH_KERNEL_SLOWDOWN`);
from 256k nothing fits at c = 1 and t = 2, c = 4 does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.common import RESULTS, write_json
from ptd_jax.presets import model_preset
from ptd_jax.perf.hardware import HARDWARE
from ptd_jax.perf.search import describe, search

OUT = RESULTS / "cp_planner.json"
GPUS, BATCH, HW = 8, 8, HARDWARE["h200"]
POLICIES = ("none", "selective", "full")
LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288)
KEYS = ("iteration_time_s", "tflops_per_gpu", "mfu", "memory_gb_per_gpu", "recompute_granularity", "attention_backend")


def model(seq: int):
    return model_preset("llama3-8b").replace(
        seq_length=seq, dtype="bfloat16", fused_kernels=True, attention_backend="cudnn"
    )


def row(r: dict | None) -> dict | None:
    if r is None:
        return None
    return {"layout": describe(r), "schedule": r["pipeline_schedule"], **{k: r[k] for k in KEYS}}


def best_pair(seq: int) -> dict:
    """The best layout with c = 1 and with c > 1 at `seq` tokens, and the smallest memory that did not fit."""
    ranked = search(model(seq), GPUS, BATCH, HW, POLICIES, sensitivity=False, context_parallel_sizes=None)
    ones = [r for r in ranked["layouts"] if r["context_parallel_size"] == 1]
    more = [r for r in ranked["layouts"] if r["context_parallel_size"] > 1]
    tightest_one = min(
        (r for r in ranked["excluded"] if r["context_parallel_size"] == 1),
        key=lambda r: r["memory_gb_per_gpu"],
        default=None,
    )
    out = {"seq_length": seq, "best_c1": row(ones[0] if ones else None), "best_c_gt_1": row(more[0] if more else None)}
    out["best"] = row(ranked["layouts"][0]) if ranked["layouts"] else None
    out["smallest_c1_that_does_not_fit"] = row(tightest_one) if not ones else None
    out["layouts_that_fit"] = {"c=1": len(ones), "c>1": len(more)}
    c1, cn = out["best_c1"], out["best_c_gt_1"]
    out["c_gt_1_wins"] = cn is not None and (c1 is None or cn["iteration_time_s"] < c1["iteration_time_s"])
    out["speedup_c_gt_1"] = c1["iteration_time_s"] / cn["iteration_time_s"] if c1 and cn else None
    return out


def text(r: dict | None) -> str:
    return "nothing fits" if r is None else f"{r['layout']} {r['recompute_granularity']} {r['iteration_time_s']:.2f} s"


def crossover(sweep: list[dict]) -> int | None:
    """The shortest S from which c > 1 wins at every longer S of the sweep where some layout fits."""
    fitting = [s for s in sweep if s["best"] is not None]
    for i, s in enumerate(fitting):
        if all(x["c_gt_1_wins"] for x in fitting[i:]):
            return s["seq_length"]
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    sweep = []
    for seq in LENGTHS:
        s = best_pair(seq)
        sweep.append(s)
        print(f"S={seq:>6}: c=1 {text(s['best_c1'])} | c>1 {text(s['best_c_gt_1'])}", flush=True)
    result = {
        "model": "llama3-8b",
        "hardware": HW.name,
        "num_gpus": GPUS,
        "global_batch_size": BATCH,
        "dtype": "bfloat16",
        "recompute_policies": POLICIES,
        "at_131072": next(s for s in sweep if s["seq_length"] == 131072),
        "sweep": sweep,
        "crossover_seq_length": crossover(sweep),
    }
    write_json(args.out, result)
    print(
        json.dumps(
            {"at_131072_best": result["at_131072"]["best"], "crossover_seq_length": result["crossover_seq_length"]}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
