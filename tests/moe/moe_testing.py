"""Helpers shared by the MoE tests (a plain module: test folders share no conftest names)."""

import numpy as np


def rel_err(actual, expected) -> float:
    """Max absolute difference relative to the largest reference magnitude."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))
