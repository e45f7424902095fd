"""tilax.gp with the Matérn kernels (tilax.kernel_mv's): the MLL and its gradients, and the
posterior mean, against a dense float64 Cholesky computation (gp_oracle, at n = 200)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gp_oracle import dense_mll, dense_posterior, gp_data
from helpers import rel_err

import tilax

#: Error of the MLL's stochastic estimate (16 probes, the log-determinant's quadrature), at
#: this size in absolute terms (the MLL itself is -21 to -93 here): its variance grows as the
#: kernel roughens (measured: 0.14 for Matérn-5/2, 0.6 to 0.9 for Matérn-1/2, which 64 probes
#: halve). The posterior mean is a CG solve, not an estimate: it is held to 1e-3.
MLL_ERROR = 1.5


# (The n = 200 jit compile takes ~20 s on 2 CPU cores: one kernel runs every time, the others
# with the heavy cases.)
@pytest.mark.parametrize("kernel", [
    pytest.param("matern12", marks=pytest.mark.kernels),
    pytest.param("matern32", marks=pytest.mark.kernels),
    "matern52",
])  # fmt: skip
def test_mll_gradients_and_posterior_mean_match_dense_cholesky(kernel):
    x, y = gp_data(200, 2, seed=2, noise=0.05)
    params = {"lengthscale": jnp.asarray([0.3, 0.6], jnp.float32),
              "outputscale": jnp.float32(1.5), "noise": jnp.float32(0.05)}  # fmt: skip
    value_ref, grads_ref, _, _ = dense_mll(params, x, y, kernel)

    def mll(p):
        return tilax.gp.mll(p, x, y, kernel=kernel, key=jax.random.key(0), impl="xla")

    value, grads = jax.jit(jax.value_and_grad(mll))(params)
    assert abs(float(value) - value_ref) <= MLL_ERROR, (float(value), value_ref)
    assert rel_err(grads, grads_ref) <= 0.1, (grads, grads_ref)
    x_star = np.asarray(x[:20] + 0.01, np.float32)
    mean, variance = tilax.gp.posterior(params, x, y, x_star, kernel=kernel, impl="xla")
    mean_ref, variance_ref = dense_posterior(params, x, y, x_star, kernel)
    assert rel_err(mean, mean_ref) <= 1e-3
    np.testing.assert_allclose(variance, variance_ref, rtol=0.05, atol=1e-3)


def test_unknown_kernel_names_the_supported_ones():
    x, y = gp_data(10, 2, seed=0, noise=0.05)
    params = {"lengthscale": 0.3, "outputscale": 1.0, "noise": 0.05}
    with pytest.raises(ValueError, match="'matern52'"):
        tilax.gp.mll(params, x, y, kernel="matern72", key=jax.random.key(0))
