"""Matrix-free pivoted-Cholesky preconditioner ``P = L L^T + noise * I`` (plain JAX).

The rank-``k`` factor ``L: [n, k]`` comes from a pivoted Cholesky factorisation that reads the
kernel matrix only through its diagonal and ``k`` of its columns (one kernel sum with a single
key each: ``O(n k)`` kernel values, ``O(n k^2)`` work), as in Gardner et al., "GPyTorch:
Blackbox Matrix-Matrix Gaussian Process Inference" (2018). ``P`` is inverted in the eigenbasis
of ``L L^T`` (see ``Preconditioner``) and sampled from (``z = L e + sqrt(noise) e'``, so that
``z ~ N(0, P)``) in ``O(n k)``; its log-determinant and the trace of its inverse are exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

# JAX's default float32 matmul is TF32 on NVIDIA GPUs (10-bit mantissa): the solve below divides
# a cancelling difference by the noise, so every product here is full float32.
matmul = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)


class PivotedCholesky(NamedTuple):
    factor: jax.Array  # L: [n, rank]
    pivots: jax.Array  # int32 [rank]: the row of A each column of L pivots on
    used: jax.Array  # bool [rank]: False where the step found no pivot left (its column is 0)


def pivoted_cholesky(
    diagonal: jax.Array, column: Callable[[jax.Array], jax.Array], rank: int
) -> PivotedCholesky:
    """Rank-``rank`` pivoted Cholesky factor ``L: [n, rank]`` with ``L L^T ~ A``.

    Args:
      diagonal: ``[n]``, the diagonal of the symmetric positive semi-definite ``A``.
      column: ``column(i) -> [n]``, column ``i`` of ``A`` (``i`` a traced int32 scalar).
      rank: number of columns of ``L`` (static). Each step takes the largest remaining diagonal
        entry of ``A - L L^T`` as its pivot; once that entry is at rounding level (below
        ``100 eps max(diagonal)``) the remaining columns are zero, so ``rank = n`` factors a
        positive-definite ``A`` exactly and a singular one without NaNs.

    Returns:
      ``L`` (the dtype of ``diagonal``), its pivots and which steps found one. ``A - L L^T`` is
      positive semi-definite and its trace (the sum of the remaining diagonal) decreases with
      the rank. ``L L^T`` is the Nystrom approximation ``A[:, S] A[S, S]^-1 A[S, :]`` on the
      used pivots ``S`` (``nystrom_factor`` recomputes ``L`` from those columns).
    """
    n = diagonal.shape[0]
    floor = 100 * jnp.finfo(diagonal.dtype).eps * jnp.max(diagonal, initial=0.0)

    def step(m, state):
        factor, remaining, pivots, used = state
        pivot = jnp.argmax(remaining)
        pivot_value = remaining[pivot]
        usable = pivot_value > floor
        # Columns m.. of the factor are still zero, so the full product is the partial one.
        residual_column = column(pivot) - matmul(factor, factor[pivot])
        new = jnp.where(usable, residual_column / jnp.sqrt(jnp.where(usable, pivot_value, 1)), 0)
        new = new.at[pivot].set(jnp.where(usable, jnp.sqrt(pivot_value), 0))
        factor = factor.at[:, m].set(new)
        remaining = jnp.maximum(remaining - new**2, 0).at[pivot].set(0)
        return factor, remaining, pivots.at[m].set(pivot.astype(jnp.int32)), used.at[m].set(usable)

    state = (jnp.zeros((n, rank), diagonal.dtype), diagonal, jnp.zeros((rank,), jnp.int32),
             jnp.zeros((rank,), bool))
    if rank == 0:  # the loop would still trace its step, which indexes the empty factor
        return PivotedCholesky(*state[0:1], *state[2:])
    factor, _, pivots, used = jax.lax.fori_loop(0, rank, step, state)
    return PivotedCholesky(factor, pivots, used)


def nystrom_factor(columns: jax.Array, pivot_block: jax.Array,
                   pivoted: PivotedCholesky) -> jax.Array:
    """The pivoted Cholesky factor from its pivot columns: ``L = A[:, S] chol(A[S, S])^-T``.

    ``columns = A[:, S]`` (``[n, rank]``) and ``pivot_block = A[S, S]`` in pivot order, for the
    pivots ``S`` of ``pivoted`` (unused steps give zero columns). Equal to ``pivoted.factor`` up
    to rounding, and differentiable in ``A``'s entries with the pivots held fixed.
    ``chol(A[S, S])`` is ``pivoted.factor``'s pivot rows, differentiated as a Cholesky factor
    of ``pivot_block``: factorising the block again fails in float32 (NaN) once the late
    pivots near rounding level make it numerically singular, as at a rank near ``n``.
    """
    used = pivoted.used
    both_used = used[:, None] & used[None, :]
    identity = jnp.eye(used.shape[0], dtype=columns.dtype)
    pivot_block = jnp.where(both_used, pivot_block, identity)
    known_factor = jnp.where(both_used, jnp.tril(pivoted.factor[pivoted.pivots]), identity)
    block_cholesky = _cholesky_of(pivot_block, known_factor)
    columns = jnp.where(used[None, :], columns, 0)
    return jax.scipy.linalg.solve_triangular(block_cholesky, columns.T, lower=True).T


@jax.custom_jvp
def _cholesky_of(matrix: jax.Array, factor: jax.Array) -> jax.Array:
    """``factor``, a lower Cholesky factor of ``matrix`` already known, with the derivative of
    ``jnp.linalg.cholesky(matrix)``; ``factor`` itself is not differentiated."""
    del matrix
    return factor


@_cholesky_of.defjvp
def _cholesky_of_jvp(primals, tangents):
    # d chol(A) = L Phi(L^-1 dA L^-T), Phi: the lower triangle with half the diagonal (the
    # tangent symmetrised first, as jnp.linalg.cholesky's own rule does).
    _, factor = primals
    d_matrix = (tangents[0] + tangents[0].T) / 2
    solve = functools.partial(jax.scipy.linalg.solve_triangular, factor, lower=True)
    inner = solve(solve(d_matrix).T)  # L^-1 dA L^-T (symmetric)
    phi = jnp.tril(inner) - 0.5 * jnp.diag(jnp.diagonal(inner))
    return factor, matmul(factor, phi)


class Preconditioner(NamedTuple):
    """``P = L L^T + noise * I``, kept as ``L`` and the eigenpairs of ``L L^T``.

    ``L L^T = G diag(s) G^T`` with ``G: [n, k]`` orthonormal (``G = Q U`` from ``L = Q R`` and
    ``R = U S V^T``, ``s = S^2``). In that basis ``P^-1 = G diag(1 / (s + noise)) G^T +
    (I - G G^T) / noise``: the large and the small eigenvalues of ``P`` are inverted apart. The
    textbook Woodbury form solves with ``noise * I + L^T L``, whose condition number
    ``~ max(s) / noise`` reaches ``1e7`` (``1e-4`` noise, ``1e3`` kernel eigenvalue), where a
    float32 Cholesky factor is noise and the preconditioner indefinite.
    """

    factor: jax.Array  # L: [n, k]
    noise: jax.Array  # scalar
    basis: jax.Array  # G: [n, k]
    eigenvalues: jax.Array  # s: [k]

    @classmethod
    def build(cls, factor: jax.Array, noise: jax.Array) -> Preconditioner:
        n, rank = factor.shape
        if rank == 0:
            return cls(factor, noise, factor, jnp.zeros((0,), factor.dtype))
        q, r = jnp.linalg.qr(factor)
        u, singular_values, _ = jnp.linalg.svd(r)
        return cls(factor, noise, matmul(q, u), singular_values**2)

    def solve(self, v: jax.Array) -> jax.Array:
        """``P^{-1} v`` for ``v: [n, c]``."""
        projections = matmul(self.basis.T, v)
        complement = (v - matmul(self.basis, projections)) / self.noise
        scaled = projections / (self.eigenvalues + self.noise)[:, None]
        return complement + matmul(self.basis, scaled)

    def logdet(self) -> jax.Array:
        """``log det P = sum(log(s + noise)) + (n - k) log(noise)``."""
        n, rank = self.factor.shape
        return jnp.sum(jnp.log(self.eigenvalues + self.noise)) + (n - rank) * jnp.log(self.noise)

    def trace_inverse(self) -> jax.Array:
        """``tr(P^-1) = sum(1 / (s + noise)) + (n - k) / noise``."""
        n, rank = self.factor.shape
        return jnp.sum(1 / (self.eigenvalues + self.noise)) + (n - rank) / self.noise

    def sample(self, key: jax.Array, count: int) -> jax.Array:
        """``count`` independent ``N(0, P)`` vectors as the columns of ``[n, count]``."""
        n, rank = self.factor.shape
        low_key, full_key = jax.random.split(key)
        low = jax.random.normal(low_key, (rank, count), self.factor.dtype)
        full = jax.random.normal(full_key, (n, count), self.factor.dtype)
        return matmul(self.factor, low) + jnp.sqrt(self.noise) * full
