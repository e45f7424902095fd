"""The Mosaic GPU exact gradient sweep (tilax.rbf.mosaic.exact_grad) on a CPU: the whole
``"highest"`` backward through it in JAX's GPU interpret mode (tests/mosaic_interpret.py)
against the Triton kernels' (interpreted), its sums against a float64 oracle, lowering for
CUDA (with the column sums' shuffles, which the interpreter replaces by ``jnp.sum``), and the
settings it refuses. Registers, layouts and timing are the GPU's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from jax import export

from tilax.rbf import config as rbf_config
from tilax.rbf import vjp as rbf_vjp
from tilax.rbf.mosaic import exact as mosaic_exact
from tilax.rbf.mosaic import exact_grad as mosaic_exact_grad
from tilax.rbf.numerics import Difference

SWEEP = dict(block_p=mosaic_exact_grad.BLOCK_P, block_l=mosaic_exact_grad.BLOCK_L)


def _mosaic_config(config):
    """``config`` with the exact path's forward and backward (both launches) on Mosaic GPU."""
    exact = config.exact
    fwd = dataclasses.replace(exact.fwd, block_p=mosaic_exact.BLOCK_P,
                              block_l=mosaic_exact.BLOCK_L, backend="mosaic")
    sweep = dataclasses.replace(exact.dq, **SWEEP, backend="mosaic")
    return dataclasses.replace(config, exact=dataclasses.replace(exact, fwd=fwd, dq=sweep,
                                                                 dk=sweep))


@pytest.mark.kernels
@pytest.mark.parametrize("isotropic", [False, True])
def test_highest_gradients_match_the_triton_kernels_in_interpret_mode(isotropic):
    from mosaic_interpret import interpreter_for_loads

    interpreter = interpreter_for_loads()
    n, m, dim, out = 200, 150, 3, 16
    rng = np.random.default_rng(3)
    q = (100.0 + 2e-3 * rng.standard_normal((n, dim))).astype(np.float32)
    k = (100.0 + 2e-3 * rng.standard_normal((m, dim))).astype(np.float32)
    k[:20] = q[:20]
    v = rng.standard_normal((m, out)).astype(np.float32)
    g = rng.standard_normal((n, out)).astype(np.float32)
    lengthscale = (np.float32(1e-3) if isotropic
                   else rng.uniform(5e-4, 2e-3, dim).astype(np.float32))
    triton = rbf_config.default_config("interpret", "highest", batch=1, n=n, m=m, out=out,
                                          dim=dim)
    mosaic = _mosaic_config(triton)

    def value_and_grads(config):
        def loss(q, k, v, lengthscale):
            return jnp.sum(rbf_vjp.kernel_mv_with_config(q, k, v, lengthscale, config) * g)

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, lengthscale)

    want_value, want = value_and_grads(triton)
    with interpreter:
        got_value, got = value_and_grads(mosaic)
    assert np.isclose(got_value, want_value, rtol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dlengthscale"), got, want, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert rel_err(a, b) <= 1e-5, name


@pytest.mark.kernels
@pytest.mark.parametrize("per_dimension, dims", [(True, 4), (False, 4), (True, 1)])
def test_pair_sums_match_float64_in_interpret_mode(per_dimension, dims):
    """Each output of one sweep against float64 sums over the pairs, with a partial last
    query tile (valid_l = 150 of 192 rows) and padded keys."""
    from mosaic_interpret import interpreter_for_loads

    interpreter = interpreter_for_loads()
    rng = np.random.default_rng(5)
    num_keys, num_queries, valid_l, out = 128, 192, 150, 16
    x = rng.normal(size=(1, dims, num_keys)).astype(np.float32)
    y = rng.normal(size=(1, dims, num_queries)).astype(np.float32)
    scale = (rng.uniform(0.5, 1.0, dims) if per_dimension else rng.uniform(0.5, 1.0, 1)).astype(
        np.float32)
    u = rng.normal(size=(1, num_keys, out)).astype(np.float32)
    w = rng.normal(size=(1, num_queries, out)).astype(np.float32)
    with interpreter:
        got = mosaic_exact_grad.pair_sums(
            x, y, distance=Difference(dims, per_dimension), valid_l=valid_l, scale=scale,
            u=u, w=w, with_squares=True)
    got = {name: np.asarray(a, np.float64) for name, a in got.items()}
    e = x[0, :, :, None].astype(np.float64) - y[0, :, None, :valid_l]  # [D, keys, queries]
    r = scale.astype(np.float64)[:, None, None]
    t = -np.sum((r * e) ** 2, axis=0) if per_dimension else -r[0] ** 2 * np.sum(e**2, axis=0)
    kernel = np.exp2(t)
    a = kernel * (u[0].astype(np.float64) @ w[0, :valid_l].T.astype(np.float64))
    want = {"sums": np.sum(a * e, axis=2) * (r[:, :, 0] if per_dimension else 1.0),
            "pw": kernel @ w[0, :valid_l].astype(np.float64),
            "loop_sums": np.sum(a * e, axis=1)}
    assert got["loop_sums"].shape == (1, dims, 4, num_queries)
    loop = got["loop_sums"][0].sum(axis=1)
    np.testing.assert_allclose(loop[:, :valid_l], want["loop_sums"], rtol=1e-5, atol=1e-5)
    assert not loop[:, valid_l:].any()  # masked queries add nothing
    np.testing.assert_allclose(got["sums"][0], want["sums"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["pw"][0], want["pw"], rtol=1e-5, atol=1e-5)
    if per_dimension:
        squares = np.sum(a * e**2, axis=2) * r[:, :, 0] ** 2
        np.testing.assert_allclose(got["squares"][0], squares, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_allclose(got["rows"][0, 0], np.sum(a * t, axis=1), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.kernels
def test_pair_sums_under_vmap_fold_the_mapped_axis_into_the_batch():
    """The sweep runs under run_state (no batching rule): vmap gives each item's sums."""
    from mosaic_interpret import interpreter_for_loads

    interpreter = interpreter_for_loads()
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 1, 4, 128)).astype(np.float32)
    y = rng.normal(size=(2, 1, 4, 64)).astype(np.float32)
    u = rng.normal(size=(2, 1, 128, 16)).astype(np.float32)
    w = rng.normal(size=(1, 64, 16)).astype(np.float32)  # not mapped
    scale = np.ones(4, np.float32)

    def sums(x, y, u):
        return mosaic_exact_grad.pair_sums(
            x, y, distance=Difference(4, True), valid_l=64, scale=scale, u=u, w=w,
            with_squares=True)

    with interpreter:
        mapped = jax.vmap(sums)(x, y, u)
    for item in range(2):
        with interpreter_for_loads():
            alone = sums(x[item], y[item], u[item])
        for name, value in alone.items():
            np.testing.assert_allclose(np.asarray(mapped[name][item]), np.asarray(value),
                                       rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("per_dimension", [True, False])
def test_lowers_for_cuda(per_dimension):
    f32 = jnp.float32
    args = [jax.ShapeDtypeStruct(s, f32) for s in ((2, 8, 256), (2, 8, 320), (2, 256, 32),
                                                   (2, 320, 32), (8 if per_dimension else 1,))]

    def sweep(x, y, u, w, scale):
        return mosaic_exact_grad.pair_sums(
            x, y, u=u, w=w, scale=scale, distance=Difference(8, per_dimension), valid_l=300,
            with_squares=True)

    module = export.export(jax.jit(sweep), platforms=["cuda"])(*args).mlir_module()
    assert module.count("mosaic_gpu") >= 1


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(distance=Difference(8, True, rounded=True)), "unrounded"),
        (dict(distance=Difference(32, True)), "32 dimensions"),
        (dict(block_l=128), "must be 64"),
    ],
)
def test_unsupported_settings_say_why(settings, match):
    x = jnp.zeros((1, 8, 128), jnp.float32)
    u = jnp.zeros((1, 128, 16), jnp.float32)
    kwargs = dict(distance=Difference(8, True), valid_l=128, scale=jnp.ones(8), u=u, w=u,
                  with_squares=True) | settings
    with pytest.raises(ValueError, match=match):
        mosaic_exact_grad.pair_sums(x, x, **kwargs)
    with pytest.raises(ValueError, match="value columns 80"):
        wide = jnp.zeros((1, 128, 80), jnp.float32)
        mosaic_exact_grad.pair_sums(
            x, x, **(kwargs | dict(u=wide, w=wide, distance=Difference(8, True), block_l=64)))
