"""Plain-XLA RBF kernel sums: the benchmark baselines and the test oracles.

* ``*_dense`` materialise the full ``[..., N, M]`` kernel matrix (fast for small problems,
  memory ``O(N * M)``).
* ``*_xla`` process the queries in chunks with ``lax.map`` over a ``jax.checkpoint``-ed body,
  so forward *and* backward keep at most one ``[..., chunk, M]`` block alive: memory
  ``O((N + M) * chunk)``. Being plain JAX they are differentiable to any order.

All of them take inputs already validated by ``tilax.rbf.api`` (shapes ``[..., N, D]``,
``[..., M, D]``, ``[..., M, O]``; floating dtypes) and compute in float32 (float64 stays
float64), returning the result type of the point and value inputs.

Squared distances use the expansion ``|q|^2 + |k|^2 - 2 q.k`` with a ``HIGHEST``-precision dot,
after shifting both point sets by the mean key: the kernel is translation invariant, and the
shift keeps the norms small so the expansion does not cancel catastrophically for data far
from the origin. The shift is a constant for autodiff (``stop_gradient``); every derivative is
still exact because the function does not depend on it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# Elements of one [..., chunk, M] block in the chunked path (64 MiB in float32).
CHUNK_ELEMENTS = 1 << 24


def compute_dtype(*arrays) -> jnp.dtype:
    """float64 stays float64; every other floating input computes in float32."""
    dtype = jnp.result_type(*arrays)
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def centered_scaled(queries, points, scale, dtype=None):
    """``((queries - c) / scale, (points - c) / scale)`` with ``c`` the mean point (no gradient).

    ``queries: [..., N, D]``, ``points: [..., M, D]`` (``M >= 1``), ``scale`` a scalar or ``[D]``.
    """
    dtype = dtype or compute_dtype(queries, points)
    queries = queries.astype(dtype)
    points = points.astype(dtype)
    scale = jnp.asarray(scale).astype(dtype)
    center = lax.stop_gradient(jnp.mean(points, axis=-2, keepdims=True))
    return (queries - center) / scale, (points - center) / scale


def _half_sq_dist(qs, ks):
    """``0.5 * ||qs_i - ks_j||^2`` as ``[..., N, M]`` (scaled, centred coordinates)."""
    cross = jnp.einsum("...nd,...md->...nm", qs, ks, precision=lax.Precision.HIGHEST)
    q_sq = 0.5 * jnp.sum(qs * qs, axis=-1)
    k_sq = 0.5 * jnp.sum(ks * ks, axis=-1)
    return q_sq[..., :, None] + k_sq[..., None, :] - cross


def _product_precision(precision: str | None) -> lax.Precision:
    return lax.Precision.HIGHEST if precision == "highest" else lax.Precision.DEFAULT


def default_chunk(n: int, m: int, batch: int) -> int:
    """Queries per chunk: a ``[batch, chunk, m]`` block of about ``CHUNK_ELEMENTS`` values."""
    return int(max(1, min(n, CHUNK_ELEMENTS // max(1, m * batch))))


def _map_query_chunks(fn, queries, chunk: int):
    """Apply ``fn`` to chunks of ``queries: [..., N, D]`` (along N) and concatenate the results.

    ``fn`` maps ``[..., c, D] -> [..., c, *rest]``; it runs under ``jax.checkpoint`` so its
    ``[..., c, M]`` intermediates are recomputed in the backward pass instead of stored.
    """
    lead = queries.shape[:-2]
    n, dim = queries.shape[-2:]
    num_chunks = -(-n // chunk)
    padded = jnp.pad(queries, [(0, 0)] * len(lead) + [(0, num_chunks * chunk - n), (0, 0)])
    blocks = jnp.moveaxis(padded.reshape(*lead, num_chunks, chunk, dim), -3, 0)
    out = jnp.moveaxis(lax.map(jax.checkpoint(fn), blocks), 0, len(lead))
    out = out.reshape(*lead, num_chunks * chunk, *out.shape[len(lead) + 2 :])
    return lax.slice_in_dim(out, 0, n, axis=len(lead))


def kernel_mv_dense(q, k, v, lengthscale, *, precision=None):
    """``exp(-0.5 ||(q_i - k_j)/l||^2) @ v`` through the materialised ``[..., N, M]`` matrix."""
    dtype = compute_dtype(q, k, v)
    qs, ks = centered_scaled(q, k, lengthscale, dtype)
    kernel = jnp.exp(-_half_sq_dist(qs, ks))
    out = jnp.einsum(
        "...nm,...mo->...no", kernel, v.astype(dtype), precision=_product_precision(precision)
    )
    return out.astype(jnp.result_type(q, k, v))


def kernel_mv_xla(q, k, v, lengthscale, *, precision=None, chunk=None):
    """``rbf_kernel_mv`` in chunks of queries: memory ``O((N + M) * chunk)`` forward and backward.

    ``chunk`` defaults to ``default_chunk`` (a ``[batch, chunk, M]`` block of ~16M values).
    """
    dtype = compute_dtype(q, k, v)
    qs, ks = centered_scaled(q, k, lengthscale, dtype)
    values = v.astype(dtype)
    batch = math.prod(q.shape[:-2])
    chunk = chunk or default_chunk(q.shape[-2], k.shape[-2], batch)

    def block(q_chunk):
        kernel = jnp.exp(-_half_sq_dist(q_chunk, ks))
        return jnp.einsum(
            "...nm,...mo->...no", kernel, values, precision=_product_precision(precision)
        )

    return _map_query_chunks(block, qs, chunk).astype(jnp.result_type(q, k, v))


def _kde_normaliser_log(dim: int, bandwidth, dtype):
    """``log((2 pi h^2)^(-D/2))``."""
    h = jnp.asarray(bandwidth).astype(dtype)
    return -0.5 * dim * math.log(2.0 * math.pi) - dim * jnp.log(h)


def _kde_block(xq, xd, weights, *, log: bool):
    """Unnormalised ``sum_j w_j exp(-0.5 ||xq_i - xd_j||^2)`` (or its log) for one block."""
    exponent = -_half_sq_dist(xq, xd)
    if log:
        # log-sum-exp shifted by the largest exponent of a weighted point. Not
        # jax.nn.logsumexp(b=w): it masks zero weights, which zeroes their (nonzero) gradient.
        # The clamp only keeps 0 * exp(overflow) = NaN away from zero-weight points far closer
        # than every weighted one; it changes nothing else.
        shift = jnp.max(jnp.where(weights[..., None, :] > 0, exponent, -jnp.inf), axis=-1)
        shift = lax.stop_gradient(shift)
        limit = 700.0 if exponent.dtype == jnp.float64 else 80.0
        scaled = jnp.exp(jnp.minimum(exponent - shift[..., None], limit))
        total = jnp.einsum("...nm,...m->...n", scaled, weights, precision=lax.Precision.HIGHEST)
        return jnp.log(total) + shift
    return jnp.einsum(
        "...nm,...m->...n", jnp.exp(exponent), weights, precision=lax.Precision.HIGHEST
    )


def _kde_finish(raw, dim, bandwidth, dtype, *, log: bool):
    log_norm = _kde_normaliser_log(dim, bandwidth, dtype)
    return raw + log_norm if log else raw * jnp.exp(log_norm)


def kde_density_dense(query, data, bandwidth, weights, *, log=False):
    """Gaussian KDE through the materialised ``[..., N, M]`` matrix.

    ``weights: [..., M]`` must already sum to one. Returns ``[..., N]`` (log density if ``log``).
    """
    dtype = compute_dtype(query, data)
    xq, xd = centered_scaled(query, data, bandwidth, dtype)
    raw = _kde_block(xq, xd, weights.astype(dtype), log=log)
    out = _kde_finish(raw, query.shape[-1], bandwidth, dtype, log=log)
    return out.astype(jnp.result_type(query, data))


def kde_density_xla(query, data, bandwidth, weights, *, log=False, chunk=None):
    """Gaussian KDE in chunks of queries (memory ``O((N + M) * chunk)``), like ``kernel_mv_xla``.

    ``log=True`` uses ``logsumexp``, finite far from all data.
    """
    dtype = compute_dtype(query, data)
    xq, xd = centered_scaled(query, data, bandwidth, dtype)
    w = weights.astype(dtype)
    batch = math.prod(query.shape[:-2])
    chunk = chunk or default_chunk(query.shape[-2], data.shape[-2], batch)
    raw = _map_query_chunks(lambda block: _kde_block(block, xd, w, log=log), xq, chunk)
    out = _kde_finish(raw, query.shape[-1], bandwidth, dtype, log=log)
    return out.astype(jnp.result_type(query, data))
