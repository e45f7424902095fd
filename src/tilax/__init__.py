"""tilax: Pallas GPU kernels for Mixture-of-Experts layers and stationary kernel sums."""

from tilax import gp as gp  # tilax.gp.mll, tilax.gp.posterior
from tilax.moe.api import MoEConfig, moe_apply, moe_init, moe_update_bias
from tilax.rbf import kernel_mv, rbf_kde_density, rbf_kernel_mv

__version__ = "0.1.0"

__all__ = [
    "MoEConfig",
    "__version__",
    "kernel_mv",
    "moe_apply",
    "moe_init",
    "moe_update_bias",
    "rbf_kde_density",
    "rbf_kernel_mv",
]
