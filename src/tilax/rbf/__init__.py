"""RBF kernel sums: ``rbf_kernel_mv`` and ``rbf_kde_density`` (see ``tilax.rbf.api``)."""

from tilax.rbf.api import rbf_kde_density, rbf_kernel_mv

__all__ = ["rbf_kde_density", "rbf_kernel_mv"]
