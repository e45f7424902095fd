"""Mixture-of-Experts layer: router, dispatch, Pallas grouped matmuls and XLA baselines.

The public entry points are re-exported at the top level as ``tilax.MoEConfig``,
``tilax.moe_init`` and ``tilax.moe_apply``; :func:`skew_tokens` is the benchmark/test knob for
skewed routing.
"""

from tilax.moe.api import MoEConfig, kernel_tiles, moe_apply, moe_init, resolve_impl
from tilax.moe.router import skew_tokens

__all__ = ["MoEConfig", "kernel_tiles", "moe_apply", "moe_init", "resolve_impl", "skew_tokens"]
