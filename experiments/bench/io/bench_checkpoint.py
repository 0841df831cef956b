"""How long an asynchronous checkpoint blocks training, against the whole write; and a restore into another layout.

A GPT of about 150M parameters (+ Adam moments: ~1.8 GB of float32 state) on 8 fake CPU devices at (d,p,t) = (2,2,2):
`Checkpointer.save` returns after the canonical conversion and the device-to-host copy; `wait()` after orbax's
write. For scale, the same arrays are also handed to orbax unconverted (`orbax_only_blocked_s`: the copy alone).
Then the step is restored at (1,4,2) with v = 2. JSON to experiments/results/bench_checkpoint.json.

Usage: python -m experiments.bench.io.bench_checkpoint [--layers 16 --hidden 768]  (layers divisible by 8)
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from experiments.common import RESULTS, write_json  # noqa: E402
from ptd_jax import model as gpt  # noqa: E402
from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig  # noqa: E402
from ptd_jax.optimizer import make_optimizer  # noqa: E402
from ptd_jax.parallel.mesh import make_mesh  # noqa: E402
from ptd_jax.parallel.step import init_sharded_state  # noqa: E402
from ptd_jax.train import checkpoint  # noqa: E402


def layout(d, p, t, v):
    return ParallelConfig(
        data_parallel_size=d,
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=t,
        virtual_pipeline_stages=v,
        pipeline_schedule="interleaved" if v > 1 else "1f1b",
        micro_batch_size=1,
        global_batch_size=8,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=12, seq_length=128, vocab_size=50257
    )
    optimizer = make_optimizer(TrainConfig())
    source, target = layout(2, 2, 2, 1), layout(1, 4, 2, 2)
    mesh = make_mesh(source)
    state = init_sharded_state(jax.random.key(0), model, optimizer, mesh, source)
    jax.block_until_ready(state)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    rounds = []
    with tempfile.TemporaryDirectory() as root:
        with checkpoint.Checkpointer(
            Path(root) / "ckpt", optimizer=optimizer, model_cfg=model, parallel=source, keep=1
        ) as saver:
            for step in range(1, args.rounds + 1):
                t0 = time.perf_counter()
                saver.save(step, state, {"bench": True})
                blocked = time.perf_counter() - t0
                saver.wait()
                rounds.append({"blocked_s": blocked, "total_s": time.perf_counter() - t0})
        dest_mesh = make_mesh(target)
        like = init_sharded_state(jax.random.key(1), model, optimizer, dest_mesh, target)
        t0 = time.perf_counter()
        restored = checkpoint.restore(
            Path(root) / "ckpt",
            args.rounds,
            like,
            optimizer=optimizer,
            model_cfg=model,
            parallel=target,
            mesh=dest_mesh,
        )
        jax.block_until_ready(restored)
        restore_s = time.perf_counter() - t0
        # The same arrays handed to orbax as they lie (no canonical conversion): what the device-to-host copy costs.
        with checkpoint._manager(Path(root) / "raw", create=True, async_save=True) as manager:
            raw = []
            for step in range(1, args.rounds + 1):
                body = {"params": state["params"], "opt_state": state["opt_state"]}
                t0 = time.perf_counter()
                manager.save(
                    step,
                    args=ocp.args.Composite(
                        params=ocp.args.StandardSave(body["params"]), opt_state=ocp.args.StandardSave(body["opt_state"])
                    ),
                )
                raw.append(time.perf_counter() - t0)
                manager.wait_until_finished()
    later = rounds[1:] or rounds  # the first save also compiles the canonical conversion
    result = {
        "model": {"layers": args.layers, "hidden": args.hidden, "params": gpt.count_params(state["params"])},
        "state_bytes": state_bytes,
        "save_from": "(d,p,t,v)=(2,2,2,1)",
        "restore_to": "(1,4,2,2)",
        "rounds": rounds,
        "median_blocked_s": sorted(r["blocked_s"] for r in later)[len(later) // 2],
        "median_total_s": sorted(r["total_s"] for r in later)[len(later) // 2],
        "restore_resharded_s": restore_s,
        "orbax_only_blocked_s": sorted(raw[1:] or raw)[len(raw[1:] or raw) // 2],
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
    }
    result["blocked_fraction"] = result["median_blocked_s"] / result["median_total_s"]
    write_json(RESULTS / "bench_checkpoint.json", result, indent=2, end="\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
