"""FP8 numerics of the MoE layer in plain JAX: fine-grained scaled e4m3 quantisation and the
grouped matmuls on quantised operands, as DeepSeek-V3 trains (arXiv 2412.19437, section 3.3).

The reference the FP8 kernels match, and the math of ``MoEConfig(quantize="fp8")`` on the XLA
path (``fp8.py``):

- **Scales from the data, in float32.** A *tile* is 128 consecutive values along one axis
  (``quantize_rows``: activations and gradients, 1 x 128 along the contraction), a *block* is
  128 x 128 (``quantize_blocks``: weights). Each has one float32 scale
  ``s = amax / 448`` (as ``amax * float32(1 / 448)``), ``amax`` the largest magnitude of its
  values computed in float32, and
  holds ``q = e4m3(x / s)``: an IEEE float32 division, rounded to nearest-even into
  ``float8_e4m3fn`` (448 is that type's largest finite value). A tile or block of zeros gets
  ``s = 1`` (its values are exactly 0); a nonzero scale is at least float32's smallest normal
  (``2**-126``), so ``s`` is never 0 or subnormal and ``x / s`` never overflows (float32
  subnormal inputs quantise to 0: XLA may flush them, and ``x / 2**-126`` is below e4m3's
  smallest subnormal anyway). The last
  tile of an axis that is not a multiple of 128 is shorter (zero-padded for its ``amax``).
- **Saturation.** ``x / s`` is clipped to ``[-448, 448]`` before the cast: a value beyond
  ``448 * s`` (possible only with scales from elsewhere, ``cast_rows``) becomes ``+-448``,
  never inf or NaN (``float8_e4m3fn`` has no inf: an unclipped cast gives NaN). NaN stays NaN.
- **Products.** ``out = sum over 128-chunks c of the contraction of (q_lhs[:, c] . q_rhs[c, :])
  * s_lhs[c] * s_rhs[c]``: each chunk's products of e4m3 values summed in float32 (exact
  inputs: an e4m3 value is exact in bfloat16, so the chunk products run as bfloat16 dots with
  float32 accumulation), then scaled and added to a float32 accumulator. This is the promotion
  Hopper's FP8 MMA needs: its tensor cores keep about 14 bits of the accumulator, so DeepSeek's
  kernels (and tilax's) hand each 128-deep partial to float32 registers, where the scales
  apply. Outputs are rounded once to bfloat16.

Which operand is quantised along which axis (``d`` model width, ``h`` hidden width; ``a`` the
SwiGLU activation, ``dy`` a row's output gradient times its combine weight, ``dg``/``du`` the
gate/up pre-activations' gradients):

| product | left operand: 1 x 128 tiles along | right operand |
| --- | --- | --- |
| forward ``x @ w_gate`` (and ``w_up``) | ``x`` rows: ``d`` | ``w_gate[e]``: 128 x 128 blocks |
| forward ``a @ w_down`` | ``a`` rows: ``h`` | ``w_down[e]``: 128 x 128 blocks |
| input grad ``dy @ w_down.T`` | ``dy`` rows: ``d`` | forward's blocks, transposed |
| input grad ``dg @ w_gate.T`` (``du @ w_up.T``) | ``dg`` rows: ``h`` | the same, transposed |
| weight grad ``x.T @ dg`` (and ``x.T @ du``) | ``x``: tokens (128 x 1) | ``dg``: tokens (128 x 1) |
| weight grad ``a.T @ dy`` | ``a``: tokens (128 x 1) | ``dy``: tokens (128 x 1) |

A block scale covers the same 128 x 128 values after a transpose, so the input gradients reuse
the forward's quantised weights. Row tiles do not transpose: the weight gradients contract over
tokens and quantise both operands again, from their bfloat16 values, in 128 x 1 tiles along the
tokens (DeepSeek-V3 re-quantises the forward's cached FP8 activations instead, which adds a
second rounding; tilax keeps the bfloat16 values the backward already holds). The token tiles of
a weight gradient start at each expert's first row (``token_tiles``): a tile never mixes two
experts, and each 128-token partial product is promoted as above.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tilax.moe import reference

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
#: The largest finite ``float8_e4m3fn`` value: the scale maps a tile's amax onto it.
E4M3_MAX = 448.0
#: Values per tile (along one axis) and per block side; also the promotion interval.
TILE = 128
#: ``1 / 448`` rounded to float32: ``scale = amax * RECIPROCAL_MAX``.
RECIPROCAL_MAX = float(np.float32(1.0 / E4M3_MAX))
#: The smallest scale of a nonzero tile: float32's smallest normal.
MIN_SCALE = float(jnp.finfo(F32).tiny)


def _tiled(x: jax.Array, axis: int) -> jax.Array:
    """``x`` with ``axis`` zero-padded to a multiple of ``TILE`` and split into
    ``[..., tiles, TILE, ...]`` (the tile index where ``axis`` was, then the 128 values)."""
    size = x.shape[axis]
    pad = -size % TILE
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths)
    return x.reshape(x.shape[:axis] + ((size + pad) // TILE, TILE) + x.shape[axis + 1 :])


def _untiled(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Inverse of :func:`_tiled`: merge the tile axes back and drop the padding."""
    x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])
    return jax.lax.slice_in_dim(x, 0, size, axis=axis)


def scale_of(amax: jax.Array) -> jax.Array:
    """The float32 scale of tiles with largest magnitudes ``amax``: ``amax / 448``, at least
    ``MIN_SCALE``; 1 for all-zero tiles. The division is a float32 product with
    ``RECIPROCAL_MAX`` (XLA rewrites a division by a constant so; the kernels multiply too)."""
    amax = amax.astype(F32)
    return jnp.where(amax > 0, jnp.maximum(amax * RECIPROCAL_MAX, MIN_SCALE), 1.0)


def cast_e4m3(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``e4m3(clip(x / scale, -448, 448))`` in float32 math: round to nearest even, saturating
    (``scale`` broadcasts against ``x``)."""
    return jnp.clip(x.astype(F32) / scale, -E4M3_MAX, E4M3_MAX).astype(FP8)


def _normal_axis(x: jax.Array, axis: int) -> int:
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of shape {x.shape}")
    return axis % x.ndim


def quantize_rows(x: jax.Array, *, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """Quantise ``x`` to e4m3 in 1 x 128 tiles along ``axis`` (the contraction axis).

    Args:
        x: a float array (any float dtype; its amax is taken in float32).
        axis: the axis the tiles run along.

    Returns:
        ``(q, scales)``: ``q`` ``float8_e4m3fn`` with the shape of ``x``; ``scales`` float32
        with ``axis`` replaced by ``ceil(x.shape[axis] / 128)``, one per tile, so that
        ``q * scale`` (:func:`dequantize_rows`) approximates ``x``.
    """
    axis = _normal_axis(x, axis)
    tiles = _tiled(x.astype(F32), axis)
    amax = jnp.max(jnp.abs(tiles), axis=axis + 1, keepdims=True)
    scales = scale_of(amax)
    q = _untiled(cast_e4m3(tiles, scales), axis, x.shape[axis])
    return q, jnp.squeeze(scales, axis + 1)


def cast_rows(x: jax.Array, scales: jax.Array, *, axis: int = -1) -> jax.Array:
    """``x`` cast to e4m3 with given per-tile ``scales`` (the layout :func:`quantize_rows`
    returns), saturating where ``|x| > 448 * scale``."""
    axis = _normal_axis(x, axis)
    tiles = _tiled(x.astype(F32), axis)
    return _untiled(cast_e4m3(tiles, jnp.expand_dims(scales, axis + 1)), axis, x.shape[axis])


def dequantize_rows(q: jax.Array, scales: jax.Array, *, axis: int = -1) -> jax.Array:
    """float32 ``q * scale`` of each 1 x 128 tile along ``axis`` (inverse of
    :func:`quantize_rows` up to the e4m3 rounding)."""
    axis = _normal_axis(q, axis)
    tiles = _tiled(q.astype(F32), axis) * jnp.expand_dims(scales, axis + 1)
    return _untiled(tiles, axis, q.shape[axis])


def quantize_blocks(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantise ``w: [..., K, N]`` to e4m3 in 128 x 128 blocks of its last two axes.

    Returns:
        ``(q, scales)``: ``q`` ``float8_e4m3fn`` ``[..., K, N]``; ``scales`` float32
        ``[..., ceil(K / 128), ceil(N / 128)]``. ``(q.T, scales.T)`` (both last two axes
        swapped) is exactly the quantisation of ``w.T``.
    """
    if w.ndim < 2:
        raise ValueError(f"quantize_blocks takes [..., K, N], got shape {w.shape}")
    k, n = w.shape[-2:]
    blocks = _tiled(_tiled(w.astype(F32), w.ndim - 1), w.ndim - 2)  # [..., Kc, 128, Nc, 128]
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1), keepdims=True)
    scales = scale_of(amax)
    q = _untiled(_untiled(cast_e4m3(blocks, scales), w.ndim - 2, k), w.ndim - 1, n)
    return q, scales[..., :, 0, :, 0]


def dequantize_blocks(q: jax.Array, scales: jax.Array) -> jax.Array:
    """float32 ``q * scale`` of each 128 x 128 block of the last two axes."""
    k, n = q.shape[-2:]
    blocks = _tiled(_tiled(q.astype(F32), q.ndim - 1), q.ndim - 2)
    blocks = blocks * scales[..., :, None, :, None]
    return _untiled(_untiled(blocks, q.ndim - 2, k), q.ndim - 1, n)


def transpose_blocks(q: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The quantised ``w.T`` from the quantised ``w`` (no rounding: blocks map onto blocks)."""
    return jnp.swapaxes(q, -1, -2), jnp.swapaxes(scales, -1, -2)


# ----------------------------------------------------------------------------------------------
# Grouped matmuls


def _row_experts(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """``[num_rows]`` the expert owning each row (the last one past every group)."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(num_rows, dtype=ends.dtype)
    owner = jnp.searchsorted(ends, rows, side="right", method="compare_all")
    return jnp.minimum(owner, group_sizes.shape[0] - 1).astype(jnp.int32)


def _chunk_ragged(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return reference.ragged_matmul(lhs, rhs, group_sizes)  # batches under jax.vmap


def _chunk_blocked(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The rows of each expert gathered into a zero-padded ``[E, R, K]`` block, a batched
    product, and each row read back from its block."""
    num_rows, num_experts = lhs.shape[0], rhs.shape[0]
    starts = jnp.cumsum(group_sizes) - group_sizes
    slots = jnp.arange(num_rows, dtype=starts.dtype)
    used = slots[None, :] < group_sizes[:, None]
    source = jnp.where(used, starts[:, None] + slots[None, :], 0)
    blocks = jnp.where(used[..., None], jnp.take(lhs, source, axis=0), 0).astype(lhs.dtype)
    out = jnp.einsum("ebk,ekn->ebn", blocks, rhs, preferred_element_type=F32)
    row_expert = _row_experts(group_sizes, num_rows)
    slot = jnp.clip(jnp.arange(num_rows) - starts[row_expert], 0, num_rows - 1)
    in_group = jnp.arange(num_rows) < jnp.sum(group_sizes)
    rows = out.reshape(num_experts * num_rows, -1)[row_expert * num_rows + slot]
    return jnp.where(in_group[:, None], rows, 0.0)


#: How :func:`grouped_matmul` runs each chunk's product over the row layout.
CHUNK_PRODUCTS = {"ragged_dot": _chunk_ragged, "blocked": _chunk_blocked}


def grouped_matmul(
    lhs: jax.Array,
    lhs_scales: jax.Array,
    rhs: jax.Array,
    rhs_scales: jax.Array,
    group_sizes: jax.Array,
    *,
    impl: str = "ragged_dot",
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """``out[r] = x[r] @ w[e(r)]`` for rows sorted by expert, from e4m3 operands.

    Expert ``e`` owns rows ``[sum(group_sizes[:e]), sum(group_sizes[:e + 1]))``; rows past
    every group come out zero. For each 128-chunk ``c`` of the contraction the products of the
    e4m3 values are summed in float32, multiplied by the row's tile scale ``lhs_scales[r, c]``
    and the weight block's ``rhs_scales[e, c, n // 128]``, and added to a float32 sum in chunk
    order (the module docstring: Hopper's promotion).

    Args:
        lhs: ``[R, K]`` e4m3 rows (from :func:`quantize_rows`).
        lhs_scales: ``[R, ceil(K / 128)]`` float32.
        rhs: ``[E, K, N]`` e4m3 weights (from :func:`quantize_blocks`).
        rhs_scales: ``[E, ceil(K / 128), ceil(N / 128)]`` float32.
        group_sizes: ``[E]`` int32 rows per expert.
        impl: how each chunk runs: ``"ragged_dot"`` (``jax.lax.ragged_dot``) or
            ``"blocked"`` (zero-padded ``[E, R, K]`` blocks); the same sums either way.
        out_dtype: the output dtype (the float32 sum is rounded once).

    Returns:
        ``[R, N]`` in ``out_dtype``.
    """
    if impl not in CHUNK_PRODUCTS:
        raise ValueError(f"impl must be one of {tuple(CHUNK_PRODUCTS)}, got {impl!r}")
    num_rows, contraction = lhs.shape
    width = rhs.shape[-1]
    row_expert = _row_experts(group_sizes, num_rows)
    product = CHUNK_PRODUCTS[impl]
    out = jnp.zeros((num_rows, width), F32)
    for chunk in range(-(-contraction // TILE)):
        part = slice(chunk * TILE, min((chunk + 1) * TILE, contraction))
        # e4m3 values are exact in bfloat16: a bfloat16 product with float32 accumulation
        # sums them exactly as the FP8 MMA does, without float8 dots in XLA.
        partial = product(
            lhs[:, part].astype(jnp.bfloat16), rhs[:, part].astype(jnp.bfloat16), group_sizes
        )
        weight_scale = jnp.repeat(rhs_scales[row_expert, chunk], TILE, axis=-1)[:, :width]
        out = out + partial * lhs_scales[:, chunk, None] * weight_scale
    return out.astype(out_dtype)


class TokenTiles(NamedTuple):
    """The rows of a row layout regrouped into 128-row tiles that start at each expert's first
    row (the weight gradients' contraction tiles): ``J = ceil(R / 128) + E`` tiles bound any
    group sizes.

    Attributes:
        source: ``[J, 128]`` int32 row of each tile slot (0 where the slot is empty).
        used: ``[J, 128]`` bool, the slot holds a row of its tile's expert.
        expert: ``[J]`` int32 expert of each tile (unused tiles hold no row).
    """

    source: jax.Array
    used: jax.Array
    expert: jax.Array


def token_tiles(group_sizes: jax.Array, num_rows: int) -> TokenTiles:
    """The :class:`TokenTiles` of ``num_rows`` rows grouped by ``group_sizes``."""
    num_experts = group_sizes.shape[0]
    num_tiles = -(-num_rows // TILE) + num_experts
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    tiles_per_expert = -(-sizes // TILE)
    tile_ends = jnp.cumsum(tiles_per_expert)
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    expert = jnp.minimum(
        jnp.searchsorted(tile_ends, tiles, side="right", method="compare_all"), num_experts - 1
    ).astype(jnp.int32)
    local_tile = tiles - (tile_ends - tiles_per_expert)[expert]
    local_row = local_tile[:, None] * TILE + jnp.arange(TILE, dtype=jnp.int32)[None, :]
    used = (tiles < tile_ends[-1])[:, None] & (local_row < sizes[expert][:, None])
    source = jnp.where(used, starts[expert][:, None] + local_row, 0)
    return TokenTiles(source=source, used=used, expert=expert)


def to_tiles(rows: jax.Array, tiles: TokenTiles) -> jax.Array:
    """``[R, K]`` rows as ``[J, 128, K]`` token tiles (zeros in empty slots)."""
    values = jnp.take(rows, tiles.source, axis=0, mode="clip")
    return jnp.where(tiles.used[..., None], values, jnp.zeros((), rows.dtype))


def quantize_token_tiles(rows: jax.Array, tiles: TokenTiles) -> tuple[jax.Array, jax.Array]:
    """``rows: [R, K]`` quantised in 128 x 1 tiles along the tokens, per expert
    (:func:`quantize_rows` along the tiles' token axis): ``([J, 128, K] e4m3, [J, K] float32)``."""
    q, scales = quantize_rows(to_tiles(rows, tiles), axis=1)
    return q, scales[:, 0]


def grouped_matmul_t(
    lhs: jax.Array,
    lhs_scales: jax.Array,
    rhs: jax.Array,
    rhs_scales: jax.Array,
    tiles: TokenTiles,
    num_experts: int,
    *,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """Weight gradients ``out[e] = lhs[rows of e].T @ rhs[rows of e]`` from e4m3 token tiles.

    Each tile's 128-token products are summed in float32, scaled by the two operands' scales
    of that tile (``lhs_scales[j, k] * rhs_scales[j, n]``) and added into its expert's float32
    sum: the promotion of :func:`grouped_matmul`, along the tokens.

    Args:
        lhs: ``[J, 128, K]`` e4m3 (:func:`quantize_token_tiles`).
        lhs_scales: ``[J, K]`` float32.
        rhs: ``[J, 128, N]`` e4m3.
        rhs_scales: ``[J, N]`` float32.
        tiles: the :class:`TokenTiles` both were made with.
        num_experts: ``E``.
        out_dtype: the output dtype.

    Returns:
        ``[E, K, N]`` in ``out_dtype`` (zero for experts without rows).
    """
    partial = jnp.einsum(
        "jtk,jtn->jkn",
        lhs.astype(jnp.bfloat16),
        rhs.astype(jnp.bfloat16),
        preferred_element_type=F32,
    )
    partial = partial * lhs_scales[:, :, None] * rhs_scales[:, None, :]
    out = jax.ops.segment_sum(partial, tiles.expert, num_segments=num_experts)
    return out.astype(out_dtype)
