"""Gaussian-process benchmarks: the MLL with its gradient per impl and n (suite ``gp``), per
preconditioner rank (suite ``gp_rank``), and the million-point fit (suite ``gp_fit``).

The cases come from ``bench_gp`` (parametrised by conftest for the session's mode and suites);
``bench.run`` times an evaluation per the contract in ``bench_harness``; the fit is run once by
``bench_gp.run_fit`` and its wall time stored as the row's one round.
"""

import bench_gp
import pytest


@pytest.mark.bench_suite("gp")
def test_gp(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("gp_rank")
def test_gp_rank(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("gp_fit")
def test_gp_fit(bench, case):
    bench_gp.run_fit(bench, case)
