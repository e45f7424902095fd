"""The Mosaic GPU RBF forward (tilax.rbf.mosaic.forward) on a CPU: results in JAX's GPU
interpret mode (tests/mosaic_interpret.py), lowering for CUDA, and when it is chosen.

The interpreter runs the three warpgroups thread by thread (slow: one small problem), checks
the barrier protocol (every phase observed) and what is computed, not layouts or timing, which
tests/rbf/test_rbf_gpu.py covers on Hopper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from jax import export
from rbf_oracle import kernel_mv_float64

from tilax.rbf import config as rbf_config
from tilax.rbf import vjp as rbf_vjp
from tilax.rbf.mosaic import forward as mosaic_forward
from tilax.rbf.numerics import Expansion

PARTS = Expansion("tf32_parts")


def _operands(n, m, dim, out, lengthscale, seed=0):
    """Scaled points, values, and the kernel's operands: TF32 parts and bfloat16 values."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, n, dim)).astype(np.float32)
    k = rng.standard_normal((1, m, dim)).astype(np.float32)
    v = rng.standard_normal((1, m, out)).astype(np.float32)
    qs, ks = jnp.asarray(q / lengthscale), jnp.asarray(k / lengthscale)
    rows_q = mosaic_forward.BLOCK_P * -(-n // mosaic_forward.BLOCK_P)
    rows_k = 128 * -(-m // 128)
    x, y = rbf_vjp.expansion_points(PARTS, qs, ks, rows_q, rows_k)
    values = rbf_vjp.value_operand(jnp.asarray(v), rows_k, out, "bf16")
    return (q, k, v), (x, y, values)


@pytest.mark.kernels
@pytest.mark.parametrize("m", [200, 460])  # two key tiles (the ring's slots), four (refills)
def test_forward_matches_float64_in_interpret_mode(m):
    from mosaic_interpret import available, gpu_interpreter

    reason = available()
    if reason:
        pytest.skip(reason)
    # The layout casts only choose registers: identity in the interpreter (which has no rule).
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu.core import layout_cast_p

    mlir.register_lowering(layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    n, lengthscale = 128, 1.5
    (q, k, v), (x, y, values) = _operands(n, m, 8, 16, lengthscale)
    # Padded keys and values hold garbage (the ones make every padded kernel value 1): only
    # the index mask in the last tile keeps them out.
    y, values = y.at[:, m:].set(0.0), values.at[:, m:].set(1e3)
    with gpu_interpreter():
        out = mosaic_forward.kernel_matmul(
            x, y, values, distance=PARTS, valid_l=m, block_p=mosaic_forward.BLOCK_P,
            block_l=128, block_o=16, values="bf16", num_stages=2,
        )  # fmt: skip
    want = kernel_mv_float64(q[0], k[0], v[0], lengthscale)
    got = np.asarray(out)[0, :n]
    assert rel_err(got, want) < 1e-2  # bfloat16 values


def test_lowers_for_cuda():
    args = [
        jax.ShapeDtypeStruct(s, t)
        for s, t in (
            ((2, 256, 32), jnp.float32),
            ((2, 384, 32), jnp.float32),
            ((2, 384, 32), jnp.bfloat16),
        )
    ]

    def forward(x, y, v):
        return mosaic_forward.kernel_matmul(
            x, y, v, distance=PARTS, valid_l=300, block_p=128, block_l=128, block_o=16,
            values="bf16", num_stages=3,
        )  # fmt: skip

    module = export.export(jax.jit(forward), platforms=["cuda"])(*args).mlir_module()
    assert module.count("mosaic_gpu") >= 1


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(distance=Expansion("tf32x3")), "TF32 parts"),
        (dict(values="bf16x3"), "bfloat16"),
        (dict(block_p=64), "must be 128"),
        (dict(block_o=8), "value tile 8"),
    ],
)
def test_unsupported_settings_say_why(settings, match):
    x = jnp.zeros((1, 128, 32), jnp.float32)
    v = jnp.zeros((1, 128, 16), jnp.bfloat16)
    kwargs = (
        dict(distance=PARTS, valid_l=128, block_p=128, block_l=128, block_o=16, values="bf16")
        | settings
    )
    with pytest.raises(ValueError, match=match):
        mosaic_forward.kernel_matmul(x, x, v, **kwargs)


HOPPER = rbf_config.Device(mosaic=True, cores=132, shared_memory=232448)


def _fast_forward(precision=None, n=65536, dim=8, out=16, device=HOPPER):
    config = rbf_config.default_config(
        "triton", precision, batch=1, n=n, m=n, out=out, dim=dim, device=device
    )
    return config.fast.fwd


def test_chosen_for_the_default_fast_forward_on_hopper():
    assert _fast_forward().backend == "mosaic"
    assert _fast_forward(out=100).backend == "mosaic"  # two value tiles of 64
    assert _fast_forward("high").backend is None  # bfloat16x3 values: Triton
    assert _fast_forward(dim=20).backend is None  # parts wider than 64 columns
    assert _fast_forward(n=4096).backend is None  # program tiles under 128 rows
    no_mosaic = rbf_config.Device(mosaic=False, cores=132, shared_memory=232448)
    assert _fast_forward(device=no_mosaic).backend is None
