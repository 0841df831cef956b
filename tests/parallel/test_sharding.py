"""The params' layouts (`parallel/sharding.py`): `layout_params` stages the reference layers [L, ...] as the
schedule stores them (round-robin, or ZB-V's V) and `reference_layout` undoes it; `place_params` puts them on the
mesh with their specs, arrays and ShapeDtypeStructs alike; `v_shaped` says which schedules store the V."""

import jax
import numpy as np
import pytest

from ptd_jax import model as gpt
from ptd_jax.config import ModelConfig, ParallelConfig
from ptd_jax.parallel import sharding
from ptd_jax.parallel.mesh import make_mesh

CFG = ModelConfig(num_layers=8, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=257)


def layout(p, t=1, v=1, schedule="1f1b"):
    return ParallelConfig(
        pipeline_model_parallel_size=p,
        tensor_model_parallel_size=t,
        virtual_pipeline_stages=v,
        pipeline_schedule=schedule,
        micro_batch_size=1,
        global_batch_size=8,
    )


LAYOUTS = {
    "p1t2": layout(1, 2),
    "p2t2-1f1b": layout(2, 2),
    "p4-interleaved": layout(4, 1, 2, "interleaved"),
    "p2t2-zb-v": layout(2, 2, 2, "zb-v"),
    "p4-zb-v": layout(4, 1, 2, "zb-v"),
}


def numbered_layers(num_layers=CFG.num_layers):
    """A params tree whose every layer leaf holds its layer's index (and the layer's position inside the leaf)."""
    params = gpt.init_params(jax.random.key(0), CFG)
    return {
        **params,
        "layers": jax.tree.map(
            lambda x: np.arange(num_layers).reshape(-1, *[1] * (x.ndim - 1)) * 1000 + np.zeros(x.shape),
            params["layers"],
        ),
    }


def test_v_shaped_is_zb_v_when_pipelined():
    assert sharding.v_shaped(LAYOUTS["p4-zb-v"]) and sharding.v_shaped(LAYOUTS["p2t2-zb-v"])
    assert not any(sharding.v_shaped(LAYOUTS[name]) for name in ("p1t2", "p2t2-1f1b", "p4-interleaved"))


@pytest.mark.parametrize("name", LAYOUTS)
def test_reference_layout_undoes_layout_params(name):
    parallel = LAYOUTS[name]
    params = gpt.init_params(jax.random.key(0), CFG, tensor_parallel_size=parallel.tensor_model_parallel_size)
    laid = sharding.layout_params(params, parallel)
    p, v = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_stages
    if p > 1:
        assert laid["layers"]["attn"]["qkv_kernel"].shape[:3] == (v, p, CFG.num_layers // (p * v))
    else:
        assert laid is params
    jax.tree.map(np.testing.assert_array_equal, sharding.reference_layout(laid, parallel), params)


@pytest.mark.parametrize("name, stage_of", [("p4-interleaved", lambda c, r, p: c * p + r), ("p4-zb-v", None)])
def test_chunk_c_of_rank_r_holds_its_virtual_stage(name, stage_of):
    """Round-robin: chunk c of rank r is virtual stage c·p + r (the paper's §2.2.2). ZB-V's V: chunk 0 of rank r is
    stage r, chunk 1 is stage 2p − 1 − r (rank 0 holds the first and the last stage)."""
    parallel = LAYOUTS[name]
    p, v = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_stages
    k = CFG.num_layers // (p * v)
    stage_of = stage_of or (lambda c, r, p: r if c == 0 else 2 * p - 1 - r)
    leaf = sharding.layout_params(numbered_layers(), parallel)["layers"]["mlp"]["fc1_bias"]
    for c in range(v):
        for r in range(p):
            want = [(stage_of(c, r, p) * k + j) * 1000 for j in range(k)]
            assert leaf[c, r, :, 0].tolist() == want, (c, r)


@pytest.mark.parametrize("name", ["p1t2", "p2t2-zb-v"])
def test_place_params_puts_arrays_and_shapes_alike_on_the_mesh(name):
    """Arrays come back as arrays with the specs' shardings and the laid-out values; ShapeDtypeStructs come back as
    ShapeDtypeStructs of the same shapes, dtypes and shardings (for lowering without data)."""
    parallel = LAYOUTS[name]
    mesh = make_mesh(parallel)
    t = parallel.tensor_model_parallel_size
    params = gpt.init_params(jax.random.key(0), CFG, tensor_parallel_size=t)
    placed, specs = sharding.place_params(params, parallel, mesh)
    assert specs == sharding.param_specs(
        sharding.layout_params(params, parallel), pipelined=parallel.pipeline_model_parallel_size > 1
    )
    jax.tree.map(np.testing.assert_array_equal, placed, sharding.layout_params(params, parallel))
    abstract = jax.eval_shape(lambda key: gpt.init_params(key, CFG, tensor_parallel_size=t), jax.random.key(0))
    shapes, abstract_specs = sharding.place_params(abstract, parallel, mesh)
    assert abstract_specs == specs
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    described = jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), shapes)
    assert described == jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), placed)
    word = placed["embed"]["word"]
    assert word.sharding.spec == jax.sharding.PartitionSpec("tensor", None)
