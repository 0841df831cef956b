"""Context parallelism (`parallel/context.py`): the load-balanced layout, and float64 loss and every gradient of p2p
(ring) and all_gather attention against the single-device reference, with grouped-query attention (a Llama config)
and GPT-2's, composed with TP + SP, interleaved pipelining, the distributed optimizer and each recompute policy; a
context rank whose tokens are all masked; the layout's rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ptd_jax import model as gpt
from ptd_jax.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.optimizer import make_optimizer, new_state
from ptd_jax.parallel import context, sharding
from ptd_jax.parallel.mesh import CONTEXT_MESH_AXES, MESH_AXES, make_mesh
from ptd_jax.parallel.step import make_parallel_grad_step, make_parallel_train_step, state_specs
from ptd_jax.train.reference import accumulate_gradients, make_train_step
from ptd_jax.cli.train import main
from ptd_jax.presets import LLAMA_SWITCHES
from tests.helpers.cli import exit_code
from tests.helpers.exactness import assert_equals_reference

B, S = 4, 32


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


LLAMA = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=8,
    ffn_hidden_size=48,
    seq_length=S,
    vocab_size=257,
    **LLAMA_SWITCHES,
    dtype="float64",
    param_dtype="float64",
)
GPT2 = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=S, vocab_size=257, dtype="float64",
    param_dtype="float64",
)  # fmt: skip


def layout(c, comm="p2p", d=1, p=1, t=1, **fields) -> ParallelConfig:
    return ParallelConfig(
        data_parallel_size=d,
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=t,
        context_parallel_size=c,
        cp_comm_type=comm,
        micro_batch_size=1,
        global_batch_size=B,
        **fields,
    )


def batch(m, masked=None):
    """[m, B/m, S] tokens, labels and a loss mask with a hole; `masked`: positions masked in every row."""
    toks = np.asarray(jax.random.randint(jax.random.key(1), (B, S + 1), 0, 257))
    mask = np.ones((B, S), np.int32)
    mask[1, 3:20] = 0
    if masked is not None:
        mask[:, masked] = 0
    return [x.reshape(m, B // m, S) for x in (toks[:, :-1], toks[:, 1:], mask)]


def compare(parallel, cfg=LLAMA, recompute="none", masked=None, rtol=1e-11):
    params = gpt.init_params(jax.random.key(0), cfg, tensor_parallel_size=parallel.tensor_model_parallel_size)
    m = parallel.num_microbatches * parallel.data_parallel_size
    reference = jax.jit(accumulate_gradients, static_argnums=4, static_argnames="recompute")(
        params, *batch(m, masked), cfg, recompute=recompute
    )
    mesh = make_mesh(parallel)
    placed, specs = sharding.place_params(params, parallel, mesh)
    step = make_parallel_grad_step(mesh, cfg, parallel, specs, recompute=recompute)
    loss, grads, norm = step(placed, *batch(parallel.num_microbatches, masked))
    assert np.isfinite(float(loss)) and np.isfinite(float(norm))
    assert_equals_reference((loss, sharding.reference_layout(grads, parallel), norm), reference, rtol)


# --- the layout ---------------------------------------------------------------------------------------------------


def test_rank_r_holds_chunks_r_and_2c_minus_1_minus_r():
    order = context.load_balanced_order(16, 4)  # chunks of 2
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert (order[context.restore_order(16, 4)] == np.arange(16)).all()
    for r in range(4):
        assert jnp.array_equal(context.chunk_positions(r, 4, 4), order[4 * r : 4 * r + 4])
    with pytest.raises(ValueError, match="multiple of 2"):
        context.load_balanced_order(12, 4)


@pytest.mark.parametrize("c", [2, 4, 8])
def test_every_rank_has_the_same_causal_work(c):
    """The point of the layout: under a causal mask each rank's queries see the same number of keys (a contiguous
    split would give the last rank 2c − 1 times the first one's)."""
    n = 8 * c
    order = context.load_balanced_order(n, c).reshape(c, -1)
    work = [int((np.arange(n)[None, :] <= q[:, None]).sum()) for q in order]
    assert len(set(work)) == 1


def test_the_context_axis_sits_between_pipe_and_tensor_and_only_when_c_exceeds_1():
    assert make_mesh(layout(1)).axis_names == MESH_AXES
    mesh = make_mesh(layout(2, d=2, t=2))
    assert mesh.axis_names == CONTEXT_MESH_AXES == ("data", "pipe", "context", "tensor")
    assert [d.id for d in mesh.devices[0, 0].ravel()] == [0, 1, 2, 3]  # a context group's devices are neighbours
    assert layout(2, d=2, t=2).num_devices == 8
    assert ParallelConfig.for_devices(8, context_parallel_size=2, tensor_model_parallel_size=2).data_parallel_size == 2


def test_gather_sequence_restores_the_natural_order():
    c = 4
    mesh = make_mesh(layout(c))
    x = jnp.arange(2 * S).reshape(2, S)

    def body(x):
        return context.gather_sequence(context.split_sequence(x[None], c)[0], c)

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))(x)
    assert jnp.array_equal(got, x)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(context_parallel_size=3), "seq_length=32 is not divisible by 2 x context_parallel_size=3"),
        (dict(context_parallel_size=2, cp_comm_type="a2a"), "cp_comm_type='a2a' is not one of"),
        (
            dict(context_parallel_size=2, tensor_model_parallel_size=4, sequence_parallel=True, seq_length=36),
            "seq_length=36 / context_parallel_size=2 is not divisible by tensor_model_parallel_size=4",
        ),
    ],
)
def test_bad_layouts_name_their_values(fields, message):
    cfg = GPT2.replace(seq_length=fields.pop("seq_length", S))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        ParallelConfig(global_batch_size=B, **fields).check_model(cfg)


def test_cudnn_and_the_ring_with_dropout_are_refused():
    """cuDNN's attention returns no log-sum-exp to merge (the Pallas kernel's ring: tests/parallel/
    test_context_flash.py)."""
    with pytest.raises(ConfigError, match="needs attention_backend='xla' or 'pallas', got 'cudnn'"):
        layout(2).check_model(GPT2.replace(attention_backend="cudnn", dtype="float32", param_dtype="float32"))
    with pytest.raises(ConfigError, match="needs cp_comm_type='all_gather'"):
        layout(2).check_model(GPT2.replace(attention_dropout=0.1))
    layout(2, "all_gather").check_model(GPT2.replace(attention_dropout=0.1))
    with pytest.raises(ConfigError, match="context_parallel_size=3 does not divide num_devices=8"):
        ParallelConfig.for_devices(8, context_parallel_size=3)


# --- exactness ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parallel, cfg",
    [
        pytest.param(layout(2, "p2p"), LLAMA, id="c2-p2p-llama"),
        pytest.param(layout(2, "all_gather", d=2), GPT2, id="d2c2-all_gather-gpt2"),
    ],
)
def test_context_parallel_equals_the_reference(parallel, cfg):
    compare(parallel, cfg)


def test_a_context_rank_with_every_token_masked_gives_no_nan():
    """Rank 0 of c = 2 holds chunks 0 and 3 (positions 0-7 and 24-31): all masked, in every row (Megatron #1764)."""
    compare(layout(2, "p2p"), masked=np.r_[0:8, 24:32])


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
@pytest.mark.parametrize("c", [2, 4])
def test_every_comm_type_and_c_equal_the_reference(c, comm, cfg):
    compare(layout(c, comm, d=8 // (2 * c)), cfg)


INTERLEAVED = dict(p=2, pipeline_schedule="interleaved", virtual_pipeline_stages=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "comm, fields",
    [
        pytest.param("p2p", dict(t=2, sequence_parallel=True), id="t2-sp-p2p"),
        pytest.param("all_gather", dict(t=2, sequence_parallel=True), id="t2-sp-all_gather"),
        pytest.param("p2p", INTERLEAVED, id="p2-interleaved-p2p"),
        pytest.param("all_gather", dict(p=2, t=2, pipeline_schedule="zb-v", virtual_pipeline_stages=2), id="zb-v"),
        pytest.param("all_gather", dict(p=2, pipeline_schedule="1f1b"), id="p2-1f1b-all_gather"),
    ],
)
def test_context_composes_with_tensor_and_pipeline_parallelism(comm, fields):
    compare(layout(2, comm, **fields), LLAMA.replace(num_layers=4))


def test_the_ring_refuses_pipe_divergent_branches():
    """p2p's collective-permute over context gave wrong gradients inside the per-rank pipeline's branches (XLA:CPU,
    p = 2, 1F1B: relative errors of order 1): refused; "auto" runs lockstep tables uniform."""
    with pytest.raises(ConfigError, match="cp_comm_type='p2p' with pipeline_model_parallel_size=2 needs a lockstep"):
        layout(2, "p2p", p=2, pipeline_schedule="1f1b")
    with pytest.raises(ConfigError, match="pipeline_branching='per-rank'"):
        layout(2, "p2p", **INTERLEAVED, pipeline_branching="per-rank")
    layout(2, "all_gather", p=2, pipeline_schedule="zb-v", virtual_pipeline_stages=2)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_context_under_each_recompute_policy(recompute):
    compare(layout(2, "p2p", p=2, pipeline_schedule="1f1b-lockstep"), recompute=recompute)


@pytest.mark.slow
@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_a_sliding_window_across_context_ranks(comm):
    """A window shorter than a chunk: whole key chunks fall outside it and are skipped (p2p) or masked."""
    compare(layout(4, comm), LLAMA.replace(window_size=3))


@pytest.mark.slow
def test_the_distributed_optimizer_step_equals_the_reference_step():
    """One AdamW step, d = 2 × c = 2 × t = 2, the distributed optimizer: the parameters after it."""
    parallel = layout(2, "p2p", d=2, t=2, use_distributed_optimizer=True)
    train_cfg = TrainConfig(train_iters=4, lr=1e-3, lr_warmup_iters=0)
    optimizer = make_optimizer(train_cfg)
    params = gpt.init_params(jax.random.key(0), LLAMA, tensor_parallel_size=2)
    reference = new_state(jax.tree.map(jnp.copy, params), optimizer)
    want, _ = make_train_step(LLAMA, train_cfg, optimizer)(reference, *batch(parallel.num_microbatches * 2), None)
    mesh = make_mesh(parallel)
    init = sharding.place_params(params, parallel, mesh)[0]
    abstract = jax.eval_shape(lambda: new_state(init, optimizer))
    specs = state_specs(optimizer, abstract, parallel, pipelined=False)
    laid = jax.jit(lambda p: new_state(p, optimizer), out_shardings=sharding.named(mesh, specs))(init)
    step = make_parallel_train_step(mesh, LLAMA, parallel, train_cfg, optimizer, laid)
    got, _ = step(laid, *batch(parallel.num_microbatches), jax.random.key(0))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want["params"]), jax.tree.leaves(got["params"])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-9, atol=1e-12, err_msg=str(path))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--context-parallel-size", "3"], "context_parallel_size=3 does not divide num_devices=8"),
        (["--context-parallel-size", "2", "--seq-length", "34"], "seq_length=34 is not divisible by 2 x"),
        (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], "invalid choice: 'a2a'"),
        pytest.param(
            ["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--attention-backend", "pallas"],
            "needs attention_backend='xla', got 'pallas'",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "2"],
            "needs a lockstep schedule",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_ptd_train_refuses_bad_context_layouts_with_one_line(args, message, capsys):
    tiny = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32"]
    tiny += ["--tensor-model-parallel-size", "1", "--train-iters", "1"]  # no demo layout; nothing long if accepted
    assert exit_code(main, [*tiny, "--global-batch-size", "8", "--micro-batch-size", "1", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
