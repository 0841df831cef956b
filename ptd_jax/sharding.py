"""Every sharding decision of the model in one table: which dim of which parameter is split over "tensor".

Parameters not in the table are replicated over "tensor". Nothing is split over "data" (replicated weights,
data-parallel gradients reduced once per step) and, until the pipeline lands, over "pipe".
Batches [M, d·b, S] are split over "data" on dim 1 (each data rank takes its b rows of every microbatch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ptd_jax.mesh import Axis

TENSOR, DATA = Axis.TENSOR.value, Axis.DATA.value

# parameter path -> dim split over tensor (the stored arrays: layers carry a leading L dim)
TENSOR_SPLIT_DIM: dict[tuple[str, ...], int] = {
    ("embed", "word"): 0,                    # [Vp, D]: vocab-parallel embedding and output layer
    ("layers", "attn", "qkv_kernel"): 3,     # [L, D, 3, H, K]: column-parallel over heads
    ("layers", "attn", "qkv_bias"): 2,       # [L, 3, H, K]
    ("layers", "attn", "out_kernel"): 1,     # [L, H, K, D]: row-parallel over heads
    ("layers", "mlp", "fc1_kernel"): 2,      # [L, D, F]: column-parallel
    ("layers", "mlp", "fc1_bias"): 1,        # [L, F]
    ("layers", "mlp", "fc2_kernel"): 1,      # [L, F, D]: row-parallel
}

BATCH_SPEC = P(None, DATA, None)  # [M, d·b, S]


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def param_spec(path, leaf) -> P:
    dim = TENSOR_SPLIT_DIM.get(_path_names(path))
    if dim is None:
        return P()
    return P(*([None] * dim + [TENSOR] + [None] * (leaf.ndim - dim - 1)))


def param_specs(params):
    """PartitionSpec tree matching `params`."""
    return jax.tree_util.tree_map_with_path(param_spec, params)


def is_tensor_split(spec: P) -> bool:
    return TENSOR in tuple(spec)


def opt_state_specs(optimizer: optax.GradientTransformation, opt_state, specs):
    """Optimizer moments shard like their parameters; counters and other scalars are replicated."""
    return optax.tree_map_params(optimizer, lambda _, spec: spec, opt_state, specs,
                                 transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))


def state_specs(optimizer, state):
    specs = param_specs(state["params"])
    return {"params": specs, "opt_state": opt_state_specs(optimizer, state["opt_state"], specs), "step": P()}


def named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def global_norm(grads, specs):
    """L2 norm counting every parameter once, inside shard_map: tensor-split leaves are summed over their shards
    (one scalar all-reduce over tensor), replicated leaves (LayerNorm, biases of row-parallel layers) counted
    once — not t times."""
    split = jnp.zeros((), jnp.float32)
    replicated = jnp.zeros((), jnp.float32)
    for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        square = jnp.sum(jnp.square(g.astype(jnp.promote_types(g.dtype, jnp.float32))))
        if is_tensor_split(spec):
            split = split + square
        else:
            replicated = replicated + square
    return jnp.sqrt(jax.lax.psum(split, TENSOR) + replicated)
