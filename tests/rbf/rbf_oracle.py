"""Float64 oracles for the RBF tests: direct pairwise differences, no tricks, x64 only here.
Errors against them: ``helpers.rel_err`` (tests/helpers.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _f64(*arrays):
    return [jnp.asarray(np.asarray(a, np.float64)) for a in arrays]


def kernel_mv(q, k, v, lengthscale):
    """``sum_j exp(-0.5 ||(q_i - k_j) / l||^2) v_j`` in float64 (call inside enable_x64)."""
    diff = (q[..., :, None, :] - k[..., None, :, :]) / lengthscale
    return jnp.einsum("...nm,...mo->...no", jnp.exp(-0.5 * jnp.sum(diff * diff, -1)), v)


def kde_density(query, data, bandwidth, weights, *, log):
    """Weighted normalised Gaussian KDE in float64 (weights normalised here)."""
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    diff = (query[..., :, None, :] - data[..., None, :, :]) / bandwidth
    exponent = -0.5 * jnp.sum(diff * diff, -1)
    dim = query.shape[-1]
    log_norm = -0.5 * dim * jnp.log(2.0 * jnp.pi * bandwidth**2)
    if log:
        # Plain log of the shifted sum: differentiable in zero weights (logsumexp(b=w) is not).
        shift = jax.lax.stop_gradient(jnp.max(exponent, axis=-1, keepdims=True))
        total = jnp.einsum("...nm,...m->...n", jnp.exp(exponent - shift), weights)
        return jnp.log(total) + shift[..., 0] + log_norm
    return jnp.einsum("...nm,...m->...n", jnp.exp(exponent), weights) * jnp.exp(log_norm)


# The oracles run jitted: one XLA compile per shape instead of one per primitive, which made
# the eager float64 oracle most of the time of the shape-fuzz test (on CPU).
@jax.jit
def _kernel_mv_value_and_grads(q, k, v, lengthscale, cot):
    out = kernel_mv(q, k, v, lengthscale)
    grads = jax.grad(lambda *a: jnp.sum(kernel_mv(*a) * cot), argnums=(0, 1, 2, 3))(
        q, k, v, lengthscale
    )
    return out, grads


@functools.partial(jax.jit, static_argnames="log")
def _kde_value_and_grads(query, data, bandwidth, weights, cot, *, log):
    def loss(*a):
        return jnp.sum(kde_density(*a, log=log) * cot)

    out = kde_density(query, data, bandwidth, weights, log=log)
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(query, data, bandwidth, weights)
    return out, grads


def kernel_mv_value_and_grads(q, k, v, lengthscale, cotangent):
    """Float64 output and the gradients of ``sum(out * cotangent)`` w.r.t. q, k, v, lengthscale."""
    with jax.enable_x64(True):
        out, grads = _kernel_mv_value_and_grads(*_f64(q, k, v, lengthscale, cotangent))
        return np.asarray(out), [np.asarray(g) for g in grads]


def kernel_mv_float64(q, k, v, lengthscale) -> np.ndarray:
    """``kernel_mv`` of NumPy-convertible inputs, in float64, as a NumPy array."""
    with jax.enable_x64(True):
        return np.asarray(jax.jit(kernel_mv)(*_f64(q, k, v, lengthscale)))


def kde_value_and_grads(query, data, bandwidth, weights, cotangent, *, log):
    """Float64 KDE and the gradients of ``sum(out * cotangent)`` w.r.t. all four inputs."""
    with jax.enable_x64(True):
        args = _f64(query, data, bandwidth, weights, cotangent)
        out, grads = _kde_value_and_grads(*args, log=log)
        return np.asarray(out), [np.asarray(g) for g in grads]


def lengthscale_grad_scale(q, k, lengthscale, dq, dk):
    """The size of the terms summed into d(lengthscale) = -sum (x - c) * dx / l (centred x).

    The gradient itself can be orders of magnitude smaller than its terms (they cancel), so its
    float32 error is judged against this scale, as float32 XLA's own result would be.
    """
    center = np.mean(k, axis=-2, keepdims=True)
    terms = np.abs((q - center) * dq).reshape(-1, q.shape[-1]).sum(0)
    terms += np.abs((k - center) * dk).reshape(-1, k.shape[-1]).sum(0)
    terms = terms / np.asarray(lengthscale)
    return terms if np.ndim(lengthscale) else terms.sum()


# ------------------------------------------------------------------------------------------
# The stationary kernels of tilax.kernel_mv, in plain NumPy float64 (values and analytic
# gradients; no JAX, no autodiff)

#: ``c`` of ``z = c r`` per Matérn kernel.
MATERN_RATES = {"matern12": 1.0, "matern32": np.sqrt(3.0), "matern52": np.sqrt(5.0)}


def stationary_profile(kernel: str, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(k(r), phi(r))`` in float64, ``phi = -dk/ds`` with ``s = r^2 / 2`` (``-k'(r) / r``),
    and the documented convention ``phi = 0`` at ``r = 0`` for Matérn-1/2."""
    r = np.asarray(r, np.float64)
    if kernel == "rbf":
        value = np.exp(-0.5 * r * r)
        return value, value
    # Beyond float64's exp (r = inf included) every Matérn value and weight is 0.
    z = np.minimum(MATERN_RATES[kernel] * r, 1e4)
    decay = np.exp(-z)
    if kernel == "matern12":
        with np.errstate(divide="ignore", invalid="ignore"):
            return decay, np.where(r > 0, decay / np.where(r > 0, r, 1.0), 0.0)
    if kernel == "matern32":
        return (1.0 + z) * decay, 3.0 * decay
    return (1.0 + z + z * z / 3.0) * decay, (5.0 / 3.0) * (1.0 + z) * decay


def stationary_kernel_mv(kernel, q, k, v, lengthscale, cotangent):
    """``out = K @ v`` and the gradients of ``sum(out * cotangent)`` w.r.t. ``q``, ``k``,
    ``v`` and the lengthscale (its shape: scalar or ``[D]``), in NumPy float64, for
    ``q: [..., N, D]``, ``k: [..., M, D]``, ``v: [..., M, O]``.

    With ``e = (q_i - k_j) / l`` and ``A_ij = phi_ij (g_i . v_j)``: ``dq_i = -sum_j A_ij e_ij
    / l``, ``dk_j = sum_i A_ij e_ij / l``, ``dv_j = sum_i K_ij g_i``,
    ``dl_d = sum_ij A_ij e_ijd^2 / l_d``.
    """
    q, k, v, g = (np.asarray(a, np.float64) for a in (q, k, v, cotangent))
    scale = np.asarray(lengthscale, np.float64)
    e = (q[..., :, None, :] - k[..., None, :, :]) / scale
    r = np.sqrt(np.sum(e * e, axis=-1))
    value, phi = stationary_profile(kernel, r)
    out = np.einsum("...nm,...mo->...no", value, v)
    a = phi * np.einsum("...no,...mo->...nm", g, v)
    dq = -np.einsum("...nm,...nmd->...nd", a, e) / scale
    dk = np.einsum("...nm,...nmd->...md", a, e) / scale
    dv = np.einsum("...nm,...no->...mo", value, g)
    dl = np.einsum("...nm,...nmd->...d", a, e * e).reshape(-1, q.shape[-1]).sum(0) / scale
    return out, [dq, dk, dv, dl if scale.ndim else np.sum(dl)]
