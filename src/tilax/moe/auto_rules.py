"""Which Pallas backend ``impl="auto"`` runs: a table of measured wins, nothing guessed.

Each rule names a GPU (``jax.Device.device_kind``), a dtype, a dispatch and the expert count
and top-k it was measured at, the backend whose bf16 train step was faster there, and the
stored result files (``data/results/``) that hold both backends' rows from one process. A
config that matches no rule runs Triton, the backend every configuration has been measured
with. ``tests/moe/test_moe_auto_rules.py`` reads the evidence files and fails if a rule's
backend is not faster beyond the spread of both rows at every size stored there;
``docs/guides/moe.md`` lists the table.

Rules apply to the measured settings only: dropless routing, the default tiles and no
``recompute`` (the Mosaic GPU kernels have their own tile constraints).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from tilax import _pallas


@dataclasses.dataclass(frozen=True)
class AutoRule:
    device_kind: str
    dtype: str
    dispatch: str
    num_experts: int
    top_k: int
    backend: str
    evidence: tuple[str, ...]


_E8_LAYER_34E4F92 = (
    "h200-20261201-34e4f92-layer-mosaic-T131072.json",
    "h200-20261201-34e4f92-layer-mosaic-T32768.json",
)

_E8_LAYER_GATHER_FUSED = (
    "h200-20261201-e6271ea-layer-gf.json",
    "h200-20261202-ee91e69-layer-gf.json",
)
_E8_LAYER_SORTED = _E8_LAYER_34E4F92 + ("h200-20261202-ee91e69-layer.json",)
_E64_DECODER_24F4F42 = ("h200-20261201-24f4f42-decoder-T131072.json",)
_E64_DECODER_29D021F = ("h200-20261202-29d021f-decoder.json",)

RULES: tuple[AutoRule, ...] = (
    AutoRule("NVIDIA H200", "bfloat16", "sorted", 8, 2, "mosaic", _E8_LAYER_SORTED),
    AutoRule("NVIDIA H200", "bfloat16", "fused_gsum", 8, 2, "mosaic", _E8_LAYER_34E4F92),
    AutoRule("NVIDIA H200", "bfloat16", "gather", 8, 2, "mosaic", _E8_LAYER_GATHER_FUSED),
    AutoRule("NVIDIA H200", "bfloat16", "fused", 8, 2, "mosaic", _E8_LAYER_GATHER_FUSED),
    AutoRule("NVIDIA H200", "bfloat16", "sorted", 64, 8, "mosaic", _E64_DECODER_24F4F42),
    AutoRule("NVIDIA H200", "bfloat16", "fused", 64, 8, "mosaic", _E64_DECODER_29D021F),
)


def rule_for(device_kind, dtype, dispatch: str, num_experts: int, top_k: int) -> AutoRule | None:
    """The rule of a layer (dropless, default tiles) on a GPU of ``device_kind``, or ``None``."""
    for rule in RULES:
        if (rule.device_kind == device_kind and jnp.dtype(rule.dtype) == jnp.dtype(dtype)
                and (rule.dispatch, rule.num_experts, rule.top_k)
                == (dispatch, num_experts, top_k)):
            return rule
    return None


def matching_rule(config) -> AutoRule | None:
    """The rule for ``config`` (an ``MoEConfig``) on this device, or ``None``."""
    tiles_set = any(getattr(config, name) is not None for name in
                    ("block_m", "block_n", "block_k", "num_warps", "num_stages"))
    if config.routing != "dropless" or config.recompute or tiles_set:
        return None
    return rule_for(_pallas.gpu_device_kind(), config.dtype, config.dispatch,
                    config.num_experts, config.top_k)


def auto_backend(config) -> str:
    """The Pallas backend ``impl="auto"`` runs for ``config``: a rule's backend where one
    matches and can run here, else the default (Triton on GPUs, interpret mode on CPU)."""
    rule = matching_rule(config)
    if rule is not None and rule.backend == "mosaic":
        if _pallas.mosaic_unavailable_reason() is None:
            return "mosaic"
    return _pallas.resolve_backend("auto")
