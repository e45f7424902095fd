"""Tile choice and the shared-memory model of the RBF Pallas kernels (plain Python: no kernel
runs). The GPU side of the same question is tests/rbf/test_rbf_gpu.py::test_every_shape_runs."""

from __future__ import annotations

import pytest

from tilax.rbf import config as C

H200 = 232448  # opt-in shared memory per block, sm90


def gpu(shared_memory: int = H200) -> C.Device:
    """A GPU (no Mosaic GPU) of ``shared_memory`` bytes per block and an H200's cores."""
    return C.Device(mosaic=False, cores=132, shared_memory=shared_memory)

BIG = 65536  # N = M of the benchmark rows: the largest tiles


def launches(path: C.PathConfig, dim: int):
    """(name, launch, call) for every kernel call each launch of ``path`` serves."""
    calls = C.path_calls(path.modes, dim, path.cols)
    for name in ("fwd", "dq", "dk"):
        for call in calls[name]:
            yield name, getattr(path, name), call


def paths(cfg: C.PallasConfig):
    return [path for path in (cfg.fast, cfg.exact) if path is not None]


def test_every_shape_fits_the_h200_forward_and_backward():
    # D in 1..128, O in 1..512, every precision: every launch of both distance paths (forward,
    # both gradient kernels, the KDE's) fits with the margin. Configs repeat (they depend on O
    # only through the value tile and padded columns): each distinct one is checked once.
    budget = C.SHARED_MEMORY_MARGIN * H200
    checked = set()
    for precision in C.PRECISIONS:
        for dim in range(1, 129):
            for out in range(1, 513):
                cfg = C.default_config("triton", precision, batch=1, n=BIG, m=BIG, out=out,
                                       dim=dim, device=gpu())  # fmt: skip
                for path in paths(cfg):
                    if (path, dim) in checked:
                        continue
                    checked.add((path, dim))
                    assert path.cols >= out and path.cols % path.dq.block_o == 0
                    for name, launch, call in launches(path, dim):
                        for tile in (launch.block_p, launch.block_l, launch.block_o):
                            assert tile >= 16 and tile & (tile - 1) == 0, (name, launch)
                        assert path.cols % launch.block_o == 0, (name, launch, path.cols)
                        used = C.shared_memory_bytes(call, launch)
                        assert used <= budget, (precision, dim, out, name, call, launch, used)
    assert len(checked) > 3 * 128  # the grid really produced distinct configs


@pytest.mark.parametrize("limit", [101376, 166912])  # sm86/sm89, sm80
@pytest.mark.parametrize("n", [1, 300, BIG])
def test_sampled_shapes_fit_smaller_devices(limit, n):
    # Within the limit; the margin may be given up by the smallest tiles (D = 64, O = 512).
    # (D = 128 with O = 512 needs more than ~99 KB: see the next test.)
    for precision in C.PRECISIONS:
        for dim in (1, 3, 8, 20, 33, 64):
            for out in (1, 16, 100, 200, 512):
                cfg = C.default_config("triton", precision, batch=2, n=n, m=n + 7, out=out,
                                       dim=dim, device=gpu(limit))  # fmt: skip
                for path in paths(cfg):
                    for name, launch, call in launches(path, dim):
                        used = C.shared_memory_bytes(call, launch)
                        assert used <= limit, (name, launch, used)


def test_shapes_beyond_a_small_device_raise_a_clear_error():
    with pytest.raises(ValueError, match="no RBF kernel tiles fit 101376 bytes"):
        C.default_config("triton", "high", batch=1, n=BIG, m=BIG, out=512, dim=128,
                         device=gpu(101376))  # fmt: skip


def test_model_flags_the_measured_overflow_and_passes_what_ran():
    # On the H200, "high" at D = 20, O = 100 failed with 64 x 128 gradient tiles and 3 stages
    # (237568 bytes requested); "default" ran with the same launch (bfloat16 cotangent tiles).
    old = C.Launch(64, 128, 64, num_warps=4, num_stages=3)
    width, cols = C.expansion_width(20), 128
    high = C.KernelCall("grad", C.Expansion("tf32x3"), width, cols, values="bf16x3",
                        coords="bf16x3", with_pw=False)  # fmt: skip
    default = C.KernelCall("grad", C.Expansion("tf32x3"), width, cols, values="bf16",
                           coords="bf16x3", with_pw=False)  # fmt: skip
    assert C.shared_memory_bytes(high, old) >= 237568
    assert C.shared_memory_bytes(default, old) <= H200
    cfg = C.default_config("triton", "high", batch=1, n=600, m=900, out=100, dim=20,
                           device=gpu())  # fmt: skip
    for _, launch, call in launches(cfg.fast, 20):
        assert C.shared_memory_bytes(call, launch) <= C.SHARED_MEMORY_MARGIN * H200


def test_large_problems_keep_the_tuned_fast_launches():
    # precision=None is "default": TF32-part distances, single-bfloat16 value products, and the
    # H200-tuned launches at the benchmark shape (N = M = 65536, D = 8, O = 16).
    cfg = C.default_config("triton", None, batch=1, n=BIG, m=BIG, out=16, dim=8,
                           device=gpu())  # fmt: skip
    assert cfg.precision == "default" and cfg.fast.modes == C.FAST_MODES["default"]
    assert (cfg.fast.modes.distance, cfg.fast.modes.values) == ("tf32x3", "bf16")
    assert cfg.fast.fwd == C.Launch(128, 128, 16, num_warps=4, num_stages=3)
    assert cfg.fast.dq == cfg.fast.dk == C.Launch(128, 64, 16, num_warps=4, num_stages=3)
    assert cfg.exact.modes == C.EXACT_MODES["default"]
    highest = C.default_config("triton", "highest", batch=1, n=BIG, m=BIG, out=16, dim=8,
                               device=gpu())  # fmt: skip
    assert highest.fast is None and highest.exact.modes.distance == "difference"
    assert highest.exact.fwd == C.Launch(64, 32, 16, num_warps=4, num_stages=2)
    assert highest.exact.dq == C.Launch(64, 32, 16, num_warps=4, num_stages=2)
    assert highest.exact.dk == C.Launch(64, 16, 16, num_warps=4, num_stages=2)  # it spills at 32


def test_small_problems_shrink_tiles_for_occupancy():
    cfg = C.default_config("triton", None, batch=1, n=100, m=20, out=3, dim=2,
                           device=gpu())  # fmt: skip
    fast = cfg.fast
    assert (fast.fwd.block_p, fast.fwd.block_l, fast.fwd.block_o) == (32, 32, 16)
    assert (fast.dq.block_p, fast.dq.block_l, fast.dk.block_p, fast.dk.block_l) == (64, 32, 32, 64)
    assert fast.query_rows(100, backward=True) == 128 and fast.key_rows(20, backward=True) == 32


def test_interpret_mode_uses_large_tiles_and_explicit_blocks():
    forced = C.default_config("interpret", "high", batch=1, n=5, m=5, out=200, dim=3, block_q=64,
                              block_o=32)  # fmt: skip
    for path in paths(forced):
        assert (path.fwd.block_p, path.dq.block_p, path.dk.block_l, path.fwd.block_o) == (
            64, 64, 64, 32,
        )  # fmt: skip
        assert path.fwd.block_l == 16 and path.cols == 224


def test_fit_launch_shrinks_stages_then_tiles_and_raises_when_nothing_fits():
    call = C.KernelCall("grad", C.Difference(64, True), cols=256, values="tf32x3")
    start = C.Launch(128, 128, 64, num_stages=3)
    fitted = C.fit_launch(call, start, H200)
    assert fitted.num_stages == 1 and fitted.block_l < start.block_l
    assert C.shared_memory_bytes(call, fitted) <= C.SHARED_MEMORY_MARGIN * H200
    with pytest.raises(ValueError, match="no RBF kernel tiles fit 1000 bytes"):
        C.fit_launch(call, start, 1000)
