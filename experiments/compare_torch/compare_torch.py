"""ptd_jax against PyTorch (issue 14): the same GPT, the same initial weights, the same data and the same layout,
trained four ways, with loss traces side by side and tokens/s.

1. ptd_jax: the parallel train step (`parallel.step.make_parallel_train_step`, jit(shard_map) over fake CPU
   devices; the pipeline executor when p > 1);
2. PyTorch's own pipeline schedules: `torch.distributed.pipelining` (ScheduleGPipe, Schedule1F1B,
   ScheduleInterleaved1F1B) over gloo, one CPU process per pipeline rank, launched by torchrun (t = 1 only: it has
   no tensor parallelism of its own); the tied output layer is Megatron's: the last stage keeps a copy of the word
   embedding and the two copies' gradients are all-reduced between the first and the last rank, the grad norm is
   all-reduced over the ranks (each weight counted once);
3. single-device eager PyTorch: transformers' GPT2LMHeadModel (Megatron's GPT is GPT-2), microbatches
   accumulated as Megatron does;
4. megatron-core itself, where it is installed (`--no-megatron-core` skips it): its GPTModel (local layer spec)
   and its own schedules (no pipelining at p = 1, 1F1B, interleaved 1F1B; it has no GPipe) and tensor parallelism,
   one CPU process per (pipeline, tensor) rank, p·t of them, over gloo, torchrun; `megatron_worker.py` (and the
   five CPU shims it needs).

Each engine runs in its own process (`workers.py`, `megatron_worker.py`; what they share is in `common.py`). The
weights are ptd_jax's `init_params`, written as a Hugging Face GPT-2 folder by `interop.to_hf` (safetensors) and
read back by every side (megatron-core's through `interop.to_megatron`). The data are windows of s + 1 bytes of this
interpreter's standard-library sources (the demo corpus's text, byte tokens), the same [iters, B, s + 1] array for
all. Every side runs AdamW with Megatron's schedule (linear warm-up, cosine decay to min_lr), clipping to a global
norm of 1, weight decay on matrices and embeddings only, no dropout, float32; the loss is the sum of token losses
over the global token count.

Timing: each round runs the ptd_jax process (all layouts), then one torchrun per pipeline size, then the eager
process, then megatron-core's torchruns, so the engines alternate; an engine's time per round is the median of its
iteration times after the first, and the reported tokens/s is B·s over the median of the rounds. Each iteration's
process CPU time (every thread's, summed over torch's ranks) is recorded too, as tokens per CPU second: on a loaded
machine it follows the work executed better than the wall time (XLA's idle pool threads spin, which it counts).
Threads on the shared cores: torch's ranks cores / p each, eager torch `--torch-eager-threads` (default 1, its
fastest on the development machine: experiments/README.md), XLA its pool over all cores. Torch runs with
OMP_WAIT_POLICY=PASSIVE: on a machine shared with other work, OpenMP's spinning workers otherwise made eager steps
many times slower. XLA runs with its default flags: none of the XLA:CPU flags tried made these steps faster
(docs/architecture.md, "Where a p = 2 step goes on 2 fake devices"). On a shared machine, compare the ratios of one
run rather than absolute numbers: single rounds spread by up to 2x.

Usage: python -m experiments.compare_torch.compare_torch [--rounds 3] [--iters 10] [--torch-eager-threads 1]
       [--layouts serial p2-1f1b p2-1f1b-lockstep-uniform p2-gpipe p2v2-interleaved t2 p2t2-1f1b] [--no-megatron-core]
       [--out experiments/results/compare_torch.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.common import ROOT, write_json
from experiments.compare_torch.common import MICRO_BATCH, MICROBATCHES, MODEL, TRAIN, Layout, make_data

MEGATRON_SCHEDULES = {
    "serial": "forward_backward_no_pipelining",
    "1f1b": "forward_backward_pipelining_without_interleaving",
    "interleaved": "forward_backward_pipelining_with_interleaving",
}
"""megatron-core's schedule for each of ours (it has no GPipe)."""


def megatron_runs(layout: Layout) -> bool:
    return layout.p == 1 or layout.family in MEGATRON_SCHEDULES


def megatron_key(layout: Layout) -> tuple:
    """What megatron-core runs for a layout: ptd_jax's branching and 1F1B table are not among its choices, so
    p2-1f1b and p2-1f1b-lockstep-uniform share one megatron-core run."""
    return (layout.p, layout.v, layout.t, layout.family if layout.p > 1 else "serial")


def megatron_layouts(layouts: list[Layout]) -> dict:
    """megatron_key -> the layout megatron-core runs for it (the first named; its record carries that name)."""
    out = {}
    for x in layouts:
        if megatron_runs(x):
            out.setdefault(megatron_key(x), x)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The worker processes
# ---------------------------------------------------------------------------------------------------------------


def _worker_cmd(kind: str, spec_path: Path, world: int = 1) -> list[str]:
    module = ["-m", "experiments.compare_torch.workers", kind, str(spec_path)]
    if kind in ("torch-pipeline", "megatron"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *module]
    return [sys.executable, *module]


def _run_worker(kind: str, spec: dict, work: Path, world: int = 1) -> dict:
    tag = f"{kind}-{world}"
    spec = {**spec, "out": str(work / f"{tag}.json")}
    spec_path = work / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    subprocess.run(_worker_cmd(kind, spec_path, world), check=True, cwd=ROOT, env=env)
    return json.loads(Path(spec["out"]).read_text())


def _layouts_of(layouts, keep) -> list[dict]:
    return [dataclasses.asdict(x) for x in layouts if keep(x)]


def run_rounds(layouts: list[Layout], spec: dict, work: Path, rounds: int, megatron_core: bool) -> list[dict]:
    """Each round: one ptd_jax process per device count (its own fake devices), one torchrun per pipeline size of
    torch.distributed.pipelining, the eager process, one megatron-core torchrun per device count (one run per
    `megatron_key`, under the first layout's name); the per-engine records of every round."""
    by_p = sorted({x.p for x in layouts if x.p > 1 and x.t == 1})
    megatron_p = sorted({x.devices for x in layouts if megatron_runs(x)}) if megatron_core else []
    megatron_ran = megatron_layouts(layouts).values()
    runs = []
    for _ in range(rounds):
        run = {"jax": {}}
        for n in sorted({x.devices for x in layouts}):
            run["jax"].update(
                _run_worker(
                    "jax", {**spec, "layouts": _layouts_of(layouts, lambda x, n=n: x.devices == n)}, work, world=n
                )
            )
        for p in by_p:
            run[f"pipe{p}"] = _run_worker(
                "torch-pipeline",
                {**spec, "layouts": _layouts_of(layouts, lambda x, p=p: x.p == p and x.t == 1)},
                work,
                world=p,
            )
        run["eager"] = _run_worker("torch-eager", spec, work)
        for p in megatron_p:
            run[f"megatron{p}"] = _run_worker(
                "megatron", {**spec, "layouts": _layouts_of(megatron_ran, lambda x, p=p: x.devices == p)}, work, world=p
            )
        runs.append(run)
    return runs


# ---------------------------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------------------------


def _max_rel_diff(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _tokens_per_s(results, tokens: int, field="step_s"):
    """(tokens / the median over rounds, each round's median iteration after the first)."""
    per_round = [statistics.median(r[field][1:]) for r in results]
    return tokens / statistics.median(per_round), per_round


def _jax_columns(layout: Layout, jax_runs, runs, tokens: int) -> dict:
    jax_tps, jax_rounds = _tokens_per_s(jax_runs, tokens)
    jax_cpu_tps, jax_cpu_rounds = _tokens_per_s(jax_runs, tokens, "cpu_s")
    return {
        "data_parallel_size": 1,
        "pipeline_model_parallel_size": layout.p,
        "tensor_model_parallel_size": layout.t,
        "virtual_pipeline_stages": layout.v,
        "schedule": layout.schedule if layout.p > 1 else None,
        "pipeline_branching": jax_runs[0]["branching"] if layout.p > 1 else None,
        "loss_max_rel_diff_jax_vs_eager": max(
            _max_rel_diff(j["losses"], r["eager"]["losses"]) for j, r in zip(jax_runs, runs)
        ),
        "jax_tokens_per_s": jax_tps,
        "jax_tokens_per_cpu_s": jax_cpu_tps,
        "jax_compile_s": jax_runs[0]["compile_s"],
        "jax_step_s_per_round": jax_rounds,
        "jax_cpu_s_per_round": jax_cpu_rounds,
        "loss_jax": jax_runs[0]["losses"],
        "grad_norm_jax": jax_runs[0]["grad_norms"],
        "torch_engine": None,
    }


def _torch_columns(layout: Layout, row: dict, jax_runs, runs, tokens: int) -> dict:
    """torch's side of a t = 1 layout: eager at (1, 1, 1), torch.distributed.pipelining at p > 1."""
    torch_runs = [r["eager"] if layout.p == 1 else r[f"pipe{layout.p}"][layout.name] for r in runs]
    torch_tps, torch_rounds = _tokens_per_s(torch_runs, tokens)
    torch_cpu_tps, torch_cpu_rounds = _tokens_per_s(torch_runs, tokens, "cpu_s")
    return {
        "torch_engine": "eager" if layout.p == 1 else f"torch.distributed.pipelining {layout.family}",
        "loss_max_rel_diff": max(_max_rel_diff(j["losses"], t["losses"]) for j, t in zip(jax_runs, torch_runs)),
        "loss_max_rel_diff_torch_vs_eager": max(
            _max_rel_diff(t["losses"], r["eager"]["losses"]) for t, r in zip(torch_runs, runs)
        ),
        "torch_tokens_per_s": torch_tps,
        "jax_over_torch": row["jax_tokens_per_s"] / torch_tps,
        "torch_tokens_per_cpu_s": torch_cpu_tps,
        "jax_over_torch_cpu": row["jax_tokens_per_cpu_s"] / torch_cpu_tps,
        "torch_step_s_per_round": torch_rounds,
        "torch_cpu_s_per_round": torch_cpu_rounds,
        "loss_torch": torch_runs[0]["losses"],
    }


def _megatron_columns(layout: Layout, ran: str, row: dict, jax_runs, runs, tokens: int) -> dict:
    """megatron-core's side of a layout, from the run `ran` (the first layout of its `megatron_key`)."""
    mc_runs = [r[f"megatron{layout.devices}"][ran] for r in runs]
    mc_tps, mc_rounds = _tokens_per_s(mc_runs, tokens)
    mc_cpu_tps, mc_cpu_rounds = _tokens_per_s(mc_runs, tokens, "cpu_s")
    return {
        "megatron_core_engine": "megatron.core.pipeline_parallel."
        + MEGATRON_SCHEDULES["serial" if layout.p == 1 else layout.family],
        "megatron_core_run": ran,
        "loss_max_rel_diff_jax_vs_megatron_core": max(
            _max_rel_diff(j["losses"], m["losses"]) for j, m in zip(jax_runs, mc_runs)
        ),
        "loss_max_rel_diff_megatron_core_vs_eager": max(
            _max_rel_diff(m["losses"], r["eager"]["losses"]) for m, r in zip(mc_runs, runs)
        ),
        "megatron_core_tokens_per_s": mc_tps,
        "jax_over_megatron_core": row["jax_tokens_per_s"] / mc_tps,
        "megatron_core_tokens_per_cpu_s": mc_cpu_tps,
        "jax_over_megatron_core_cpu": row["jax_tokens_per_cpu_s"] / mc_cpu_tps,
        "megatron_core_step_s_per_round": mc_rounds,
        "megatron_core_cpu_s_per_round": mc_cpu_rounds,
        "loss_megatron_core": mc_runs[0]["losses"],
        "grad_norm_megatron_core": mc_runs[0]["grad_norms"],
        "grad_norm_max_rel_diff_jax_vs_megatron_core": max(
            _max_rel_diff(j["grad_norms"], m["grad_norms"]) for j, m in zip(jax_runs, mc_runs)
        ),
    }


def layout_row(layout: Layout, runs: list[dict], tokens: int, megatron_core: bool, megatron_ran: str | None) -> dict:
    """One layout's record: ptd_jax's losses, grad norms and tokens/s next to torch's (t = 1) and megatron-core's
    (`megatron_ran`: the run it shares, None where megatron-core did not run it)."""
    jax_runs = [r["jax"][layout.name] for r in runs]
    row = _jax_columns(layout, jax_runs, runs, tokens)
    if layout.t == 1:
        row.update(_torch_columns(layout, row, jax_runs, runs, tokens))
    if megatron_ran is not None:
        row.update(_megatron_columns(layout, megatron_ran, row, jax_runs, runs, tokens))
        if layout.t > 1:  # no torch engine: the comparison is with megatron-core
            row["loss_max_rel_diff"] = row["loss_max_rel_diff_jax_vs_megatron_core"]
    elif megatron_core:
        row["megatron_core_engine"] = None  # megatron-core has no GPipe schedule
    return row


def compare(
    layouts: list[Layout],
    *,
    model: dict,
    iters: int,
    rounds: int,
    micro_batch: int,
    microbatches: int,
    threads: int,
    torch_eager_threads: int = 1,
    seed: int = 1234,
    megatron_core: bool = True,
) -> dict:
    import importlib.util

    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig
    from ptd_jax.interop import to_hf

    megatron_core = megatron_core and importlib.util.find_spec("megatron.core") is not None
    alone = [x.name for x in layouts if x.t > 1 and not (megatron_core and megatron_runs(x))]
    if alone:  # t > 1: only megatron-core runs it beside ptd_jax (torch.distributed.pipelining has no t)
        why = "no GPipe there" if megatron_core else "megatron-core is not installed or --no-megatron-core"
        raise SystemExit(
            f"compare_torch: error: layouts {alone} have t > 1, which only megatron-core runs beside "
            f"ptd_jax ({why}); drop them"
        )
    cfg = ModelConfig(**model)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = gpt.init_params(jax.random.key(seed), cfg)
        to_hf(jax.tree.map(np.asarray, params), cfg, work / "weights")
        np.save(work / "data.npy", make_data(iters, micro_batch * microbatches, cfg.seq_length, seed))
        spec = {
            "model": model,
            "train": TRAIN,
            "iters": iters,
            "micro_batch": micro_batch,
            "microbatches": microbatches,
            "threads": threads,
            "torch_eager_threads": torch_eager_threads,
            "weights": str(work / "weights"),
            "data": str(work / "data.npy"),
            "jax_cache": str(work / "jax_cache"),
        }
        runs = run_rounds(layouts, spec, work, rounds, megatron_core)

    tokens = micro_batch * microbatches * cfg.seq_length
    eager_tps, eager_rounds = _tokens_per_s([r["eager"] for r in runs], tokens)
    eager_cpu_tps, eager_cpu_rounds = _tokens_per_s([r["eager"] for r in runs], tokens, "cpu_s")
    result = {
        "model": model,
        "train": {**TRAIN, "train_iters": iters},
        "micro_batch": micro_batch,
        "microbatches": microbatches,
        "global_batch": micro_batch * microbatches,
        "iters": iters,
        "rounds": rounds,
        "threads": threads,
        "torch_eager_threads": torch_eager_threads,
        "dtype": "float32",
        "loss_torch_eager": runs[0]["eager"]["losses"],
        "torch_eager_tokens_per_s": eager_tps,
        "torch_eager_step_s_per_round": eager_rounds,
        "torch_eager_tokens_per_cpu_s": eager_cpu_tps,
        "torch_eager_cpu_s_per_round": eager_cpu_rounds,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "layouts": {},
    }
    first_run = megatron_layouts(layouts)
    for layout in layouts:
        ran = first_run[megatron_key(layout)].name if megatron_core and megatron_runs(layout) else None
        result["layouts"][layout.name] = layout_row(layout, runs, tokens, megatron_core, ran)
    result["megatron_core"] = megatron_core
    return result


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["layouts"])
    fig, axes = plt.subplots(2, len(names) + 1, figsize=(4 * (len(names) + 1), 6.5), squeeze=False)
    for i, name in enumerate(names):
        row = result["layouts"][name]
        its = range(1, len(row["loss_jax"]) + 1)
        ax = axes[0][i]
        ax.plot(its, row["loss_jax"], "o-", label="ptd_jax")
        if row.get("loss_torch"):
            ax.plot(its, row["loss_torch"], "x--", label=f"torch ({row['torch_engine']})")
        ax.plot(its, result["loss_torch_eager"], ":", label="torch eager")
        if row.get("loss_megatron_core"):
            ax.plot(its, row["loss_megatron_core"], "+-.", label="megatron-core")
        ax.set(title=name, xlabel="iteration", ylabel="loss")
        ax.legend(fontsize=7, loc="upper right")
        ax = axes[1][i]
        if row.get("loss_torch"):
            rel = [abs(x - y) / abs(y) for x, y in zip(row["loss_jax"], row["loss_torch"])]
            ax.semilogy(its, [max(r, 1e-10) for r in rel], "o-", label="vs torch")
        if row.get("loss_megatron_core"):
            rel = [abs(x - y) / abs(y) for x, y in zip(row["loss_jax"], row["loss_megatron_core"])]
            ax.semilogy(its, [max(r, 1e-10) for r in rel], "+-.", label="vs megatron-core")
        ax.legend(fontsize=7)
        ax.axhline(1e-4, color="gray", ls="--", lw=1)
        ax.set(xlabel="iteration", ylabel="|jax − other| / other", ylim=(1e-10, 1e-2))
    ax = axes[0][-1]
    x = range(len(names))
    rows = [result["layouts"][n] for n in names]
    ax.bar([i - 0.27 for i in x], [r["jax_tokens_per_s"] for r in rows], 0.27, label="ptd_jax")
    ax.bar(list(x), [r.get("torch_tokens_per_s", 0.0) for r in rows], 0.27, label="torch")
    ax.bar(
        [i + 0.27 for i in x],
        [r.get("megatron_core_tokens_per_s", 0.0) for r in rows],
        0.27,
        label="megatron-core (CPU)",
    )
    ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    ax.set(title="tokens/s (median of rounds)", ylabel="tokens/s")
    ax.legend(fontsize=8)
    axes[1][-1].axis("off")
    m = result["model"]
    fig.suptitle(
        f"ptd_jax vs PyTorch: L={m['num_layers']} h={m['hidden_size']} s={m['seq_length']} "
        f"b={result['micro_batch']} m={result['microbatches']}, {result['rounds']} alternating rounds, "
        f"{result['threads']} CPU cores"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=["serial", "p2-1f1b", "p2-1f1b-lockstep-uniform", "p2-gpipe", "p2v2-interleaved", "t2", "p2t2-1f1b"],
        help="t<T> layouts run ptd_jax and megatron-core only",
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=MICRO_BATCH)
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
    parser.add_argument("--model", type=json.loads, default={}, help="ModelConfig overrides, as JSON")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--torch-eager-threads",
        type=int,
        default=1,
        help="eager torch's intra-op threads (1 was its fastest on the 2-core machine)",
    )
    parser.add_argument("--out", default="experiments/results/compare_torch.json")
    parser.add_argument("--plot", default=None, help="PNG (default: --out with .png)")
    parser.add_argument(
        "--no-megatron-core",
        dest="megatron_core",
        action="store_false",
        help="skip megatron-core (by default it runs where it is installed)",
    )
    args = parser.parse_args(argv)
    result = compare(
        [Layout.parse(x) for x in args.layouts],
        model={**MODEL, **args.model},
        iters=args.iters,
        rounds=args.rounds,
        micro_batch=args.micro_batch_size,
        microbatches=args.microbatches,
        threads=args.threads,
        torch_eager_threads=args.torch_eager_threads,
        megatron_core=args.megatron_core,
    )
    write_json(args.out, result)
    _plot(result, args.plot or str(Path(args.out).with_suffix(".png")))
    for name, row in result["layouts"].items():
        print(
            json.dumps(
                {
                    name: {
                        k: row[k]
                        for k in (
                            "loss_max_rel_diff",
                            "jax_tokens_per_s",
                            "torch_tokens_per_s",
                            "jax_over_torch",
                            "jax_over_torch_cpu",
                            "loss_max_rel_diff_jax_vs_megatron_core",
                            "jax_over_megatron_core",
                        )
                        if k in row
                    }
                }
            )
        )
    print(json.dumps({"torch_eager_tokens_per_s": result["torch_eager_tokens_per_s"]}))
    return result


if __name__ == "__main__":
    main()
