"""Property-based tests of the public RBF functions against the float64 oracle (issue 76): over
shapes, dtypes, data scales and lengthscale (bandwidth) ratios from subnormal to huge, impls and
precisions. Few examples at small shapes, derandomized, so that CI is repeatable. Marked
``kernels`` (``nox -s tests_kernels``): the search compiles every impl at new shapes (15 s on
the 2-core machine); tests/rbf's unit tests hold each impl against the oracle every day."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from rbf_oracle import kde_density, kernel_mv

import tilax

pytestmark = [pytest.mark.kernels, pytest.mark.codegen]  # subnormal to huge scales

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Relative tolerance of a result against the oracle on the inputs as rounded to their dtype:
# the output's rounding for the narrow dtypes, the default precision's bfloat16 value products
# (and its distance budget, 2^-8) in float32, float32 rounding for "highest".
TOLERANCE = {("float32", "highest"): 2e-5, ("float32", None): 1.5e-2,
             ("bfloat16", "highest"): 1.6e-2, ("bfloat16", None): 2.5e-2,
             ("float16", "highest"): 2e-3, ("float16", None): 1.5e-2}  # fmt: skip
# Data exponents a dtype holds with room for its spread (float16 tops out at 65504).
DATA_EXPONENTS = {"float32": (-30, 30), "bfloat16": (-30, 30), "float16": (-2, 2)}

PROPERTY_SETTINGS = settings(max_examples=8, deadline=None, derandomize=True, database=None)


@st.composite
def problems(draw, *, with_values: bool):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    low, high = DATA_EXPONENTS[dtype]
    data_exponent = draw(st.integers(low, high))
    # The lengthscale relative to the data's spread; now and then far outside it, down to the
    # subnormal float32 lengthscales and up to 1e38.
    ratio = draw(st.one_of(st.floats(-2.0, 2.0), st.sampled_from([-50.0, -20.0, 20.0, 60.0])))
    scale = float(np.clip(10.0 ** (data_exponent + ratio), 1e-45, 3e38))
    shape = dict(n=draw(st.sampled_from([1, 3, 7])), m=draw(st.sampled_from([1, 4, 9])),
                 dim=draw(st.sampled_from([1, 3])), out=draw(st.sampled_from([1, 5])))  # fmt: skip
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    spread = 10.0**data_exponent
    points_q = rng.normal(size=(shape["n"], shape["dim"])) * spread
    points_k = rng.normal(size=(shape["m"], shape["dim"])) * spread
    if draw(st.booleans()):  # some queries exactly on keys
        points_q[: min(shape["n"], shape["m"])] = points_k[: min(shape["n"], shape["m"])]
    extra = rng.normal(size=(shape["m"], shape["out"])) if with_values else rng.uniform(
        0.1, 1.0, size=shape["m"])
    return dict(
        dtype=dtype,
        q=jnp.asarray(points_q, DTYPES[dtype]),
        k=jnp.asarray(points_k, DTYPES[dtype]),
        extra=jnp.asarray(extra, DTYPES[dtype]),
        scale=np.float32(scale),
        impl=draw(st.sampled_from(["xla", "dense", "pallas"])),
        precision=draw(st.sampled_from([None, "highest"])),
    )


def _f64(x):
    return jnp.asarray(np.asarray(jnp.asarray(x, jnp.float32), np.float64))


def _clipped(x, dtype):
    """Values beyond ``dtype``'s range as its largest finite number (an overflow is right)."""
    big = float(jnp.finfo(dtype).max)
    return np.clip(np.asarray(x, np.float64), -big, big)


@PROPERTY_SETTINGS
@given(problems(with_values=True))
def test_kernel_mv_matches_float64(problem):
    q, k, v, scale = problem["q"], problem["k"], problem["extra"], problem["scale"]
    out = tilax.rbf_kernel_mv(q, k, v, scale, impl=problem["impl"],
                              precision=problem["precision"])  # fmt: skip
    assert out.dtype == q.dtype and out.shape == (q.shape[0], v.shape[1])
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


    with jax.enable_x64(True):
        expected = np.asarray(kernel_mv(_f64(q), _f64(k), _f64(v), jnp.float64(scale)))
        # The size of the summed terms, sum_j K_ij |v_j|: signed sums may cancel.
        magnitude = np.asarray(kernel_mv(_f64(q), _f64(k), jnp.abs(_f64(v)), jnp.float64(scale)))
    tolerance = TOLERANCE[(problem["dtype"], problem["precision"])]
    error = np.abs(np.asarray(out, np.float64) - expected)
    assert np.all(error <= tolerance * magnitude + 1e-30), (error.max(), magnitude.max())


@PROPERTY_SETTINGS
@given(problems(with_values=False), st.booleans())
def test_kde_density_matches_float64(problem, log):
    query, data, weights = problem["q"], problem["k"], problem["extra"]
    h = problem["scale"]
    out = tilax.rbf_kde_density(query, data, h, weights=weights, log=log, impl=problem["impl"],
                                precision=problem["precision"])  # fmt: skip
    assert out.dtype == query.dtype and out.shape == (query.shape[0],)
    assert not np.any(np.isnan(np.asarray(out, np.float32)))


    with jax.enable_x64(True):
        expected = np.asarray(kde_density(_f64(query), _f64(data), jnp.float64(h),
                                          _f64(weights), log=log))  # fmt: skip
    tolerance = TOLERANCE[(problem["dtype"], problem["precision"])]
    actual = _clipped(out, query.dtype)
    expected = _clipped(expected, query.dtype)
    if log:  # an error in the density is an absolute error in its log
        bound = tolerance * np.maximum(1.0, np.abs(expected))
    else:
        bound = tolerance * np.abs(expected) + 4 * float(jnp.finfo(jnp.float32).tiny)
    assert np.all(np.abs(actual - expected) <= bound), (actual, expected)
