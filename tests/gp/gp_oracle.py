"""Dense float64 oracles for the GP tests: the n x n covariance and its Cholesky factor (NumPy,
no JAX, so no x64 switch), and the data the tests share."""

from __future__ import annotations

import numpy as np


def gp_data(n: int, dim: int, seed: int, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """Inputs uniform in the unit cube, targets a smooth function plus noise (float32)."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(n, dim))
    y = np.sin(6 * x[:, 0]) + np.cos(4 * x[:, 1 % dim]) + np.sqrt(noise) * rng.normal(size=n)
    return x.astype(np.float32), y.astype(np.float32)


#: ``c`` of ``z = c r`` per Matérn kernel.
MATERN_RATES = {"matern12": 1.0, "matern32": np.sqrt(3.0), "matern52": np.sqrt(5.0)}


def _profile(kernel: str, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(k(r), phi(r))``, ``phi = -k'(r) / r`` (``-dk/ds``, ``s = r^2 / 2``; 0 at ``r = 0``
    for Matérn-1/2, tilax.kernel_mv's convention)."""
    if kernel == "rbf":
        value = np.exp(-0.5 * r * r)
        return value, value
    z = MATERN_RATES[kernel] * r
    decay = np.exp(-z)
    if kernel == "matern12":
        return decay, np.where(r > 0, decay / np.where(r > 0, r, 1.0), 0.0)
    if kernel == "matern32":
        return (1 + z) * decay, 3 * decay
    return (1 + z + z * z / 3) * decay, 5 / 3 * (1 + z) * decay


def kernel_matrix(a, b, lengthscale, kernel: str = "rbf"):
    """Kernel matrix, its pair weights ``phi`` (``dK/d(scaled_d) = -phi scaled_d``) and the
    scaled differences ``(a_i - b_j) / l``, all float64."""
    scaled = (np.asarray(a, np.float64)[:, None, :] - np.asarray(b, np.float64)[None]) / (
        np.asarray(lengthscale, np.float64)
    )
    value, phi = _profile(kernel, np.sqrt(np.sum(scaled**2, axis=-1)))
    return value, phi, scaled


def rbf_matrix(a: np.ndarray, b: np.ndarray, lengthscale) -> tuple[np.ndarray, np.ndarray]:
    """RBF kernel matrix and the scaled differences (a_i - b_j) / l, both float64."""
    value, _, scaled = kernel_matrix(a, b, lengthscale)
    return value, scaled


def dense_mll(params: dict, x, y, kernel: str = "rbf") -> tuple[float, dict, np.ndarray,
                                                                np.ndarray]:
    """``log p(y | x)`` and its gradients w.r.t. params, x and y by Cholesky, in float64.

    ``d mll = 0.5 tr((alpha alpha^T - C^-1) dC)``.
    """
    lengthscale = np.asarray(params["lengthscale"], np.float64)
    outputscale, noise = float(params["outputscale"]), float(params["noise"])
    y = np.asarray(y, np.float64)
    n = y.shape[0]
    kernel, phi, scaled = kernel_matrix(x, x, lengthscale, kernel)
    covariance = outputscale * kernel + noise * np.eye(n)
    cholesky = np.linalg.cholesky(covariance)
    alpha = np.linalg.solve(cholesky.T, np.linalg.solve(cholesky, y))
    value = -0.5 * y @ alpha - np.sum(np.log(np.diag(cholesky))) - 0.5 * n * np.log(2 * np.pi)
    inverse = np.linalg.inv(covariance)
    weight = 0.5 * (np.outer(alpha, alpha) - inverse)
    # dK/dl_d = phi * scaled_d^2 / l_d (phi = K for the Gaussian); a scalar lengthscale sums
    # over d.
    per_dim = np.einsum("ij,ij,ijd->d", weight, outputscale * phi, scaled**2) / lengthscale
    grads = {
        "lengthscale": per_dim if lengthscale.ndim else np.sum(per_dim),
        "outputscale": np.sum(weight * kernel),
        "noise": np.trace(weight),
    }
    # C_ij depends on x_i through row i and column i: d C_ij / d x_i = -phi_ij (x_i - x_j) / l^2.
    d_x = -2 * np.einsum("ij,ij,ijd->id", weight, outputscale * phi, scaled) / lengthscale
    return float(value), grads, d_x, -alpha


def dense_posterior(params: dict, x, y, x_star, kernel: str = "rbf"
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Posterior mean and variance of the latent function at ``x_star``, in float64."""
    outputscale, noise = float(params["outputscale"]), float(params["noise"])
    name = kernel
    kernel, _, _ = kernel_matrix(x, x, params["lengthscale"], name)
    cross, _, _ = kernel_matrix(x, x_star, params["lengthscale"], name)
    covariance = outputscale * kernel + noise * np.eye(kernel.shape[0])
    solved = np.linalg.solve(covariance, np.c_[np.asarray(y, np.float64), outputscale * cross])
    mean = outputscale * cross.T @ solved[:, 0]
    variance = outputscale - outputscale * np.sum(cross * solved[:, 1:], axis=0)
    return mean, variance
