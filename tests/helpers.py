"""Numerical helpers shared by every test folder (tests/ is on ``sys.path``: its conftest lives
there). One definition each; the oracles per op live beside their tests (``tests/rbf/
rbf_oracle.py``, ``tests/moe/moe_testing.py``) and use these."""

from __future__ import annotations

import numpy as np


def _float64_leaves(tree) -> list[np.ndarray]:
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in _float64_leaves(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _float64_leaves(item)]
    return [np.asarray(tree, np.float64)]


def rel_err(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` in float64, over every leaf of two matching
    pytrees (dicts, lists, tuples or arrays) taken together."""
    actual, expected = _float64_leaves(actual), _float64_leaves(expected)
    if len(actual) != len(expected):
        raise ValueError(f"rel_err: {len(actual)} leaves against {len(expected)}")
    diff = sum(float(np.sum(np.square(a - e))) for a, e in zip(actual, expected, strict=True))
    norm = sum(float(np.sum(np.square(e))) for e in expected)
    return float(np.sqrt(diff) / max(np.sqrt(norm), 1e-300))


def peak_rel_err(actual, expected) -> float:
    """The largest absolute difference over the largest reference magnitude (float64): an
    elementwise bound, stricter than ``rel_err`` where one element alone is wrong."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-300))
