"""tilax.gp on the Pallas kernel sum (interpret mode on a CPU): the GPU's arithmetic."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gp_oracle import dense_mll, dense_posterior, gp_data
from helpers import rel_err

import tilax


@pytest.mark.kernels
def test_mll_and_posterior_on_the_pallas_kernel_at_the_default_precision():
    x, y = gp_data(256, 2, seed=0, noise=0.01)
    params = {"lengthscale": jnp.float32(0.3), "outputscale": jnp.float32(1.0),
              "noise": jnp.float32(0.01)}
    value_ref, grads_ref, _, _ = dense_mll(params, x, y)
    # A low preconditioner rank, so that CG runs tens of iterations on the kernel's products.
    settings = dict(impl="pallas", preconditioner_rank=5)
    mll = lambda p, impl: tilax.gp.mll(p, x, y, key=jax.random.key(0), num_probes=64,
                                       preconditioner_rank=5, impl=impl)
    value, grads = jax.jit(jax.value_and_grad(lambda p: mll(p, "pallas")))(params)
    value_xla, grads_xla = jax.jit(jax.value_and_grad(lambda p: mll(p, "xla")))(params)
    # The same probes: the kernels' products (and their VJP) change the estimates by rounding
    # only; the estimate itself (rank 5, 64 probes) is within ~1% of the exact value.
    np.testing.assert_allclose(float(value), float(value_xla), rtol=1e-4)
    assert rel_err(grads, grads_xla) <= 1e-3
    assert abs(float(value) - value_ref) <= 3e-2 * abs(value_ref)
    assert rel_err(grads, grads_ref) <= 0.1
    mean_ref, variance_ref = dense_posterior(params, x, y, x[:16])
    mean, variance = jax.jit(lambda p: tilax.gp.posterior(p, x, y, x[:16], **settings))(params)
    np.testing.assert_allclose(mean, mean_ref, atol=1e-3 * np.max(np.abs(mean_ref)))
    np.testing.assert_allclose(variance, variance_ref, atol=1e-3)
