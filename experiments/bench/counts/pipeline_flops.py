"""Matmul FLOPs the pipeline executor runs per device per step, against what Megatron's schedule runs (paper §2.2,
§3.5), counted from the traced step without compiling or running it.

For each named piece of the executor's work (`layer_forward`, `layer_backward`, `layer_input_backward`,
`layer_weight_backward` per layer, `head_backward`: one call each in
the jaxpr, found by `ptd_jax.analysis.jaxpr.named_calls`), the matmul FLOPs of its jaxpr are summed by
`analysis.jaxpr.dot_flops` (2·M·N·K per dot_general, loops multiplied by their trip counts, the larger branch of
any inner conditional). The schedule table says what each tick (uniform) or cell (per-rank)
runs (`lowering.columns`: where the head runs), so:
- executed FLOPs of rank r = Σ over ticks of what r runs: a chunk's forward or backward, plus the head where the
  table puts it (under "uniform" an idle cell runs its tick's chunk work on a dummy, and every rank runs the head
  on the ticks where some rank needs it, so every rank executes the same FLOPs);
- critical path = Σ over ticks of the largest cell's FLOPs (a lockstep tick lasts as long as its busiest rank);
- Megatron, analytically (not from this code): every forward of a chunk of k layers costs
  k·(24·b·s·h² + 4·b·s²·h)/t, every backward twice that, plus a recomputed forward under recompute="full" or the
  attention core's two batched matmuls (k·4·b·s²·h/t) under "selective", and the last stage adds the output
  layer, 2·b·s·h·Vp/t forward and twice that backward, once per microbatch.
The bench model is `common.BENCH_MODEL`, as in `speed/bench_interleaving.py` (the paper's vocabulary/hidden ratio;
GPipe, 1F1B and interleaved at p = 4, m = 8); the 1.3B preset runs 1F1B and interleaved at (p, m, t) = (4, 16, 2),
v = 1 or 2, b = 1, traced on fake CPU devices.

Usage: python -m experiments.bench.counts.pipeline_flops [--recompute none|selective|full]
       [--out experiments/results/pipeline_flops.json]
"""

from __future__ import annotations

import argparse
import json

from experiments.common import BENCH_MODEL, fake_devices, write_json

CASES = [  # (name, model overrides or preset, p, v, m, t)
    ("bench 1f1b", BENCH_MODEL, "1f1b", 4, 1, 8, 1),
    ("bench 1f1b-lockstep", BENCH_MODEL, "1f1b-lockstep", 4, 1, 8, 1),
    ("bench interleaved", BENCH_MODEL, "interleaved", 4, 2, 8, 1),
    ("bench gpipe", BENCH_MODEL, "gpipe", 4, 1, 8, 1),
    ("1.3b 1f1b", "1.3b", "1f1b", 4, 1, 16, 2),
    ("1.3b interleaved", "1.3b", "interleaved", 4, 2, 16, 2),
]


def megatron_flops(cfg, p, v, m, t, recompute="none", b=1):
    """Per pipeline rank: every rank runs m·v chunk forwards and m·v backwards (twice a forward, plus what
    `recompute` recomputes); the last rank also the output layer, m times."""
    s, h, k = cfg.seq_length, cfg.hidden_size, cfg.num_layers // (p * v)
    chunk_fwd = k * (24 * b * s * h * h + 4 * b * s * s * h) / t
    recomputed = {"none": 0.0, "selective": k * 4 * b * s * s * h / t, "full": chunk_fwd}[recompute]
    head_fwd = 2 * b * s * h * cfg.padded_vocab_size(t) / t
    return [m * v * (3 * chunk_fwd + recomputed) + (m * 3 * head_fwd if r == p - 1 else 0.0) for r in range(p)]


def measure(name, model, schedule, p, v, m, t, recompute="none"):
    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.analysis.jaxpr import dot_flops, named_calls
    from ptd_jax.config import ModelConfig, ParallelConfig
    from ptd_jax.presets import model_preset
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.sharding import place_params
    from ptd_jax.config import SCHEDULE_SPECS
    from ptd_jax.parallel.pipeline.lowering import columns
    from ptd_jax.parallel.step import make_parallel_grad_step, pipeline_schedule

    cfg = model_preset(model) if isinstance(model, str) else ModelConfig(**model)
    row = {
        "case": name,
        "recompute": recompute,
        "p": p,
        "v": v,
        "m": m,
        "t": t,
        "num_layers": cfg.num_layers,
        "hidden": cfg.hidden_size,
        "seq": cfg.seq_length,
        "vocab_padded": cfg.padded_vocab_size(t),
    }
    megatron = megatron_flops(cfg, p, v, m, t, recompute)
    lockstep = SCHEDULE_SPECS[schedule].rows == "lockstep"
    for branching in ("uniform", "per-rank") if lockstep else ("per-rank",):
        parallel = ParallelConfig(
            pipeline_model_parallel_size=p,
            virtual_pipeline_stages=v,
            pipeline_schedule=schedule,
            tensor_model_parallel_size=t,
            micro_batch_size=1,
            global_batch_size=m,
            pipeline_branching=branching,
        )
        sched = pipeline_schedule(parallel)
        mesh = make_mesh(parallel)
        abstract = jax.eval_shape(lambda key: gpt.init_params(key, cfg, tensor_parallel_size=t), jax.random.key(0))
        abstract, specs = place_params(abstract, parallel, mesh)
        step = make_parallel_grad_step(mesh, cfg, parallel, specs, recompute=recompute)
        batch = jax.ShapeDtypeStruct((m, 1, cfg.seq_length), np.int32)
        jaxpr = jax.make_jaxpr(step)(abstract, batch, batch, batch)
        k = cfg.num_layers // (p * v)  # a cell runs its chunk's k layers, each one named call of its kind
        names = {"F": "forward", "B": "backward", "I": "input_backward", "W": "weight_backward"}
        calls = {kind: list(named_calls(jaxpr, f"layer_{name}")) for kind, name in names.items()}
        layer = {kind: dot_flops(found[0]) if found else 0.0 for kind, found in calls.items()}
        head = dot_flops(next(named_calls(jaxpr, "head_backward")))
        cols = columns(sched)
        kinds = [[c.action.kind if c.action else None for c in row] for row in sched.cells]
        if branching == "uniform":  # every rank runs its tick's one kind, and the head on the head's ticks
            tick_kind = ["".join(sorted({k_ for k_ in row if k_})) for row in kinds]
            per_cell = np.array([[k * layer[tk]] * p for tk in tick_kind]) + head * cols["head"].any(axis=1)[:, None]
        else:
            per_cell = np.array([[k * layer[k_] if k_ else 0.0 for k_ in row] for row in kinds]) + head * cols["head"]
        work = {
            name: layer[kind]
            for kind, name in (
                ("F", "layer_forward"),
                ("B", "layer_backward"),
                ("I", "layer_input_backward"),
                ("W", "layer_weight_backward"),
            )
        }
        executed = [float(x) for x in per_cell.sum(axis=0)]
        critical = float(per_cell.max(axis=1).sum())
        row[branching] = {
            "ticks": sched.ticks,
            "executed_flops_per_rank": executed,
            "executed_over_megatron_per_rank": [e / g for e, g in zip(executed, megatron)],
            "executed_over_megatron_last_rank": executed[-1] / megatron[-1],
            "critical_path_flops": critical,
            "work_flops": {**work, "head_backward": head},
        }
    row["megatron_flops_per_rank"] = megatron
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/pipeline_flops.json")
    parser.add_argument("--cases", nargs="+", default=[c[0] for c in CASES])
    parser.add_argument(
        "--recompute", nargs="+", choices=["none", "selective", "full"], default=["none", "selective", "full"]
    )
    args = parser.parse_args(argv)
    fake_devices(8)
    rows = [measure(*case, recompute=r) for r in args.recompute for case in CASES if case[0] in args.cases]
    summary = {}
    for row in rows:
        summary[f"{row['case']} ({row['recompute']})"] = {
            b: {
                "executed/megatron (last rank)": round(row[b]["executed_over_megatron_last_rank"], 4),
                "critical_path_tflop": round(row[b]["critical_path_flops"] / 1e12, 4),
            }
            for b in ("uniform", "per-rank")
            if b in row
        }
    by = {(r["case"], r["recompute"]): r for r in rows}
    for model in ("bench", "1.3b"):
        for r in args.recompute:
            one, inter = (f"{model} 1f1b", r), (f"{model} interleaved", r)
            if one not in by or inter not in by:
                continue
            for b in ("uniform", "per-rank"):
                if b not in by[one] or b not in by[inter]:
                    continue
                summary[f"{model} critical path interleaved/1f1b ({b}, {r})"] = round(
                    by[inter][b]["critical_path_flops"] / by[one][b]["critical_path_flops"], 4
                )
    write_json(args.out, {"rows": rows, "summary": summary})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
