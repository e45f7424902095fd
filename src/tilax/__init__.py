"""tilax: Pallas GPU kernels for Mixture-of-Experts layers and RBF kernel sums."""

from tilax.rbf import rbf_kde_density, rbf_kernel_mv

__version__ = "0.1.0"

__all__ = ["__version__", "rbf_kde_density", "rbf_kernel_mv"]
