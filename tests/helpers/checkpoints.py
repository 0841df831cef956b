"""The model, layouts and random training states the checkpoint tests save and restore (tests/train/
test_checkpoint.py, tests/runtime/test_multiprocess.py)."""

import jax

from ptd_jax.config import ModelConfig, ParallelConfig
from ptd_jax.parallel import sharding
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.step import init_sharded_state

MODEL = ModelConfig(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=257)
"""Eight layers: every (p, v) of the tests divides them."""


def layout(d, p, t, v, B=8) -> ParallelConfig:
    """(d, p, t) with v chunks a rank: interleaved when v > 1, 1F1B otherwise; one row a microbatch."""
    return ParallelConfig(
        data_parallel_size=d,
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=t,
        virtual_pipeline_stages=v,
        pipeline_schedule="interleaved" if v > 1 else "1f1b",
        micro_batch_size=1,
        global_batch_size=B,
    )


def random_state(parallel, optimizer, seed=0):
    """(state, mesh): a state of MODEL under `parallel` whose every leaf (moments included) holds distinct values;
    padded vocabulary rows stay zero."""
    mesh = make_mesh(parallel)
    state = init_sharded_state(jax.random.key(seed), MODEL, optimizer, mesh, parallel)
    canonical = sharding.to_canonical(optimizer, state, MODEL.vocab_size, parallel.pipeline_model_parallel_size > 1)
    leaves, tree = jax.tree.flatten(canonical)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [x + jax.random.normal(k, x.shape, x.dtype) if x.ndim else x for x, k in zip(leaves, keys)]
    noisy = jax.tree.unflatten(tree, noisy)
    padded = MODEL.padded_vocab_size(parallel.tensor_model_parallel_size)
    back = sharding.from_canonical(
        optimizer, noisy, padded, parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_stages
    )
    shardings = jax.tree.map(lambda x: x.sharding, {"params": state["params"], "opt_state": state["opt_state"]})
    back = jax.device_put(back, shardings)
    return {**back, "step": state["step"]}, mesh
