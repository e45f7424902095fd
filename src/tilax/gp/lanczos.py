"""Stochastic Lanczos quadrature (SLQ) of ``log det`` from the coefficients of batched CG.

CG on ``P^{-1} A`` started from ``r_0 = z`` is the Lanczos process on ``P^{-1/2} A P^{-1/2}``
started from ``P^{-1/2} z / |P^{-1/2} z|``; its tridiagonal matrix ``T`` follows from the CG step
sizes (Saad, "Iterative Methods for Sparse Linear Systems", 6.7.3):
``T[k, k] = 1 / alpha_k + beta_{k-1} / alpha_{k-1}``, ``T[k, k+1] = sqrt(beta_k) / alpha_k``.
For ``z ~ N(0, P)``, ``P^{-1/2} z ~ N(0, I)``, and Gauss quadrature with ``T`` gives
``E[z^T P^{-1} z * e_1^T log(T) e_1] = tr log(P^{-1/2} A P^{-1/2}) = log det A - log det P``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tridiagonals(alphas: jax.Array, betas: jax.Array) -> jax.Array:
    """The Lanczos tridiagonal matrices ``[c, m, m]`` of CG coefficients ``[m, c]``.

    Iterations a column did not run (``alpha = 0``) become an identity block decoupled from
    the rest: eigenvalue 1 with an eigenvector orthogonal to ``e_1``, so they add nothing to
    ``e_1^T f(T) e_1``.
    """
    valid = alphas > 0
    safe_alphas = jnp.where(valid, alphas, 1)
    previous = jnp.concatenate([jnp.zeros_like(betas[:1]), betas[:-1] / safe_alphas[:-1]])
    diagonal = jnp.where(valid, 1 / safe_alphas + previous, 1)
    off = jnp.where(valid[1:], jnp.sqrt(betas[:-1]) / safe_alphas[:-1], 0)
    diagonal, off = diagonal.T, off.T  # [c, m], [c, m - 1]
    eye = jnp.eye(alphas.shape[0], dtype=alphas.dtype)
    upper = jnp.eye(alphas.shape[0], k=1, dtype=alphas.dtype)
    offdiagonal = jnp.pad(off, ((0, 0), (0, 1)))[:, :, None] * upper
    return diagonal[:, :, None] * eye + offdiagonal + jnp.swapaxes(offdiagonal, 1, 2)


def logdet_ratio(alphas: jax.Array, betas: jax.Array, initial_norms: jax.Array) -> jax.Array:
    """Estimate of ``log det A - log det P`` from the CG runs of the probe columns.

    Args:
      alphas, betas: ``[m, t]`` CG coefficients of the ``t`` probe columns ``z ~ N(0, P)``.
      initial_norms: ``[t]``, ``z^T P^{-1} z`` of each probe.
    """
    eigenvalues, eigenvectors = jnp.linalg.eigh(tridiagonals(alphas, betas))
    # A tridiagonal of a positive-definite operator is positive definite; the clamp only guards
    # eigenvalues that float rounding put at or below zero (weights ~0 there).
    tiny = jnp.finfo(eigenvalues.dtype).tiny
    weights = eigenvectors[:, 0, :] ** 2
    quadratures = jnp.sum(weights * jnp.log(jnp.maximum(eigenvalues, tiny)), axis=-1)
    return jnp.mean(initial_norms * quadratures)
