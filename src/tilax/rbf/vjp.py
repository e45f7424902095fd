"""The Pallas path of ``rbf_kernel_mv`` and ``rbf_kde_density``: custom VJPs over the kernels.

Each op has two paths (``tilax.rbf.numerics``), each a ``jax.custom_vjp`` whose backward pass is
made of Pallas kernels too:

* fast (expansion): defined on centred, scaled points ``qs = (q - c) / l``, ``ks = (k - c) / l``
  (and ``v``); JAX's chain rule through the scaling gives the lengthscale gradient.
* exact (differences): defined on the points, values and lengthscale themselves. The kernels
  see coordinates scaled by a power of two (exact) and apply the residual scale per pair; the
  lengthscale gradient ``dl_d = (2 ln 2 / l_d) sum_ij A_ij e_ijd^2`` (``e`` the scaled
  differences) is summed pair by pair in the query-gradient sweep.

``precision="highest"`` always runs the exact path; the other precisions run the fast one
while its error bound is within budget, else the exact one (a ``lax.cond`` on the data).

The kernels apply the config's kernel profile (``PathConfig.kernel``, ``tilax.rbf.profiles``):
the Gaussian ``exp2(t)`` of the base-2 exponent, or a Matérn kernel; every formula below holds
for each with ``K`` in ``A`` replaced by the profile's pair weight ``phi = -dk/ds`` (``K``
itself for the Gaussian), ``K`` elsewhere (``dv``) its values.

Backward of ``out = K @ v`` with cotangent ``g`` and ``A = K * (g @ v.T)``:
``dq_i = sum_j A_ij (k_j - q_i) / l^2``, ``dk_j = sum_i A_ij (q_i - k_j) / l^2``,
``dv = K.T @ g``: one kernel over query tiles (dq) and one over key tiles (dk and, while the
padded value columns number at most 64 and the exact path has at most 16 dimensions, dv in the
same sweep; otherwise dv is the forward kernel with queries and keys swapped). On Hopper the
fast path of ``rbf_kernel_mv`` runs one sweep over key tiles for all three
(``tilax.rbf.mosaic.grad``: dq's sums added up across programs). The fast path
forms the pair sums as ``sum_j A_ij ks_j - qs_i sum_j A_ij`` (tensor-core dots of the augmented
rows), the exact path from each pair's coordinate differences. Peak memory stays
``O((N + M) * (D + O))``.

The KDE's ``S_i = sum_j w_j K_ij`` comes from a streaming log-sum-exp as ``(m_i, s_i)`` with
``S_i = 2^m_i s_i`` (kept apart: at exponents of 1e10 and beyond, ``log2 s_i`` would vanish in
``m_i``'s rounding). With ``p_ij = w_j K_ij / S_i``: ``dx_i = g_i sum_j p_ij (x_j - x_i) / h^2``,
``dx_j = w_j sum_i g_i (K_ij / S_i) (x_i - x_j) / h^2``, ``dw_j = sum_i g_i K_ij / S_i``: two
gradient sweeps whose pair weights are ``exp2(t_ij - m_i) g_i / s_i`` (times ``w_j``), the
forward pass's own exponents and shift, so that the largest pair weight of a row is exact.

The backward kernels have no derivative rules: differentiating them here raises a
``NotImplementedError``. The public functions go through ``tilax.rbf.forward_mode``, which adds
forward mode and higher orders (by the plain-XLA sums) and keeps these backward kernels for
reverse mode.
"""

from __future__ import annotations

import functools
import importlib
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax

from tilax import _pallas
from tilax.rbf import numerics
from tilax.rbf.config import (
    Launch,
    PallasConfig,
    PathConfig,
    backward_distance,
    expansion_width,
    forward_distance,
    fuses_dv,
    kde_coords,
)
from tilax.rbf.numerics import Expansion


def _kernels(name: str):
    """The backend module ``tilax.rbf.<name>`` (``"triton"``, ``"mosaic.forward"``, ...),
    imported at a kernel's first use, so that ``import tilax`` and the XLA paths load no GPU
    backend (Triton, Mosaic GPU) module."""
    return importlib.import_module(f"tilax.rbf.{name}")


LOG2E, LN2 = numerics.LOG2E, numerics.LN2

_SECOND_ORDER_MESSAGE = (
    "{name}(impl='pallas') supports first-order derivatives only: its backward pass is itself "
    "a Pallas kernel without derivative rules. For Hessians or other higher-order derivatives "
    "use impl='xla' (memory-light, differentiable to any order) or impl='dense'."
)



# ------------------------------------------------------------------------------------------
# Kernel operands, built from the points, values and cotangents
#
# Operands of the RBF Pallas kernels, built from the points, values and cotangents.
#
# Expansion (fast) path: *augmented* points whose dot product is the base-2 exponent::
#
#     x_i = [qs_i,          -0.5 log2(e) |qs_i|^2, 1]
#     y_j = [log2(e) ks_j,  1,  -0.5 log2(e) |ks_j|^2]
#     x_i . y_j = -0.5 log2(e) |qs_i - ks_j|^2,          K_ij = exp2(min(x_i . y_j, 0))
#
# for centred, scaled points ``qs = (q - c) / l``, ``ks = (k - c) / l``, zero-padded to
# ``config.expansion_width`` columns (Triton dots need every dimension >= 16), or laid out
# as TF32 parts (``numerics.tf32x3_parts``) for the forward kernels. The same rows carry the
# gradient sums: ``A @ y`` gives ``sum_j A_ij ks_j`` (times log2 e) and the row sum of ``A``.
#
# Exact (difference) path: coordinates multiplied by a power of two per dimension (exact) and
# transposed to ``[B, D, rows]``, so that a kernel reads one dimension of a tile as one
# contiguous row; the residual scale (in ``[1, 2)``) is a separate operand.
#
# Rows that pad a point count to a tile multiple are zeros; the kernels mask them by index.


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
        return numerics.tf32x3_parts(blocks, first=first)
    x = jnp.concatenate(blocks, axis=-1)
    return pad_rows_cols(x, rows, expansion_width(x.shape[-1] - 2))


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
    ``Dk = numerics.difference_dims(D)`` (zero coordinates add nothing)."""
    scaled = numerics.prescale(x.astype(jnp.float32), power_of_two)
    dims = numerics.difference_dims(x.shape[2])
    return jnp.swapaxes(pad_rows_cols(scaled, rows, dims), 1, 2)


def exact_scale(residual: jax.Array, dim: int | None = None) -> jax.Array:
    """The residual scale as the kernels' ``scale`` operand: one shared, or per dimension
    (``dim`` of them, padded to ``numerics.difference_dims(dim)`` with ones)."""
    residual = residual.astype(jnp.float32)
    if dim is None:
        return jnp.reshape(residual, (1,))
    residual = jnp.broadcast_to(residual, (dim,))
    return jnp.pad(residual, (0, numerics.difference_dims(dim) - dim), constant_values=1.0)


def value_operand(a: jax.Array, rows: int, cols: int, values_mode: str) -> jax.Array:
    """Values or cotangents ``[B, R, O]`` padded to ``[B, rows, cols]``; stored in bfloat16 when
    every product with them rounds to bfloat16 anyway (the same numbers, half the bytes)."""
    a = pad_rows_cols(a.astype(jnp.float32), rows, cols)
    return a.astype(jnp.bfloat16) if values_mode == "bf16" else a


# ------------------------------------------------------------------------------------------
# Kernel calls


def _run(name: str, kernel, path: PathConfig, launch: Launch, arrays: dict, **static):
    """``kernel(**arrays, **static)`` with ``launch``'s tiles, guarded against differentiation
    (its derivatives raise a clear error instead of differentiating the kernel)."""
    arrays = {key: array for key, array in arrays.items() if array is not None}
    params = dict(backend=path.backend, block_p=launch.block_p, block_l=launch.block_l,
                  num_warps=launch.num_warps, num_stages=launch.num_stages, **static)  # fmt: skip
    guarded = jax.custom_jvp(lambda arrays: kernel(**arrays, **params))

    def no_jvp(primals, tangents):
        raise NotImplementedError(_SECOND_ORDER_MESSAGE.format(name=name))

    guarded.defjvp(no_jvp)
    return guarded(arrays)


def _sliced_transpose(r: jax.Array, rows: int, dim: int) -> jax.Array:
    """Exact-path gradient sums ``[B, >= dim, R]`` as ``[B, rows, dim]``."""
    return jnp.swapaxes(r[:, :dim, :rows], 1, 2)


def _lengthscale_grad(sums: dict, rows: int, dim: int, scale):
    """``d scale`` from an exact sweep's pair-by-pair squares (the Triton dq sweep's, or the
    Mosaic GPU sweep's over keys; ``rows`` of its program rows are real): per dimension
    ``(2 ln 2 / l_d) sum A e_d^2`` (``e_d`` the scaled differences), or for a shared scale
    ``-(2 ln 2 / l) sum A t`` (``t`` the base-2 exponent). Summed pair by pair, not by the
    identity ``-sum_i q_i . dq_i / l - ...``, which cancels at large spread-to-lengthscale
    ratios."""
    if "squares" in sums:
        squares = jnp.sum(sums["squares"][:, :dim, :rows], axis=(0, 2))
        return numerics.divide_by(2.0 * LN2 * squares, scale)
    return numerics.divide_by(-2.0 * LN2 * jnp.sum(sums["rows"][:, -1, :rows]), scale)


def _exact_operands(q, k, scale, rows_q: int, rows_k: int, *, per_dimension: bool):
    """(query points, key points, residual scale operand, gradient factor) of the exact path.

    The factor turns the kernels' sums ``sum A e`` (``e`` the differences, times the residual
    scale when ``per_dimension``) into gradients: ``-2 ln 2 p r`` per dimension, or
    ``-2 ln 2 p r^2`` for a shared scale applied to the summed squares. A scalar ``scale`` may
    still be applied ``per_dimension`` (broadcast to every dimension).
    """
    # The data's magnitude caps the power of two, so that no scaled coordinate overflows.
    magnitude = jnp.maximum(jnp.max(jnp.abs(q)), jnp.max(jnp.abs(k)))
    power, residual = numerics.exact_scales(scale, magnitude)
    factor = -2.0 * LN2 * power * (residual if per_dimension else residual * residual)
    # Finite at subnormal lengthscales too, so that zero sums give zero gradients, not 0 * inf.
    factor = jnp.clip(factor, -numerics.FLOAT32_MAX, numerics.FLOAT32_MAX)
    xq = exact_points(q, power, rows_q)
    xk = exact_points(k, power, rows_k)
    return xq, xk, exact_scale(residual, q.shape[-1] if per_dimension else None), factor


# ------------------------------------------------------------------------------------------
# rbf_kernel_mv, fast path


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel_mv_fast(qs, ks, v, path: PathConfig):
    """``exp(-0.5 |qs_i - ks_j|^2) @ v`` for centred, scaled float32 ``qs: [B, N, D]``,
    ``ks: [B, M, D]`` and ``v: [B, M, O]``."""
    return _kernel_mv_fast_fwd(qs, ks, v, path)[0]


def _kernel_mv_fast_fwd(qs, ks, v, path: PathConfig):
    (_, n, dim), m, out_dim = qs.shape, ks.shape[1], v.shape[2]
    distance = forward_distance(path.modes, dim)
    rows_q, rows_k = path.query_rows(n, backward=False), path.key_rows(m, backward=False)
    x, y = expansion_points(distance, qs, ks, rows_q, rows_k)
    values = value_operand(v, rows_k, path.cols, path.modes.values)
    kernel = _kernels("mosaic.forward").kernel_matmul if path.fwd.backend == "mosaic" else (
        _kernels("triton").kernel_matmul)
    out = _run(
        "rbf_kernel_mv", kernel, path, path.fwd, dict(x=x, y=y, v=values),
        distance=distance, valid_l=m, block_o=path.fwd.block_o, values=path.modes.values,
        profile=path.kernel,
    )  # fmt: skip
    return out[:, :n, :out_dim], (qs, ks, v)


def _mv_grad_sweeps(path: PathConfig, distance, x, y, g_pad, v_pad, n, m, dim, scale=None):
    """(query sums, key sums, dv) of ``rbf_kernel_mv``'s backward pass, both paths (the exact
    path's query sums carry the lengthscale's pair-by-pair squares too)."""
    modes = path.modes
    dots = dict(distance=distance, values=modes.values, coords=modes.coords, profile=path.kernel)

    r = _run(
        "rbf_kernel_mv", _kernels("triton").kernel_matmul_grad, path, path.dq,
        dict(x=x, y=y, u=g_pad, w=v_pad, scale=scale), valid_l=m, with_squares=scale is not None,
        block_o=path.dq.block_o, **dots,
    )  # fmt: skip
    fuse_dv = fuses_dv(modes, dim, path.cols)
    c = _run(
        "rbf_kernel_mv", _kernels("triton").kernel_matmul_grad, path, path.dk,
        dict(x=y, y=x, u=v_pad, w=g_pad, scale=scale), valid_l=n, with_pw=fuse_dv,
        block_o=path.dk.block_o, **dots,
    )  # fmt: skip
    if fuse_dv:
        return r, c, c["pw"]
    dv = _run(
        "rbf_kernel_mv", _kernels("triton").kernel_matmul, path, path.dk,
        dict(x=y, y=x, v=g_pad, scale=scale), distance=distance, valid_l=n,
        block_o=path.dk.block_o, values=modes.values, profile=path.kernel,
    )  # fmt: skip
    return r, c, dv


def _mosaic_grad_sweep(path: PathConfig, qs, ks, g, v):
    """(query sums, key sums, dv) of the fast path from one sweep over the pairs
    (``tilax.rbf.mosaic.grad``: programs over keys with the ``dk`` launch's tiles, the
    queries' sums added up across programs): the distance from TF32 parts, the pair sums
    against the augmented points."""
    (_, n, _), m = qs.shape, ks.shape[1]
    rows_q = _pallas.round_up(n, max(_kernels("mosaic.grad").BLOCK_P, path.dk.block_l))
    rows_k = _pallas.round_up(m, _kernels("mosaic.grad").BLOCK_P)
    x_parts, y_parts = expansion_points(Expansion("tf32_parts"), qs, ks, rows_q, rows_k)
    x, y = augment_queries(qs, rows_q), augment_keys(ks, rows_k)
    g_pad = value_operand(g, rows_q, path.cols, "bf16")
    v_pad = value_operand(v, rows_k, path.cols, "bf16")  # zero rows: padded keys add 0
    sums = _run("rbf_kernel_mv", _kernels("mosaic.grad").pair_sums, path, path.dk,
                dict(x=y_parts, y=x_parts, coords=x, own=y, u=v_pad, w=g_pad), valid_l=n,
                profile=path.kernel)
    return sums["loop_sums"], sums["sums"], sums["pw"]


def _kernel_mv_fast_bwd(path: PathConfig, residuals, g):
    qs, ks, v = residuals
    (_, n, dim), m, out_dim = qs.shape, ks.shape[1], v.shape[2]
    if path.dq.backend == "mosaic":
        r, c, dv = _mosaic_grad_sweep(path, qs, ks, g, v)
        dqs = r[:, :n, :dim] / LOG2E - qs * r[:, :n, dim : dim + 1]
        dks = c[:, :m, :dim] - ks * c[:, :m, dim + 1 : dim + 2]
        return dqs, dks, dv[:, :m, :out_dim]
    rows_q, rows_k = path.query_rows(n, backward=True), path.key_rows(m, backward=True)
    x, y = augment_queries(qs, rows_q), augment_keys(ks, rows_k)
    g_pad = value_operand(g, rows_q, path.cols, path.modes.values)
    v_pad = value_operand(v, rows_k, path.cols, path.modes.values)
    distance = backward_distance(path.modes, dim)
    r, c, dv = _mv_grad_sweeps(path, distance, x, y, g_pad, v_pad, n, m, dim)
    # Augmented columns: r = [log2e sum_j A ks_j, sum_j A, .], c = [sum_i A qs_i, ., sum_i A].
    r, c = r["sums"], c["sums"]
    dqs = r[:, :n, :dim] / LOG2E - qs * r[:, :n, dim : dim + 1]
    dks = c[:, :m, :dim] - ks * c[:, :m, dim + 1 : dim + 2]
    return dqs, dks, dv[:, :m, :out_dim]


_kernel_mv_fast.defvjp(_kernel_mv_fast_fwd, _kernel_mv_fast_bwd)


# ------------------------------------------------------------------------------------------
# rbf_kernel_mv, exact path


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _kernel_mv_exact(q, k, v, lengthscale, path: PathConfig):
    """``exp(-0.5 |(q_i - k_j) / l|^2) @ v`` for float32 ``q: [B, N, D]``, ``k: [B, M, D]``,
    ``v: [B, M, O]`` and ``lengthscale`` (scalar or ``[D]``), from coordinate differences."""
    return _kernel_mv_exact_fwd(q, k, v, lengthscale, path)[0]


def _kernel_mv_exact_fwd(q, k, v, lengthscale, path: PathConfig):
    (_, n, dim), m, out_dim = q.shape, k.shape[1], v.shape[2]
    per_dimension = jnp.ndim(lengthscale) == 1
    distance = forward_distance(path.modes, dim, per_dimension)
    rows_q, rows_k = path.query_rows(n, backward=False), path.key_rows(m, backward=False)
    xq, xk, scale, _ = _exact_operands(q, k, lengthscale, rows_q, rows_k,
                                       per_dimension=per_dimension)  # fmt: skip
    values = value_operand(v, rows_k, path.cols, path.modes.values)
    kernel = _kernels("mosaic.exact").kernel_matmul if path.fwd.backend == "mosaic" else (
        _kernels("triton").kernel_matmul)
    out = _run(
        "rbf_kernel_mv", kernel, path, path.fwd,
        dict(x=xq, y=xk, v=values, scale=scale), distance=distance, valid_l=m,
        block_o=path.fwd.block_o, values=path.modes.values, profile=path.kernel,
    )  # fmt: skip
    return out[:, :n, :out_dim], (q, k, v, lengthscale)


def _mosaic_exact_pair_sums(path: PathConfig, distance, xq, xk, g_pad, v_pad, n, scale):
    """(query sums, key sums, dv) of the exact path from one sweep over the pairs
    (``tilax.rbf.mosaic.exact_grad``: programs over keys with the ``dk`` launch's tiles,
    the queries' sums added up across programs), as ``_mv_grad_sweeps`` returns them, with the
    lengthscale's squares among the key sums."""
    c = _run("rbf_kernel_mv", _kernels("mosaic.exact_grad").pair_sums, path, path.dk,
             dict(x=xk, y=xq, u=v_pad, w=g_pad, scale=scale), distance=distance, valid_l=n,
             with_squares=True, profile=path.kernel)
    # Per warp, unscaled, keys minus queries: the query sweep's sums are minus their total.
    query_sums = -jnp.sum(c["loop_sums"], axis=2)
    if distance.per_dimension:
        query_sums = query_sums * scale[None, :, None]
    return {"sums": query_sums}, c, c["pw"]


def _kernel_mv_exact_bwd(path: PathConfig, residuals, g):
    q, k, v, lengthscale = residuals
    (_, n, dim), m, out_dim = q.shape, k.shape[1], v.shape[2]
    rows_q, rows_k = path.query_rows(n, backward=True), path.key_rows(m, backward=True)
    per_dimension = jnp.ndim(lengthscale) == 1
    xq, xk, scale, factor = _exact_operands(q, k, lengthscale, rows_q, rows_k,
                                            per_dimension=per_dimension)  # fmt: skip
    g_pad = value_operand(g, rows_q, path.cols, path.modes.values)
    v_pad = value_operand(v, rows_k, path.cols, path.modes.values)
    distance = backward_distance(path.modes, dim, per_dimension)
    if path.dk.backend == "mosaic":  # the squares come with the key sums
        r, c, dv = _mosaic_exact_pair_sums(path, distance, xq, xk, g_pad, v_pad, n, scale)
        squares, squares_rows = c, m
    else:
        r, c, dv = _mv_grad_sweeps(path, distance, xq, xk, g_pad, v_pad, n, m, dim, scale)
        squares, squares_rows = r, n
    dq = _sliced_transpose(r["sums"], n, dim) * factor
    dk = _sliced_transpose(c["sums"], m, dim) * factor
    grad_l = _lengthscale_grad(squares, squares_rows, dim, lengthscale)
    return dq, dk, dv[:, :m, :out_dim], grad_l


_kernel_mv_exact.defvjp(_kernel_mv_exact_fwd, _kernel_mv_exact_bwd)


# ------------------------------------------------------------------------------------------
# rbf_kde_density, fast path


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kde_fast(xq, xd, w, path: PathConfig):
    """``log sum_j w_j exp(-0.5 |xq_i - xd_j|^2)`` for centred, scaled ``xq: [B, N, D]``,
    ``xd: [B, M, D]`` and weights ``w: [B, M]`` (float32)."""
    return _kde_fast_fwd(xq, xd, w, path)[0]


def _kde_fast_fwd(xq, xd, w, path: PathConfig):
    (_, n, dim), m = xq.shape, xd.shape[1]
    distance = forward_distance(path.modes, dim)
    rows_q, rows_d = path.query_rows(n, backward=False), path.key_rows(m, backward=False)
    x, y = expansion_points(distance, xq, xd, rows_q, rows_d)
    row_max, row_sum = _run(
        "rbf_kde_density", _kernels("triton").kernel_logsumexp, path, path.fwd,
        dict(x=x, y=y, y_weight=pad_rows(w, rows_d)), distance=distance, valid_l=m,
    )  # fmt: skip
    row_max, row_sum = row_max[:, :n], _floored_sum(row_sum[:, :n], w)
    return _log_sum(row_max, row_sum), (xq, xd, w, row_max, row_sum)


def _log_sum(row_max, row_sum):
    """``log sum_j w_j K_ij`` from the log-sum-exp kernel's ``(m, s)``: ``(m + log2 s) ln 2``."""
    return (row_max + jnp.log2(row_sum)) * LN2


def _floored_sum(row_sum, w):
    """``s`` floored at the smallest positive weight, a lower bound (the largest term is
    ``w * exp2(0)``) that holds even if a compiler rounds that exponent twice, differently."""
    floor = jnp.min(jnp.where(w > 0, w, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(row_sum < floor, floor, row_sum)


def _kde_grad_sweeps(path: PathConfig, distance, x, y, w, row_max, row_sum, g, n, m, scale=None):
    """(query sums, data sums) of the KDE's backward pass, both paths, with pair weights
    ``A_ij = g_i w_j K_ij / S_i`` (query sweep) and ``g_i K_ij / S_i`` (data sweep), formed as
    ``exp2(t_ij - m_i) * (g_i / s_i)``: the same exponents, shift and sum as the forward pass."""
    rows_q = x.shape[-1] if scale is not None else x.shape[1]
    rows_d = y.shape[-1] if scale is not None else y.shape[1]
    # Rows without a finite maximum or sum have no finite pair weights: they get none.
    finite = jnp.isfinite(row_max) & (row_sum > 0)
    shift = pad_rows(jnp.where(finite, -row_max, 0.0), rows_q)
    coef = pad_rows(jnp.where(finite, g.astype(jnp.float32) / row_sum, 0.0), rows_q)
    dots = dict(distance=distance, coords=kde_coords(path.modes))
    by_query = _run(
        "rbf_kde_density", _kernels("triton").kernel_matmul_grad, path, path.dq,
        dict(x=x, y=y, scale=scale, x_offset=shift, x_coef=coef, y_coef=pad_rows(w, rows_d)),
        valid_l=m, with_squares=scale is not None, **dots,
    )  # fmt: skip
    by_data = _run(
        "rbf_kde_density", _kernels("triton").kernel_matmul_grad, path, path.dk,
        dict(x=y, y=x, scale=scale, y_offset=shift, y_coef=coef), valid_l=n,
        with_rowsum=scale is not None, **dots,
    )  # fmt: skip
    return by_query, by_data


def _kde_fast_bwd(path: PathConfig, residuals, g):
    xq, xd, w, row_max, row_sum = residuals
    (_, n, dim), m = xq.shape, xd.shape[1]
    rows_q, rows_d = path.query_rows(n, backward=True), path.key_rows(m, backward=True)
    x, y = augment_queries(xq, rows_q), augment_keys(xd, rows_d)
    distance = backward_distance(path.modes, dim)
    r, c = _kde_grad_sweeps(path, distance, x, y, w, row_max, row_sum, g, n, m)
    # r = [log2e sum_j A xd_j, sum_j A, .] (A = g p), c = [sum_i A xq_i, ., sum_i A].
    r, c = r["sums"], c["sums"]
    dxq = r[:, :n, :dim] / LOG2E - xq * r[:, :n, dim : dim + 1]
    dw = c[:, :m, dim + 1]
    dxd = w[..., None] * (c[:, :m, :dim] - xd * dw[..., None])
    return dxq, dxd, dw


_kde_fast.defvjp(_kde_fast_fwd, _kde_fast_bwd)


# ------------------------------------------------------------------------------------------
# rbf_kde_density, exact path


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _kde_exact(query, data, w, bandwidth, path: PathConfig):
    """``log sum_j w_j exp(-0.5 |(x_i - x_j) / h|^2)`` for float32 ``query: [B, N, D]``,
    ``data: [B, M, D]``, ``w: [B, M]`` and scalar ``bandwidth``, from differences."""
    return _kde_exact_fwd(query, data, w, bandwidth, path)[0]


def _kde_exact_fwd(query, data, w, bandwidth, path: PathConfig):
    (_, n, dim), m = query.shape, data.shape[1]
    distance = forward_distance(path.modes, dim, per_dimension=True, rounded=True)
    rows_q, rows_d = path.query_rows(n, backward=False), path.key_rows(m, backward=False)
    xq, xd, scale, _ = _exact_operands(query, data, bandwidth, rows_q, rows_d, per_dimension=True)
    row_max, row_sum = _run(
        "rbf_kde_density", _kernels("triton").kernel_logsumexp, path, path.fwd,
        dict(x=xq, y=xd, scale=scale, y_weight=pad_rows(w, rows_d)), distance=distance,
        valid_l=m,
    )  # fmt: skip
    row_max, row_sum = row_max[:, :n], _floored_sum(row_sum[:, :n], w)
    return _log_sum(row_max, row_sum), (query, data, w, bandwidth, row_max, row_sum)


def _kde_exact_bwd(path: PathConfig, residuals, g):
    query, data, w, bandwidth, row_max, row_sum = residuals
    (_, n, dim), m = query.shape, data.shape[1]
    rows_q, rows_d = path.query_rows(n, backward=True), path.key_rows(m, backward=True)
    xq, xd, scale, factor = _exact_operands(query, data, bandwidth, rows_q, rows_d,
                                            per_dimension=True)  # fmt: skip
    distance = backward_distance(path.modes, dim, per_dimension=True, rounded=True)
    r, c = _kde_grad_sweeps(path, distance, xq, xd, w, row_max, row_sum, g, n, m, scale)
    dquery = _sliced_transpose(r["sums"], n, dim) * factor
    dw = c["rows"][:, 0, :m]
    ddata = w[..., None] * _sliced_transpose(c["sums"], m, dim) * factor
    # One bandwidth scales every dimension: the per-dimension squares add up.
    dh = jnp.sum(_lengthscale_grad(r, n, dim, bandwidth))
    return dquery, ddata, dw, dh


_kde_exact.defvjp(_kde_exact_fwd, _kde_exact_bwd)


# ------------------------------------------------------------------------------------------
# Entry points: the fast/exact switch


def _switch(cfg: PallasConfig, q, k, scale, fast, exact):
    """``exact()`` for ``"highest"``; otherwise ``fast(qs, ks)`` on centred, scaled points where
    the expansion is within the precision's budget, else ``exact()``."""
    if cfg.fast is None:
        return exact()
    qs, ks = numerics.centered_scaled(q, k, scale)
    ok = numerics.fast_distance_ok(qs, ks, cfg.precision, cfg.kernel)

    def fast_branch():
        # Under vmap both branches run: the fast one gets finite points, so its unused
        # gradient is 0 (selected inside the branch, where XLA may fuse it with the layout).
        return fast(jnp.where(ok, qs, 0.0), jnp.where(ok, ks, 0.0))

    return lax.cond(ok, fast_branch, exact)


# Jitted (also when called eagerly): the distance switch is a lax.cond, which would otherwise
# compile both of its branches again at every call.
@functools.partial(jax.jit, static_argnames=("cfg",))
def kernel_mv(q, k, v, lengthscale, cfg: PallasConfig) -> jax.Array:
    """``rbf_kernel_mv`` for float32 ``q: [B, N, D]``, ``k: [B, M, D]``, ``v: [B, M, O]``."""
    return _switch(
        cfg, q, k, lengthscale,
        fast=lambda qs, ks: _kernel_mv_fast(qs, ks, v, cfg.fast),
        exact=lambda: _kernel_mv_exact(q, k, v, lengthscale, cfg.exact),
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("cfg",))
def kde_log_sum(query, data, weights, bandwidth, cfg: PallasConfig) -> jax.Array:
    """``log sum_j w_j exp(-0.5 |(x_i - x_j) / h|^2)`` as ``[B, N]`` for float32
    ``query: [B, N, D]``, ``data: [B, M, D]``, ``weights: [B, M]`` and scalar ``bandwidth``."""
    return _switch(
        cfg, query, data, bandwidth,
        fast=lambda xq, xd: _kde_fast(xq, xd, weights, cfg.fast),
        exact=lambda: _kde_exact(query, data, weights, bandwidth, cfg.exact),
    )  # fmt: skip


def kernel_mv_with_config(q, k, v, lengthscale, cfg: PallasConfig) -> jax.Array:
    """``rbf_kernel_mv(impl="pallas")`` with explicit settings, for tuning (no validation)."""
    batch_shape, (n, dim), (m, out_dim) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    batch = math.prod(batch_shape)
    out = kernel_mv(
        q.astype(jnp.float32).reshape(batch, n, dim),
        k.astype(jnp.float32).reshape(batch, m, dim),
        v.astype(jnp.float32).reshape(batch, m, out_dim),
        jnp.asarray(lengthscale, jnp.float32),
        cfg,
    )
    return out.reshape(*batch_shape, n, out_dim).astype(jnp.result_type(q, k, v))
