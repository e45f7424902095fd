"""Row gathers for the benchmark's peer layers whose transposes are gathers too.

Differentiating ``jnp.take`` gives a scatter-add, which XLA runs with atomics over every row;
the MoE glue's gathers have a known inverse (each output row takes one input row, and each
input row is taken a fixed number of times), so their transposes can gather instead, as
tilax's own dispatch does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def gather_rows(x, rows_of, back_index):
    """``x[rows_of]``, whose transpose is the gather ``sum_j g[back_index[:, j]]``:
    ``back_index`` ``[len(x), j]`` lists, for each row of ``x``, every output row that took it
    (each output row takes exactly one)."""
    return jnp.take(x, rows_of, axis=0)


def _gather_rows_fwd(x, rows_of, back_index):
    return gather_rows(x, rows_of, back_index), (rows_of, back_index)


def _gather_rows_bwd(residuals, g):
    rows_of, back_index = residuals
    grad = jnp.take(g, back_index, axis=0).astype(jnp.float32).sum(axis=1).astype(g.dtype)
    return grad, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)
