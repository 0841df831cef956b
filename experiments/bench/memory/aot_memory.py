"""Memory per GPU, predicted against compiled: `ptd-plan predict`'s model (`ptd_jax/perf/memory.py`) beside
XLA:GPU's compiled memory of the same training step (`ptd_jax/aot`), for (model, layout, target) cases.

    python -m experiments.bench.memory.aot_memory [--cases NAME ...] [--out experiments/results/aot_memory.json]

Needs the gpu-compile extra; no GPU. The compiled figure is arguments + outputs − aliased (the donated state) +
temporaries, per GPU, of the train step; the predicted one is the planner's total for the fuller pipeline stage.
Also reported: the state's bytes per parameter with and without the distributed optimizer (the step compiled
with negligible activations), beside Megatron's 18 and 6 + 12/d for bf16.
"""

from __future__ import annotations

import argparse
import time

from experiments.common import RESULTS, write_json

GIB = 2**30
# name: (preset, target, num_gpus, d, p, t, layers per virtual stage or None, b, B, recompute, distributed optimizer)
CASES = {
    "1.3b-p2t4-none": ("1.3b", "h100-sxm", 8, 1, 2, 4, None, 1, 16, "none", False),
    "1.3b-p2t4-full": ("1.3b", "h100-sxm", 8, 1, 2, 4, None, 1, 16, "full", False),
    "1.3b-d2p2t2-interleaved-none": ("1.3b", "h100-sxm", 8, 2, 2, 2, 6, 1, 16, "none", False),
    "1.3b-d2p2t2-interleaved-full": ("1.3b", "h100-sxm", 8, 2, 2, 2, 6, 1, 16, "full", False),
    "1.3b-d2p4-1f1b-none": ("1.3b", "h100-sxm", 8, 2, 4, 1, None, 1, 16, "none", False),
    "1.3b-d2p4-interleaved-none": ("1.3b", "h100-sxm", 8, 2, 4, 1, 3, 1, 16, "none", False),
    "1.3b-d8-distopt-none": ("1.3b", "h100-sxm", 8, 8, 1, 1, None, 1, 16, "none", True),
    "1.3b-d8-none": ("1.3b", "h200", 8, 8, 1, 1, None, 1, 16, "none", False),
    "paper-39.1b-p2t8-full": ("paper-39.1b", "a100-80gb", 512, 32, 2, 8, None, 1, 1536, "full", False),
    # zero-bubble schedules (a twelfth field: the schedule), beside the two d2p4 cases above (1f1b splits its
    # backwards too since the one pipeline)
    "1.3b-d2p4-zb-h1-none": ("1.3b", "h100-sxm", 8, 2, 4, 1, None, 1, 16, "none", False, "zb-h1"),
    "1.3b-d2p4-zb-v-none": ("1.3b", "h100-sxm", 8, 2, 4, 1, 3, 1, 16, "none", False, "zb-v"),
}


def run_case(name: str) -> dict:
    from ptd_jax.aot.compile import compile_steps
    from ptd_jax.perf.hardware import TARGETS
    from ptd_jax.aot.verify import gpu_model_config
    from ptd_jax.config import ParallelConfig, TrainConfig
    from ptd_jax.presets import model_preset
    from ptd_jax.perf.memory import memory_per_gpu

    preset, target, n, d, p, t, k, b, B, recompute, distributed = CASES[name][:11]
    schedule = CASES[name][11] if len(CASES[name]) > 11 else "interleaved" if k else "1f1b"
    cfg = gpu_model_config(model_preset(preset).replace(dtype="bfloat16"))
    v = cfg.num_layers // (p * k) if k else 1
    parallel = ParallelConfig.for_devices(
        n,
        tensor_model_parallel_size=t,
        pipeline_model_parallel_size=p,
        virtual_pipeline_stages=v,
        micro_batch_size=b,
        global_batch_size=B,
        pipeline_schedule=schedule,
        use_distributed_optimizer=distributed,
    )
    assert parallel.data_parallel_size == d, (name, parallel.data_parallel_size)
    predicted = memory_per_gpu(cfg, parallel, recompute)
    parallel, (train,) = compile_steps(
        cfg, parallel, TrainConfig(recompute_granularity=recompute), TARGETS[target], n, evaluation=False
    )
    compiled = train.memory
    return {
        "case": name,
        "model": preset,
        "target": target,
        "num_gpus": n,
        "schedule": schedule,
        "layout": {"d": d, "p": p, "t": t, "v": v, "b": b, "m": parallel.num_microbatches},
        "recompute": recompute,
        "distributed_optimizer": distributed,
        "branching": parallel.pipeline_branching,
        "params_per_gpu": predicted["params"],
        "predicted_gib": {k_: predicted[k_] / GIB for k_ in ("state", "activations", "total")},
        "compiled_gib": {k_: v_ / GIB for k_, v_ in compiled.items()},
        "compiled_bytes_per_param": {
            "arguments": compiled["arguments"] / predicted["params"],
            "total": compiled["total"] / predicted["params"],
        },
        "ratio_predicted_over_compiled": predicted["total"] / compiled["total"],
        # XLA's temporaries against the prediction less the optimizer's arguments (fp32 master weights and
        # Adam's moments: 12 bytes per parameter, 12/d with the distributed optimizer)
        "ratio_temporaries": (predicted["total"] - predicted["params"] * 12 / (d if distributed else 1))
        / compiled["temporaries"],
        "compile_time_s": train.compile_time_s,
    }


def state_bytes_per_param(d: int, distributed: bool, target: str = "h100-sxm") -> dict:
    """Compiled bytes per parameter of the 1.3B train step at d data-parallel GPUs with the activations made
    negligible (sequence 16, one microbatch): the state — weights, gradients, optimizer — as XLA allocates it."""
    from ptd_jax.aot.compile import compile_steps
    from ptd_jax.perf.hardware import TARGETS
    from ptd_jax.aot.verify import gpu_model_config
    from ptd_jax.config import ParallelConfig, TrainConfig
    from ptd_jax.presets import model_preset
    from ptd_jax.perf.memory import memory_per_gpu

    cfg = gpu_model_config(model_preset("1.3b").replace(dtype="bfloat16", seq_length=16))
    parallel = ParallelConfig.for_devices(
        d, micro_batch_size=1, global_batch_size=d, use_distributed_optimizer=distributed
    )
    params = memory_per_gpu(cfg, parallel, "none")["params"]
    _, (train,) = compile_steps(cfg, parallel, TrainConfig(), TARGETS[target], d, evaluation=False)
    return {
        "d": d,
        "distributed_optimizer": distributed,
        "params": params,
        "compiled_bytes_per_param": train.memory["total"] / params,
        "arguments_bytes_per_param": train.memory["arguments"] / params,
        "megatron_bytes_per_param": 6 + 12 / d if distributed else 18,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--out", default=str(RESULTS / "aot_memory.json"))
    parser.add_argument("--no-state", action="store_true", help="leave out the bytes-per-parameter compiles")
    args = parser.parse_args(argv)
    rows = []
    for name in args.cases:
        start = time.perf_counter()
        row = run_case(name)
        rows.append(row)
        print(
            f"{name}: predicted {row['predicted_gib']['total']:.2f} GiB, compiled {row['compiled_gib']['total']:.2f}"
            f" GiB (args {row['compiled_gib']['arguments']:.2f}, temp {row['compiled_gib']['temporaries']:.2f}), "
            f"ratio {row['ratio_predicted_over_compiled']:.3f}, temporaries {row['ratio_temporaries']:.3f} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    state = (
        []
        if args.no_state
        else [state_bytes_per_param(d, distributed) for d in (2, 8) for distributed in (False, True)]
    )
    for row in state:
        print(
            f"state at d={row['d']} distributed={row['distributed_optimizer']}: "
            f"{row['compiled_bytes_per_param']:.2f} bytes/param compiled, "
            f"Megatron {row['megatron_bytes_per_param']:.2f}"
        )
    write_json(args.out, {"rows": rows, "state_bytes_per_param": state}, end="\n")


if __name__ == "__main__":
    main()
