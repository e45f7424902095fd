"""``tilax.kernel_mv``'s stationary kernels (``tilax.rbf.profiles``) against the NumPy float64
oracle (``rbf_oracle.stationary_kernel_mv``): values and gradients w.r.t. q, k, v and the
lengthscale (scalar and ARD), batch dimensions, coincident points, offset data in
``"highest"``, tiny and huge lengthscales, every impl (Pallas in interpret mode on this CPU;
the Mosaic GPU kernels' Matérn profiles in ``test_rbf_matern_mosaic.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import peak_rel_err, rel_err
from rbf_oracle import stationary_kernel_mv, stationary_profile

import tilax
from tilax.rbf import config as rbf_config
from tilax.rbf import numerics, profiles

KERNELS = ("rbf", "matern12", "matern32", "matern52")
MATERN = ("matern12", "matern32", "matern52")
#: Relative error of values and gradients: float32-accurate paths, the fast XLA path (an
#: expansion at HIGHEST), and the Pallas default (bfloat16 value products, ~2^-9).
TOLERANCE = {"highest": 2e-5, "xla_default": 2e-4, "pallas_default": 2e-2}


def _inputs(batch=(2,), n=24, m=40, dim=3, out=4, ard=True, seed=0, coincident=6):
    """Float32 inputs whose first ``coincident`` keys are queries (pairs at r = 0)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*batch, n, dim)).astype(np.float32)
    k = rng.standard_normal((*batch, m, dim)).astype(np.float32)
    k[..., :coincident, :] = q[..., :coincident, :]
    v = rng.standard_normal((*batch, m, out)).astype(np.float32)
    g = rng.standard_normal((*batch, n, out)).astype(np.float32)
    scale = (rng.uniform(0.6, 1.8, dim) if ard else np.asarray(1.3)).astype(np.float32)
    return q, k, v, scale, g


def _value_and_grads(kernel, q, k, v, scale, g, **kwargs):
    def loss(*args):
        return jnp.sum(tilax.kernel_mv(*args, kernel=kernel, **kwargs) * g)

    out = tilax.kernel_mv(q, k, v, scale, kernel=kernel, **kwargs)
    return out, jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, scale)


def _check(kernel, inputs, tol, **kwargs):
    """Values and gradients within ``tol`` of the oracle, relative to their norm, or for a
    gradient that underflows float32 (tiny lengthscales), absolutely against ``dv``'s norm
    (of order one: its pairs are the kernel values)."""
    out, grads = _value_and_grads(kernel, *inputs, **kwargs)
    want_out, want_grads = stationary_kernel_mv(kernel, *inputs)
    assert rel_err(out, want_out) < tol, kernel
    floor = np.linalg.norm(want_grads[2])
    for name, got, want in zip(("dq", "dk", "dv", "dl"), grads, want_grads, strict=True):
        got = np.asarray(got, np.float64)
        assert np.all(np.isfinite(got)), (kernel, name)
        assert np.shape(got) == np.shape(want), (kernel, name)
        error = np.linalg.norm(got - want) / max(np.linalg.norm(want), floor)
        assert error < tol, (kernel, name, error)


@pytest.mark.parametrize("kernel", MATERN)
@pytest.mark.parametrize("precision", ["highest", pytest.param(None, marks=pytest.mark.kernels)])
def test_xla_matches_float64(kernel, precision):
    """ARD lengthscales, batch dimensions, coincident pairs."""
    tol = TOLERANCE["highest" if precision else "xla_default"]
    _check(kernel, _inputs(), tol, impl="xla", precision=precision)


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", MATERN)
def test_dense_matches_float64_with_a_scalar_lengthscale(kernel):
    inputs = _inputs(ard=False)
    _check(kernel, inputs, TOLERANCE["highest"], impl="dense", precision="highest")


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("impl", ["xla", "dense"])
@pytest.mark.parametrize("ard", [True, False])
def test_xla_impls_match_float64_everywhere(kernel, impl, ard):
    inputs = _inputs(ard=ard)
    _check(kernel, inputs, TOLERANCE["highest"], impl=impl, precision="highest")
    _check(kernel, inputs, TOLERANCE["xla_default"], impl=impl)


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", MATERN)
@pytest.mark.parametrize("precision", ["highest", None])
def test_pallas_matches_float64(kernel, precision):
    inputs = _inputs(batch=(), n=40, m=56)
    tol = TOLERANCE["highest" if precision else "pallas_default"]
    _check(kernel, inputs, tol, impl="pallas", precision=precision, block_q=16, block_k=16)


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", MATERN)
def test_pallas_scalar_lengthscale_matches_float64(kernel):
    """One lengthscale for all dimensions: the exact kernels' shared scale (applied to the
    summed squares; its gradient from the pairs' exponents)."""
    inputs = _inputs(batch=(), n=40, m=56, ard=False)
    _check(kernel, inputs, TOLERANCE["highest"], impl="pallas", precision="highest",
           block_q=16, block_k=16)  # fmt: skip


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", MATERN)
def test_pallas_fast_path_matches_float64(kernel):
    """Data within the Matérn kernels' fast budget (small spread-to-lengthscale ratio) run the
    expansion kernels: the default's bfloat16 value products, ~2^-9."""
    q, k, v, _, g = _inputs(batch=(), n=40, m=56, coincident=0)
    scale = np.float32(30.0 if kernel != "matern12" else 300.0)
    qs, ks = numerics.centered_scaled(jnp.asarray(q), jnp.asarray(k), scale)
    assert bool(numerics.fast_distance_ok(qs, ks, None, kernel))
    _check(kernel, (q, k, v, scale, g), TOLERANCE["pallas_default"], impl="pallas")


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", MATERN)
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_highest_is_float32_accurate_on_offset_data(kernel, impl):
    """Points 1e4 from the origin at lengthscales of ~1: distances from differences."""
    q, k, v, scale, g = _inputs(batch=(), n=20, m=30)
    q, k = q + np.float32(1e4), k + np.float32(1e4)
    kwargs = dict(block_q=16, block_k=16) if impl == "pallas" else {}
    _check(kernel, (q, k, v, scale, g), 1e-4, impl=impl, precision="highest", **kwargs)


@pytest.mark.kernels
@pytest.mark.codegen
@pytest.mark.parametrize("kernel", MATERN)
@pytest.mark.parametrize("lengthscale", [1e-3, 1e3])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_tiny_and_huge_lengthscales(kernel, lengthscale, impl):
    """Values in [0, 1], finite gradients, and the oracle's numbers: at 1e-3 only the
    coincident pairs count (their Matérn-1/2 gradient is the convention's 0), at 1e3 every
    pair is near r = 0."""
    q, k, v, _, g = _inputs(batch=(), n=20, m=30)
    scale = np.full(3, lengthscale, np.float32)
    kwargs = dict(impl=impl, block_q=16, block_k=16) if impl == "pallas" else dict(impl=impl)
    for precision in ("highest", None):
        _check(kernel, (q, k, v, scale, g), 1e-4 if precision else 2e-2,
               precision=precision, **kwargs)  # fmt: skip
        ones = jnp.eye(30, dtype=jnp.float32)  # the kernel matrix itself
        matrix = np.asarray(tilax.kernel_mv(q, k, ones, scale, kernel=kernel,
                                            precision=precision, **kwargs))  # fmt: skip
        assert matrix.min() >= 0.0 and matrix.max() <= 1.0


@pytest.mark.kernels
@pytest.mark.codegen
@pytest.mark.parametrize("kernel", KERNELS)
def test_values_in_unit_interval_at_every_scale(kernel):
    """Subnormal to huge lengthscales (the XLA path; the Pallas kernels share the profiles)."""
    q, k, _, _, _ = _inputs(batch=(), n=16, m=16)
    eye = np.eye(16, dtype=np.float32)
    for scale in (1e-30, 1e-3, 1.0, 1e3, 1e30):
        for precision in ("highest", None):
            matrix = np.asarray(tilax.kernel_mv(q, k, eye, scale, kernel=kernel, impl="xla",
                                                precision=precision))  # fmt: skip
            assert np.all((matrix >= 0) & (matrix <= 1)), (kernel, scale, precision)


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", MATERN)
@pytest.mark.parametrize("impl", ["xla", "dense", "pallas"])
def test_coincident_points_have_finite_gradients(kernel, impl):
    """One query on one key: Matérn-1/2's gradient there is the convention's 0, the others'
    is their (zero) slope at r = 0; the value is 1."""
    x = np.array([[0.3, -1.2]], np.float32)
    v = np.array([[2.0]], np.float32)
    scale = np.array([0.5, 2.0], np.float32)
    for precision in ("highest", None):
        out, grads = _value_and_grads(kernel, x, x, v, scale, np.ones((1, 1), np.float32),
                                      impl=impl, precision=precision)  # fmt: skip
        np.testing.assert_allclose(np.asarray(out), [[2.0]], rtol=1e-6)
        for grad in grads[:2] + grads[3:]:
            np.testing.assert_array_equal(np.asarray(grad), np.zeros_like(grad))
        np.testing.assert_allclose(np.asarray(grads[2]), [[1.0]], rtol=1e-6)


@pytest.mark.kernels
def test_matern12_gradient_near_coincidence_is_the_cone_slope():
    """Off r = 0, however close, the Matérn-1/2 gradient in q is the unit vector's slope
    ``exp(-r) (k - q) / (r l^2)``: magnitude ``exp(-r) / l`` for one dimension."""
    k = np.array([[1.0]], np.float32)
    for offset in (1e-6, 1e-3, 0.5):
        q = k + np.float32(offset)
        grad = jax.grad(
            lambda q: tilax.kernel_mv(
                q, k, np.ones((1, 1), np.float32), 2.0, kernel="matern12", impl="xla"
            ).sum()
        )(q)
        r = offset / 2.0
        np.testing.assert_allclose(np.asarray(grad), [[-np.exp(-r) / 2.0]], rtol=1e-3)


@pytest.mark.parametrize("kernel", KERNELS)
def test_profiles_match_the_oracle(kernel):
    """Both forms of the profile (base-2 exponents for the kernels, ``s`` for XLA) against the
    NumPy oracle's values and pair weights, from r = 0 to beyond float32's underflow."""
    r = np.concatenate([[0.0], np.geomspace(1e-6, 200.0, 400)]).astype(np.float64)
    want_value, want_weight = stationary_profile(kernel, r)
    half_sq = jnp.asarray(0.5 * r * r, jnp.float32)
    t = jnp.asarray(-0.5 * r * r / np.log(2.0), jnp.float32)
    value, weight = profiles.values_and_weights(kernel, t)
    for got, want in ((value, want_value), (weight, want_weight),
                      (profiles.half_sq_kernel(kernel, half_sq), want_value)):  # fmt: skip
        assert peak_rel_err(got, want) < 1e-5, kernel
    assert np.all(np.asarray(value) <= 1.0)


@pytest.mark.parametrize("kernel", MATERN)
def test_profile_derivative_is_minus_the_pair_weight(kernel):
    half_sq = jnp.asarray([0.0, 1e-8, 0.3, 2.0, 50.0, 1e5, np.inf], jnp.float32)
    grad = jax.vmap(jax.grad(lambda s: profiles.half_sq_kernel(kernel, s)))(half_sq)
    _, want = stationary_profile(kernel, np.sqrt(2.0 * np.asarray(half_sq, np.float64)))
    assert np.all(np.isfinite(np.asarray(grad)))
    np.testing.assert_allclose(np.asarray(grad)[2:], -want[2:], rtol=1e-5, atol=1e-30)
    if kernel != "matern12":  # differentiable at r = 0: phi(0) = 3 or 5/3
        np.testing.assert_allclose(np.asarray(grad)[0], -want[0], rtol=1e-6)
    else:
        assert float(grad[0]) == 0.0


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", MATERN)
def test_forward_mode_and_hessian_on_pallas(kernel):
    """Forward mode through the Pallas path is the XLA sum's tangent; reverse of forward (the
    Hessian in the lengthscale) is finite and matches the XLA path's."""
    q, k, v, scale, _ = _inputs(batch=(), n=16, m=24, coincident=0)
    tangents = tuple(np.ones_like(a) for a in (q, k, v, scale))

    def fn(impl):
        return lambda *a: tilax.kernel_mv(*a, kernel=kernel, impl=impl, precision="highest")

    _, pallas = jax.jvp(fn("pallas"), (q, k, v, scale), tangents)
    _, xla = jax.jvp(fn("xla"), (q, k, v, scale), tangents)
    assert rel_err(pallas, xla) < 1e-5
    hess = jax.hessian(lambda s: fn("xla")(q, k, v, s).sum())(scale)
    assert np.all(np.isfinite(np.asarray(hess)))


@pytest.mark.parametrize(
    "impl", ["xla", pytest.param("dense", marks=pytest.mark.kernels),
             pytest.param("pallas", marks=pytest.mark.kernels)]
)  # fmt: skip
def test_rbf_kernel_mv_is_kernel_mv_rbf(impl):
    q, k, v, scale, _ = _inputs()
    a = tilax.rbf_kernel_mv(q, k, v, scale, impl=impl)
    b = tilax.kernel_mv(q, k, v, scale, impl=impl)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kernel", ["matern", "Matern52", "gaussian", None, 52])
def test_unknown_kernel_is_a_value_error_naming_it(kernel):
    q, k, v, scale, _ = _inputs()
    with pytest.raises(ValueError, match="kernel must be one of"):
        tilax.kernel_mv(q, k, v, scale, kernel=kernel)


def test_matern_kernels_take_the_gaussian_launches():
    """The matern_launches rule: every launch of every path is the Gaussian kernel's."""
    hopper = rbf_config.Device(mosaic=True, cores=132, shared_memory=232448)
    for precision in (None, "high", "highest"):
        base = rbf_config.default_config("triton", precision, batch=1, n=65536, m=65536,
                                         out=16, dim=8, device=hopper)  # fmt: skip
        for kernel in MATERN:
            cfg = rbf_config.default_config(
                "triton",
                precision,
                batch=1,
                n=65536,
                m=65536,
                out=16,
                dim=8,
                device=hopper,
                kernel=kernel,
            )
            assert cfg.kernel == kernel
            for path, other in ((cfg.fast, base.fast), (cfg.exact, base.exact)):
                if path is None:
                    continue
                assert path.kernel == kernel and path.modes == other.modes
                assert (path.fwd, path.dq, path.dk) == (other.fwd, other.dq, other.dk)
    with pytest.raises(ValueError, match="kernel"):
        rbf_config.default_config("triton", None, batch=1, n=8, m=8, out=1, dim=1,
                                  op="kde", kernel="matern12")  # fmt: skip


def test_value_error_bounds_set_the_fast_budget():
    """The switch converts the expansion's bound per kernel: the Matérn-1/2 kernel (a square
    root of the bound) leaves the fast path at a much smaller spread than the others."""
    bound = 1e-6
    assert profiles.value_error_bound("rbf", bound) == bound
    assert profiles.value_error_bound("matern52", bound) == pytest.approx(5 / 3 * bound)
    assert profiles.value_error_bound("matern32", bound) == pytest.approx(3 * bound)
    assert float(profiles.value_error_bound("matern12", bound)) == pytest.approx(np.sqrt(2e-6))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 8)), jnp.float32)
    qs, ks = numerics.centered_scaled(x, x, 3.0)  # rho ~ 3: fast for all but Matérn-1/2
    ok = {kernel: bool(numerics.fast_distance_ok(qs, ks, None, kernel)) for kernel in KERNELS}
    assert ok == {"rbf": True, "matern12": False, "matern32": True, "matern52": True}


def test_fast_kernels_floor_matern12_near_pairs():
    """From the expansion (``fast=True``) Matérn-1/2's distance is floored at ``r_f = 2^-12``:
    a near pair's weight is ``exp(-r_f) / r_f`` whichever way the rounding left ``t`` (no
    ``1 / r`` of a rounding error), its value within ``r_f`` of 1; the Gaussian kernel and the
    differences' form are unchanged."""
    r_f = 2.0**-12
    t = jnp.asarray([1e-7, 0.0, -1e-12, -1e-9, -(0.5 / np.log(2.0))], jnp.float32)  # r = 1 last
    value, weight = profiles.values_and_weights("matern12", t, fast=True)
    np.testing.assert_allclose(np.asarray(weight)[:4], np.exp(-r_f) / r_f, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(weight)[4], np.exp(-1.0), rtol=1e-5)
    assert np.all(np.asarray(value)[:4] >= np.exp(-r_f) - 1e-7)
    _, exact_weight = profiles.values_and_weights("matern12", t)
    assert float(exact_weight[1]) == float(exact_weight[0]) == 0.0  # t >= 0: coincident
    for kernel in ("rbf", "matern32", "matern52"):
        fast = profiles.values_and_weights(kernel, t, fast=True)
        exact = profiles.values_and_weights(kernel, t)
        np.testing.assert_array_equal(np.asarray(fast), np.asarray(exact))
