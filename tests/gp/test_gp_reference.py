"""tilax.gp.reference.dense_mll (the dense baseline of the gp benchmarks) against the float64
NumPy oracle: its value and its jax.grad, float64 and float32, scalar and ARD lengthscales."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gp_oracle import dense_mll as oracle_mll
from gp_oracle import gp_data

from tilax.gp.reference import dense_mll, kernel_matrix


@pytest.mark.parametrize("lengthscale", [0.3, [0.2, 0.5, 1.0]])
def test_value_and_gradient_match_the_oracle_in_float64(lengthscale):
    x, y = gp_data(200, 3, seed=1, noise=0.01)
    params = {"lengthscale": np.asarray(lengthscale), "outputscale": 1.3, "noise": 0.02}
    value, grads, _, _ = oracle_mll(params, x, y)
    with jax.enable_x64(True):
        ours = {k: jnp.asarray(v, jnp.float64) for k, v in params.items()}
        x64, y64 = jnp.asarray(x, jnp.float64), jnp.asarray(y, jnp.float64)
        got, got_grads = jax.value_and_grad(lambda p: dense_mll(p, x64, y64))(ours)
        assert float(got) == pytest.approx(value, rel=1e-10)
        for name in params:
            np.testing.assert_allclose(np.asarray(got_grads[name]), grads[name], rtol=1e-7)


def test_float32_is_float32_accurate_at_moderate_conditioning():
    x, y = gp_data(300, 2, seed=2, noise=0.1)
    params = {"lengthscale": 0.5, "outputscale": 1.0, "noise": 0.1}
    value, _, _, _ = oracle_mll(params, x, y)
    got = dense_mll({k: jnp.float32(v) for k, v in params.items()}, jnp.asarray(x),
                    jnp.asarray(y))
    assert got.dtype == jnp.float32
    assert float(got) == pytest.approx(value, rel=1e-4)


def test_kernel_matrix_is_the_rbf_matrix_and_names_its_kernels():
    a = np.random.default_rng(3).normal(size=(5, 2)).astype(np.float32)
    b = np.random.default_rng(4).normal(size=(7, 2)).astype(np.float32)
    squared = np.sum((a[:, None] - b[None]) ** 2 / 0.7**2, axis=-1)
    np.testing.assert_allclose(np.asarray(kernel_matrix("rbf", a, b, 0.7)),
                               np.exp(-0.5 * squared), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="kernel must be one of 'rbf'"):
        kernel_matrix("matern99", a, b, 0.7)
