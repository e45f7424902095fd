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
Peak memory stays ``O((N + M) * (D + O))`` in both passes. Variants with ``fused_backward``
instead run one sweep over key tiles (``pallas_triton.kernel_matmul_grad_fused``): each
exponent once, dk and dv in registers, the query sums added into a float32 buffer by atomics.
Variants with ``distance="direct"`` compute exponents from coordinate differences on the FMA
units instead of the augmented dot (padded rows then contribute zero through zero values).

Candidate defaults live in ``VARIANTS`` (selected by ``DEFAULT_VARIANT`` or the environment
variable ``TILAX_RBF_VARIANT``); ``tests/rbf/gpu_timing.py --variants`` times them all.

Second-order derivatives (``jax.hessian``, ``grad`` of ``grad``) of ``impl="pallas"`` raise a
``NotImplementedError`` naming the alternatives: the backward kernels have no derivative rules.
``impl="xla"`` and ``impl="dense"`` are plain JAX and differentiable to any order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
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

    ``distance``: the augmented-point dot giving each exponent, or ``"direct"``: the exponent
    summed from coordinate differences on the FMA units (``pallas_triton.DirectDistance``;
    float32-accurate, plain kernel sums only: the KDE falls back to ``"tf32x3"``). ``values``:
    products with the values and cotangents (``K @ v``, ``g @ v.T``, ``K.T @ g``). ``coords``:
    products with coordinates in the gradients (``A @ ks``), whose result is differenced with
    ``qs * rowsum``. Mode names as in ``pallas_triton.DOT_MODES``.
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
    tiles the value columns. ``fused_backward``: ``rbf_kernel_mv``'s backward is one sweep
    (``pallas_triton.kernel_matmul_grad_fused``, launched with ``dk``; dq by float32 atomics)
    when all value columns fit one tile of at most 64.
    """

    backend: _pallas.Backend
    modes: DotModes
    block_o: int
    fwd: Launch
    dq: Launch
    dk: Launch
    fused_backward: bool = False

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


@dataclasses.dataclass(frozen=True)
class Variant:
    """A candidate default for GPUs: dot modes of ``precision=None`` (float32/float64 inputs),
    preferred launches of the three kernels, and whether the backward is one fused sweep.

    Explicit ``precision=`` names keep their ``PRECISION_MODES`` but use the variant's tiles and
    backward. The launches are preferences: tiles still shrink to the problem (see
    ``default_config``).
    """

    modes: DotModes
    fwd: Launch
    dq: Launch
    dk: Launch
    fused_backward: bool = False


_HIGH, _DEFAULT = PRECISION_MODES["high"], PRECISION_MODES["default"]
_FWD_BEST = Launch(128, 32, num_warps=4, num_stages=2)  # best of the H200 forward sweep
_BWD_BEST = Launch(64, 128, num_warps=4, num_stages=3)  # best of the H200 backward sweep
# Fused backward: programs of 64 keys, 64 or 32-query steps. (Programs of 128 or 256 keys in
# 64-row sub-tiles spill 1.5-4 KB per thread in Triton 3.6 sm_90a builds, with 4 or 8 warps.)
_FUSED_64 = Launch(64, 64, num_warps=4, num_stages=3)
_FUSED_64_W8 = Launch(64, 64, num_warps=8, num_stages=3)
_FUSED_64_L32 = Launch(64, 32, num_warps=4, num_stages=3)

#: Candidate defaults, timed against each other by ``tests/rbf/gpu_timing.py --variants``.
#: Every backward kernel below builds without register spills in Triton 3.6 for sm_90a
#: (ptxas -v) except those of "tiles", "tiles_bf16v", "direct" and "direct_fused" (40-410 B).
#: Comments: what changes, and the predicted H200 time (N = M = 65536, D = 8, O = 16, float32;
#: fwd / fwd+bwd in ms; XLA is 24.2 / 77.5, the targets 3.0 / 9.7).
VARIANTS = {
    # The tiles of the branch before the sweep: 128 x 64 everywhere, 8-warp backward. 4.1 / 28
    "branch": Variant(_HIGH, Launch(128, 64), Launch(128, 64, 8), Launch(128, 64, 8)),
    # (a) The measured best tiles with "high" modes. 3.9 / 15.7 (measured)
    "tiles": Variant(_HIGH, _FWD_BEST, _BWD_BEST, _BWD_BEST),
    # (c) + single-bfloat16 value products ("default" modes). 3.4 / 12.5
    "tiles_bf16v": Variant(_DEFAULT, _FWD_BEST, _BWD_BEST, _BWD_BEST),
    # (c) + coordinate products in one TF32 pass instead of three bfloat16 passes. 3.4 / 11
    "tf32c": Variant(DotModes("tf32x3", "bf16", "tf32"), _FWD_BEST, _BWD_BEST, _BWD_BEST),
    # (b) FMA-unit distances (no tf32x3 dot, exact to float32), "high" value modes. 3.3 / 14
    "direct": Variant(DotModes("direct", "bf16x3", "bf16x3"), _FWD_BEST, _BWD_BEST, _BWD_BEST),
    # (b + c) FMA-unit distances, single bfloat16 values, TF32 coordinates. 2.8 / 10
    "direct_fast": Variant(DotModes("direct", "bf16", "tf32"), _FWD_BEST, _BWD_BEST, _BWD_BEST),
    # (b + c + e) as direct_fast with 64-key forward tiles. 2.9 / 10
    "direct_fast_k64": Variant(
        DotModes("direct", "bf16", "tf32"), Launch(128, 64), _BWD_BEST, _BWD_BEST
    ),
    # (d) One fused backward sweep (each exponent once, dq by atomics), "high" modes. 3.9 / 11
    "fused": Variant(_HIGH, _FWD_BEST, _BWD_BEST, _FUSED_64, fused_backward=True),
    # (c + d) fused, single bfloat16 values, TF32 coordinates. 3.4 / 8.5
    "fused_fast": Variant(
        DotModes("tf32x3", "bf16", "tf32"), _FWD_BEST, _BWD_BEST, _FUSED_64, fused_backward=True
    ),
    # (b + c + d) direct distances, fused backward, fast value/coordinate modes. 2.8 / 7.5
    "direct_fused_fast": Variant(
        DotModes("direct", "bf16", "tf32"), _FWD_BEST, _BWD_BEST, _FUSED_64, fused_backward=True
    ),
    # (b + c + d) direct_fused_fast with 8 warps (two warpgroups hide latency). 2.8 / 7.5
    "direct_fused_fast_w8": Variant(
        DotModes("direct", "bf16", "tf32"), _FWD_BEST, _BWD_BEST, _FUSED_64_W8,
        fused_backward=True,
    ),  # fmt: skip
    # (b + c + d + e) direct_fused_fast with 32-query steps (fewer live registers). 2.8 / 8
    "direct_fused_fast_l32": Variant(
        DotModes("direct", "bf16", "tf32"), _FWD_BEST, _BWD_BEST, _FUSED_64_L32,
        fused_backward=True,
    ),  # fmt: skip
    # (b + d) direct distances, fused backward, "high" value/coordinate modes. 3.3 / 10
    "direct_fused": Variant(
        DotModes("direct", "bf16x3", "bf16x3"), _FWD_BEST, _BWD_BEST, _FUSED_64,
        fused_backward=True,
    ),  # fmt: skip
    # (b + c + d) direct_fused_fast_l32 with single TF32 values (~10x less error). 2.9 / 8
    "direct_fused_tf32": Variant(
        DotModes("direct", "tf32", "tf32"), _FWD_BEST, _BWD_BEST, _FUSED_64_L32,
        fused_backward=True,
    ),
    # (c + d) TF32-part distances as now, single TF32 values and coordinates, fused. 3.4 / 8.5
    "fused_tf32": Variant(
        DotModes("tf32x3", "tf32", "tf32"), _FWD_BEST, _BWD_BEST, _FUSED_64, fused_backward=True
    ),
    # (b + c + d + e) direct_fused_fast with 64-key forward tiles, 3 stages. 2.8 / 7.5
    "direct_fused_fast_k64s3": Variant(
        DotModes("direct", "bf16", "tf32"), Launch(128, 64, num_warps=4, num_stages=3), _BWD_BEST,
        _FUSED_64, fused_backward=True,
    ),  # fmt: skip
    # Everything single bfloat16 after a direct distance, fused backward (least accurate). 2.8 / 7
    "direct_fused_bf16": Variant(
        DotModes("direct", "bf16", "bf16"), _FWD_BEST, _BWD_BEST, _FUSED_64, fused_backward=True
    ),
}

#: The variant ``rbf_kernel_mv``/``rbf_kde_density`` use; the environment variable
#: ``TILAX_RBF_VARIANT`` (read when a call is traced) overrides it, for tuning runs.
DEFAULT_VARIANT = "tiles"


def current_variant() -> str:
    """``TILAX_RBF_VARIANT`` when set, else ``DEFAULT_VARIANT``."""
    name = os.environ.get("TILAX_RBF_VARIANT") or DEFAULT_VARIANT
    if name not in VARIANTS:
        raise ValueError(f"TILAX_RBF_VARIANT must be one of {tuple(VARIANTS)}, got {name!r}")
    return name


# ------------------------------------------------------------------------------------------
# Default tiles


@functools.cache
def _gpu_sm_count() -> int:
    """Streaming multiprocessors of the first GPU (132 on an H100/H200 SXM when unknown)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def _fit_tile(preferred: int, size: int) -> int:
    """``preferred`` shrunk to the problem: never more than ``next_power_of_2(size)``, >= 16."""
    return max(16, min(preferred, _pallas.next_power_of_2(size)))


def _occupancy_tile(
    preferred: int, size: int, other_programs: int, smallest: int, per_sm: int = 2
) -> int:
    """Largest tile <= ``preferred`` (down to ``smallest``) giving >= ``per_sm`` programs per
    GPU SM."""
    tile = _fit_tile(preferred, size)
    target = per_sm * _gpu_sm_count()
    while tile > smallest and other_programs * (-(-size // tile)) < target:
        tile //= 2
    return tile


def _gpu_launch(preferred: Launch, block_p: int, block_l: int) -> Launch:
    """``preferred``'s launch settings on the fitted tiles (at most 4 warps on a shrunk tile)."""
    warps = preferred.num_warps if block_p >= preferred.block_p else min(preferred.num_warps, 4)
    return Launch(block_p, block_l, num_warps=warps, num_stages=preferred.num_stages)


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
    variant: str | None = None,
) -> PallasConfig:
    """The settings ``rbf_kernel_mv``/``rbf_kde_density`` use unless told otherwise.

    ``variant`` (default ``current_variant()``) gives the dot modes of ``precision=None``, the
    preferred GPU launches and the backward's shape (see ``VARIANTS``); an explicit
    ``precision`` name gives the modes instead. On GPUs (Triton) a program tile halves while
    the grid would have fewer than two programs per SM (small ``N`` or ``M``), down to 32 rows
    forward and 64 backward (below 64 rows the backward loses the Hopper tensor-core path), and
    no tile exceeds the next power of two of its dimension (min 16); value tile
    ``min(64, next_power_of_2(O))``. In interpret mode (CPU) every tile is
    ``min(128, next_power_of_2(size))``: fewer, larger tiles interpret faster. Explicit
    ``block_q``/``block_k`` set the query/key tiles of all three kernels, ``block_o`` the value
    tile.
    """
    chosen = VARIANTS[variant or current_variant()]
    modes = chosen.modes if precision is None else PRECISION_MODES[precision]
    value_tile = block_o or _fit_tile(64, out)
    if backend == "interpret":
        q_tile = block_q or _fit_tile(128, n)
        k_tile = block_k or _fit_tile(128, m)
        fwd = dq = Launch(q_tile, k_tile)
        dk = Launch(k_tile, q_tile)
    else:
        o_tiles = -(-out // value_tile)
        pf, pq, pk = chosen.fwd, chosen.dq, chosen.dk
        fwd = _gpu_launch(
            pf,
            block_q or _occupancy_tile(pf.block_p, n, batch * o_tiles, min(32, pf.block_p)),
            block_k or _fit_tile(pf.block_l, m),
        )
        dq = _gpu_launch(
            pq,
            block_q or _occupancy_tile(pq.block_p, n, batch, min(64, pq.block_p)),
            block_k or _fit_tile(pq.block_l, m),
        )
        dk = _gpu_launch(
            pk,
            # A fused backward program does both sweeps' work: one per SM is enough.
            block_k or _occupancy_tile(pk.block_p, m, batch, min(64, pk.block_p),
                                       per_sm=1 if chosen.fused_backward else 2),  # fmt: skip
            block_q or _fit_tile(pk.block_l, n),
        )
    return PallasConfig(
        backend=backend,
        modes=modes,
        block_o=value_tile,
        fwd=fwd,
        dq=dq,
        dk=dk,
        fused_backward=chosen.fused_backward,
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


def _resolve_precision(precision: Any, dtype: jnp.dtype) -> str | None:
    """The precision name, or ``None``: the current variant's modes (float32/float64 inputs)."""
    if precision is None:
        return "default" if dtype in (jnp.bfloat16, jnp.float16) else None
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


# exp2 exponent -0.5 log2(e) |qs - ks|^2 = -sum_d (s qs_d - s ks_d)^2; key rows hold log2(e) ks.
_DIRECT_QUERY_SCALE = math.sqrt(0.5 * LOG2E)
_DIRECT_KEY_SCALE = _DIRECT_QUERY_SCALE * LN2


def _distance(mode: str, dim: int, *, program_rows: str):
    """The kernels' distance argument; ``program_rows`` ("queries"/"keys") is the ``x`` role."""
    if mode != "direct":
        return mode
    q, k = _DIRECT_QUERY_SCALE, _DIRECT_KEY_SCALE
    scales = (q, k) if program_rows == "queries" else (k, q)
    return pallas_triton.DirectDistance(dim, *scales)


def _value_operand(a: jax.Array, modes: DotModes) -> jax.Array:
    """Values and cotangents as the kernels read them: stored in bfloat16 when every product
    with them rounds to bfloat16 anyway (the same numbers, half the bytes moved per tile)."""
    return a.astype(jnp.bfloat16) if modes.values == "bf16" else a


def _kde_modes(modes: DotModes) -> DotModes:
    """The KDE's exponents carry weights and shifts, which direct distances ignore."""
    if modes.distance == "direct":
        return dataclasses.replace(modes, distance="tf32x3")
    return modes


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
    # Padded keys: zero values (and, for dots, the -1e30 exponent) make them contribute 0.
    out = matmul(
        _augment_queries(qs, cfg.query_rows(n, backward=False), parts=parts),
        _augment_keys(ks, rows_k, parts=parts),
        _value_operand(
            _pad_rows_cols(v, rows_k, _pallas.round_up(out_dim, cfg.block_o)), cfg.modes
        ),
        block_o=cfg.block_o,
        distance=_distance(distance, qs.shape[2], program_rows="queries"),
        values=cfg.modes.values,
    )
    return out[:, :n, :out_dim], (qs, ks, v)


def _kernel_mv_pallas_bwd(cfg: PallasConfig, residuals, g):
    qs, ks, v = residuals
    (_, n, dim), m, out_dim = qs.shape, ks.shape[1], v.shape[2]
    modes = cfg.modes
    # Padded queries have zero cotangents and padded keys zero values: their A_ij are 0.
    by_query = _distance(modes.distance, dim, program_rows="queries")
    by_key = _distance(modes.distance, dim, program_rows="keys")
    fused_cols = max(16, _pallas.next_power_of_2(out_dim))  # one power-of-two value tile
    if cfg.fused_backward and fused_cols <= 64:
        # One sweep over key tiles: queries only pad to its loop tile.
        rows_q, rows_k = _pallas.round_up(n, cfg.dk.block_l), _pallas.round_up(m, cfg.dk.block_p)
        x, y = _augment_queries(qs, rows_q), _augment_keys(ks, rows_k)
        g_pad = _value_operand(_pad_rows_cols(g.astype(jnp.float32), rows_q, fused_cols), modes)
        v_pad = _value_operand(_pad_rows_cols(v, rows_k, fused_cols), modes)
        fused = _launcher("rbf_kernel_mv", pallas_triton.kernel_matmul_grad_fused, cfg, cfg.dk)
        c, dv, r = fused(y, x, v_pad, g_pad, distance=by_key, values=modes.values,
                         coords=modes.coords)  # fmt: skip
        return _kernel_mv_grads(qs, ks, r, c, dv, out_dim)
    rows_q, rows_k = cfg.query_rows(n, backward=True), cfg.key_rows(m, backward=True)
    cols = _pallas.round_up(out_dim, cfg.block_o)
    x = _augment_queries(qs, rows_q)
    y = _augment_keys(ks, rows_k)
    g_pad = _value_operand(_pad_rows_cols(g.astype(jnp.float32), rows_q, cols), modes)
    v_pad = _value_operand(_pad_rows_cols(v, rows_k, cols), modes)
    dots = dict(block_o=cfg.block_o, values=modes.values)
    grad_q = _launcher("rbf_kernel_mv", pallas_triton.kernel_matmul_grad, cfg, cfg.dq)
    grad_k = _launcher("rbf_kernel_mv", pallas_triton.kernel_matmul_grad, cfg, cfg.dk)
    r = grad_q(x, y, g_pad, v_pad, with_pw=False, coords=modes.coords, distance=by_query, **dots)
    # dv = K.T @ g rides along in the dk sweep while its accumulator fits in registers.
    fuse_dv = cols <= 64
    c = grad_k(y, x, v_pad, g_pad, with_pw=fuse_dv, coords=modes.coords, distance=by_key, **dots)
    if fuse_dv:
        c, dv = c
    else:
        dv = _launcher("rbf_kernel_mv", pallas_triton.kernel_matmul, cfg, cfg.dk)(
            y, x, g_pad, distance=by_key, **dots
        )
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
      precision: how the Pallas kernels multiply; accumulation is always float32. Relative
        errors vs float64 below were measured in interpret mode, which reproduces the GPU's
        roundings (N = M = 512, D = 8, O = 16, points N(5, 2^2) per dimension, lengthscales
        0.8-1.6); ``tests/rbf/gpu_timing.py`` prints the GPU numbers.

        * ``"highest"``: every dot in IEEE float32 on the FMA units, no tensor cores. Output and
          gradients ~1e-6. Several times slower than ``"high"``.
        * ``None`` (the default): for float32 and float64 inputs the dot modes of the default
          variant (``api.DEFAULT_VARIANT``, see ``api.VARIANTS``; currently ``"tiles"``, whose
          modes are those of ``"high"``), for bfloat16 and float16 inputs ``"default"``.
          Faster candidates measured in interpret mode (same setup as below; output / worst
          gradient): direct FMA distances + single-bfloat16 values + single-TF32 coordinates
          ~2.7e-3 / 2.4e-3; single-TF32 values and coordinates ~3e-4 / 7e-4 (the GPU numbers
          come from ``tests/rbf/gpu_timing.py --variants``).
        * ``"high"``: distances from 3-pass TF32 dots
          (operands split into TF32 ``hi + lo``, float32-accurate), value and gradient products
          from 3-pass bfloat16 dots (``hi + lo`` parts, ~2**-16 per product). Output ~5e-6,
          gradients 1e-5 to 3e-5. The default because every product runs on tensor cores
          while the result stays close to float32: the kernel is then limited by ``exp``
          throughput, and the splits cost a few instructions per pair.
        * ``"default"``: as ``"high"`` but the value
          products in single bfloat16 (8-bit mantissa): output and gradients ~3e-3. Fastest.

        Distances are never computed in a single low-precision pass: the expansion
        ``|q|^2 + |k|^2 - 2 q.k`` would turn its rounding into a relative error of the kernel
        value. ``impl="xla"``/``"dense"`` use ``HIGHEST`` dots for distances, and for the
        value product ``HIGHEST`` with ``"highest"``, else XLA's default (TF32 on recent GPUs).
      block_q, block_k, block_o: tile sizes of queries, keys and value columns (powers of two
        >= 16) for ``impl="pallas"``, in the forward and both backward kernels; ``None`` picks
        them per problem and device (see ``default_config`` and ``VARIANTS``; on GPUs, for
        large problems with the ``"tiles"`` variant, 128 queries x 32 keys forward, 64 x 128
        in each backward kernel with 3 pipeline stages, value tile ``min(64, O)``).

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
    cfg = dataclasses.replace(cfg, modes=_kde_modes(cfg.modes))
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
