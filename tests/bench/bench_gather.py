"""Row gathers for the benchmark's peer layers whose transposes are gathers too.

Differentiating ``jnp.take`` gives a scatter-add, which XLA runs with atomics over every row;
the MoE glue's gathers have a known inverse (each output row takes one input row, and each
input row is taken a fixed number of times), so their transposes can gather instead, as
tilax's own dispatch does.

The indices are permutations, in bounds by construction, so the gathers use ``mode="clip"``
(XLA's plain gather, as ``tilax.moe.dispatch.take_rows`` does). jnp's default ``"fill"`` masks
every row with a select, and under it XLA gave the combine's gather a transposed layout: on the
H200 the E64 decoder's tokamax train step at 131k tokens took 37.5 ms with ``"fill"`` and
18.8 ms with ``"clip"`` (diagnostic, run ``a84ba7d``; the peer's rows stored before run
``9cd4196`` carry the slow gather).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def gather_rows(x, rows_of, back_index):
    """``x[rows_of]``, whose transpose is the gather ``sum_j g[back_index[:, j]]``:
    ``back_index`` ``[len(x), j]`` lists, for each row of ``x``, every output row that took it
    (each output row takes exactly one)."""
    return jnp.take(x, rows_of, axis=0, mode="clip")


def _gather_rows_fwd(x, rows_of, back_index):
    return gather_rows(x, rows_of, back_index), (rows_of, back_index)


def _gather_rows_bwd(residuals, g):
    rows_of, back_index = residuals
    copies = jnp.take(g, back_index, axis=0, mode="clip")
    grad = copies.astype(jnp.float32).sum(axis=1).astype(g.dtype)
    return grad, None, None


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)
