"""MoE benchmarks: one row per (suite, impl, dispatch, routing, dtype, shape, op).

The cases come from ``bench_moe`` (parametrised by conftest for the session's mode and suites);
``bench.run`` times them per the contract in ``bench_harness``.
"""

import pytest


@pytest.mark.bench_suite("maxtok")
def test_maxtok(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("layer")
def test_layer(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("decoder")
def test_decoder(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("pieces")
def test_pieces(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("blockm")
def test_blockm(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("variants")
def test_variants(bench, case):
    bench.run(case)


@pytest.mark.bench_suite("decode")
def test_decode(bench, case):
    bench.run(case)
