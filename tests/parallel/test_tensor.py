"""Tensor, sequence and data parallelism against the single-device reference (loss, every gradient, grad norm)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.optimizer import make_optimizer
from ptd_jax.parallel import sharding
from ptd_jax.analysis.collectives import jaxpr_collectives, summarize
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.step import init_sharded_state, make_parallel_grad_step, make_parallel_train_step
from ptd_jax.train.reference import accumulate_gradients
from tests.helpers.exactness import assert_equals_reference

# 8 heads and ffn 128 split evenly up to t = 8; seq 16 splits for sequence parallelism up to t = 8.
CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=8, seq_length=16, vocab_size=257)
B, S, M = 16, 16, 2
LAYOUTS = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (4, 2), (8, 1)]  # (d, t)


def batch(seed=1):
    toks = np.asarray(jax.random.randint(jax.random.key(seed), (B, S + 1), 0, 257))
    mask = np.ones((B, S), np.int32)
    mask[3, :5] = 0  # uneven masks: the mean must still be over the global token count
    return [x.reshape(M, B // M, S) for x in (toks[:, :-1], toks[:, 1:], mask)]


def layout(d, t, sp=False):
    return ParallelConfig(
        data_parallel_size=d,
        tensor_model_parallel_size=t,
        micro_batch_size=B // M // d,
        global_batch_size=B,
        sequence_parallel=sp,
    )


def compare(d, t, sp, cfg, rtol):
    params = gpt.init_params(jax.random.key(0), cfg, tensor_parallel_size=t)
    tokens, labels, mask = batch()
    reference = jax.jit(accumulate_gradients, static_argnums=4)(params, tokens, labels, mask, cfg)
    parallel = layout(d, t, sp)
    mesh = make_mesh(parallel)
    placed, specs = sharding.place_params(params, parallel, mesh)
    step = make_parallel_grad_step(mesh, cfg, parallel, specs)
    assert_equals_reference(step(placed, tokens, labels, mask), reference, rtol)


# The default run: (d, t) = (2, 4) with and without sequence parallelism (tensor and data parallelism together; every
# t runs the same tensor-parallel code); -m slow: every layout of LAYOUTS.
FLOAT64_DEFAULT = {(2, 4, False), (2, 4, True)}


@pytest.mark.parametrize(
    "d, t, sp",
    [
        pytest.param(
            d,
            t,
            sp,
            id=f"d{d}t{t}-{'tp+sp' if sp else 'tp'}",
            marks=[pytest.mark.slow] * ((d, t, sp) not in FLOAT64_DEFAULT),
        )
        for sp in (False, True)
        for d, t in LAYOUTS
    ],
)
def test_float64_loss_and_gradients_equal_the_reference(d, t, sp):
    with jax.enable_x64(True):
        compare(d, t, sp, CFG.replace(dtype="float64", param_dtype="float64"), rtol=1e-12)


@pytest.mark.slow  # 22 s; the default run checks the arithmetic exactly in float64 above
@pytest.mark.parametrize("d, t, sp", [(2, 4, False), (1, 8, True), (4, 2, True)])
def test_float32_loss_and_gradients_within_roundoff(d, t, sp):
    """float32 changes only the order of sums (t partial products per all-reduce, d partial gradients): errors
    of a few ulps (1e-7) grown by sqrt of the number of terms stay below 1e-5 here; 2e-5 still catches any
    missing or doubled term, which shows up at 1e-2 or more."""
    compare(d, t, sp, CFG, rtol=2e-5)


def test_sharded_init_equals_serial_init():
    opt = make_optimizer(TrainConfig())
    parallel = layout(2, 4)
    state = init_sharded_state(jax.random.key(3), CFG, opt, make_mesh(parallel))
    serial = jax.jit(gpt.init_params, static_argnums=(1, 2))(jax.random.key(3), CFG, 4)
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(serial)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    word = state["params"]["embed"]["word"]
    assert word.sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    assert [s.data.shape for s in word.addressable_shards][0] == (512 // 4, 32)
    serial_t1 = jax.jit(gpt.init_params, static_argnums=(1, 2))(jax.random.key(3), CFG, 1)  # real rows of t = 1
    np.testing.assert_array_equal(np.asarray(word[:257]), np.asarray(serial_t1["embed"]["word"][:257]))


# --- collectives: the exact set the paper names, per step -------------------------------------------------------

NUM_LEAVES, REPLICATED_LEAVES = 16, 9  # 7 leaves split over tensor (TENSOR_SPLIT_DIM), 9 replicated


def step_collectives(d, t, sp, recompute="none", L=2, m=2):
    cfg = CFG.replace(num_layers=L)
    parallel = ParallelConfig(
        data_parallel_size=d,
        tensor_model_parallel_size=t,
        micro_batch_size=1,
        global_batch_size=m * d,
        sequence_parallel=sp,
    )
    tcfg = TrainConfig(recompute_granularity=recompute)
    opt = make_optimizer(tcfg)
    mesh = make_mesh(parallel)
    state = jax.eval_shape(lambda k: init_sharded_state(k, cfg, opt, mesh), jax.random.key(0))
    step = make_parallel_train_step(mesh, cfg, parallel, tcfg, opt, state)
    x = jax.ShapeDtypeStruct((m, d, S), jnp.int32)
    counts = summarize(jaxpr_collectives(jax.make_jaxpr(step)(state, x, x, x, jax.random.key(0))))
    return {k: v["count"] for k, v in counts.items()}


@pytest.mark.parametrize("L, m, recompute", [(2, 2, "none"), (3, 4, "none"), (2, 3, "full")])
def test_tensor_parallel_collectives_are_exactly_megatrons(L, m, recompute):
    """Per microbatch: 2 all-reduces per layer forward (g after attention and MLP) and 2 backward (f before QKV
    and fc1); 1 for the embedding, 1 backward into the tied output layer, and 3 for the vocab-parallel
    cross-entropy (max, sum-exp, target). Full recomputation adds 1 per layer, not Megatron's 2: the backward of a
    layer needs the attention output (input of LN2) but never the layer's own output, so autodiff drops the
    recomputed MLP all-reduce as dead code. Per step: one scalar all-reduce for the grad norm and one
    data-parallel all-reduce per gradient leaf (+ token count and loss)."""
    per_layer = 4 + (1 if recompute == "full" else 0)
    assert step_collectives(2, 4, False, recompute, L, m) == {
        "psum_invariant@tensor": m * (per_layer * L + 1 + 1 + 2) + 1,
        "pmax@tensor": m,
        "psum_invariant@data": NUM_LEAVES + 2,
    }


def test_sequence_parallel_collectives():
    """All-reduces become all-gather + reduce-scatter pairs; replicated weights' gradients are partial sums over
    the sequence shards and over data ranks, reduced once per step by one all-reduce over both axes per leaf. The
    backward issues each layer's two forward all-gathers again (the LayerNorm outputs are kept as 1/t shards, as
    in Megatron: `model.REGATHERED_PRIMITIVES`)."""
    L, m = 2, 2
    assert step_collectives(2, 4, True, "none", L, m) == {
        # layers fwd, final LN -> logits, layers bwd (the reduce-scatters' transposes and the re-issued
        # all-gathers), embed bwd
        "all_gather@tensor": m * (2 * L + 1 + 2 * L + 2 * L + 1),
        "reduce_scatter@tensor": m * (2 * L + 1 + 2 * L + 1),  # layers fwd, embedding, layers bwd, logits bwd
        "psum_invariant@tensor": m * 2 + 1,  # cross-entropy sums, grad norm
        "pmax@tensor": m,
        "psum_invariant@data": NUM_LEAVES - REPLICATED_LEAVES + 2,
        "psum_invariant@data,tensor": REPLICATED_LEAVES,
    }


def test_data_parallel_only_reduces_once_per_step():
    counts = step_collectives(8, 1, False, "none", 2, 4)
    assert counts["psum_invariant@data"] == NUM_LEAVES + 2  # not once per microbatch


# --- end to end: ptd-train traces ----------------------------------------------------------------------------


@pytest.mark.slow  # 20 iterations twice; the default run checks one step exactly in float64 and ptd-train end to end
def test_ptd_train_trace_at_d2_t4_matches_the_single_device_reference(small_corpus, tmp_path):
    """20 float32 iterations through the CLI at (d, t) = (2, 4) on 8 devices vs the reference step on one."""
    from ptd_jax.cli.train import run
    from ptd_jax.train import RunOptions, train

    flags = [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "32",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        "20",
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "2",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--data-path",
        small_corpus,
        "--no-progress",
    ]
    run([*flags, "--tensor-model-parallel-size", "4", "--metrics-file", str(tmp_path / "tp.jsonl")])
    model_cfg = CFG.replace(seq_length=32)
    train(
        model_cfg,
        ParallelConfig(micro_batch_size=4, global_batch_size=8),
        TrainConfig(train_iters=20, lr=3e-3, min_lr=2e-4, lr_warmup_iters=2, log_interval=1, eval_iters=0),
        RunOptions(
            data_path=small_corpus, progress=False, reference_step=True, metrics_file=str(tmp_path / "ref.jsonl")
        ),
    )
    tp = [json.loads(line)["lm_loss"] for line in (tmp_path / "tp.jsonl").read_text().splitlines()]
    ref = [json.loads(line)["lm_loss"] for line in (tmp_path / "ref.jsonl").read_text().splitlines()]
    assert len(tp) == len(ref) == 20
    assert ref[-1] < ref[0] - 1.0
    np.testing.assert_allclose(tp, ref, rtol=1e-5)


@pytest.mark.parametrize("backend", ["pallas+fused", "xla"])
def test_sequence_parallel_stashes_one_tth_of_a_layer(backend):
    """What a layer's vjp keeps for the pipeline stash (`stash.Residuals`, weights excluded) under none and
    selective: with sequence parallelism exactly 1/t of the unsplit t = 1 layer's at t = 2 and 4, the LayerNorm
    outputs kept as sequence shards and all-gathered again in the backward (Megatron's arrangement). Before, the
    all-gathered [B, S, D] LayerNorm outputs were kept whole: 9 s b h bytes at t = 4 against 24/4 = 6."""
    from experiments.bench.memory.sp_stash import MODEL, layer_stash

    model = MODEL if backend == "pallas+fused" else {**MODEL, "attention_backend": "xla", "fused_kernels": False}
    for recompute in ("none", "selective"):
        whole = layer_stash(1, False, recompute, model)["units"]
        for t in (2, 4):
            got = layer_stash(t, True, recompute, model)
            assert got["units"] == pytest.approx(whole / t, rel=1e-12), (recompute, t, got["leaves"])


@pytest.mark.parametrize("name", ["qkv", "out", "fc1", "fc2", "swiglu_fc1"])
def test_a_ws_kernel_gradient_is_the_transpose_of_its_matmul(name):
    """`tap_weight_grad` writes the kernel's gradient as an einsum of the matmul's input and output gradient; it must
    be the transpose of the forward einsum (a wrong index order in the written-out spec fails here)."""
    from ptd_jax.parallel.tensor import DOTS, SWIGLU_FC1, spec_operands, tap_weight_grad

    spec = SWIGLU_FC1 if name == "swiglu_fc1" else DOTS[name]
    sizes = dict(b=2, s=3, d=4, g=2, r=3, k=5, h=6, f=7, t=2)
    keys = iter(jax.random.split(jax.random.key(0), 3))
    x_spec, kernel_spec, out_spec = spec_operands(spec)
    x, kernel, g = (jax.random.normal(next(keys), [sizes[c] for c in sp]) for sp in (x_spec, kernel_spec, out_spec))
    expected = jax.linear_transpose(lambda w: jnp.einsum(spec, x, w), kernel)(g)[0]
    got = tap_weight_grad(name.removeprefix("swiglu_"), {"x": x, "g": g}, kernel)
    assert got.shape == kernel.shape
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_ws_kernel_gradient_sums_over_the_axes_x_varies_over_and_the_kernel_does_not():
    """Inside shard_map with x split over "data" and the kernel replicated, the gradient is summed over "data" as the
    transpose of the forward einsum sums it (typed invariant there), in bf16 as in float32."""
    from jax.sharding import Mesh, PartitionSpec as P

    from ptd_jax.parallel.tensor import DOTS, tap_weight_grad
    from ptd_jax.parallel.vma import varying_axes

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    keys = jax.random.split(jax.random.key(1), 3)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(keys[0], (4, 3, 8), dtype)
        g = jax.random.normal(keys[1], (4, 3, 16), dtype)
        kernel = jax.random.normal(keys[2], (8, 16), dtype)

        def both(x, g, kernel):
            expected = jax.linear_transpose(lambda w: jnp.einsum(DOTS["fc1"], x, w), kernel)(g)[0]
            got = tap_weight_grad("fc1", {"x": x, "g": g}, kernel)
            assert varying_axes(got) == varying_axes(expected) == frozenset()
            assert got.dtype == expected.dtype == kernel.dtype
            return got, expected

        spec = P("data")
        got, expected = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(spec, spec, P()), out_specs=(P(), P())))(
            x, g, kernel
        )
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=1e-5, atol=1e-5)
        whole = np.einsum("bsd,bsf->df", np.asarray(x, np.float32), np.asarray(g, np.float32))
        tolerance = dict(rtol=2e-2, atol=5e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.asarray(got, np.float32), whole, **tolerance)  # a missing sum is off by ~1
