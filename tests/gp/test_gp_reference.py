"""tilax.gp.reference (dense_mll, the dense baseline of the gp benchmarks, and dense_posterior)
against the float64 NumPy oracle: values and jax.grad, float64 and float32, scalar and ARD
lengthscales, every kernel of tilax.gp.mll."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gp_oracle import dense_mll as oracle_mll
from gp_oracle import dense_posterior as oracle_posterior
from gp_oracle import gp_data
from gp_oracle import kernel_matrix as oracle_matrix

from tilax.gp.reference import dense_mll, dense_posterior, kernel_matrix


@pytest.mark.parametrize("kernel", ["rbf", "matern12", "matern32", "matern52"])
@pytest.mark.parametrize("lengthscale", [0.3, [0.2, 0.5, 1.0]])
def test_value_and_gradient_match_the_oracle_in_float64(lengthscale, kernel):
    x, y = gp_data(200, 3, seed=1, noise=0.01)
    x[7] = x[3]  # a repeated point: zero distance off the diagonal too
    params = {"lengthscale": np.asarray(lengthscale), "outputscale": 1.3, "noise": 0.02}
    value, grads, d_x, d_y = oracle_mll(params, x, y, kernel)
    with jax.enable_x64(True):
        ours = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
        x64, y64 = jnp.asarray(x, jnp.float64), jnp.asarray(y, jnp.float64)
        got, (got_grads, got_x, got_y) = jax.value_and_grad(
            lambda p, a, b: dense_mll(p, a, b, kernel=kernel), argnums=(0, 1, 2))(ours, x64, y64)
        assert float(got) == pytest.approx(value, rel=1e-10)
        for name in params:
            np.testing.assert_allclose(np.asarray(got_grads[name]), grads[name], rtol=1e-7)
        assert np.all(np.isfinite(np.asarray(got_x)))
        np.testing.assert_allclose(np.asarray(got_x), d_x, rtol=1e-6,
                                   atol=1e-8 * np.max(np.abs(d_x)))
        np.testing.assert_allclose(np.asarray(got_y), d_y, rtol=1e-9)


@pytest.mark.parametrize("kernel", ["rbf", "matern12", "matern32", "matern52"])
def test_posterior_matches_the_oracle_in_float64(kernel):
    x, y = gp_data(150, 3, seed=3, noise=0.01)
    x_star = np.concatenate([x[:5], x[:5] + 0.05, np.full((1, 3), 5.0, np.float32)])
    params = {"lengthscale": np.asarray([0.2, 0.5, 1.0]), "outputscale": 1.3, "noise": 0.02}
    mean_ref, variance_ref = oracle_posterior(params, x, y, x_star, kernel)
    with jax.enable_x64(True):
        ours = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
        mean, variance = dense_posterior(ours, jnp.asarray(x, jnp.float64),
                                         jnp.asarray(y, jnp.float64),
                                         jnp.asarray(x_star, jnp.float64), kernel=kernel)
    np.testing.assert_allclose(np.asarray(mean), mean_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(np.asarray(variance), variance_ref, rtol=1e-7, atol=1e-12)
    assert float(variance[-1]) == pytest.approx(1.3, rel=1e-6)  # far away: the prior


def test_float32_is_float32_accurate_at_moderate_conditioning():
    x, y = gp_data(300, 2, seed=2, noise=0.1)
    params = {"lengthscale": 0.5, "outputscale": 1.0, "noise": 0.1}
    value, _, _, _ = oracle_mll(params, x, y)
    got = dense_mll({k: jnp.float32(v) for k, v in params.items()}, jnp.asarray(x),
                    jnp.asarray(y))
    assert got.dtype == jnp.float32
    assert float(got) == pytest.approx(value, rel=1e-4)


@pytest.mark.parametrize("kernel", ["rbf", "matern12", "matern32", "matern52"])
def test_kernel_matrix_matches_the_oracle_and_names_its_kernels(kernel):
    a = np.random.default_rng(3).normal(size=(5, 2)).astype(np.float32)
    b = np.random.default_rng(4).normal(size=(7, 2)).astype(np.float32)
    b[2] = a[1]
    expected, _, _ = oracle_matrix(a, b, 0.7, kernel)
    np.testing.assert_allclose(np.asarray(kernel_matrix(kernel, a, b, 0.7)), expected,
                               rtol=1e-5, atol=1e-6)
    # Equal points at distance exactly 0 in float32 (the expansion |a|^2 + |b|^2 - 2 a.b gave
    # Matérn-1/2 diagonals down to 0.996 on such points).
    points = np.random.default_rng(5).normal(size=(200, 8)).astype(np.float32)
    np.testing.assert_array_equal(np.diag(np.asarray(kernel_matrix(kernel, points, points, 0.5))),
                                  1.0)
    with pytest.raises(ValueError, match="kernel must be one of 'rbf', 'matern12'"):
        kernel_matrix("matern99", a, b, 0.7)
