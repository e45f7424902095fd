"""The dense reference of ``tilax.gp.mll`` and ``tilax.gp.posterior``: the ``n x n``
covariance and its Cholesky factor.

Plain XLA, O(n^2) memory and O(n^3) time: the baseline the GP benchmarks time beside the
matrix-free ``tilax.gp.mll`` where it fits on the device (suite ``gp``), and the exact value
its estimates are checked against (in float64 under ``jax.enable_x64``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST  # not the GPUs' default TF32 products


def _distance(squared: jax.Array) -> jax.Array:
    """``sqrt(squared)`` with a zero gradient at zero (``sqrt``'s is infinite there): the
    Matérn-1/2 kernel's gradient at zero distance is 0, ``tilax.kernel_mv``'s convention."""
    positive = squared > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, squared, 1)), 0)


def _matern(rate: float, polynomial: Callable[[jax.Array], jax.Array]):
    def profile(squared):
        z = rate * _distance(squared)
        return polynomial(z) * jnp.exp(-z)
    return profile


#: Each kernel as a function of the squared scaled distance ``|(x - x') / lengthscale|^2``:
#: the kernels of ``tilax.gp.mll`` (``r`` the scaled distance, ``z = c r``).
KERNEL_PROFILES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "rbf": lambda squared: jnp.exp(-0.5 * squared),
    "matern12": _matern(1.0, lambda z: jnp.ones_like(z)),  # exp(-r)
    "matern32": _matern(math.sqrt(3), lambda z: 1 + z),  # (1 + z) exp(-z)
    "matern52": _matern(math.sqrt(5), lambda z: 1 + z + z * z / 3),  # (1 + z + z^2/3) exp(-z)
}


def _squared_distances(a: jax.Array, b: jax.Array) -> jax.Array:
    """``sum_d (a_id - b_jd)^2`` as ``[n, m]``, one dimension per step of a loop (each step
    recomputed in the backward pass): ``n x m`` arrays only."""

    def add_dimension(total, columns):
        a_d, b_d = columns
        difference = a_d[:, None] - b_d[None, :]
        return total + difference * difference, None

    start = jnp.zeros((a.shape[0], b.shape[0]), jnp.result_type(a, b))
    total, _ = jax.lax.scan(jax.checkpoint(add_dimension), start, (a.T, b.T))
    return total


def kernel_matrix(kernel: str, a: jax.Array, b: jax.Array, lengthscale: jax.Array) -> jax.Array:
    """``k(a_i, b_j)`` for ``a: [n, D]``, ``b: [m, D]``, as an ``[n, m]`` matrix.

    The squared distances are summed from coordinate differences, so a repeated point is at
    distance exactly 0. (The expansion ``|a|^2 + |b|^2 - 2 a.b`` leaves rounding there, which
    the Matérn-1/2 kernel's square root magnifies: in float32, standard-normal points in 8
    dimensions at lengthscale 0.5 gave ``k(x, x)`` as low as 0.996.)
    """
    if kernel not in KERNEL_PROFILES:
        supported = ", ".join(repr(name) for name in KERNEL_PROFILES)
        raise ValueError(f"kernel must be one of {supported} (the dense reference's kernels), "
                         f"got {kernel!r}")
    return KERNEL_PROFILES[kernel](_squared_distances(a / lengthscale, b / lengthscale))


def dense_mll(params: Mapping[str, Any], x: jax.Array, y: jax.Array, *,
              kernel: str = "rbf") -> jax.Array:
    """``log p(y | x)`` of the GP of ``tilax.gp.mll`` by a Cholesky factorisation.

    ``C = outputscale * K + noise * I``, ``log p = -0.5 y^T C^-1 y - sum(log diag L) -
    0.5 n log(2 pi)`` with ``C = L L^T``. Differentiable by ``jax.grad`` (through the Cholesky
    factorisation and the triangular solves). Computes in the dtype of ``x`` (float64 under
    ``jax.enable_x64`` with float64 inputs).

    Args:
      params: ``{"lengthscale": scalar or [D], "outputscale": scalar, "noise": scalar}``.
      x: training inputs ``[n, D]``.
      y: training targets ``[n]``.
      kernel: a name of ``KERNEL_PROFILES``.

    Returns:
      The scalar log marginal likelihood (not divided by ``n``).
    """
    n = x.shape[0]
    factor = _covariance_factor(params, x, kernel)
    white = jax.scipy.linalg.solve_triangular(factor, y, lower=True)
    return (-0.5 * jnp.dot(white, white, precision=HIGHEST) - jnp.sum(jnp.log(jnp.diag(factor)))
            - 0.5 * n * math.log(2 * math.pi))


def dense_posterior(params: Mapping[str, Any], x: jax.Array, y: jax.Array, x_star: jax.Array,
                    *, kernel: str = "rbf") -> tuple[jax.Array, jax.Array]:
    """Posterior mean and variance of ``tilax.gp.posterior`` by a Cholesky factorisation.

    ``mean = outputscale * K(x_star, x) C^-1 y``, ``variance_j = outputscale -
    outputscale^2 k_j^T C^-1 k_j`` (of the noise-free function, clamped at zero) with
    ``C = L L^T`` as in ``dense_mll``. Computes in the dtype of ``x``.

    Args:
      params, x, y, kernel: as in ``dense_mll``.
      x_star: query points ``[m, D]``.

    Returns:
      ``(mean, variance)``, each ``[m]``.
    """
    factor = _covariance_factor(params, x, kernel)
    cross = params["outputscale"] * kernel_matrix(kernel, x, x_star, params["lengthscale"])
    white_y = jax.scipy.linalg.solve_triangular(factor, y, lower=True)
    white_cross = jax.scipy.linalg.solve_triangular(factor, cross, lower=True)
    mean = jnp.matmul(white_cross.T, white_y, precision=HIGHEST)
    variance = params["outputscale"] - jnp.sum(white_cross * white_cross, axis=0)
    return mean, jnp.maximum(variance, 0)


def _covariance_factor(params: Mapping[str, Any], x: jax.Array, kernel: str) -> jax.Array:
    """The Cholesky factor ``L`` of ``C = outputscale * K(x, x) + noise * I``."""
    covariance = params["outputscale"] * kernel_matrix(kernel, x, x, params["lengthscale"])
    covariance = covariance + params["noise"] * jnp.eye(x.shape[0], dtype=covariance.dtype)
    return jnp.linalg.cholesky(covariance)
