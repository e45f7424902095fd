"""The pivoted-Cholesky preconditioner, the batched CG and the Lanczos quadrature, on small
explicit matrices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gp_oracle import gp_data, rbf_matrix

from tilax.gp import cg, lanczos, preconditioner


def kernel_matrix(n: int, lengthscale: float) -> np.ndarray:
    x, _ = gp_data(n, 2, seed=0, noise=0.1)
    return rbf_matrix(x, x, lengthscale)[0].astype(np.float32)


def factor_of(matrix: np.ndarray, rank: int) -> preconditioner.PivotedCholesky:
    a = jnp.asarray(matrix)
    return jax.jit(preconditioner.pivoted_cholesky, static_argnums=(1, 2))(
        jnp.diagonal(a), lambda i: a[:, i], rank)


def test_pivoted_cholesky_error_decreases_with_rank_and_is_exact_at_full_rank():
    matrix = kernel_matrix(12, 0.15)  # well conditioned: points far apart in lengthscales
    errors = []
    for rank in range(0, 13, 2):
        factor = np.asarray(factor_of(matrix, rank).factor, np.float64)
        residual = matrix - factor @ factor.T
        # A - L L^T stays positive semi-definite (up to rounding).
        assert np.min(np.linalg.eigvalsh(residual)) > -1e-5
        errors.append(np.trace(residual))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:], strict=False))
    full = np.asarray(factor_of(matrix, 12).factor, np.float64)
    np.testing.assert_allclose(full @ full.T, matrix, atol=1e-5)


def test_pivoted_cholesky_of_a_singular_matrix_is_finite():
    low_rank = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    matrix = low_rank @ low_rank.T
    pivoted = factor_of(matrix, 10)
    factor = np.asarray(pivoted.factor, np.float64)
    assert np.all(np.isfinite(factor))
    assert int(np.sum(pivoted.used)) == 3  # the rest find no pivot above rounding level
    np.testing.assert_allclose(factor @ factor.T, matrix, atol=1e-4 * np.max(matrix))


def test_nystrom_factor_equals_the_pivoted_factor():
    matrix = kernel_matrix(40, 0.3)
    pivoted = factor_of(matrix, 8)
    pivots = np.asarray(pivoted.pivots)
    rebuilt = preconditioner.nystrom_factor(
        jnp.asarray(matrix[:, pivots]), jnp.asarray(matrix[np.ix_(pivots, pivots)]), pivoted)
    np.testing.assert_allclose(rebuilt, pivoted.factor, atol=1e-4)


@pytest.mark.parametrize("singular_values, noise", [((3, 2, 1, 0.5), 0.3),
                                                    ((100, 1, 1e-2, 1e-3), 1e-4)])
def test_preconditioner_solve_logdet_and_trace(singular_values, noise):
    # The second case: eigenvalues of L L^T from 1e-6 to 1e4 over a noise of 1e-4, where the
    # Woodbury form's k x k system (condition ~1e8) loses float32 (error ~4e-3 here).
    rng = np.random.default_rng(1)
    left = np.linalg.qr(rng.normal(size=(30, 4)))[0]
    right = np.linalg.qr(rng.normal(size=(4, 4)))[0]
    factor = left @ np.diag(singular_values) @ right
    precond = preconditioner.Preconditioner.build(jnp.asarray(factor, jnp.float32),
                                                  jnp.float32(noise))
    dense = factor @ factor.T + noise * np.eye(30)
    v = rng.normal(size=(30, 3))
    expected = np.linalg.solve(dense, v)
    solved = np.asarray(precond.solve(jnp.asarray(v, jnp.float32)), np.float64)
    assert np.linalg.norm(solved - expected) <= 3e-4 * np.linalg.norm(expected)
    np.testing.assert_allclose(precond.logdet(), np.linalg.slogdet(dense)[1], rtol=1e-5)
    np.testing.assert_allclose(precond.trace_inverse(), np.trace(np.linalg.inv(dense)),
                               rtol=1e-5)


def test_preconditioner_samples_have_its_covariance():
    factor = jnp.asarray(np.random.default_rng(1).normal(size=(30, 4)), jnp.float32)
    precond = preconditioner.Preconditioner.build(factor, jnp.float32(0.3))
    dense = np.asarray(factor, np.float64) @ np.asarray(factor, np.float64).T + 0.3 * np.eye(30)
    samples = np.asarray(precond.sample(jax.random.key(0), 20_000), np.float64)
    np.testing.assert_allclose(samples @ samples.T / 20_000, dense, atol=0.1 * np.max(dense))


def test_batched_cg_solves_and_its_quadrature_is_exact_after_n_steps():
    matrix = kernel_matrix(24, 0.3) + 0.05 * np.eye(24, dtype=np.float32)
    rhs = np.random.default_rng(3).normal(size=(24, 5)).astype(np.float32)
    a = jnp.asarray(matrix)
    result = jax.jit(lambda b: cg.preconditioned_cg(
        lambda v: a @ v, b, lambda v: v, tol=1e-6, max_iters=100, lanczos_iters=24))(rhs)
    np.testing.assert_allclose(result.solution, np.linalg.solve(matrix, rhs), rtol=1e-3,
                               atol=1e-3)
    # With the identity preconditioner, each column's quadrature is b^T log(A) b: the Krylov
    # space of a 24 x 24 matrix is complete after at most 24 steps.
    eigenvalues, vectors = np.linalg.eigh(matrix.astype(np.float64))
    projections = vectors.T @ rhs
    expected = np.mean(np.sum(projections**2 * np.log(eigenvalues)[:, None], axis=0))
    estimate = lanczos.logdet_ratio(result.alphas, result.betas, result.initial_norms)
    np.testing.assert_allclose(estimate, expected, rtol=1e-3)


def test_tridiagonals_pad_unrun_iterations_with_a_decoupled_identity():
    alphas = jnp.array([[0.5], [0.25], [0.0]])
    betas = jnp.array([[0.2], [0.1], [0.0]])
    t = np.asarray(lanczos.tridiagonals(alphas, betas)[0])
    expected = np.array([[2.0, np.sqrt(0.2) / 0.5, 0], [np.sqrt(0.2) / 0.5, 4 + 0.2 / 0.5, 0],
                         [0, 0, 1.0]])
    np.testing.assert_allclose(t, expected, rtol=1e-6)


def test_nystrom_factor_differentiates_as_the_refactorised_block():
    matrix = jnp.asarray(kernel_matrix(40, 0.3))
    pivoted = factor_of(np.asarray(matrix), 8)
    pivots = pivoted.pivots
    direction = jnp.asarray(kernel_matrix(40, 0.5))  # a symmetric tangent

    def rebuilt(a):
        return preconditioner.nystrom_factor(a[:, pivots], a[pivots][:, pivots], pivoted)

    def textbook(a):  # the block factorised again (well conditioned here)
        block_cholesky = jnp.linalg.cholesky(a[pivots][:, pivots])
        return jax.scipy.linalg.solve_triangular(block_cholesky, a[:, pivots].T, lower=True).T

    value, tangent = jax.jvp(rebuilt, (matrix,), (direction,))
    expected_value, expected_tangent = jax.jvp(textbook, (matrix,), (direction,))
    np.testing.assert_allclose(value, expected_value, atol=1e-4)
    np.testing.assert_allclose(tangent, expected_tangent, atol=1e-3 * np.max(np.abs(
        expected_tangent)))
    # Reverse mode goes through the same rule (its transpose).
    cotangent = jnp.ones_like(value)
    grad = jax.grad(lambda a: jnp.sum(rebuilt(a) * cotangent))(matrix)
    expected_grad = jax.grad(lambda a: jnp.sum(textbook(a) * cotangent))(matrix)
    np.testing.assert_allclose(grad + grad.T, expected_grad + expected_grad.T,
                               atol=1e-3 * np.max(np.abs(expected_grad)))
