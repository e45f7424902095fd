"""Public RBF entry points: input validation, implementation choice and the custom VJPs.

``rbf_kernel_mv`` and ``rbf_kde_density`` validate their inputs, pick an implementation
(``impl``), and for ``impl="pallas"`` run the fused kernels of ``tilax.rbf.pallas_triton``
through a ``jax.custom_vjp`` whose backward pass is made of Pallas kernels too.

How the Pallas path works
-------------------------
Both point sets are shifted by the mean key (the kernel is translation invariant; the shift is a
constant for autodiff) and divided by the lengthscale, so one kernel serves scalar and per-
dimension (ARD) lengthscales: ``qs = (q - c) / l``, ``ks = (k - c) / l``. The custom VJP is
defined on ``(qs, ks, v)``; JAX's chain rule through the division gives
``d lengthscale = -sum_i qs_i * dqs_i / l - sum_j ks_j * dks_j / l``, an ``O(N + M)`` reduction
and no extra pass over pairs.

The kernels see *augmented* points whose dot product is the base-2 exponent directly::

    x_i = [qs_i,          -0.5 log2(e) |qs_i|^2, 1]
    y_j = [log2(e) ks_j,  1,  -0.5 log2(e) |ks_j|^2 (+ log2 w_j for the KDE)]
    x_i . y_j = -0.5 log2(e) |qs_i - ks_j|^2,          K_ij = exp2(x_i . y_j)

padded with zero columns to ``Dp = max(16, next_power_of_2(D + 2))`` (Triton dots need every
dimension >= 16). The same augmented rows also carry the gradient sums: ``A @ y`` gives
``sum_j A_ij ks_j`` (times log2 e) and the row sum of ``A`` in one dot.
Keys that pad ``M`` to a tile multiple get the exponent ``-1e30``, so they contribute exactly
zero; padded queries are discarded (and have zero cotangent in the backward pass).

Backward of ``out = K @ v`` with cotangent ``g`` and ``A = K * (g @ v.T)``:
``dqs_i = sum_j A_ij (ks_j - qs_i)``, ``dks_j = sum_i A_ij (qs_i - ks_j)``, ``dv = K.T @ g``: one
kernel over query tiles (dq) and one over key tiles (dk and, for ``O <= 64``, dv in the same
sweep; wider ``O`` computes dv with the forward kernel with queries and keys swapped).
Peak memory stays ``O((N + M) * (D + O))`` in both passes.

Second-order derivatives (``jax.hessian``, ``grad`` of ``grad``) of ``impl="pallas"`` raise a
``NotImplementedError`` naming the alternatives: the backward kernels have no derivative rules.
``impl="xla"`` and ``impl="dense"`` are plain JAX and differentiable to any order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tilax import _pallas
from tilax.rbf import pallas_triton, reference

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
# Exponent (base 2) of padded keys: exp2 underflows to exactly 0, and it is finite, so it never
# produces inf - inf or 0 * inf inside the dots.
PAD_EXPONENT = -1e30

IMPLS = ("auto", "pallas", "xla", "dense")
PRECISIONS = ("highest", "high", "default")


@dataclasses.dataclass(frozen=True)
class DotModes:
    """How the kernels multiply (see ``tilax.rbf.pallas_triton``): one mode per kind of dot.

    ``distance``: the augmented-point dot giving each exponent. ``values``: products with the
    values and cotangents (``K @ v``, ``g @ v.T``, ``K.T @ g``). ``coords``: products with
    coordinates in the gradients (``A @ ks``), whose result is differenced with ``qs * rowsum``.
    """

    distance: str
    values: str
    coords: str


#: precision name -> dot modes (see ``tilax.rbf.pallas_triton``). The distance is never a single
#: low-precision pass: its exponent error would grow like eps * |qs|^2, a relative error of the
#: kernel value rather than of the distance. Coordinates are never single bfloat16 either:
#: ``sum_j A_ij ks_j - qs_i sum_j A_ij`` cancels, so their rounding would be amplified.
PRECISION_MODES = {
    "highest": DotModes(distance="ieee", values="ieee", coords="ieee"),
    "high": DotModes(distance="tf32x3", values="bf16x3", coords="bf16x3"),
    "default": DotModes(distance="tf32x3", values="bf16", coords="bf16x3"),
}


@dataclasses.dataclass(frozen=True)
class PallasConfig:
    """Static settings of one Pallas call: backend, dot modes, tiles and Triton launch knobs.

    ``block_q``/``block_k`` tile queries/keys in the forward kernels, ``bwd_block_q``/
    ``bwd_block_k`` in the backward ones (the dk kernel's program tile is ``bwd_block_k`` and its
    loop tile ``bwd_block_q``); ``block_o`` tiles the value columns.
    """

    backend: _pallas.Backend
    modes: DotModes
    block_q: int
    block_k: int
    block_o: int
    bwd_block_q: int
    bwd_block_k: int
    num_warps: int = 4
    num_stages: int = 2
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2


# ------------------------------------------------------------------------------------------
# Default tiles


@functools.cache
def _gpu_sm_count() -> int:
    """Streaming multiprocessors of the first GPU (132 on an H100/H200 SXM when unknown)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _fit_tile(preferred: int, size: int) -> int:
    """``preferred`` shrunk to the problem: never more than ``next_power_of_2(size)``, >= 16."""
    return max(16, min(preferred, _pallas.next_power_of_2(size)))


def _occupancy_tile(preferred: int, size: int, other_programs: int) -> int:
    """Largest tile <= ``preferred`` (down to 32) that still gives >= 2 programs per GPU SM."""
    tile = _fit_tile(preferred, size)
    target = 2 * _gpu_sm_count()
    while tile > 32 and other_programs * (-(-size // tile)) < target:
        tile //= 2
    return tile


def default_config(
    backend: _pallas.Backend,
    precision: str,
    *,
    batch: int,
    n: int,
    m: int,
    out: int,
    block_q: int | None = None,
    block_k: int | None = None,
    block_o: int | None = None,
) -> PallasConfig:
    """The tiles ``rbf_kernel_mv``/``rbf_kde_density`` use unless told otherwise.

    On GPUs (Triton): forward query tile 128 and key tile 64, backward 64 x 64, value tile
    ``min(64, next_power_of_2(O))``, 4 warps and 2 pipeline stages. A query (key) tile shrinks,
    down to 32, while the grid would have fewer than two programs per SM (small ``N`` or ``M``),
    and no tile exceeds the next power of two of its dimension (minimum 16). In interpret mode
    (CPU) every tile is ``min(128, next_power_of_2(size))``: fewer, larger tiles interpret faster.
    Explicit ``block_q``/``block_k`` apply to the forward and backward kernels, ``block_o`` to the
    value columns.
    """
    value_tile = block_o or _fit_tile(64, out)
    if backend == "interpret":
        fwd_q = bwd_q = block_q or _fit_tile(128, n)
        fwd_k = bwd_k = block_k or _fit_tile(128, m)
    else:
        o_tiles = -(-out // value_tile)
        fwd_q = block_q or _occupancy_tile(128, n, batch * o_tiles)
        fwd_k = block_k or _fit_tile(64, m)
        bwd_q = block_q or _occupancy_tile(64, n, batch)
        bwd_k = block_k or _occupancy_tile(64, m, batch)
    return PallasConfig(
        backend=backend,
        modes=PRECISION_MODES[precision],
        block_q=fwd_q,
        block_k=fwd_k,
        block_o=value_tile,
        bwd_block_q=bwd_q,
        bwd_block_k=bwd_k,
    )


# ------------------------------------------------------------------------------------------
# Validation


def _as_float_array(name: str, x: Any) -> jax.Array:
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    _pallas.check_float_array(name, x)
    return x


def _check_points(name: str, x: jax.Array, layout: str) -> None:
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape {layout} (rank >= 2), got shape {x.shape}")


def _check_batch(names: tuple[str, ...], arrays: tuple[jax.Array, ...], core: tuple[int, ...]):
    batches = [a.shape[: a.ndim - c] for a, c in zip(arrays, core, strict=True)]
    if any(b != batches[0] for b in batches):
        described = ", ".join(
            f"{n} has shape {a.shape} (batch {b})"
            for n, a, b in zip(names, arrays, batches, strict=True)
        )
        joined = ", ".join(names)
        raise ValueError(f"{joined} must share their leading batch dimensions: {described}")


def _concrete_value(x: jax.Array) -> np.ndarray | None:
    """The value of ``x`` as NumPy, or ``None`` when it is a tracer (under jit, vmap, grad)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _check_scale(name: str, scale: Any, dim: int, *, per_dimension: bool) -> jax.Array:
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = float(scale)
    scale = _as_float_array(name, scale)
    allowed = [()] + ([(dim,)] if per_dimension else [])
    if scale.shape not in allowed:
        expected = f"a scalar or shape ({dim},) (one per input dimension)" if per_dimension else (
            "a scalar (shape ())"
        )
        raise ValueError(f"{name} must be {expected}, got shape {scale.shape}")
    value = _concrete_value(scale)
    if value is not None and not np.all(value > 0):
        raise ValueError(f"{name} must be positive, got {value}")
    return scale


def _check_block(name: str, block: Any) -> None:
    if block is None:
        return
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise TypeError(f"{name} must be an int (a power of two >= 16) or None, got {block!r}")
    if block < 16 or block & (block - 1):
        raise ValueError(
            f"{name} must be a power of two >= 16 (Triton dots need every dimension >= 16), "
            f"got {block}"
        )


def _resolve_impl(impl: Any, dtype: jnp.dtype) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    # float64 stays float64 on the XLA path; the kernels compute in float32.
    return "pallas" if _pallas.platform() == "gpu" and dtype != jnp.float64 else "xla"


def _resolve_precision(precision: Any, dtype: jnp.dtype) -> str:
    if precision is None:
        return "default" if dtype in (jnp.bfloat16, jnp.float16) else "high"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
    return precision


# ------------------------------------------------------------------------------------------
# Augmented points and padding


def _pad_rows_cols(x: jax.Array, rows: int, cols: int) -> jax.Array:
    return jnp.pad(x, [(0, 0), (0, rows - x.shape[1]), (0, cols - x.shape[2])])


def _layout(x: jax.Array, *, parts: bool, first: bool) -> jax.Array:
    """Augmented ``[B, R, D + 2]`` points as a kernel operand: TF32 parts, or zero-padded to
    ``max(16, next_power_of_2(D + 2))`` columns (Triton dots need every dimension >= 16)."""
    if parts:
        return pallas_triton.tf32x3_parts(x, first=first)
    width = max(16, _pallas.next_power_of_2(x.shape[-1]))
    return _pad_rows_cols(x, x.shape[1], width)


def _augment_queries(
    qs: jax.Array, rows: int, *, shift: jax.Array | None = None, parts: bool = False
) -> jax.Array:
    """``[qs, -0.5 log2e |qs|^2 - shift, 1]`` with zero rows up to ``rows``."""
    alpha = -0.5 * LOG2E * jnp.sum(qs * qs, axis=-1)
    if shift is not None:
        alpha = alpha - shift
    x = jnp.concatenate([qs, alpha[..., None], jnp.ones_like(alpha)[..., None]], axis=-1)
    return _layout(_pad_rows_cols(x, rows, x.shape[2]), parts=parts, first=True)


def _augment_keys(
    ks: jax.Array, rows: int, *, log2_weights: jax.Array | None = None, parts: bool = False
) -> jax.Array:
    """``[log2e ks, 1, -0.5 log2e |ks|^2 + log2 w]`` with rows ``[0, 1, -1e30]`` up to ``rows``:
    padding keys have the exponent ``-1e30`` for every query, so they contribute exactly 0."""
    batch, m, dim = ks.shape
    beta = -0.5 * LOG2E * jnp.sum(ks * ks, axis=-1)
    if log2_weights is not None:
        beta = beta + log2_weights
    y = jnp.concatenate([LOG2E * ks, jnp.ones_like(beta)[..., None], beta[..., None]], axis=-1)
    pad_row = jnp.zeros((dim + 2,), y.dtype).at[dim].set(1.0).at[dim + 1].set(PAD_EXPONENT)
    y = jnp.concatenate([y, jnp.broadcast_to(pad_row, (batch, rows - m, dim + 2))], axis=1)
    return _layout(y, parts=parts, first=False)


def _forward_distance(modes: DotModes) -> tuple[bool, str]:
    """Forward kernels read TF32 parts from memory (one dot, no adds); returns (parts, mode)."""
    if modes.distance == "tf32x3":
        return True, "tf32_parts"
    return False, modes.distance


_SECOND_ORDER_MESSAGE = (
    "{name}(impl='pallas') supports first-order derivatives only: its backward pass is itself "
    "a Pallas kernel without derivative rules. For Hessians or other higher-order derivatives "
    "use impl='xla' (memory-light, differentiable to any order) or impl='dense'."
)


def _first_order_only(name: str, fn):
    """``fn`` whose derivatives raise a clear error instead of differentiating the kernels."""
    wrapped = jax.custom_jvp(fn)

    def no_jvp(primals, tangents):
        raise NotImplementedError(_SECOND_ORDER_MESSAGE.format(name=name))

    wrapped.defjvp(no_jvp)
    return wrapped


def _kernels(name: str, cfg: PallasConfig, *, backward: bool):
    """The three kernel launchers bound to ``cfg``'s static settings, guarded for 2nd order."""
    launch = dict(
        backend=cfg.backend,
        num_warps=cfg.bwd_num_warps if backward else cfg.num_warps,
        num_stages=cfg.bwd_num_stages if backward else cfg.num_stages,
    )
    matmul = functools.partial(pallas_triton.kernel_matmul, **launch)
    grad = functools.partial(pallas_triton.kernel_matmul_grad, **launch)
    logsumexp = functools.partial(pallas_triton.kernel_logsumexp, **launch)

    def guarded(fn):
        def call(*arrays, **static):
            return _first_order_only(name, functools.partial(fn, **static))(*arrays)

        return call

    return guarded(matmul), guarded(grad), guarded(logsumexp)


# ------------------------------------------------------------------------------------------
# rbf_kernel_mv: Pallas path with its custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel_mv_pallas(qs, ks, v, cfg: PallasConfig):
    """``exp(-0.5 |qs_i - ks_j|^2) @ v`` for ``qs: [B, N, D]``, ``ks: [B, M, D]``, ``v: [B, M, O]``.

    The custom VJP's primal: every input is float32 and already centred and scaled.
    """
    return _kernel_mv_pallas_fwd(qs, ks, v, cfg)[0]


def _kernel_mv_pallas_fwd(qs, ks, v, cfg: PallasConfig):
    n, m, out_dim = qs.shape[1], ks.shape[1], v.shape[2]
    matmul, _, _ = _kernels("rbf_kernel_mv", cfg, backward=False)
    parts, distance = _forward_distance(cfg.modes)
    rows_k = _pallas.round_up(m, cfg.block_k)
    out = matmul(
        _augment_queries(qs, _pallas.round_up(n, cfg.block_q), parts=parts),
        _augment_keys(ks, rows_k, parts=parts),
        _pad_rows_cols(v, rows_k, _pallas.round_up(out_dim, cfg.block_o)),
        block_p=cfg.block_q,
        block_l=cfg.block_k,
        block_o=cfg.block_o,
        distance=distance,
        values=cfg.modes.values,
    )
    return out[:, :n, :out_dim], (qs, ks, v)


def _kernel_mv_pallas_bwd(cfg: PallasConfig, residuals, g):
    qs, ks, v = residuals
    (_, n, dim), m, out_dim = qs.shape, ks.shape[1], v.shape[2]
    matmul, grad, _ = _kernels("rbf_kernel_mv", cfg, backward=True)
    rows_q = _pallas.round_up(n, cfg.bwd_block_q)
    rows_k = _pallas.round_up(m, cfg.bwd_block_k)
    cols = _pallas.round_up(out_dim, cfg.block_o)
    x = _augment_queries(qs, rows_q)
    y = _augment_keys(ks, rows_k)
    g_pad = _pad_rows_cols(g.astype(jnp.float32), rows_q, cols)
    v_pad = _pad_rows_cols(v, rows_k, cols)
    modes = cfg.modes
    dots = dict(block_o=cfg.block_o, distance=modes.distance, values=modes.values)
    r = grad(
        x, y, g_pad, v_pad,
        with_pw=False, block_p=cfg.bwd_block_q, block_l=cfg.bwd_block_k, coords=modes.coords,
        **dots,
    )  # fmt: skip
    # dv = K.T @ g rides along in the dk sweep while its accumulator fits in registers.
    fuse_dv = cols <= 64
    c = grad(
        y, x, v_pad, g_pad,
        with_pw=fuse_dv, block_p=cfg.bwd_block_k, block_l=cfg.bwd_block_q, coords=modes.coords,
        **dots,
    )  # fmt: skip
    if fuse_dv:
        c, dv = c
    else:
        dv = matmul(y, x, g_pad, block_p=cfg.bwd_block_k, block_l=cfg.bwd_block_q, **dots)
    dqs = r[:, :n, :dim] / LOG2E - qs * r[:, :n, dim : dim + 1]
    dks = c[:, :m, :dim] - ks * c[:, :m, dim + 1 : dim + 2]
    return dqs, dks, dv[:, :m, :out_dim]


_kernel_mv_pallas.defvjp(_kernel_mv_pallas_fwd, _kernel_mv_pallas_bwd)


# ------------------------------------------------------------------------------------------
# rbf_kde_density: Pallas path with its custom VJP


def _log2_weights(w: jax.Array) -> jax.Array:
    return jnp.where(w > 0, jnp.log2(jnp.where(w > 0, w, 1.0)), PAD_EXPONENT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kde_log_sum_pallas(xq, xd, w, cfg: PallasConfig):
    """``log sum_j w_j exp(-0.5 |xq_i - xd_j|^2)`` for ``xq: [B, N, D]``, ``xd: [B, M, D]``."""
    return _kde_log_sum_pallas_fwd(xq, xd, w, cfg)[0]


def _kde_log_sum_pallas_fwd(xq, xd, w, cfg: PallasConfig):
    n, m = xq.shape[1], xd.shape[1]
    _, _, logsumexp = _kernels("rbf_kde_density", cfg, backward=False)
    parts, distance = _forward_distance(cfg.modes)
    log2_sum = logsumexp(
        _augment_queries(xq, _pallas.round_up(n, cfg.block_q), parts=parts),
        _augment_keys(
            xd, _pallas.round_up(m, cfg.block_k), log2_weights=_log2_weights(w), parts=parts
        ),
        block_p=cfg.block_q,
        block_l=cfg.block_k,
        distance=distance,
    )[:, :n]
    return log2_sum * LN2, (xq, xd, w, log2_sum)


def _kde_log_sum_pallas_bwd(cfg: PallasConfig, residuals, g):
    """With ``p_ij = w_j K_ij / S_i`` (``S_i`` the sum): ``dxq_i = g_i sum_j p_ij (xd_j - xq_i)``,
    ``dxd_j = w_j sum_i g_i (K_ij / S_i) (xq_i - xd_j)``, ``dw_j = sum_i g_i K_ij / S_i``.

    Both sweeps are the forward ``kernel_matmul`` on augmented points whose exponent already
    subtracts ``log2 S_i``, with coordinates (and a ones column for the row sums) as values.
    """
    xq, xd, w, log2_sum = residuals
    (_, n, dim), m = xq.shape, xd.shape[1]
    matmul, _, _ = _kernels("rbf_kde_density", cfg, backward=True)
    rows_q = _pallas.round_up(n, cfg.bwd_block_q)
    rows_d = _pallas.round_up(m, cfg.bwd_block_k)
    value_tile = _fit_tile(64, dim + 1)
    cols = _pallas.round_up(dim + 1, value_tile)
    dots = dict(block_o=value_tile, distance=cfg.modes.distance, values=cfg.modes.coords)
    x = _augment_queries(xq, rows_q, shift=log2_sum)
    g = g.astype(jnp.float32)

    def with_ones(points):
        return jnp.concatenate([points, jnp.ones_like(points[..., :1])], axis=-1)

    weighted = matmul(
        x, _augment_keys(xd, rows_d, log2_weights=_log2_weights(w)),
        _pad_rows_cols(with_ones(xd), rows_d, cols),
        block_p=cfg.bwd_block_q, block_l=cfg.bwd_block_k, **dots,
    )[:, :n]  # fmt: skip
    dxq = g[..., None] * (weighted[..., :dim] - xq * weighted[..., dim : dim + 1])
    by_data = matmul(
        _augment_keys(xd, rows_d), x, _pad_rows_cols(g[..., None] * with_ones(xq), rows_q, cols),
        block_p=cfg.bwd_block_k, block_l=cfg.bwd_block_q, **dots,
    )[:, :m]  # fmt: skip
    dw = by_data[..., dim]
    dxd = jnp.where(w[..., None] > 0, w[..., None] * (by_data[..., :dim] - xd * dw[..., None]), 0.0)
    return dxq, dxd, dw


_kde_log_sum_pallas.defvjp(_kde_log_sum_pallas_fwd, _kde_log_sum_pallas_bwd)


# ------------------------------------------------------------------------------------------
# Public functions


def rbf_kernel_mv(
    q,
    k,
    v,
    lengthscale,
    *,
    impl: str = "auto",
    precision: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    block_o: int | None = None,
) -> jax.Array:
    r"""RBF (Gaussian) kernel matrix times values, without materialising the kernel matrix.

    Computes ``out[..., i, o] = sum_j exp(-0.5 * sum_d ((q[i, d] - k[j, d]) / l[d])**2) * v[j, o]``.

    Args:
      q: queries, shape ``[..., N, D]``.
      k: keys, shape ``[..., M, D]`` (same leading batch dimensions and ``D`` as ``q``).
      v: values, shape ``[..., M, O]``.
      lengthscale: positive scalar, or shape ``[D]`` for one lengthscale per input dimension
        (ARD). Its gradient has the same shape.
      impl: ``"auto"`` (default: ``"pallas"`` on GPU, ``"xla"`` on CPU and for float64 inputs),
        ``"pallas"`` (fused tiled kernel; Triton on GPU, interpret mode on CPU, which is slow and
        meant for tests), ``"xla"`` (plain XLA in chunks of queries, memory ``O((N + M) * chunk)``,
        differentiable to any order) or ``"dense"`` (materialises the ``N x M`` matrix).
      precision: how the Pallas kernels multiply; accumulation is always float32. Relative
        errors vs float64 below were measured in interpret mode, which reproduces the GPU's
        roundings (N = M = 512, D = 8, O = 16, points N(5, 2^2) per dimension, lengthscales
        0.8-1.6); ``tests/rbf/gpu_timing.py`` prints the GPU numbers.

        * ``"highest"``: every dot in IEEE float32 on the FMA units, no tensor cores. Output and
          gradients ~1e-6. Several times slower than ``"high"``.
        * ``"high"`` (default for float32 and float64 inputs): distances from 3-pass TF32 dots
          (operands split into TF32 ``hi + lo``, float32-accurate), value and gradient products
          from 3-pass bfloat16 dots (``hi + lo`` parts, ~2**-16 per product). Output ~5e-6,
          gradients 1e-5 to 3e-5. The default because every product runs on tensor cores
          while the result stays close to float32: the kernel is then limited by ``exp``
          throughput, and the splits cost a few instructions per pair.
        * ``"default"`` (default for bfloat16 and float16 inputs): as ``"high"`` but the value
          products in single bfloat16 (8-bit mantissa): output and gradients ~3e-3. Fastest.

        Distances are never computed in a single low-precision pass: the expansion
        ``|q|^2 + |k|^2 - 2 q.k`` would turn its rounding into a relative error of the kernel
        value. ``impl="xla"``/``"dense"`` use ``HIGHEST`` dots for distances, and for the
        value product ``HIGHEST`` with ``"highest"``, else XLA's default (TF32 on recent GPUs).
      block_q, block_k, block_o: tile sizes of queries, keys and value columns (powers of two
        >= 16) for ``impl="pallas"``; ``None`` picks them per problem and device (see
        ``default_config``: on GPUs 128 x 64 forward, 64 x 64 backward, value tile
        ``min(64, O)``).

    Returns:
      ``[..., N, O]`` in the result dtype of ``q``, ``k`` and ``v`` (bfloat16 in, bfloat16 out).
      Empty ``M`` gives zeros, empty ``N`` or ``O`` an empty array.

    Raises:
      TypeError: an input is not a real floating-point array (integer, bool, complex), or a
        block size is not an int.
      ValueError: wrong ranks, mismatched batch or feature dimensions, ``v`` rows not matching
        ``k``, a lengthscale of the wrong shape or (when concrete) not positive, an unknown
        ``impl`` or ``precision``, a block size that is not a power of two >= 16.
      NotImplementedError: second-order differentiation of ``impl="pallas"`` (use ``"xla"``).

    Example:
      >>> import jax, jax.numpy as jnp, tilax
      >>> q = jax.random.normal(jax.random.key(0), (1000, 3))
      >>> k = jax.random.normal(jax.random.key(1), (2000, 3))
      >>> v = jax.random.normal(jax.random.key(2), (2000, 4))
      >>> out = tilax.rbf_kernel_mv(q, k, v, jnp.array([0.5, 1.0, 2.0]))
      >>> out.shape
      (1000, 4)
      >>> grad_l = jax.grad(lambda l: tilax.rbf_kernel_mv(q, k, v, l).sum())(1.0)
    """
    q = _as_float_array("q", q)
    k = _as_float_array("k", k)
    v = _as_float_array("v", v)
    _check_points("q", q, "[..., N, D]")
    _check_points("k", k, "[..., M, D]")
    _check_points("v", v, "[..., M, O]")
    _check_batch(("q", "k", "v"), (q, k, v), (2, 2, 2))
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same feature dimension D: q has shape {q.shape} "
            f"(D={q.shape[-1]}), k has shape {k.shape} (D={k.shape[-1]})"
        )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"v must have one row per key: k has shape {k.shape} (M={k.shape[-2]}), "
            f"v has shape {v.shape} (expected [..., {k.shape[-2]}, O])"
        )
    dim = q.shape[-1]
    lengthscale = _check_scale("lengthscale", lengthscale, dim, per_dimension=True)
    for name, block in (("block_q", block_q), ("block_k", block_k), ("block_o", block_o)):
        _check_block(name, block)
    out_dtype = jnp.result_type(q, k, v)
    impl = _resolve_impl(impl, out_dtype)
    precision = _resolve_precision(precision, out_dtype)

    batch_shape, (n, m, out_dim) = q.shape[:-2], (q.shape[-2], k.shape[-2], v.shape[-1])
    if m == 0 or n == 0 or out_dim == 0 or math.prod(batch_shape) == 0:
        return jnp.zeros((*batch_shape, n, out_dim), out_dtype)
    if impl == "dense":
        return reference.kernel_mv_dense(q, k, v, lengthscale, precision=precision)
    if impl == "xla":
        return reference.kernel_mv_xla(q, k, v, lengthscale, precision=precision)

    batch = math.prod(batch_shape)
    cfg = default_config(
        _pallas.resolve_backend("pallas"), precision, batch=batch, n=n, m=m, out=out_dim,
        block_q=block_q, block_k=block_k, block_o=block_o,
    )  # fmt: skip
    return kernel_mv_with_config(q, k, v, lengthscale, cfg)


def kernel_mv_with_config(q, k, v, lengthscale, cfg: PallasConfig) -> jax.Array:
    """``rbf_kernel_mv(impl="pallas")`` with explicit settings, for tuning (no validation)."""
    batch_shape, n, dim = q.shape[:-2], q.shape[-2], q.shape[-1]
    m, out_dim = k.shape[-2], v.shape[-1]
    qs, ks = reference.centered_scaled(q, k, lengthscale)
    batch = math.prod(batch_shape)
    out = _kernel_mv_pallas(
        qs.astype(jnp.float32).reshape(batch, n, dim),
        ks.astype(jnp.float32).reshape(batch, m, dim),
        v.astype(jnp.float32).reshape(batch, m, out_dim),
        cfg,
    )
    return out.reshape(*batch_shape, n, out_dim).astype(jnp.result_type(q, k, v))


def rbf_kde_density(
    query,
    data,
    bandwidth,
    *,
    weights=None,
    log: bool = False,
    impl: str = "auto",
    precision: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    r"""Normalised Gaussian kernel density estimate, optionally weighted, or its logarithm.

    ``p(x_i) = sum_j w_j (2 pi h^2)^(-D/2) exp(-||x_i - x_j||^2 / (2 h^2))`` with the weights
    normalised to sum to one (uniform ``1/M`` by default).

    Args:
      query: evaluation points, shape ``[..., N, D]``.
      data: sample points, shape ``[..., M, D]`` (same batch dimensions and ``D``).
      bandwidth: positive scalar ``h``.
      weights: optional non-negative ``[..., M]`` (not all zero); normalised to sum to one over
        ``M``. Gradients flow to them (through the normalisation).
      log: return ``log p(x)``. The Pallas kernel always runs a streaming log-sum-exp (running
        maximum and rescaled sum per query), so the log density is finite and accurate far from
        all data, where ``p(x)`` itself underflows to 0; ``log=False`` exponentiates it.
      impl: as in ``rbf_kernel_mv`` (``"auto"``: Pallas on GPU, XLA on CPU or for float64).
      precision: as in ``rbf_kernel_mv``. The KDE has no value product, so ``"high"`` and
        ``"default"`` coincide: distances in 3-pass TF32, backward sums in 3-pass bfloat16
        (log density ~2e-7 relative, gradients ~1e-5); ``"highest"``: IEEE float32 (~1e-6).
      block_q, block_k: tile sizes (powers of two >= 16) for ``impl="pallas"``.

    Returns:
      ``[..., N]`` in the result dtype of ``query`` and ``data``. Empty ``M`` gives density 0
      (log: ``-inf``); empty ``N`` an empty array.

    Raises:
      TypeError: non-floating inputs (integer, bool, complex) or a non-int block size.
      ValueError: wrong ranks, mismatched batch or feature dimensions, ``weights`` not of shape
        ``[..., M]``, a non-scalar bandwidth, and, when the values are concrete, a bandwidth
        that is not positive or weights that are negative or all zero; unknown ``impl`` or
        ``precision``; bad block sizes.
      NotImplementedError: second-order differentiation of ``impl="pallas"``.

    Example:
      >>> import jax, tilax
      >>> data = jax.random.normal(jax.random.key(0), (5000, 2))
      >>> grid = jax.random.uniform(jax.random.key(1), (100, 2), minval=-40.0, maxval=40.0)
      >>> log_p = tilax.rbf_kde_density(grid, data, 0.3, log=True)  # finite everywhere
      >>> log_p.shape
      (100,)
    """
    query = _as_float_array("query", query)
    data = _as_float_array("data", data)
    _check_points("query", query, "[..., N, D]")
    _check_points("data", data, "[..., M, D]")
    _check_batch(("query", "data"), (query, data), (2, 2))
    if query.shape[-1] != data.shape[-1]:
        raise ValueError(
            f"query and data must have the same feature dimension D: query has shape "
            f"{query.shape} (D={query.shape[-1]}), data has shape {data.shape} (D={data.shape[-1]})"
        )
    bandwidth = _check_scale("bandwidth", bandwidth, query.shape[-1], per_dimension=False)
    batch_shape, (n, dim), m = query.shape[:-2], query.shape[-2:], data.shape[-2]
    if weights is not None:
        weights = _as_float_array("weights", weights)
        if weights.shape != (*batch_shape, m):
            raise ValueError(
                f"weights must have shape [..., M] = {(*batch_shape, m)} to match data of shape "
                f"{data.shape}, got shape {weights.shape}"
            )
        value = _concrete_value(weights)
        if value is not None and np.any(value < 0):
            raise ValueError(f"weights must be non-negative, got minimum {value.min()}")
        if value is not None and m > 0 and np.any(np.sum(value, axis=-1) <= 0):
            raise ValueError("weights must not be all zero (over M, for every batch entry)")
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        _check_block(name, block)
    out_dtype = jnp.result_type(query, data)
    impl = _resolve_impl(impl, out_dtype)
    precision = _resolve_precision(precision, out_dtype)

    if m == 0 or n == 0 or math.prod(batch_shape) == 0:
        return jnp.full((*batch_shape, n), -jnp.inf if log else 0.0, out_dtype)
    dtype = reference.compute_dtype(query, data)
    if weights is None:
        weights = jnp.full((*batch_shape, m), 1.0 / m, dtype)
    else:
        weights = weights.astype(dtype)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if impl == "dense":
        return reference.kde_density_dense(query, data, bandwidth, weights, log=log)
    if impl == "xla":
        return reference.kde_density_xla(query, data, bandwidth, weights, log=log)

    batch = math.prod(batch_shape)
    cfg = default_config(
        _pallas.resolve_backend("pallas"), precision, batch=batch, n=n, m=m, out=dim + 1,
        block_q=block_q, block_k=block_k,
    )  # fmt: skip
    xq, xd = reference.centered_scaled(query, data, bandwidth, dtype)
    log_sum = _kde_log_sum_pallas(
        xq.astype(jnp.float32).reshape(batch, n, dim),
        xd.astype(jnp.float32).reshape(batch, m, dim),
        weights.astype(jnp.float32).reshape(batch, m),
        cfg,
    ).reshape(*batch_shape, n)
    log_norm = -0.5 * dim * math.log(2.0 * math.pi) - dim * jnp.log(bandwidth.astype(jnp.float32))
    log_p = log_sum + log_norm
    return (log_p if log else jnp.exp(log_p)).astype(out_dtype)
