"""tilax.gp.posterior against the dense float64 posterior."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gp_oracle import dense_posterior, gp_data

import tilax


def test_posterior_mean_and_variance_match_dense():
    x, y = gp_data(500, 2, seed=0, noise=0.01)
    x_star, _ = gp_data(40, 2, seed=1, noise=0.01)
    x_star = np.concatenate([x_star, x_star + 3.0])  # near the data and far from it
    params = {"lengthscale": jnp.array([0.3, 0.5]), "outputscale": jnp.float32(1.5),
              "noise": jnp.float32(0.01)}
    mean_ref, variance_ref = dense_posterior(params, x, y, x_star)
    # query_batch 32 splits the 80 queries into 3 solves, the last one padded.
    fn = jax.jit(lambda p, xs: tilax.gp.posterior(p, x, y, xs, impl="xla", query_batch=32))
    mean, variance = fn(params, x_star)
    assert mean.shape == variance.shape == (80,) and mean.dtype == jnp.float32
    np.testing.assert_allclose(mean, mean_ref, atol=2e-3 * np.max(np.abs(mean_ref)))
    np.testing.assert_allclose(variance, variance_ref, atol=2e-3 * 1.5)
    # Near the data each variance is small (3e-4 to 2e-3 here), and CG's error in it grows as
    # the square of the tolerance: the default's is 0.1% (22% at tol=1e-4).
    np.testing.assert_allclose(variance[:40], variance_ref[:40], rtol=1e-2)
    assert np.all(np.asarray(variance) >= 0)
    # Far from the data the posterior is the prior.
    np.testing.assert_allclose(variance[40:], 1.5, rtol=0.05)


def test_posterior_without_preconditioner_and_empty_queries():
    x, y = gp_data(100, 1, seed=2, noise=0.1)
    params = {"lengthscale": 0.2, "outputscale": 1.0, "noise": 0.1}
    x_star = np.linspace(0, 1, 7, dtype=np.float32)[:, None]
    mean_ref, variance_ref = dense_posterior(params, x, y, x_star)
    fn = jax.jit(lambda xs: tilax.gp.posterior(params, x, y, xs, impl="xla",
                                               preconditioner_rank=0))
    mean, variance = fn(x_star)
    np.testing.assert_allclose(mean, mean_ref, atol=1e-3)
    np.testing.assert_allclose(variance, variance_ref, atol=1e-3)
    mean, variance = tilax.gp.posterior(params, x, y, x_star[:0], impl="xla")
    assert mean.shape == variance.shape == (0,)


def test_eager_calls_run_as_one_compiled_program_each():
    """Outside ``jax.jit``, ``mll`` and ``posterior`` still compile as one program each (a
    ``jit`` inside), not their preconditioner and CG loops piece by piece at every call; the
    argument checks stay outside it and raise at every call."""
    x, y = gp_data(60, 2, seed=3, noise=0.1)
    params = {"lengthscale": 0.5, "outputscale": 1.0, "noise": 0.1}
    x_star = x[:5]
    key = jax.random.key(0)
    calls = {
        "mll": lambda p, x, y: tilax.gp.mll(p, x, y, key=key, impl="xla"),
        "posterior": lambda p, x, y: tilax.gp.posterior(p, x, y, x_star, impl="xla"),
    }
    for name, call in calls.items():
        jaxpr = jax.make_jaxpr(call)(params, x, y)
        # (the parameters' casts to the compute dtype may stay outside)
        outside = [e.primitive.name for e in jaxpr.eqns
                   if e.primitive.name != "convert_element_type"]
        assert outside == ["jit"], name
        first = call(params, x, y)
        for again, before in zip(jax.tree.leaves(call(params, x, y)), jax.tree.leaves(first),
                                 strict=True):
            np.testing.assert_array_equal(again, before)
        with pytest.raises(ValueError, match="positive"):
            call(dict(params, noise=-1.0), x, y)


def test_info_reports_whether_cg_converged():
    x, y = gp_data(300, 2, seed=0, noise=0.01)
    params = {"lengthscale": 0.3, "outputscale": 1.0, "noise": 0.01}
    mean, variance, info = tilax.gp.posterior(params, x, y, x[:20], impl="xla",
                                              return_info=True)
    assert mean.shape == variance.shape == (20,)
    assert 1 <= int(info["cg_iterations"]) < 1000 and float(info["relative_residual"]) <= 1e-6
    # A noise of 1e-5 under 300 points within a lengthscale is beyond float32 (the guide's
    # "Limits of float32"): CG breaks down, and the info says so.
    params = dict(params, noise=1e-5)
    *_, info = tilax.gp.posterior(params, x, y, x[:20], impl="xla", return_info=True)
    assert float(info["relative_residual"]) > 1e-2
    *_, info = tilax.gp.posterior(params, x, y, x[:0], impl="xla", return_info=True)
    assert int(info["cg_iterations"]) == 0


def test_the_mean_alone_skips_the_variance_solves():
    # 1 500 points: the default preconditioner (rank 400) is incomplete, so every solve
    # iterates and the variance's batched solves are most of the work.
    x, y = gp_data(1500, 3, seed=4, noise=0.01)
    params = {"lengthscale": 0.3, "outputscale": 1.0, "noise": 0.01}
    x_star = x[:40] + 0.01
    mean, variance, info = tilax.gp.posterior(params, x, y, x_star, impl="xla",
                                              query_batch=8, return_info=True)
    alone, alone_info = tilax.gp.posterior(params, x, y, x_star, impl="xla",
                                           return_variance=False, return_info=True)
    np.testing.assert_allclose(np.asarray(alone), np.asarray(mean), rtol=1e-6, atol=1e-6)
    assert float(alone_info["relative_residual"]) <= 1e-6
    # Its program holds one CG loop (the mean's), the full one two (the variance's in a map).
    loops = {flag: str(jax.make_jaxpr(lambda xs, flag=flag: tilax.gp.posterior(
        params, x, y, xs, impl="xla", return_variance=flag))(x_star)).count("while[")
        for flag in (True, False)}
    assert loops == {True: 2, False: 1}
