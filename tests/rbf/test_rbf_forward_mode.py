"""Forward-mode differentiation of the RBF sums (issue 76, item 9): ``jax.jvp``, ``jax.jacfwd``
and ``jax.hessian`` of a scalar loss on ``impl="pallas"`` as on ``"xla"``, with reverse mode
still running the Pallas backward kernels (tilax.rbf.forward_mode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from rbf_oracle import kde_density, kernel_mv

import tilax


def _inputs(seed=0, batch=()):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(*batch, 5, 2)).astype(np.float32)
    k = rng.normal(size=(*batch, 6, 2)).astype(np.float32)
    v = rng.normal(size=(*batch, 6, 3)).astype(np.float32)
    w = rng.uniform(0.2, 1.0, size=(*batch, 6)).astype(np.float32)
    return q, k, v, w


def _f64(*arrays):
    return [jnp.asarray(np.asarray(a, np.float64)) for a in arrays]


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_kernel_mv_jvp_in_every_argument(impl):
    q, k, v, _ = _inputs(1)
    lengthscale = np.array([0.7, 1.3], np.float32)
    tangents = _inputs(2)[:3] + (np.array([0.1, -0.2], np.float32),)

    def f(q, k, v, ls):
        return tilax.rbf_kernel_mv(q, k, v, ls, impl=impl, precision="highest")

    out, tangent = jax.jvp(f, (q, k, v, lengthscale), tangents)
    with jax.enable_x64(True):
        ref_out, ref_tangent = jax.jvp(kernel_mv, tuple(_f64(q, k, v, lengthscale)),
                                       tuple(_f64(*tangents)))  # fmt: skip
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(tangent, ref_tangent) < 1e-4


# The log density through the Pallas interpreter is a heavy case; log=False keeps one everyday.
@pytest.mark.parametrize(
    "impl, log",
    [pytest.param("pallas", True, marks=pytest.mark.kernels), ("pallas", False), ("xla", True),
     ("xla", False)],
)  # fmt: skip
def test_kde_jvp_and_jacfwd(impl, log):
    query, data, _, weights = _inputs(3)

    def f(query, data, h, w):
        return tilax.rbf_kde_density(query, data, h, weights=w, log=log, impl=impl,
                                     precision="highest")  # fmt: skip

    primals = (query, data, np.float32(0.8), weights)
    tangents = (*_inputs(4)[:2], np.float32(0.3), _inputs(4)[3])
    _, tangent = jax.jvp(f, primals, tangents)
    jac_h = jax.jacfwd(lambda h: f(query, data, h, weights))(np.float32(0.8))
    with jax.enable_x64(True):
        def ref(query, data, h, w):
            return kde_density(query, data, h, w, log=log)

        # (the references jitted: one compile each instead of one per operation)
        _, ref_tangent = jax.jit(lambda p, t: jax.jvp(ref, p, t))(tuple(_f64(*primals)),
                                                                  tuple(_f64(*tangents)))
        ref_jac_h = jax.jit(jax.jacfwd(lambda h: ref(*_f64(query, data), h, *_f64(weights))))(
            jnp.float64(0.8)
        )
    assert rel_err(tangent, ref_tangent) < 1e-4
    assert rel_err(jac_h, ref_jac_h) < 1e-4


# Pallas: a heavy case (test_rbf_kernel_mv.py's Hessian keeps one small one every day).
@pytest.mark.parametrize("impl", [pytest.param("pallas", marks=pytest.mark.kernels), "xla"])
def test_hessian_of_scalar_losses(impl):
    q, k, v, weights = _inputs(5)

    def mv_loss(q):
        return jnp.sum(tilax.rbf_kernel_mv(q, k, v, 0.9, impl=impl, precision="highest") ** 2)

    def kde_loss(h):
        return jnp.sum(tilax.rbf_kde_density(q, k, h, weights=weights, log=True, impl=impl,
                                             precision="highest"))  # fmt: skip

    hess_q = jax.jit(jax.hessian(mv_loss))(q)
    hess_h = jax.hessian(kde_loss)(np.float32(0.8))
    with jax.enable_x64(True):
        q64, k64, v64, w64 = _f64(q, k, v, weights)
        ref_q = jax.jit(jax.hessian(lambda q: jnp.sum(kernel_mv(q, k64, v64, 0.9) ** 2)))(q64)
        ref_h = jax.jit(jax.hessian(lambda h: jnp.sum(kde_density(q64, k64, h, w64, log=True))))(
            jnp.float64(0.8)
        )
    assert hess_q.shape == (5, 2, 5, 2)
    assert rel_err(hess_q, ref_q) < 1e-4
    assert rel_err(hess_h, ref_h) < 1e-4


def test_reverse_mode_keeps_the_pallas_backward():
    """``jax.grad`` transposes the tangent into the Pallas backward pass (the cotangent
    primitive), not into the XLA tangent's transpose."""
    q, k, v, _ = _inputs(6)

    def loss(q, k, v, ls):
        return tilax.rbf_kernel_mv(q, k, v, ls, impl="pallas").sum()

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, np.float32(0.9)))
    assert "rbf_cotangent" in jaxpr
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, np.float32(0.9))
    ref = jax.grad(lambda *a: tilax.rbf_kernel_mv(*a, impl="xla").sum(), argnums=(0, 1, 2, 3))(
        q, k, v, np.float32(0.9)
    )
    assert rel_err(grads, ref) < 1e-2  # the default precision's bfloat16 value products


def test_forward_mode_under_vmap_and_jit():
    q, k, v, _ = _inputs(7, batch=(2,))

    def tangent(ls):
        return jax.jvp(lambda ls: tilax.rbf_kernel_mv(q, k, v, ls, impl="pallas",
                                                      precision="highest"),
                       (ls,), (jnp.float32(1.0),))[1]  # fmt: skip

    scales = jnp.array([0.5, 1.5], jnp.float32)
    batched = jax.jit(jax.vmap(tangent))(scales)
    with jax.enable_x64(True):
        q64, k64, v64 = _f64(q, k, v)
        expected = [jax.jvp(lambda ls: kernel_mv(q64, k64, v64, ls), (jnp.float64(s),),
                            (jnp.float64(1.0),))[1] for s in (0.5, 1.5)]  # fmt: skip
    assert rel_err(batched, np.stack(expected)) < 1e-4
    # vmap of the gradient (the cotangent primitive under vmap).
    grads = jax.vmap(jax.grad(lambda ls: tilax.rbf_kernel_mv(q, k, v, ls, impl="pallas",
                                                             precision="highest").sum()))(scales)
    ref = jax.vmap(jax.grad(lambda ls: tilax.rbf_kernel_mv(q, k, v, ls, impl="xla",
                                                           precision="highest").sum()))(scales)
    assert rel_err(grads, ref) < 1e-4


def test_kde_forward_mode_under_vmap_with_python_tangents():
    query, data, _, _ = _inputs(8)

    def tangent(impl):
        def one(h):
            return jax.jvp(lambda h: tilax.rbf_kde_density(query, data, h, impl=impl), (h,),
                           (1.0,))[1]  # fmt: skip

        return jax.vmap(one)(jnp.array([0.5, 1.0], jnp.float32))

    assert rel_err(tangent("pallas"), tangent("xla")) < 1e-2


def test_gradient_of_a_mapped_loss_keeps_the_pallas_backward():
    """``grad`` of a ``vmap``-ed loss: the batched tangent binds itself again (folded into the
    batch dimension), so its transpose is still the Pallas backward pass."""
    q, k, v, _ = _inputs(9, batch=(3,))

    def loss(q, impl):
        return jax.vmap(lambda q1, k1, v1: tilax.rbf_kernel_mv(
            q1, k1, v1, 0.8, impl=impl, precision="highest").sum())(q, k, v).sum()  # fmt: skip

    assert "rbf_cotangent" in str(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(q, "pallas"))
    assert rel_err(jax.grad(loss)(q, "pallas"), jax.grad(loss)(q, "xla")) < 1e-5
