"""Plain-XLA RBF kernel sums: the benchmark baselines and the test oracles.

* ``*_dense`` materialise the full ``[..., N, M]`` kernel matrix (fast for small problems,
  memory ``O(N * M)``, ``O(N * M * D)`` in the backward pass of the exact path).
* ``*_xla`` process the queries in chunks with ``lax.map`` over a ``jax.checkpoint``-ed body,
  so forward *and* backward keep at most one chunk's pair arrays alive: memory
  ``O((N + M) * chunk)``. Being plain JAX they are differentiable to any order.

All of them take inputs already validated by ``tilax.rbf.api`` (shapes ``[..., N, D]``,
``[..., M, D]``, ``[..., M, O]``; floating dtypes) and compute in float32 (float64 stays
float64), returning the result type of the point and value inputs.

Distances follow ``tilax.rbf.numerics``: ``precision="highest"`` sums squared coordinate
differences ``((q_d - k_d) / l_d)^2`` (exact at any scale); the other precisions use the expansion
``|a|^2 + |b|^2 - 2 a.b`` of centred, scaled points (one ``HIGHEST`` matrix product, clamped at
0) while its error bound is within budget, and the differences beyond it. Kernel values are
always in ``[0, 1]``. ``kernel_mv_*`` take the kernel profile as ``kernel``
(``tilax.rbf.profiles.half_sq_kernel``: the Gaussian ``exp(-s)`` by default, or a Matérn kernel,
differentiable by its ``custom_jvp``); the KDE is Gaussian.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from tilax.rbf import numerics, profiles

# Elements of one chunk's pair arrays in the chunked path (64 MiB in float32).
CHUNK_ELEMENTS = 1 << 24
# Pair arrays the exact path's backward pass keeps per input dimension (XLA on CPU keeps about
# three [chunk, M] arrays per dimension alive); its chunks shrink by this factor times D.
# (Beyond EXACT_DIMS_UNROLLED dimensions the loop keeps less, but larger chunks made a
# gradient at D = 64 slower on a CPU: 2.9 -> 3.5 s at 4096 x 4096 points.)
EXACT_PAIR_ARRAYS_PER_DIM = 3
# Dimensions summed per step of the exact path's loop (``_exact_half_sq``).
EXACT_DIMS_UNROLLED = 8


def _expansion_half_sq(qs, ks):
    """``0.5 ||qs_i - ks_j||^2 >= 0`` as ``[..., N, M]`` by the expansion (centred, scaled)."""
    cross = jnp.einsum("...nd,...md->...nm", qs, ks, precision=lax.Precision.HIGHEST)
    q_sq = 0.5 * jnp.sum(qs * qs, axis=-1)
    k_sq = 0.5 * jnp.sum(ks * ks, axis=-1)
    return jnp.maximum(q_sq[..., :, None] + k_sq[..., None, :] - cross, 0.0)


def _exact_half_sq(q, k, lengthscale):
    """``0.5 sum_d ((q_id - k_jd) / l_d)^2`` as ``[..., N, M]`` from coordinate differences."""
    per_dimension = jnp.ndim(lengthscale) == 1
    scales = numerics.Scale.of(lengthscale)  # once, not once per dimension

    def add_dimension(total, d):
        scale = scales[d] if per_dimension else scales
        scaled = scale.apply(q[..., :, None, d] - k[..., None, :, d])
        # Each square and the result pass through a max with 0 (a no-op) that XLA cannot fuse
        # into the sums: every recomputation of an exponent (XLA recomputes per use, and in the
        # backward pass) then rounds alike. A fused multiply-add would not round the product,
        # and beyond 2^24 two roundings of one exponent differ by more than 1, which the
        # log-sum-exp's shift turns into factors of 2^1000.
        square = jnp.maximum(scaled * scaled, 0.0)
        return (square if total is None else total + square), None

    dim = q.shape[-1]
    # Up to EXACT_DIMS_UNROLLED unrolled: as a loop of one step, a GP gradient's first call at
    # D = 8 took 6.4-6.7 s of CPU against 4.9-5.5 unrolled.
    if dim <= EXACT_DIMS_UNROLLED:
        total = None
        for d in range(dim):
            total, _ = add_dimension(total, d)
    else:
        # A loop over the dimensions, EXACT_DIMS_UNROLLED per step, each step recomputed in the
        # backward pass: the program stops growing with D. At D = 64 on a CPU (500 x 2000
        # points) compiling the forward took 2.6 -> 0.8 s and its gradient 8.0 -> 1.4 s, the
        # gradient's call 365 -> 224 ms.
        shape = jnp.broadcast_shapes(q.shape[:-1] + (1,), k.shape[:-2] + (1, k.shape[-2]))
        total, _ = lax.scan(jax.checkpoint(add_dimension), jnp.zeros(shape, q.dtype),
                            jnp.arange(dim), unroll=EXACT_DIMS_UNROLLED)
    return jnp.maximum(0.5 * total, 0.0)


def _product_precision(precision: str | None) -> lax.Precision:
    return lax.Precision.HIGHEST if precision == "highest" else lax.Precision.DEFAULT


def default_chunk(n: int, m: int, batch: int, dim: int = 0) -> int:
    """Queries per chunk: pair arrays of about ``CHUNK_ELEMENTS`` values.

    ``dim > 0`` sizes chunks for the exact path, whose backward pass keeps per-dimension pair
    arrays (``EXACT_PAIR_ARRAYS_PER_DIM`` per dimension).
    """
    per_row = max(1, m * batch) * max(1, EXACT_PAIR_ARRAYS_PER_DIM * dim)
    return int(max(1, min(n, CHUNK_ELEMENTS // per_row)))


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


def _by_distance_path(q, k, lengthscale, precision, *, fast, exact, kernel="rbf"):
    """``fast(qs, ks)`` (centred, scaled points) where the expansion is within its budget for
    ``precision`` and ``kernel``, else ``exact(q, k)``; always ``exact`` for ``"highest"``."""
    if not numerics.uses_expansion(precision):
        return exact(q, k)
    qs, ks = numerics.centered_scaled(q, k, lengthscale)
    ok = numerics.fast_distance_ok(qs, ks, precision, kernel)
    # Under vmap both branches run: the fast one gets finite points, so its unused gradient is 0.
    qs, ks = jnp.where(ok, qs, 0.0), jnp.where(ok, ks, 0.0)
    return lax.cond(ok, lambda: fast(qs, ks), lambda: exact(q, k))


# Jitted (also when called eagerly): the distance switch is a lax.cond, which would otherwise
# compile both of its branches again at every call.
@functools.partial(jax.jit, static_argnames=("precision", "kernel"))
def kernel_mv_dense(q, k, v, lengthscale, *, precision=None, kernel="rbf"):
    """``k(||(q_i - k_j)/l||) @ v`` through the materialised ``[..., N, M]`` matrix (``kernel``
    a ``tilax.rbf.profiles`` name; the Gaussian ``exp(-0.5 r^2)`` by default)."""
    dtype, out_dtype = numerics.compute_dtype(q, k, v), jnp.result_type(q, k, v)
    q, k, values = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    lengthscale = jnp.asarray(lengthscale).astype(dtype)

    def product(half_sq):
        return jnp.einsum("...nm,...mo->...no", profiles.half_sq_kernel(kernel, half_sq), values,
                          precision=_product_precision(precision))  # fmt: skip

    out = _by_distance_path(
        q, k, lengthscale, precision,
        fast=lambda qs, ks: product(_expansion_half_sq(qs, ks)),
        exact=lambda q, k: product(_exact_half_sq(q, k, lengthscale)), kernel=kernel,
    )  # fmt: skip
    return out.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("precision", "chunk", "kernel"))
def kernel_mv_xla(q, k, v, lengthscale, *, precision=None, chunk=None, kernel="rbf"):
    """``kernel_mv`` in chunks of queries: memory ``O((N + M) * chunk)`` forward and backward.

    ``chunk`` defaults to ``default_chunk`` (pair arrays of ~16M values); ``kernel`` as in
    ``kernel_mv_dense``.
    """
    dtype, out_dtype = numerics.compute_dtype(q, k, v), jnp.result_type(q, k, v)
    q, k, values = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    lengthscale = jnp.asarray(lengthscale).astype(dtype)
    n, m, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    batch = math.prod(q.shape[:-2])

    def product(half_sq):
        return jnp.einsum("...nm,...mo->...no", profiles.half_sq_kernel(kernel, half_sq), values,
                          precision=_product_precision(precision))  # fmt: skip

    def fast(qs, ks):
        rows = chunk or default_chunk(n, m, batch)
        return _map_query_chunks(lambda block: product(_expansion_half_sq(block, ks)), qs, rows)

    def exact(q, k):
        rows = chunk or default_chunk(n, m, batch, dim)
        return _map_query_chunks(
            lambda block: product(_exact_half_sq(block, k, lengthscale)), q, rows
        )

    out = _by_distance_path(q, k, lengthscale, precision, fast=fast, exact=exact, kernel=kernel)
    return out.astype(out_dtype)


def _kde_normaliser_log(dim: int, bandwidth, dtype):
    """``log((2 pi h^2)^(-D/2))``."""
    h = jnp.asarray(bandwidth).astype(dtype)
    return -0.5 * dim * math.log(2.0 * math.pi) - dim * numerics.log_positive(h)


def _kde_log_sum(half_sq, weights):
    """``log sum_j w_j exp(-half_sq_ij)`` for one block, by a log-sum-exp.

    Shifted by the largest exponent of a weighted point. Not ``jax.nn.logsumexp(b=w)``: it masks
    zero weights, which zeroes their (nonzero) gradient. The clamp only keeps
    ``0 * exp(overflow) = NaN`` away from zero-weight points far closer than every weighted one.
    """
    exponent = -half_sq
    largest = jnp.max(jnp.where(weights[..., None, :] > 0, exponent, -jnp.inf), axis=-1)
    # Every weighted exponent -inf (each squared distance beyond float range, as at tiny
    # bandwidths): the sum underflows, its log is -inf. The shift of 0 only keeps -inf - -inf
    # (NaN) out of the arithmetic below.
    underflowed = largest == -jnp.inf
    shift = lax.stop_gradient(jnp.where(jnp.isfinite(largest), largest, 0.0))
    limit = 700.0 if exponent.dtype == jnp.float64 else 80.0
    scaled = jnp.exp(jnp.minimum(exponent - shift[..., None], limit))
    total = jnp.einsum("...nm,...m->...n", scaled, weights, precision=lax.Precision.HIGHEST)
    # The largest weighted term is w * exp(0): the sum is at least the smallest positive weight.
    # Where XLA recomputes that exponent with another rounding (beyond 2^24, two roundings
    # differ by more than 1) the term could underflow; the floor keeps the log finite.
    floor = jnp.min(jnp.where(weights > 0, weights, jnp.inf), axis=-1)[..., None]
    total = jnp.where(total < floor, floor, total)
    return jnp.where(underflowed, -jnp.inf, jnp.log(total) + shift)


def _kde_finish(log_sum, dim, bandwidth, *, log: bool):
    """The (log) density from ``log sum_j w_j K_ij``. The plain density is ``exp`` of the log
    density, so a huge normaliser (tiny bandwidth) times an underflowed sum is 0, not NaN."""
    log_p = log_sum + _kde_normaliser_log(dim, bandwidth, log_sum.dtype)
    return log_p if log else jnp.exp(log_p)


@functools.partial(jax.jit, static_argnames=("log", "precision"))
def kde_density_dense(query, data, bandwidth, weights, *, log=False, precision=None):
    """Gaussian KDE through the materialised ``[..., N, M]`` matrix.

    ``weights: [..., M]`` must already sum to one. Returns ``[..., N]`` (log density if ``log``).
    """
    dtype, out_dtype = numerics.compute_dtype(query, data), jnp.result_type(query, data)
    query, data, w = query.astype(dtype), data.astype(dtype), weights.astype(dtype)
    h = jnp.asarray(bandwidth).astype(dtype)
    raw = _by_distance_path(
        query, data, h, precision,
        fast=lambda qs, ks: _kde_log_sum(_expansion_half_sq(qs, ks), w),
        exact=lambda q, k: _kde_log_sum(_exact_half_sq(q, k, h), w),
    )  # fmt: skip
    out = _kde_finish(raw, query.shape[-1], h, log=log)
    return out.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("log", "precision", "chunk"))
def kde_density_xla(query, data, bandwidth, weights, *, log=False, precision=None, chunk=None):
    """Gaussian KDE in chunks of queries (memory ``O((N + M) * chunk)``), like ``kernel_mv_xla``.

    The sum is a log-sum-exp (the log density is finite far from all data).
    """
    dtype, out_dtype = numerics.compute_dtype(query, data), jnp.result_type(query, data)
    query, data, w = query.astype(dtype), data.astype(dtype), weights.astype(dtype)
    h = jnp.asarray(bandwidth).astype(dtype)
    n, m, dim = query.shape[-2], data.shape[-2], query.shape[-1]
    batch = math.prod(query.shape[:-2])

    def fast(qs, ks):
        rows = chunk or default_chunk(n, m, batch)
        return _map_query_chunks(
            lambda block: _kde_log_sum(_expansion_half_sq(block, ks), w), qs, rows
        )

    def exact(q, k):
        rows = chunk or default_chunk(n, m, batch, dim)
        return _map_query_chunks(
            lambda block: _kde_log_sum(_exact_half_sq(block, k, h), w), q, rows
        )

    raw = _by_distance_path(query, data, h, precision, fast=fast, exact=exact)
    out = _kde_finish(raw, dim, h, log=log)
    return out.astype(out_dtype)


def kde_log_sum_xla(query, data, bandwidth, weights, *, precision=None):
    """``log sum_j w_j exp(-0.5 |(x_i - x_j) / h|^2)`` (the log density without its normaliser)
    by ``kde_density_xla``; ``weights`` sum to one."""
    log_p = kde_density_xla(query, data, bandwidth, weights, log=True, precision=precision)
    dtype = numerics.compute_dtype(query, data)
    return log_p - _kde_normaliser_log(query.shape[-1], bandwidth, dtype).astype(log_p.dtype)
