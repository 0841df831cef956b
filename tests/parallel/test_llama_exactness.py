"""The Llama switches (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied output, no biases) through every
parallel path, float64, loss and every gradient against the single-device reference: tensor + sequence
parallelism, interleaved 1F1B, a zero-bubble schedule, the distributed optimizer, and each recompute policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig, ParallelConfig, TrainConfig
from ptd_jax.optimizer import make_optimizer, new_state
from ptd_jax.parallel import sharding
from ptd_jax.parallel.mesh import make_mesh
from ptd_jax.parallel.step import make_parallel_grad_step, make_parallel_train_step, state_specs
from ptd_jax.train.reference import accumulate_gradients, make_train_step
from ptd_jax.presets import LLAMA_SWITCHES
from tests.helpers.exactness import assert_equals_reference

B, S = 8, 16


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


LLAMA = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=8,
    num_query_groups=2,
    kv_channels=8,
    ffn_hidden_size=48,
    seq_length=S,
    vocab_size=257,
    use_rope_scaling=True,
    rope_original_max_position=8,  # short enough that the scaling changes some of this model's frequencies
    **LLAMA_SWITCHES,
    dtype="float64",
    param_dtype="float64",
)


def layout(d, p, t, schedule="1f1b", v=1, **fields) -> ParallelConfig:
    return ParallelConfig(
        data_parallel_size=d,
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=t,
        virtual_pipeline_stages=v,
        pipeline_schedule=schedule,
        micro_batch_size=1,
        global_batch_size=B,
        **fields,
    )


def batch(m):
    toks = np.asarray(jax.random.randint(jax.random.key(1), (B, S + 1), 0, 257))
    mask = np.ones((B, S), np.int32)
    mask[2, 3:9] = 0
    return [x.reshape(m, B // m, S) for x in (toks[:, :-1], toks[:, 1:], mask)]


def compare(parallel, cfg=LLAMA, recompute="none", rtol=1e-11):
    params = gpt.init_params(jax.random.key(0), cfg, tensor_parallel_size=parallel.tensor_model_parallel_size)
    m = parallel.num_microbatches * parallel.data_parallel_size
    reference = jax.jit(accumulate_gradients, static_argnums=4, static_argnames="recompute")(
        params, *batch(m), cfg, recompute=recompute
    )
    mesh = make_mesh(parallel)
    placed, specs = sharding.place_params(params, parallel, mesh)
    step = make_parallel_grad_step(mesh, cfg, parallel, specs, recompute=recompute)
    loss, grads, norm = step(placed, *batch(parallel.num_microbatches))
    assert_equals_reference((loss, sharding.reference_layout(grads, parallel), norm), reference, rtol)


def test_the_llama_config_has_every_switch():
    params = gpt.init_params(jax.random.key(0), LLAMA)
    attn, mlp = params["layers"]["attn"], params["layers"]["mlp"]
    assert set(params) == {"embed", "layers", "final_ln", "output"} and set(params["embed"]) == {"word"}
    assert attn["qkv_kernel"].shape == (4, 32, 2, 4 + 2, 8) and set(attn) == {"qkv_kernel", "out_kernel"}
    assert mlp["fc1_kernel"].shape == (4, 32, 2, 48) and set(params["final_ln"]) == {"scale"}
    assert gpt.rotary_frequencies(LLAMA)[-1] < LLAMA.rotary_base ** (-6 / 8)  # scaled down at long wavelengths


# The default run: the switches under tensor + sequence parallelism and in a pipeline (interleaved, t = 2); each
# schedule, recompute policy and the distributed optimizer with the GPT-2 switches in pipeline/test_executor.py; the
# other layouts here, each recompute policy and the distributed optimizer with the Llama switches: -m slow.
@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param(layout(1, 1, 2, sequence_parallel=True), id="t2-sp"),
        pytest.param(layout(1, 2, 2, "interleaved", 2), id="p2t2-interleaved"),
        pytest.param(layout(1, 2, 1, "zb-v", 2), id="p2-zb-v", marks=pytest.mark.slow),
        pytest.param(layout(2, 2, 2, "zb-h1", sequence_parallel=True), id="d2p2t2-zb-h1-sp", marks=pytest.mark.slow),
    ],
)
def test_llama_equals_the_reference(parallel):
    compare(parallel)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_llama_recompute_equals_the_reference(recompute):
    compare(layout(1, 2, 2, "1f1b"), recompute=recompute)


@pytest.mark.slow  # 34 s; Qwen2's and Mistral's logits against transformers' run by default (tests/interop/)
def test_qwen2_qkv_bias_and_mistral_window_equal_the_reference():
    """Qwen2's biases on the QKV projection only; Mistral's sliding window (shorter than the sequence) with a head
    dim of its own and the interleaved (Meta) rotation."""
    qwen = LLAMA.replace(add_qkv_bias=True, use_rope_scaling=False, untie_embeddings_and_output_weights=False)
    params = gpt.init_params(jax.random.key(0), qwen)
    assert set(params["layers"]["attn"]) == {"qkv_kernel", "qkv_bias", "out_kernel"}
    compare(layout(1, 1, 2, sequence_parallel=True), qwen)
    mistral = LLAMA.replace(window_size=5, kv_channels=12, rotary_interleaved=True, use_rope_scaling=False)
    compare(layout(1, 2, 2, "interleaved", 2), mistral)


def test_a_sliding_window_changes_the_loss():
    """The window is applied (a test above that ignored it would still pass against a reference that ignores it)."""
    params = gpt.init_params(jax.random.key(0), LLAMA)
    tokens, labels, mask = (x[0] for x in batch(1))
    full = float(gpt.loss_sum(params, tokens, labels, mask, LLAMA))
    windowed = float(gpt.loss_sum(params, tokens, labels, mask, LLAMA.replace(window_size=4)))
    whole = float(gpt.loss_sum(params, tokens, labels, mask, LLAMA.replace(window_size=S)))
    assert windowed != pytest.approx(full, rel=1e-6) and whole == pytest.approx(full, rel=1e-12)


@pytest.mark.slow
def test_llama_distributed_optimizer_step_equals_the_reference_step():
    """One AdamW step under the distributed optimizer (d = 2, t = 2, p = 2, ZB-H1) against the reference step."""
    parallel = layout(2, 2, 2, "zb-h1", use_distributed_optimizer=True)
    train_cfg = TrainConfig(train_iters=4, lr=1e-3, lr_warmup_iters=0)
    optimizer = make_optimizer(train_cfg)
    params = gpt.init_params(jax.random.key(0), LLAMA, tensor_parallel_size=2)
    reference = new_state(jax.tree.map(jnp.copy, params), optimizer)  # the steps donate their state
    want, _ = make_train_step(LLAMA, train_cfg, optimizer)(reference, *batch(parallel.num_microbatches * 2), None)
    mesh = make_mesh(parallel)
    init = sharding.place_params(params, parallel, mesh)[0]
    abstract = jax.eval_shape(lambda: new_state(init, optimizer))
    specs = state_specs(optimizer, abstract, parallel, pipelined=True)
    laid = jax.jit(lambda p: new_state(p, optimizer), out_shardings=sharding.named(mesh, specs))(init)
    step = make_parallel_train_step(mesh, LLAMA, parallel, train_cfg, optimizer, laid)
    got, _ = step(laid, *batch(parallel.num_microbatches), jax.random.key(0))
    got_params = sharding.reference_layout(got["params"], parallel)
    for path, a in jax.tree_util.tree_leaves_with_path(want["params"]):
        b = got_params
        for k in path:
            b = b[k.key]
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-9, atol=1e-12, err_msg=str(path))
