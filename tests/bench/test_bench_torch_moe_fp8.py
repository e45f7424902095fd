"""The PyTorch FP8 peer (``bench_torch_moe``, rows with ``quantize="fp8"`` on
``torch_grouped_mm``/``torch_grouped_mm_compile``): which layer-suite rows get it, and its
quantisation and row-layout math checked with numpy (the helpers take numpy or torch). The
``torch._scaled_grouped_mm`` calls themselves need torch on a GPU of compute capability 9.0+:
the layer suite's rows measure them against the float32 reference."""

import dataclasses

import bench_moe
import bench_torch_moe
import ml_dtypes
import numpy as np
import pytest

E4M3 = ml_dtypes.float8_e4m3fn


def cast(x):
    return x.astype(E4M3)


def group_amax(chunk_amax, group_of_chunk, num_groups):
    out = np.zeros((num_groups, chunk_amax.shape[1]), np.float32)
    np.maximum.at(out, group_of_chunk, chunk_amax)
    return out


def test_fp8_peer_rows_beside_the_mosaic_fp8_rows():
    """Every FP8 Mosaic GPU row of the layer suite has the PyTorch peer's FP8 rows, eager and
    compiled, same config and same impl names as the bfloat16 peer, each after the peer's
    bfloat16 row of that config (right after it unless an earlier group, the DeepSeek router's
    softmax baseline, already holds that row): the pair runs in one process."""
    cases = bench_moe.layer_cases("full")
    ids = [case.id for case in cases]
    mosaic = [case for case in cases if case.quantize and case.impl == "mosaic"]
    assert len(mosaic) == 3
    for impl in ("torch_grouped_mm", "torch_grouped_mm_compile"):
        peers = [case for case in cases if case.quantize and case.impl == impl]
        assert {
            dataclasses.replace(case, impl="mosaic", dispatch="sorted") for case in peers
        } == set(mosaic)
        for case in peers:
            assert case.id.startswith(f"layer-{impl}-bf16-fp8-")
            assert ids.index(case.id.replace("-fp8", "")) < ids.index(case.id)
            info = case.extra_info()
            assert info["quantize"] == "fp8" and info["fp8_scaling"] == "rowwise"
            assert info["fp8_weight_grad"] == "fp8" and info["fp8_fast_accum"] is True
            assert info["fp8_bound_out"] == bench_torch_moe.FP8_REL_ERR_BOUND_OUT
            assert info["fp8_bound_grad"] == bench_torch_moe.FP8_REL_ERR_BOUND_GRAD
    assert len(ids) == len(set(ids))
    assert "fp8_scaling" not in mosaic[0].extra_info()


def test_fp8_peer_smoke_row_is_a_recorded_unavailable_row_without_torch():
    smoke = [
        case
        for case in bench_moe.layer_cases("smoke")
        if case.quantize and case.impl == "torch_grouped_mm"
    ]
    assert len(smoke) == 1
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        assert smoke[0].unavailable_reason() == "unavailable: torch is not installed here"


def test_rowwise_scales_and_values():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 48)).astype(np.float32) * np.float32(3.0)
    x[2] = 0.0  # a row of zeros: the smallest normal scale, values exactly 0
    x[3, 5] = 1000.0  # an outlier sets its row's scale
    q, scale = bench_torch_moe.e4m3_rowwise(x, 1, np, cast)
    assert q.dtype == E4M3 and q.shape == x.shape and scale.shape == (6,)
    amax = np.abs(x).max(axis=1)
    np.testing.assert_allclose(scale[amax > 0], amax[amax > 0] / np.float32(448), rtol=1e-7)
    assert scale[2] == np.float32(2.0**-126) and not np.any(q[2].astype(np.float32))
    restored = q.astype(np.float32) * scale[:, None]
    # the largest magnitude of each row maps to 448 exactly
    np.testing.assert_allclose(np.abs(restored).max(axis=1), amax, rtol=1e-6)
    # e4m3 rounding: relative error at most 2**-4 for values in its normal range
    normal = np.abs(x / scale[:, None]) >= 2.0**-6
    np.testing.assert_array_less(np.abs(restored - x)[normal], 2.0**-4 * np.abs(x)[normal] + 1e-12)
    # along the other axis: one scale per column (a weight's output column)
    w = rng.standard_normal((2, 32, 16)).astype(np.float32)
    q_w, s_w = bench_torch_moe.e4m3_rowwise(w, 1, np, cast)
    assert s_w.shape == (2, 16)
    np.testing.assert_allclose(s_w, np.abs(w).max(axis=1) / np.float32(448), rtol=1e-7)


def test_padded_groups_layout():
    align = bench_torch_moe.FP8_ROW_ALIGN
    counts = np.array([5, 0, 17, 16, 1], np.int32)
    group_ends = np.cumsum(counts).astype(np.int32)
    num_rows = int(counts.sum())
    padded_ends, shift, total = bench_torch_moe.padded_groups(group_ends, num_rows)
    assert total % align == 0 and total >= num_rows + len(counts) * (align - 1)
    assert padded_ends[-1] == total and np.all(padded_ends % align == 0)
    sorted_expert = np.repeat(np.arange(len(counts)), counts)
    position = np.arange(num_rows) + shift[sorted_expert]
    assert len(set(position.tolist())) == num_rows and position.max() < total
    starts = np.concatenate([[0], padded_ends[:-1]])
    for expert in range(len(counts)):  # each expert's rows in order at its aligned start
        mine = position[sorted_expert == expert]
        np.testing.assert_array_equal(mine, starts[expert] + np.arange(counts[expert]))
        assert padded_ends[expert] - starts[expert] >= counts[expert]
    chunk_starts = np.arange(total // align) * align
    group_of_chunk = bench_torch_moe.group_of_chunks(padded_ends, chunk_starts)
    np.testing.assert_array_equal(
        np.repeat(np.arange(len(counts)), np.diff(np.concatenate([[0], padded_ends])) // align),
        group_of_chunk,
    )


@pytest.mark.parametrize("counts", [(5, 0, 17, 16, 1), (40, 3)])
def test_weight_gradient_operands_per_token_group(counts):
    """The 2d x 2d weight gradient's operands: one scale per (expert's token group, column),
    group-major; ``sum_g`` over a group of dequantised ``x.T @ dy`` matches the float32
    product to FP8 accuracy, and a group's scale ignores every other group's rows."""
    rng = np.random.default_rng(1)
    counts = np.array(counts, np.int32)
    num_rows, k, n = int(counts.sum()), 32, 24
    group_ends = np.cumsum(counts).astype(np.int32)
    padded_ends, shift, total = bench_torch_moe.padded_groups(group_ends, num_rows)
    sorted_expert = np.repeat(np.arange(len(counts)), counts)
    position = np.arange(num_rows) + shift[sorted_expert]
    x = np.zeros((total, k), np.float32)
    dy = np.zeros((total, n), np.float32)
    x[position] = rng.standard_normal((num_rows, k))
    dy[position] = rng.standard_normal((num_rows, n)) * (1 + np.arange(num_rows))[:, None]
    align = bench_torch_moe.FP8_ROW_ALIGN
    group_of_chunk = bench_torch_moe.group_of_chunks(padded_ends, np.arange(total // align) * align)

    def reduce(chunk_amax, groups):
        return group_amax(chunk_amax, groups, len(counts))

    q_x, s_x = bench_torch_moe.e4m3_token_groups(x, group_of_chunk, reduce, np, cast)
    q_g, s_g = bench_torch_moe.e4m3_token_groups(dy, group_of_chunk, reduce, np, cast)
    assert s_x.shape == (len(counts) * k,) and s_g.shape == (len(counts) * n,)
    starts = np.concatenate([[0], padded_ends[:-1]])
    for expert in range(len(counts)):
        rows = slice(starts[expert], padded_ends[expert])
        scale_x, scale_g = s_x[expert * k : (expert + 1) * k], s_g[expert * n : (expert + 1) * n]
        if counts[expert]:
            np.testing.assert_allclose(scale_x, np.abs(x[rows]).max(0) / 448, rtol=1e-6)
            np.testing.assert_allclose(scale_g, np.abs(dy[rows]).max(0) / 448, rtol=1e-6)
        else:
            assert np.all(scale_x == np.float32(2.0**-126))
        # what the kernel computes for this group, in float64
        ours = (q_x[rows].astype(np.float64) * scale_x).T @ (q_g[rows].astype(np.float64) * scale_g)
        exact = x[rows].astype(np.float64).T @ dy[rows]
        norm = max(np.linalg.norm(exact), 1e-30)
        assert np.linalg.norm(ours - exact) <= 0.05 * norm


def test_fp8_numerics_bound():
    out, grad = bench_torch_moe.FP8_REL_ERR_BOUND_OUT, bench_torch_moe.FP8_REL_ERR_BOUND_GRAD
    assert out < grad
    problem = bench_torch_moe.fp8_numerics_problem
    assert problem({"rel_err_out": out / 2, "max_expert_frac": 0.5}) == ""
    assert problem({"rel_err_out": out, "rel_err_grad_x": grad, "fp8_bound_out": out}) == ""
    assert "rel_err_out" in problem({"rel_err_out": (out + grad) / 2})
    found = problem(
        {"rel_err_out": out / 2, "rel_err_grad_x": 0.7, "rel_err_grad_params": float("nan")}
    )
    assert "rel_err_grad_x 0.7 above" in found and "rel_err_grad_params nan above" in found
    assert "rel_err_out" not in found
