"""The RBF contract at the edges (issue 76): output dtypes, every representable lengthscale and
bandwidth (subnormal float32 included), far data with tiny lengthscales on the exact Pallas
path, KDE weights of any finite size, and the public API's type information."""

from __future__ import annotations

import inspect
import os
import typing
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rbf_oracle import kde_density, kernel_mv

import tilax
from tilax.rbf import numerics

IMPLS = ("xla", "dense", "pallas")
PRECISIONS = (None, "highest")
# Tiny lengthscales: normal, the smallest normal float32 and below it (subnormal), the smallest.
TINY_SCALES = (1e-20, 1e-35, 2.0**-126, 1e-38, 1e-40, 1e-45)
HUGE_SCALES = (1e30, 3e38)

QUERIES = np.array([[0.0, 0.0], [0.5, 0.0], [3.0, 1.0], [1.0, 1.0]], np.float32)
KEYS = np.array([[0.0, 0.0], [1.0, 1.0], [-2.0, 0.5]], np.float32)
VALUES = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, -6.0]], np.float32)


def _kernel_mv_f64(q, k, v, lengthscale):
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v, lengthscale)]
        return np.asarray(kernel_mv(*f64))


def _kde_f64(query, data, bandwidth, weights, *, log):
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(a, np.float64)) for a in (query, data, bandwidth, weights)]
        return np.asarray(kde_density(*f64, log=log))


# ------------------------------------------------------------------------------------------
# Item 5: output dtype follows the inputs on every path


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_output_dtype_follows_inputs(impl, dtype):
    q, k, v = (jnp.asarray(a, dtype) for a in (QUERIES, KEYS, VALUES))
    assert tilax.rbf_kernel_mv(q, k, v, 1.0, impl=impl).dtype == dtype
    assert tilax.rbf_kde_density(q, k, 1.0, impl=impl).dtype == dtype
    assert tilax.rbf_kde_density(q, k, 1.0, impl=impl, log=True).dtype == dtype
    # Mixed: the result type of the inputs (bfloat16 and float32 give float32).
    assert tilax.rbf_kernel_mv(q, k, VALUES, 1.0, impl=impl).dtype == jnp.float32


# ------------------------------------------------------------------------------------------
# Item 7: every representable lengthscale, subnormal included, on every impl and precision


@pytest.mark.codegen
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("lengthscale", TINY_SCALES + HUGE_SCALES)
def test_kernel_mv_at_extreme_lengthscales(impl, precision, lengthscale):
    out = tilax.rbf_kernel_mv(QUERIES, KEYS, VALUES, np.float32(lengthscale), impl=impl,
                              precision=precision)  # fmt: skip
    expected = _kernel_mv_f64(QUERIES, KEYS, VALUES, np.float32(lengthscale))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.codegen
@pytest.mark.parametrize("impl", IMPLS)
def test_kernel_mv_per_dimension_subnormal_lengthscale(impl):
    lengthscale = np.array([1e-45, 1.0], np.float32)  # one dimension exact, one ordinary
    out = tilax.rbf_kernel_mv(QUERIES, KEYS, VALUES, lengthscale, impl=impl)
    # Only pairs equal in the first coordinate contribute (exp(-0.5 dy^2)).
    expected = _kernel_mv_f64(QUERIES, KEYS, VALUES, np.array([1e-300, 1.0]))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.codegen
def test_scaling_helpers_read_subnormals_from_bits():
    x = jnp.array([1e-45, 1e-40, 2.0**-126, 1.0, 3e38], jnp.float32)
    mantissa, exponent = numerics.split_exponent(x)
    np.testing.assert_array_equal(
        np.asarray(mantissa, np.float64) * 2.0 ** np.asarray(exponent, np.float64),
        np.asarray(x, np.float64),
    )
    np.testing.assert_allclose(numerics.log_positive(x), np.log(np.asarray(x, np.float64)),
                               rtol=1e-6)  # fmt: skip
    assert float(numerics.divide_by(jnp.float32(1e-30), jnp.float32(1e-40))) == pytest.approx(
        np.float64(np.float32(1e-30)) / np.float64(np.float32(1e-40)), rel=1e-6
    )


# ------------------------------------------------------------------------------------------
# Item 8: the exact Pallas path with far data and a tiny lengthscale


@pytest.mark.codegen
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("lengthscale", [1e-35, 1e-38, 1e-45])
@pytest.mark.parametrize("offset", [1e4, 1e30])
def test_far_data_tiny_lengthscale(impl, precision, lengthscale, offset):
    q, k = QUERIES + np.float32(offset), KEYS + np.float32(offset)
    out = np.asarray(tilax.rbf_kernel_mv(q, k, VALUES, np.float32(lengthscale), impl=impl,
                                         precision=precision))  # fmt: skip
    # Coincident float32 points give their key's value, every other pair gives 0.
    coincident = np.all(q[:, None, :] == k[None, :, :], axis=-1).astype(np.float32)
    np.testing.assert_allclose(out, coincident @ VALUES, rtol=1e-6, atol=0)


@pytest.mark.codegen
@pytest.mark.parametrize("impl", IMPLS)
def test_huge_lengthscale_far_data(impl):
    q, k = QUERIES * np.float32(1e37), KEYS * np.float32(1e37)
    out = tilax.rbf_kernel_mv(q, k, VALUES, np.float32(1e38), impl=impl, precision="highest")
    expected = _kernel_mv_f64(q, k, VALUES, np.float32(1e38))
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------
# Item 6: the KDE at tiny bandwidths


@pytest.mark.codegen
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("bandwidth", [1e-15, 1e-20, 1e-25, 1e-38, 1e-40, 1e-45])
def test_kde_tiny_bandwidth(impl, precision, bandwidth):
    h = np.float32(bandwidth)
    log_p = np.asarray(tilax.rbf_kde_density(QUERIES, KEYS, h, log=True, impl=impl,
                                             precision=precision))  # fmt: skip
    p = np.asarray(tilax.rbf_kde_density(QUERIES, KEYS, h, impl=impl, precision=precision))
    on_data = np.any(np.all(QUERIES[:, None] == KEYS[None], axis=-1), axis=-1)
    # On the data: the normaliser's peak, log(1/M) - D/2 log(2 pi h^2) (its exp overflows
    # float32 from h ~ 1e-19 down).
    peak = np.log(1.0 / len(KEYS)) - np.log(2 * np.pi) - 2 * np.log(np.float64(h))
    np.testing.assert_allclose(log_p[on_data], peak, rtol=1e-6)
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(p[on_data], np.exp(peak).astype(np.float32), rtol=1e-5)
    # Off the data, at 0.5 or more from every point, the exponents are beyond float32 (or,
    # at 1e-15, the log density is a finite -1e29): the density is 0.
    expected_off = _kde_f64(QUERIES, KEYS, h, np.ones(len(KEYS)), log=True)[~on_data]
    assert np.all(p[~on_data] == 0.0)
    if bandwidth >= 1e-15:
        np.testing.assert_allclose(log_p[~on_data], expected_off, rtol=1e-6)
    else:
        assert np.all(log_p[~on_data] == -np.inf)


# ------------------------------------------------------------------------------------------
# Item 10: KDE weights of any finite positive size


@pytest.mark.codegen
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [1e-45, 1e-40, 1e-30, 1.0, 1e30, 1e38, 3.4e38])
@pytest.mark.parametrize("log", [False, True])
def test_kde_weights_of_any_size(impl, scale, log):
    relative = np.array([1.0, 0.5, 0.25], np.float32)
    weights = (relative * np.float32(scale)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy overflow warning from validation
        out = tilax.rbf_kde_density(QUERIES, KEYS, 0.8, weights=weights, log=log, impl=impl)
    # Subnormal weights keep their ratios only roughly (few mantissa bits): compare to the
    # float32 weights as they are.
    expected = _kde_f64(QUERIES, KEYS, np.float32(0.8), weights.astype(np.float64), log=log)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5)


@pytest.mark.codegen
@pytest.mark.parametrize("scale", [1e-45, 1e-40, 3.4e38])
def test_kde_weights_of_any_size_under_jit(scale):
    """The same inside a caller's ``jax.jit``: XLA fuses the weights' normalisation there, and
    on a CPU (denormals flushed) subnormal weights once gave NaN or 0."""
    weights = (np.array([1.0, 0.5, 0.25], np.float32) * np.float32(scale)).astype(np.float32)
    out = jax.jit(lambda w: tilax.rbf_kde_density(QUERIES, KEYS, 0.8, weights=w, impl="xla"))(
        weights)
    expected = _kde_f64(QUERIES, KEYS, np.float32(0.8), weights.astype(np.float64), log=False)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5)


@pytest.mark.codegen
def test_the_scale_checks_run_with_the_default_cpu_codegen():
    """The check above fails on the broken normalisation only with XLA's default CPU emitters,
    not the older ones ``nox -s tests`` compiles the other tests with: the checks of extreme
    scales are marked ``codegen``, and nox runs those with the default."""
    assert "xla_cpu_use_fusion_emitters=false" not in os.environ.get("XLA_FLAGS", "")
    marks = test_kde_weights_of_any_size_under_jit.pytestmark
    assert any(mark.name == "codegen" for mark in marks)


@pytest.mark.codegen
def test_kde_weights_gradient_through_normalisation():
    weights = np.array([1.0, 0.5, 0.25], np.float32)

    def loss(w, impl):
        return jnp.sum(tilax.rbf_kde_density(QUERIES, KEYS, 0.8, weights=w, impl=impl))

    with jax.enable_x64(True):
        expected = jax.jit(jax.grad(
            lambda w: jnp.sum(kde_density(jnp.asarray(QUERIES, jnp.float64),
                                          jnp.asarray(KEYS, jnp.float64), 0.8, w, log=False))
        ))(jnp.asarray(weights, jnp.float64))  # fmt: skip
    for impl in IMPLS:  # jitted: one compile each, and the fused normalisation's derivative
        grad = jax.jit(jax.grad(loss), static_argnums=1)(weights, impl)
        np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6)


def test_kde_validation_of_all_zero_weights_still_raises():
    with pytest.raises(ValueError, match="all zero"):
        tilax.rbf_kde_density(QUERIES, KEYS, 0.8, weights=np.zeros(3, np.float32))


# ------------------------------------------------------------------------------------------
# Item 11: type information


def test_package_is_typed():
    assert (Path(tilax.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize("fn", [tilax.rbf_kernel_mv, tilax.rbf_kde_density])
def test_public_rbf_functions_are_fully_annotated(fn):
    hints = typing.get_type_hints(fn)
    for name in inspect.signature(fn).parameters:
        assert name in hints, f"{fn.__name__}: parameter {name} has no type hint"
    assert hints["return"] is jax.Array
    first = next(iter(inspect.signature(fn).parameters))
    assert hints[first] == jax.typing.ArrayLike


@pytest.mark.codegen
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lengthscale", [1e-30, 1e-40, 1e-45])
def test_gradients_finite_at_tiny_scales(impl, lengthscale):
    """Far pairs (kernel 0) and coincident ones (distance 0) add zero gradient, not 0 * inf."""

    def loss(q, k, v, ls):
        return tilax.rbf_kernel_mv(q, k, v, ls, impl=impl, precision="highest").sum()

    def kde_loss(query, h):
        return tilax.rbf_kde_density(query, KEYS, h, impl=impl, log=True).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(QUERIES, KEYS, VALUES, np.float32(lengthscale))
    grads += jax.grad(kde_loss, argnums=(0, 1))(QUERIES, np.float32(lengthscale))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
