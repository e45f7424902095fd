"""Token dispatch in plain XLA: sort copies by expert, permute, unpermute and combine.

Every token has ``k`` *copies*, one per chosen expert; copy ``c = t * k + j`` is token ``t``'s
``j``-th choice. The grouped matmuls work in the *row space*: the copies sorted by expert (a
stable sort, so within an expert the copies are in token order), padded at the end to a multiple
of the kernels' row tile. One ``argsort`` of ``T * k`` ints builds the whole layout; moving data
between token space and row space is always a gather (no scatter of activations).

Capacity routing keeps at most ``C`` copies per expert, the earliest tokens first; the dropped
copies are sorted behind all kept ones, so the first ``sum(group_sizes)`` rows are exactly the
kept copies, grouped by expert. Under expert parallelism the copies to keep are decided across
devices and given as a mask (``kept``); the layout is built the same way.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tilax._pallas import round_up


class RowLayout(NamedTuple):
    """Where every token copy sits in the row space (``R_pad`` rows; all int32 unless noted).

    Attributes:
        row_copy: ``[R_pad]`` the copy held by each row (0 on padding rows).
        row_token: ``[R_pad]`` the token of each row's copy (0 on padding rows).
        row_valid: ``[R_pad]`` bool, the row holds a kept copy (not padding, not dropped).
        row_target: ``[R_pad]`` ``row_token`` on kept rows, ``T`` (a scratch row) elsewhere:
            where a fused combine may accumulate the row's output.
        copy_row: ``[T, k]`` the row of each copy (clamped into range for dropped copies).
        copy_kept: ``[T, k]`` bool, the copy was kept (always true without capacity).
        group_sizes: ``[E]`` kept copies per expert.
        group_offsets: ``[E + 1]`` exclusive prefix sum of ``group_sizes``: expert ``e`` owns
            rows ``[group_offsets[e], group_offsets[e + 1])``.
    """

    row_copy: jax.Array
    row_token: jax.Array
    row_valid: jax.Array
    row_target: jax.Array
    copy_row: jax.Array
    copy_kept: jax.Array
    group_sizes: jax.Array
    group_offsets: jax.Array


class GmmSchedule(NamedTuple):
    """Work items of a grouped matmul over the row space (arrays of ``W`` int32).

    Item ``w`` multiplies row tile ``tile[w]`` (rows ``tile * block_m`` onwards) by expert
    ``expert[w]``'s weights and keeps the tile-local rows ``[lo[w], hi[w])``. A tile that
    straddles an expert boundary appears once per expert; unused items have ``lo == hi``.
    ``W = R_pad / block_m + E - 1`` bounds the count, so the grid is static.
    """

    expert: jax.Array
    tile: jax.Array
    lo: jax.Array
    hi: jax.Array


def expert_capacity(
    num_tokens: int, top_k: int, num_experts: int, capacity_factor: float
) -> int:
    """``C = ceil(capacity_factor * T * top_k / E)``: the most copies one expert keeps."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def row_count(
    num_tokens: int, top_k: int, num_experts: int, capacity: int | None = None
) -> int:
    """Rows of the row space before padding: ``T * k``, or ``min(T * k, E * C)`` with a
    capacity ``C``."""
    copies = num_tokens * top_k
    return copies if capacity is None else min(copies, num_experts * capacity)


def expert_counts(expert_ids: jax.Array, num_experts: int) -> jax.Array:
    """``[E]`` int32: how many entries of ``expert_ids`` (any shape) name each expert.

    A compare-and-sum, which XLA fuses into one reduction; a scatter-add would serialise on
    GPU atomics to only ``E`` addresses.
    """
    flat = expert_ids.reshape(-1, 1)
    return jnp.sum(flat == jnp.arange(num_experts, dtype=flat.dtype), axis=0, dtype=jnp.int32)


def sort_by_expert(
    expert_ids: jax.Array,
    num_experts: int,
    *,
    capacity: int | None = None,
    kept: jax.Array | None = None,
    row_multiple: int = 1,
) -> RowLayout:
    """Build the row layout for ``expert_ids: [T, k]`` (int32).

    Args:
        expert_ids: each token's chosen experts (distinct within a token).
        num_experts: ``E``.
        capacity: keep at most this many copies per expert, earliest tokens first
            (``None``: dropless, keep all).
        kept: ``[T, k]`` bool, the copies to keep when that was decided elsewhere (expert
            parallelism: across devices); not together with ``capacity``.
        row_multiple: pad the row count up to a multiple of this (the kernels' row tile).

    Returns:
        The :class:`RowLayout`, with ``R_pad = round_up(R, row_multiple)`` rows where
        ``R = T * k`` (dropless, or ``kept`` given) or ``min(T * k, E * capacity)`` (capacity).
    """
    num_tokens, top_k = expert_ids.shape
    copies = num_tokens * top_k
    flat_expert = expert_ids.reshape(-1).astype(jnp.int32)
    if kept is not None:
        if capacity is not None:
            raise ValueError("sort_by_expert takes capacity or kept, not both")
        kept = kept.reshape(-1)
        # Copies not kept get the key E: the stable sort puts them behind every kept row.
        order = _argsort_experts(jnp.where(kept, flat_expert, num_experts), num_experts)
        group_sizes = expert_counts(jnp.where(kept, flat_expert, num_experts), num_experts)
        num_rows = copies
    elif capacity is None:
        counts = expert_counts(flat_expert, num_experts)
        order = _argsort_experts(flat_expert, num_experts)
        kept = jnp.ones((copies,), bool)
        group_sizes = counts
        num_rows = copies
    else:
        counts = expert_counts(flat_expert, num_experts)
        order = _argsort_experts(flat_expert, num_experts)
        starts = jnp.cumsum(counts) - counts
        rank = jnp.zeros((copies,), jnp.int32).at[order].set(
            jnp.arange(copies, dtype=jnp.int32) - starts[flat_expert[order]]
        )
        kept = rank < capacity
        # Dropped copies get the key E: one more stable sort puts them behind every kept row.
        order = _argsort_experts(jnp.where(kept, flat_expert, num_experts), num_experts)
        group_sizes = jnp.minimum(counts, capacity)
        num_rows = row_count(num_tokens, top_k, num_experts, capacity)
    padded_rows = round_up(max(num_rows, 1), row_multiple)
    group_offsets = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes).astype(jnp.int32)]
    )
    # A pad, not ``zeros.at[:num_rows].set``: under shard_map jax 0.11.2's partitioner
    # crashes (segfault) on that scatter when it covers the whole array.
    row_copy = jnp.pad(order[:num_rows], (0, padded_rows - num_rows))
    row_token = row_copy // top_k
    row_valid = jnp.arange(padded_rows, dtype=jnp.int32) < group_offsets[-1]
    row_target = jnp.where(row_valid, row_token, num_tokens)
    copy_row = jnp.zeros((copies,), jnp.int32).at[order].set(
        jnp.arange(copies, dtype=jnp.int32)
    )
    copy_row = jnp.minimum(copy_row, padded_rows - 1)
    return RowLayout(
        row_copy=row_copy,
        row_token=row_token,
        row_valid=row_valid,
        row_target=row_target,
        copy_row=copy_row.reshape(num_tokens, top_k),
        copy_kept=kept.reshape(num_tokens, top_k),
        group_sizes=group_sizes,
        group_offsets=group_offsets,
    )


def _argsort_experts(keys: jax.Array, largest: int) -> jax.Array:
    """``jnp.argsort(keys, stable=True)`` as int32, for keys in ``[0, largest]``: sorted as
    the narrowest unsigned integers that hold them. On GPUs XLA sorts with CUB's radix sort,
    one pass per byte of the key: at the E64 decoder's 1M copies on the H200 four passes of
    int32 keys took about 0.05 ms."""
    narrow = jnp.uint8 if largest < 2**8 else jnp.uint16 if largest < 2**16 else jnp.int32
    return jnp.argsort(keys.astype(narrow), stable=True).astype(jnp.int32)


def copy_ranks(expert_ids: jax.Array, num_experts: int, valid: jax.Array) -> jax.Array:
    """``[T, k]`` int32: each valid copy's rank among the valid copies of its expert, in token
    order (0 for the earliest token); what capacity routing compares with ``C``."""
    copies = expert_ids.size
    key = jnp.where(valid, expert_ids, num_experts).reshape(-1).astype(jnp.int32)
    counts = expert_counts(key, num_experts + 1)
    order = _argsort_experts(key, num_experts)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.zeros((copies,), jnp.int32).at[order].set(
        jnp.arange(copies, dtype=jnp.int32) - starts[key[order]]
    )
    return rank.reshape(expert_ids.shape)


def gmm_schedule(
    group_offsets: jax.Array, num_rows: int, block_m: int, *, cover_tail: bool = True
) -> GmmSchedule:
    """Work items for a grouped matmul over ``num_rows`` rows (a multiple of ``block_m``).

    With ``cover_tail`` the last expert's group is stretched to ``num_rows`` so that every row,
    padding and dropped rows included, is computed by exactly one item: the outputs are fully
    defined and finite. Without it the rows past ``group_offsets[-1]`` belong to no item and
    are never written (their tiles cost an empty program each): for row spaces sized for a
    worst case that is rarely filled (expert parallelism's receive buffer), whose readers mask
    those rows out with ``where``.
    """
    if num_rows % block_m:
        raise ValueError(f"num_rows ({num_rows}) must be a multiple of block_m ({block_m})")
    num_experts = group_offsets.shape[0] - 1
    num_tiles = num_rows // block_m
    num_items = num_tiles + num_experts - 1
    starts = group_offsets[:-1]
    ends = group_offsets[1:].at[-1].set(num_rows) if cover_tail else group_offsets[1:]
    first_tile = starts // block_m
    tiles_per_expert = jnp.where(ends > starts, -(-ends // block_m) - first_tile, 0)
    item_end = jnp.cumsum(tiles_per_expert)
    item_start = item_end - tiles_per_expert
    items = jnp.arange(num_items, dtype=jnp.int32)
    expert = jnp.minimum(
        jnp.searchsorted(item_end, items, side="right", method="compare_all"), num_experts - 1
    ).astype(jnp.int32)
    used = items < item_end[-1]
    tile = jnp.where(used, first_tile[expert] + items - item_start[expert], 0)
    tile_start = tile * block_m
    lo = jnp.clip(starts[expert] - tile_start, 0, block_m)
    hi = jnp.clip(ends[expert] - tile_start, 0, block_m)
    return GmmSchedule(
        expert=expert,
        tile=tile.astype(jnp.int32),
        lo=jnp.where(used, lo, 0).astype(jnp.int32),
        hi=jnp.where(used, hi, 0).astype(jnp.int32),
    )


@jax.custom_vjp
def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[index]`` along the first axis, for the layout's indices, which are in bounds by
    construction: ``mode="clip"`` is XLA's plain gather, where jnp's default ``"fill"`` masks
    every row (on the H200, 8% slower for 1M rows of 512 bf16 at random, 2% for sorted ones).

    Rows of 16-bit values move as ``uint32`` pairs: XLA's gather moves one element per
    thread step, and on the H200 1M rows of 512 bf16 took 0.40 ms that way against 0.67 ms
    (diagnostic timings). Not for a gather that feeds arithmetic (``copy_values``): XLA fuses
    that one into its consumer, and the bitcast would make it write the rows out first. The
    gradient is the scatter-add of the rows' cotangents (a bitcast has none of its own)."""
    if x.ndim < 2 or x.dtype.itemsize != 2 or x.shape[-1] % 2:
        return jnp.take(x, index, axis=0, mode="clip")
    pairs = lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), jnp.uint32)
    rows = jnp.take(pairs, index, axis=0, mode="clip")
    return lax.bitcast_convert_type(rows, x.dtype).reshape(*rows.shape[:-1], x.shape[-1])


def _shape_marker(x: jax.Array) -> jax.Array:
    """An empty array carrying ``x``'s row count and dtype to a backward (residuals must be
    arrays: a ``ShapeDtypeStruct`` fails where JAX lowers them as constants, e.g. an eager
    ``jax.grad`` through ``shard_map``)."""
    return jnp.zeros((x.shape[0], 0), x.dtype)


def _take_rows_fwd(x, index):
    return take_rows(x, index), (_shape_marker(x), index)


def _take_rows_bwd(residuals, d_rows):
    x_marker, index = residuals
    shape = (x_marker.shape[0], *d_rows.shape[index.ndim:])
    d_x = jnp.zeros(shape, d_rows.dtype).at[index].add(d_rows, mode="clip")
    return d_x.astype(x_marker.dtype), None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def permute(x: jax.Array, layout: RowLayout) -> jax.Array:
    """Token space to row space: ``x[row_token]``, ``[R_pad, d]`` (a gather). Its gradient
    gathers back: each token sums its kept copies' rows (``sum_copies``)."""
    return _permute(x, layout)


@jax.custom_vjp
def _permute(x: jax.Array, layout: RowLayout) -> jax.Array:
    return take_rows(x, layout.row_token)


def _permute_fwd(x, layout):
    return _permute(x, layout), (_shape_marker(x), layout)


def _permute_bwd(residuals, d_rows):
    # Not take_rows' scatter-add: on the H200 the E64 top-8 decoder's 1M rows of 512 bf16
    # summed back by a gather in 0.30 ms against 1.89 ms for a float32 scatter-add. Padding
    # rows belong to no copy, and their cotangents go nowhere.
    x_marker, layout = residuals
    d_x = sum_copies(d_rows, layout).astype(x_marker.dtype)
    return d_x, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def row_weights(weights: jax.Array, layout: RowLayout) -> jax.Array:
    """``[R_pad]`` float32 combine weight of each row (0 on padding and dropped rows)."""
    flat = weights.reshape(-1).astype(jnp.float32)
    return jnp.where(layout.row_valid, jnp.take(flat, layout.row_copy, mode="clip"), 0.0)


def copy_values(
    row_values: jax.Array, layout: RowLayout, deterministic: bool = False
) -> jax.Array:
    """Row space to copies: ``[T, k, ...]`` values of each copy's row, zero for dropped copies.

    Differentiated by JAX, the gather's gradient is a scatter-add into the rows; with
    ``deterministic`` it is a gather instead (:func:`take_fixed_order`: each kept row's
    cotangent is its copy's)."""
    if deterministic:
        values = take_fixed_order(row_values, layout.copy_row, layout.row_copy[:, None],
                                  layout.row_valid[:, None])
    else:
        values = jnp.take(row_values, layout.copy_row, axis=0, mode="clip")
    kept = layout.copy_kept.reshape(layout.copy_kept.shape + (1,) * (values.ndim - 2))
    return jnp.where(kept, values, jnp.zeros((), values.dtype))


def combine(
    rows: jax.Array, weights: jax.Array, layout: RowLayout, deterministic: bool = False
) -> jax.Array:
    """Unpermute and combine: ``y[t] = sum_j w[t, j] * rows[copy_row[t, j]]`` (float32 sum).

    Dropped copies contribute zero. Returns ``[T, d]`` in ``rows.dtype``. ``deterministic``:
    the gradient with respect to ``rows`` is a gather, not a scatter-add (:func:`copy_values`).
    """
    values = copy_values(rows, layout, deterministic).astype(jnp.float32)
    weights = jnp.where(layout.copy_kept, weights.astype(jnp.float32), 0.0)
    return jnp.sum(values * weights[:, :, None], axis=1).astype(rows.dtype)


def sum_copies(rows: jax.Array, layout: RowLayout) -> jax.Array:
    """``out[t] = sum_j rows[copy_row[t, j]]`` over kept copies (float32 sum), ``[T, d]``."""
    return jnp.sum(copy_values(rows, layout).astype(jnp.float32), axis=1).astype(rows.dtype)


@jax.custom_vjp
def take_fixed_order(
    src: jax.Array, index: jax.Array, readers: jax.Array, readers_valid: jax.Array
) -> jax.Array:
    """``src[index]`` along the first axis (``index`` of any shape, in bounds), whose gradient
    adds each source row's cotangents in a fixed order: a gather, no scatter-add.

    ``readers: [S, m]`` int32 names, for each of the ``S`` rows of ``src``, the flat positions
    in ``index`` that read it (``readers_valid`` masks unused entries); the gradient is
    ``d_src[s] = sum_j d_out.flat[readers[s, j]]`` over the valid ``j``, in ``j`` order
    (float32). Positions of ``index`` that no reader names must get zero cotangents (rows
    that a later ``where`` masks out): they are not added anywhere.
    """
    return jnp.take(src, index, axis=0, mode="clip")


def _take_fixed_order_fwd(src, index, readers, readers_valid):
    return take_fixed_order(src, index, readers, readers_valid), (
        _shape_marker(src), index, readers, readers_valid)


def _take_fixed_order_bwd(residuals, d_out):
    src_marker, index, readers, readers_valid = residuals
    d_flat = d_out.reshape(index.size, *d_out.shape[index.ndim:])
    gathered = jnp.take(d_flat, readers, axis=0, mode="clip").astype(jnp.float32)
    valid = readers_valid.reshape(readers_valid.shape + (1,) * (gathered.ndim - 2))
    d_src = jnp.sum(jnp.where(valid, gathered, 0.0), axis=1)
    return d_src.astype(src_marker.dtype), None, None, None


take_fixed_order.defvjp(_take_fixed_order_fwd, _take_fixed_order_bwd)
