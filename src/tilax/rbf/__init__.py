"""Kernel sums: ``kernel_mv`` (stationary kernels), ``rbf_kernel_mv`` (its Gaussian kernel) and
``rbf_kde_density`` (see ``tilax.rbf.api``)."""

from tilax.rbf.api import kernel_mv, rbf_kde_density, rbf_kernel_mv

__all__ = ["kernel_mv", "rbf_kde_density", "rbf_kernel_mv"]
