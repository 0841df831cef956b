"""The single-device CPU training step against eager PyTorch (issue 14): ptd_jax's reference step
(`train.reference.make_train_step`: forward, backward, clipping, AdamW) and the same step in eager torch
(transformers' GPT2LMHeadModel with SDPA attention, microbatches accumulated, the same clipping and AdamW), on the
same weights and batch, float32, no dropout.

Two cases from the issue: "wide" (8 layers, h 256, s 128, b 8, one microbatch) and "small" (4 layers, h 128,
s 128, b 4, 4 microbatches); vocabulary 257 (the byte tokenizer's). Both engines live in one process and
alternate step by step (rounds of `--steps` steps each; an engine's round time is the median of its steps), so the
ratio compares the same moments of a machine shared with other work; the reported times are medians over rounds.
Torch gets all cores as threads with OMP_WAIT_POLICY=PASSIVE (set before torch is imported), XLA its default
pool. The benchmark runs twice, each time in a fresh process: "glibc_default", the step as it was before
`ptd_jax.runtime.host_memory` (glibc's default malloc: XLA's temporaries are a fresh mmap every step), and
"kept", with `keep_freed_host_memory()` called before JAX starts (glibc's setting is process-wide and its arena
limit binds only threads not yet started, so the two cannot alternate in one process; torch, in both processes, is
the common yardstick). `--profile` adds, per case, an XLA:CPU profile of both jax variants (leaf ops by
kind, the top ones with their HLO, minor page faults per step) and a torch profile. `--xla-flags` appends XLA:CPU
flags, for trying them.

Usage: python -m experiments.compare_torch.bench_cpu_step [--rounds 7] [--steps 3] [--cases wide small] [--profile]
       [--out experiments/results/bench_cpu_step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from experiments.common import ROOT, write_json

CASES = {
    "wide": dict(
        model=dict(num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=257),
        micro_batch=8,
        microbatches=1,
    ),
    "small": dict(
        model=dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=257),
        micro_batch=4,
        microbatches=4,
    ),
}
TRAIN = dict(lr=1e-3, min_lr=1e-4, lr_warmup_iters=0, weight_decay=0.01, clip_grad=1.0, train_iters=1000)


def jax_step(case: dict, tokens):
    """(run one step, loss of the last step) for ptd_jax's reference step; the state is donated and carried."""
    import jax
    import numpy as np

    from ptd_jax.config import ModelConfig, TrainConfig
    from ptd_jax.optimizer import make_optimizer
    from ptd_jax.train.reference import init_state, make_train_step

    cfg = ModelConfig(**case["model"])
    train_cfg = TrainConfig(**TRAIN)
    optimizer = make_optimizer(train_cfg)
    M, b = case["microbatches"], case["micro_batch"]
    x = tokens[:, :-1].reshape(M, b, -1).astype(np.int32)
    y = tokens[:, 1:].reshape(M, b, -1).astype(np.int32)
    mask = np.ones(x.shape, np.float32)
    key = jax.random.key(0)
    box = {"state": init_state(key, cfg, optimizer, train_cfg)}
    step = make_train_step(cfg, train_cfg, optimizer).lower(box["state"], x, y, mask, key).compile()

    def run():
        box["state"], metrics = step(box["state"], x, y, mask, key)
        return float(jax.block_until_ready(metrics["lm_loss"]))

    return run, cfg, box["state"]["params"], step.as_text()


def torch_step(case: dict, cfg, params, tokens, threads: int):
    """The same step in eager torch, from the same initial weights (via `interop.to_hf`)."""
    import tempfile

    import jax
    import numpy as np
    import torch
    from transformers import GPT2LMHeadModel

    from experiments.compare_torch.common import schedule_lr_factor
    from ptd_jax.interop import to_hf

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        to_hf(jax.tree.map(np.asarray, params), cfg, tmp)
        model = GPT2LMHeadModel.from_pretrained(tmp, attn_implementation="sdpa", dtype=torch.float32).train()
    named = list(model.named_parameters())
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": TRAIN["weight_decay"]},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=TRAIN["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule_lr_factor(s, TRAIN, TRAIN["train_iters"]))
    x, y = torch.from_numpy(tokens[:, :-1]), torch.from_numpy(tokens[:, 1:])
    M, b = case["microbatches"], case["micro_batch"]

    def run():
        total = 0.0
        for j in range(M):
            logits = model(x[j * b : (j + 1) * b]).logits
            loss = (
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), y[j * b : (j + 1) * b].flatten(), reduction="sum"
                )
                / y.numel()
            )
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["clip_grad"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return total

    return run


def profile_jax(run, hlo_text: str, steps: int = 3, top: int = 15) -> dict:
    """XLA:CPU profile of `steps` steps: leaf operations by kind and the `top` ones by name, each with its HLO
    instruction (shapes) from the compiled module, in ms per step."""
    import collections
    import glob
    import gzip
    import re
    import resource
    import tempfile

    import jax

    from experiments.common import leaf_times

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            wall = (time.perf_counter() - t0) / steps
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
        trace_file = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
        kinds, counts = leaf_times(trace_file, [(-float("inf"), float("inf"))])
        names = collections.defaultdict(float)
        with gzip.open(trace_file) as f:
            events = json.load(f)["traceEvents"]
        for e in events:
            if e.get("ph") == "X" and not e["name"].startswith("$") and "Thunk" not in e["name"]:
                names[e["name"]] += e["dur"] / 1e3 / steps
    lines = {m[2]: m[0].strip() for m in re.finditer(r"^\s*(ROOT\s+)?%?([\w.-]+) = .*$", hlo_text, re.M)}
    by_name = sorted(names.items(), key=lambda kv: -kv[1])
    leaf = [(n, ms) for n, ms in by_name if n in lines][:top]
    return {
        "wall_ms_per_step": wall * 1e3,
        "minor_page_faults_per_step": faults,
        "leaf_ms_per_step": sum(kinds.values()) / steps,
        "by_kind_ms_per_step": {k: round(v / steps, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_ops": [{"name": n, "ms_per_step": round(ms, 3), "hlo": lines[n][:300]} for n, ms in leaf],
    }


def profile_torch(run, steps: int = 3, top: int = 15) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {
        "top_ops": [
            {
                "name": e.key,
                "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
                "calls_per_step": e.count / steps,
            }
            for e in rows
        ]
    }


def main(argv=None) -> dict:
    """Both modes, each in its own process; their results side by side."""
    import subprocess
    import sys
    import tempfile

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--mode" in argv:
        return run_mode(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/bench_cpu_step.json")
    known, rest = parser.parse_known_args(argv)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("glibc_default", "kept"):
            out = Path(tmp) / f"{mode}.json"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "experiments.compare_torch.bench_cpu_step",
                    *rest,
                    "--mode",
                    mode,
                    "--out",
                    str(out),
                ],
                check=True,
                cwd=ROOT,
            )
            result[mode] = json.loads(out.read_text())
    result["summary"] = {
        name: {
            f"{mode}_jax_speedup_over_torch": result[mode]["cases"][name]["jax_speedup_over_torch"]
            for mode in ("glibc_default", "kept")
        }
        for name in result["kept"]["cases"]
    }
    print(json.dumps(result["summary"]))
    write_json(known.out, result)
    return result


def run_mode(argv) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS before JAX starts")
    parser.add_argument("--profile", action="store_true", help="add an XLA:CPU and a torch profile of each case")
    parser.add_argument("--mode", choices=["glibc_default", "kept"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.mode == "kept":  # before JAX starts: its worker threads must not have picked their arenas yet
        from ptd_jax.runtime.host_memory import keep_freed_host_memory

        assert keep_freed_host_memory()
    else:
        os.environ["PTD_JAX_KEEP_HOST_MEMORY"] = "0"  # glibc's defaults throughout
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    from experiments.compare_torch.common import make_data

    result = {
        "mode": args.mode,
        "threads": args.threads,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "train": TRAIN,
        "cases": {},
    }
    for name in args.cases:
        case = CASES[name]
        tokens = make_data(1, case["micro_batch"] * case["microbatches"], case["model"]["seq_length"], 0)[0]
        start = time.perf_counter()
        run_jax, cfg, params, hlo_text = jax_step(case, tokens)
        compile_s = time.perf_counter() - start
        run_torch = torch_step(case, cfg, params, tokens, args.threads)
        engines = {"jax": run_jax, "torch": run_torch}
        first = {k: run() for k, run in engines.items()}  # warm-up; the first step's loss is the same on both
        rounds = {k: [] for k in engines}
        for _ in range(args.rounds):
            times = {k: [] for k in engines}
            for _ in range(args.steps):
                for k, run in engines.items():
                    t0 = time.perf_counter()
                    run()
                    times[k].append(time.perf_counter() - t0)
            for k in engines:
                rounds[k].append(statistics.median(times[k]))
        jax_s, torch_s = statistics.median(rounds["jax"]), statistics.median(rounds["torch"])
        tokens_per_step = tokens.shape[0] * case["model"]["seq_length"]
        result["cases"][name] = {
            **case,
            "jax_step_s": jax_s,
            "torch_step_s": torch_s,
            "jax_speedup_over_torch": torch_s / jax_s,
            "jax_tokens_per_s": tokens_per_step / jax_s,
            "torch_tokens_per_s": tokens_per_step / torch_s,
            "first_step_loss": first,
            "jax_compile_s": compile_s,
            "round_s": rounds,
        }
        if args.profile:
            result["cases"][name]["profile"] = {
                "jax": profile_jax(run_jax, hlo_text),
                "torch": profile_torch(run_torch),
            }
        print(
            json.dumps(
                {
                    name: {
                        k: result["cases"][name][k]
                        for k in ("jax_step_s", "torch_step_s", "jax_speedup_over_torch", "first_step_loss")
                    }
                }
            )
        )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
