"""RBF benchmarks: one row per (suite, impl, shape, op).

The cases come from ``bench_rbf`` (parametrised by conftest for the session's mode and suites);
``bench.run`` times them per the contract in ``bench_harness``.
"""

import pytest


@pytest.mark.bench_suite("kernel_mv_max_n")
def test_kernel_mv_max_n(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("kernel_mv_peak")
def test_kernel_mv_peak(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("kernel_mv")
def test_kernel_mv(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("kde_density")
def test_kde_density(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("kernel_mv_tiles")
def test_kernel_mv_tiles(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("kernel_mv_launches")
def test_kernel_mv_launches(bench, case):
    bench.run(case)
