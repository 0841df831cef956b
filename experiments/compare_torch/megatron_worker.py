"""compare_torch's fourth engine: megatron-core itself (its GPTModel with the local layer spec and its own pipeline
schedules, `megatron.core.pipeline_parallel.get_forward_backward_func`: no pipelining at p = 1, 1F1B, interleaved
1F1B, and its tensor parallelism), one CPU process per (pipeline, tensor) rank, p·t of them, over gloo, launched
by torchrun (`workers.py megatron`), trained with compare_torch's loop (the same weights through `interop.to_megatron`,
data, AdamW, schedule, clipping and loss normalisation: `common.py`).

megatron-core is written for CUDA. On CPU, in this worker process only, five things are pointed at the CPU; none of
them changes its math:
- `torch.cuda.current_device()` returns "cpu" (its p2p and attention buffers are allocated on it);
- `torch.zeros(..., device="cuda")` allocates on the CPU (the schedules' token counter);
- `Tensor.cuda()` returns the tensor (the tied output layer's start-up copy);
- `torch.cuda.synchronize()` does nothing (after p2p, where gloo has already waited);
- the CUDA RNG tracker's `fork()` is a no-op (it guards attention dropout, which is 0 here).

The tied output layer is Megatron's: the last stage keeps a copy of the word embedding and the two copies'
gradients are all-reduced over megatron-core's embedding group; the grad norm is all-reduced over the ranks, each
weight counted once. GPipe is not one of megatron-core's schedules.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from experiments.compare_torch.common import Layout, distributed_update, torch_optimizer


def point_megatron_at_the_cpu(torch) -> None:
    """The five CPU shims of the module docstring (process-wide: a worker process only)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    zeros = torch.zeros

    def cpu_zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return zeros(*args, **kwargs)

    torch.zeros = cpu_zeros


COLUMN_PARALLEL = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "embedding.word_embeddings.weight",
    "output_layer.weight",
)
"""Split over t along dim 0 (output rows; the QKV rows go head by head, so each rank gets whole heads; the
vocabulary rows of the embedding and the output layer)."""
ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
"""Split over t along dim 1 (input columns); their biases, the LayerNorms and the positions are whole on every rank."""


def tensor_shard(name: str, value, rank: int, t: int):
    """Tensor-parallel rank `rank`'s part of a whole tensor of megatron-core's state dict (Megatron's split)."""
    if t == 1:
        return value
    if name.endswith(COLUMN_PARALLEL):
        return value.chunk(t, dim=0)[rank].clone()
    if name.endswith(ROW_PARALLEL):
        return value.chunk(t, dim=1)[rank].clone()
    return value


def _stage_state(full: dict, stage: int, layers_per_stage: int, first: bool, last: bool) -> dict:
    """The megatron-core state dict of pipeline stage `stage` (its layers renumbered from 0, as its
    `state_dict()` names them), from the whole model's."""
    out = {}
    lo = stage * layers_per_stage
    for name, value in full.items():
        if name.startswith("decoder.layers."):
            index, rest = name.removeprefix("decoder.layers.").split(".", 1)
            if lo <= int(index) < lo + layers_per_stage:
                out[f"decoder.layers.{int(index) - lo}.{rest}"] = value
        elif name.startswith("embedding."):
            if first:
                out[name] = value
        elif last:  # decoder.final_layernorm
            out[name] = value
    if last and not first:
        out["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return out


def _transformer_config(torch, cfg, p: int, v: int, t: int):
    """megatron-core's TransformerConfig of ptd_jax's model: no dropout, no fusions, float32, CPU initialisation
    (the weights are loaded after)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=cfg.layernorm_epsilon,
        activation_func=lambda x: torch.nn.functional.gelu(x, approximate="tanh" if cfg.gelu_approximate else "none"),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=t,
        pipeline_model_parallel_size=p,
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
        batch_p2p_comm=False,
    )


def _build_chunks(config, cfg, full: dict, layout: Layout, tp_rank: int, pp_rank: int) -> list:
    """This rank's v model chunks (Megatron's round-robin stages), each loaded with its part of `full`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    p, v, t = layout.p, layout.v, layout.t
    num_stages = p * v
    chunks = []
    for c in range(v):
        stage = c * p + pp_rank
        first, last = stage == 0, stage == num_stages - 1
        chunk = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.seq_length,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute",
            vp_stage=c if v > 1 else None,
        )
        state = {
            name: tensor_shard(name, value, tp_rank, t)
            for name, value in _stage_state(full, stage, cfg.num_layers // num_stages, first, last).items()
        }
        missing, unexpected = chunk.load_state_dict(state, strict=False)
        assert not unexpected and all(x.endswith("_extra_state") for x in missing), (missing, unexpected)
        chunks.append(chunk.train())
    return chunks


def _forward_step(M: int, total: int, positions, mask):
    """megatron-core's forward_step_func: per-token losses on the last stage, summed over the global tokens (the
    schedule divides by M: the global-token normalisation survives it)."""

    def forward_step(iterator, model):
        tokens, labels = next(iterator)
        losses = model(tokens, positions, mask, labels=labels)

        def loss_func(output):
            mb_sum = output.sum() / total
            return mb_sum * M, {"loss": mb_sum.detach()}

        return losses, loss_func

    return forward_step


def _train_layout(torch, dist, layout: Layout, cfg, full: dict, data, spec: dict) -> dict:
    """Train one layout for every batch of `data`: {"losses", "grad_norms", "step_s", "cpu_s"}."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    v, p, t = layout.v, layout.p, layout.t
    parallel_state.initialize_model_parallel(t, p, virtual_pipeline_model_parallel_size=v if v > 1 else None)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    chunks = _build_chunks(_transformer_config(torch, cfg, p, v, t), cfg, full, layout, tp_rank, pp_rank)
    named = [(n, w) for chunk in chunks for n, w in chunk.named_parameters()]
    # by name: megatron-core sets `tensor_model_parallel` on a weight only when it initialises it
    sharded = {id(w) for n, w in named if t > 1 and n.endswith(COLUMN_PARALLEL + ROW_PARALLEL)}
    opt, sched = torch_optimizer(torch, named, spec)
    embed = chunks[0].embedding.word_embeddings.weight if pp_rank == 0 else None
    head = chunks[-1].output_layer.weight if pp_rank == p - 1 and p > 1 else None
    forward_backward = get_forward_backward_func()
    M, b, S = spec["microbatches"], spec["micro_batch"], cfg.seq_length
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]  # True = masked
    forward_step = _forward_step(M, M * b * S, torch.arange(S).expand(b, S), mask)
    losses, norms, times, cpu = [], [], [], []
    for batch in data:
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        tokens, labels = batch[:, :-1], batch[:, 1:]
        micro = [(tokens[j * b : (j + 1) * b], labels[j * b : (j + 1) * b]) for j in range(M)]
        iterators = [iter(micro) for _ in range(v)] if v > 1 else iter(micro)
        reduced = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators,
            model=chunks if v > 1 else chunks[0],
            num_microbatches=M,
            seq_length=S,
            micro_batch_size=b,
            forward_only=False,
        )
        if p > 1 and (embed is not None or head is not None):  # the tied copies, per tensor rank
            tied = embed if embed is not None else head
            dist.all_reduce(tied.grad, group=parallel_state.get_embedding_group())
        grads = [w for _, w in named if w.grad is not None]
        # each weight once: a tensor-parallel shard on every tensor rank, a replicated one on tensor rank 0 only
        counted = [w for w in grads if w is not head and (id(w) in sharded or tp_rank == 0)]
        local_loss = sum(float(x["loss"]) for x in reduced) if reduced and tp_rank == 0 else 0.0  # once per t
        loss, norm = distributed_update(torch, dist, grads, counted, local_loss, opt, sched, spec["train"]["clip_grad"])
        dist.barrier()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        losses.append(loss)
        norms.append(norm)
    cpu_all = torch.tensor(cpu, dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(cpu_all)  # every rank's process CPU time, summed
    parallel_state.destroy_model_parallel()
    return {"losses": losses, "grad_norms": norms, "step_s": times, "cpu_s": cpu_all.tolist()}


def run_megatron(spec: dict) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    from ptd_jax.interop import from_hf, to_megatron

    point_megatron_at_the_cpu(torch)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, spec["threads"] // world))  # world = p·t processes
    torch.manual_seed(0)
    cfg, params = from_hf(spec["weights"])
    full = {k: torch.from_numpy(np.array(v)) for k, v in to_megatron(params, cfg).items()}
    data = torch.from_numpy(np.load(spec["data"]))
    out = {}
    for layout in (Layout(**x) for x in spec["layouts"]):
        assert layout.devices == world, (layout, world)
        out[layout.name] = _train_layout(torch, dist, layout, cfg, full, data, spec)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(out))
    dist.destroy_process_group()
    return out
