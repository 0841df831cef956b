"""ptd_jax against PyTorch (issue 14): the same GPT, the same initial weights, the same data and the same layout,
trained four ways, with loss traces side by side and tokens/s.

1. ptd_jax: the parallel train step (`parallel.step.make_parallel_train_step`, jit(shard_map) over fake CPU
   devices; the pipeline executor when p > 1);
2. PyTorch's own pipeline schedules: `torch.distributed.pipelining` (ScheduleGPipe, Schedule1F1B,
   ScheduleInterleaved1F1B) over gloo, one CPU process per pipeline rank, launched by torchrun (t = 1 only: it has
   no tensor parallelism of its own); the tied output
   layer is Megatron's: the last stage keeps a copy of the word embedding and the two copies' gradients are
   all-reduced between the first and the last rank, the grad norm is all-reduced over the ranks (each weight
   counted once);
3. single-device eager PyTorch: transformers' GPT2LMHeadModel (Megatron's GPT is GPT-2), microbatches
   accumulated as Megatron does;
4. megatron-core itself, where it is installed (`--no-megatron-core` skips it): its GPTModel (local layer spec)
   and its own schedules (no pipelining at p = 1, 1F1B, interleaved 1F1B; it has no GPipe) and tensor parallelism,
   one CPU process per (pipeline, tensor) rank, p·t of them, over gloo, torchrun; `experiments/megatron_worker.py` (and the five CPU shims it needs).

The weights are ptd_jax's `init_params`, written as a Hugging Face GPT-2 folder by `interop.to_hf` (safetensors)
and read back by every side (megatron-core's through `interop.to_megatron`). The data are windows of s + 1 bytes of this interpreter's standard-library sources
(the demo corpus's text, byte tokens), the same [iters, B, s + 1] array for all. Every side runs AdamW with
Megatron's schedule (linear warm-up, cosine decay to min_lr), clipping to a global norm of 1, weight decay on
matrices and embeddings only, no dropout, float32; the loss is the sum of token losses over the global token count.

Timing: each round runs the ptd_jax process (all layouts), then one torchrun per pipeline size, then the eager
process, then megatron-core's torchruns, so the engines alternate; an engine's time per round is the median of its iteration times after the
first, and the reported tokens/s is B·s over the median of the rounds. Each iteration's process CPU time (every
thread's, summed over torch's ranks) is recorded too, as tokens per CPU second: on a loaded machine it follows the
work executed better than the wall time (XLA's idle pool threads spin, which it counts). Threads on the shared
cores: torch's ranks cores / p each, eager torch `--torch-eager-threads` (default 1, its
fastest here: 98-106 ms a step against 111-143 ms with 2 threads, 3 alternating runs, 2026-12-01), XLA its pool
over all cores. Torch runs with OMP_WAIT_POLICY=PASSIVE: on a machine shared with other work, OpenMP's spinning
workers otherwise made eager steps up to 60x slower (3.2 s against 0.05 s on the 2-core development machine). XLA
runs with its default flags: none of the XLA:CPU flags tried made these steps faster (docs/architecture.md, "Where
a p = 2 step goes on 2 fake devices"). On a shared machine, compare the ratios of one run rather than absolute
numbers: single rounds spread by up to 2x.

Usage: python -m experiments.compare_torch [--rounds 3] [--iters 10] [--torch-eager-threads 1]
       [--layouts serial p2-1f1b p2-1f1b-uniform p2-gpipe p2v2-interleaved t2 p2t2-1f1b] [--no-megatron-core]
       [--out experiments/results/compare_torch.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=256)
"""The data are bytes, so V = 256: it divides over t = 2 with no padded rows, which megatron-core's vocab-parallel
softmax would count and ours does not."""
TRAIN = dict(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_style="cosine", weight_decay=0.01, clip_grad=1.0)
MICRO_BATCH, MICROBATCHES = 2, 4
LAYOUT_NAME = re.compile(r"^(serial|t(\d+)|p(\d+)(?:v(\d+))?(?:t(\d+))?-(gpipe|1f1b|interleaved)(?:-(uniform|per-rank))?)$")


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    p: int = 1
    v: int = 1
    t: int = 1
    """tensor-parallel size: only ptd_jax and megatron-core run t > 1 (torch.distributed.pipelining has no tensor
    parallelism of its own)"""
    schedule: str = "1f1b"
    branching: str = "auto"
    """ptd_jax's --pipeline-branching (torch runs the same schedule either way): the name's suffix, else the
    default, "auto" (per-rank on this CPU; the record names the branching that ran)."""

    @classmethod
    def parse(cls, name: str) -> "Layout":
        match = LAYOUT_NAME.match(name)
        if match is None:
            raise SystemExit(f"layout {name!r}: expected 'serial', t<T> or "
                             f"p<P>[v<V>][t<T>]-<gpipe|1f1b|interleaved>[-uniform|-per-rank]")
        if match[1] == "serial":
            return cls(name)
        if match[2]:
            return cls(name, t=int(match[2]))
        return cls(name, int(match[3]), int(match[4] or 1), int(match[5] or 1), match[6], match[7] or "auto")

    @property
    def devices(self) -> int:
        return self.p * self.t


def schedule_lr_factor(step: int, train: dict, iters: int) -> float:
    """ptd_jax's `optimizer.learning_rate_schedule` / lr, in Python (for torch's LambdaLR)."""
    warmup, peak, floor = train["lr_warmup_iters"], train["lr"], train["min_lr"]
    if step < warmup:
        return step / max(warmup, 1)
    ratio = min(max((step - warmup) / max(iters - warmup, 1), 0.0), 1.0)
    return (floor + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (peak - floor)) / peak


def make_data(iters: int, batch: int, seq: int, seed: int):
    """[iters, B, s + 1] int64 windows of the standard library's bytes (random offsets, fixed by `seed`)."""
    import numpy as np

    from ptd_jax.data.corpus import stdlib_files

    text = b"".join(path.read_bytes() for path in stdlib_files()[:60])
    stream = np.frombuffer(text, np.uint8).astype(np.int64)
    starts = np.random.default_rng(seed).integers(0, len(stream) - seq - 1, (iters, batch))
    return stream[starts[..., None] + np.arange(seq + 1)]


# ---------------------------------------------------------------------------------------------------------------
# ptd_jax
# ---------------------------------------------------------------------------------------------------------------

def run_jax(spec: dict) -> dict:
    from ptd_jax.runtime.host_memory import keep_freed_host_memory
    from ptd_jax.parallel.mesh import set_fake_devices

    keep_freed_host_memory()  # before JAX starts (runtime/host_memory.py)

    layouts = [Layout(**x) for x in spec["layouts"]]
    set_fake_devices(max(x.devices for x in layouts))
    import jax
    import numpy as np

    # Rounds after the first load their executables from the run's cache (compile_s is then the load time).
    jax.config.update("jax_compilation_cache_dir", spec["jax_cache"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
    from ptd_jax.interop import from_hf
    from ptd_jax.optimizer import make_optimizer, new_state
    from ptd_jax.parallel import sharding
    from ptd_jax.parallel.mesh import make_mesh
    from ptd_jax.parallel.step import init_sharded_state, make_parallel_train_step, on_mesh

    _, canonical = from_hf(spec["weights"])
    cfg = ModelConfig(**spec["model"])
    train_cfg = TrainConfig(train_iters=spec["iters"], **spec["train"])
    optimizer = make_optimizer(train_cfg)
    data = np.load(spec["data"])
    out = {}
    for layout in layouts:
        parallel = ParallelConfig(pipeline_model_parallel_size=layout.p, virtual_pipeline_stages=layout.v,
                                  tensor_model_parallel_size=layout.t,
                                  pipeline_schedule=layout.schedule, pipeline_branching=layout.branching,
                                  micro_batch_size=spec["micro_batch"],
                                  global_batch_size=spec["micro_batch"] * spec["microbatches"])
        parallel.check_model(cfg)
        mesh = make_mesh(parallel)
        params = sharding.from_canonical(optimizer, {"params": canonical}, cfg.padded_vocab_size(layout.t), layout.p,
                                         layout.v)["params"]
        abstract = init_sharded_state(jax.random.key(0), cfg, optimizer, mesh, parallel, shapes_only=True)
        state = jax.device_put(new_state(params, optimizer), jax.tree.map(lambda x: x.sharding, abstract))
        M, b = spec["microbatches"], spec["micro_batch"]
        batches = [(x[:, :-1].reshape(M, b, -1).astype(np.int32), x[:, 1:].reshape(M, b, -1).astype(np.int32))
                   for x in data]
        mask = np.ones_like(batches[0][0], dtype=np.float32)
        key = jax.random.key(0)
        start = time.perf_counter()
        step = make_parallel_train_step(mesh, cfg, parallel, train_cfg, optimizer, state).lower(
            state, *batches[0], mask, key).compile()
        compile_s = time.perf_counter() - start
        losses, norms, times, cpu = [], [], [], []
        for tokens, labels in batches:
            start, start_cpu = time.perf_counter(), time.process_time()
            state, metrics = jax.block_until_ready(step(state, tokens, labels, mask, key))
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            losses.append(float(metrics["lm_loss"]))
            norms.append(float(metrics["grad_norm"]))
        out[layout.name] = {"losses": losses, "grad_norms": norms, "step_s": times, "cpu_s": cpu, "compile_s": compile_s,
                            "branching": on_mesh(parallel, mesh).pipeline_branching}  # what ran
    return out


# ---------------------------------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------------------------------

def _torch_setup(spec: dict, threads: int):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    from transformers import GPT2LMHeadModel

    def load():
        return GPT2LMHeadModel.from_pretrained(spec["weights"], attn_implementation="sdpa",
                                               dtype=torch.float32).train()

    return torch, load, torch.from_numpy(np.load(spec["data"]))


def torch_optimizer(torch, named_params, spec: dict):
    """AdamW with ptd_jax's groups (no decay for biases and LayerNorms: the 1-D tensors) and schedule."""
    params = list(named_params)
    groups = [{"params": [p for _, p in params if p.ndim >= 2], "weight_decay": spec["train"]["weight_decay"]},
              {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=spec["train"]["lr"], betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule_lr_factor(s, spec["train"], spec["iters"]))
    return opt, sched


def clip_grads(torch, grads, norm, max_norm: float):
    """ptd_jax's `optimizer.clip_by_global_norm` (the same formula as torch's clip_grad_norm_)."""
    coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coeff)


def distributed_update(torch, dist, params, counted, loss: float, opt, sched, max_norm: float) -> tuple[float, float]:
    """One optimizer step of a multi-process torch engine: the squared grad norm of `counted` (each weight once
    over the ranks) and the loss summed over the ranks, the gradients of `params` clipped to the global norm, AdamW,
    the schedule; returns (loss, grad norm)."""
    sq = torch.stack([torch.sum(w.grad * w.grad) for w in counted]).sum() if counted else torch.tensor(0.0)
    both = torch.stack([sq, torch.tensor(float(loss))])
    if dist.get_world_size() > 1:
        dist.all_reduce(both)
    norm = torch.sqrt(both[0])
    clip_grads(torch, [w.grad for w in params], norm, max_norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(both[1]), float(norm)


def run_torch_eager(spec: dict) -> dict:
    torch, load, data = _torch_setup(spec, spec["torch_eager_threads"])
    model = load()
    opt, sched = torch_optimizer(torch, model.named_parameters(), spec)
    M, b = spec["microbatches"], spec["micro_batch"]
    losses, times, cpu = [], [], []
    for batch in data:
        start, start_cpu = time.perf_counter(), time.process_time()
        tokens, labels = batch[:, :-1], batch[:, 1:]
        total = labels.numel()
        loss_sum = 0.0
        for j in range(M):
            logits = model(tokens[j * b:(j + 1) * b]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[j * b:(j + 1) * b].flatten(),
                                                     reduction="sum") / total
            loss.backward()
            loss_sum += loss.item()
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        clip_grads(torch, [p.grad for p in params], norm, spec["train"]["clip_grad"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        losses.append(loss_sum)
    return {"losses": losses, "step_s": times, "cpu_s": cpu}


def _stage_module(torch, model, stage: int, num_stages: int, layers_per_stage: int):
    """Stage `stage` of the GPT-2: the embeddings on the first, its layers, the final LayerNorm and the output
    layer (this rank's copy of the word embedding) on the last."""
    nn = torch.nn
    first, last = stage == 0, stage == num_stages - 1
    blocks = model.transformer.h[stage * layers_per_stage:(stage + 1) * layers_per_stage]

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = model.transformer.wte if first or last else None
            self.wpe = model.transformer.wpe if first else None
            self.blocks = nn.ModuleList(blocks)
            self.ln_f = model.transformer.ln_f if last else None

        def forward(self, x):
            if first:  # x: token ids [b, S]
                x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
            for block in self.blocks:  # no mask: SDPA's is_causal
                x = block(x)
            if last:
                return nn.functional.linear(self.ln_f(x), self.wte.weight)  # [b, S, V]
            return x

    return Stage()


def run_torch_pipeline(spec: dict) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch, load, data = _torch_setup(spec, max(1, spec["threads"] // world))
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
    embedding_group = dist.new_group([0, world - 1])  # Megatron's embedding group: the tied copies
    out = {}
    for layout in (Layout(**x) for x in spec["layouts"]):
        assert layout.p == world, (layout, world)
        model = load()
        num_stages = layout.p * layout.v
        k = spec["model"]["num_layers"] // num_stages
        local = [rank + c * world for c in range(layout.v)]  # the round-robin chunks of Megatron and torch
        modules = [_stage_module(torch, model, s, num_stages, k) for s in local]
        stages = [PipelineStage(m, s, num_stages, torch.device("cpu")) for m, s in zip(modules, local)]
        B = spec["micro_batch"] * spec["microbatches"]
        total = B * spec["model"]["seq_length"]

        def loss_fn(logits, labels):
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / total

        cls = schedules[layout.schedule]
        schedule = cls(stages if layout.v > 1 else stages[0], spec["microbatches"], loss_fn=loss_fn,
                       scale_grads=False)
        named = [(n, p) for m in modules for n, p in m.named_parameters()]
        opt, sched = torch_optimizer(torch, named, spec)
        head = model.transformer.wte.weight  # on the last rank, the output layer's copy
        first_rank, last_rank = rank == 0, rank == world - 1
        losses, times, cpu = [], [], []
        for batch in data:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            tokens, labels = batch[:, :-1], batch[:, 1:]
            micro_losses = []
            if first_rank and last_rank:
                schedule.step(tokens, target=labels, losses=micro_losses)
            elif first_rank:
                schedule.step(tokens)
            elif last_rank:
                schedule.step(target=labels, losses=micro_losses)
            else:
                schedule.step()
            if first_rank or last_rank:
                dist.all_reduce(head.grad, group=embedding_group)
            params = [p for _, p in named if p.grad is not None]
            counted = [p for p in params if not (last_rank and not first_rank and p is head)]
            loss, _ = distributed_update(torch, dist, params, counted, sum(x.item() for x in micro_losses), opt,
                                         sched, spec["train"]["clip_grad"])
            dist.barrier()
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            losses.append(loss)
        cpu_all = torch.tensor(cpu, dtype=torch.float64)
        dist.all_reduce(cpu_all)  # every rank's process CPU time, summed
        out[layout.name] = {"losses": losses, "step_s": times, "cpu_s": cpu_all.tolist()}
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------------------------

def _worker_cmd(kind: str, spec_path: Path, world: int = 1) -> list[str]:
    module = ["-m", "experiments.compare_torch", "--worker", kind, "--spec", str(spec_path)]
    if kind in ("torch-pipeline", "megatron"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                *module]
    return [sys.executable, *module]


def _run_worker(kind: str, spec: dict, work: Path, world: int = 1) -> dict:
    tag = f"{kind}-{world}"
    spec = {**spec, "out": str(work / f"{tag}.json")}
    spec_path = work / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run(_worker_cmd(kind, spec_path, world), check=True, cwd=ROOT, env=env)
    return json.loads(Path(spec["out"]).read_text())


def _max_rel_diff(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


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
    ax.bar([i + 0.27 for i in x], [r.get("megatron_core_tokens_per_s", 0.0) for r in rows], 0.27,
           label="megatron-core (CPU)")
    ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    ax.set(title="tokens/s (median of rounds)", ylabel="tokens/s")
    ax.legend(fontsize=8)
    axes[1][-1].axis("off")
    m = result["model"]
    fig.suptitle(f"ptd_jax vs PyTorch: L={m['num_layers']} h={m['hidden_size']} s={m['seq_length']} "
                 f"b={result['micro_batch']} m={result['microbatches']}, {result['rounds']} alternating rounds, "
                 f"{result['threads']} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


MEGATRON_SCHEDULES = {"serial": "forward_backward_no_pipelining", "1f1b": "forward_backward_pipelining_without_interleaving",
                      "interleaved": "forward_backward_pipelining_with_interleaving"}
"""megatron-core's schedule for each of ours (it has no GPipe)."""


def megatron_runs(layout: Layout) -> bool:
    return layout.p == 1 or layout.schedule in MEGATRON_SCHEDULES


def megatron_key(layout: Layout) -> tuple:
    """What megatron-core runs for a layout: ptd_jax's branching is not one of its choices, so p2-1f1b and
    p2-1f1b-uniform share one megatron-core run."""
    return (layout.p, layout.v, layout.t, layout.schedule if layout.p > 1 else "serial")


def compare(layouts: list[Layout], *, model: dict, iters: int, rounds: int, micro_batch: int, microbatches: int,
            threads: int, torch_eager_threads: int = 1, seed: int = 1234, megatron_core: bool = True) -> dict:
    import importlib.util

    import jax
    import numpy as np

    from ptd_jax import model as gpt
    from ptd_jax.config import ModelConfig
    from ptd_jax.interop import to_hf

    megatron_core = megatron_core and importlib.util.find_spec("megatron.core") is not None
    alone = [x.name for x in layouts if x.t > 1 and not (megatron_core and megatron_runs(x))]
    if alone:  # t > 1: only megatron-core runs it beside ptd_jax (torch.distributed.pipelining has no t)
        raise SystemExit(f"compare_torch: error: layouts {alone} have t > 1, which only megatron-core runs beside "
                         f"ptd_jax ({'no GPipe there' if megatron_core else 'megatron-core is not installed or --no-megatron-core'}); drop them")
    cfg = ModelConfig(**model)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = gpt.init_params(jax.random.key(seed), cfg)
        to_hf(jax.tree.map(np.asarray, params), cfg, work / "weights")
        np.save(work / "data.npy", make_data(iters, micro_batch * microbatches, cfg.seq_length, seed))
        spec = {"model": model, "train": TRAIN, "iters": iters, "micro_batch": micro_batch,
                "microbatches": microbatches, "threads": threads, "torch_eager_threads": torch_eager_threads,
                "weights": str(work / "weights"),
                "data": str(work / "data.npy"), "jax_cache": str(work / "jax_cache")}
        by_p = sorted({x.p for x in layouts if x.p > 1 and x.t == 1})  # torch.distributed.pipelining's
        megatron_p = sorted({x.devices for x in layouts if megatron_runs(x)}) if megatron_core else []
        megatron_layouts = {}  # one layout per megatron_key, the first named
        for x in layouts:
            if megatron_runs(x):
                megatron_layouts.setdefault(megatron_key(x), x)
        runs = []
        for _ in range(rounds):
            run = {"jax": {}}
            for n in sorted({x.devices for x in layouts}):  # one process per device count: its own fake devices
                run["jax"].update(_run_worker("jax", {
                    **spec, "layouts": [dataclasses.asdict(x) for x in layouts if x.devices == n]}, work, world=n))
            for p in by_p:
                run[f"pipe{p}"] = _run_worker("torch-pipeline", {
                    **spec, "layouts": [dataclasses.asdict(x) for x in layouts if x.p == p and x.t == 1]},
                    work, world=p)
            run["eager"] = _run_worker("torch-eager", spec, work)
            for p in megatron_p:
                run[f"megatron{p}"] = _run_worker("megatron", {
                    **spec, "layouts": [dataclasses.asdict(x) for x in megatron_layouts.values() if x.devices == p]},
                    work, world=p)
            runs.append(run)

    tokens = micro_batch * microbatches * cfg.seq_length

    def tokens_per_s(results, field="step_s"):  # median over rounds of each round's median iteration after the first
        per_round = [statistics.median(r[field][1:]) for r in results]
        return tokens / statistics.median(per_round), per_round

    eager_tps, eager_rounds = tokens_per_s([r["eager"] for r in runs])
    eager_cpu_tps, eager_cpu_rounds = tokens_per_s([r["eager"] for r in runs], "cpu_s")
    result = {"model": model, "train": {**TRAIN, "train_iters": iters}, "micro_batch": micro_batch,
              "microbatches": microbatches, "global_batch": micro_batch * microbatches, "iters": iters,
              "rounds": rounds, "threads": threads, "torch_eager_threads": torch_eager_threads, "dtype": "float32",
              "loss_torch_eager": runs[0]["eager"]["losses"], "torch_eager_tokens_per_s": eager_tps,
              "torch_eager_step_s_per_round": eager_rounds, "torch_eager_tokens_per_cpu_s": eager_cpu_tps,
              "torch_eager_cpu_s_per_round": eager_cpu_rounds, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "layouts": {}}
    for layout in layouts:
        jax_runs = [r["jax"][layout.name] for r in runs]
        jax_tps, jax_rounds = tokens_per_s(jax_runs)
        jax_cpu_tps, jax_cpu_rounds = tokens_per_s(jax_runs, "cpu_s")
        row = result["layouts"][layout.name] = {
            "data_parallel_size": 1, "pipeline_model_parallel_size": layout.p, "tensor_model_parallel_size": layout.t,
            "virtual_pipeline_stages": layout.v, "schedule": layout.schedule if layout.p > 1 else None,
            "pipeline_branching": jax_runs[0]["branching"] if layout.p > 1 else None,
            "loss_max_rel_diff_jax_vs_eager": max(_max_rel_diff(j["losses"], r["eager"]["losses"])
                                                  for j, r in zip(jax_runs, runs)),
            "jax_tokens_per_s": jax_tps, "jax_tokens_per_cpu_s": jax_cpu_tps, "jax_compile_s": jax_runs[0]["compile_s"],
            "jax_step_s_per_round": jax_rounds, "jax_cpu_s_per_round": jax_cpu_rounds, "loss_jax": jax_runs[0]["losses"],
            "grad_norm_jax": jax_runs[0]["grad_norms"], "torch_engine": None}
        if layout.t == 1:  # torch: eager at (1, 1, 1), torch.distributed.pipelining at p > 1
            torch_runs = [r["eager"] if layout.p == 1 else r[f"pipe{layout.p}"][layout.name] for r in runs]
            torch_tps, torch_rounds = tokens_per_s(torch_runs)
            torch_cpu_tps, torch_cpu_rounds = tokens_per_s(torch_runs, "cpu_s")
            row.update({
                "torch_engine": "eager" if layout.p == 1 else f"torch.distributed.pipelining {layout.schedule}",
                "loss_max_rel_diff": max(_max_rel_diff(j["losses"], t["losses"]) for j, t in zip(jax_runs, torch_runs)),
                "loss_max_rel_diff_torch_vs_eager": max(_max_rel_diff(t["losses"], r["eager"]["losses"])
                                                        for t, r in zip(torch_runs, runs)),
                "torch_tokens_per_s": torch_tps, "jax_over_torch": jax_tps / torch_tps,
                "torch_tokens_per_cpu_s": torch_cpu_tps, "jax_over_torch_cpu": jax_cpu_tps / torch_cpu_tps,
                "torch_step_s_per_round": torch_rounds, "torch_cpu_s_per_round": torch_cpu_rounds,
                "loss_torch": torch_runs[0]["losses"]})
        if layout.devices in megatron_p and megatron_runs(layout):
            ran = megatron_layouts[megatron_key(layout)].name
            mc_runs = [r[f"megatron{layout.devices}"][ran] for r in runs]
            mc_tps, mc_rounds = tokens_per_s(mc_runs)
            mc_cpu_tps, mc_cpu_rounds = tokens_per_s(mc_runs, "cpu_s")
            row.update({
                "megatron_core_engine": "megatron.core.pipeline_parallel."
                                        + MEGATRON_SCHEDULES["serial" if layout.p == 1 else layout.schedule],
                "megatron_core_run": ran,
                "loss_max_rel_diff_jax_vs_megatron_core": max(_max_rel_diff(j["losses"], m["losses"])
                                                              for j, m in zip(jax_runs, mc_runs)),
                "loss_max_rel_diff_megatron_core_vs_eager": max(_max_rel_diff(m["losses"], r["eager"]["losses"])
                                                                for m, r in zip(mc_runs, runs)),
                "megatron_core_tokens_per_s": mc_tps, "jax_over_megatron_core": jax_tps / mc_tps,
                "megatron_core_tokens_per_cpu_s": mc_cpu_tps, "jax_over_megatron_core_cpu": jax_cpu_tps / mc_cpu_tps,
                "megatron_core_step_s_per_round": mc_rounds, "megatron_core_cpu_s_per_round": mc_cpu_rounds,
                "loss_megatron_core": mc_runs[0]["losses"], "grad_norm_megatron_core": mc_runs[0]["grad_norms"],
                "grad_norm_max_rel_diff_jax_vs_megatron_core": max(
                    _max_rel_diff(j["grad_norms"], m["grad_norms"]) for j, m in zip(jax_runs, mc_runs))})
            if layout.t > 1:  # no torch engine: the comparison is with megatron-core
                row["loss_max_rel_diff"] = row["loss_max_rel_diff_jax_vs_megatron_core"]
        elif megatron_core:
            row["megatron_core_engine"] = None  # megatron-core has no GPipe schedule
    result["megatron_core"] = megatron_core
    return result


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["serial", "p2-1f1b", "p2-1f1b-uniform", "p2-gpipe",
                                                          "p2v2-interleaved", "t2", "p2t2-1f1b"],
                        help="t<T> layouts run ptd_jax and megatron-core only")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=MICRO_BATCH)
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES)
    parser.add_argument("--model", type=json.loads, default={}, help="ModelConfig overrides, as JSON")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--torch-eager-threads", type=int, default=1,
                        help="eager torch's intra-op threads (1 was its fastest on the 2-core machine)")
    parser.add_argument("--out", default="experiments/results/compare_torch.json")
    parser.add_argument("--plot", default=None, help="PNG (default: --out with .png)")
    parser.add_argument("--no-megatron-core", dest="megatron_core", action="store_false",
                        help="skip megatron-core (by default it runs where it is installed)")
    parser.add_argument("--worker", choices=["jax", "torch-pipeline", "torch-eager", "megatron"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        if args.worker == "torch-pipeline":
            run_torch_pipeline(spec)  # rank 0 writes
        elif args.worker == "megatron":
            from experiments.megatron_worker import run_megatron

            run_megatron(spec)  # rank 0 writes
        else:
            out = run_jax(spec) if args.worker == "jax" else run_torch_eager(spec)
            Path(spec["out"]).write_text(json.dumps(out))
        return None
    result = compare([Layout.parse(x) for x in args.layouts], model={**MODEL, **args.model}, iters=args.iters,
                     rounds=args.rounds, micro_batch=args.micro_batch_size, microbatches=args.microbatches,
                     threads=args.threads, torch_eager_threads=args.torch_eager_threads,
                     megatron_core=args.megatron_core)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    _plot(result, args.plot or str(Path(args.out).with_suffix(".png")))
    for name, row in result["layouts"].items():
        print(json.dumps({name: {k: row[k] for k in ("loss_max_rel_diff", "jax_tokens_per_s", "torch_tokens_per_s",
                                                     "jax_over_torch", "jax_over_torch_cpu",
                                                     "loss_max_rel_diff_jax_vs_megatron_core",
                                                     "jax_over_megatron_core") if k in row}}))
    print(json.dumps({"torch_eager_tokens_per_s": result["torch_eager_tokens_per_s"]}))
    return result


if __name__ == "__main__":
    main()
