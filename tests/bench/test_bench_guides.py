"""Guide timings: the RBF guide's Gaussian-process lengthscale step (suite ``guide_gp``).

The case comes from ``bench_guides`` (parametrised by conftest when ``--bench-suite guide_gp``
asks); ``bench.run`` times it per the contract in ``bench_harness``.
"""

import pytest


@pytest.mark.bench_suite("guide_gp")
def test_guide_gp(bench, case):
    bench.run(case)
