"""The distributed optimizer (`ptd_jax/parallel/distributed_optimizer.py`): master weights and Adam moments split
over "data", gradients reduce-scattered; the loss trace of the plain optimizer, the same checkpoints."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.data import GPTData, microbatches
from ptd_jax.optimizer import make_optimizer
from ptd_jax.parallel.distributed_optimizer import data_dim, shard_spec
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.sharding import to_canonical
from ptd_jax.parallel.step import init_sharded_state, make_parallel_train_step
from ptd_jax.train import checkpoint

CFG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=257)
TRAIN = TrainConfig(train_iters=20, lr=3e-3, lr_warmup_iters=2)


def layout(d, p, t, distributed):
    return ParallelConfig(
        data_parallel_size=d,
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=t,
        micro_batch_size=1,
        global_batch_size=8,
        use_distributed_optimizer=distributed,
    )


def test_the_data_split_takes_the_outermost_free_dim_that_d_divides():
    assert data_dim(P(None, None, "tensor"), (4, 96, 8), 2) == 0  # a stack of layers: the layer dim
    assert data_dim(P(None, None, "tensor"), (3, 96, 8), 2) == 1  # 3 % 2 != 0
    assert data_dim(P(None, "tensor"), (6, 128), 4) is None  # 128 is split by tensor, 6 % 4 != 0
    assert data_dim(P(), (3,), 2) is None
    assert data_dim(P(), (2, 8), 4) == 1
    assert shard_spec(P(None, None, "pipe", None), (2, 8, 2, 32), 4) == P(None, "data", "pipe", None)
    assert shard_spec(P(), (32,), 1) == P()


def test_master_weights_and_moments_are_split_over_data():
    opt = make_optimizer(TRAIN)
    for distributed, fraction in [(False, 1.0), (True, 0.25)]:
        parallel = layout(4, 1, 2, distributed)
        state = init_sharded_state(jax.random.key(0), CFG, opt, make_mesh(parallel), parallel)
        for tree in (state["params"], state["opt_state"][0].mu, state["opt_state"][0].nu):
            local = sum(x.addressable_shards[0].data.size for x in jax.tree.leaves(tree))
            whole = sum(x.size / (2 if "tensor" in x.sharding.spec else 1) for x in jax.tree.leaves(tree))
            assert local / whole == pytest.approx(fraction, rel=0.02)  # tiny leaves (d ∤ any dim) stay whole


def loss_trace(corpus, parallel, n=20):
    opt = make_optimizer(TRAIN)
    mesh = make_mesh(parallel)
    state = init_sharded_state(jax.random.key(0), CFG, opt, mesh, parallel, train_cfg=TRAIN)
    step = make_parallel_train_step(mesh, CFG, parallel, TRAIN, opt, state)
    data = GPTData(corpus, seq_length=32, global_batch_size=8, eval_iters=0, seed=0)
    trace = []
    for i in range(n):
        state, metrics = step(state, *microbatches(data.train_batch(i), parallel), jax.random.key(1))
        trace.append((float(metrics["lm_loss"]), float(metrics["grad_norm"])))
    return np.array(trace)


# 20 iterations twice: -m slow; the default run checks one step exactly in float64 (pipeline/test_executor.py)
@pytest.mark.slow
@pytest.mark.parametrize("d, p, t", [(4, 1, 2), (2, 2, 2)])
def test_loss_trace_equals_the_plain_optimizer(small_corpus, d, p, t):
    """20 float32 iterations: loss and grad norm of the distributed optimizer equal the plain one's to 1e-5."""
    plain = loss_trace(small_corpus, layout(d, p, t, False))
    distributed = loss_trace(small_corpus, layout(d, p, t, True))
    assert plain[-1, 0] < plain[0, 0] - 0.5
    np.testing.assert_allclose(distributed, plain, rtol=1e-5)


@pytest.mark.parametrize("save_distributed", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_checkpoints_load_into_either_optimizer(tmp_path, save_distributed):
    """A state saved under one optimizer restores, array for array, under the other (the canonical form is
    unsharded)."""
    opt = make_optimizer(TRAIN)
    saved_layout, load_layout = layout(2, 2, 2, save_distributed), layout(2, 2, 2, not save_distributed)
    mesh = make_mesh(saved_layout)
    state = init_sharded_state(jax.random.key(0), CFG, opt, mesh, saved_layout)
    state = jax.tree.map(lambda x: x + 0.5 if x.dtype == np.float32 else x, state)  # moments not all zero
    with checkpoint.Checkpointer(
        tmp_path, optimizer=opt, model_cfg=CFG, parallel=saved_layout, async_save=False
    ) as saver:
        saver.save(3, state, {"note": "test"})
    like = init_sharded_state(jax.random.key(1), CFG, opt, mesh, load_layout, shapes_only=True)
    restored = checkpoint.restore(tmp_path, 3, like, optimizer=opt, model_cfg=CFG, parallel=load_layout, mesh=mesh)
    for tree in ("params", "opt_state"):
        for b, shape in zip(jax.tree.leaves(restored[tree]), jax.tree.leaves(like[tree]), strict=True):
            assert b.sharding == shape.sharding
    # the padded vocabulary rows (0.5 here) are not part of a checkpoint: compare the canonical forms
    canonical = [
        to_canonical(opt, jax.device_get(s), vocab_size=CFG.vocab_size, pipelined=True) for s in (state, restored)
    ]
    for a, b in zip(jax.tree.leaves(canonical[0]), jax.tree.leaves(canonical[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bytes_per_parameter_are_megatrons_with_microbatches_accumulated_in_place():
    """16-bit with the distributed optimizer and m = 4 microbatches holds Megatron's 6 + 12/d bytes per parameter
    (XLA's memory analysis of the compiled step, activations extrapolated out): each layer's gradient is added in
    place into the float32 accumulators. With the whole microbatch gradient beside them (a scan of value_and_grad)
    and the master shards split on an inner dim (a transposed copy after the all-gather) it held +27% here."""
    from experiments.bench.memory.bench_optimizer_memory import measure

    row = measure(
        "float16", 2, True, 4, model=dict(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=512)
    )
    assert row["state_bytes_per_param"] == pytest.approx(6.0, abs=0.01)  # 12/d: master weights and two moments
    assert abs(row["relative_error"]) < 0.10, row
