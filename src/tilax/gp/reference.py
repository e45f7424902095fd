"""The dense reference of ``tilax.gp.mll``: the ``n x n`` covariance and its Cholesky factor.

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

#: Each kernel as a function of the squared scaled distance ``|(x - x') / lengthscale|^2``.
KERNEL_PROFILES: dict[str, Callable[[jax.Array], jax.Array]] = {
    "rbf": lambda squared: jnp.exp(-0.5 * squared),
}


def kernel_matrix(kernel: str, a: jax.Array, b: jax.Array, lengthscale: jax.Array) -> jax.Array:
    """``k(a_i, b_j)`` for ``a: [n, D]``, ``b: [m, D]``, as an ``[n, m]`` matrix.

    The squared distances come from ``|a|^2 + |b|^2 - 2 a.b`` (clamped at zero): no ``[n, m, D]``
    differences, so the matrix is the only ``n x m`` array.
    """
    if kernel not in KERNEL_PROFILES:
        supported = ", ".join(repr(name) for name in KERNEL_PROFILES)
        raise ValueError(f"kernel must be one of {supported} (the dense reference's kernels), "
                         f"got {kernel!r}")
    a, b = a / lengthscale, b / lengthscale
    squared = (jnp.sum(a * a, 1)[:, None] + jnp.sum(b * b, 1)[None, :]
               - 2 * jnp.dot(a, b.T, precision=jax.lax.Precision.HIGHEST))
    return KERNEL_PROFILES[kernel](jnp.maximum(squared, 0))


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
    covariance = params["outputscale"] * kernel_matrix(kernel, x, x, params["lengthscale"])
    covariance = covariance + params["noise"] * jnp.eye(n, dtype=covariance.dtype)
    factor = jnp.linalg.cholesky(covariance)
    white = jax.scipy.linalg.solve_triangular(factor, y, lower=True)
    return (-0.5 * jnp.dot(white, white) - jnp.sum(jnp.log(jnp.diag(factor)))
            - 0.5 * n * math.log(2 * math.pi))
