"""The tensor- and data-parallel training step: one `jit(shard_map(...))` over the ("data", "pipe", "tensor") mesh.

Per iteration, on every device (paper §2.3 for tensor, §2.1 for data parallelism):
1. take this data rank's b rows of each of the M microbatches (in_specs split the batch over "data");
2. accumulate float32 gradients of the tensor-parallel loss over the M microbatches: with M > 1 through the
   pipeline executor's 1F1B table at p = 1 (`accumulation_schedule`: each layer's gradient added in place into
   the accumulators, Megatron's main_grad), with M = 1 by one `jax.value_and_grad`; parameters are first marked
   varying over "data" (and, under sequence parallelism, the tensor-replicated ones over "tensor") so that
   autodiff does not all-reduce them once per microbatch;
3. all-reduce the gradients over "data" once (and the sequence-parallel replicated ones over "tensor" once);
4. clip by a global norm that counts each parameter once, then AdamW on the local shards.

With p > 1, step 2 is the pipeline executor (`pipeline/executor.py`) running the layout's schedule table.
Initialisation shards the serial `model.init_params` (jit with out_shardings), so a run at t = 4 starts from exactly
the weights of t = 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig, schedule_spec
from ptd_jax.runtime.platform import resolve_branching
from ptd_jax.loss_scale import current_scale, guarded_update, init_loss_scale, poison, unscale
from ptd_jax.optimizer import learning_rate_schedule, new_state, schedule_count
from ptd_jax.parallel import context, distributed_optimizer
from ptd_jax.parallel import sharding
from ptd_jax.parallel import tensor as tp
from ptd_jax.parallel.mesh import Axis
from ptd_jax.parallel.pipeline import executor
from ptd_jax.parallel.pipeline.table import accumulation_table, build, build_forward_only, validate
from ptd_jax.parallel.vma import mark_tree, mark_varying

DATA, PIPE, TENSOR, CONTEXT = Axis.DATA.value, Axis.PIPE.value, Axis.TENSOR.value, Axis.CONTEXT.value


def on_mesh(parallel: ParallelConfig, mesh) -> ParallelConfig:
    """`parallel` with "auto" branching resolved for the platform of the mesh's devices (not the process's default
    backend, which need not be the one a step is built for)."""
    platform = mesh.devices.flat[0].platform
    branching = resolve_branching(parallel.pipeline_branching, platform, parallel.pipeline_schedule)
    if parallel.context_parallel_size > 1 and parallel.cp_comm_type == "p2p" and parallel.pipeline_branching == "auto":
        branching = "uniform"  # the ring over context in no pipe-divergent branch (`ParallelConfig`'s rule)
    return dataclasses.replace(parallel, pipeline_branching=branching)


def init_sharded_state(
    key,
    model_cfg: ModelConfig,
    optimizer,
    mesh,
    parallel: ParallelConfig | None = None,
    *,
    shapes_only: bool = False,
    train_cfg: TrainConfig | None = None,
):
    """The serial initial state, laid out on the mesh (TP-sharded init equals the serial init). With p > 1 the
    layers are stored in the pipeline layout (`sharding.stage_layers`). `shapes_only`: its ShapeDtypeStructs with
    their shardings, computing nothing (what a restore needs). float16 adds the loss scaler (`train_cfg`'s)."""
    p = mesh.shape[PIPE]
    v = parallel.virtual_pipeline_stages if parallel is not None else 1

    def init(k):
        params = gpt.init_params(k, model_cfg, mesh.shape[TENSOR])
        if p > 1:
            v_shape = parallel is not None and schedule_spec(parallel.pipeline_schedule).stage_map == "v"
            params["layers"] = sharding.stage_layers(params["layers"], p, v, v_shape)
        state = new_state(params, optimizer)
        loss_scale = init_loss_scale(model_cfg, train_cfg or TrainConfig())
        return state if loss_scale is None else {**state, "loss_scale": loss_scale}

    abstract = jax.eval_shape(init, key)
    shardings = sharding.named(mesh, state_specs(optimizer, abstract, parallel, pipelined=p > 1))
    if shapes_only:
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    return jax.jit(init, out_shardings=shardings)(key)


def state_specs(optimizer, state, parallel: ParallelConfig | None, pipelined: bool):
    """`sharding.state_specs`, with the master weights and moments split over "data" under the distributed
    optimizer (`distributed_optimizer.shard_specs`)."""
    specs = sharding.state_specs(optimizer, state, pipelined=pipelined)
    if parallel is None or not parallel.use_distributed_optimizer or parallel.data_parallel_size == 1:
        return specs
    params = distributed_optimizer.shard_specs(specs["params"], state["params"], parallel.data_parallel_size)
    return {**specs, "params": params, "opt_state": sharding.opt_state_specs(optimizer, state["opt_state"], params)}


def _pipeline_layout(param_specs) -> bool:
    """Whether the layers are stored in the pipeline layout [v, p, k, ...] (`sharding.stage_layers`): their specs
    name "pipe"."""
    return any(PIPE in tuple(s) for s in jax.tree.leaves(param_specs["layers"], is_leaf=lambda x: isinstance(x, P)))


def _replicated_axes(param_specs, parallel: ParallelConfig):
    """Per parameter, the mesh axes its gradient is a partial sum over (`sharding.replicated_axes`)."""
    return sharding.replicated_axes_tree(
        param_specs,
        parallel.pipeline_model_parallel_size > 1,
        parallel.sequence_parallel,
        context=parallel.context_parallel_size > 1,
    )


def _token_axes(parallel: ParallelConfig) -> tuple[str, ...]:
    """The axes the batch's tokens are spread over: "data", and "context" with context parallelism (the loss's sum
    and its token count are all-reduced over both: the global token mean, whatever a rank's share of the mask)."""
    return (DATA, CONTEXT) if parallel.context_parallel_size > 1 else (DATA,)


def _local_batch(parallel: ParallelConfig, *arrays):
    """This device's tokens of [M, b, S] arrays: with context parallelism its rank's 2 of the 2c chunks."""
    c = parallel.context_parallel_size
    return arrays if c == 1 else tuple(context.split_sequence(x, c) for x in arrays)


@dataclass(frozen=True)
class GradPlan:
    """How a step computes its loss and gradients: everything `loss_and_grads` needs but the data."""

    model_cfg: ModelConfig
    parallel: ParallelConfig
    param_specs: Any
    """The params' specs without the "data" split (the gradients' reduction axes come from them)."""
    recompute: str = "none"
    sched: Any = None
    """The table the microbatches run through (`accumulation_schedule`); None: one microbatch, no table."""
    scatter_dims: Any = None
    """The distributed optimizer: reduce-scatter each gradient over "data" on that dim
    (`distributed_optimizer.scatter_grads`)."""
    norm_specs: Any = None
    """The specs the global norm counts by (with the "data" split under the distributed optimizer); None:
    `param_specs`."""


def loss_and_grads(params, tokens, labels, mask, key, plan: GradPlan, loss_scale=None):
    """shard_map body: (mean token loss, fully reduced local gradient shards, global grad norm). With a
    `loss_scale` the backward runs on the scaled loss and loss and gradients are unscaled (float32) before the
    norm. With context parallelism, traced `over_context` on this rank's chunks of the sequence."""
    with context.over_context(plan.parallel):
        return _loss_and_grads(params, *_local_batch(plan.parallel, tokens, labels, mask), key, plan, loss_scale)


def _loss_and_grads(params, tokens, labels, mask, key, plan: GradPlan, loss_scale=None):
    parallel = plan.parallel
    axes = _replicated_axes(plan.param_specs, parallel)
    varying = mark_tree(params, axes)
    scale = jnp.ones((), jnp.float32) if loss_scale is None else loss_scale
    acc = gpt.acc_dtype(jax.tree.leaves(params)[0].dtype)
    token_axes = _token_axes(parallel)
    # the loss is the token sum over the global count: dividing by total_tokens / scale seeds scale / total_tokens
    total_tokens = jax.lax.psum(jnp.sum(mask > 0), token_axes).astype(acc) / scale.astype(acc)
    batch = executor.StepInputs(tokens, labels, mask, total_tokens)
    if plan.sched is None:
        loss, grads = _one_microbatch(varying, batch, plan, key, scale)
        loss = jax.lax.psum(loss, token_axes)
    else:
        staged = not _pipeline_layout(plan.param_specs)
        if staged:  # the p = 1 accumulation table: layers [L, ...] as the executor's one chunk [1, 1, L, ...]
            varying = {**varying, "layers": sharding.stage_layers(varying["layers"], 1, 1)}
        opts = executor.Options(
            plan.model_cfg,
            sequence_parallel=parallel.sequence_parallel,
            scatter_gather=parallel.scatter_gather,
            recompute=plan.recompute,
            branching=parallel.pipeline_branching,
            key=key,
        )
        loss, grads = executor.accumulate(varying, batch, plan.sched, opts)
        if staged:
            grads = {**grads, "layers": sharding.unstage_layers(grads["layers"])}
        loss = jax.lax.psum(loss, token_axes if staged else (*token_axes, PIPE))
    if plan.scatter_dims is not None:  # "data" by reduce-scatter, the other axes as usual
        axes = jax.tree.map(lambda a: tuple(x for x in a if x != DATA), axes, is_leaf=lambda a: isinstance(a, tuple))
    grads = jax.tree.map(
        lambda a, g: jax.lax.psum(g, a) if a else g, axes, grads, is_leaf=lambda a: isinstance(a, tuple)
    )
    if plan.scatter_dims is not None:
        grads = distributed_optimizer.scatter_grads(grads, plan.scatter_dims)
    if loss_scale is not None:
        loss, grads = unscale(loss, grads, scale)
    # float32 for float32 or 16-bit params (the gathered copy is 16-bit under the distributed optimizer)
    grads = jax.tree.map(lambda g, p: g.astype(gpt.acc_dtype(p.dtype)), grads, params)
    return loss, grads, sharding.global_norm(grads, plan.param_specs if plan.norm_specs is None else plan.norm_specs)


def _one_microbatch(params, batch: executor.StepInputs, plan: GradPlan, key, scale):
    """Per-rank float32 loss and gradient of the one microbatch (not yet reduced over data), both multiplied by
    the loss scale (dividing by total_tokens / scale seeds the backward with scale / total_tokens). More
    microbatches run through the executor's table (`accumulation_schedule`)."""
    tokens, labels, mask = batch.tokens, batch.labels, batch.mask
    if tokens.shape[0] != 1:
        raise ValueError(f"{tokens.shape[0]=} microbatches need a schedule table (`accumulation_schedule`)")
    acc = gpt.acc_dtype(jax.tree.leaves(params)[0].dtype)
    total_tokens = batch.total_tokens

    def loss_fn(p):
        return (
            tp.loss_sum(
                p,
                tokens[0],
                labels[0],
                mask[0],
                plan.model_cfg,
                sequence_parallel=plan.parallel.sequence_parallel,
                key=jax.random.fold_in(key, 0) if key is not None else None,
                recompute=plan.recompute,
            )
            / total_tokens
        )

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return loss.astype(acc), jax.tree.map(lambda g, x: g.astype(gpt.acc_dtype(x.dtype)), grads, params)


def pipeline_schedule(parallel: ParallelConfig):
    """The validated schedule table for the layout, or None without pipelining."""
    if parallel.pipeline_model_parallel_size == 1:
        return None
    sched = build(
        parallel.pipeline_schedule,
        parallel.pipeline_model_parallel_size,
        parallel.virtual_pipeline_stages,
        parallel.num_microbatches,
        parallel.microbatch_group_size,
    )
    validate(sched)
    return sched


def accumulation_schedule(parallel: ParallelConfig):
    """The table a training step runs: the pipeline's; with p = 1 and m > 1 the 1F1B table at p = 1 (each
    microbatch's forward, then its backward), so that the executor adds each layer's gradient in place into the
    float32 accumulators, as Megatron adds into main_grad in its backward, instead of holding one microbatch's
    whole gradient beside them (`experiments/bench/memory/bench_optimizer_memory.py`); None with one microbatch."""
    if parallel.pipeline_model_parallel_size > 1:
        return pipeline_schedule(parallel)
    if parallel.num_microbatches == 1:
        return None
    sched = accumulation_table(parallel.num_microbatches)
    validate(sched)
    return sched


def make_parallel_grad_step(
    mesh,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    param_specs,
    recompute: str = "none",
    scatter_gather: bool = True,
):
    """jit(params, tokens, labels, mask) -> (loss, grads, grad_norm), for comparing with the reference."""
    parallel = dataclasses.replace(on_mesh(parallel, mesh), scatter_gather=scatter_gather)
    plan = GradPlan(model_cfg, parallel, param_specs, recompute, accumulation_schedule(parallel))

    def body(params, tokens, labels, mask):
        return loss_and_grads(params, tokens, labels, mask, None, plan)

    batch = sharding.BATCH_SPEC
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(param_specs, batch, batch, batch), out_specs=(P(), param_specs, P()))
    )


def make_parallel_train_step(
    mesh,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    train_cfg: TrainConfig,
    optimizer: optax.GradientTransformation,
    state,
    *,
    poison_steps: tuple[int, ...] = (),
):
    """jit(state, tokens, labels, mask [M, d·b, S], key) -> (state, metrics); state donated, shardings declared.
    A non-finite loss or gradient skips the update (`loss_scale.guarded_update`).

    `state` (or its abstract shape) fixes the pytree structure of the in/out specifications. `poison_steps`: a
    test hook (`loss_scale.poison`)."""
    parallel = on_mesh(parallel, mesh)
    lr_schedule = learning_rate_schedule(train_cfg)
    use_dropout = model_cfg.hidden_dropout > 0 or model_cfg.attention_dropout > 0
    pipelined = parallel.pipeline_model_parallel_size > 1
    sched = accumulation_schedule(parallel)
    specs = state_specs(optimizer, state, parallel, pipelined=pipelined)
    distributed = specs["params"] != sharding.param_specs(state["params"], pipelined)
    dims = distributed_optimizer.data_dims(specs["params"]) if distributed else None
    plan = GradPlan(
        model_cfg,
        parallel,
        sharding.param_specs(state["params"], pipelined),
        train_cfg.recompute_granularity,
        sched,
        scatter_dims=dims,
        norm_specs=specs["params"],
    )

    def step(state, tokens, labels, mask, key):
        params = state["params"]
        if distributed:  # the whole local shards, gathered in the compute dtype
            params = distributed_optimizer.gather_params(params, dims, jnp.dtype(model_cfg.dtype))
        if use_dropout:  # a different stream per iteration and per data rank
            key = jax.random.fold_in(jax.random.fold_in(key, state["step"]), jax.lax.axis_index(DATA))
        else:
            key = None
        scale = current_scale(state) if "loss_scale" in state else None
        loss, grads, grad_norm = loss_and_grads(params, tokens, labels, mask, key, plan, scale)
        if poison_steps:  # the test hook: a poisoned step's norm is inf, as a real overflow's
            loss, grads = poison(loss, grads, state["step"], poison_steps)
            grad_norm = sharding.global_norm(grads, specs["params"])
        lr = lr_schedule(schedule_count(state["opt_state"]))  # applied (or, skipped, would have been): not "step"
        state, guard = guarded_update(state, loss, grads, grad_norm, optimizer, train_cfg)
        return state, {"lm_loss": loss, "grad_norm": grad_norm, "lr": lr, **guard}

    batch = sharding.BATCH_SPEC
    metric_specs = {"lm_loss": P(), "grad_norm": P(), "lr": P(), "skipped": P(), "loss_scale": P()}
    sharded = jax.shard_map(
        step, mesh=mesh, in_specs=(specs, batch, batch, batch, P()), out_specs=(specs, metric_specs)
    )
    state_shardings = sharding.named(mesh, specs)
    batch_sharding = sharding.named(mesh, batch)
    replicated = sharding.named(mesh, P())
    return jax.jit(
        sharded,
        donate_argnums=0,
        in_shardings=(state_shardings, batch_sharding, batch_sharding, batch_sharding, replicated),
        out_shardings=(state_shardings, sharding.named(mesh, metric_specs)),
    )


def make_parallel_eval_step(mesh, model_cfg: ModelConfig, parallel: ParallelConfig, param_specs):
    """jit(params, tokens, labels, mask [M, d·b, S]) -> mean token loss over the global batch (no dropout).
    With p > 1 the forwards of the training schedule run through the pipeline executor."""
    parallel = on_mesh(parallel, mesh)
    p = parallel.pipeline_model_parallel_size
    sched = (
        None
        if p == 1
        else build_forward_only(
            parallel.pipeline_schedule,
            p,
            parallel.virtual_pipeline_stages,
            parallel.num_microbatches,
            parallel.microbatch_group_size,
        )
    )

    def eval_step(params, tokens, labels, mask):
        with context.over_context(parallel):
            return _eval_step(params, *_local_batch(parallel, tokens, labels, mask))

    def _eval_step(params, tokens, labels, mask):
        acc = gpt.acc_dtype(jax.tree.leaves(params)[0].dtype)
        token_axes = _token_axes(parallel)
        total_tokens = jax.lax.psum(jnp.sum(mask > 0), token_axes).astype(acc)
        if sched is not None:
            varying = mark_tree(params, _replicated_axes(param_specs, parallel))
            opts = executor.Options(
                model_cfg,
                sequence_parallel=parallel.sequence_parallel,
                scatter_gather=parallel.scatter_gather,
                branching=parallel.pipeline_branching,
            )
            loss = executor.loss(varying, executor.StepInputs(tokens, labels, mask, total_tokens), sched, opts)
            return jax.lax.psum(loss, (*token_axes, PIPE))

        def body(total, xs):
            return total + tp.loss_sum(params, *xs, model_cfg, sequence_parallel=parallel.sequence_parallel), None

        total, _ = jax.lax.scan(body, mark_varying(jnp.zeros((), acc), token_axes), (tokens, labels, mask))
        return jax.lax.psum(total, token_axes) / total_tokens

    batch = sharding.BATCH_SPEC
    return jax.jit(jax.shard_map(eval_step, mesh=mesh, in_specs=(param_specs, batch, batch, batch), out_specs=P()))
