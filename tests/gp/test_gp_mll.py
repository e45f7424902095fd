"""tilax.gp.mll and its gradient against a dense float64 Cholesky computation."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from gp_oracle import dense_mll, gp_data
from helpers import rel_err

import tilax

NAMES = ("lengthscale", "outputscale", "noise")


def as_params(lengthscale, outputscale, noise) -> dict:
    return {"lengthscale": jnp.asarray(lengthscale, jnp.float32),
            "outputscale": jnp.float32(outputscale), "noise": jnp.float32(noise)}


@pytest.fixture(scope="module")
def problem_1000():
    x, y = gp_data(1000, 2, seed=0, noise=0.01)
    params = as_params(0.3, 1.0, 0.01)
    return params, x, y, dense_mll(params, x, y)


@pytest.fixture(scope="module")
def value_and_grad_1000(problem_1000):
    params, x, y, _ = problem_1000
    # One compile for all the n = 1000 checks: the key is an argument.
    fn = jax.jit(jax.value_and_grad(
        lambda p, key: tilax.gp.mll(p, x, y, key=key, impl="xla"), argnums=0))
    return fn, fn(params, jax.random.key(0))


def test_mll_and_gradient_match_dense_cholesky(problem_1000, value_and_grad_1000):
    _, _, _, (value_ref, grads_ref, _, _) = problem_1000
    _, (value, grads) = value_and_grad_1000
    assert value.dtype == jnp.float32 and value.shape == ()
    assert abs(float(value) - value_ref) <= 1e-3 * abs(value_ref), (float(value), value_ref)
    assert rel_err(grads, grads_ref) <= 0.05, (grads, grads_ref)
    for name in NAMES:  # each component too, not only the largest
        assert abs(float(grads[name]) - grads_ref[name]) <= 0.05 * abs(grads_ref[name]), name


def test_another_key_gives_another_estimate_as_good(problem_1000, value_and_grad_1000):
    params, _, _, (value_ref, grads_ref, _, _) = problem_1000
    fn, (first, _) = value_and_grad_1000
    other, grads = fn(params, jax.random.key(1))
    assert float(first) != float(other)
    assert abs(float(other) - value_ref) <= 1e-3 * abs(value_ref)
    assert rel_err(grads, grads_ref) <= 0.05


def test_jit_matches_eager_and_reports_cg():
    x, y = gp_data(100, 2, seed=3, noise=0.01)
    params = as_params(0.3, 1.0, 0.01)
    value_ref, _, _, _ = dense_mll(params, x, y)
    kwargs = dict(key=jax.random.key(3), impl="xla", num_probes=4, tol=1e-2,
                  preconditioner_rank=20)
    eager, info = tilax.gp.mll(params, x, y, return_info=True, **kwargs)
    jitted = jax.jit(lambda p: tilax.gp.mll(p, x, y, **kwargs))(params)
    # Eager and jitted rounding differ, and so may the step where CG stops (within tol).
    np.testing.assert_allclose(float(jitted), float(eager), rtol=1e-3)
    assert 0 < int(info["cg_iterations"]) < 1000 and float(info["relative_residual"]) <= 1e-2
    assert abs(float(eager) - value_ref) <= 1e-2 * abs(value_ref)


def test_ard_lengthscale_and_gradients_in_x_and_y():
    x, y = gp_data(200, 3, seed=1, noise=0.05)
    params = as_params([0.4, 0.7, 1.5], 2.0, 0.05)
    value_ref, grads_ref, d_x_ref, d_y_ref = dense_mll(params, x, y)
    fn = lambda p, xx, yy: tilax.gp.mll(p, xx, yy, key=jax.random.key(0), impl="xla")
    value, (grads, d_x, d_y) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(params, x, y)
    assert grads["lengthscale"].shape == (3,)
    assert abs(float(value) - value_ref) <= 1e-3 * abs(value_ref)
    assert rel_err(grads, grads_ref) <= 0.05
    np.testing.assert_allclose(grads["lengthscale"], grads_ref["lengthscale"], rtol=0.05)
    assert rel_err(d_x, d_x_ref) <= 0.05
    assert rel_err(d_y, d_y_ref) <= 1e-3


def test_without_preconditioner():
    # P = noise * I: plain Hutchinson and SLQ, whose error is larger (here ~1.5%).
    x, y = gp_data(150, 2, seed=2, noise=0.1)
    params = as_params(0.5, 1.0, 0.1)
    value_ref, _, _, _ = dense_mll(params, x, y)
    value = jax.jit(lambda p: tilax.gp.mll(p, x, y, key=jax.random.key(0), impl="xla",
                                           preconditioner_rank=0, num_probes=64))(params)
    assert abs(float(value) - value_ref) <= 0.05 * abs(value_ref)


def test_the_default_preconditioner_is_complete_up_to_1024_points():
    # 800 points in 8 dimensions: at rank 50 the MLL is 0.3-1% off here and the gradient
    # 0.2-0.8% (three keys), far over these bounds.
    # At rank n, 537 of the 800 pivots are used, the last ones just above rounding level:
    # factorising their block again in float32 gave NaN gradients (now the block's factor is
    # the pivots' rows).
    x, y = gp_data(800, 8, seed=8, noise=0.01)
    params = as_params(np.linspace(0.3, 0.9, 8) * np.sqrt(8), 1.0, 0.01)
    value_ref, grads_ref, _, _ = dense_mll(params, x, y)
    value, grads = jax.jit(jax.value_and_grad(lambda p: tilax.gp.mll(
        p, x, y, key=jax.random.key(0), impl="xla")))(params)
    assert abs(float(value) - value_ref) <= 1e-4 * abs(value_ref)
    assert rel_err(grads, grads_ref) <= 1e-3, (grads, grads_ref)
    assert [tilax.gp.api.preconditioner_rank_for(None, n) for n in (800, 1024, 1025)] == [
        800, 1024, 400]


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in ``jaxpr`` and the programs nested in it."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dot_precisions(sub)
    return found


@pytest.mark.parametrize("fn", ["mll", "posterior"])
def test_every_product_outside_the_kernel_sums_is_full_float32(fn):
    # JAX's default float32 product on NVIDIA GPUs is TF32 (a 10-bit mantissa), and the
    # preconditioner's solve divides a cancelling difference by the noise. The CPU computes
    # float32 whatever the precision, so what is checked here is that every product asks for it.
    x, y = gp_data(40, 2, seed=0, noise=0.01)
    params = as_params(0.3, 1.0, 0.01)
    if fn == "mll":
        program = jax.value_and_grad(
            lambda p: tilax.gp.mll(p, x, y, key=jax.random.key(0), impl="xla"))
    else:
        program = lambda p: tilax.gp.posterior(p, x, y, x[:4] + 0.01, impl="xla")  # noqa: E731
    precisions = _dot_precisions(jax.make_jaxpr(program)(params).jaxpr)
    assert precisions
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert all(p == highest for p in precisions), precisions
