import numpy as np
import pytest
from helpers import peak_rel_err, rel_err


def test_rel_err_is_normwise_over_all_leaves():
    expected = {"a": np.array([3.0, 0.0]), "b": [np.array([4.0])]}
    actual = {"a": np.array([3.0, 1.0]), "b": [np.array([4.0])]}
    assert rel_err(actual, expected) == pytest.approx(1 / 5)
    assert rel_err(expected, expected) == 0.0


def test_rel_err_rejects_mismatched_trees():
    with pytest.raises(ValueError, match="leaves"):
        rel_err([np.ones(2)], [np.ones(2), np.ones(2)])


def test_peak_rel_err_sees_one_wrong_element():
    expected = np.ones(10_000)
    actual = expected.copy()
    actual[7] = 2.0
    assert peak_rel_err(actual, expected) == pytest.approx(1.0)
    assert rel_err(actual, expected) == pytest.approx(0.01)
