"""Every sharding decision in one file: which dim of which parameter is split over which mesh axis, and the
pipeline's stacked-layer layout [v, p, k, ...] with its conversions (no other module knows that layout).

- "tensor": the table `TENSOR_SPLIT_DIM` (paper §2.3); parameters not in it are replicated over "tensor".
- "pipe": with pipeline parallelism the stacked layers [L, ...] are stored [v, p, k = L/(p·v), ...] and split over
  "pipe" on dim 1 (`stage_layers`); inside shard_map a rank sees [v, 1, k, ...] and the executor works on its
  chunks [v, k, ...] (`local_chunks`). Embeddings and the final LayerNorm are replicated over "pipe" (used by the
  first and last virtual stages, their gradients summed: Megatron's tied-embedding all-reduce).
- "data": nothing is split (replicated weights, data-parallel gradients reduced once per step); batches
  [M, d·b, S] are split over "data" on dim 1 (each data rank takes its b rows of every microbatch).
- Checkpoints hold the canonical form, which no layout leaks into: layers [L, ...] in model order and the word
  embedding with the unpadded V rows; optimizer moments the same way (`to_canonical`, `from_canonical`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ptd_jax.config import ParallelConfig, schedule_spec
from ptd_jax.model import acc_dtype
from ptd_jax.parallel.mesh import Axis

TENSOR, DATA, PIPE, CONTEXT = Axis.TENSOR.value, Axis.DATA.value, Axis.PIPE.value, Axis.CONTEXT.value

# parameter path -> dim split over tensor (the stored arrays: layers carry a leading L dim)
TENSOR_SPLIT_DIM: dict[tuple[str, ...], int] = {
    # counted from the end, so that the stacked layers' leading dims ([L] or the pipeline's [v, p, k]) do not matter
    ("embed", "word"): -2,  # [Vp, D]: vocab-parallel embedding (and the tied output layer)
    ("output", "word"): -2,  # [Vp, D]: the untied output layer, vocab-parallel
    ("layers", "attn", "qkv_kernel"): -3,  # [L, D, G, R+2, K]: column-parallel over query groups
    ("layers", "attn", "qkv_bias"): -3,  # [L, G, R+2, K]
    ("layers", "attn", "out_kernel"): -3,  # [L, H, K, D]: row-parallel over heads
    ("layers", "mlp", "fc1_kernel"): -1,  # [L, D, F] or SwiGLU's [L, D, 2, F]: column-parallel
    ("layers", "mlp", "fc1_bias"): -1,  # [L, F] or [L, 2, F]
    ("layers", "mlp", "fc2_kernel"): -2,  # [L, F, D]: row-parallel
}

BATCH_SPEC = P(None, DATA, None)  # [M, d·b, S]


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def param_spec(path, leaf, pipelined: bool = False) -> P:
    """Spec of one parameter. With `pipelined`, layer leaves are stored [v, p, L/(p·v), ...] (see
    `stage_layers`) and their dim 1 is split over "pipe"."""
    names = _path_names(path)
    dims: list = [None] * leaf.ndim
    if pipelined and names[0] == "layers":
        dims[1] = PIPE
    dim = TENSOR_SPLIT_DIM.get(names)
    if dim is not None:
        dims[dim % leaf.ndim] = TENSOR
    return P(*dims)


def param_specs(params, pipelined: bool = False):
    """PartitionSpec tree matching `params`."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: param_spec(path, leaf, pipelined), params)


def _v_turn(x):
    """ZB-V's layout from the round-robin one and back: chunk 1's ranks reversed ([1, r] <-> [1, p − 1 − r])."""
    return jnp.concatenate([x[:1], x[1:, ::-1]]) if x.shape[0] == 2 else x


def stage_layers(layers, p: int, v: int, v_shape: bool = False):
    """[L, ...] -> [v, p, L/(p·v), ...]: a free reshape that puts layer (c·p + r)·k + j at [c, r, j], i.e. chunk c
    of pipeline rank r holds virtual stage c·p + r — the paper's round-robin assignment (§2.2.2). `v_shape` (ZB-V,
    v = 2): chunk 1 of rank r holds stage 2p − 1 − r instead (a reversal of chunk 1's ranks)."""
    staged = jax.tree.map(lambda x: x.reshape(v, p, x.shape[0] // (p * v), *x.shape[1:]), layers)
    return jax.tree.map(_v_turn, staged) if v_shape else staged


def unstage_layers(layers, v_shape: bool = False):
    """[v, p, k, ...] -> [L, ...] (the reference layout); `v_shape` as in `stage_layers`."""
    if v_shape:
        layers = jax.tree.map(_v_turn, layers)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[3:]), layers)


def v_shaped(parallel: ParallelConfig) -> bool:
    """Whether `parallel`'s schedule stores its chunks in the V (ZB-V: `stage_layers`' `v_shape`)."""
    return parallel.pipeline_model_parallel_size > 1 and schedule_spec(parallel.pipeline_schedule).stage_map == "v"


def layout_params(params, parallel: ParallelConfig):
    """The reference params [L, ...] in `parallel`'s stored layout: the layers staged [v, p, k, ...] when p > 1,
    unchanged otherwise. Works on arrays and on ShapeDtypeStructs alike."""
    if parallel.pipeline_model_parallel_size == 1:
        return params
    p, v = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_stages
    staged = jax.eval_shape if _abstract(params["layers"]) else lambda f, x: f(x)
    return {**params, "layers": staged(lambda x: stage_layers(x, p, v, v_shaped(parallel)), params["layers"])}


def reference_layout(tree, parallel: ParallelConfig):
    """The inverse of `layout_params` (for params or gradients in the stored layout): layers back to [L, ...]."""
    if parallel.pipeline_model_parallel_size == 1:
        return tree
    return {**tree, "layers": unstage_layers(tree["layers"], v_shaped(parallel))}


def place_params(params, parallel: ParallelConfig, mesh):
    """(params on `mesh`, their PartitionSpecs): the reference params laid out for `parallel` (`layout_params`)
    and put on the mesh; ShapeDtypeStructs come back as ShapeDtypeStructs carrying their shardings (for
    lowering without data)."""
    laid = layout_params(params, parallel)
    specs = param_specs(laid, pipelined=parallel.pipeline_model_parallel_size > 1)
    shardings = named(mesh, specs)
    if _abstract(laid):
        placed = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), laid, shardings)
        return placed, specs
    return jax.device_put(laid, shardings), specs


def _abstract(tree) -> bool:
    return all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def local_chunks(layers_local):
    """Inside shard_map: this pipeline rank's shard [v, 1, k, ...] -> its chunks [v, k, ...] (chunk c is virtual
    stage c·p + rank)."""
    return jax.tree.map(lambda x: x[:, 0], layers_local)


def from_local_chunks(chunks):
    """The inverse of `local_chunks`: [v, k, ...] -> the rank's shard [v, 1, k, ...] (for gradients)."""
    return jax.tree.map(lambda x: x[:, None], chunks)


def split_axes(spec: P) -> tuple[str, ...]:
    return tuple(a for a in tuple(spec) if a is not None)


def replicated_axes(spec: P, pipelined: bool, sequence_parallel: bool, context: bool = False) -> tuple[str, ...]:
    """Mesh axes a parameter is replicated on but used with differing data, so that its gradient is a partial
    sum: "data" always, "pipe" for the embeddings/final LayerNorm under pipelining, "tensor" for the
    tensor-replicated weights under sequence parallelism, "context" for every parameter under context parallelism
    (each rank holds other tokens). Marked varying before autodiff (no per-microbatch all-reduce) and summed once
    after."""
    marked = (DATA,) + ((PIPE,) if pipelined else ()) + ((CONTEXT,) if context else ())
    marked += (TENSOR,) if sequence_parallel else ()
    split = split_axes(spec)
    return tuple(a for a in marked if a not in split)


def replicated_axes_tree(specs, pipelined: bool, sequence_parallel: bool, context: bool = False):
    """`replicated_axes` for every leaf of a PartitionSpec tree: a tree of axis-name tuples."""
    return jax.tree.map(
        lambda s: replicated_axes(s, pipelined, sequence_parallel, context), specs, is_leaf=lambda x: isinstance(x, P)
    )


def opt_state_specs(optimizer: optax.GradientTransformation, opt_state, specs):
    """Optimizer moments shard like their parameters; counters and other scalars are replicated."""
    return optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        opt_state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )


def state_specs(optimizer, state, pipelined: bool = False):
    """Specs of {"params", "opt_state", "step"[, "loss_scale"]}: the step and the loss scaler are replicated."""
    specs = param_specs(state["params"], pipelined)
    out = {"params": specs, "opt_state": opt_state_specs(optimizer, state["opt_state"], specs), "step": P()}
    if "loss_scale" in state:
        out["loss_scale"] = jax.tree.map(lambda _: P(), state["loss_scale"])
    return out


def named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def global_norm(grads, specs):
    """L2 norm counting every parameter once, inside shard_map: each leaf's sum of squares is summed over the mesh
    axes it is split on (one scalar all-reduce per group of axes), and replicated leaves (LayerNorm, biases of
    row-parallel layers, embeddings over "pipe") are counted once — not once per replica."""
    groups: dict[tuple[str, ...], jax.Array] = {}
    for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        square = jnp.sum(jnp.square(g.astype(acc_dtype(g.dtype))))
        axes = split_axes(spec)
        groups[axes] = groups.get(axes, 0.0) + square
    total = sum(jax.lax.psum(value, axes) if axes else value for axes, value in sorted(groups.items()))
    return jnp.sqrt(total)


# ---------------------------------------------------------------------------------------------------------------
# The canonical form (checkpoints): layers [L, ...] in model order, the word embedding [V, D] unpadded
# ---------------------------------------------------------------------------------------------------------------


def _canonical_leaf(names, x, vocab_size: int, pipelined: bool, v_shape: bool = False):
    if pipelined and names[0] == "layers":
        return (_v_turn(x) if v_shape else x).reshape(-1, *x.shape[3:])  # [v, p, k, ...] -> [L, ...]
    if names[-1] == "word":  # the word embedding and the untied output layer
        return x[:vocab_size]
    return x


def _layout_leaf(names, x, padded_vocab_size: int, p: int, v: int, v_shape: bool = False):
    if p > 1 and names[0] == "layers":
        staged = x.reshape(v, p, x.shape[0] // (p * v), *x.shape[1:])  # `stage_layers`
        return _v_turn(staged) if v_shape else staged
    if names[-1] == "word":
        # The padded rows are zero and get zero gradients (they never enter the loss), so their parameters and
        # Adam moments stay zero: padding with zeros restores exactly the state a run at this t would have.
        return jnp.pad(x, ((0, padded_vocab_size - x.shape[0]), (0, 0)))
    return x


def _canonical_spec(names, leaf, p: int) -> P:
    dims: list = [None] * leaf.ndim
    if names[-1] == "word":
        return P(None, TENSOR)  # V need not divide by t, but D does (t divides the heads): split D
    if p > 1 and names[0] == "layers":
        dims[0] = PIPE  # L / p contiguous layers per pipe rank (the rank's own at v = 1)
    dim = TENSOR_SPLIT_DIM.get(names)
    if dim is not None:
        dims[dim % leaf.ndim] = TENSOR
    return P(*dims)


def _map_state(optimizer, state, leaf_fn, non_params=lambda x: x):
    """Apply leaf_fn(names, x) to every parameter-shaped leaf of {"params", "opt_state"} (moments included) and
    `non_params` to the optimizer's other leaves (counters). Without "opt_state", the params alone."""
    names = jax.tree_util.tree_map_with_path(lambda path, _: _path_names(path), state["params"])
    # A names tuple sits where params has a leaf, so tree.map hands it over whole.
    out = {"params": jax.tree.map(lambda x, n: leaf_fn(n, x), state["params"], names)}
    if "opt_state" in state:
        out["opt_state"] = optax.tree_map_params(
            optimizer, lambda x, n: leaf_fn(n, x), state["opt_state"], names, transform_non_params=non_params
        )
    return out


def to_canonical(optimizer, state, vocab_size: int, pipelined: bool, v_shape: bool = False):
    """The run's {"params", "opt_state"} -> the canonical form (a free reshape and a slice; ZB-V's layout,
    `v_shape`, also reverses chunk 1's ranks)."""
    return _map_state(optimizer, state, lambda n, x: _canonical_leaf(n, x, vocab_size, pipelined, v_shape))


def from_canonical(optimizer, canonical, padded_vocab_size: int, p: int, v: int, v_shape: bool = False):
    """The canonical form -> the layout of a run at pipeline size p with v chunks and this padded vocabulary."""
    return _map_state(optimizer, canonical, lambda n, x: _layout_leaf(n, x, padded_vocab_size, p, v, v_shape))


def canonical_specs(optimizer, canonical, p: int):
    """How the canonical form lies on the mesh while it is restored: tensor-split dims stay split (the word
    embedding on D), layers are split over "pipe" on their L dim, everything else is replicated."""
    return _map_state(optimizer, canonical, lambda n, x: _canonical_spec(n, x, p), non_params=lambda _: P())
