"""The training step at p = 1 with several microbatches runs the executor's 1F1B table at p = 1
(`step.accumulation_schedule`): checked here against the independent single-device reference
(`train.reference.accumulate_gradients`, a scan of value_and_grad), hidden dropout included, in float64. Attention
dropout is drawn per tensor rank in the tensor-parallel model (Megatron's RNG tracker), so it has no single-device
twin; the p = 2 vs p = 1 dropout test in pipeline/test_executor.py covers it."""

import jax
import numpy as np
import pytest

from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.optimizer import make_optimizer
from ptd_jax.parallel import sharding
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.step import accumulation_schedule, init_sharded_state, make_parallel_train_step
from ptd_jax.train.reference import accumulate_gradients

B, S, M = 4, 8, 4


# Both under -m slow (about 30 s each): the table at p = 1 without dropout is exact in tests/parallel/test_tensor.py's
# float64 cases, and dropout through the executor's tables in pipeline/test_executor.py's ZB-V training step
@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_p1_microbatch_table_with_dropout_equals_the_reference(recompute):
    with jax.enable_x64(True):
        cfg = ModelConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            seq_length=S,
            vocab_size=97,
            hidden_dropout=0.2,
            dtype="float64",
            param_dtype="float64",
        )
        tcfg = TrainConfig(lr=1e-3, lr_warmup_iters=0, recompute_granularity=recompute)
        parallel = ParallelConfig(micro_batch_size=B // M, global_batch_size=B)
        assert accumulation_schedule(parallel).p == 1  # the table, not one value_and_grad
        opt = make_optimizer(tcfg)
        mesh = make_mesh(parallel)
        state = init_sharded_state(jax.random.key(0), cfg, opt, mesh, parallel)
        params = jax.device_get(state["params"])
        toks = np.asarray(jax.random.randint(jax.random.key(1), (B, S + 1), 0, 97))
        mask = np.ones((B, S), np.int32)
        mask[1, 2:5] = 0
        tokens, labels, mask = (x.reshape(M, B // M, S) for x in (toks[:, :-1], toks[:, 1:], mask))
        key = jax.random.key(7)
        step = make_parallel_train_step(mesh, cfg, parallel, tcfg, opt, state)
        _, metrics = step(state, tokens, labels, mask, key)
        # the step's stream: fold_in(fold_in(key, step 0), data rank 0), then per microbatch as the reference
        ref_key = jax.random.fold_in(jax.random.fold_in(key, 0), 0)
        ref_loss, ref_grads = accumulate_gradients(params, tokens, labels, mask, cfg, recompute=recompute, key=ref_key)
        ref_norm = float(
            sharding.global_norm(ref_grads, jax.tree.map(lambda _: jax.sharding.PartitionSpec(), ref_grads))
        )
        _, plain = accumulate_gradients(
            params, tokens, labels, mask, cfg.replace(hidden_dropout=0.0, attention_dropout=0.0)
        )
        assert float(metrics["lm_loss"]) == pytest.approx(float(ref_loss), rel=1e-12)
        assert float(metrics["grad_norm"]) == pytest.approx(ref_norm, rel=1e-12)
        assert (
            abs(
                ref_norm
                - float(sharding.global_norm(plain, jax.tree.map(lambda _: jax.sharding.PartitionSpec(), plain)))
            )
            > 1e-3
        )  # dropout did act
