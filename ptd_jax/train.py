"""The single-device training step — the reference every parallel path is compared against — and the loop,
which runs the tensor/data-parallel step of `parallel_step` on the mesh.

One iteration (Megatron's `train_step`): the global batch of B samples is cut into M = B / b microbatches;
the gradient of each microbatch's summed token loss is accumulated in float32 (a `lax.scan`), divided by the
global token count (so the loss is the mean over the whole batch whatever the layout), clipped to a global
norm, and applied by AdamW. State is donated.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ptd_jax import model as gpt
from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.data import Batch, GPTData, split_global_batch
from ptd_jax.flops import device_peak_tflops, flops_per_iteration, model_flops_per_iteration
from ptd_jax.mesh import make_mesh
from ptd_jax.metrics import MetricsLogger
from ptd_jax.optimizer import clip_by_global_norm, learning_rate_schedule, make_optimizer

State = dict[str, Any]  # {"params", "opt_state", "step"}


def init_state(key: jax.Array, model_cfg: ModelConfig, optimizer: optax.GradientTransformation) -> State:
    params = gpt.init_params(key, model_cfg)
    return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}


def microbatches(batch: Batch, parallel: ParallelConfig):
    """Global batch [B, S] -> (tokens, labels, mask) each [M, d·b, S] in Megatron's sampler order."""
    m, d, b = parallel.num_microbatches, parallel.data_parallel_size, parallel.micro_batch_size

    def cut(x):
        return split_global_batch(x, m, d, b).reshape(m, d * b, *x.shape[1:])

    return cut(batch.tokens), cut(batch.labels), cut(batch.loss_mask)


def accumulate_gradients(params, tokens_MxBxS, labels_MxBxS, mask_MxBxS, model_cfg: ModelConfig, *,
                         recompute: str = "none", key=None):
    """Sum over microbatches of d(loss_sum / total_tokens)/d(params), accumulated in float32 (or float64).

    Returns (mean token loss of the batch, grads)."""
    acc = jnp.promote_types(jax.tree.leaves(params)[0].dtype, jnp.float32)
    total_tokens = jnp.maximum(jnp.sum(mask_MxBxS > 0), 1).astype(acc)

    def micro_loss(p, tokens, labels, mask, k):
        return gpt.loss_sum(p, tokens, labels, mask, model_cfg, key=k, recompute=recompute) / total_tokens

    grad_fn = jax.value_and_grad(micro_loss)

    def body(carry, xs):
        loss_acc, grad_acc = carry
        index, tokens, labels, mask = xs
        k = jax.random.fold_in(key, index) if key is not None else None
        loss, grads = grad_fn(params, tokens, labels, mask, k)
        grad_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_acc, grads)
        return (loss_acc + loss, grad_acc), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), params)
    indices = jnp.arange(tokens_MxBxS.shape[0])
    (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), acc), zeros),
                                    (indices, tokens_MxBxS, labels_MxBxS, mask_MxBxS))
    return loss, grads


def make_train_step(model_cfg: ModelConfig, train_cfg: TrainConfig, optimizer: optax.GradientTransformation):
    """jit(state, tokens, labels, mask [M, b, S], key) -> (state, metrics); the state is donated."""
    schedule = learning_rate_schedule(train_cfg)
    use_dropout = model_cfg.hidden_dropout > 0 or model_cfg.attention_dropout > 0

    def step(state, tokens, labels, mask, key):
        key = jax.random.fold_in(key, state["step"]) if use_dropout else None
        loss, grads = accumulate_gradients(state["params"], tokens, labels, mask, model_cfg,
                                           recompute=train_cfg.recompute_granularity, key=key)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
        grads, grad_norm = clip_by_global_norm(grads, train_cfg.clip_grad)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"lm_loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"])}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return jax.jit(step, donate_argnums=0)


def make_eval_step(model_cfg: ModelConfig):
    """jit(params, tokens, labels, mask [M, b, S]) -> mean token loss (no dropout)."""

    def eval_step(params, tokens, labels, mask):
        def body(total, xs):
            return total + gpt.loss_sum(params, *xs, model_cfg), None

        acc = jnp.promote_types(jax.tree.leaves(params)[0].dtype, jnp.float32)
        total, _ = jax.lax.scan(body, jnp.zeros((), acc), (tokens, labels, mask))
        return total / jnp.maximum(jnp.sum(mask > 0), 1)

    return jax.jit(eval_step)


@dataclass
class RunOptions:
    """Where data comes from and where results go (not part of the algorithm)."""

    data_path: str | None = None
    """Prefix of a .bin/.idx pair; None = the embedded default corpus."""
    split: str = "969,30,1"
    save: str | None = None
    load: str | None = None
    metrics_file: str | None = None
    plot_dir: str | None = None
    peak_tflops: float | None = None
    progress: bool = True
    reference_step: bool = False
    """Run the single-device reference step instead of the shard_map step (one device only; for comparisons)."""


def _log_record(iteration, metrics, step_time, model_cfg, parallel, peak_tflops, num_devices):
    B, s = parallel.global_batch_size, model_cfg.seq_length
    vocab = model_cfg.padded_vocab_size(parallel.tensor_model_parallel_size)  # the logits actually computed
    flops = flops_per_iteration(model_cfg, B, vocab)
    tflops = flops / step_time / num_devices / 1e12
    mfu = model_flops_per_iteration(model_cfg, B, vocab) / step_time / num_devices / (peak_tflops * 1e12)
    return {
        "kind": "train",
        "iteration": iteration,
        "lm_loss": float(metrics["lm_loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "lr": float(metrics["lr"]),
        "step_time_s": step_time,
        "tokens_per_s": B * s / step_time,
        "tflops_per_device": tflops,
        "mfu": mfu,
    }


def train(model_cfg: ModelConfig, parallel: ParallelConfig, train_cfg: TrainConfig,
          options: RunOptions | None = None) -> dict:
    """Train on the mesh of `parallel` (the shard_map step) and return a summary dict (the CLI's last line)."""
    from ptd_jax import checkpoint
    from ptd_jax.data import default_corpus
    from ptd_jax.parallel_step import init_sharded_state, make_parallel_eval_step, make_parallel_train_step
    from ptd_jax.sharding import param_specs

    options = options or RunOptions()
    parallel.check_model(model_cfg)
    data_path = options.data_path or default_corpus(progress=options.progress)
    data = GPTData(data_path, seq_length=model_cfg.seq_length, global_batch_size=parallel.global_batch_size,
                   train_iters=train_cfg.train_iters, eval_iters=train_cfg.eval_iters, seed=train_cfg.seed,
                   split=options.split, vocab_size=model_cfg.vocab_size)

    optimizer = make_optimizer(train_cfg)
    key = jax.random.key(train_cfg.seed)
    init_key, dropout_key = jax.random.split(key)
    mesh = make_mesh(parallel)
    if options.reference_step:
        if parallel.num_devices != 1:
            raise ConfigError(f"the reference step runs on one device, not num_devices={parallel.num_devices}")
        state = init_state(init_key, model_cfg, optimizer)
    else:
        state = init_sharded_state(init_key, model_cfg, optimizer, mesh, parallel)
    start = 0
    if options.load:
        state, start = checkpoint.restore(options.load, state, model_cfg, parallel)
    num_params = gpt.count_params(state["params"])

    if options.reference_step:
        train_step, eval_step = make_train_step(model_cfg, train_cfg, optimizer), make_eval_step(model_cfg)
    else:
        train_step = make_parallel_train_step(mesh, model_cfg, parallel, train_cfg, optimizer, state)
        pipelined = parallel.pipeline_model_parallel_size > 1
        eval_step = make_parallel_eval_step(mesh, model_cfg, parallel, param_specs(state["params"], pipelined))
    device = jax.devices()[0]
    num_devices = parallel.num_devices
    peak, peak_source = device_peak_tflops(device.device_kind, model_cfg.dtype == "bfloat16",
                                           options.peak_tflops, jax.local_device_count())
    if data.valid is None and train_cfg.eval_iters > 0:
        print(f"ptd_jax: warning: the validation split of {data_path} is empty (split={options.split}); "
              f"no validation loss will be reported", file=sys.stderr)

    def evaluate(params):
        losses = [float(eval_step(params, *microbatches(b, parallel))) for b in data.valid_batches()]
        return float(np.mean(losses)) if losses else None

    logger = MetricsLogger(train_cfg.train_iters, start_iter=start, metrics_file=options.metrics_file,
                           progress=options.progress)
    logger.message(f"ptd_jax: {num_params / 1e6:.2f}M parameters, layout d={parallel.data_parallel_size} "
                   f"p={parallel.pipeline_model_parallel_size} t={parallel.tensor_model_parallel_size}, "
                   f"B={parallel.global_batch_size} b={parallel.micro_batch_size} m={parallel.num_microbatches}, "
                   f"{model_cfg.dtype}, attention {model_cfg.attention_backend}, fused LayerNorm/loss kernels "
                   f"{'on' if model_cfg.fused_kernels else 'off'}, peak {peak:.3g} TFLOP/s/device ({peak_source}), "
                   f"data {data_path}")
    if parallel.pipeline_model_parallel_size > 1:
        from ptd_jax.parallel_step import pipeline_schedule

        sched = pipeline_schedule(parallel)
        sim = sched.simulate()
        logger.message(f"pipeline: {sched.name} p={sched.p} v={sched.v} m={sched.m}: {sched.ticks} lockstep ticks, "
                       f"bubble {sim['bubble_fraction']:.3f} (paper (p-1)/(v*m) = {sched.formula_bubble():.3f}), "
                       f"peak stash per rank {sched.peak_stash}")
    wall_start = time.perf_counter()
    records, compile_time = [], None
    window_start, window_iters = time.perf_counter(), 0
    first_loss = None
    try:
        for iteration in range(start, train_cfg.train_iters):
            batch = data.train_batch(iteration)
            state, metrics = train_step(state, *microbatches(batch, parallel), dropout_key)
            window_iters += 1
            if compile_time is None:  # the first step includes compilation: time it apart
                jax.block_until_ready(metrics)
                compile_time = time.perf_counter() - window_start
                first_loss = float(metrics["lm_loss"])
                window_start, window_iters = time.perf_counter(), 0
            logger.advance()
            done = iteration + 1
            if done % train_cfg.log_interval == 0 or done == train_cfg.train_iters:
                jax.block_until_ready(metrics)
                now = time.perf_counter()
                step_time = (now - window_start) / window_iters if window_iters else compile_time
                record = _log_record(done, metrics, step_time, model_cfg, parallel, peak, num_devices)
                record["includes_compile"] = not window_iters
                records.append(record)
                logger.log_train(record)
                window_start, window_iters = now, 0
            if data.valid is not None and (done % train_cfg.eval_interval == 0 or done == train_cfg.train_iters):
                valid = evaluate(state["params"])
                logger.log_eval({"kind": "valid", "iteration": done, "valid_lm_loss": valid,
                                 "valid_ppl": math.exp(min(valid, 50))})
            if options.save and ((train_cfg.save_interval and done % train_cfg.save_interval == 0)
                                 or done == train_cfg.train_iters):
                checkpoint.save(options.save, done, state, model_cfg, parallel, train_cfg)
            if window_iters == 0:  # eval and save are not training time: restart the window after them
                window_start = time.perf_counter()
    finally:
        logger.close()

    timed = [r for r in records if not r["includes_compile"]]
    summary = {
        "iterations": train_cfg.train_iters - start,
        "num_params": num_params,
        "wall_time_s": time.perf_counter() - wall_start,
        "compile_time_s": compile_time,
        "first_lm_loss": first_loss,
        "final_lm_loss": records[-1]["lm_loss"] if records else None,
        "final_valid_lm_loss": logger.eval_records[-1]["valid_lm_loss"] if logger.eval_records else None,
        "tokens_per_s": float(np.median([r["tokens_per_s"] for r in timed])) if timed else None,
        "tflops_per_device": float(np.median([r["tflops_per_device"] for r in timed])) if timed else None,
        "mfu": float(np.median([r["mfu"] for r in timed])) if timed else None,
        "peak_tflops": peak,
        "peak_source": peak_source,
        "device": device.device_kind,
        "num_devices": num_devices,
        "attention_backend": model_cfg.attention_backend,
        "fused_kernels": model_cfg.fused_kernels,
    }
    if options.plot_dir:
        summary["plot"] = logger.plot(options.plot_dir)
    return summary
