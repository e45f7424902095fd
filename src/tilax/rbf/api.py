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
dimension >= 16). The forward kernels instead read them pre-split into TF32 parts
(``pallas_triton.tf32x3_parts``, ``3 (D + 2)`` columns padded to a power of two): the float32-
accurate distance is then one TF32 tensor-core dot. The backward kernels split in registers
(memory stays lower), and the same augmented rows carry the gradient sums: ``A @ y`` gives
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
    coordinates in the gradients (``A @ ks``), whose result is differenced with
    ``qs * rowsum``. Mode names as in ``pallas_triton.DOT_MODES``.
    """

    distance: str
    values: str
    coords: str


#: precision name -> dot modes (see ``tilax.rbf.pallas_triton``); ``precision=None`` means
#: ``"default"``. The distance is never a single low-precision pass: its exponent error would
#: grow like eps * |qs|^2, a relative error of the kernel value rather than of the distance.
#: Coordinates are never single bfloat16 either: ``sum_j A_ij ks_j - qs_i sum_j A_ij`` cancels,
#: so their rounding would be amplified.
#:
#: Why ``"default"`` is the default: on an H200 (jax 0.11.2, N = M = 65536, D = 8, O = 16,
#: float32; forward / forward+backward) it took 2.93 / 12.65 ms at ~2.5e-3 relative error (worst
#: gradient 2.9e-3), against 4.08 / 16.41 ms for ``"high"`` (~1e-5) and 24.77 / 77.84 ms for
#: chunked XLA, with the GPU launches below. Also measured there, and slower: a one-sweep fused
#: backward (dq by atomics; 16-19 ms fwd+bwd), exponents from coordinate differences on the FMA
#: units instead of the TF32 dot (6.5-7 / 25-38 ms) and single-TF32 coordinate products.
PRECISION_MODES = {
    "highest": DotModes(distance="ieee", values="ieee", coords="ieee"),
    "high": DotModes(distance="tf32x3", values="bf16x3", coords="bf16x3"),
    "default": DotModes(distance="tf32x3", values="bf16", coords="bf16x3"),
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel's tiles and Triton launch settings.

    ``block_p``: rows of the point set one program owns (its grid axis); ``block_l``: rows of
    the other point set per step of the in-kernel loop.
    """

    block_p: int
    block_l: int
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class PallasConfig:
    """Static settings of the Pallas path: backend, dot modes, value tile and three launches.

    ``fwd`` is the forward kernel (programs over query tiles, loop over key tiles; the KDE's
    log-sum-exp too), ``dq`` the query-gradient kernel (the same roles) and ``dk`` the key-
    gradient kernel (programs over *key* tiles, loop over query tiles; also dv). ``block_o``
    tiles the value columns.
    """

    backend: _pallas.Backend
    modes: DotModes
    block_o: int
    fwd: Launch
    dq: Launch
    dk: Launch

    def query_rows(self, n: int, *, backward: bool) -> int:
        """``n`` padded to every query tile of the pass."""
        if not backward:
            return _pallas.round_up(n, self.fwd.block_p)
        return _pallas.round_up(n, max(self.dq.block_p, self.dk.block_l))

    def key_rows(self, m: int, *, backward: bool) -> int:
        """``m`` padded to every key tile of the pass."""
        if not backward:
            return _pallas.round_up(m, self.fwd.block_l)
        return _pallas.round_up(m, max(self.dq.block_l, self.dk.block_p))


#: Preferred GPU launches on large problems, the best of the H200 tile sweeps: forward (programs
#: over query tiles) and both backward kernels (dq over query tiles, dk over key tiles).
GPU_FWD_LAUNCH = Launch(128, 32, num_warps=4, num_stages=2)
GPU_BWD_LAUNCH = Launch(64, 128, num_warps=4, num_stages=3)


# ------------------------------------------------------------------------------------------
# Default tiles


@functools.cache
def _gpu_sm_count() -> int:
    """Streaming multiprocessors of the first GPU (132 on an H100/H200 SXM when unknown)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _fit_tile(preferred: int, size: int) -> int:
    """``preferred`` shrunk to the problem: never more than ``next_power_of_2(size)``, >= 16."""
    return max(16, min(preferred, _pallas.next_power_of_2(size)))


def _occupancy_tile(preferred: int, size: int, other_programs: int, smallest: int) -> int:
    """Largest tile <= ``preferred`` (down to ``smallest``) giving >= 2 programs per GPU SM."""
    tile = _fit_tile(preferred, size)
    target = 2 * _gpu_sm_count()
    while tile > smallest and other_programs * (-(-size // tile)) < target:
        tile //= 2
    return tile


def default_config(
    backend: _pallas.Backend,
    precision: str | None,
    *,
    batch: int,
    n: int,
    m: int,
    out: int,
    block_q: int | None = None,
    block_k: int | None = None,
    block_o: int | None = None,
) -> PallasConfig:
    """The settings ``rbf_kernel_mv``/``rbf_kde_density`` use unless told otherwise.

    ``precision`` names the dot modes (``PRECISION_MODES``; ``None`` is ``"default"``). On GPUs
    (Triton) the launches start from ``GPU_FWD_LAUNCH`` and ``GPU_BWD_LAUNCH``; a program tile
    halves while the grid would have fewer than two programs per SM (small ``N`` or ``M``), down
    to 32 rows forward and 64 backward (below 64 rows the backward loses the Hopper tensor-core
    path), and no tile exceeds the next power of two of its dimension (min 16); value tile
    ``min(64, next_power_of_2(O))``. In interpret mode (CPU) every tile is
    ``min(128, next_power_of_2(size))``: fewer, larger tiles interpret faster. Explicit
    ``block_q``/``block_k`` set the query/key tiles of all three kernels, ``block_o`` the value
    tile.
    """
    modes = PRECISION_MODES[precision or "default"]
    value_tile = block_o or _fit_tile(64, out)
    if backend == "interpret":
        q_tile = block_q or _fit_tile(128, n)
        k_tile = block_k or _fit_tile(128, m)
        fwd = dq = Launch(q_tile, k_tile)
        dk = Launch(k_tile, q_tile)
    else:
        o_tiles = -(-out // value_tile)
        pf, pb = GPU_FWD_LAUNCH, GPU_BWD_LAUNCH
        fwd = dataclasses.replace(
            pf,
            block_p=block_q or _occupancy_tile(pf.block_p, n, batch * o_tiles, 32),
            block_l=block_k or _fit_tile(pf.block_l, m),
        )
        dq = dataclasses.replace(
            pb,
            block_p=block_q or _occupancy_tile(pb.block_p, n, batch, 64),
            block_l=block_k or _fit_tile(pb.block_l, m),
        )
        dk = dataclasses.replace(
            pb,
            block_p=block_k or _occupancy_tile(pb.block_p, m, batch, 64),
            block_l=block_q or _fit_tile(pb.block_l, n),
        )
    return PallasConfig(backend=backend, modes=modes, block_o=value_tile, fwd=fwd, dq=dq, dk=dk)


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
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


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


def _resolve_precision(precision: Any) -> str | None:
    """The precision name (``None``: the default, as ``"default"``)."""
    if precision is None:
        return None
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


def _value_operand(a: jax.Array, modes: DotModes) -> jax.Array:
    """Values and cotangents as the kernels read them: stored in bfloat16 when every product
    with them rounds to bfloat16 anyway (the same numbers, half the bytes moved per tile)."""
    return a.astype(jnp.bfloat16) if modes.values == "bf16" else a


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


def _launcher(name: str, kernel, cfg: PallasConfig, launch: Launch):
    """``kernel`` bound to ``cfg``'s backend and ``launch``'s tiles, guarded for 2nd order."""
    static = dict(
        backend=cfg.backend,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        block_p=launch.block_p,
        block_l=launch.block_l,
    )

    def call(*arrays, **options):
        return _first_order_only(name, functools.partial(kernel, **static, **options))(*arrays)

    return call


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
    matmul = _launcher("rbf_kernel_mv", pallas_triton.kernel_matmul, cfg, cfg.fwd)
    parts, distance = _forward_distance(cfg.modes)
    rows_k = cfg.key_rows(m, backward=False)
    # Padded keys have the -1e30 exponent (and zero values): they contribute exactly 0.
    out = matmul(
        _augment_queries(qs, cfg.query_rows(n, backward=False), parts=parts),
        _augment_keys(ks, rows_k, parts=parts),
        _value_operand(
            _pad_rows_cols(v, rows_k, _pallas.round_up(out_dim, cfg.block_o)), cfg.modes
        ),
        block_o=cfg.block_o,
        distance=distance,
        values=cfg.modes.values,
    )
    return out[:, :n, :out_dim], (qs, ks, v)


def _kernel_mv_pallas_bwd(cfg: PallasConfig, residuals, g):
    qs, ks, v = residuals
    n, m, out_dim = qs.shape[1], ks.shape[1], v.shape[2]
    modes = cfg.modes
    # Padded queries have zero cotangents and padded keys zero values: their A_ij are 0.
    rows_q, rows_k = cfg.query_rows(n, backward=True), cfg.key_rows(m, backward=True)
    cols = _pallas.round_up(out_dim, cfg.block_o)
    x = _augment_queries(qs, rows_q)
    y = _augment_keys(ks, rows_k)
    g_pad = _value_operand(_pad_rows_cols(g.astype(jnp.float32), rows_q, cols), modes)
    v_pad = _value_operand(_pad_rows_cols(v, rows_k, cols), modes)
    dots = dict(block_o=cfg.block_o, distance=modes.distance, values=modes.values)
    grad_q = _launcher("rbf_kernel_mv", pallas_triton.kernel_matmul_grad, cfg, cfg.dq)
    grad_k = _launcher("rbf_kernel_mv", pallas_triton.kernel_matmul_grad, cfg, cfg.dk)
    r = grad_q(x, y, g_pad, v_pad, with_pw=False, coords=modes.coords, **dots)
    # dv = K.T @ g rides along in the dk sweep while its accumulator fits in registers.
    fuse_dv = cols <= 64
    c = grad_k(y, x, v_pad, g_pad, with_pw=fuse_dv, coords=modes.coords, **dots)
    if fuse_dv:
        c, dv = c
    else:
        dv_kernel = _launcher("rbf_kernel_mv", pallas_triton.kernel_matmul, cfg, cfg.dk)
        dv = dv_kernel(y, x, g_pad, **dots)
    return _kernel_mv_grads(qs, ks, r, c, dv, out_dim)


def _kernel_mv_grads(qs, ks, r, c, dv, out_dim):
    """``(dqs, dks, dv)`` from the kernels' row sums (see the module docstring)."""
    (_, n, dim), m = qs.shape, ks.shape[1]
    dqs = r[:, :n, :dim] / LOG2E - qs * r[:, :n, dim : dim + 1]
    dks = c[:, :m, :dim] - ks * c[:, :m, dim + 1 : dim + 2]
    return dqs, dks, dv[:, :m, :out_dim]


_kernel_mv_pallas.defvjp(_kernel_mv_pallas_fwd, _kernel_mv_pallas_bwd)


# ------------------------------------------------------------------------------------------
# rbf_kde_density: Pallas path with its custom VJP


def _log2_weights(w: jax.Array) -> jax.Array:
    """``log2 w``, with zero weights at the padding exponent (they contribute exactly 0)."""
    return jnp.where(w == 0, PAD_EXPONENT, jnp.log2(jnp.where(w == 0, 1.0, w)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kde_log_sum_pallas(xq, xd, w, cfg: PallasConfig):
    """``log sum_j w_j exp(-0.5 |xq_i - xd_j|^2)`` for ``xq: [B, N, D]``, ``xd: [B, M, D]``."""
    return _kde_log_sum_pallas_fwd(xq, xd, w, cfg)[0]


def _kde_log_sum_pallas_fwd(xq, xd, w, cfg: PallasConfig):
    n, m = xq.shape[1], xd.shape[1]
    logsumexp = _launcher("rbf_kde_density", pallas_triton.kernel_logsumexp, cfg, cfg.fwd)
    parts, distance = _forward_distance(cfg.modes)
    rows_q, rows_d = cfg.query_rows(n, backward=False), cfg.key_rows(m, backward=False)
    log2_sum = logsumexp(
        _augment_queries(xq, rows_q, parts=parts),
        _augment_keys(xd, rows_d, log2_weights=_log2_weights(w), parts=parts),
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
    rows_q, rows_d = cfg.query_rows(n, backward=True), cfg.key_rows(m, backward=True)
    value_tile = _fit_tile(64, dim + 1)
    cols = _pallas.round_up(dim + 1, value_tile)
    dots = dict(block_o=value_tile, distance=cfg.modes.distance, values=cfg.modes.coords)
    by_query = _launcher("rbf_kde_density", pallas_triton.kernel_matmul, cfg, cfg.dq)
    by_point = _launcher("rbf_kde_density", pallas_triton.kernel_matmul, cfg, cfg.dk)
    x = _augment_queries(xq, rows_q, shift=log2_sum)
    g = g.astype(jnp.float32)

    def with_ones(points):
        return jnp.concatenate([points, jnp.ones_like(points[..., :1])], axis=-1)

    weighted = by_query(
        x, _augment_keys(xd, rows_d, log2_weights=_log2_weights(w)),
        _pad_rows_cols(with_ones(xd), rows_d, cols), **dots,
    )[:, :n]  # fmt: skip
    dxq = g[..., None] * (weighted[..., :dim] - xq * weighted[..., dim : dim + 1])
    by_data = by_point(
        _augment_keys(xd, rows_d), x, _pad_rows_cols(g[..., None] * with_ones(xq), rows_q, cols),
        **dots,
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
      precision: how the Pallas kernels multiply; accumulation is always float32 and distances
        are always float32-accurate (three-pass TF32). Relative errors vs float64 for float32
        inputs, measured on an H200 (N = M = 65536, D = 8, O = 16, standard normal points,
        lengthscales 0.8-1.6; the ``kernel_mv`` bench rows store them as ``rel_err``):

        * ``None`` (the default) or ``"default"``: value and cotangent products from single
          bfloat16 operands (8-bit mantissa) on tensor cores: output and gradients ~2.5e-3.
          This mirrors JAX's own default float32 matmul precision on GPUs, which also rounds
          the operands (to TF32); the fastest setting.
        * ``"high"``: value products from three bfloat16 passes (operands split into ``hi + lo``
          parts): ~1e-5, about 1.3x the time of the default.
        * ``"highest"``: every product in IEEE float32 on the FMA units, no tensor cores:
          ~5e-6, several times slower. Use it (or ``"high"``) for full float32 accuracy, e.g.
          in linear solves that repeat the product many times.

        ``impl="xla"`` and ``"dense"`` compute distances with ``HIGHEST`` dots and multiply by
        ``v`` at ``HIGHEST`` precision with ``"highest"``, else at XLA's default (TF32 on
        recent GPUs).
      block_q: query tile size of the forward and both backward kernels for ``impl="pallas"``
        (a power of two, at least 16); ``None`` picks it per problem and device (see
        ``default_config``; on GPUs, for large problems, 128 queries forward and 64 in the
        backward kernels).
      block_k: key tile size (a power of two, at least 16); ``None`` picks it (for large
        problems on GPUs, 32 keys forward and 128 in the backward kernels).
      block_o: value column tile size (a power of two, at least 16); ``None`` gives
        ``min(64, next_power_of_2(O))``, at least 16.

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

    Examples:
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
    precision = _resolve_precision(precision)

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
      precision: as in ``rbf_kernel_mv``. The KDE has no value product, so ``None``,
        ``"default"`` and ``"high"`` coincide: distances in three-pass TF32, backward sums in
        three-pass bfloat16 (log density ~2e-7 relative, gradients ~1e-5); ``"highest"``:
        IEEE float32 (~1e-6).
      block_q: query tile size (a power of two, at least 16) for ``impl="pallas"``.
      block_k: data point tile size (a power of two, at least 16) for ``impl="pallas"``.

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

    Examples:
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
    precision = _resolve_precision(precision)

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
