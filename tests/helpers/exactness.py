"""The exactness check every parallel path is held to: its loss, every gradient (each leaf's worst error relative to
the leaf's largest value) and the grad norm against the single-device reference's, at one tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def assert_equals_reference(got, reference, rtol: float) -> None:
    """`got` = (loss, grads, grad norm) of a parallel step in the reference layout; `reference` = (loss, grads) of
    `train.reference.accumulate_gradients` on the same batch. An AssertionError names the first leaf off by more
    than `rtol` ("relative error")."""
    loss, grads, norm = got
    ref_loss, ref_grads = reference
    assert float(loss) == pytest.approx(float(ref_loss), rel=rtol)
    for (path, ref), leaf in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True):
        assert leaf.shape == ref.shape, jax.tree_util.keystr(path)
        err = float(jnp.max(jnp.abs(leaf - ref))) / float(jnp.max(jnp.abs(ref)))
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"
    ref_norm = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(ref_grads))))
    assert float(norm) == pytest.approx(ref_norm, rel=rtol)


def rel(a, b) -> float:
    """The worst error of `a` relative to `b`'s largest value, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
