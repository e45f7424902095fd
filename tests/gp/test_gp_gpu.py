"""GPU checks of tilax.gp on the compiled kernel sums (Triton; Mosaic GPU on Hopper) against a
dense float64 Cholesky computation (skipped off GPU).

Run on the GPU host: ``PYTHONPATH=src:tests python -m pytest tests/gp/test_gp_gpu.py -q``.
The CPU tests run the same estimators on the interpreted kernels at smaller sizes
(test_gp_pallas.py); here the defaults run as a user gets them: ``impl="auto"``, the
``"highest"`` kernel sums, the complete preconditioner up to 1 024 points and rank 400 above.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from gp_oracle import dense_mll, dense_posterior, gp_data
from helpers import rel_err
from test_gp_mll import NAMES, as_params

import tilax

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (compiled kernels)"),
]

KERNELS = ("rbf", "matern12", "matern32", "matern52")


@pytest.mark.parametrize("kernel", KERNELS)
def test_mll_gradient_and_posterior_at_1000_points_match_dense_cholesky(kernel):
    # Up to 1 024 points the default preconditioner is complete: the estimates are all but
    # exact, so the bounds are the (1e-3 on the value, 5% on the gradient).
    x, y = gp_data(1000, 4, seed=0, noise=0.01)
    params = as_params([0.4, 0.6, 0.8, 1.0], 1.0, 0.01)
    value_ref, grads_ref, _, _ = dense_mll(params, x, y, kernel)
    fn = jax.jit(jax.value_and_grad(
        lambda p, impl: tilax.gp.mll(p, x, y, kernel=kernel, key=jax.random.key(0), impl=impl),
        argnums=0), static_argnums=1)
    value, grads = fn(params, "auto")
    assert abs(float(value) - value_ref) <= 1e-3 * abs(value_ref), (float(value), value_ref)
    for name in NAMES:
        assert rel_err(grads[name], grads_ref[name]) <= 0.05, (name, grads[name], grads_ref[name])
    # The same probes through XLA's products: the kernels change the estimate by rounding only.
    value_xla, grads_xla = fn(params, "xla")
    np.testing.assert_allclose(float(value), float(value_xla), rtol=1e-4)
    assert rel_err(grads, grads_xla) <= 1e-3
    x_star = np.asarray(x[:64] + 0.01, np.float32)
    mean, variance = jax.jit(
        lambda p: tilax.gp.posterior(p, x, y, x_star, kernel=kernel))(params)
    mean_ref, variance_ref = dense_posterior(params, x, y, x_star, kernel)
    assert rel_err(mean, mean_ref) <= 1e-3
    np.testing.assert_allclose(variance, variance_ref, atol=1e-3)


def test_mll_at_4096_points_with_the_default_rank_400_preconditioner():
    # Measured on a CPU (jax 0.10.2, the XLA sums, 3 keys): relative error 3.4e-4 in 8-D.
    x, y = gp_data(4096, 8, seed=1, noise=0.05)
    params = as_params(np.sqrt(8.0), 1.0, 0.05)
    value_ref, grads_ref, _, _ = dense_mll(params, x, y)
    value, grads = jax.jit(jax.value_and_grad(
        lambda p: tilax.gp.mll(p, x, y, key=jax.random.key(0))))(params)
    assert abs(float(value) - value_ref) <= 1e-2 * abs(value_ref), (float(value), value_ref)
    assert rel_err(grads, grads_ref) <= 0.1, (grads, grads_ref)
