"""Mixture-of-Experts layer: router, dispatch, Pallas grouped matmuls and XLA baselines.

The public entry points are re-exported at the top level as ``tilax.MoEConfig``,
``tilax.moe_init``, ``tilax.moe_apply`` and ``tilax.moe_update_bias``; ``skew_tokens`` is the
benchmark/test knob for skewed routing.
"""

from tilax.moe.api import (
    MoEConfig,
    kernel_tiles,
    moe_apply,
    moe_init,
    moe_update_bias,
    resolve_impl,
)
from tilax.moe.router import skew_tokens

__all__ = ["MoEConfig", "kernel_tiles", "moe_apply", "moe_init", "moe_update_bias",
           "resolve_impl", "skew_tokens"]
