"""The Mosaic GPU kernels' Matérn profiles on a CPU: every kernel lowers for CUDA with a Matérn
profile (its rsqrt and pair weights included), and in JAX's GPU interpret mode
(tests/mosaic_interpret.py) the whole Matérn ``kernel_mv`` with its gradients, through the
Mosaic GPU kernels, matches the Triton kernels' (interpreted), on both distance paths.
tests/rbf/test_rbf_gpu.py runs them on Hopper."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from jax import export

from tilax.rbf import config as rbf_config
from tilax.rbf import numerics
from tilax.rbf import vjp as rbf_vjp
from tilax.rbf.mosaic import exact as mosaic_exact
from tilax.rbf.mosaic import exact_grad as mosaic_exact_grad
from tilax.rbf.mosaic import forward as mosaic_forward
from tilax.rbf.mosaic import grad as mosaic_grad
from tilax.rbf.numerics import Difference, Expansion

PROFILES = ["matern12", pytest.param("matern52", marks=pytest.mark.kernels)]


def _lowers(fn, shapes):
    args = [jax.ShapeDtypeStruct(s, t) for s, t in shapes]
    module = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    assert module.count("mosaic_gpu") >= 1


@pytest.mark.parametrize("profile", PROFILES)
def test_fast_kernels_lower_for_cuda(profile):
    f32, bf16 = jnp.float32, jnp.bfloat16

    def forward(x, y, v):
        return mosaic_forward.kernel_matmul(
            x, y, v, distance=Expansion("tf32_parts"), valid_l=300, block_p=128, block_l=128,
            block_o=16, values="bf16", profile=profile,
        )  # fmt: skip

    _lowers(forward, [((2, 256, 32), f32), ((2, 384, 32), f32), ((2, 384, 32), bf16)])

    def sweep(x, y, coords, own, u, w):
        return mosaic_grad.pair_sums(x, y, coords, own, u, w, valid_l=300, block_l=128,
                                     profile=profile)  # fmt: skip

    _lowers(sweep, [((2, 256, 32), f32), ((2, 384, 32), f32), ((2, 384, 16), f32),
                    ((2, 256, 16), f32), ((2, 256, 16), bf16), ((2, 384, 16), bf16)])  # fmt: skip


@pytest.mark.parametrize("profile", PROFILES)
def test_exact_kernels_lower_for_cuda(profile):
    f32 = jnp.float32

    def forward(x, y, v, scale):
        return mosaic_exact.kernel_matmul(
            x, y, v, distance=Difference(8, True), valid_l=300, block_o=16, values="tf32x3",
            scale=scale, block_p=mosaic_exact.BLOCK_P, block_l=mosaic_exact.BLOCK_L,
            profile=profile,
        )  # fmt: skip

    _lowers(forward, [((2, 8, 256), f32), ((2, 8, 384), f32), ((2, 384, 16), f32), ((8,), f32)])

    def sweep(x, y, u, w, scale):
        return mosaic_exact_grad.pair_sums(
            x, y, u=u, w=w, scale=scale, distance=Difference(8, False), valid_l=300,
            with_squares=True, profile=profile,
        )  # fmt: skip

    _lowers(sweep, [((2, 8, 256), f32), ((2, 8, 320), f32), ((2, 256, 32), f32),
                    ((2, 320, 32), f32), ((1,), f32)])  # fmt: skip


def _on_mosaic(path, fwd, sweep):
    """``path`` with its forward on ``fwd``'s and both backward launches on ``sweep``'s tiles,
    all on Mosaic GPU."""
    fwd = dataclasses.replace(path.fwd, **fwd, backend="mosaic")
    sweep = dataclasses.replace(path.dk, **sweep, backend="mosaic")
    return dataclasses.replace(path, fwd=fwd, dq=sweep, dk=sweep)


def _value_and_grads(config, q, k, v, lengthscale, g):
    def loss(q, k, v, lengthscale):
        return jnp.sum(rbf_vjp.kernel_mv_with_config(q, k, v, lengthscale, config) * g)

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, lengthscale)


def _inputs(n, m, dim, out, spread, seed=5):
    rng = np.random.default_rng(seed)
    q = (spread * rng.standard_normal((n, dim))).astype(np.float32)
    k = (spread * rng.standard_normal((m, dim))).astype(np.float32)
    k[:16] = q[:16]  # coincident pairs
    v = rng.standard_normal((m, out)).astype(np.float32)
    g = rng.standard_normal((n, out)).astype(np.float32)
    return q, k, v, g


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", ["matern12", "matern32", "matern52"])
def test_highest_matches_the_triton_kernels_in_interpret_mode(kernel):
    """``"highest"``: the exact forward and sweep with Matérn profiles, offset data."""
    from mosaic_interpret import interpreter_for_loads

    interpreter = interpreter_for_loads()
    n, m, dim, out = 200, 150, 3, 16
    q, k, v, g = _inputs(n, m, dim, out, 2e-3)
    q, k = q + np.float32(100.0), k + np.float32(100.0)
    lengthscale = np.random.default_rng(6).uniform(5e-4, 2e-3, dim).astype(np.float32)
    triton = rbf_config.default_config("interpret", "highest", batch=1, n=n, m=m, out=out,
                                       dim=dim, kernel=kernel)  # fmt: skip
    tiles = dict(block_p=mosaic_exact_grad.BLOCK_P, block_l=mosaic_exact_grad.BLOCK_L)
    fwd_tiles = dict(block_p=mosaic_exact.BLOCK_P, block_l=mosaic_exact.BLOCK_L)
    mosaic = dataclasses.replace(triton, exact=_on_mosaic(triton.exact, fwd_tiles, tiles))
    want_value, want = _value_and_grads(triton, q, k, v, lengthscale, g)
    with interpreter:
        got_value, got = _value_and_grads(mosaic, q, k, v, lengthscale, g)
    assert np.isclose(got_value, want_value, rtol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dlengthscale"), got, want, strict=True):
        assert rel_err(np.asarray(a, np.float64), np.asarray(b, np.float64)) <= 1e-5, name


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", ["matern12", "matern32", "matern52"])
def test_default_matches_the_triton_kernels_in_interpret_mode(kernel):
    """The default precision within the fast budget: the fast forward and sweep with Matérn
    profiles against the Triton kernels (both bfloat16 value products: a few 2^-9)."""
    from mosaic_interpret import interpreter_for_loads

    interpreter = interpreter_for_loads()
    n, m, dim, out = 200, 150, 3, 16
    q, k, v, g = _inputs(n, m, dim, out, 1.0)
    lengthscale = np.float32(40.0 if kernel != "matern12" else 400.0)
    qs, ks = numerics.centered_scaled(jnp.asarray(q), jnp.asarray(k), lengthscale)
    assert bool(numerics.fast_distance_ok(qs, ks, None, kernel))
    triton = rbf_config.default_config("interpret", None, batch=1, n=n, m=m, out=out, dim=dim,
                                       kernel=kernel)  # fmt: skip
    tiles = dict(block_p=mosaic_grad.BLOCK_P, block_l=mosaic_grad.BLOCK_L)
    fwd_tiles = dict(block_p=mosaic_forward.BLOCK_P, block_l=128)
    mosaic = dataclasses.replace(triton, fast=_on_mosaic(triton.fast, fwd_tiles, tiles))
    want_value, want = _value_and_grads(triton, q, k, v, lengthscale, g)
    with interpreter:
        got_value, got = _value_and_grads(mosaic, q, k, v, lengthscale, g)
    assert np.isclose(got_value, want_value, rtol=2e-2)
    for name, a, b in zip(("dq", "dk", "dv", "dlengthscale"), got, want, strict=True):
        assert rel_err(np.asarray(a, np.float64), np.asarray(b, np.float64)) <= 2e-2, name
