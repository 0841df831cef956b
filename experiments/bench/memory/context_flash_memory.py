"""Memory per GPU of a long-sequence train step under context parallelism, attention by the Pallas flash kernel's ring
against XLA's blocks (`ptd_jax/parallel/context.py`), from XLA:GPU's deviceless compile (`ptd-train --compile-only
--json`; the gpu-compile extra, no GPU).

    python -m experiments.bench.memory.context_flash_memory [--seq-lengths 16384 32768] [--sizes 1 2 4]
        [--out experiments/results/context_flash_memory.json]

Llama 3.2 1B cut to 2 layers, bf16, b = 1, t = 1, d = 1 (num_gpus = c), no recomputation, H200. The train step's
temporaries and total (arguments + outputs − aliased + temporaries) per c and attention backend: with the kernel
no score block exists, so what grows with the sequence falls about 1/c; XLA's ring materialises float32 scores
(and probabilities) per Sc × Sc sub-block, [b, H, S/(2c), S/(2c)] each. XLA at c = 1 is the single-device
attention's [b, H, S, S].
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from experiments.common import RESULTS, ROOT, write_json

GIB = 2**30
MODEL = ["--model-preset", "llama3.2-1b", "--num-layers", "2", "--bf16", "--recompute-granularity", "none"]
LAYOUT = ["--micro-batch-size", "1", "--global-batch-size", "1", "--tensor-model-parallel-size", "1"]


def compile_case(seq_length: int, c: int, backend: str, target: str) -> dict:
    """`ptd-train --compile-only --json` of one case, in its own process (each compile's memory is its own)."""
    args = [*MODEL, *LAYOUT, "--seq-length", str(seq_length), "--context-parallel-size", str(c)]
    args += ["--attention-backend", backend, "--compile-only", "--target", target, "--num-gpus", str(c), "--json"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "ptd_jax.cli.train", *args], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode not in (0, 1):  # 1: compiled, but more than the GPU's memory (the JSON says so too)
        raise RuntimeError(f"seq_length={seq_length} c={c} {backend}: {done.stderr.strip()[-400:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    train = out["memory"]["train_step"]
    return {
        "seq_length": seq_length,
        "context_parallel_size": c,
        "attention_backend": backend,
        "fits": out["fits"],
        "temporaries_gib": train["temporaries"] / GIB,
        "total_gib": train["total"] / GIB,
        "arguments_gib": train["arguments"] / GIB,
        "compile_time_s": out["compile_time_s_by_program"]["train_step"],
        "kernels": out["kernels"],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--backends", nargs="+", default=["pallas", "xla"])
    parser.add_argument("--target", default="h200")
    parser.add_argument("--out", default=str(RESULTS / "context_flash_memory.json"))
    args = parser.parse_args(argv)
    rows = []
    for seq_length in args.seq_lengths:
        for backend in args.backends:
            for c in args.sizes:
                start = time.perf_counter()
                row = compile_case(seq_length, c, backend, args.target)
                rows.append(row)
                print(
                    f"S={seq_length} c={c} {backend}: temporaries {row['temporaries_gib']:.2f} GiB, total "
                    f"{row['total_gib']:.2f} GiB ({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    write_json(
        args.out,
        {
            "what": "train step memory per GPU, XLA:GPU deviceless compile (ptd-train --compile-only --json)",
            "model": "llama3.2-1b, 2 layers, bf16, fused LayerNorm/loss kernels, recompute none",
            "layout": "b=1, t=1, d=1, p=1, cp_comm_type=p2p, num_gpus=c",
            "target": args.target,
            "cases": rows,
        },
    )


if __name__ == "__main__":
    main()
