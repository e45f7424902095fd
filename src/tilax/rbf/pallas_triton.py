"""Pallas kernels (Triton backend on GPU, interpret mode on CPU) for RBF kernel sums.

Every kernel here works on *augmented* point arrays ``x: [B, P, Dp]`` and ``y: [B, L, Dp]``
whose row dot product is already the base-2 exponent of the kernel value::

    t[i, l] = x[i] . y[l]           kernel value  exp2(t[i, l])

``tilax.rbf.api`` builds them from the scaled points (``q / lengthscale``) so that
``t = -0.5 * log2(e) * ||q_i - k_l||^2`` (plus ``log2(w_l)`` for the KDE). This turns the
distance into one tensor-core dot with no element-wise work per pair beyond a single ``exp2``,
and the same kernels serve queries and keys with their roles swapped (the backward pass needs
both directions). Rows that pad the point count to a tile multiple are built by the caller so
that they contribute exactly zero (zero values or a ``-1e30`` exponent).

Each program owns one tile of ``x`` rows (and one tile of output columns) and loops over all
tiles of ``y`` with ``lax.fori_loop`` over ``pl.ds`` slices of the full ``y`` block, so the
accumulators stay in registers and no ``P x L`` matrix ever exists in memory.

Dots take a *mode* naming how float32 operands are multiplied (accumulation is float32):

* ``"ieee"``: full float32 products on the FMA units (slow: no tensor cores);
* ``"tf32x3"``: each operand split into TF32 ``hi + lo``; ``hi*hi + hi*lo + lo*hi`` on tensor
  cores, relative error ~2**-21 per product. Used for the distance dot, whose operands are loaded
  tiles, so the split costs nothing per pair (but the three partial products cost two adds);
* ``"tf32_parts"``: the same product from operands that ``tf32x3_parts`` laid out in memory as
  ``[hi | lo | hi]`` and ``[hi | hi | lo]``: one TF32 dot over the concatenation, no adds. Used
  by the forward kernels, where the wider copies are transient;
* ``"bf16x3"``: bfloat16 ``hi + lo`` parts, relative error ~2**-16 per product, for dots with a
  per-pair operand (kernel values, gradient weights): splitting a float32 tile into bfloat16
  parts is ~3 instructions per element, and a bfloat16 tile feeds the next tensor-core dot
  straight from registers (a float32/TF32 one needs shuffles);
* ``"bf16"``: operands rounded to bfloat16 (8-bit mantissa), relative error ~2**-9 per product.

The splits are written out here (not left to Triton's ``tf32x3``, which adds a NaN select per
output element), so the interpret mode on CPU computes the same rounded parts as the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax._pallas import Backend, pallas_call

DOT_MODES = ("ieee", "tf32x3", "tf32_parts", "bf16x3", "bf16")


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


def _split(a: jax.Array, mode: str) -> tuple[jax.Array, ...]:
    """The parts a ``mode`` dot multiplies: ``(a,)``, ``(bf16(a),)`` or ``(hi, lo)``."""
    if mode in ("ieee", "tf32_parts"):
        return (a,)
    if mode == "bf16":
        return (a.astype(jnp.bfloat16),)
    if mode == "bf16x3":
        hi = _round_to_bf16(a)  # exact in bfloat16, so the cast below is exact
        return hi.astype(jnp.bfloat16), (a - hi).astype(jnp.bfloat16)
    if mode == "tf32x3":
        hi = _round_to_tf32(a)
        return hi, _round_to_tf32(a - hi)
    raise ValueError(f"unknown dot mode {mode!r}; expected one of {DOT_MODES}")


def tf32x3_parts(x: jax.Array, *, first: bool) -> jax.Array:
    """``x: [..., K]`` float32 as TF32 parts, ``[hi | lo | hi]`` (``first``) or ``[hi | hi | lo]``.

    Zero-padded to ``max(16, next_power_of_2(3 K))`` columns. The dot of a ``first`` and a
    second operand is ``hi.hi + lo.hi + hi.lo``, the ``"tf32x3"`` product, in one TF32 dot.
    """
    hi = _round_to_tf32(x)
    lo = _round_to_tf32(x - hi)
    parts = jnp.concatenate([hi, lo, hi] if first else [hi, hi, lo], axis=-1)
    width = max(16, 1 << (parts.shape[-1] - 1).bit_length())
    return jnp.pad(parts, [(0, 0)] * (x.ndim - 1) + [(0, width - parts.shape[-1])])


def _dot(a_parts, b_parts, mode: str, backend: Backend, *, b_transposed: bool = False):
    """``a @ b`` (or ``a @ b.T``) from ``_split`` parts, float32 accumulation."""
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
    return dot(a_lo, b_hi) + dot(a_hi, b_lo) + dot(a_hi, b_hi)


def _tile(index: jax.Array, size: int) -> pl.Slice:
    return pl.ds(pl.multiple_of(index * size, size), size)


def _exponent(x_parts, y_parts, distance: str, backend: Backend) -> jax.Array:
    """``t[i, l] = x_i . y_l`` (base-2 exponents) from ``_split`` parts."""
    return _dot(x_parts, y_parts, distance, backend, b_transposed=True)


# --------------------------------------------------------------------------------------------
# out[i] = sum_l exp2(x_i . y_l) v_l


def _kernel_matmul_kernel(x_ref, y_ref, v_ref, out_ref, *, block_l, distance, values, backend):
    x = _split(x_ref[...], distance)
    num_tiles = y_ref.shape[0] // block_l

    def body(j, acc):
        rows = _tile(j, block_l)
        p = jnp.exp2(_exponent(x, _split(y_ref[rows, :], distance), distance, backend))
        return acc + _dot(_split(p, values), _split(v_ref[rows, :], values), values, backend)

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    out_ref[...] = lax.fori_loop(0, num_tiles, body, acc).astype(out_ref.dtype)


def kernel_matmul(
    x: jax.Array,
    y: jax.Array,
    v: jax.Array,
    *,
    block_p: int,
    block_l: int,
    block_o: int,
    distance: str,
    values: str,
    backend: Backend,
    num_warps: int | None = 4,
    num_stages: int | None = 2,
) -> jax.Array:
    """``out[b, i, :] = sum_l exp2(x[b, i] . y[b, l]) * v[b, l, :]``, float32 ``[B, P, O]``.

    ``x: [B, P, Dp]``, ``y: [B, L, Dp]``, ``v: [B, L, O]`` float32 (or bfloat16 for a ``"bf16"``
    values mode) with ``P``, ``L`` and ``O``
    multiples of ``block_p``, ``block_l`` and ``block_o``. Grid: (P tiles, O tiles, batch).
    """
    batch, num_p, dim = x.shape
    num_l, num_o = y.shape[1], v.shape[2]
    kernel = functools.partial(
        _kernel_matmul_kernel, block_l=block_l, distance=distance, values=values, backend=backend
    )
    return pallas_call(
        kernel,
        backend=backend,
        num_warps=num_warps,
        num_stages=num_stages,
        grid=(num_p // block_p, num_o // block_o, batch),
        in_specs=[
            pl.BlockSpec((pl.squeezed, block_p, dim), lambda i, o, b: (b, i, 0)),
            pl.BlockSpec((pl.squeezed, num_l, dim), lambda i, o, b: (b, 0, 0)),
            pl.BlockSpec((pl.squeezed, num_l, block_o), lambda i, o, b: (b, 0, o)),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, block_p, block_o), lambda i, o, b: (b, i, o)),
        out_shape=jax.ShapeDtypeStruct((batch, num_p, num_o), jnp.float32),
        name="rbf_kernel_matmul",
    )(x, y, v)


# --------------------------------------------------------------------------------------------
# r[i] = sum_l exp2(x_i . y_l) (u_i . w_l) y_l        (and optionally pw[i] = sum_l exp2(.) w_l)


def _kernel_matmul_grad_kernel(
    x_ref, y_ref, u_ref, w_ref, r_ref, *pw_refs, block_l, block_o, distance, values, coords, backend
):
    x = _split(x_ref[...], distance)
    num_tiles = y_ref.shape[0] // block_l
    chunks = [pl.ds(o * block_o, block_o) for o in range(u_ref.shape[1] // block_o)]
    # Narrow value tiles stay in registers for the whole loop; wide ones are re-read per tile.
    hoisted_u = None
    if len(chunks) * block_o <= 64:
        hoisted_u = [_split(u_ref[:, c], values) for c in chunks]

    def body(j, carry):
        r_acc, pw_acc = carry
        rows = _tile(j, block_l)
        y = y_ref[rows, :]
        p = jnp.exp2(_exponent(x, _split(y, distance), distance, backend))
        p_parts = _split(p, values) if pw_refs else None
        uw = None  # not zeros: 0.0 + x costs an add per pair (it is not x for x = -0.0)
        new_pw = []
        for o, c in enumerate(chunks):
            w = _split(w_ref[rows, c], values)
            u = hoisted_u[o] if hoisted_u is not None else _split(u_ref[:, c], values)
            uw_o = _dot(u, w, values, backend, b_transposed=True)
            uw = uw_o if uw is None else uw + uw_o
            if pw_refs:
                new_pw.append(pw_acc[o] + _dot(p_parts, w, values, backend))
        r_acc = r_acc + _dot(_split(p * uw, coords), _split(y, coords), coords, backend)
        return r_acc, tuple(new_pw)

    r0 = jnp.zeros(r_ref.shape, jnp.float32)
    pw0 = tuple(jnp.zeros((r_ref.shape[0], block_o), jnp.float32) for _ in chunks if pw_refs)
    r_acc, pw_acc = lax.fori_loop(0, num_tiles, body, (r0, pw0))
    r_ref[...] = r_acc
    for pw_ref in pw_refs:
        for c, acc in zip(chunks, pw_acc, strict=True):
            pw_ref[:, c] = acc


def kernel_matmul_grad(
    x: jax.Array,
    y: jax.Array,
    u: jax.Array,
    w: jax.Array,
    *,
    with_pw: bool,
    block_p: int,
    block_l: int,
    block_o: int,
    distance: str,
    values: str,
    coords: str,
    backend: Backend,
    num_warps: int | None = 4,
    num_stages: int | None = 2,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The pair sums the backward pass of ``kernel_matmul`` needs, in one sweep over ``y``.

    With ``K[i, l] = exp2(x_i . y_l)`` this returns ``r[b, i] = sum_l K[i, l] (u_i . w_l) y_l``
    (``[B, P, Dp]``) and, when ``with_pw``, also ``pw[b, i] = sum_l K[i, l] w_l`` (``[B, P, O]``).
    With ``(x, y, u, w) = (queries, keys, dout, v)`` ``r`` carries the query gradient; with the
    roles swapped it carries the key gradient and ``pw`` is the value gradient.
    ``u: [B, P, O]``, ``w: [B, L, O]``; tile rules as in ``kernel_matmul``. Grid: (P tiles, batch).
    """
    batch, num_p, dim = x.shape
    num_l, num_o = y.shape[1], u.shape[2]
    kernel = functools.partial(
        _kernel_matmul_grad_kernel,
        block_l=block_l,
        block_o=block_o,
        distance=distance,
        values=values,
        coords=coords,
        backend=backend,
    )
    out_specs = [pl.BlockSpec((pl.squeezed, block_p, dim), lambda i, b: (b, i, 0))]
    out_shape = [jax.ShapeDtypeStruct((batch, num_p, dim), jnp.float32)]
    if with_pw:
        out_specs.append(pl.BlockSpec((pl.squeezed, block_p, num_o), lambda i, b: (b, i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((batch, num_p, num_o), jnp.float32))
    out = pallas_call(
        kernel,
        backend=backend,
        num_warps=num_warps,
        num_stages=num_stages,
        grid=(num_p // block_p, batch),
        in_specs=[
            pl.BlockSpec((pl.squeezed, block_p, dim), lambda i, b: (b, i, 0)),
            pl.BlockSpec((pl.squeezed, num_l, dim), lambda i, b: (b, 0, 0)),
            pl.BlockSpec((pl.squeezed, block_p, num_o), lambda i, b: (b, i, 0)),
            pl.BlockSpec((pl.squeezed, num_l, num_o), lambda i, b: (b, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        name="rbf_kernel_matmul_grad",
    )(x, y, u, w)
    return tuple(out) if with_pw else out[0]


# --------------------------------------------------------------------------------------------
# lse[i] = log2 sum_l exp2(x_i . y_l), streaming over tiles of y (running max and rescaled sum)


def _kernel_logsumexp_kernel(x_ref, y_ref, out_ref, *, block_l, distance, backend):
    x = _split(x_ref[...], distance)
    num_tiles = y_ref.shape[0] // block_l

    def body(j, carry):
        running_max, running_sum = carry
        t = _exponent(x, _split(y_ref[_tile(j, block_l), :], distance), distance, backend)
        new_max = jnp.maximum(running_max, jnp.max(t, axis=1))
        rescaled = running_sum * jnp.exp2(running_max - new_max)
        return new_max, rescaled + jnp.sum(jnp.exp2(t - new_max[:, None]), axis=1)

    # exp2(-inf - finite) = 0 clears the initial sum at the first tile. Padded (and zero-weight)
    # points have exponents near -1e30: a tile of only those adds its count at a -1e30 max, which
    # the first real point's exp2(-1e30 - max) = 0 rescale clears again (one real point exists).
    init = (jnp.full(out_ref.shape, -jnp.inf, jnp.float32), jnp.zeros(out_ref.shape, jnp.float32))
    running_max, running_sum = lax.fori_loop(0, num_tiles, body, init)
    out_ref[...] = running_max + jnp.log2(running_sum)


def kernel_logsumexp(
    x: jax.Array,
    y: jax.Array,
    *,
    block_p: int,
    block_l: int,
    distance: str,
    backend: Backend,
    num_warps: int | None = 4,
    num_stages: int | None = 2,
) -> jax.Array:
    """``lse[b, i] = log2 sum_l exp2(x[b, i] . y[b, l])``, float32 ``[B, P]``.

    Finite even where every ``exp2`` underflows (queries far from all points): the running
    maximum is subtracted before exponentiating. Grid: (P tiles, batch).
    """
    batch, num_p, dim = x.shape
    num_l = y.shape[1]
    kernel = functools.partial(
        _kernel_logsumexp_kernel, block_l=block_l, distance=distance, backend=backend
    )
    return pallas_call(
        kernel,
        backend=backend,
        num_warps=num_warps,
        num_stages=num_stages,
        grid=(num_p // block_p, batch),
        in_specs=[
            pl.BlockSpec((pl.squeezed, block_p, dim), lambda i, b: (b, i, 0)),
            pl.BlockSpec((pl.squeezed, num_l, dim), lambda i, b: (b, 0, 0)),
        ],
        out_specs=pl.BlockSpec((pl.squeezed, block_p), lambda i, b: (b, i)),
        out_shape=jax.ShapeDtypeStruct((batch, num_p), jnp.float32),
        name="rbf_kernel_logsumexp",
    )(x, y)
