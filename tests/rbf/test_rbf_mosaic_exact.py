"""The Mosaic GPU exact RBF forward (tilax.rbf.mosaic.exact) on a CPU: the exact split
of kernel values, results in JAX's GPU interpret mode (tests/mosaic_interpret.py) against
float64, lowering for CUDA, the settings it refuses, and when ``"highest"`` chooses it.
Layouts, registers and timing are the GPU tests' (tests/rbf/test_rbf_gpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from rbf_oracle import kernel_mv_float64

from tilax.rbf import config as rbf_config
from tilax.rbf import numerics
from tilax.rbf import vjp as rbf_vjp
from tilax.rbf.mosaic import common as mosaic_common
from tilax.rbf.mosaic import exact as mosaic_exact
from tilax.rbf.mosaic import exact_grad as mosaic_exact_grad
from tilax.rbf.numerics import Difference

BLOCK = dict(block_p=mosaic_exact.BLOCK_P, block_l=mosaic_exact.BLOCK_L)


def test_paired_columns_put_each_threads_keys_of_two_chunks_side_by_side():
    # In wgmma's register layout the thread of lane L holds columns 8 j + 2 (L & 3) + {0, 1}
    # of every 8-column chunk j; paired_keys reads four of them, chunks 2 i and 2 i + 1, at
    # 16 i + 4 (L & 3).
    keys = np.arange(2 * 48, dtype=np.float32).reshape(2, 48)
    paired = np.asarray(mosaic_common.paired_columns(jnp.asarray(keys)))
    for lane in range(32):
        quad = lane & 3
        for i in range(3):
            four = paired[:, 16 * i + 4 * quad: 16 * i + 4 * quad + 4]
            columns = [8 * j + 2 * quad + p for j in (2 * i, 2 * i + 1) for p in (0, 1)]
            np.testing.assert_array_equal(four, keys[:, columns])


def test_split3_is_exact_to_float32():
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.uniform(0, 1, 100000), rng.uniform(0, 1, 1000) * 2.0**-60,
                        [1.0, 0.0, 1 - 2.0**-24, 2.0**-126]]).astype(np.float32)
    parts = mosaic_common.split3(jnp.asarray(a))
    assert all(part.dtype == jnp.bfloat16 for part in parts)
    total = sum(np.asarray(part).astype(np.float64) for part in parts)
    assert np.all(np.abs(total - a) <= 2.0**-24 * np.abs(a))
    hi, mid, _ = (np.abs(np.asarray(part).astype(np.float64)) for part in parts)
    assert np.all(mid <= 2.0**-7 * hi)  # truncation: each part below the one before


def _operands(n, m, dim, out, lengthscale, seed=0, offset=0.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((1, n, dim)) * lengthscale * 3 + offset).astype(np.float32)
    k = (rng.standard_normal((1, m, dim)) * lengthscale * 3 + offset).astype(np.float32)
    v = rng.standard_normal((1, m, out)).astype(np.float32)
    return q, k, v


def _kernel_operands(q, k, v, lengthscale, per_dimension):
    rows_q = mosaic_exact.BLOCK_P * -(-q.shape[1] // mosaic_exact.BLOCK_P)
    rows_k = mosaic_exact.BLOCK_L * -(-k.shape[1] // mosaic_exact.BLOCK_L)
    ls = jnp.asarray(lengthscale, jnp.float32)
    power, residual = numerics.exact_scales(ls)
    x = rbf_vjp.exact_points(jnp.asarray(q), power, rows_q)
    y = rbf_vjp.exact_points(jnp.asarray(k), power, rows_k)
    scale = rbf_vjp.exact_scale(residual, q.shape[-1] if per_dimension else None)
    values = rbf_vjp.value_operand(jnp.asarray(v), rows_k, 16, "tf32x3")
    return x, y, values, scale


@pytest.mark.kernels
@pytest.mark.parametrize("per_dimension", [True, False])
def test_forward_matches_float64_in_interpret_mode(per_dimension):
    from mosaic_interpret import interpreter_for_loads

    interpreter = interpreter_for_loads()
    n, m, dim = 128, 200, 3
    # Far from the origin at a small lengthscale: the expansion would be useless here.
    lengthscale = np.array([1e-3, 2e-3, 1.5e-3]) if per_dimension else 1e-3
    q, k, v = _operands(n, m, dim, 16, 1e-3, offset=100.0)
    k[0, :50] = q[0, :50]  # coincident points: kernel values of exactly 1
    x, y, values, scale = _kernel_operands(q, k, v, lengthscale, per_dimension)
    # Padded keys hold garbage: only the index mask in the last tile keeps them out.
    y, values = y.at[:, :, m:].set(0.0), values.at[:, m:].set(1e3)
    with interpreter:
        out = mosaic_exact.kernel_matmul(
            x, y, values, distance=Difference(dim, per_dimension), valid_l=m, block_o=16,
            values="tf32x3", scale=scale, **BLOCK,
        )  # fmt: skip
    want = kernel_mv_float64(q[0], k[0], v[0], lengthscale)
    got = np.asarray(out)[0, :n]
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


# Value tiles of 64 columns or more group wgmma's K by 64: chunks of the key tile follow.
@pytest.mark.parametrize("block_o", [16, 32, 64])
def test_lowers_for_cuda(block_o):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 8, 256), (2, 8, 384),
                                                           (2, 384, 128), (8,))]

    def forward(x, y, v, scale):
        return mosaic_exact.kernel_matmul(
            x, y, v, distance=Difference(8, True), valid_l=300, block_o=block_o,
            values="tf32x3", scale=scale, **BLOCK,
        )  # fmt: skip

    module = export.export(jax.jit(forward), platforms=["cuda"])(*args).mlir_module()
    assert module.count("mosaic_gpu") >= 1


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(distance=Difference(8, True, rounded=True)), "unrounded"),
        (dict(distance=Difference(32, True)), "32 dimensions"),
        (dict(values="bf16"), "float32 accuracy"),
        (dict(block_p=64), "must be 128"),
        (dict(block_o=8), "value tile 8"),
    ],
)
def test_unsupported_settings_say_why(settings, match):
    x = jnp.zeros((1, 8, 128), jnp.float32)
    v = jnp.zeros((1, 128, 16), jnp.float32)
    kwargs = dict(distance=Difference(8, True), valid_l=128, block_o=16, values="tf32x3",
                  scale=jnp.ones(8), **BLOCK) | settings
    with pytest.raises(ValueError, match=match):
        mosaic_exact.kernel_matmul(x, x, v, **kwargs)


HOPPER = rbf_config.Device(mosaic=True, cores=132, shared_memory=232448)
NO_MOSAIC = rbf_config.Device(mosaic=False, cores=132, shared_memory=232448)


def _exact_path(precision="highest", n=65536, dim=8, out=16, op="kernel_mv", m=None,
                device=HOPPER, **tiles):
    return rbf_config.default_config("triton", precision, batch=1, n=n, m=m or n, out=out,
                                     dim=dim, device=device, op=op, **tiles).exact


def _exact_forward(*args, **kwargs):
    return _exact_path(*args, **kwargs).fwd


def test_chosen_for_the_highest_forward_on_hopper():
    launch = _exact_forward()
    assert (launch.backend, launch.block_p, launch.block_l) == ("mosaic", 128, 128)
    assert _exact_forward(out=100).backend == "mosaic"
    assert _exact_forward("default").backend is None  # bfloat16 values: Triton
    assert _exact_forward(dim=20).backend is None  # more dimensions than registers hold
    assert _exact_forward(n=4096).backend is None  # program tiles under 128 rows
    assert _exact_forward(op="kde").backend is None  # the KDE has no Mosaic GPU kernel
    assert _exact_forward(device=NO_MOSAIC).backend is None


def test_sweeps_chosen_for_the_highest_backward_on_hopper():
    """The exact Mosaic GPU backward (tilax.rbf.mosaic.exact_grad, one sweep set on both
    launches) replaces both Triton sweeps, with its own tiles, where it runs and programs over
    either point set fill the GPU."""
    path = _exact_path()
    for launch in (path.dq, path.dk):
        assert (launch.backend, launch.block_p, launch.block_l) == (
            "mosaic", mosaic_exact_grad.BLOCK_P, mosaic_exact_grad.BLOCK_L)
    assert _exact_path(out=100).dq.backend is None  # more value columns than the sweeps take
    assert _exact_path(dim=20).dq.backend is None
    assert _exact_path(m=4096).dk.backend is None  # too few key programs: neither sweep
    assert _exact_path(m=4096).dq.backend is None
    assert _exact_path(block_q=64, block_k=32).dq.backend is None  # explicit tiles: Triton
    assert _exact_path(op="kde").dq.backend is None
    assert _exact_path(device=NO_MOSAIC).dq.backend is None
