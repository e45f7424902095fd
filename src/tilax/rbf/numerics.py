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
from tilax.rbf import profiles

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
# The exact path scales coordinates by s = sqrt(log2(e) / 2) / l: exp2(-sum_d (s_d x_d)^2) is
# exp(-0.5 sum_d (x_d / l_d)^2).
HALF_LOG2E_SQRT = math.sqrt(0.5 * LOG2E)
# Exactly pre-scaled coordinates stay below 2^PRESCALED_EXPONENT in magnitude (the power of two
# is capped by the data's magnitude), so that their differences stay finite; the clamp at
# COORD_MAX is a guard for non-finite data only.
PRESCALED_EXPONENT = 125
COORD_MAX = 2.0**126
# The residual scale stays below 2^63, so that its square (a shared scale multiplies summed
# squares by r^2) is finite and a zero distance gives an exponent of 0, never 0 * inf.
RESIDUAL_MAX = 2.0**63

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


# ------------------------------------------------------------------------------------------
# Scales at every representable size
#
# Lengthscales, bandwidths and weights may be subnormal (down to 2^-149 in float32). XLA on CPUs
# (and GPUs) flushes subnormal operands to zero, so ``1 / l``, ``log l`` or ``w / max(w)`` of
# such numbers are inf, -inf or NaN. These helpers read the exponent from the bits instead and
# scale by exact powers of two, each a normal number.


def _layout(dtype) -> tuple[int, int, type]:
    """(mantissa bits, exponent bias, unsigned integer type of the same width) of ``dtype``."""
    info = jnp.finfo(dtype)
    return info.nmant, info.maxexp - 1, jnp.uint32 if info.bits == 32 else jnp.uint64


def split_exponent(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(m, e)`` with ``|x| = m 2^e``, ``m`` in ``[1, 2)`` and ``e`` an int32, for nonzero
    finite ``x``, subnormal numbers included (from the bits: no flush to zero). No gradient."""
    x = lax.stop_gradient(x)
    nmant, bias, uint = _layout(x.dtype)
    frac_mask = jnp.asarray((1 << nmant) - 1, uint)
    one = jnp.asarray(bias << nmant, uint)
    # |x| from the bits: a float abs would read a subnormal x as 0 in code XLA compiles with
    # denormals flushed (a fused program on a CPU).
    bits = lax.bitcast_convert_type(x, uint) & jnp.asarray(jnp.iinfo(uint).max >> 1, uint)
    field = (bits >> nmant).astype(jnp.int32)
    normal = lax.bitcast_convert_type((bits & frac_mask) | one, x.dtype)
    # A subnormal number is its fraction bits times 2^(1 - bias - nmant); as an integer converted
    # to a float (exact, and normal), its own exponent field gives the rest.
    frac = (bits & frac_mask).astype(x.dtype)
    frac_bits = lax.bitcast_convert_type(frac, uint)
    sub_field = (frac_bits >> nmant).astype(jnp.int32)
    sub = lax.bitcast_convert_type((frac_bits & frac_mask) | one, x.dtype)
    is_sub = field == 0
    mantissa = jnp.where(is_sub, sub, normal)
    exponent = jnp.where(is_sub, sub_field - bias + 1 - bias - nmant, field - bias)
    return mantissa, exponent


def power_of_two(n: jax.Array, dtype=jnp.float32) -> jax.Array:
    """``2^n`` for integer ``n`` within the normal exponents of ``dtype`` (exact, from bits)."""
    nmant, bias, uint = _layout(dtype)
    biased = (jnp.asarray(n, jnp.int32) + bias).astype(uint)
    return lax.bitcast_convert_type(biased << nmant, jnp.dtype(dtype))


def times_power_of_two(x: jax.Array, n: jax.Array) -> jax.Array:
    """``x 2^n`` for a normal or zero ``x`` and integer ``n`` of any size: exact unless the result
    overflows (to inf) or underflows (to 0). Two factors, each a normal power of two."""
    _, bias, _ = _layout(x.dtype)
    limit = bias - 27
    n = jnp.asarray(n, jnp.int32)
    first = jnp.clip(n, -limit, limit)
    second = jnp.clip(n - first, -limit, limit)
    return (x * power_of_two(first, x.dtype)) * power_of_two(second, x.dtype)


def divide_by(x: jax.Array, scale: jax.Array) -> jax.Array:
    """``x / scale`` for a positive ``scale`` of any size (subnormal included): ``x 2^-e / m``,
    correctly rounded unless it overflows or underflows. No gradient in ``scale``."""
    mantissa, exponent = split_exponent(scale)
    return times_power_of_two(x, -exponent) / mantissa


def log_positive(x: jax.Array) -> jax.Array:
    """``log x`` for a positive ``x``, subnormal included; differentiable where ``x`` is normal
    (the derivative at a subnormal ``x`` is 0: ``1 / x`` is not a float there)."""
    tiny = float(jnp.finfo(x.dtype).tiny)
    normal = x >= tiny  # False for a subnormal number, flushed or not
    mantissa, exponent = split_exponent(x)
    from_bits = jnp.log(mantissa) + exponent.astype(x.dtype) * LN2
    return jnp.where(normal, jnp.log(jnp.where(normal, x, 1.0)), from_bits)


def _rescaled_weights(weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(weights / 2^e, 2^-e)`` with ``2^e`` the largest weight's power of two (per row over
    ``M``), the first from the bits alone, the second clamped below overflow."""
    _, bias, uint = _layout(weights.dtype)
    positive = (lax.bitcast_convert_type(weights, uint) << 1) != 0  # the sign bit dropped
    mantissa, exponent = split_exponent(weights)
    exponent = jnp.where(positive, exponent, jnp.iinfo(jnp.int32).min // 2)
    largest = jnp.max(exponent, axis=-1, keepdims=True)
    values = jnp.where(positive, times_power_of_two(mantissa, exponent - largest), 0.0)
    return values, times_power_of_two(jnp.ones((), weights.dtype), jnp.minimum(-largest, bias))


# A custom JVP so that the value never reads the weights as floats: in code XLA fuses on a CPU
# (under jit) LLVM turns a bit test of a float that is also read as a float into a float
# comparison, which reads a subnormal weight as 0 (denormals are flushed there).
@jax.custom_jvp
def normalized_weights(weights: jax.Array) -> jax.Array:
    """Non-negative ``weights: [..., M]`` (not all zero) divided by their sum over ``M``, for any
    finite size: first rescaled by a power of two so that the largest is in ``[1, 2)`` (the sum
    of 1e38s would overflow, 1e-45s are flushed to zero), then divided by their sum. The
    derivative is that of ``w / sum(w)`` with the rescaling factor clamped at the float's
    largest power of two."""
    values, _ = _rescaled_weights(weights)
    return values / jnp.sum(values, axis=-1, keepdims=True)


@normalized_weights.defjvp
def _normalized_weights_jvp(primals, tangents):
    (weights,), (d_weights,) = primals, tangents
    values, factor = _rescaled_weights(weights)
    total = jnp.sum(values, axis=-1, keepdims=True)
    out = values / total
    d_rescaled = d_weights * factor
    return out, (d_rescaled - out * jnp.sum(d_rescaled, axis=-1, keepdims=True)) / total


@dataclasses.dataclass(frozen=True)
class Scale:
    """``x / lengthscale`` whose derivative in the lengthscale stays finite at any lengthscale:
    ``Scale.of(l).apply(x)``, the lengthscale's part computed once for every ``x`` it scales
    (``scale[d]``: dimension ``d`` of a ``[D]`` lengthscale), not once per coordinate.

    Written ``(x / l0) * exp(log l0 - log l)`` with ``l0 = stop_gradient(l)``: the value is the
    correctly rounded ``x / l`` (the factor is exactly 1; as :func:`divide_by`, so that a
    subnormal lengthscale divides too), and the derivative is formed as ``(x / l0) * (-1 / l)``.
    Differentiating ``x / l`` directly forms ``1 / l^2``, which overflows for ``l < 1e-19`` and
    turns a zero cotangent into ``0 * inf = NaN``. Values beyond ``2 sqrt(max)`` (whose squares
    overflow) are clamped there.
    """

    mantissa: jax.Array
    exponent: jax.Array
    factor: jax.Array  # exp(log l0 - log l): exactly 1, carrying the lengthscale's derivative

    @classmethod
    def of(cls, lengthscale: jax.Array) -> Scale:
        fixed = lax.stop_gradient(lengthscale)
        mantissa, exponent = split_exponent(fixed)
        return cls(mantissa, exponent, jnp.exp(log_positive(fixed) - log_positive(lengthscale)))

    def __getitem__(self, d) -> Scale:
        return Scale(self.mantissa[d], self.exponent[d], self.factor[d])

    def apply(self, x: jax.Array) -> jax.Array:
        # Beyond sqrt(max) a square overflows anyway: clamped there, a scaled difference is
        # never inf (at subnormal lengthscales it would be), so its derivative is never 0 * inf.
        bound = 2.0 * math.sqrt(float(jnp.finfo(x.dtype).max))
        scaled = jnp.clip(times_power_of_two(x, -self.exponent) / self.mantissa, -bound, bound)
        return scaled * self.factor


def centered_scaled(queries, points, scale, dtype=None):
    """``((queries - c) / scale, (points - c) / scale)``, ``c`` the mean point (no gradient).

    ``queries: [..., N, D]``, ``points: [..., M, D]`` (``M >= 1``), ``scale`` a scalar or ``[D]``.
    The kernel is translation invariant, so ``c`` changes no value or derivative; it keeps the
    norms of the expansion small for data far from the origin.
    """
    dtype = dtype or compute_dtype(queries, points)
    queries = queries.astype(dtype)
    points = points.astype(dtype)
    scale = Scale.of(jnp.asarray(scale).astype(dtype))
    center = lax.stop_gradient(jnp.mean(points, axis=-2, keepdims=True))
    return scale.apply(queries - center), scale.apply(points - center)


def spread_ratio(qs: jax.Array, ks: jax.Array) -> jax.Array:
    """``max_i |qs_i| + max_j |ks_j|`` over every batch entry (no gradient); inf or NaN if the
    scaled points overflow."""
    qs, ks = lax.stop_gradient(qs), lax.stop_gradient(ks)
    return jnp.sqrt(jnp.max(jnp.sum(qs * qs, axis=-1))) + jnp.sqrt(jnp.max(jnp.sum(ks * ks, -1)))


def fast_distance_ok(qs: jax.Array, ks: jax.Array, precision: str | None,
                     kernel: str = "rbf") -> jax.Array:
    """Whether the expansion of centred, scaled ``qs``, ``ks`` is within ``precision``'s budget.

    The budget bounds the relative error of a kernel value: the expansion's bound on the
    exponent's error, converted for ``kernel`` by ``profiles.value_error_bound`` (the Gaussian
    kernel's is the bound itself). False for a non-finite ratio (scaled points that overflow),
    so such data take the exact path.
    """
    unit_roundoff = float(jnp.finfo(qs.dtype).eps) / 2
    bound = expansion_error_bound(qs.shape[-1], spread_ratio(qs, ks), unit_roundoff)
    if kernel != "rbf":
        bound = profiles.value_error_bound(kernel, bound)
    return bound <= FAST_DISTANCE_BUDGET[precision or "default"]


def exact_scales(lengthscale: jax.Array, magnitude: jax.Array | None = None):
    """``(p, r)`` with ``p * r = sqrt(log2(e) / 2) / lengthscale``, ``p`` a power of two.

    Multiplying coordinates by ``p`` is exact, so the kernels' differences ``p q_d - p k_d`` are
    the correctly rounded scaled differences; the residual ``r`` is applied per pair. ``r`` is in
    ``[1, 2)`` unless ``p`` is capped: by ``2^125 / magnitude`` (``magnitude`` the largest
    coordinate, so that no scaled coordinate overflows and two far points never both clamp to
    one value; ``r`` then carries the rest, up to ``RESIDUAL_MAX``, and far pairs still get
    exponents beyond float32), or below at ``2^-126`` for lengthscales beyond ``1e38``. Any
    positive lengthscale, subnormal included (its exponent is read from its bits). No gradient:
    callers differentiate through :class:`Scale` or an identity.
    """
    mantissa, exponent = split_exponent(lengthscale.astype(jnp.float32))
    # s = (c / m) 2^-e with c / m in (c / 2, c]: one rounding, as c / l would have.
    scale_mantissa, scale_exponent = split_exponent(HALF_LOG2E_SQRT / mantissa)
    total = scale_exponent - exponent
    cap = jnp.int32(126)
    if magnitude is not None:
        magnitude = lax.stop_gradient(magnitude).astype(jnp.float32)
        usable = (magnitude > 0) & jnp.isfinite(magnitude)
        _, magnitude_exponent = split_exponent(jnp.where(usable, magnitude, 1.0))
        cap = jnp.where(usable, jnp.minimum(cap, PRESCALED_EXPONENT - 1 - magnitude_exponent), cap)
    power = jnp.clip(total, -126, cap)
    residual = jnp.minimum(times_power_of_two(scale_mantissa, total - power), RESIDUAL_MAX)
    return power_of_two(power), residual


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
