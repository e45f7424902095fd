"""How the RBF implementations keep kernel values right: shared by the XLA and Pallas paths.

Two ways to get the squared distance of a pair:

* **differences** (the exact path): ``sum_d ((q_d - k_d) / l_d)^2`` from the coordinate
  differences of the inputs. Each difference is correctly rounded whatever the data's offset, so
  the exponent has a relative error of a few float32 ulps at any ratio of data spread to
  lengthscale. ``precision="highest"`` always takes this path.
* **the expansion** (the fast path): ``|a|^2 + |b|^2 - 2 a.b`` of centred, scaled points
  ``a = (q - c) / l``, ``b = (k - c) / l``, one matrix product per tile. Its exponent error grows
  with the squared norms, so :func:`expansion_error_bound` bounds it by the spread-to-lengthscale
  ratio ``rho = max_i |a_i| + max_j |b_j|``. The fast precisions take this path only while the
  bound is within their budget (``FAST_DISTANCE_BUDGET``) and switch to the exact path beyond it
  (a ``lax.cond`` on the data: under ``vmap`` with a batched ratio both paths run).

The kernels name the two forms as data (:class:`Expansion`, :class:`Difference`: the
``Distance`` both backends and the launch rules read), and multiply by values, cotangents and
coordinates in a chosen *dot mode* (:func:`split`, :func:`dot`, below).

Both clamp the exponent at 0, so every kernel value is in ``[0, 1]``; the default precision's
Mosaic GPU kernels (``tilax.rbf.mosaic.forward``, ``tilax.rbf.mosaic.grad``) instead rely on
the budget: within it a fast exponent exceeds 0 by less than ``ln(1 + 2^-8) / ln 2``, so its
``exp2`` rounds to at most 1 in bfloat16 (see ``FAST_DISTANCE_BUDGET``).

Derivation of the bound (``u = 2^-24``, ``lambda = log2(e)``, exponents in base 2,
``t = -lambda/2 |a - b|^2``): centring and scaling round ``a`` and ``b`` (``2u`` each, moving
``t`` by at most ``4 u (lambda/2) (|a| + |b|)^2``); the norms ``-lambda/2 |a|^2`` sum ``D`` squares
(``(D + 2) u`` relative each); the cross product is three TF32 passes over ``D + 2`` augmented
columns, whose dropped ``lo * lo`` term and rounded ``lo`` parts cost ``12 u`` per product, and
whose float32 accumulation costs at most ``6 (D + 2) u`` of the sum of absolute terms,
``(lambda/2) (|a| + |b|)^2``. In total ``|dt| <= (7D + 31) u (lambda/2) (|a| + |b|)^2`` and, as
``ln 2 * lambda = 1``, the relative error of a kernel value is at most (to first order)
``(7D + 31) 2^-25 rho^2``. It is a worst case; measured errors are one to two orders smaller.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from tilax._pallas import Backend

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
# The exact path scales coordinates by s = sqrt(log2(e) / 2) / l: exp2(-sum_d (s_d x_d)^2) is
# exp(-0.5 sum_d (x_d / l_d)^2).
HALF_LOG2E_SQRT = math.sqrt(0.5 * LOG2E)
# Scales stay normal float32 numbers: 1 / l of a subnormal lengthscale would be infinite.
SCALE_MIN, SCALE_MAX = 2.0**-126, 2.0**126
# Exactly pre-scaled coordinates are clamped here so that differences of two stay finite.
COORD_MAX = 2.0**126

#: Largest worst-case relative error of a kernel value (``expansion_error_bound``) at which a
#: precision still uses the fast expansion; beyond it the exact path runs. ``"default"``'s budget
#: matches the rounding of its single-bfloat16 value products (2^-9 per product), less 2^-16: a
#: kernel value of an exponent ``t <= b / ln 2`` (``b`` the budget) is at most
#: ``e^b < 1 + 2^-8``, which bfloat16 rounds to 1, so the bfloat16 kernel values of the default
#: fast path stay in ``[0, 1]`` without a clamp. ``"high"``'s sits an order of magnitude above
#: its typical error (~1e-5).
FAST_DISTANCE_BUDGET = {"default": 2.0**-8 - 2.0**-16, "high": 2.0**-12}


def compute_dtype(*arrays) -> jnp.dtype:
    """float64 stays float64; every other floating input computes in float32."""
    dtype = jnp.result_type(*arrays)
    return jnp.dtype(jnp.float64) if dtype == jnp.float64 else jnp.dtype(jnp.float32)


def uses_expansion(precision: str | None) -> bool:
    """Whether ``precision`` may take the fast expansion (every precision but ``"highest"``)."""
    return precision != "highest"


def expansion_error_bound(dim: int, rho, unit_roundoff: float = 2.0**-24):
    """Worst-case first-order bound on the relative error of a kernel value from the expansion.

    ``rho`` is the spread-to-lengthscale ratio ``max_i |a_i| + max_j |b_j|`` of the centred,
    scaled points (see the module docstring for the derivation); ``unit_roundoff`` is ``2^-24``
    for float32 (``2^-53`` for the float64 XLA path).
    """
    return (7 * dim + 31) * (unit_roundoff / 2) * rho**2


def max_spread_ratio(dim: int, budget: float, unit_roundoff: float = 2.0**-24) -> float:
    """The largest ``rho`` whose ``expansion_error_bound`` is within ``budget``."""
    return math.sqrt(budget / ((7 * dim + 31) * (unit_roundoff / 2)))


def scale_by(x: jax.Array, lengthscale: jax.Array) -> jax.Array:
    """``x / lengthscale`` whose derivative in the lengthscale stays finite at any lengthscale.

    Written ``(x / l0) * exp(log l0 - log l)`` with ``l0 = stop_gradient(l)``: the value is the
    correctly rounded ``x / l`` (the factor is exactly 1), and the derivative is formed as
    ``(x / l0) * (-1 / l)``. Differentiating ``x / l`` directly forms ``1 / l^2``, which overflows
    for ``l < 1e-19`` and turns a zero cotangent into ``0 * inf = NaN``.
    """
    fixed = lax.stop_gradient(lengthscale)
    return (x / fixed) * jnp.exp(jnp.log(fixed) - jnp.log(lengthscale))


def centered_scaled(queries, points, scale, dtype=None):
    """``((queries - c) / scale, (points - c) / scale)``, ``c`` the mean point (no gradient).

    ``queries: [..., N, D]``, ``points: [..., M, D]`` (``M >= 1``), ``scale`` a scalar or ``[D]``.
    The kernel is translation invariant, so ``c`` changes no value or derivative; it keeps the
    norms of the expansion small for data far from the origin.
    """
    dtype = dtype or compute_dtype(queries, points)
    queries = queries.astype(dtype)
    points = points.astype(dtype)
    scale = jnp.asarray(scale).astype(dtype)
    center = lax.stop_gradient(jnp.mean(points, axis=-2, keepdims=True))
    return scale_by(queries - center, scale), scale_by(points - center, scale)


def spread_ratio(qs: jax.Array, ks: jax.Array) -> jax.Array:
    """``max_i |qs_i| + max_j |ks_j|`` over every batch entry (no gradient); inf or NaN if the
    scaled points overflow."""
    qs, ks = lax.stop_gradient(qs), lax.stop_gradient(ks)
    return jnp.sqrt(jnp.max(jnp.sum(qs * qs, axis=-1))) + jnp.sqrt(jnp.max(jnp.sum(ks * ks, -1)))


def fast_distance_ok(qs: jax.Array, ks: jax.Array, precision: str | None) -> jax.Array:
    """Whether the expansion of centred, scaled ``qs``, ``ks`` is within ``precision``'s budget.

    False for a non-finite ratio (scaled points that overflow), so such data take the exact path.
    """
    unit_roundoff = float(jnp.finfo(qs.dtype).eps) / 2
    bound = expansion_error_bound(qs.shape[-1], spread_ratio(qs, ks), unit_roundoff)
    return bound <= FAST_DISTANCE_BUDGET[precision or "default"]


def exact_scales(lengthscale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(p, r)`` with ``p * r = sqrt(log2(e) / 2) / lengthscale``, ``p`` a power of two.

    Multiplying coordinates by ``p`` is exact, so the kernels' differences ``p q_d - p k_d`` are
    the correctly rounded scaled differences; the residual ``r`` in ``[1, 2)`` is applied per pair.
    The scale is clamped to normal float32 numbers (lengthscales between about ``1e-38`` and
    ``1e38``). No gradient: callers differentiate through :func:`scale_by` or an identity.
    """
    scale = HALF_LOG2E_SQRT / lax.stop_gradient(lengthscale).astype(jnp.float32)
    mantissa, exponent = jnp.frexp(jnp.clip(scale, SCALE_MIN, SCALE_MAX))
    return jnp.ldexp(jnp.float32(1.0), exponent - 1), 2.0 * mantissa


def prescale(x: jax.Array, power_of_two: jax.Array) -> jax.Array:
    """``x * p`` (exact) clamped to ``+-COORD_MAX`` so that differences of two stay finite."""
    return jnp.clip(x * power_of_two, -COORD_MAX, COORD_MAX)


# ------------------------------------------------------------------------------------------
# The two distance forms, as the kernels take them

#: Largest float32 (exponents below ``-FLOAT32_MAX`` are ``-inf``).
FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)
#: Difference kernels hold the program's coordinates in registers up to this many dimensions;
#: beyond, they loop over dimensions and re-read coordinates per tile, and the gradient kernels
#: split their per-dimension sums into chunks of this many.
HOISTED_DIMS = DIM_CHUNK = 16


def difference_dims(dim: int) -> int:
    """Dimensions the :class:`Difference` kernels take for ``dim``-dimensional points: ``dim``,
    or beyond ``DIM_CHUNK`` the next multiple of it (the layout adds zero coordinates)."""
    return dim if dim <= DIM_CHUNK else -(-dim // DIM_CHUNK) * DIM_CHUNK


@dataclasses.dataclass(frozen=True)
class Expansion:
    """Exponents ``min(x_i . y_l, 0)`` of augmented points (``tilax.rbf.vjp`` builds them),
    one ``mode`` dot (:func:`dot`)."""

    mode: str


@dataclasses.dataclass(frozen=True)
class Difference:
    """Exponents ``-sum_{d < dim} (r_d (x[d, i] - y[d, l]))^2`` of transposed coordinates.

    ``per_dimension``: ``r`` has ``dim`` entries; otherwise one, applied once per pair to the
    summed squares. ``rounded``: every square is rounded before it is summed (a ``max`` with 0
    that compilers cannot fuse into the sum), so that every kernel, however compiled, gets the
    same bits; the KDE subtracts the forward pass's row maximum from exponents recomputed in
    its backward pass, and beyond 2^24 two roundings of one exponent differ by more than 1.
    """

    dim: int
    per_dimension: bool
    rounded: bool = False


Distance = Expansion | Difference


# ------------------------------------------------------------------------------------------
# Dot modes: products of float32 tiles inside the kernels, at a chosen precision
#
# Dots take a *mode* naming how float32 operands are multiplied (accumulation is float32):
#
# * ``"ieee"``: full float32 products on the FMA units (slow: no tensor cores);
# * ``"tf32x3"``: each operand split into TF32 ``hi + lo``; ``hi*hi + hi*lo + lo*hi`` on tensor
#   cores, relative error ~2**-21 per product (float32-accurate);
# * ``"tf32_parts"``: the same product from operands that ``tf32x3_parts`` laid out in memory as
#   ``[hi | lo | hi]`` and ``[hi | hi | lo]``: one TF32 dot over the concatenation, no adds;
# * ``"bf16x3"``: bfloat16 ``hi + lo`` parts, relative error ~2**-16 per product; a bfloat16 tile
#   feeds the next tensor-core dot straight from registers;
# * ``"bf16x2"``: the first operand rounded to bfloat16, the second in ``hi + lo`` parts:
#   ``a_hi b_hi + a_hi b_lo``, each product's error at most 2**-8 relative to ``a``, ~2**-16 to
#   ``b``.
#   For pair weights times coordinates whose sums are differenced with the weights' row sum
#   from the same product (the weights' rounding is then a perturbation of the weights, not
#   amplified by the cancellation; the coordinates' rounding would be);
# * ``"bf16"``: operands rounded to bfloat16 (8-bit mantissa), relative error ~2**-9 per product.
#
# The splits are written out here (not left to Triton's ``tf32x3``, which adds a NaN select per
# output element), so the interpret mode on CPU computes the same rounded parts as the GPU.

DOT_MODES = ("ieee", "tf32x3", "tf32_parts", "bf16x3", "bf16x2", "bf16")


def _round_to_tf32(x: jax.Array) -> jax.Array:
    """Round float32 values to TF32 (10 mantissa bits), ties away from zero."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _round_to_bf16(x: jax.Array) -> jax.Array:
    """Round float32 values to bfloat16 (7 mantissa bits), ties away from zero, kept as float32.

    Integer add-and-mask is cheaper on GPUs than converting to bfloat16 and widening back.
    """
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def split(a: jax.Array, mode: str) -> tuple[jax.Array, ...]:
    """The parts a ``mode`` dot multiplies: ``(a,)``, ``(bf16(a),)`` or ``(hi, lo)`` (for
    ``"bf16x2"`` both operands' parts; its dot takes the first operand's ``hi`` only)."""
    if mode in ("ieee", "tf32_parts"):
        return (a,)
    if mode == "bf16":
        return (a.astype(jnp.bfloat16),)
    if mode in ("bf16x3", "bf16x2"):
        hi = _round_to_bf16(a)  # exact in bfloat16, so the cast below is exact
        return hi.astype(jnp.bfloat16), (a - hi).astype(jnp.bfloat16)
    if mode == "tf32x3":
        hi = _round_to_tf32(a)
        return hi, _round_to_tf32(a - hi)
    raise ValueError(f"unknown dot mode {mode!r}; expected one of {DOT_MODES}")


def tf32x3_parts(blocks: list[jax.Array], *, first: bool) -> jax.Array:
    """``x: [..., K]``, given as its column ``blocks`` in order, as TF32 parts: ``[hi | lo | hi]``
    (``first``) or ``[hi | hi | lo]``.

    Zero-padded to ``max(16, next_power_of_2(3 K))`` columns. The dot of a ``first`` and a
    second operand is ``hi.hi + lo.hi + hi.lo``, the ``"tf32x3"`` product, in one TF32 dot. The
    blocks are split one by one and written by one concatenation (one XLA fusion; a
    concatenated ``x`` would be written out first).
    """
    his = [_round_to_tf32(b) for b in blocks]
    los = [_round_to_tf32(b - hi) for b, hi in zip(blocks, his, strict=True)]
    cols = sum(b.shape[-1] for b in blocks)
    width = max(16, 1 << (3 * cols - 1).bit_length())
    # The zero columns join the concatenation (one XLA fusion; a separate pad was a second).
    zeros = jnp.zeros((*blocks[0].shape[:-1], width - 3 * cols), blocks[0].dtype)
    return jnp.concatenate([*his, *los, *his, zeros] if first else [*his, *his, *los, zeros],
                           axis=-1)


def dot(a_parts, b_parts, mode: str, backend: Backend, *, b_transposed: bool = False):
    """``a @ b`` (or ``a @ b.T``) from ``split`` parts, float32 accumulation."""
    dims = (((1,), (1,) if b_transposed else (0,)), ((), ()))
    if mode == "ieee":
        precision = lax.Precision.HIGHEST
    elif mode in ("tf32x3", "tf32_parts") and backend != "interpret":
        precision = lax.DotAlgorithmPreset.TF32_TF32_F32
    elif mode in ("tf32x3", "tf32_parts"):
        precision = lax.Precision.HIGHEST  # the parts are exact TF32 values already
    else:
        precision = None  # bfloat16 operands

    def dot(a, b):
        return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)

    if len(a_parts) == 1:
        return dot(a_parts[0], b_parts[0])
    (a_hi, a_lo), (b_hi, b_lo) = a_parts, b_parts
    # Small terms first. (Triton does not fold these adds into the dot accumulators.)
    if mode == "bf16x2":
        return dot(a_hi, b_lo) + dot(a_hi, b_hi)
    return dot(a_lo, b_hi) + dot(a_hi, b_lo) + dot(a_hi, b_hi)
