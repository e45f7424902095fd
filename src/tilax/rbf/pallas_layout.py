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

import functools
import operator

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


def _augmented(blocks: list[jax.Array], rows: int, *, parts: bool, first: bool) -> jax.Array:
    """Augmented points ``[B, R, D + 2]`` given as column ``blocks``, with zero rows up to
    ``rows``, as a kernel operand: TF32 parts, or zero-padded to ``expansion_width``."""
    blocks = [pad_rows_cols(b, rows, b.shape[2]) for b in blocks]
    if parts:
        return pallas_dots.tf32x3_parts(blocks, first=first)
    x = jnp.concatenate(blocks, axis=-1)
    return pad_rows_cols(x, rows, pallas_config.expansion_width(x.shape[-1] - 2))


def _squared_norms(x: jax.Array) -> jax.Array:
    """``sum(x * x, axis=-1, keepdims=True)``, for up to 16 columns as a sum of columns: XLA
    then computes it inside the operand's one concatenation, where a reduce would be a kernel
    of its own."""
    if x.shape[-1] > 16:
        return jnp.sum(x * x, axis=-1, keepdims=True)
    columns = [x[..., d : d + 1] for d in range(x.shape[-1])]
    return functools.reduce(operator.add, [c * c for c in columns])


def augment_queries(qs: jax.Array, rows: int, *, parts: bool = False) -> jax.Array:
    """``[qs, -0.5 log2e |qs|^2, 1]`` with zero rows up to ``rows``."""
    alpha = -0.5 * LOG2E * _squared_norms(qs)
    return _augmented([qs, alpha, jnp.ones_like(alpha)], rows, parts=parts, first=True)


def augment_keys(ks: jax.Array, rows: int, *, parts: bool = False) -> jax.Array:
    """``[log2e ks, 1, -0.5 log2e |ks|^2]`` with zero rows up to ``rows``."""
    beta = -0.5 * LOG2E * _squared_norms(ks)
    return _augmented([LOG2E * ks, jnp.ones_like(beta), beta], rows, parts=parts, first=False)


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
