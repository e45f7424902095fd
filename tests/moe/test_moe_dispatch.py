"""Row layout, capacity selection and the XLA gathers of dispatch.py, checked by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tilax.moe import dispatch


def test_expert_capacity_formula():
    assert dispatch.expert_capacity(6, 1, 2, 0.5) == 2  # ceil(1.5)
    assert dispatch.expert_capacity(10, 2, 4, 1.25) == 7  # ceil(6.25)
    assert dispatch.expert_capacity(8, 2, 4, 1.0) == 4  # exact: no rounding up


def test_dropless_layout_is_a_stable_sort_by_expert():
    ids = jnp.asarray([[2, 0], [0, 1], [2, 1]], jnp.int32)  # copies 0..5 -> experts 2,0,0,1,2,1
    layout = dispatch.sort_by_expert(ids, 4, row_multiple=4)
    np.testing.assert_array_equal(layout.group_sizes, [2, 2, 2, 0])
    np.testing.assert_array_equal(layout.group_offsets, [0, 2, 4, 6, 6])
    np.testing.assert_array_equal(layout.row_copy, [1, 2, 3, 5, 0, 4, 0, 0])
    np.testing.assert_array_equal(layout.row_token, [0, 1, 1, 2, 0, 2, 0, 0])
    np.testing.assert_array_equal(layout.row_valid, [1, 1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(layout.row_target, [0, 1, 1, 2, 0, 2, 3, 3])
    np.testing.assert_array_equal(layout.copy_row, [[4, 0], [1, 2], [5, 3]])
    assert layout.copy_kept.all()


def test_capacity_drops_the_latest_tokens_of_full_experts():
    # T=6, k=1, E=2, capacity_factor 0.5 -> C = ceil(0.5 * 6 / 2) = 2.
    ids = jnp.asarray([[0], [0], [1], [0], [0], [1]], jnp.int32)
    capacity = dispatch.expert_capacity(6, 1, 2, 0.5)
    layout = dispatch.sort_by_expert(ids, 2, capacity=capacity)
    # Expert 0 keeps tokens 0 and 1 and drops 3 and 4; expert 1 keeps 2 and 5.
    np.testing.assert_array_equal(layout.copy_kept[:, 0], [1, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(layout.group_sizes, [2, 2])
    np.testing.assert_array_equal(layout.row_token, [0, 1, 2, 5])  # R = min(6, E * C) = 4
    np.testing.assert_array_equal(layout.row_valid, [1, 1, 1, 1])


def test_capacity_keeps_copies_across_experts_independently():
    # Token 1 is dropped by expert 0 (already holds token 0) but kept by expert 1.
    ids = jnp.asarray([[0, 1], [0, 1], [1, 0]], jnp.int32)
    layout = dispatch.sort_by_expert(ids, 2, capacity=2, row_multiple=8)
    np.testing.assert_array_equal(layout.copy_kept, [[1, 1], [1, 1], [0, 0]])
    np.testing.assert_array_equal(layout.group_offsets, [0, 2, 4])
    np.testing.assert_array_equal(layout.row_valid, [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(layout.row_target[:4], [0, 1, 0, 1])
    np.testing.assert_array_equal(layout.row_target[4:], [3, 3, 3, 3])


def test_schedule_splits_straddling_tiles():
    offsets = jnp.asarray([0, 5, 5, 12], jnp.int32)  # expert 1 empty, tile size 4, 16 rows
    schedule = dispatch.gmm_schedule(offsets, 16, 4)
    used = np.asarray(schedule.lo) < np.asarray(schedule.hi)
    items = [
        (int(e), int(t), int(lo), int(hi))
        for e, t, lo, hi, u in zip(*schedule, used, strict=True)
        if u
    ]
    # Expert 0: rows 0-4 (tiles 0 and 1); expert 2: rows 5-11 plus the padding rows 12-15.
    assert items == [(0, 0, 0, 4), (0, 1, 0, 1), (2, 1, 1, 4), (2, 2, 0, 4), (2, 3, 0, 4)]
    assert len(schedule.expert) == 16 // 4 + 3 - 1
    with pytest.raises(ValueError, match="multiple of block_m"):
        dispatch.gmm_schedule(offsets, 15, 4)


def test_combine_and_sum_copies_skip_dropped_copies():
    ids = jnp.asarray([[0, 1], [0, 1], [1, 0]], jnp.int32)
    layout = dispatch.sort_by_expert(ids, 2, capacity=2)
    rows = jnp.arange(8, dtype=jnp.float32).reshape(4, 2)  # rows: t0e0, t1e0, t0e1, t1e1
    weights = jnp.asarray([[0.5, 0.25], [2.0, 1.0], [3.0, 3.0]])
    expected = np.array([[0.5 * 0 + 0.25 * 4, 0.5 * 1 + 0.25 * 5],
                         [2.0 * 2 + 1.0 * 6, 2.0 * 3 + 1.0 * 7],
                         [0.0, 0.0]])
    np.testing.assert_allclose(dispatch.combine(rows, weights, layout), expected)
    np.testing.assert_allclose(
        dispatch.sum_copies(rows, layout), [[4, 6], [8, 10], [0, 0]]
    )
    np.testing.assert_allclose(
        dispatch.row_weights(weights, layout), [0.5, 2.0, 0.25, 1.0]
    )


@pytest.mark.parametrize(("dtype", "width"), [
    (jnp.bfloat16, 6),  # moved as uint32 pairs
    (jnp.float16, 4),
    (jnp.bfloat16, 5),  # odd width: a plain gather
    (jnp.float32, 4),
])  # fmt: skip
def test_take_rows_is_a_row_gather_with_its_gradient(dtype, width):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((7, width)), dtype)
    index = jnp.asarray([6, 0, 3, 3, 1], jnp.int32)
    rows = dispatch.take_rows(x, index)
    assert rows.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(x, np.float32)[index])
    weights = jnp.arange(5 * width, dtype=jnp.float32).reshape(5, width)
    def loss(x):
        return jnp.sum(dispatch.take_rows(x, index).astype(jnp.float32) * weights)

    grad = jax.grad(loss)(x)
    expected = np.zeros((7, width), np.float32)
    np.add.at(expected, np.asarray(index), np.asarray(weights))
    assert grad.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(grad, np.float32), expected)
