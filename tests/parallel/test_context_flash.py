"""The p2p ring on the Pallas flash kernel (`parallel/context.py`, attention_backend='pallas', interpreted on CPU),
float32: attention alone (output and dQ, dK, dV) against the single-device XLA attention and the XLA ring, with
grouped-query attention, c = 2 and 4, padded sub-blocks; broken variants (the block's lse in the backward instead
of the final one, a wrong diagonal) fail; which sub-blocks the layout makes visible; a whole parallel train step at
c = 2 against the reference step; the configurations it refuses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ptd_jax import model as gpt
from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.optimizer import make_optimizer, new_state
from ptd_jax.parallel import context, sharding
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.step import make_parallel_grad_step, make_parallel_train_step, state_specs
from ptd_jax.train.reference import accumulate_gradients, make_train_step
from ptd_jax.presets import LLAMA_SWITCHES
from tests.helpers.exactness import assert_equals_reference, rel

RTOL = 1e-5


def layout(c, comm="p2p", **fields) -> ParallelConfig:
    return ParallelConfig(context_parallel_size=c, cp_comm_type=comm, micro_batch_size=1, global_batch_size=2, **fields)


def inputs(B, S, G, R, K, seed=0):
    """q [B, S, G, R, K], k, v [B, S, G, K] and an output cotangent, float32, in natural order."""
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, S, G, R, K), jnp.float32)
    k, v = (jax.random.normal(x, (B, S, G, K), jnp.float32) for x in (kk, kv))
    return q, k, v, jax.random.normal(kd, q.shape, jnp.float32)


def ring_value_and_grads(c, backend, q, k, v, do):
    """The ring's output and (dq, dk, dv) for natural-order inputs: permuted to the load-balanced layout, split over
    context by shard_map, and back."""
    S = q.shape[1]
    order, restore = context.load_balanced_order(S, c), context.restore_order(S, c)
    mesh = make_mesh(layout(c))
    ring = context.Ring(c, backend=backend, interpret=True)
    spec = P(None, "context")
    attend = jax.shard_map(
        lambda q, k, v: context.ring_attention(q, k, v, ring), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec
    )

    def loss(q, k, v):
        out = attend(q[:, order], k[:, order], v[:, order])[:, restore]
        return jnp.sum(out * do), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def reference_value_and_grads(q, k, v, do):
    def loss(q, k, v):
        out = gpt.causal_attention(q, k, v, backend="xla")
        return jnp.sum(out * do), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def assert_close(got, want, rtol=RTOL):
    (out, grads), (ref_out, ref_grads) = got, want
    assert rel(out, ref_out) <= rtol, f"output: relative error {rel(out, ref_out):.2e}"
    for name, g, w in zip("qkv", grads, ref_grads, strict=True):
        assert g.shape == w.shape and rel(g, w) <= rtol, f"d{name}: relative error {rel(g, w):.2e}"


# --- which sub-blocks are visible ---------------------------------------------------------------------------------


@pytest.mark.parametrize("c", [2, 3, 4, 8])
def test_the_sub_block_plan_is_the_causal_mask_of_the_layout(c):
    """`_flash_block` decides from (hop, a, b) and the rank alone; against the chunks' global indices: skipped where
    the key chunk is later, the causal kernel where it is the query chunk, the full kernel where it is earlier."""
    for rank in range(c):
        for j in range(c):
            s = (rank - j) % c
            for a, q_chunk in enumerate((rank, 2 * c - 1 - rank)):
                for b, k_chunk in enumerate((s, 2 * c - 1 - s)):
                    diagonal, seen = context._flash_block(j, a, b, jnp.int32(rank), c, like=jnp.zeros(()))
                    assert (bool(diagonal), bool(seen)) == (k_chunk == q_chunk, k_chunk <= q_chunk), (rank, j, a, b)


# --- attention alone ----------------------------------------------------------------------------------------------


# -m slow (11-17 s each): the default run checks the kernel ring against single-device attention at c = 2 in
# test_the_backward_needs_the_final_log_sum_exp below
@pytest.mark.slow
@pytest.mark.parametrize(
    "c, shape",
    [
        pytest.param(2, (1, 128, 2, 2, 16), id="c2-S128-G2R2-K16"),  # Sc = 32: blocks of 32, no padding
        pytest.param(4, (2, 64, 2, 2, 32), id="c4-S64-G2R2-K32"),  # Sc = 8: padded to one tile of 16
        pytest.param(2, (1, 48, 1, 4, 8), id="c2-S48-G1R4-K8"),  # Sc = 12: rows and head dim padded
    ],
)
def test_the_kernel_ring_equals_single_device_attention_and_the_xla_ring(c, shape):
    q, k, v, do = inputs(*shape)
    got = ring_value_and_grads(c, "pallas", q, k, v, do)
    assert_close(got, reference_value_and_grads(q, k, v, do))
    assert_close(got, ring_value_and_grads(c, "xla", q, k, v, do))


def test_the_backward_needs_the_final_log_sum_exp(monkeypatch):
    """FlashAttention-2's backward is exact with the row's final lse only: each sub-block's own lse (what its
    forward returned) gives probabilities that sum to 1 per sub-block, not per row."""
    q, k, v, do = inputs(1, 64, 2, 2, 16)
    want = reference_value_and_grads(q, k, v, do)
    assert_close(ring_value_and_grads(2, "pallas", q, k, v, do), want)

    def block_lse(grads, q, k, v, rows, kernel):  # the broken variant: the sub-block's lse and delta
        o_blk, lse_blk = context.flash_forward(*context.match_varying(q, k, v), kernel)
        delta = jnp.einsum("bshk,bshk->bhs", rows[0], o_blk)
        return grads_of(grads, q, k, v, (rows[0], lse_blk, delta), kernel)

    grads_of = context._flash_grad_block
    monkeypatch.setattr(context, "_flash_grad_block", block_lse)
    out, grads = ring_value_and_grads(2, "pallas", q, k, v, do)
    assert rel(out, want[0]) <= RTOL  # the forward is untouched
    assert max(rel(g, w) for g, w in zip(grads, want[1])) > 1e-2


def test_a_wrong_diagonal_fails(monkeypatch):
    """The full kernel on the diagonal sub-blocks (future keys leak in): the output is off."""
    q, k, v, do = inputs(1, 64, 2, 2, 16)
    plan = context._flash_block
    monkeypatch.setattr(context, "_flash_block", lambda *a, **kw: (False, plan(*a, **kw)[1]))
    out, _ = ring_value_and_grads(2, "pallas", q, k, v, do)
    assert rel(out, reference_value_and_grads(q, k, v, do)[0]) > 1e-2


# --- the whole step -----------------------------------------------------------------------------------------------

LLAMA = ModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=96,
    seq_length=64,
    vocab_size=257,
    **LLAMA_SWITCHES,
    dtype="float32",
    param_dtype="float32",
)


def batch(m, S):
    toks = np.asarray(jax.random.randint(jax.random.key(1), (2, S + 1), 0, 257))
    mask = np.ones((2, S), np.int32)
    mask[1, 5:20] = 0
    return [x.reshape(m, 2 // m, S) for x in (toks[:, :-1], toks[:, 1:], mask)]


# The whole steps with the kernel ring: -m slow (20-35 s each); the default run has the ring alone above and the
# XLA ring's whole steps in test_context.py
@pytest.mark.slow
@pytest.mark.parametrize("c", [2, 4])
def test_the_parallel_gradients_with_the_kernel_equal_the_reference(c):
    """Loss and every gradient of `make_parallel_grad_step` (attention by the kernel ring) against the single-device
    reference with XLA attention, float32."""
    cfg = LLAMA.replace(attention_backend="pallas")
    parallel = layout(c)
    params = gpt.init_params(jax.random.key(0), LLAMA)
    reference = jax.jit(accumulate_gradients, static_argnums=4)(params, *batch(2, LLAMA.seq_length), LLAMA)
    mesh = make_mesh(parallel)
    placed, specs = sharding.place_params(params, parallel, mesh)
    step = make_parallel_grad_step(mesh, cfg, parallel, specs)
    loss, grads, norm = step(placed, *batch(parallel.num_microbatches, LLAMA.seq_length))
    assert_equals_reference((loss, sharding.reference_layout(grads, parallel), norm), reference, RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_the_kernel_ring_under_recomputation_in_a_pipeline(recompute):
    """c = 2 x p = 2 (1F1B's lockstep table, run uniform), 4 layers: the kernel ring recomputed by the policy inside
    the pipeline's ticks, loss and every gradient against the single-device reference with XLA attention."""
    model = LLAMA.replace(num_layers=4)
    parallel = layout(2, pipeline_model_parallel_size=2, pipeline_schedule="1f1b-lockstep")
    params = gpt.init_params(jax.random.key(0), model)
    reference = jax.jit(accumulate_gradients, static_argnums=4, static_argnames="recompute")(
        params, *batch(2, model.seq_length), model, recompute=recompute
    )
    mesh = make_mesh(parallel)
    placed, specs = sharding.place_params(params, parallel, mesh)
    step = make_parallel_grad_step(
        mesh, model.replace(attention_backend="pallas"), parallel, specs, recompute=recompute
    )
    loss, grads, norm = step(placed, *batch(parallel.num_microbatches, model.seq_length))
    assert_equals_reference((loss, sharding.reference_layout(grads, parallel), norm), reference, RTOL)


@pytest.mark.slow
def test_the_parallel_train_step_at_c2_with_the_kernel_equals_the_reference_step():
    """One step of `make_parallel_train_step`, c = 2, attention by the kernel ring, against the single-device
    reference step with XLA attention: loss, grad norm and every parameter after the update. Adam with eps = 1 and
    lr = 1 makes the first update g / (|g| + 1), about the gradient itself, so a gradient error shows in the
    parameters at its own scale (eps = 1e-8 would give sign(g), hiding it)."""
    cfg = LLAMA.replace(attention_backend="pallas")
    parallel = layout(2)
    train_cfg = TrainConfig(train_iters=4, lr=1.0, lr_warmup_iters=0, adam_eps=1.0, weight_decay=0.0)
    optimizer = make_optimizer(train_cfg)
    params = gpt.init_params(jax.random.key(0), LLAMA)
    data = batch(parallel.num_microbatches, LLAMA.seq_length)
    reference = new_state(jax.tree.map(jnp.copy, params), optimizer)
    want, want_metrics = make_train_step(LLAMA, train_cfg, optimizer)(reference, *data, None)
    mesh = make_mesh(parallel)
    init = sharding.place_params(params, parallel, mesh)[0]
    abstract = jax.eval_shape(lambda: new_state(init, optimizer))
    specs = state_specs(optimizer, abstract, parallel, pipelined=False)
    laid = jax.jit(lambda p: new_state(p, optimizer), out_shardings=sharding.named(mesh, specs))(init)
    step = make_parallel_train_step(mesh, cfg, parallel, train_cfg, optimizer, laid)
    got, metrics = step(laid, *data, jax.random.key(0))
    for name in ("lm_loss", "grad_norm"):
        assert float(metrics[name]) == pytest.approx(float(want_metrics[name]), rel=RTOL), name
    flat = jax.tree_util.tree_leaves_with_path(want["params"])
    for (path, after), leaf, before in zip(flat, jax.tree.leaves(got["params"]), jax.tree.leaves(params), strict=True):
        update = np.asarray(after, np.float64) - np.asarray(before, np.float64)
        err = np.max(np.abs(np.asarray(leaf, np.float64) - np.asarray(after, np.float64))) / np.max(np.abs(update))
        assert err <= 1e-4, f"{jax.tree_util.keystr(path)}: {err:.2e} of the update"


# --- what is refused ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, model, message",
    [
        (dict(), dict(attention_backend="cudnn"), "context_parallel_size=2 needs attention_backend='xla' or 'pallas'"),
        (dict(comm="all_gather"), dict(), "cp_comm_type='all_gather' with context_parallel_size=2 needs"),
        (dict(), dict(window_size=8), "window_size=8: a sliding window under context parallelism needs"),
    ],
)
def test_what_the_kernel_ring_refuses_names_its_values(fields, model, message):
    cfg = LLAMA.replace(**{"attention_backend": "pallas", **model})
    with pytest.raises(ConfigError, match=message):
        layout(2, **fields).check_model(cfg)
    layout(2).check_model(LLAMA.replace(attention_backend="pallas"))  # p2p, causal: accepted
    layout(2, "all_gather").check_model(LLAMA.replace(window_size=8))  # XLA keeps the window either way


def test_the_ring_is_static_and_hashable():
    """The custom VJP's non-differentiable argument."""
    ring = context.Ring(2, None, "pallas", True)
    assert hash(ring) == hash(dataclasses.replace(ring))
