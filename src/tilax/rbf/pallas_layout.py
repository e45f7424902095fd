"""Operands of the RBF Pallas kernels, built from the points, values and cotangents.

Expansion (fast) path: *augmented* points whose dot product is the base-2 exponent::

    x_i = [qs_i,          -0.5 log2(e) |qs_i|^2, 1]
    y_j = [log2(e) ks_j,  1,  -0.5 log2(e) |ks_j|^2]
    x_i . y_j = -0.5 log2(e) |qs_i - ks_j|^2,          K_ij = exp2(min(x_i . y_j, 0))

for centred, scaled points ``qs = (q - c) / l``, ``ks = (k - c) / l``, zero-padded to
``pallas_config.expansion_width`` columns (Triton dots need every dimension >= 16), or laid out
as TF32 parts (``pallas_dots.tf32x3_parts``) for the forward kernels. The same rows carry the
gradient sums: ``A @ y`` gives ``sum_j A_ij ks_j`` (times log2 e) and the row sum of ``A``.

Exact (difference) path: coordinates multiplied by a power of two per dimension (exact) and
transposed to ``[B, D, rows]``, so that a kernel reads one dimension of a tile as one
contiguous row; the residual scale (in ``[1, 2)``) is a separate operand.

Rows that pad a point count to a tile multiple are zeros; the kernels mask them by index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tilax.rbf import numerics, pallas_config, pallas_dots, pallas_triton

LOG2E = numerics.LOG2E


def pad_rows_cols(x: jax.Array, rows: int, cols: int) -> jax.Array:
    """``x: [B, R, C]`` zero-padded to ``[B, rows, cols]``."""
    return jnp.pad(x, [(0, 0), (0, rows - x.shape[1]), (0, cols - x.shape[2])])


def pad_rows(x: jax.Array, rows: int, value: float = 0.0) -> jax.Array:
    """``x: [B, R]`` padded with ``value`` to ``[B, rows]``."""
    return jnp.pad(x, [(0, 0), (0, rows - x.shape[1])], constant_values=value)


def _expansion_layout(x: jax.Array, *, parts: bool, first: bool) -> jax.Array:
    """Augmented ``[B, R, D + 2]`` points as a kernel operand: TF32 parts, or zero-padded."""
    if parts:
        return pallas_dots.tf32x3_parts(x, first=first)
    width = pallas_config.expansion_width(x.shape[-1] - 2)
    return pad_rows_cols(x, x.shape[1], width)


def augment_queries(qs: jax.Array, rows: int, *, parts: bool = False) -> jax.Array:
    """``[qs, -0.5 log2e |qs|^2, 1]`` with zero rows up to ``rows``."""
    alpha = -0.5 * LOG2E * jnp.sum(qs * qs, axis=-1)
    x = jnp.concatenate([qs, alpha[..., None], jnp.ones_like(alpha)[..., None]], axis=-1)
    return _expansion_layout(pad_rows_cols(x, rows, x.shape[2]), parts=parts, first=True)


def augment_keys(ks: jax.Array, rows: int, *, parts: bool = False) -> jax.Array:
    """``[log2e ks, 1, -0.5 log2e |ks|^2]`` with zero rows up to ``rows``."""
    beta = -0.5 * LOG2E * jnp.sum(ks * ks, axis=-1)
    y = jnp.concatenate([LOG2E * ks, jnp.ones_like(beta)[..., None], beta[..., None]], axis=-1)
    return _expansion_layout(pad_rows_cols(y, rows, y.shape[2]), parts=parts, first=False)


def expansion_points(distance, qs: jax.Array, ks: jax.Array, rows_q: int, rows_k: int):
    """(queries, keys) augmented for ``distance`` (TF32 parts for ``"tf32_parts"``)."""
    parts = distance.mode == "tf32_parts"
    return augment_queries(qs, rows_q, parts=parts), augment_keys(ks, rows_k, parts=parts)


def exact_points(x: jax.Array, power_of_two: jax.Array, rows: int) -> jax.Array:
    """``x: [B, R, D]`` times ``power_of_two`` (scalar or ``[D]``), as ``[B, Dk, rows]`` with
    ``Dk = pallas_triton.difference_dims(D)`` (zero coordinates add nothing)."""
    scaled = numerics.prescale(x.astype(jnp.float32), power_of_two)
    dims = pallas_triton.difference_dims(x.shape[2])
    return jnp.swapaxes(pad_rows_cols(scaled, rows, dims), 1, 2)


def exact_scale(residual: jax.Array, dim: int | None = None) -> jax.Array:
    """The residual scale as the kernels' ``scale`` operand: one shared, or per dimension
    (``dim`` of them, padded to ``pallas_triton.difference_dims(dim)`` with ones)."""
    residual = residual.astype(jnp.float32)
    if dim is None:
        return jnp.reshape(residual, (1,))
    residual = jnp.broadcast_to(residual, (dim,))
    return jnp.pad(residual, (0, pallas_triton.difference_dims(dim) - dim), constant_values=1.0)


def value_operand(a: jax.Array, rows: int, cols: int, values_mode: str) -> jax.Array:
    """Values or cotangents ``[B, R, O]`` padded to ``[B, rows, cols]``; stored in bfloat16 when
    every product with them rounds to bfloat16 anyway (the same numbers, half the bytes)."""
    a = pad_rows_cols(a.astype(jnp.float32), rows, cols)
    return a.astype(jnp.bfloat16) if values_mode == "bf16" else a
