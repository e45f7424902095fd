"""GPU checks of the Pallas kernels (Triton; Mosaic GPU on Hopper) against float64 at moderate
sizes (skipped off GPU).

Run on the GPU host: ``PYTHONPATH=src python -m pytest tests/rbf/test_rbf_gpu.py -m gpu -q``
(50 tests: at commit 9e2d1ac 46 passed in 235 s on the H200 and the Mosaic exact forward's
two failed on its accumulation, fixed in d98132e; the five Mosaic GPU tests passed at 80aa7bd;
the two of the Mosaic exact gradient sweeps are not run on a GPU yet).
The float64 oracle runs on the GPU with x64 enabled only inside the oracle.
tests/rbf/test_rbf_numerics.py runs on the GPU too (the extreme-scale cases).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from rbf_oracle import kde_value_and_grads, kernel_mv_value_and_grads, lengthscale_grad_scale

import tilax
from tilax import _pallas
from tilax.rbf import config as rbf_config
from tilax.rbf import vjp as rbf_vjp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton kernels)"),
]

# Relative error bounds vs float64 for outputs; gradients get 5x.
TOLERANCE = {"highest": 1e-5, "high": 1e-4, "default": 2e-2}


def make_inputs(seed, batch, n, m, dim, out):
    rng = np.random.default_rng(seed)
    q = (rng.normal(size=(*batch, n, dim)) + 1.0).astype(np.float32)
    k = (rng.normal(size=(*batch, m, dim)) + 1.0).astype(np.float32)
    v = rng.normal(size=(*batch, m, out)).astype(np.float32)
    lengthscale = rng.uniform(0.8, 2.0, size=(dim,)).astype(np.float32)
    cotangent = rng.normal(size=(*batch, n, out)).astype(np.float32)
    return q, k, v, lengthscale, cotangent


def pallas_value_and_grads(q, k, v, lengthscale, cotangent, **kwargs):
    @jax.jit
    def run(q, k, v, lengthscale, cotangent):
        def fn(*args):
            return tilax.rbf_kernel_mv(*args, impl="pallas", **kwargs)

        out, vjp = jax.vjp(fn, q, k, v, lengthscale)
        return out, vjp(cotangent)

    return run(q, k, v, lengthscale, cotangent)


@pytest.mark.parametrize("precision", [None, "highest", "high", "default"])
@pytest.mark.parametrize(
    "batch, n, m, dim, out",
    [((), 3000, 2500, 8, 16), ((2,), 1001, 777, 3, 1), ((), 600, 900, 20, 100)],
)
def test_kernel_mv_matches_float64(precision, batch, n, m, dim, out):
    inputs = make_inputs(0, batch, n, m, dim, out)
    got, grads = pallas_value_and_grads(*inputs, precision=precision)
    ref, ref_grads = kernel_mv_value_and_grads(*inputs)
    tolerance = TOLERANCE[precision or "default"]
    assert rel_err(got, ref) < tolerance, rel_err(got, ref)
    for name, grad, expected in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3], strict=True):
        assert rel_err(grad, expected) < 5 * tolerance, (name, rel_err(grad, expected))
    # d(lengthscale) sums terms that cancel: judge its error against the terms' size.
    scale = lengthscale_grad_scale(inputs[0], inputs[1], inputs[3], ref_grads[0], ref_grads[1])
    assert np.all(np.abs(np.asarray(grads[3], np.float64) - ref_grads[3]) <= 5 * tolerance * scale)


# Every shape runs: a sample of D in 1..128 and O in 1..512 for each precision, forward and
# backward, with the tiles of large problems (no occupancy shrink) at a size the float64 oracle
# handles. The launches' shared memory is what tests/rbf/test_rbf_tiles.py models; here Triton
# itself must accept them. Fast precisions run twice: within their distance budget (the fast
# path) and beyond it (a small lengthscale: the exact path).
SHAPE_GRID = {
    "highest": [(1, 1), (20, 100), (64, 512), (128, 100), (128, 512)],
    "high": [(3, 1), (20, 100), (33, 512), (128, 16), (128, 512)],
    None: [(1, 512), (20, 100), (64, 200), (128, 1), (128, 512)],
}
GRID_CASES = [(p, d, o) for p, shapes in SHAPE_GRID.items() for d, o in shapes]


def large_problem_fn(precision, n, m, dim, out):
    """``rbf_kernel_mv(impl="pallas")``'s value and VJP with the tiles of problems that fill
    the GPU: planned for this device with one core (no occupancy shrink)."""
    device = dataclasses.replace(rbf_config.Device.here(), cores=1)
    cfg = rbf_config.default_config(_pallas.resolve_backend("pallas"), precision, batch=1, n=n,
                                    m=m, out=out, dim=dim, device=device)

    @jax.jit
    def run(q, k, v, lengthscale, cotangent):
        out, vjp = jax.vjp(lambda *a: rbf_vjp.kernel_mv_with_config(*a, cfg), q, k, v,
                           lengthscale)
        return out, vjp(cotangent)

    return run


@pytest.mark.parametrize("precision, dim, out", GRID_CASES)
def test_every_shape_runs(precision, dim, out):
    n, m = 520, 300  # not tile multiples: padding and masking run too
    q, k, v, lengthscale, cotangent = make_inputs(7, (), n, m, dim, out)
    lengthscale = lengthscale * np.float32(np.sqrt(dim))  # rho ~ 3-5 at every D
    run = large_problem_fn(precision, n, m, dim, out)
    tolerance = TOLERANCE[precision or "default"]
    scales = [lengthscale]
    if precision != "highest":  # beyond the budget: the exact path
        scales.append(np.full_like(lengthscale, 0.05))
    for scale in scales:
        got, grads = run(q, k, v, scale, cotangent)
        ref, ref_grads = kernel_mv_value_and_grads(q, k, v, scale, cotangent)
        assert rel_err(got, ref) < tolerance, (scale[0], rel_err(got, ref))
        for name, grad, expected in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3],
                                        strict=True):  # fmt: skip
            assert rel_err(grad, expected) < 5 * tolerance, (name, rel_err(grad, expected))
        scale_l = lengthscale_grad_scale(q, k, scale, ref_grads[0], ref_grads[1])
        error_l = np.abs(np.asarray(grads[3], np.float64) - ref_grads[3])
        assert np.all(error_l <= 5 * tolerance * scale_l)


@pytest.mark.parametrize("precision", [None, "highest"])
def test_kde_log_density_at_tiny_bandwidths(precision):
    # Exponents near -1e31 at a bandwidth of 1e-16: the forward pass's row maximum and the
    # backward pass's recomputed exponents must agree to the bit (Triton fuses multiply-adds).
    rng = np.random.default_rng(8)
    data = rng.uniform(size=(700, 3)).astype(np.float32)
    query = rng.uniform(size=(500, 3)).astype(np.float32)
    query[:50] = data[:50]
    weights = rng.uniform(0.2, 1.0, size=700).astype(np.float32)
    g = rng.normal(size=500).astype(np.float32)

    @jax.jit
    def run(query, data, bandwidth, weights, g):
        def log_density(*args):
            return tilax.rbf_kde_density(*args[:3], weights=args[3], log=True, impl="pallas",
                                         precision=precision)  # fmt: skip

        out, vjp = jax.vjp(log_density, query, data, bandwidth, weights)
        return out, vjp(g)

    for bandwidth in (1e-3, 1e-6, 1e-16):
        h = np.float32(bandwidth)
        got, grads = run(query, data, h, weights, g)
        ref, ref_grads = kde_value_and_grads(query, data, h, weights, g, log=True)
        assert np.all(np.isfinite(np.asarray(got))) and rel_err(got, ref) < 1e-6
        for name, grad, expected in zip(("dquery", "ddata", "dh", "dw"), grads, ref_grads,
                                        strict=True):  # fmt: skip
            if np.max(np.abs(expected)) < 1e37:  # within float32
                assert rel_err(grad, expected) < 1e-4, (bandwidth, name, rel_err(grad, expected))


@pytest.mark.parametrize("block_q, block_k, block_o", [(16, 16, 16), (32, 128, 32), (128, 32, 64)])
def test_kernel_mv_explicit_tiles(block_q, block_k, block_o):
    inputs = make_inputs(1, (), 700, 650, 4, 40)
    got, grads = pallas_value_and_grads(*inputs, precision="highest", block_q=block_q,
                                        block_k=block_k, block_o=block_o)  # fmt: skip
    ref, ref_grads = kernel_mv_value_and_grads(*inputs)
    assert rel_err(got, ref) < TOLERANCE["highest"]
    for grad, expected in zip(grads[:3], ref_grads[:3], strict=True):
        assert rel_err(grad, expected) < 5 * TOLERANCE["highest"]
    scale = lengthscale_grad_scale(inputs[0], inputs[1], inputs[3], ref_grads[0], ref_grads[1])
    assert np.all(np.abs(np.asarray(grads[3]) - ref_grads[3]) <= 5 * TOLERANCE["highest"] * scale)


@pytest.mark.parametrize("precision", [None, "high"])
def test_default_tiles_at_a_larger_size_match_xla(precision):
    q, k, v, lengthscale, _ = make_inputs(2, (), 20000, 30000, 8, 16)
    got = jax.jit(lambda *a: tilax.rbf_kernel_mv(*a, impl="pallas", precision=precision))(
        q, k, v, lengthscale
    )
    ref = jax.jit(lambda *a: tilax.rbf_kernel_mv(*a, impl="xla", precision="highest"))(
        q, k, v, lengthscale
    )
    assert rel_err(got, ref) < (1e-4 if precision == "high" else 1e-2)


@pytest.mark.parametrize("log", [True, False])
@pytest.mark.parametrize("precision", [None, "highest", "high"])
def test_kde_matches_float64(log, precision):
    rng = np.random.default_rng(3)
    query = rng.normal(size=(1500, 5)).astype(np.float32)
    data = rng.normal(size=(2100, 5)).astype(np.float32)
    weights = rng.uniform(size=(2100,)).astype(np.float32)
    weights[::7] = 0.0
    cotangent = rng.normal(size=(1500,)).astype(np.float32)
    bandwidth = np.float32(0.4)

    @jax.jit
    def run(query, data, bandwidth, weights, cotangent):
        def density(*args):
            q, d, h, w = args
            return tilax.rbf_kde_density(q, d, h, weights=w, log=log, impl="pallas",
                                         precision=precision)  # fmt: skip

        out, vjp = jax.vjp(density, query, data, bandwidth, weights)
        return out, vjp(cotangent)

    got, grads = run(query, data, bandwidth, weights, cotangent)
    ref, ref_grads = kde_value_and_grads(query, data, bandwidth, weights, cotangent, log=log)
    # The KDE has no value product: its default modes are those of "high".
    tolerance = TOLERANCE[precision or "high"]
    assert rel_err(got, ref) < tolerance
    for name, grad, expected in zip(("dquery", "ddata", "dh", "dw"), grads, ref_grads,
                                    strict=True):  # fmt: skip
        assert rel_err(grad, expected) < 10 * tolerance, (name, rel_err(grad, expected))


def test_kde_log_density_far_from_data():
    rng = np.random.default_rng(4)
    data = rng.normal(size=(5000, 3)).astype(np.float32)
    query = (rng.normal(size=(300, 3)) + 200.0).astype(np.float32)
    log_p = tilax.rbf_kde_density(query, data, 0.5, log=True, impl="pallas")
    ref, _ = kde_value_and_grads(query, data, np.float32(0.5), np.ones(5000), np.ones(300),
                                 log=True)  # fmt: skip
    assert np.all(np.isfinite(log_p))
    assert rel_err(log_p, ref) < 1e-6


def test_bfloat16_inputs():
    q, k, v, lengthscale, cotangent = make_inputs(5, (), 2000, 2000, 8, 16)
    as_bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    got, grads = pallas_value_and_grads(*as_bf16, lengthscale, jnp.asarray(cotangent, jnp.bfloat16))
    assert got.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
    ref, _ = kernel_mv_value_and_grads(*[np.asarray(x, np.float32) for x in as_bf16],
                                       lengthscale, cotangent)  # fmt: skip
    assert rel_err(got, ref) < 1e-2


def test_peak_memory_is_linear_in_n():
    # 4x the points must not mean 16x the memory (no N x M buffer anywhere, fwd or bwd). Both
    # sizes run the same kernels (on Hopper the Mosaic GPU ones, whose operands take more bytes
    # a point than the Triton kernels' that smaller sizes run).
    def peak(n):
        q, k, v, lengthscale, cotangent = make_inputs(6, (), n, n, 8, 16)
        args = [jnp.asarray(x) for x in (q, k, v, lengthscale, cotangent)]
        lowered = jax.jit(
            jax.grad(lambda q, k, v, ls, c: jnp.sum(tilax.rbf_kernel_mv(q, k, v, ls,
                                                                        impl="pallas") * c),
                     argnums=(0, 1, 2, 3))  # fmt: skip
        ).lower(*args)
        analysis = lowered.compile().memory_analysis()
        return analysis.temp_size_in_bytes + analysis.output_size_in_bytes

    small, large = peak(40000), peak(160000)
    assert large < 6 * small, (small, large)


def test_mosaic_kernels_at_a_size_that_chooses_them():
    """At N = M = 40000 (program tiles of 128 rows keep two programs per SM) the default fast
    path runs the Mosaic GPU forward (tilax.rbf.mosaic.forward) and gradient sweeps
    (tilax.rbf.mosaic.grad) on Hopper; against ``"highest"`` (float32-exact) on the
    same data, with keys not a multiple of the tile."""

    if _pallas.mosaic_unavailable_reason() is not None:
        pytest.skip(_pallas.mosaic_unavailable_reason())
    q, k, v, lengthscale, cot = make_inputs(7, (), 40000, 40037, 8, 16)
    config = rbf_config.default_config("triton", None, batch=1, n=40000, m=40037, out=16,
                                          dim=8)
    assert config.fast.fwd.backend == config.fast.dq.backend == config.fast.dk.backend == (
        "mosaic")
    fast, fast_grads = pallas_value_and_grads(q, k, v, lengthscale, cot)
    exact, exact_grads = pallas_value_and_grads(q, k, v, lengthscale, cot, precision="highest")
    assert rel_err(fast, exact) < TOLERANCE["default"]
    for name, got, want in zip(("dq", "dk", "dv"), fast_grads, exact_grads, strict=False):
        assert rel_err(got, want) < 5 * TOLERANCE["default"], name
    scale = lengthscale_grad_scale(q, k, lengthscale, np.asarray(exact_grads[0]),
                                   np.asarray(exact_grads[1]))
    error = np.abs(np.asarray(fast_grads[3], np.float64) - np.asarray(exact_grads[3], np.float64))
    assert np.all(error <= 5 * TOLERANCE["default"] * scale)


def test_mosaic_forward_kernel_values_at_most_one_at_the_budget_edge():
    """The Mosaic GPU forward does not clamp its exponents at 0: the default fast budget keeps
    every bfloat16 kernel value at most 1 (``numerics.FAST_DISTANCE_BUDGET``). Points on a
    sphere whose spread ratio is just inside the budget, each its own query and key; 1024 probe
    keys carry a one-hot value (column ``i % 16``), so that ``out[i, i % 16]`` is ``K_ii`` plus
    the kernel values of probes of the same column, at least 5.8 lengthscales away (under
    1e-7 together): a bfloat16 ``K_ii`` above 1 would be at least ``1 + 2^-7``."""
    from tilax.rbf import numerics

    if _pallas.mosaic_unavailable_reason() is not None:
        pytest.skip(_pallas.mosaic_unavailable_reason())
    n, dim, out = 40000, 8, 16
    budget = numerics.FAST_DISTANCE_BUDGET["default"]
    radius = 0.499 * numerics.max_spread_ratio(dim, budget)
    rng = np.random.default_rng(11)
    half = rng.normal(size=(n // 2, dim))
    half *= radius / np.linalg.norm(half, axis=1, keepdims=True)
    points = jnp.asarray(np.concatenate([half, -half]).astype(np.float32))  # mean 0
    qs, ks = numerics.centered_scaled(points, points, jnp.float32(1.0))
    assert bool(numerics.fast_distance_ok(qs, ks, None))
    assert float(numerics.expansion_error_bound(dim, numerics.spread_ratio(qs, ks))) > (
        0.99 * budget)
    config = rbf_config.default_config("triton", None, batch=1, n=n, m=n, out=out, dim=dim)
    assert config.fast.fwd.backend == "mosaic"
    probes = np.arange(1024)
    values = jnp.zeros((n, out), jnp.float32).at[probes, probes % out].set(1.0)
    got = tilax.rbf_kernel_mv(points, points, values, jnp.float32(1.0), impl="pallas")
    diagonal = np.asarray(got)[probes, probes % out]
    assert diagonal.max() < 1.0 + 2.0**-8
    assert diagonal.min() > 0.99


@pytest.mark.parametrize("isotropic", [False, True])
def test_mosaic_exact_forward_at_a_size_that_chooses_it(isotropic):
    """At N = M = 40000 ``"highest"``'s forward runs the Mosaic GPU exact kernel
    (tilax.rbf.mosaic.exact) on Hopper: float32-accurate against float64 on data far
    from the origin at a small lengthscale (where the expansion is useless), with coincident
    points and keys not a multiple of the tile, and as the Triton difference kernel."""

    if _pallas.mosaic_unavailable_reason() is not None:
        pytest.skip(_pallas.mosaic_unavailable_reason())
    n, m, dim = 40000, 40037, 8
    rng = np.random.default_rng(5)
    lengthscale = np.float32(1e-3) if isotropic else rng.uniform(5e-4, 2e-3, dim).astype(
        np.float32)
    q = (100.0 + 3e-3 * rng.normal(size=(n, dim))).astype(np.float32)
    k = (100.0 + 3e-3 * rng.normal(size=(m, dim))).astype(np.float32)
    k[:1000] = q[:1000]
    v = rng.normal(size=(m, 16)).astype(np.float32)
    config = rbf_config.default_config("triton", "highest", batch=1, n=n, m=m, out=16,
                                          dim=dim)
    assert config.exact.fwd.backend == "mosaic"
    # Explicit tiles keep the Triton difference kernel (the default ones at this size).
    triton = rbf_config.default_config("triton", "highest", batch=1, n=n, m=m, out=16,
                                          dim=dim, block_q=64, block_k=32)
    assert triton.exact.fwd.backend is None

    def forward(cfg):
        return np.asarray(jax.jit(lambda *a: rbf_vjp.kernel_mv_with_config(*a, cfg))(
            q, k, v, lengthscale), np.float64)

    got, baseline = forward(config), forward(triton)
    rows = np.r_[0:128, n - 128:n]  # coincident points, then others
    scales = np.broadcast_to(np.asarray(lengthscale, np.float64), (dim,))
    d2 = sum(((q[rows, d, None].astype(np.float64) - k[None, :, d]) / scales[d]) ** 2
             for d in range(dim))
    kernel = np.exp(-0.5 * d2)
    want, magnitude = kernel @ v.astype(np.float64), kernel @ np.abs(v.astype(np.float64))
    # float32-accurate: each output within a few hundred float32 roundings of the sum of its
    # terms' sizes (the values cancel in the sums: an error relative to the outputs' norm
    # would also measure that cancellation), as the Triton kernel's three TF32 passes.
    for name, result in (("mosaic", got), ("triton", baseline)):
        worst = np.max(np.abs(result[rows] - want) / magnitude)
        assert worst <= 2.0**-16, (name, worst, rel_err(result[rows], want))
    assert rel_err(got, baseline) < 10 * TOLERANCE["highest"], rel_err(got, baseline)


@pytest.mark.parametrize("isotropic", [False, True])
def test_mosaic_exact_gradient_sweeps(isotropic):
    """``"highest"``'s backward runs the Mosaic GPU exact sweeps
    (tilax.rbf.mosaic.exact_grad) by default on Hopper at a size that fills the GPU,
    and matches the Triton difference kernels' (explicit tiles) on data far from the origin at
    a small lengthscale, with coincident points and point counts not multiples of a tile."""

    if _pallas.mosaic_unavailable_reason() is not None:
        pytest.skip(_pallas.mosaic_unavailable_reason())
    n, m, dim = 40000, 40011, 8
    rng = np.random.default_rng(9)
    lengthscale = np.float32(1e-3) if isotropic else rng.uniform(5e-4, 2e-3, dim).astype(
        np.float32)
    q = (100.0 + 3e-3 * rng.normal(size=(n, dim))).astype(np.float32)
    k = (100.0 + 3e-3 * rng.normal(size=(m, dim))).astype(np.float32)
    k[:500] = q[:500]
    v = rng.normal(size=(m, 16)).astype(np.float32)
    cot = rng.normal(size=(n, 16)).astype(np.float32)
    mosaic = rbf_config.default_config("triton", "highest", batch=1, n=n, m=m, out=16,
                                          dim=dim)
    assert mosaic.exact.dq.backend == mosaic.exact.dk.backend == "mosaic"
    triton = rbf_config.default_config("triton", "highest", batch=1, n=n, m=m, out=16,
                                          dim=dim, block_q=64, block_k=32)
    assert triton.exact.dq.backend is None and triton.exact.dk.backend is None

    def grads(config):
        def loss(q, k, v, lengthscale):
            return jnp.sum(rbf_vjp.kernel_mv_with_config(q, k, v, lengthscale, config) * cot)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, lengthscale)

    got, want = grads(mosaic), grads(triton)
    for name, a, b in zip(("dq", "dk", "dv", "dlengthscale"), got, want, strict=True):
        assert rel_err(a, b) < 10 * TOLERANCE["highest"], (name, rel_err(a, b))


@pytest.mark.parametrize("dim, out, block_l", [(8, 64, 128), (14, 48, 64), (19, 48, 64)])
def test_mosaic_gradient_sweep_with_wide_operands(dim, out, block_l):
    """The widest operands that loop tiles of 128 fit in shared memory with (64 value columns),
    and wider ones (TF32 parts of 64 columns with 48 value columns), where the default fast
    backward runs the Mosaic GPU sweep with loop tiles of 64: against ``"highest"`` on the
    same data."""

    if _pallas.mosaic_unavailable_reason() is not None:
        pytest.skip(_pallas.mosaic_unavailable_reason())
    n, m = 40000, 40037
    q, k, v, lengthscale, cot = make_inputs(17, (), n, m, dim, out)
    config = rbf_config.default_config("triton", None, batch=1, n=n, m=m, out=out, dim=dim)
    assert (config.fast.dk.backend, config.fast.dk.block_l) == ("mosaic", block_l)
    fast, fast_grads = pallas_value_and_grads(q, k, v, lengthscale, cot)
    exact, exact_grads = pallas_value_and_grads(q, k, v, lengthscale, cot, precision="highest")
    assert rel_err(fast, exact) < TOLERANCE["default"]
    for name, got, want in zip(("dq", "dk", "dv"), fast_grads, exact_grads, strict=False):
        assert rel_err(got, want) < 5 * TOLERANCE["default"], name


def test_mosaic_gradient_sweep_under_vmap():
    """vmap of the fast path's gradients on the Mosaic GPU sweep (a vmapped axis joins the
    kernel's batch axis) matches one call per example."""
    import dataclasses


    if _pallas.mosaic_unavailable_reason() is not None:
        pytest.skip(_pallas.mosaic_unavailable_reason())
    n, m = 8000, 9001
    q, k, v, lengthscale, cot = make_inputs(13, (2,), n, m, 8, 16)
    triton = rbf_config.default_config("triton", None, batch=1, n=n, m=m, out=16, dim=8)
    sweep = dataclasses.replace(triton.fast.dq, block_p=128, block_l=128, backend="mosaic")
    mosaic = dataclasses.replace(triton, fast=dataclasses.replace(triton.fast, dq=sweep,
                                                                  dk=sweep))

    def grads(q, k, v, cot):
        def loss(q, k, v, lengthscale):
            return jnp.sum(rbf_vjp.kernel_mv_with_config(q, k, v, lengthscale, mosaic) * cot)

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, lengthscale)

    mapped = jax.jit(jax.vmap(grads))(q, k, v, cot)
    for example in range(2):
        one = jax.jit(grads)(q[example], k[example], v[example], cot[example])
        for name, a, b in zip(("dq", "dk", "dv", "dl"), mapped, one, strict=True):
            assert rel_err(a[example], b) < 1e-5, name


@pytest.mark.parametrize("block_l", [64, 128])
def test_mosaic_gradient_sweeps(block_l):
    """The fast path's backward on the Mosaic GPU sweep (tilax.rbf.mosaic.grad; the
    launch sweep's candidate rows) is as accurate as on the Triton sweeps: both against
    ``"highest"``'s gradients on the same data, with point counts not multiples of a tile."""
    import dataclasses


    if _pallas.mosaic_unavailable_reason() is not None:
        pytest.skip(_pallas.mosaic_unavailable_reason())
    n, m = 20000, 20011
    q, k, v, lengthscale, cot = make_inputs(11, (), n, m, 8, 16)
    triton = rbf_config.default_config("triton", None, batch=1, n=n, m=m, out=16, dim=8)
    assert triton.fast.dq.backend is None  # program tiles of 64 at this size: Triton
    sweep = dataclasses.replace(triton.fast.dq, block_p=128, block_l=block_l, backend="mosaic")
    mosaic = dataclasses.replace(triton, fast=dataclasses.replace(triton.fast, dq=sweep,
                                                                  dk=sweep))
    exact = rbf_config.default_config("triton", "highest", batch=1, n=n, m=m, out=16, dim=8)

    def grads(config):
        def loss(q, k, v, lengthscale):
            return jnp.sum(rbf_vjp.kernel_mv_with_config(q, k, v, lengthscale, config) * cot)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, lengthscale)

    got, baseline, want = grads(mosaic), grads(triton), grads(exact)
    for name, a, b, w in zip(("dq", "dk", "dv"), got, baseline, want, strict=False):
        assert rel_err(a, w) < max(1.5 * rel_err(b, w), 1e-3), name
    # d(lengthscale) sums terms that cancel: judge its error against the terms' size.
    scale = lengthscale_grad_scale(q, k, lengthscale, np.asarray(want[0]), np.asarray(want[1]))
    error = np.abs(np.asarray(got[3], np.float64) - np.asarray(want[3], np.float64))
    assert np.all(error <= TOLERANCE["default"] * scale)


# ------------------------------------------------------------------------------------------
# tilax.kernel_mv's Matérn kernels (tilax.rbf.profiles) on the same kernels


def matern_value_and_grads(kernel, q, k, v, lengthscale, cotangent, **kwargs):
    @jax.jit
    def run(q, k, v, lengthscale, cotangent):
        def fn(*args):
            return tilax.kernel_mv(*args, kernel=kernel, impl="pallas", **kwargs)

        out, vjp = jax.vjp(fn, q, k, v, lengthscale)
        return out, vjp(cotangent)

    return run(q, k, v, lengthscale, cotangent)


@pytest.mark.parametrize("kernel", ["matern12", "matern32", "matern52"])
@pytest.mark.parametrize("precision", [None, "highest"])
def test_matern_kernel_mv_matches_float64(kernel, precision):
    """Moderate sizes (the Triton kernels, or the Mosaic GPU ones where chosen) against the
    NumPy float64 oracle, coincident pairs included."""
    from rbf_oracle import stationary_kernel_mv

    q, k, v, lengthscale, cot = make_inputs(3, (), 1500, 1100, 8, 16)
    k[:100] = q[:100]
    got, grads = matern_value_and_grads(kernel, q, k, v, lengthscale, cot, precision=precision)
    ref, ref_grads = stationary_kernel_mv(kernel, q, k, v, lengthscale, cot)
    tolerance = TOLERANCE[precision or "default"]
    assert rel_err(got, ref) < tolerance, rel_err(got, ref)
    for name, grad, expected in zip(("dq", "dk", "dv", "dl"), grads, ref_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(grad))), name
        assert rel_err(grad, expected) < 5 * tolerance, (name, rel_err(grad, expected))


@pytest.mark.parametrize("kernel", ["matern12", "matern32", "matern52"])
def test_matern_mosaic_kernels_at_a_size_that_chooses_them(kernel):
    """At N = M = 40000 the Matérn kernels run the Mosaic GPU kernels of both paths (the
    matern_launches rule): the default's fast forward and sweep (data within the kernel's fast
    budget: lengthscales ten times the data's spread) against ``"highest"``'s exact ones on the
    same data, keys not a multiple of the tile, coincident pairs included."""
    from tilax.rbf import numerics

    if _pallas.mosaic_unavailable_reason() is not None:
        pytest.skip(_pallas.mosaic_unavailable_reason())
    q, k, v, lengthscale, cot = make_inputs(8, (), 40000, 40037, 8, 16)
    k[:500] = q[:500]
    lengthscale = lengthscale * (100.0 if kernel == "matern12" else 10.0)
    qs, ks = numerics.centered_scaled(jnp.asarray(q), jnp.asarray(k), jnp.asarray(lengthscale))
    assert bool(numerics.fast_distance_ok(qs, ks, None, kernel))
    for precision in (None, "highest"):
        config = rbf_config.default_config("triton", precision, batch=1, n=40000, m=40037,
                                           out=16, dim=8, kernel=kernel)  # fmt: skip
        path = config.fast or config.exact
        assert path.kernel == kernel
        assert path.fwd.backend == path.dq.backend == path.dk.backend == "mosaic", precision
    fast, fast_grads = matern_value_and_grads(kernel, q, k, v, lengthscale, cot)
    exact, exact_grads = matern_value_and_grads(kernel, q, k, v, lengthscale, cot,
                                                precision="highest")  # fmt: skip
    assert rel_err(fast, exact) < TOLERANCE["default"]
    for name, got, want in zip(("dq", "dk", "dv"), fast_grads, exact_grads, strict=False):
        assert np.all(np.isfinite(np.asarray(got))), name
        assert rel_err(got, want) < 5 * TOLERANCE["default"], name
    scale = lengthscale_grad_scale(q, k, lengthscale, np.asarray(exact_grads[0]),
                                   np.asarray(exact_grads[1]))  # fmt: skip
    error = np.abs(np.asarray(fast_grads[3], np.float64) - np.asarray(exact_grads[3], np.float64))
    assert np.all(error <= 5 * TOLERANCE["default"] * scale)


@pytest.mark.parametrize("kernel", ["matern12", "matern52"])
def test_matern_values_in_unit_interval_on_the_gpu(kernel):
    """The exp unit's approximate ``exp2`` and ``rsqrt``: every kernel value in [0, 1] (rows of
    the kernel matrix, as K @ one-hot columns), at tiny, unit and huge lengthscales."""
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.normal(size=(2048, 4)).astype(np.float32))
    eye = jnp.eye(2048, 64, dtype=jnp.float32)
    for scale in (1e-3, 1.0, 1e3):
        for precision in (None, "highest"):
            got = np.asarray(tilax.kernel_mv(x, x, eye, jnp.float32(scale), kernel=kernel,
                                             impl="pallas", precision=precision))  # fmt: skip
            assert got.min() >= 0.0 and got.max() <= 1.0, (scale, precision)
