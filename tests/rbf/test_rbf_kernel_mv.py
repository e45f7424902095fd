"""rbf_kernel_mv against a float64 oracle: outputs, every gradient, awkward shapes, transforms.

Pallas runs in interpret mode here (CPU); shapes stay tiny and tiles are forced to 16 so that
several tiles, padding of N, M and O, and the in-kernel loops are all exercised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st
from rbf_oracle import kernel_mv_value_and_grads, lengthscale_grad_scale

import tilax

# (batch, N, M, D, O, per-dimension lengthscale)
CASES = {
    "batch-odd-ard": ((2,), 37, 29, 3, 5, True),
    "n1-d1-o1": ((), 1, 40, 1, 1, False),
    "two-batch-dims-o18": ((2, 3), 17, 33, 5, 18, False),
    "wide-o70": ((), 20, 21, 2, 70, True),
    # More dimensions than the difference kernels hold in registers (numerics.HOISTED_DIMS)
    "d17": ((), 19, 23, 17, 3, True),
}

# Relative error bounds vs float64 (interpret mode; GPU errors are checked by
# tests/rbf/test_rbf_gpu.py).
TOLERANCE = {"highest": 2e-6, "high": 1e-4, "default": 3e-2}


def make_inputs(seed, batch, n, m, dim, out, ard):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(*batch, n, dim)).astype(np.float32)
    # Offset keys so the data are not centred at the origin (exercises the centring).
    k = (rng.normal(size=(*batch, m, dim)) + 3.0).astype(np.float32)
    q = q + 3.0
    v = rng.normal(size=(*batch, m, out)).astype(np.float32)
    lengthscale = (
        rng.uniform(0.6, 2.0, size=(dim,)).astype(np.float32) if ard else np.float32(1.3)
    )
    cotangent = rng.normal(size=(*batch, n, out)).astype(np.float32)
    return q, k, v, lengthscale, cotangent


def value_and_grads(q, k, v, lengthscale, cotangent, **kwargs):
    """Output and the gradients of ``sum(out * cotangent)``, in one jitted call (one compile)."""

    @jax.jit
    def run(q, k, v, lengthscale, cotangent):
        out, vjp = jax.vjp(lambda *a: tilax.rbf_kernel_mv(*a, **kwargs), q, k, v, lengthscale)
        return out, vjp(cotangent)

    return run(q, k, v, lengthscale, cotangent)


def assert_matches_oracle(inputs, tolerance, **kwargs):
    q, k, v, lengthscale, cotangent = inputs
    out, grads = value_and_grads(q, k, v, lengthscale, cotangent, **kwargs)
    ref_out, ref_grads = kernel_mv_value_and_grads(q, k, v, lengthscale, cotangent)
    assert out.shape == ref_out.shape and out.dtype == jnp.float32
    assert rel_err(out, ref_out) < tolerance, rel_err(out, ref_out)
    for name, grad, ref in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3], strict=True):
        assert grad.shape == np.shape(ref), (name, grad.shape, np.shape(ref))
        assert rel_err(grad, ref) < 5 * tolerance, (name, rel_err(grad, ref))
    grad_l, ref_l = np.asarray(grads[3], np.float64), ref_grads[3]
    assert grad_l.shape == np.shape(ref_l)
    scale = lengthscale_grad_scale(q, k, lengthscale, ref_grads[0], ref_grads[1])
    assert np.all(np.abs(grad_l - ref_l) <= 5 * tolerance * scale), (grad_l, ref_l, scale)


#: The cases of the everyday run; the other two (batch dimensions, which the vmap test and the
#: smaller cases run too) are heavy interpreter cases.
HEAVY_CASES = ("batch-odd-ard", "two-batch-dims-o18")


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=[pytest.mark.kernels] if case in HEAVY_CASES else [])
    for case in CASES
])
def test_pallas_matches_float64(case):
    inputs = make_inputs(0, *CASES[case])
    assert_matches_oracle(
        inputs, TOLERANCE["highest"], impl="pallas", precision="highest", block_q=16, block_k=16
    )


@pytest.mark.parametrize("precision", [pytest.param("high", marks=pytest.mark.kernels), "default"])
def test_pallas_fast_precisions(precision):
    inputs = make_inputs(1, *CASES["batch-odd-ard"])
    assert_matches_oracle(inputs, TOLERANCE[precision], impl="pallas", precision=precision)


@pytest.mark.parametrize("impl", ["xla", "dense"])
def test_xla_paths_match_float64(impl):
    inputs = make_inputs(2, *CASES["two-batch-dims-o18"])
    assert_matches_oracle(inputs, 2e-6, impl=impl)


def test_xla_chunks_do_not_change_the_result():
    q, k, v, lengthscale, _ = make_inputs(3, *CASES["batch-odd-ard"])
    chunked = tilax.rbf.reference.kernel_mv_xla(q, k, v, lengthscale, chunk=5)
    dense = tilax.rbf.reference.kernel_mv_dense(q, k, v, lengthscale)
    np.testing.assert_allclose(chunked, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.kernels
@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    batch=st.sampled_from([(), (2,)]),
    n=st.integers(1, 40),
    m=st.integers(1, 40),
    dim=st.integers(1, 6),
    out=st.integers(1, 20),
    ard=st.booleans(),
    block=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_shape_fuzz(batch, n, m, dim, out, ard, block, seed):
    inputs = make_inputs(seed, batch, n, m, dim, out, ard)
    assert_matches_oracle(
        inputs, TOLERANCE["highest"], impl="pallas", precision="highest", block_q=block,
        block_k=block,
    )  # fmt: skip


def test_padded_keys_contribute_nothing():
    # Keys near the origin (where padding rows would sit) with M=17 padded to 32.
    q, k, v, lengthscale, _ = make_inputs(5, (), 8, 17, 2, 3, False)
    k = k - 3.0
    out = jax.jit(
        lambda *a: tilax.rbf_kernel_mv(*a, impl="pallas", precision="highest", block_k=32)
    )(q, k, v, lengthscale)
    ref = tilax.rbf_kernel_mv(q, k, v, lengthscale, impl="dense")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_vmap_matches_batched_call():
    q, k, v, lengthscale, _ = make_inputs(6, (3,), 10, 12, 2, 4, True)

    def single(q1, k1, v1, ls):
        return tilax.rbf_kernel_mv(q1, k1, v1, ls, impl="pallas", precision="highest")

    @jax.jit
    def run(q, k, v, ls):
        mapped = jax.vmap(single, in_axes=(0, 0, 0, None))(q, k, v, ls)
        # vmap of a gradient: per-example lengthscale gradients.
        per_example = jax.vmap(
            jax.grad(lambda q1, k1, v1, ls: single(q1, k1, v1, ls).sum(), argnums=3),
            in_axes=(0, 0, 0, None),
        )(q, k, v, ls)
        return mapped, per_example

    mapped, per_example = run(q, k, v, jnp.asarray(lengthscale))
    batched = tilax.rbf_kernel_mv(q, k, v, lengthscale, impl="dense")
    np.testing.assert_allclose(mapped, batched, rtol=1e-5, atol=1e-6)
    for i in range(3):
        _, grads = kernel_mv_value_and_grads(q[i], k[i], v[i], lengthscale, np.ones((10, 4)))
        assert rel_err(per_example[i], grads[3]) < 1e-5


def test_jit_with_traced_lengthscale():
    q, k, v, lengthscale, _ = make_inputs(7, (), 9, 10, 3, 2, True)
    fn = jax.jit(lambda q, k, v, ls: tilax.rbf_kernel_mv(q, k, v, ls, impl="pallas"))
    # Default precision: single-bfloat16 value products.
    ref = tilax.rbf_kernel_mv(q, k, v, lengthscale, impl="dense")
    assert rel_err(fn(q, k, v, lengthscale), ref) < TOLERANCE["default"]


def test_bfloat16_inputs_give_bfloat16_output():
    q, k, v, lengthscale, _ = make_inputs(8, (), 20, 24, 3, 4, False)
    as_bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    cotangent = jnp.ones((20, 4), jnp.bfloat16)
    out, (grad_q, _, grad_v, _) = value_and_grads(*as_bf16, lengthscale, cotangent,
                                                  impl="pallas")  # fmt: skip
    assert out.dtype == grad_q.dtype == grad_v.dtype == jnp.bfloat16
    exact = tilax.rbf_kernel_mv(*[x.astype(jnp.float32) for x in as_bf16], lengthscale,
                                impl="dense")  # fmt: skip
    assert rel_err(out, exact) < 1e-2


def test_float64_inputs_stay_float64_on_auto():
    q, k, v, lengthscale, _ = make_inputs(9, (), 6, 7, 2, 2, False)
    with jax.enable_x64(True):
        out = tilax.rbf_kernel_mv(*(np.asarray(x, np.float64) for x in (q, k, v)), lengthscale)
        assert out.dtype == jnp.float64


@pytest.mark.parametrize("impl", ["pallas", "xla", "dense"])
def test_empty_keys_give_zeros_and_empty_queries_empty(impl):
    q, k, v, lengthscale, _ = make_inputs(10, (2,), 5, 4, 3, 2, False)
    zeros = tilax.rbf_kernel_mv(q, k[:, :0], v[:, :0], lengthscale, impl=impl)
    assert zeros.shape == (2, 5, 2) and not np.any(np.asarray(zeros))
    empty = tilax.rbf_kernel_mv(q[:, :0], k, v, lengthscale, impl=impl)
    assert empty.shape == (2, 0, 2)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_hessian_matches_float64(impl):
    """Second order on every impl (Pallas: its forward-mode rule, tilax.rbf.forward_mode)."""
    q, k, v, lengthscale, _ = make_inputs(12, (), 6, 7, 2, 2, True)

    def loss(ls):
        return tilax.rbf_kernel_mv(q, k, v, ls, impl=impl, precision="highest").sum()

    hessian = jax.jit(jax.hessian(loss))(jnp.asarray(lengthscale))
    with jax.enable_x64(True):
        from rbf_oracle import kernel_mv

        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        ref = jax.jit(jax.hessian(lambda ls: kernel_mv(*args, ls).sum()))(
            jnp.asarray(np.asarray(lengthscale, np.float64))
        )
    assert rel_err(hessian, ref) < 1e-4


def test_auto_runs_the_auto_impl_rule():
    """On this CPU ``impl="auto"`` is the XLA path (the rule on GPUs and for float64:
    tests/rbf/test_rbf_rules.py)."""
    q, k, v, lengthscale, _ = make_inputs(5, (), 40, 30, 3, 2, False)
    auto = tilax.rbf_kernel_mv(q, k, v, lengthscale)
    np.testing.assert_array_equal(auto, tilax.rbf_kernel_mv(q, k, v, lengthscale, impl="xla"))
