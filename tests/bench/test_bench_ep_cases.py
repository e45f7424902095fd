"""The ``ep`` suite's grid: which mesh sizes a host measures, and that every size gets its
links, steps and exchanges against one set of one-device rows."""

from collections import Counter

import bench_ep
import pytest


@pytest.mark.parametrize("experts, have, sizes", [
    (8, 1, [2]),         # one GPU: the two-GPU rows are stored as unavailable
    (8, 2, [2]),
    (8, 4, [2, 4]),
    (64, 8, [2, 4, 8]),  # E64 with 32, 16 and 8 experts per GPU in one process
    (8, 3, [2]),         # 3 does not divide 8
    (6, 6, [2, 3, 6]),
])
def test_mesh_sizes(experts, have, sizes):
    assert bench_ep.mesh_sizes(experts, have) == sizes


def test_every_mesh_size_gets_the_same_rows(monkeypatch):
    import jax

    monkeypatch.setattr(jax, "local_device_count", lambda: 8)
    cases = bench_ep.ep_cases("full")
    per_size = Counter(case.devices for case in cases)
    assert per_size[1] == len(bench_ep.SHAPES) * len(bench_ep.TOKENS_PER_DEVICE)
    one_size = per_size[2]
    assert per_size == {1: per_size[1], 2: one_size, 4: one_size, 8: one_size}
    assert one_size == per_size[1] * (len(bench_ep.LINKS) + 2 * len(bench_ep.TRANSPORTS)
                                      + len(bench_ep.CHUNKS))
    assert len({case.id for case in cases}) == len(cases)  # row names stay unique
    assert [case.part for case in cases[:1]] == ["link"]  # links run first
