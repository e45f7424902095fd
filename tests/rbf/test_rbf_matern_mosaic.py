"""The Mosaic GPU kernels' Matérn profiles on a CPU: every kernel lowers for CUDA with a Matérn
profile (its rsqrt and pair weights included), and in JAX's GPU interpret mode
(tests/mosaic_interpret.py) the whole ``"highest"`` Matérn ``kernel_mv`` with its gradients,
through the Mosaic GPU exact kernels, matches the Triton kernels' (interpreted), and the fast
forward and sweep with Matérn profiles match the float64 oracle.
tests/rbf/test_rbf_gpu.py runs them on Hopper."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from jax import export
from rbf_oracle import stationary_kernel_mv, stationary_profile

from tilax.rbf import config as rbf_config
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


def _inputs(n, m, dim, out, spread, seed=5, coincident=16):
    rng = np.random.default_rng(seed)
    q = (spread * rng.standard_normal((n, dim))).astype(np.float32)
    k = (spread * rng.standard_normal((m, dim))).astype(np.float32)
    k[:coincident] = q[:coincident]
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


def _fast_interpreter():
    """JAX's GPU interpreter for the fast kernels (layout casts as identities)."""
    from mosaic_interpret import available, gpu_interpreter

    reason = available()
    if reason:
        pytest.skip(reason)
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu.core import layout_cast_p

    mlir.register_lowering(layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    return gpu_interpreter()


# The default precision's fast kernels, each on its own (in kernel_mv, the fast/exact switch
# traces the exact branch too, whose default-precision kernels are Triton's, which the GPU
# interpreter does not run): against the NumPy float64 oracle.


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", ["matern12", "matern32", "matern52"])
def test_fast_forward_matches_float64_in_interpret_mode(kernel):
    n, m, dim, out, lengthscale = 128, 200, 8, 16, 3.0
    q, k, v, _ = _inputs(n, m, dim, out, 1.0)
    qs, ks = jnp.asarray(q / lengthscale), jnp.asarray(k / lengthscale)
    x, y = rbf_vjp.expansion_points(Expansion("tf32_parts"), qs[None], ks[None], 128, 256)
    values = rbf_vjp.value_operand(jnp.asarray(v)[None], 256, out, "bf16")
    # Padded keys hold garbage: only the index mask in the last tile keeps them out.
    values = values.at[:, m:].set(1e3)
    with _fast_interpreter():
        got = mosaic_forward.kernel_matmul(
            x, y, values, distance=Expansion("tf32_parts"), valid_l=m, block_p=128,
            block_l=128, block_o=16, values="bf16", profile=kernel,
        )  # fmt: skip
    want, _ = stationary_kernel_mv(kernel, q, k, v, np.float32(lengthscale),
                                   np.zeros((n, out), np.float32))  # fmt: skip
    assert rel_err(np.asarray(got)[0, :n], want) < 1e-2  # bfloat16 kernel values


@pytest.mark.kernels
@pytest.mark.parametrize("kernel", ["matern12", "matern32", "matern52"])
def test_fast_sweep_matches_float64_in_interpret_mode(kernel):
    """The sweep's three sums with the profile's pair weights (for ``A``) and values (for
    ``pw``). Raw sums, before the differencing that forms the gradients: no near pairs,
    whose Matérn-1/2 weight the expansion's rounding sets (``profiles.FAST_SQUARE_FLOOR``)."""
    n, m, dim, out, block_l = 150, 200, 3, 5, 64
    q, k, v, g = _inputs(n, m, dim, out, 1.0, coincident=0)
    qs, ks = jnp.asarray(q)[None], jnp.asarray(k)[None]
    rows_q, rows_k = -(-n // block_l) * block_l, -(-m // 128) * 128
    x, y = rbf_vjp.expansion_points(Expansion("tf32_parts"), qs, ks, rows_q, rows_k)
    queries, keys = rbf_vjp.augment_queries(qs, rows_q), rbf_vjp.augment_keys(ks, rows_k)
    g_pad = rbf_vjp.value_operand(jnp.asarray(g)[None], rows_q, 16, "bf16")
    v_pad = rbf_vjp.value_operand(jnp.asarray(v)[None], rows_k, 16, "bf16")
    with _fast_interpreter():
        got = mosaic_grad.pair_sums(y, x, queries, keys, v_pad, g_pad, valid_l=n,
                                    block_l=block_l, profile=kernel)  # fmt: skip
    r = np.sqrt(((q.astype(np.float64)[:, None] - k.astype(np.float64)[None]) ** 2).sum(-1))
    value, weight = stationary_profile(kernel, r)  # [n, m]
    g16 = np.asarray(g_pad[0, :n, :out].astype(jnp.float32), np.float64)
    v16 = np.asarray(v_pad[0, :m, :out].astype(jnp.float32), np.float64)
    a = weight * (g16 @ v16.T)
    wants = {"loop_sums": a @ np.asarray(keys[0, :m], np.float64),
             "sums": a.T @ np.asarray(queries[0, :n], np.float64)}  # fmt: skip
    for name, want in wants.items():
        sums = np.asarray(got[name][0], np.float64)[: want.shape[0]]
        # Pair weights rounded to bfloat16 (and the expansion's distances near r = 0).
        assert rel_err(sums, want) < 2e-2, name
    assert rel_err(np.asarray(got["pw"][0, :m, :out], np.float64), value.T @ g16) < 1e-2
