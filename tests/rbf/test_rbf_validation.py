"""Bad inputs give a TypeError/ValueError that names the argument and what was expected."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilax

Q = np.zeros((2, 5, 3), np.float32)
K = np.ones((2, 4, 3), np.float32)
V = np.ones((2, 4, 6), np.float32)


def call_mv(q=Q, k=K, v=V, lengthscale=1.0, **options):
    return tilax.rbf_kernel_mv(q, k, v, lengthscale, **options)


def call_kde(query=Q, data=K, bandwidth=1.0, **options):
    return tilax.rbf_kde_density(query, data, bandwidth, **options)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(q=Q.astype(np.int32)), "q must be a real floating-point array, got dtype int32"),
        (dict(k=K.astype(np.complex64)), "k must be a real floating-point array"),
        (dict(v=V.astype(bool)), "v must be a real floating-point array"),
        (dict(lengthscale=np.array(2, np.int32)), "lengthscale must be a real floating-point"),
        (dict(block_q=32.0), "block_q must be an int"),
        (dict(block_o=True), "block_o must be an int"),
    ],
)
def test_kernel_mv_type_errors(changes, match):
    with pytest.raises(TypeError, match=match):
        call_mv(**changes)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(q=np.zeros(3, np.float32)), r"q must have shape \[..., N, D\] \(rank >= 2\), got"),
        (dict(k=np.zeros(3, np.float32)), r"k must have shape \[..., M, D\]"),
        (dict(v=np.zeros(4, np.float32)), r"v must have shape \[..., M, O\]"),
        (dict(k=np.ones((3, 4, 3), np.float32)), r"batch dimensions: .*k has shape \(3, 4, 3\)"),
        (dict(k=np.ones((4, 3), np.float32)), "must share their leading batch dimensions"),
        (dict(k=np.ones((2, 4, 2), np.float32)), r"same feature dimension D: q has shape"),
        (dict(v=np.ones((2, 5, 6), np.float32)), r"one row per key: .*expected \[..., 4, O\]"),
        (dict(lengthscale=np.ones(2, np.float32)), r"scalar or shape \(3,\).*got shape \(2,\)"),
        (dict(lengthscale=np.ones((3, 1), np.float32)), r"lengthscale must be a scalar or"),
        (dict(lengthscale=0.0), "lengthscale must be positive"),
        (dict(lengthscale=np.array([1.0, -1.0, 2.0], np.float32)), "must be positive"),
        (dict(lengthscale=np.inf), "lengthscale must be positive and finite, got inf"),
        (dict(lengthscale=np.array([1.0, np.nan, 2.0], np.float32)), "positive and finite"),
        (dict(impl="cuda"), "impl must be one of"),
        (dict(precision="fast"), "precision must be one of"),
        (dict(block_q=24), "block_q must be a power of two >= 16"),
        (dict(block_k=8), "block_k must be a power of two >= 16"),
        (dict(block_o=0), "block_o must be a power of two >= 16"),
    ],
)
def test_kernel_mv_value_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        call_mv(**changes)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(query=Q.astype(np.int64)), "query must be a real floating-point array"),
        (dict(data=K.astype(np.complex64)), "data must be a real floating-point array"),
        (dict(bandwidth=np.array(1, np.int32)), "bandwidth must be a real floating-point"),
        (dict(weights=np.ones((2, 4), np.int32)), "weights must be a real floating-point"),
        (dict(block_k="16"), "block_k must be an int"),
    ],
)
def test_kde_type_errors(changes, match):
    with pytest.raises(TypeError, match=match):
        call_kde(**changes)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(query=np.zeros(3, np.float32)), r"query must have shape \[..., N, D\]"),
        (dict(data=np.ones((3, 4, 3), np.float32)), "must share their leading batch dimensions"),
        (dict(data=np.ones((2, 4, 5), np.float32)), "same feature dimension D"),
        (dict(bandwidth=np.ones(3, np.float32)), r"bandwidth must be a scalar \(shape \(\)\)"),
        (dict(bandwidth=-0.5), "bandwidth must be positive"),
        (dict(weights=np.ones((2, 5), np.float32)), r"weights must have shape \[..., M\] = \(2, 4"),
        (dict(weights=np.ones(4, np.float32)), r"weights must have shape"),
        (dict(weights=np.array([[1, -1, 1, 1]] * 2, np.float32)), "weights must be non-negative"),
        (dict(weights=np.array([[1, np.nan, 1, 1]] * 2, np.float32)), "weights must be finite"),
        (dict(weights=np.array([[1, 1, np.inf, 1]] * 2, np.float32)), "weights must be finite"),
        (dict(weights=np.array([[1, 1, 1, -np.inf]] * 2, np.float32)), "weights must be finite"),
        (dict(bandwidth=np.nan), "bandwidth must be positive and finite"),
        (dict(bandwidth=np.float32(np.inf)), "bandwidth must be positive and finite"),
        (dict(weights=np.zeros((2, 4), np.float32)), "weights must not be all zero"),
        (dict(weights=np.array([[1, 1, 1, 1], [0, 0, 0, 0]], np.float32)), "not be all zero"),
        (dict(impl="triton"), "impl must be one of"),
        (dict(block_q=100), "block_q must be a power of two"),
    ],
)
def test_kde_value_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        call_kde(**changes)


@pytest.mark.parametrize("impl", ["pallas", "xla", "dense"])
def test_bad_weights_raise_for_every_impl(impl):
    weights = np.array([[1, np.nan, 1, 1], [1, 1, 1, 1]], np.float32)
    with pytest.raises(ValueError, match="weights must be finite, got 1 non-finite value"):
        call_kde(weights=weights, impl=impl)
    with pytest.raises(ValueError, match="weights must be non-negative, got minimum -2"):
        call_kde(weights=np.array([[1, 1, 1, 1], [1, -2, 1, 1]], np.float32), impl=impl)


def test_traced_values_are_not_checked_but_shapes_are():
    # Under jit the lengthscale value is unknown: no error; a wrong shape still raises.
    fn = jax.jit(lambda ls: tilax.rbf_kernel_mv(Q, K, V, ls, impl="xla"))
    assert fn(jnp.float32(-1.0)).shape == (2, 5, 6)
    with pytest.raises(ValueError, match="lengthscale must be a scalar or"):
        fn(jnp.ones(2))


def test_a_python_number_and_a_float32_scalar_share_one_compilation():
    """A lengthscale or bandwidth given as 0.5 and later as ``jnp.float32(0.7)`` runs the same
    compiled program (a weakly typed scalar would be a second signature)."""
    from tilax.rbf import reference

    # Shapes no other test uses, so that no earlier call has compiled them.
    data = jax.random.normal(jax.random.key(0), (37, 3))
    query = jax.random.normal(jax.random.key(1), (21, 3))
    values = jnp.ones((37, 2))
    for jitted, call in (
        (reference.kde_density_xla,
         lambda h: tilax.rbf_kde_density(query, data, h, log=True, impl="xla")),
        (reference.kernel_mv_xla,
         lambda h: tilax.rbf_kernel_mv(query, data, values, h, impl="xla")),
    ):
        before = jitted._cache_size()
        for scale in (0.5, jnp.float32(0.7), 2):
            call(scale).block_until_ready()
        assert jitted._cache_size() - before == 1
