"""Kernel values right at every scale, for every impl and precision (tilax.rbf.numerics).

Coincident and nearly coincident points at lengthscales down to 1e-6, data far from the
origin, lengthscales of 1e-20 and 1e20, log densities at bandwidths down to 1e-16, and the fast
precisions' documented error bound. Each (impl, precision) compiles once: lengthscales,
bandwidths and points are traced arguments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from rbf_oracle import kde_value_and_grads, kernel_mv_value_and_grads

import tilax
from tilax.rbf import numerics, reference

IMPLS = ("pallas", "xla", "dense")
PRECISIONS = (None, "high", "highest")  # None is "default"
CASES = [(impl, precision) for impl in IMPLS for precision in PRECISIONS]


@functools.cache
def kernel_matrix(impl, precision):
    """``K(x, x)`` for ``x: [N, D]`` and a lengthscale: ``rbf_kernel_mv`` of the identity."""

    @jax.jit
    def run(x, lengthscale):
        eye = jnp.eye(x.shape[0], dtype=x.dtype)
        return tilax.rbf_kernel_mv(x, x, eye, lengthscale, impl=impl, precision=precision)

    return run


@functools.cache
def value_and_grads(impl, precision):
    @jax.jit
    def run(q, k, v, lengthscale, cotangent):
        def fn(*args):
            return tilax.rbf_kernel_mv(*args, impl=impl, precision=precision)

        out, vjp = jax.vjp(fn, q, k, v, lengthscale)
        return out, vjp(cotangent)

    return run


def float64_kernel_matrix(x, lengthscale):
    x = np.asarray(x, np.float64)
    diff = (x[:, None, :] - x[None, :, :]) / np.float64(lengthscale)
    return np.exp(-0.5 * np.sum(diff * diff, axis=-1))


# One set of shapes for every test, so that each (impl, precision) compiles once per function:
# N queries, M keys, D dimensions, OUT value columns.
N, M, D, OUT = 23, 19, 3, 4


def clustered_points(lengthscale, rng):
    """``N`` points spread over 3 units: 15, then exact duplicates of 4 of them, then 4
    neighbours 0.5 to 2 lengthscales away (rounded to float32, as the oracle sees them)."""
    base = rng.uniform(0.0, 3.0, size=(15, D))
    direction = np.array([0.48, 0.6, 0.64])
    near = base[:4] + np.array([0.5, 1.0, 1.5, 2.0])[:, None] * lengthscale * direction
    return np.concatenate([base, base[4:8], near]).astype(np.float32)


@pytest.mark.codegen
@pytest.mark.parametrize("impl, precision", CASES)
def test_coincident_points_at_small_lengthscales(impl, precision):
    rng = np.random.default_rng(0)
    run = kernel_matrix(impl, precision)
    for lengthscale in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        x = clustered_points(lengthscale, rng)
        kernel = np.asarray(run(x, np.float32(lengthscale)))
        assert np.all(np.isfinite(kernel)), lengthscale
        assert kernel.min() >= 0.0 and kernel.max() <= 1.0, (lengthscale, kernel.max())
        if precision == "highest":
            expected = float64_kernel_matrix(x, np.float32(lengthscale))
            assert np.max(np.abs(kernel - expected)) < 2e-6, (lengthscale, impl)
            assert np.all(np.diag(kernel) == 1.0)


@pytest.mark.codegen
@pytest.mark.parametrize("impl, precision", [
    pytest.param(impl, precision,
                 marks=[pytest.mark.kernels] if impl == "pallas" and precision != "highest" else [])
    for impl, precision in CASES
])
def test_extreme_lengthscales(impl, precision):
    rng = np.random.default_rng(1)
    x = rng.uniform(0.0, 3.0, size=(N, D)).astype(np.float32)
    x[5] = x[2]  # a coincident pair: exactly 1 at any lengthscale
    run = kernel_matrix(impl, precision)
    tiny = np.asarray(run(x, np.float32(1e-20)))
    expected = np.eye(N)
    expected[2, 5] = expected[5, 2] = 1.0
    np.testing.assert_array_equal(tiny, expected)
    np.testing.assert_array_equal(np.asarray(run(x, np.float32(1e20))), np.ones((N, N)))
    # Gradients: finite (no 0 * inf); at 1e-20 only dv = K.T g is nonzero.
    k = rng.uniform(0.0, 3.0, size=(M, D)).astype(np.float32)
    k[0] = x[2]
    v = rng.normal(size=(M, OUT)).astype(np.float32)
    g = rng.normal(size=(N, OUT)).astype(np.float32)
    for lengthscale in (np.float32(1e-20), np.full(D, 1e-20, np.float32), np.float32(1e20)):
        out, grads = value_and_grads(impl, precision)(x, k, v, lengthscale, g)
        assert np.all(np.isfinite(np.asarray(out)))
        for grad in grads:
            assert np.all(np.isfinite(np.asarray(grad))), (impl, precision, lengthscale)
        if lengthscale.max() < 1.0:
            for grad in (grads[0], grads[1], grads[3]):
                assert not np.any(np.asarray(grad))
            # (bfloat16 or, for XLA on GPUs, TF32 products round g below "highest")
            rtol = 1e-6 if precision == "highest" else 1e-2
            np.testing.assert_allclose(np.asarray(grads[2])[0], g[2] + g[5], rtol=rtol)


@pytest.mark.codegen
@pytest.mark.parametrize("impl, precision", [
    pytest.param(impl, precision, marks=[pytest.mark.kernels] if impl == "pallas"
                 and precision != "highest" else [])  # the fast kernels: 5 s each
    for impl, precision in CASES
])
def test_offset_data(impl, precision):
    # Points near 1e4 with a spread of ~1: differences, not |q|^2 + |k|^2 - 2 q.k.
    rng = np.random.default_rng(2)
    q = (rng.normal(size=(N, D)) + 1e4).astype(np.float32)
    k = (rng.normal(size=(M, D)) + 1e4).astype(np.float32)
    k[:3] = q[:3]
    v = rng.normal(size=(M, OUT)).astype(np.float32)
    g = rng.normal(size=(N, OUT)).astype(np.float32)
    tolerance = {"highest": 2e-6, "high": 1e-4, None: 3e-2}[precision]
    if impl != "pallas" and precision != "highest":
        tolerance = 3e-3  # XLA's default precision: float32 on a CPU, TF32 on recent GPUs
    for lengthscale in (np.float32(0.7), np.array([0.5, 1.0, 2.0], np.float32)):
        out, grads = value_and_grads(impl, precision)(q, k, v, lengthscale, g)
        ref, ref_grads = kernel_mv_value_and_grads(q, k, v, lengthscale, g)
        assert rel_err(out, ref) < tolerance, rel_err(out, ref)
        for name, grad, expected in zip(("dq", "dk", "dv"), grads, ref_grads, strict=False):
            assert rel_err(grad, expected) < 5 * tolerance, (name, rel_err(grad, expected))
        assert rel_err(grads[3], ref_grads[3]) < 20 * tolerance, rel_err(grads[3], ref_grads[3])


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_at_a_small_lengthscale(impl):
    # Nearly coincident points 1e-3 apart and a lengthscale of 1e-3: the exact path's
    # gradients, every one of them, against float64.
    rng = np.random.default_rng(3)
    lengthscale = 1e-3
    q = clustered_points(lengthscale, rng)
    k = q[4:].copy()  # the duplicates and the near neighbours are among the keys
    v = rng.normal(size=(M, OUT)).astype(np.float32)
    g = rng.normal(size=(N, OUT)).astype(np.float32)
    out, grads = value_and_grads(impl, "highest")(q, k, v, np.float32(lengthscale), g)
    ref, ref_grads = kernel_mv_value_and_grads(q, k, v, np.float32(lengthscale), g)
    assert rel_err(out, ref) < 2e-6
    for name, grad, expected in zip(("dq", "dk", "dv", "dl"), grads, ref_grads, strict=True):
        assert rel_err(grad, expected) < 1e-5, (name, rel_err(grad, expected))


@pytest.mark.parametrize(
    "impl",
    [
        "pallas",
        pytest.param("xla", marks=pytest.mark.skipif(
            jax.default_backend() == "gpu",
            reason="XLA multiplies by the values in TF32 on GPUs; the bound is the distance's",
        )),
    ],
)  # fmt: skip
def test_fast_precision_error_is_within_the_documented_bound(impl):
    # "high": its value products add at most ~2^-16 to each kernel value; the distance error
    # must stay within numerics.expansion_error_bound(D, rho) while rho is within the budget,
    # and the exact path takes over beyond it.
    rng = np.random.default_rng(4)
    run = kernel_matrix(impl, "high")
    x = rng.normal(size=(40, 4)).astype(np.float32)
    x[20:] = x[:20] + 0.3 * rng.normal(size=(20, 4)).astype(np.float32)  # near neighbours
    budget_rho = numerics.max_spread_ratio(4, numerics.FAST_DISTANCE_BUDGET["high"])
    radius = np.max(np.linalg.norm(x - x.mean(axis=0), axis=1))
    for rho in (2.0, 6.0, 0.95 * budget_rho, 3 * budget_rho, 30 * budget_rho):
        lengthscale = np.float32(2 * radius / rho)  # queries = keys: rho = 2 radius / l
        kernel = np.asarray(run(x, lengthscale), np.float64)
        expected = float64_kernel_matrix(x, lengthscale)
        counted = expected > 1e-30
        error = np.max(np.abs(kernel - expected)[counted] / expected[counted])
        if rho < budget_rho:
            bound = numerics.expansion_error_bound(4, rho) + 2.0**-15
            assert error <= bound, (rho, error, bound)
        else:  # the exact path: errors do not grow with rho
            assert error <= 2.0**-14, (rho, error)


@functools.cache
def log_density_and_grads(impl, precision):
    @jax.jit
    def run(query, data, bandwidth, weights, cotangent):
        def log_density(q, d, h, w):
            return tilax.rbf_kde_density(q, d, h, weights=w, log=True, impl=impl,
                                         precision=precision)  # fmt: skip

        out, vjp = jax.vjp(log_density, query, data, bandwidth, weights)
        return out, vjp(cotangent)

    return run


@pytest.mark.codegen
@pytest.mark.parametrize("impl, precision", [
    pytest.param(impl, precision, marks=[pytest.mark.kernels] if impl == "pallas"
                 and precision != "highest" else [])  # the fast kernels: 4 s each
    for impl, precision in CASES
])
def test_log_density_at_tiny_bandwidths(impl, precision):
    # The log density is finite and float32-accurate down to bandwidths of 1e-16 (exponents
    # near -1e31), at queries on data points and between them; gradients stay finite and match
    # float64 (d bandwidth wherever float32 can hold it: ~1e46 at 1e-16).
    rng = np.random.default_rng(5)
    data = rng.uniform(0.0, 1.0, size=(30, 2)).astype(np.float32)
    query = rng.uniform(0.0, 1.0, size=(17, 2)).astype(np.float32)
    query[:5] = data[:5]
    weights = rng.uniform(0.2, 1.0, size=30).astype(np.float32)
    g = rng.normal(size=17).astype(np.float32)
    run = log_density_and_grads(impl, precision)
    for bandwidth in (1e-2, 1e-4, 1e-6, 1e-9, 1e-12, 1e-16):
        h = np.float32(bandwidth)
        log_p, grads = run(query, data, h, weights, g)
        ref, ref_grads = kde_value_and_grads(query, data, h, weights, g, log=True)
        assert np.all(np.isfinite(np.asarray(log_p))), bandwidth
        assert rel_err(log_p, ref) < 1e-6, (bandwidth, rel_err(log_p, ref))
        names = ("dquery", "ddata", "dbandwidth", "dweights")
        for name, grad, expected in zip(names, grads, ref_grads, strict=True):
            if np.max(np.abs(expected)) > 1e37:
                continue  # beyond float32
            assert np.all(np.isfinite(np.asarray(grad))), (name, bandwidth)
            assert rel_err(grad, expected) < 1e-4, (name, bandwidth, rel_err(grad, expected))


@pytest.mark.kernels
def test_default_gradients_of_distant_clusters():
    """The default precision rounds the gradients' pair weights to bfloat16 but keeps the
    coordinates in two parts (the ``"bf16x2"`` dot mode): for clusters some 40 lengthscales
    apart, still within the fast budget, dq and dk keep the default's error. Coordinates in
    one bfloat16 part would be off by about the spread times 2^-9 (4% here), because
    ``sum_j A_ij k_j - q_i sum_j A_ij`` cancels; the weights' rounding does not, since their
    row sum comes from the same products."""
    rng = np.random.default_rng(8)
    centres = np.array([[20.0, 0, 0], [-20.0, 0, 0], [0, 20.0, 0], [0, -20.0, 0]])
    q = (np.repeat(centres, 40, axis=0) + 0.7 * rng.normal(size=(160, 3))).astype(np.float32)
    k = (q + 0.3 * rng.normal(size=q.shape)).astype(np.float32)
    v = rng.normal(size=(160, 4)).astype(np.float32)
    g = rng.normal(size=(160, 4)).astype(np.float32)
    lengthscale = np.float32(1.0)
    qs, ks = numerics.centered_scaled(jnp.asarray(q), jnp.asarray(k), lengthscale)
    assert numerics.spread_ratio(qs, ks) > 40
    assert numerics.fast_distance_ok(qs, ks, None)  # the expansion: the fast path's sums
    _, grads = value_and_grads("pallas", None)(q, k, v, lengthscale, g)
    _, want = kernel_mv_value_and_grads(q, k, v, lengthscale, g)
    for name, grad, expected in zip(("dq", "dk"), grads[:2], want[:2], strict=True):
        assert rel_err(grad, expected) < 1e-2, (name, rel_err(grad, expected))


def test_bf16x2_dot_rounds_the_first_operand_only():
    """``"bf16x2"``: ``a`` rounded to bfloat16 (nearest), ``b`` in two bfloat16 parts."""
    from tilax.rbf import numerics

    rng = np.random.default_rng(9)
    a = rng.normal(size=(32, 64)).astype(np.float32)
    b = (rng.normal(size=(64, 16)) * 100.0).astype(np.float32)
    a_parts = numerics.split(jnp.asarray(a), "bf16x2")
    b_parts = numerics.split(jnp.asarray(b), "bf16x2")
    got = np.asarray(numerics.dot(a_parts, b_parts, "bf16x2", "interpret"), np.float64)
    a16 = np.asarray(a_parts[0].astype(jnp.float32), np.float64)
    assert np.max(np.abs(a16 - a)) > 0  # rounded ...
    assert np.all(np.abs(a16 - a) <= 2.0**-8 * np.abs(a))  # ... to the nearest bfloat16
    want = a16 @ b.astype(np.float64)
    assert rel_err(got, want) < 2.0**-15  # b's two parts: float32-like against rounded a
    assert rel_err(got, a.astype(np.float64) @ b) > 2.0**-12  # a's rounding shows


@pytest.mark.codegen
@pytest.mark.parametrize("per_dimension", [False, True])
def test_the_lengthscales_bit_level_work_is_done_once_not_per_dimension(per_dimension):
    """The exact distance path scales each coordinate difference by ``numerics.Scale``: the
    lengthscale's subnormal-safe split and logs are computed once per call, so the program (and
    its compile time) does not grow with them per dimension (at D = 8 a GP gradient's program
    was twice the size). Per dimension only the scaling itself remains: its two power-of-two
    factors, built from bits (14 bit-level operations per dimension before)."""

    def bit_ops(dim):
        q, v = jnp.ones((16, dim)), jnp.ones((16, 2))
        lengthscale = jnp.ones(dim) if per_dimension else jnp.float32(1.0)
        jaxpr = jax.make_jaxpr(
            lambda q, ls: reference.kernel_mv_dense(q, q, v, ls, precision="highest"))(
                q, lengthscale)
        return str(jaxpr).count("bitcast_convert_type")

    assert (bit_ops(8) - bit_ops(2)) / 6 <= 2


def test_the_exact_distance_program_does_not_grow_with_the_dimension():
    """The exact path sums the dimensions in a loop, ``EXACT_DIMS_UNROLLED`` per step (each
    step recomputed in the backward pass): the programs of a gradient at D = 64 and D = 16 are
    the same size (unrolled, at D = 64 a CPU took 8 s to compile the gradient, 1.4 s looped)."""

    def jaxpr_lines(dim):
        q, v, lengthscale = jnp.ones((16, dim)), jnp.ones((16, 2)), jnp.ones(dim)

        def loss(q, lengthscale):
            return reference.kernel_mv_xla(q, q, v, lengthscale, precision="highest").sum()

        return len(str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, lengthscale)).split("\n"))

    assert reference.EXACT_DIMS_UNROLLED < 16
    assert jaxpr_lines(64) == jaxpr_lines(16)
