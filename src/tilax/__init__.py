"""tilax: Pallas GPU kernels for Mixture-of-Experts layers and RBF kernel sums."""

from tilax.moe.api import MoEConfig, moe_apply, moe_init

__version__ = "0.1.0"

__all__ = ["MoEConfig", "__version__", "moe_apply", "moe_init"]
