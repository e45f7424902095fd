"""tilax: Pallas GPU kernels for Mixture-of-Experts layers and RBF kernel sums."""

__version__ = "0.1.0"

__all__ = ["__version__"]
