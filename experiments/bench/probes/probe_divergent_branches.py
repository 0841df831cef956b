"""Probe: does this backend run the executor's pipe-divergent branches correctly, and how fast?

Under `--pipeline-branching per-rank` each pipeline rank takes its own side of the executor's conds and its own trip
counts of the kinds' layer loops (only the last stage runs the head, only stage 0 embeds, idle cells skip their
chunk), so tensor-parallel collectives sit inside branches and loops that differ between pipe ranks; the ring over
"pipe" stays outside, uniform (docs/architecture.md, "Pipeline"). XLA:CPU runs that correctly; a GPU is unmeasured.
This runs the real gradient step of a small model at (p, t) = (2, 2), interleaved (v = 2, m = 4), under both
branchings, on the first 4 devices of the default backend, each call in a thread with a timeout (a hang is reported,
not waited for), and compares the loss and every gradient: "uniform" never branches per rank, so it is the
reference. With fewer than 4 devices it says so and exits 0 (one GPU cannot show pipe-divergent behaviour).

Prints and writes {"backend", "devices", "status": "ok" | "mismatch" | "hung" | "skipped", "max_rel_diff",
"uniform_s", "per_rank_s"}.

Usage: python -m experiments.bench.probes.probe_divergent_branches [--timeout-s 180] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

from experiments.common import fake_devices, pipeline_step, write_json

DEVICES = 4
MODEL = dict(num_layers=8, hidden_size=128, num_attention_heads=4, vocab_size=1024, seq_length=64)


def run_with_timeout(fn, timeout_s: float):
    """(result, seconds) of fn() in a daemon thread, or (None, None) if it did not finish in time."""
    import jax

    box = {}

    def work():
        start = time.perf_counter()
        box["out"] = jax.block_until_ready(fn())
        box["s"] = time.perf_counter() - start

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return (box["out"], box["s"]) if "out" in box else (None, None)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=180.0, help="per step call, compilation included")
    parser.add_argument("--fake-devices", type=int, default=0, help="simulate N CPU devices (tests)")
    parser.add_argument("--out", default="experiments/results/probe_divergent_branches.json")
    args = parser.parse_args(argv)
    if args.fake_devices:
        fake_devices(args.fake_devices)
    import jax
    import numpy as np

    from ptd_jax.config import ModelConfig

    devices = jax.devices()
    result = {"backend": jax.default_backend(), "devices": [d.device_kind for d in devices]}
    if len(devices) < DEVICES:
        result.update(status="skipped", reason=f"needs {DEVICES} devices, found {len(devices)}")
    else:
        cfg = ModelConfig(**MODEL)
        outs = {}
        for branching in ("uniform", "per-rank"):
            compiled, step_args = pipeline_step(cfg, "interleaved", 2, branching, "none", p=2, m=4, t=2)
            out, seconds = run_with_timeout(lambda c=compiled, a=step_args: c(*a), args.timeout_s)
            if out is None:
                result.update(status="hung", hung_branching=branching, timeout_s=args.timeout_s)
                break
            outs[branching] = out
            result[f"{branching.replace('-', '_')}_s"] = seconds
        if len(outs) == 2:
            (loss_u, grads_u, _), (loss_p, grads_p, _) = outs["uniform"], outs["per-rank"]
            diffs = [abs(float(loss_p) - float(loss_u)) / abs(float(loss_u))]
            for gu, gp in zip(jax.tree.leaves(grads_u), jax.tree.leaves(grads_p), strict=True):
                gu, gp = np.asarray(gu, np.float64), np.asarray(gp, np.float64)
                diffs.append(float(np.max(np.abs(gp - gu)) / max(float(np.max(np.abs(gu))), 1e-30)))
            result["max_rel_diff"] = max(diffs)
            result["status"] = "ok" if result["max_rel_diff"] <= 1e-5 else "mismatch"
    print(json.dumps(result), flush=True)
    write_json(args.out, result)
    if result["status"] == "hung":
        os._exit(2)  # the hung thread holds the devices: leave without waiting for it
    return result


if __name__ == "__main__":
    main()
