"""Expert-parallel benchmarks: one row per (part, layer, tokens per device, devices, exchange).

The cases come from ``bench_ep`` (parametrised by conftest when ``--bench-suite ep`` asks);
``bench.run`` times them per the contract in ``bench_harness``.
"""

import pytest


@pytest.mark.bench_suite("ep")
def test_ep(bench, case):
    bench.run(case)
