"""Batched preconditioned conjugate gradients that also record the Lanczos coefficients.

All right-hand sides are the columns of one ``[n, c]`` matrix, so each iteration is one product
of the operator with ``c`` columns (one kernel sum), not ``c`` products. This is the modified
batched CG (mBCG) of Gardner et al. (2018): the step sizes ``alpha_k`` and ``beta_k`` of each
column's first iterations are kept, from which ``tilax.gp.lanczos`` builds that column's Lanczos
tridiagonal matrix for the log-determinant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


class CGResult(NamedTuple):
    solution: jax.Array  # [n, c]
    # alpha_k and beta_k of the first ``lanczos_iters`` iterations, [lanczos_iters, c]; zero
    # where the column had already converged (or CG stopped).
    alphas: jax.Array
    betas: jax.Array
    # r_0^T P^{-1} r_0 of each column, [c] (the squared norm the Lanczos start vector carries).
    initial_norms: jax.Array
    iterations: jax.Array  # int32 scalar: iterations run (the most any column needed)
    relative_residuals: jax.Array  # [c]: |r| / |b| of each column, as CG tracked it


def _divide(numerator: jax.Array, denominator: jax.Array, where: jax.Array) -> jax.Array:
    return jnp.where(where, numerator / jnp.where(where, denominator, 1), 0)


def preconditioned_cg(
    matvec: Callable[[jax.Array], jax.Array],
    b: jax.Array,
    precondition: Callable[[jax.Array], jax.Array],
    *,
    tol: float,
    max_iters: int,
    lanczos_iters: int,
) -> CGResult:
    """Solve ``A x = b`` column by column for a symmetric positive-definite ``A``, from ``x = 0``.

    A column stops (its coefficients are masked) once ``|r| <= tol |b|``; the loop ends when
    every column has, or after ``max_iters`` iterations.
    """
    dtype = b.dtype
    b_norm = jnp.linalg.norm(b, axis=0)
    z = precondition(b)
    gamma = jnp.sum(b * z, axis=0)
    initial_norms = gamma
    active = b_norm > 0

    def cond(state):
        i, *_, active, _, _ = state
        return (i < max_iters) & jnp.any(active)

    def body(state):
        i, x, r, p, gamma, active, alphas, betas = state
        ap = matvec(p)
        curvature = jnp.sum(p * ap, axis=0)
        # A breakdown (p^T A p or r^T P^-1 r not positive: rounding on a nearly singular
        # system) stops the column where it is, rather than turning it into NaNs.
        active = active & (curvature > 0)
        alpha = _divide(gamma, curvature, active)
        x = x + alpha * p
        r = r - alpha * ap
        z = precondition(r)
        gamma_next = jnp.sum(r * z, axis=0)
        beta = _divide(gamma_next, gamma, active)
        p = jnp.where(active, z + beta * p, p)
        if lanczos_iters:  # (an update of the empty arrays would not trace)
            alphas = alphas.at[i].set(alpha, mode="drop")
            betas = betas.at[i].set(beta, mode="drop")
        active = active & (jnp.linalg.norm(r, axis=0) > tol * b_norm) & (gamma_next > 0)
        gamma = jnp.where(active, gamma_next, gamma)
        return i + 1, x, r, p, gamma, active, alphas, betas

    coefficients = jnp.zeros((lanczos_iters, b.shape[1]), dtype)
    state = (jnp.int32(0), jnp.zeros_like(b), b, z, gamma, active, coefficients, coefficients)
    iterations, x, r, _, _, _, alphas, betas = jax.lax.while_loop(cond, body, state)
    residuals = jnp.linalg.norm(r, axis=0) / jnp.where(b_norm > 0, b_norm, 1)
    return CGResult(x, alphas, betas, initial_norms, iterations, residuals)
