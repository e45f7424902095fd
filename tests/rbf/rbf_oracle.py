"""Float64 oracles for the RBF tests: direct pairwise differences, no tricks, x64 only here."""

from __future__ import annotations

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


def kernel_mv_value_and_grads(q, k, v, lengthscale, cotangent):
    """Float64 output and the gradients of ``sum(out * cotangent)`` w.r.t. q, k, v, lengthscale."""
    with jax.enable_x64(True):
        args = _f64(q, k, v, lengthscale)
        (cot,) = _f64(cotangent)
        out = kernel_mv(*args)
        grads = jax.grad(lambda *a: jnp.sum(kernel_mv(*a) * cot), argnums=(0, 1, 2, 3))(*args)
        return np.asarray(out), [np.asarray(g) for g in grads]


def kde_value_and_grads(query, data, bandwidth, weights, cotangent, *, log):
    """Float64 KDE and the gradients of ``sum(out * cotangent)`` w.r.t. all four inputs."""
    with jax.enable_x64(True):
        args = _f64(query, data, bandwidth, weights)
        (cot,) = _f64(cotangent)

        def loss(*a):
            return jnp.sum(kde_density(*a, log=log) * cot)

        out = kde_density(*args, log=log)
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
        return np.asarray(out), [np.asarray(g) for g in grads]


def rel_err(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` in float64."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-300))
