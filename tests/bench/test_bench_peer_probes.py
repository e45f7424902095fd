"""A peer's probe that crashed says how: a signal by name, not a negative exit code."""

import bench_rbf


def test_exit_status_names_the_signal():
    assert bench_rbf.exit_status(1) == "exit code 1"
    assert bench_rbf.exit_status(-11) == "crashed: SIGSEGV (signal 11)"
    assert bench_rbf.exit_status(-200) == "ended by signal 200"
