"""rbf_kde_density against a float64 oracle: density, log density, all gradients, far queries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from rbf_oracle import kde_value_and_grads

import tilax


def make_inputs(seed, batch, n, m, dim, *, zero_weight=True):
    rng = np.random.default_rng(seed)
    query = (rng.normal(size=(*batch, n, dim)) + 2.0).astype(np.float32)
    data = (rng.normal(size=(*batch, m, dim)) + 2.0).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, size=(*batch, m)).astype(np.float32)
    if zero_weight:
        weights[..., 1] = 0.0  # a zero weight still has a (nonzero) gradient
    cotangent = rng.normal(size=(*batch, n)).astype(np.float32)
    return query, data, np.float32(0.7), weights, cotangent


def value_and_grads(query, data, bandwidth, weights, cotangent, **kwargs):
    @jax.jit
    def run(query, data, bandwidth, weights, cotangent):
        def density(q, d, h, w):
            return tilax.rbf_kde_density(q, d, h, weights=w, **kwargs)

        out, vjp = jax.vjp(density, query, data, bandwidth, weights)
        return out, vjp(cotangent)

    return run(query, data, bandwidth, weights, cotangent)


@pytest.mark.parametrize(
    "impl, log, precision, dim",
    [
        ("pallas", True, "highest", 3),
        pytest.param("pallas", False, "highest", 3, marks=pytest.mark.kernels),
        # beyond numerics.HOISTED_DIMS
        pytest.param("pallas", True, "highest", 17, marks=pytest.mark.kernels),
        pytest.param("pallas", True, "high", 3, marks=pytest.mark.kernels),
        ("pallas", False, None, 3),
        ("xla", True, None, 3),
        ("dense", False, None, 3),
    ],
)
def test_matches_float64(impl, log, precision, dim):
    inputs = make_inputs(0, (2,), 21, 35, dim)
    # The KDE has no value product: Pallas's default modes are those of "high".
    tolerance = 1e-4 if impl == "pallas" and precision != "highest" else 3e-6
    blocks = dict(block_q=16, block_k=16) if impl == "pallas" else {}
    out, grads = value_and_grads(*inputs, impl=impl, log=log, precision=precision, **blocks)
    ref_out, ref_grads = kde_value_and_grads(*inputs, log=log)
    assert out.shape == (2, 21) and out.dtype == jnp.float32
    assert rel_err(out, ref_out) < tolerance, rel_err(out, ref_out)
    for name, grad, ref in zip(("dquery", "ddata", "dbandwidth", "dweights"), grads, ref_grads,
                               strict=True):  # fmt: skip
        assert grad.shape == np.shape(ref), name
        assert rel_err(grad, ref) < 10 * tolerance, (name, rel_err(grad, ref))


def test_uniform_weights_by_default():
    query, data, bandwidth, _, _ = make_inputs(1, (), 9, 14, 2)
    out = tilax.rbf_kde_density(query, data, bandwidth, impl="pallas", precision="highest")
    ref, _ = kde_value_and_grads(query, data, bandwidth, np.ones(14), np.ones(9), log=False)
    assert rel_err(out, ref) < 3e-6


@pytest.mark.parametrize("impl", [pytest.param("pallas", marks=pytest.mark.kernels), "xla"])
def test_log_density_far_from_data_is_finite_and_accurate(impl):
    query, data, bandwidth, weights, _ = make_inputs(2, (), 6, 30, 2, zero_weight=False)
    far = query + np.float32(60.0)  # ~85 bandwidths away: the density underflows to 0
    ref, _ = kde_value_and_grads(far, data, bandwidth, weights, np.ones(6), log=True)
    log_p = tilax.rbf_kde_density(far, data, bandwidth, weights=weights, log=True, impl=impl)
    assert np.all(np.isfinite(log_p)) and np.all(np.asarray(log_p) < -1e3)
    assert rel_err(log_p, ref) < 1e-6, impl
    p = tilax.rbf_kde_density(far, data, bandwidth, weights=weights, impl=impl)
    assert not np.any(np.asarray(p))  # the plain density really underflows here
    grad = jax.grad(lambda q: tilax.rbf_kde_density(q, data, bandwidth, log=True,
                                                    impl=impl).sum())(far)  # fmt: skip
    assert np.all(np.isfinite(grad))


@pytest.mark.parametrize("impl", ["pallas", "xla", "dense"])
def test_empty_data_and_empty_queries(impl):
    query, data, bandwidth, _, _ = make_inputs(3, (2,), 4, 5, 3)
    density = tilax.rbf_kde_density(query, data[:, :0], bandwidth, impl=impl)
    assert density.shape == (2, 4) and not np.any(np.asarray(density))
    log_density = tilax.rbf_kde_density(query, data[:, :0], bandwidth, log=True, impl=impl)
    assert np.all(np.asarray(log_density) == -np.inf)
    assert tilax.rbf_kde_density(query[:, :0], data, bandwidth, impl=impl).shape == (2, 0)


def test_bfloat16_inputs():
    query, data, bandwidth, weights, _ = make_inputs(4, (), 10, 20, 2)
    q16, d16 = jnp.asarray(query, jnp.bfloat16), jnp.asarray(data, jnp.bfloat16)
    out = jax.jit(lambda q, d: tilax.rbf_kde_density(q, d, bandwidth, weights=weights,
                                                     impl="pallas"))(q16, d16)  # fmt: skip
    assert out.dtype == jnp.bfloat16
    ref, _ = kde_value_and_grads(q16.astype(jnp.float32), d16.astype(jnp.float32), bandwidth,
                                 weights, np.ones(10), log=False)  # fmt: skip
    assert rel_err(out, ref) < 1e-2
