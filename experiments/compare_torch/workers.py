"""compare_torch's worker processes, one engine each, launched by `compare_torch.py`: ptd_jax's parallel train step
on fake CPU devices, eager torch (transformers' GPT2LMHeadModel) and `torch.distributed.pipelining` (one torchrun
process per stage, gloo); megatron-core's worker is `megatron_worker.py`. Each reads the spec JSON that
`compare_torch.py` writes and writes its record to the spec's "out" (rank 0 under torchrun).

Usage (by compare_torch.py): python -m experiments.compare_torch.workers jax|torch-eager|torch-pipeline|megatron SPEC
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from experiments.compare_torch.common import Layout, clip_grads, distributed_update, torch_optimizer, torch_setup

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
        parallel = ParallelConfig(
            pipeline_model_parallel_size=layout.p,
            virtual_pipeline_stages=layout.v,
            tensor_model_parallel_size=layout.t,
            pipeline_schedule=layout.schedule,
            pipeline_branching=layout.branching,
            micro_batch_size=spec["micro_batch"],
            global_batch_size=spec["micro_batch"] * spec["microbatches"],
        )
        parallel.check_model(cfg)
        mesh = make_mesh(parallel)
        params = sharding.from_canonical(
            optimizer, {"params": canonical}, cfg.padded_vocab_size(layout.t), layout.p, layout.v
        )["params"]
        abstract = init_sharded_state(jax.random.key(0), cfg, optimizer, mesh, parallel, shapes_only=True)
        state = jax.device_put(new_state(params, optimizer), jax.tree.map(lambda x: x.sharding, abstract))
        M, b = spec["microbatches"], spec["micro_batch"]
        batches = [
            (x[:, :-1].reshape(M, b, -1).astype(np.int32), x[:, 1:].reshape(M, b, -1).astype(np.int32)) for x in data
        ]
        mask = np.ones_like(batches[0][0], dtype=np.float32)
        key = jax.random.key(0)
        start = time.perf_counter()
        step = (
            make_parallel_train_step(mesh, cfg, parallel, train_cfg, optimizer, state)
            .lower(state, *batches[0], mask, key)
            .compile()
        )
        compile_s = time.perf_counter() - start
        losses, norms, times, cpu = [], [], [], []
        for tokens, labels in batches:
            start, start_cpu = time.perf_counter(), time.process_time()
            state, metrics = jax.block_until_ready(step(state, tokens, labels, mask, key))
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            losses.append(float(metrics["lm_loss"]))
            norms.append(float(metrics["grad_norm"]))
        out[layout.name] = {
            "losses": losses,
            "grad_norms": norms,
            "step_s": times,
            "cpu_s": cpu,
            "compile_s": compile_s,
            "branching": on_mesh(parallel, mesh).pipeline_branching,
        }  # what ran
    return out


# ---------------------------------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------------------------------


def run_torch_eager(spec: dict) -> dict:
    torch, load, data = torch_setup(spec, spec["torch_eager_threads"])
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
            logits = model(tokens[j * b : (j + 1) * b]).logits
            loss = (
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), labels[j * b : (j + 1) * b].flatten(), reduction="sum"
                )
                / total
            )
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


def stage_module(torch, model, stage: int, num_stages: int, layers_per_stage: int):
    """Stage `stage` of the GPT-2: the embeddings on the first, its layers, the final LayerNorm and the output
    layer (this rank's copy of the word embedding) on the last."""
    nn = torch.nn
    first, last = stage == 0, stage == num_stages - 1
    blocks = model.transformer.h[stage * layers_per_stage : (stage + 1) * layers_per_stage]

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
    torch, load, data = torch_setup(spec, max(1, spec["threads"] // world))
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
        modules = [stage_module(torch, model, s, num_stages, k) for s in local]
        stages = [PipelineStage(m, s, num_stages, torch.device("cpu")) for m, s in zip(modules, local)]
        B = spec["micro_batch"] * spec["microbatches"]
        total = B * spec["model"]["seq_length"]

        def loss_fn(logits, labels, total=total):
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / total

        cls = schedules[layout.family]
        schedule = cls(stages if layout.v > 1 else stages[0], spec["microbatches"], loss_fn=loss_fn, scale_grads=False)
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
            loss, _ = distributed_update(
                torch,
                dist,
                params,
                counted,
                sum(x.item() for x in micro_losses),
                opt,
                sched,
                spec["train"]["clip_grad"],
            )
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["jax", "torch-pipeline", "torch-eager", "megatron"])
    parser.add_argument("spec", help="the spec JSON written by compare_torch.py")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    if args.kind == "torch-pipeline":
        run_torch_pipeline(spec)  # rank 0 writes
    elif args.kind == "megatron":
        from experiments.compare_torch.megatron_worker import run_megatron

        run_megatron(spec)  # rank 0 writes
    else:
        out = run_jax(spec) if args.kind == "jax" else run_torch_eager(spec)
        Path(spec["out"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
