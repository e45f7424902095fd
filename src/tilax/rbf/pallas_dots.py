"""Dot products of float32 tiles inside the RBF Pallas kernels, at a chosen precision.

Dots take a *mode* naming how float32 operands are multiplied (accumulation is float32):

* ``"ieee"``: full float32 products on the FMA units (slow: no tensor cores);
* ``"tf32x3"``: each operand split into TF32 ``hi + lo``; ``hi*hi + hi*lo + lo*hi`` on tensor
  cores, relative error ~2**-21 per product (float32-accurate);
* ``"tf32_parts"``: the same product from operands that ``tf32x3_parts`` laid out in memory as
  ``[hi | lo | hi]`` and ``[hi | hi | lo]``: one TF32 dot over the concatenation, no adds;
* ``"bf16x3"``: bfloat16 ``hi + lo`` parts, relative error ~2**-16 per product; a bfloat16 tile
  feeds the next tensor-core dot straight from registers;
* ``"bf16x2"``: the first operand rounded to bfloat16, the second in ``hi + lo`` parts:
  ``a_hi b_hi + a_hi b_lo``, each product's error at most 2**-8 relative to ``a``, ~2**-16 to ``b``.
  For pair weights times coordinates whose sums are differenced with the weights' row sum
  from the same product (the weights' rounding is then a perturbation of the weights, not
  amplified by the cancellation; the coordinates' rounding would be);
* ``"bf16"``: operands rounded to bfloat16 (8-bit mantissa), relative error ~2**-9 per product.

The splits are written out here (not left to Triton's ``tf32x3``, which adds a NaN select per
output element), so the interpret mode on CPU computes the same rounded parts as the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tilax._pallas import Backend

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
