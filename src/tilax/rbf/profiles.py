"""The stationary kernels' profiles: a kernel value and its pair weight from a squared distance.

Every kernel sum of ``tilax.rbf`` is ``sum_j k(r_ij) v_j`` with ``r = ||(q - k) / l||``; a
*profile* is the function ``k`` of the squared distance, named by the public ``kernel``
argument, and its *pair weight* ``phi = -dk/ds`` (``s = r^2 / 2``; ``phi = -2 dk/d(r^2)``),
which takes the Gaussian kernel's value's place in every backward sum: with
``A_ij = phi_ij (g_i . v_j)``, ``dq_i = sum_j A_ij (k_j - q_i) / l^2``, and the lengthscale's
gradient sums ``A_ij ((q_i - k_j) / l_d)^2 / l_d``, for every profile.

| ``kernel`` | ``k(r)`` | ``phi``, with ``z = c r`` |
| --- | --- | --- |
| ``"rbf"`` | ``exp(-r^2 / 2)`` | ``exp(-r^2 / 2)`` |
| ``"matern12"`` | ``exp(-r)`` | ``exp(-r) / r`` (0 at ``r = 0``) |
| ``"matern32"`` | ``(1 + z) exp(-z)``, ``c = sqrt 3`` | ``3 exp(-z)`` |
| ``"matern52"`` | ``(1 + z + z^2 / 3) exp(-z)``, ``c = sqrt 5`` | ``5/3 (1 + z) exp(-z)`` |

Conventions at coincident points (``r = 0``): the Matérn-1/2 kernel is a cone there, its
derivative in ``r`` is ``-1`` but the direction ``(q - k) / r`` is undefined; its gradient at
``r = 0`` is taken to be 0 (the subgradient of the symmetric cone; ``phi = 0``). Below
``r_0 ~ 1e-15`` (``SQUARE_FLOOR``: ``s`` or ``-t`` of ``2^-100``) the distance is taken as
``r_0``, so that ``phi`` stays below ``1 / r_0 ~ 1e15`` and no ``0 * inf`` arises: a pair
closer than ``r_0`` lengthscales (but not coincident) contributes ``r / r_0`` of its gradient.
Matérn-3/2 and 5/2 are differentiable at 0 (``phi(0) = 3`` and ``5/3``): no convention is
needed for their first derivatives. Far pairs: ``z`` is capped at ``Z_MAX``, where
``exp(-z)`` is 0 in float32 and float64, so that ``poly(z) exp(-z)`` is 0, never
``inf * 0``; values are clamped at 1 (an approximate ``exp2`` may round them just above it).
From the expansion (the fast kernels, ``fast=True``) Matérn-1/2's distance is floored at
``2^-12`` instead (``FAST_SQUARE_FLOOR``): there ``t`` near 0 is a rounding error, not a
coincidence.

Cost on a GPU, per pair: the Gaussian one ``exp2`` (the exp unit, ``MUFU.EX2``); a Matérn
kernel a reciprocal square root (``MUFU.RSQ``: ``r = s rsqrt(s)``, and for Matérn-1/2's weight
``1 / r`` from the same op) and one ``exp2``: two exp-unit ops a pair, and 2 (Matérn-1/2) to 6
(Matérn-5/2) FMA-pipe instructions more than the Gaussian kernel's.

Two forms, one formula each: :func:`kernel_values` and :func:`pair_weights` take the kernels'
base-2 exponent ``t = -log2(e) s`` (what the tiled kernels compute, with the exp unit's
operations passed in), :func:`half_sq_kernel` the natural ``s`` (the plain-XLA sums,
differentiable by a ``custom_jvp`` whose tangent is ``-phi ds``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

KERNELS = ("rbf", "matern12", "matern32", "matern52")
MATERN = {"matern12": 1.0, "matern32": math.sqrt(3.0), "matern52": math.sqrt(5.0)}

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
#: The squared-distance floor of the Matérn profiles (in the form's units: ``-t`` or ``s``):
#: ``rsqrt`` of it is finite (2^50), and its square root is far below any float32 difference
#: of order-1 coordinates.
SQUARE_FLOOR = 2.0**-100
#: The fast (expansion) kernels' floor on Matérn-1/2's distance, ``r_f = 2^-12`` (as ``-t``):
#: the expansion cannot tell pairs closer than its error apart from coincident ones (its
#: rounding leaves ``t`` a little off 0 either way), and Matérn-1/2's weight ``1 / r`` of such
#: a pair would multiply that rounding; floored, a near pair's weight is at most
#: ``1 / r_f = 4096`` and its value is off by at most ``r_f`` (within "high"'s budget; the
#: switch keeps the expansion's own error in ``r`` within the budget too).
FAST_SQUARE_FLOOR = 2.0**-24 / (2.0 * LN2)
#: ``c r`` is capped here: ``exp(-Z_MAX)`` underflows to 0 in float64 (and float32), and the
#: polynomial factor stays finite.
Z_MAX = 1024.0


def check_kernel(kernel) -> str:
    """``kernel`` if it names a profile, else a ``ValueError`` naming the argument."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def _matern_parts(kernel: str, squared, distance_per_root: float, exp2, rsqrt, *, fast: bool):
    """``(u, exp(-z), 1 / u)`` of a Matérn profile with ``u = sqrt(squared)``, ``z = a u``
    (``a = c distance_per_root``), from ``squared = r^2 / distance_per_root^2`` (``-t`` in
    base-2 units, ``s`` in natural ones), floored and capped as the module says. The fast
    kernels' exponents are finite (the expansion of budget-bound points): no cap there."""
    rate = MATERN[kernel]
    floor = FAST_SQUARE_FLOOR if fast and kernel == "matern12" else SQUARE_FLOOR
    if fast:
        squared = jnp.maximum(squared, floor)
    else:  # clipped before the square root: rsqrt(inf) = 0 would give inf * 0 = NaN
        squared = jnp.clip(squared, floor, (Z_MAX / (rate * distance_per_root)) ** 2)
    inverse_root = rsqrt(squared)
    root = squared * inverse_root
    decay = exp2((-rate * distance_per_root * LOG2E) * root)
    return root, decay, inverse_root


def _matern_value(kernel: str, root, decay, a: float, clamp: bool):
    """``poly(z) exp(-z)`` with the polynomial in ``u = z / a`` (its coefficients scaled:
    multiply-adds only)."""
    if kernel == "matern12":
        return decay  # exp2 of a non-positive number: at most 1
    if kernel == "matern32":
        value = (a * root + 1.0) * decay
    else:
        value = ((a * a / 3.0 * root + a) * root + 1.0) * decay
    return jnp.minimum(value, 1.0) if clamp else value


def _matern_weight(
    kernel: str, root, decay, inverse_root, a: float, distance_per_root: float, coincident
):
    """``phi``: Matérn-1/2's ``exp(-r) / r`` (``r = distance_per_root u``; 0 where
    ``coincident``), ``3 exp(-z)``, ``5/3 (1 + z) exp(-z)``."""
    if kernel == "matern12":
        weight = decay * (inverse_root * (1.0 / distance_per_root))
        return weight if coincident is False else jnp.where(coincident, 0.0, weight)
    if kernel == "matern32":
        return 3.0 * decay
    return (5.0 / 3.0 * a * root + 5.0 / 3.0) * decay


# ------------------------------------------------------------------------------------------
# The kernels' form: from the base-2 exponent t = -log2(e) r^2 / 2 <= 0

#: ``r = BASE2_DISTANCE sqrt(-t)``: ``r^2 = 2 ln(2) (-t)``.
BASE2_DISTANCE = math.sqrt(2.0 * LN2)


def kernel_values(
    kernel: str, t, *, exp2=jnp.exp2, rsqrt=lax.rsqrt, clamp: bool = True, fast: bool = False
):
    """Kernel values from base-2 exponents ``t`` (``-inf`` far away; the fast path's may exceed
    0 by a rounding error). ``exp2`` and ``rsqrt``: the backend's (its exp unit's) operations.
    ``clamp=False`` skips the Matérn values' clamp at 1 where they are rounded to bfloat16
    next (the rounding takes values within ``2^-9`` of 1 to at most 1). ``fast``: exponents
    from the expansion (Matérn-1/2's distance floored at ``FAST_SQUARE_FLOOR``). The Gaussian
    kernel's value is ``exp2(t)`` exactly."""
    if kernel == "rbf":
        return exp2(t)
    root, decay, _ = _matern_parts(kernel, -t, BASE2_DISTANCE, exp2, rsqrt, fast=fast)
    return _matern_value(kernel, root, decay, MATERN[kernel] * BASE2_DISTANCE, clamp)


def values_and_weights(
    kernel: str, t, *, exp2=jnp.exp2, rsqrt=lax.rsqrt, clamp: bool = True, fast: bool = False
):
    """``(kernel values, pair weights phi)`` from base-2 exponents ``t``, sharing the exp unit's
    operations (for the Gaussian kernel one ``exp2``, the same array twice). ``fast`` as in
    :func:`kernel_values`: there Matérn-1/2's weight of a near pair is ``exp(-r_f) / r_f``
    (``t`` near 0 is the expansion's rounding, not a coincidence); from differences it is 0 at
    ``t = 0``, the convention."""
    if kernel == "rbf":
        p = exp2(t)
        return p, p
    root, decay, inverse_root = _matern_parts(kernel, -t, BASE2_DISTANCE, exp2, rsqrt, fast=fast)
    a = MATERN[kernel] * BASE2_DISTANCE
    value = _matern_value(kernel, root, decay, a, clamp)
    coincident = False if fast else t >= 0
    weight = _matern_weight(kernel, root, decay, inverse_root, a, BASE2_DISTANCE, coincident)
    return value, weight


def mufu_ops_per_pair(kernel: str, *, backward: bool = False) -> int:
    """Exp-unit (``MUFU``) operations a pair costs in the kernels: ``exp2``, and for a Matérn
    kernel ``rsqrt`` too (its weight reuses both)."""
    del backward  # value and weight share the same two operations
    return 1 if kernel == "rbf" else 2


# ------------------------------------------------------------------------------------------
# The plain-XLA form: from s = r^2 / 2, differentiable

#: ``r = NATURAL_DISTANCE sqrt(s)``.
NATURAL_DISTANCE = math.sqrt(2.0)


def _weight_of_half_sq(kernel: str, half_sq):
    """``phi(s) = -dk/ds``, plain JAX (differentiable: higher derivatives away from ``r = 0``)."""
    if kernel == "rbf":
        return jnp.exp(-half_sq)
    root, decay, inverse_root = _matern_parts(kernel, half_sq, NATURAL_DISTANCE, jnp.exp2,
                                              lax.rsqrt, fast=False)  # fmt: skip
    a = MATERN[kernel] * NATURAL_DISTANCE
    return _matern_weight(kernel, root, decay, inverse_root, a, NATURAL_DISTANCE,
                          half_sq <= 0)  # fmt: skip


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _matern_half_sq(kernel: str, half_sq):
    root, decay, _ = _matern_parts(kernel, half_sq, NATURAL_DISTANCE, jnp.exp2, lax.rsqrt,
                                   fast=False)  # fmt: skip
    return _matern_value(kernel, root, decay, MATERN[kernel] * NATURAL_DISTANCE, clamp=True)


@_matern_half_sq.defjvp
def _matern_half_sq_jvp(kernel, primals, tangents):
    (half_sq,), (d_half_sq,) = primals, tangents
    weight = _weight_of_half_sq(kernel, half_sq)
    # A zero weight (far pairs, r = 0 for Matérn-1/2) times an infinite tangent stays 0.
    tangent = jnp.where(weight == 0, 0.0, -weight * d_half_sq)
    return _matern_half_sq(kernel, half_sq), tangent


def half_sq_kernel(kernel: str, half_sq: jax.Array) -> jax.Array:
    """Kernel values from ``s = r^2 / 2 >= 0`` (``inf`` far away), in ``half_sq``'s dtype.

    The Gaussian kernel is ``exp(-s)`` (JAX's own derivatives); the Matérn kernels differentiate
    to ``-phi(s) ds`` (the module's conventions at ``r = 0``), and their higher derivatives are
    exact away from ``r = 0``.
    """
    if kernel == "rbf":
        return jnp.exp(-half_sq)
    return _matern_half_sq(kernel, half_sq)


def value_error_bound(kernel: str, exponent_error):
    """Worst-case relative error of a kernel value whose ``s = r^2 / 2`` is off by at most
    ``exponent_error`` (absolute; for the Gaussian kernel it is the value's relative error):
    ``|d log k / ds| <= 1, 5/3, 3`` for the Gaussian, Matérn-5/2 and Matérn-3/2 kernels, and for
    Matérn-1/2 ``|dr| <= sqrt(2 ds)`` (its slope in ``s`` is unbounded at ``r = 0``)."""
    if kernel == "matern12":
        return jnp.sqrt(2.0 * exponent_error)
    return {"rbf": 1.0, "matern32": 3.0, "matern52": 5.0 / 3.0}[kernel] * exponent_error
