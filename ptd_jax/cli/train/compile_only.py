"""`ptd-train --compile-only --target NAME --num-gpus N`: the run's training and evaluation steps compiled by
XLA:GPU for N GPUs of the target (hosts of 8) on this machine, no GPU and no data needed (`ptd_jax/aot`).

Prints one summary (or `--json`: one object) — per-GPU memory from XLA against the device's, compile time, the
collectives and kernels in the compiled HLO, and what the `auto` defaults resolved to. Exit 0 when it fits, 1 when
it does not (one line with the bytes), 2 on bad input (the usual one line).
"""

from __future__ import annotations

import json
import sys

from ptd_jax.perf.hardware import TARGETS

GIB = 2**30


def describe(s: dict) -> str:
    mem, lay, res = s["memory"]["train_step"], s["layout"], s["resolved"]
    lines = [
        f"compiled for {s['num_gpus']} x {s['device']} ({s['target']}): layout d={lay['data']} p={lay['pipe']} "
        f"t={lay['tensor']} v={lay['virtual']} {lay['schedule']}, b={lay['micro_batch_size']} "
        f"m={lay['num_microbatches']}; resolved: branching {res['pipeline_branching']}, attention "
        f"{res['attention_backend']}, fused kernels {'on' if res['fused_kernels'] else 'off'}, {res['dtype']}, "
        f"V={res['vocab_size']}",
        f"  memory per GPU (train step): arguments {mem['arguments'] / GIB:.2f} GiB, temporaries "
        f"{mem['temporaries'] / GIB:.2f}, outputs {mem['outputs'] / GIB:.2f} (aliased {mem['aliased'] / GIB:.2f}), "
        f"total {mem['total'] / GIB:.2f} GiB of {s['memory_budget_bytes'] / GIB:.2f} GiB usable "
        f"({s['allocator_fraction']:g} of {s['device_memory_bytes'] / GIB:.2f} GiB: XLA_PYTHON_CLIENT_MEM_FRACTION): "
        f"{'fits' if s['fits'] else 'DOES NOT FIT'}",
    ]
    if "eval_step" in s["memory"]:
        lines.append(f"  eval step: total {s['memory']['eval_step']['total'] / GIB:.2f} GiB")
    lines.append(f"  compile time {s['compile_time_s']:.1f} s")
    lines.append(
        "  collectives: "
        + ", ".join(
            f"{op} x{c['count']} ({c['bytes'] / 2**20:.1f} MiB, groups of "
            f"{'/'.join(str(g) if g else 'pairs' for g in c['group_sizes'])})"
            for op, c in s["collectives"].items()
        )
    )
    lines.append("  kernels: " + ", ".join(f"{kind} {n}" for kind, n in s["kernels"].items()))
    return "\n".join(lines)


def run(args, model_cfg, parallel, train_cfg) -> int:
    from ptd_jax.aot.compile import compile_steps, kernel_target, summary
    from ptd_jax.cli.train.checks import check_attention_kernels

    target = TARGETS[args.target]
    model_cfg = check_attention_kernels(model_cfg, args, kernel_target(target))
    parallel, programs = compile_steps(model_cfg, parallel, train_cfg, target, parallel.num_devices)
    result = summary(model_cfg, parallel, target, parallel.num_devices, programs)
    print(json.dumps(result) if args.json else describe(result))
    if not result["fits"]:
        print(
            f"ptd-train: the step needs {result['memory_bytes_per_gpu']:,} bytes per GPU but one {target.name} has "
            f"{result['memory_budget_bytes']:,} usable ({result['allocator_fraction']:g} of "
            f"{target.memory_bytes:,})",
            file=sys.stderr,
        )
        return 1
    return 0
