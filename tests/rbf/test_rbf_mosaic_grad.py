"""The Mosaic GPU gradient sweep of the RBF fast path (tilax.rbf.mosaic.grad) on a CPU:
its three pair sums in JAX's GPU interpret mode against float64 (the queries' sums added up
across programs by TMA reductions), under vmap, its lowering for CUDA, the settings it refuses,
and where the default config chooses it. tests/rbf/test_rbf_gpu.py runs it on
Hopper."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from jax import export

from tilax.rbf import config as rbf_config
from tilax.rbf import numerics
from tilax.rbf import vjp as rbf_vjp
from tilax.rbf.mosaic import grad as mosaic_grad
from tilax.rbf.numerics import Expansion

PARTS = Expansion("tf32_parts")


def _interpreter():
    from mosaic_interpret import available, gpu_interpreter

    reason = available()
    if reason:
        pytest.skip(reason)
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu.core import layout_cast_p

    mlir.register_lowering(layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    return gpu_interpreter()


@pytest.mark.kernels
@pytest.mark.parametrize("n, m, block_l", [(150, 200, 64), (130, 100, 128), (60, 100, 64)])
def test_pair_sums_match_float64_in_interpret_mode(n, m, block_l):
    """The three sums of one sweep (programs over keys): the keys' sums and dv-like sums, and
    the queries' sums added up across programs (two programs of keys in the first case, loop
    tiles started at different offsets, the last one partial; one partial tile in the last)."""
    rng = np.random.default_rng(3)
    dim, out = 3, 5
    qs = rng.standard_normal((1, n, dim)).astype(np.float32)
    ks = rng.standard_normal((1, m, dim)).astype(np.float32)
    g = rng.standard_normal((1, n, out)).astype(np.float32)
    v = rng.standard_normal((1, m, out)).astype(np.float32)
    rows_q, rows_k = -(-n // block_l) * block_l, -(-m // 128) * 128
    x, y = rbf_vjp.expansion_points(PARTS, jnp.asarray(qs), jnp.asarray(ks), rows_q, rows_k)
    queries = rbf_vjp.augment_queries(jnp.asarray(qs), rows_q)
    keys = rbf_vjp.augment_keys(jnp.asarray(ks), rows_k)
    g_pad = rbf_vjp.value_operand(jnp.asarray(g), rows_q, 16, "bf16")
    v_pad = rbf_vjp.value_operand(jnp.asarray(v), rows_k, 16, "bf16")
    # Padded loop rows hold garbage: only the index mask keeps them out.
    g_pad = g_pad.at[:, n:].set(7.0)
    queries = queries.at[:, n:].set(3.0)
    with _interpreter():
        got = mosaic_grad.pair_sums(y, x, queries, keys, v_pad, g_pad, valid_l=n,
                                           block_l=block_l)
    q64, k64 = qs[0].astype(np.float64), ks[0].astype(np.float64)
    kernel = np.exp(-0.5 * ((q64[:, None] - k64[None]) ** 2).sum(-1))  # [n, m]
    g16 = np.asarray(g_pad[0, :n, :out].astype(jnp.float32), np.float64)
    v16 = np.asarray(v_pad[0, :m, :out].astype(jnp.float32), np.float64)
    # The pair weights rounded to bfloat16, as the kernel rounds them ("bf16x2" coordinates);
    # its float32 weights differ from these float64 ones by far less than a rounding step.
    a = np.asarray(jnp.asarray(kernel * (g16 @ v16.T), jnp.float32).astype(jnp.bfloat16),
                   np.float64)
    wants = {"loop_sums": a @ np.asarray(keys[0, :m], np.float64),
             "sums": a.T @ np.asarray(queries[0, :n], np.float64)}
    for name, want in wants.items():
        rows = want.shape[0]
        sums = np.asarray(got[name][0], np.float64)
        assert sums.shape[1] == 16, name
        # Coordinates in bfloat16 hi + lo, TF32 parts exponents: float32-like sums of the
        # rounded weights (unrounded weights, or coordinates in single bfloat16, are 1e-3 off)
        assert rel_err(sums[:rows], want) < 1e-4, name
    assert np.all(np.asarray(got["loop_sums"][0, n:]) == 0.0)  # masked loop rows get nothing
    pw = np.asarray(got["pw"][0, :m, :out], np.float64)
    want_pw = kernel.T @ g16
    assert rel_err(pw, want_pw) < 1e-2  # bfloat16 kernel


@pytest.mark.kernels
def test_pair_sums_under_vmap_in_interpret_mode():
    """A vmapped axis joins the batch axis (the kernel itself has no batching rule)."""
    rng = np.random.default_rng(4)
    rows_q, rows_k = 64, 128
    x = jnp.asarray(rng.standard_normal((2, 1, rows_q, 16)).astype(np.float32) * 0.1)
    y = jnp.asarray(rng.standard_normal((2, 1, rows_k, 16)).astype(np.float32) * 0.1)
    queries = jnp.asarray(rng.standard_normal((2, 1, rows_q, 16)).astype(np.float32))
    keys = jnp.asarray(rng.standard_normal((2, 1, rows_k, 16)).astype(np.float32))
    g = jnp.asarray(rng.standard_normal((2, 1, rows_q, 16))).astype(jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 1, rows_k, 16))).astype(jnp.bfloat16)

    def sweep(x, y, queries, keys, v, g):
        return mosaic_grad.pair_sums(y, x, queries, keys, v, g, valid_l=50, block_l=64)

    with _interpreter():
        mapped = jax.vmap(sweep)(x, y, queries, keys, v, g)
        one = sweep(x[1], y[1], queries[1], keys[1], v[1], g[1])
    for name in ("sums", "pw", "loop_sums"):
        np.testing.assert_allclose(mapped[name][1], one[name], rtol=1e-6, atol=1e-6)


def test_lowers_for_cuda():
    shapes = {"x": ((2, 256, 32), jnp.float32), "y": ((2, 384, 32), jnp.float32),
              "coords": ((2, 384, 16), jnp.float32), "own": ((2, 256, 16), jnp.float32),
              "u": ((2, 256, 16), jnp.bfloat16), "w": ((2, 384, 16), jnp.bfloat16)}
    args = [jax.ShapeDtypeStruct(s, t) for s, t in shapes.values()]

    def sweep(x, y, coords, own, u, w):
        return mosaic_grad.pair_sums(x, y, coords, own, u, w, valid_l=300, block_l=128)

    module = export.export(jax.jit(sweep), platforms=["cuda"])(*args).mlir_module()
    assert module.count("mosaic_gpu") >= 1
    batched = [jax.ShapeDtypeStruct((3, *a.shape), a.dtype) for a in args]
    module = export.export(jax.jit(jax.vmap(sweep)), platforms=["cuda"])(*batched).mlir_module()
    assert module.count("mosaic_gpu") >= 1


@pytest.mark.parametrize("shapes, block_l, match", [
    (dict(x=(1, 128, 80)), 64, "parts width 80"),
    (dict(coords=(1, 128, 24), own=(1, 128, 24)), 64, "coordinates width 24"),
    (dict(own=(1, 128, 32)), 64, "own coordinates width 32"),
    (dict(u=(1, 128, 128), w=(1, 128, 128)), 64, "value columns 128"),
    (dict(x=(1, 64, 32), u=(1, 64, 16), own=(1, 64, 16)), 64, "P=64"),
    ({}, 32, "loop tile 32"),
])
def test_unsupported_settings_say_why(shapes, block_l, match):
    sizes = dict(x=(1, 128, 32), y=(1, 128, 32), coords=(1, 128, 16), own=(1, 128, 16),
                 u=(1, 128, 16), w=(1, 128, 16)) | shapes
    arrays = {name: jnp.zeros(size, jnp.bfloat16 if name in "uw" else jnp.float32)
              for name, size in sizes.items()}
    with pytest.raises(ValueError, match=match):
        mosaic_grad.pair_sums(**arrays, valid_l=128, block_l=block_l)


@pytest.mark.kernels
def test_fast_path_gradients_through_the_mosaic_sweeps_match_float64_in_interpret_mode():
    import dataclasses

    from rbf_oracle import kernel_mv_value_and_grads

    from tilax.rbf import config as rbf_config
    from tilax.rbf import vjp as rbf_vjp

    rng = np.random.default_rng(5)
    n, m, dim, out = 130, 150, 3, 5  # partial tiles in both sweeps
    qs = (rng.standard_normal((1, n, dim)) * 0.8).astype(np.float32)  # centred, scaled points
    ks = (rng.standard_normal((1, m, dim)) * 0.8).astype(np.float32)
    v = rng.standard_normal((1, m, out)).astype(np.float32)
    cot = rng.standard_normal((1, n, out)).astype(np.float32)
    cfg = rbf_config.default_config("interpret", None, batch=1, n=n, m=m, out=out, dim=dim)
    sweep = rbf_config.Launch(128, 64, cfg.fast.dq.block_o, backend="mosaic")
    path = dataclasses.replace(cfg.fast, dq=sweep, dk=sweep)

    # The forward runs the Triton kernel in interpret mode, the backward the Mosaic sweeps in
    # JAX's GPU interpreter (which takes no Triton kernels).
    _, backward = jax.vjp(lambda qs, ks, v: rbf_vjp._kernel_mv_fast(qs, ks, v, path),
                          *map(jnp.asarray, (qs, ks, v)))
    with _interpreter():
        grads = backward(jnp.asarray(cot))
    _, want = kernel_mv_value_and_grads(qs[0], ks[0], v[0], 1.0, cot[0])
    for name, got, expected in zip(("dq", "dk", "dv"), grads, want, strict=False):
        # bfloat16 values and cotangents (about 2.5e-3 here), as the Triton sweeps of the
        # default precision
        assert rel_err(got[0], expected) < 5e-3, name


HOPPER = rbf_config.Device(mosaic=True, cores=132, shared_memory=232448)


def _gradient_launches(precision=None, n=65536, dim=8, out=16, device=HOPPER, **settings):
    config = rbf_config.default_config("triton", precision, batch=1, n=n, m=n, out=out,
                                       dim=dim, device=device, **settings)
    return config.fast.dq, config.fast.dk


def test_chosen_for_rbf_kernel_mv_on_hopper():
    dq, dk = _gradient_launches()
    assert dq.backend == dk.backend == "mosaic"
    assert (dq.block_p, dq.block_l) == (dk.block_p, dk.block_l) == (128, 128)
    assert _gradient_launches(block_q=128, block_k=128) == (dq, dk)  # the caller's tiles
    assert _gradient_launches(block_q=64)[0].backend is None  # program tiles of 64: Triton
    assert _gradient_launches(block_k=64)[1].backend is None  # (the key sweep's)
    assert _gradient_launches("high")[0].backend is None  # bfloat16 x 3 values
    assert _gradient_launches(dim=20)[0].backend is None  # parts wider than 64 columns
    assert _gradient_launches(out=100)[0].backend is None  # 128 value columns
    assert _gradient_launches(n=4096)[0].backend is None  # program tiles under 128 rows
    assert _gradient_launches(op="kde")[0].backend is None  # the KDE has no Mosaic sweeps
    no_mosaic = rbf_config.Device(mosaic=False, cores=132, shared_memory=232448)
    assert _gradient_launches(device=no_mosaic)[0].backend is None


def test_loop_tiles_of_64_where_128_do_not_fit():
    """Wide operands (here D = 10: TF32 parts of 64 columns, with 48 value columns or more)
    take loop tiles of 64, whose buffers fit in shared memory; at every width the kernel
    supports, one of the two fits."""
    from tilax.rbf.config import expansion_width, parts_width

    for dim, out, block_l in ((8, 16, 128), (8, 64, 128), (10, 32, 128), (10, 48, 64),
                              (19, 16, 64), (19, 64, 64)):
        dq, dk = _gradient_launches(dim=dim, out=out)
        assert dq.backend == dk.backend == "mosaic", (dim, out)
        assert dk.block_l == block_l, (dim, out)
        need = rbf_config.mosaic_sweep_shared_memory_bytes(
            parts_width(dim), expansion_width(dim), -(-out // 16) * 16, block_l)
        assert need <= HOPPER.shared_memory - rbf_config.MOSAIC_BARRIER_BYTES, (dim, out)
    # the caller's 128, which does not fit: Triton
    assert _gradient_launches(dim=10, out=48, block_q=128)[1].backend is None


def test_default_config_names_a_wrong_op():
    with pytest.raises(ValueError, match="op must be 'kernel_mv' or 'kde', not 'kmv'"):
        rbf_config.default_config("triton", None, batch=1, n=8, m=8, out=1, dim=2, op="kmv")


def test_pair_weights_round_to_the_nearest_bfloat16_as_the_triton_sweeps_do():
    """The sweep's integer rounding of the pair weights (no conversion instruction) gives the
    bits of ``numerics.split``'s bfloat16 ``hi``: nearest, ties away from zero, for either
    sign, zero and values whose rounding carries into the exponent."""
    rng = np.random.default_rng(3)
    tie = 1.0 + 2.0**-8  # halfway between two bfloat16 neighbours
    a = np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.integers(-25, 25, 4096),
                        [0.0, -0.0, 1.0, -1.0, tie, -tie, 2.0 - 2.0**-23]]).astype(np.float32)
    got = mosaic_grad.rounded_bfloat16(jnp.asarray(a))
    (want, _) = numerics.split(jnp.asarray(a), "bf16x2")
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.view(jnp.uint16)),
                                  np.asarray(want.view(jnp.uint16)))
    assert np.all(np.abs(np.asarray(got, np.float64) - a) <= 2.0**-8 * np.abs(a))
    assert float(got[-3]) == 1.0 + 2.0**-7 and float(got[-1]) == 2.0  # away from zero
