"""Shared helpers for the MoE tests (CPU: Pallas interpret mode; keep shapes tiny)."""

import numpy as np
import pytest


def rel_err(actual, expected) -> float:
    """Max absolute difference relative to the largest reference magnitude."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


@pytest.fixture
def rng():
    return np.random.default_rng(0)
