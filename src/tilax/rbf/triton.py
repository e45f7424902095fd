"""Pallas kernels (Triton backend on GPU, interpret mode on CPU) for RBF kernel sums.

Every kernel computes base-2 exponents ``t[i, l]`` between the rows ``i`` of one point set (the
program's tile) and all rows ``l`` of another (a loop over tiles with ``lax.fori_loop``, so the
accumulators stay in registers and no ``P x L`` matrix exists in memory); kernel values are
``exp2(t)``. How ``t`` is formed is a static *distance*:

* :class:`Expansion`: ``t = min(x_i . y_l, 0)`` for *augmented* points ``x: [B, P, W]``,
  ``y: [B, L, W]`` whose dot product is the exponent (``tilax.rbf.vjp`` builds them).
  One tensor-core dot per tile; its error grows with the points' norms
  (``tilax.rbf.numerics.expansion_error_bound``).
* :class:`Difference`: ``t = -sum_d (r_d (x[d, i] - y[d, l]))^2`` for *transposed* coordinates
  ``x: [B, Dx, P]``, ``y: [B, Dx, L]`` pre-scaled by powers of two and a residual scale ``r``
  (one per dimension, or one in all). Per pair and dimension a subtraction, a multiply (none
  for one shared scale) and a fused multiply-add on the FMA units; exact at any scale.

The gradient kernels may add per-row exponent offsets (``x_offset[i]``, ``y_offset[l]``: minus
the KDE log-sum-exp's row maximum); their exponents are then clamped at ``EXPONENT_LIMIT``.
Rows of ``y`` at or beyond ``valid_l`` are padding: they are masked by their index in the last
tile, and tiles past it are never visited.

Products with values, cotangents and coordinates are dots of a chosen *mode*
(``tilax.rbf.numerics.dot``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tilax._pallas import Backend, pallas_call
from tilax.rbf import profiles
from tilax.rbf.numerics import (
    DIM_CHUNK,
    FLOAT32_MAX,
    HOISTED_DIMS,
    Difference,
    Distance,
    Expansion,
    dot,
    split,
)

#: Largest base-2 exponent relative to a log-sum-exp's row maximum (taken over weighted points):
#: a zero-weight point closer than every weighted one has ``K / S`` above 1; the clamp keeps its
#: terms finite.
EXPONENT_LIMIT = 64.0
def _tile(index, size: int) -> pl.Slice:
    """Rows ``[index * size, (index + 1) * size)``; a traced start is marked as a multiple."""
    if isinstance(index, int):
        return pl.ds(index * size, size)
    return pl.ds(pl.multiple_of(index * size, size), size)


# --------------------------------------------------------------------------------------------
# Operands beside the points: the residual scale and per-row vectors


def _row_vectors(block_p: int, num_l: int, vectors: dict):
    """(names, arrays, specs) of the present optional operands, in a fixed order: ``scale``
    (``[Dr]``, whole), program-row vectors ``x_*`` (``[B, P]``, the program's tile) and loop-row
    vectors ``y_*`` (``[B, L]``, whole)."""
    names = tuple(name for name in sorted(vectors) if vectors[name] is not None)
    specs = []
    for name in names:
        if name == "scale":
            specs.append(pl.BlockSpec(vectors[name].shape, lambda *g: (0,)))
        elif name.startswith("x_"):
            specs.append(pl.BlockSpec((pl.squeezed, block_p), lambda *g: (g[-1], g[0])))
        else:
            specs.append(pl.BlockSpec((pl.squeezed, num_l), lambda *g: (g[-1], 0)))
    return names, [vectors[name] for name in names], specs


def _split_refs(refs, names):
    """``{name: ref}`` of the optional operands (``names``) and the remaining refs."""
    return dict(zip(names, refs[: len(names)], strict=True)), refs[len(names) :]


def _point_specs(distance: Distance, block_p: int, x: jax.Array, y: jax.Array):
    """BlockSpecs of the program's points and of all loop points (grid: program tile first,
    batch last)."""
    if isinstance(distance, Expansion):
        program = pl.BlockSpec((pl.squeezed, block_p, x.shape[2]), lambda *g: (g[-1], g[0], 0))
    else:
        program = pl.BlockSpec((pl.squeezed, x.shape[1], block_p), lambda *g: (g[-1], 0, g[0]))
    loop = pl.BlockSpec((pl.squeezed, *y.shape[1:]), lambda *g: (g[-1], 0, 0))
    return program, loop


def _num_rows(distance: Distance, points: jax.Array) -> int:
    return points.shape[-1] if isinstance(distance, Difference) else points.shape[1]


# --------------------------------------------------------------------------------------------
# Exponents of the program's rows against one tile of loop rows


@dataclasses.dataclass(frozen=True)
class _LoopTile:
    """Rows ``rows`` of the loop points ``ref``; ``coords``: their coordinate rows, loaded
    already (``_Pairs.prefetch``), or ``None``: read from ``ref`` where used."""

    ref: object
    rows: pl.Slice
    coords: tuple | None = None

    def coordinate(self, d):
        return self.coords[d] if self.coords is not None else self.ref[d, self.rows]


@dataclasses.dataclass(frozen=True)
class _Pairs:
    """Exponents of a program's rows against loop tiles, for a static distance and backend."""

    distance: Distance
    backend: Backend

    def program_points(self, x_ref):
        """What every tile needs of the program's points: dot parts (expansion), or coordinate
        rows (differences; for many dimensions, the ref itself: rows are re-read per tile
        rather than held in registers)."""
        if isinstance(self.distance, Expansion):
            return split(x_ref[...], self.distance.mode)
        if self.distance.dim > HOISTED_DIMS:
            return x_ref
        return [x_ref[d, :] for d in range(self.distance.dim)]

    def scales(self, scale_ref):
        """Per-dimension residual scales (the ref itself beyond ``HOISTED_DIMS``), or the
        squared shared one (applied to the sum)."""
        if isinstance(self.distance, Expansion):
            return None
        if self.distance.per_dimension and self.distance.dim > HOISTED_DIMS:
            return scale_ref
        if self.distance.per_dimension:
            return [scale_ref[d] for d in range(self.distance.dim)]
        return scale_ref[0] * scale_ref[0]

    def prefetch(self, y_ref, block_l: int):
        """``j -> `` the coordinate rows of loop tile ``j`` (differences of up to
        ``HOISTED_DIMS`` dimensions), for ``_loop_tiles`` to load a step ahead; else ``None``.
        Triton pipelines only the loads that feed dots: loaded where they are used, these
        left the exact forward waiting on memory (ncu on the H200: long-scoreboard stalls
        first)."""
        if isinstance(self.distance, Expansion) or self.distance.dim > HOISTED_DIMS:
            return None
        return lambda j: tuple(y_ref[d, _tile(j, block_l)] for d in range(self.distance.dim))

    def difference(self, points, scales, tile: _LoopTile, d, *, scaled=True):
        """``e_d = x_d - y_d`` of the program's rows against the loop tile (``d`` may be
        traced), times the residual scale where it is per dimension (and ``scaled``)."""
        e = points[d][:, None] - tile.coordinate(d)[None, :]
        return e * scales[d] if scaled and self.distance.per_dimension else e

    def exp2(self, t):
        """``2^t``: on a GPU one ``ex2.approx.ftz`` (Triton's own calls libdevice's
        ``exp2f``, which adds instructions for subnormal results; here those are 0)."""
        if self.backend == "interpret":
            return jnp.exp2(t)
        [result] = pltriton.elementwise_inline_asm(
            "ex2.approx.ftz.f32 $0, $1;", args=[t], constraints="=f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(t.shape, jnp.float32)],
        )  # fmt: skip
        return result

    def rsqrt(self, x):
        """``1 / sqrt(x)``: on a GPU one ``rsqrt.approx.ftz`` (the exp unit, like ``exp2``)."""
        if self.backend == "interpret":
            return lax.rsqrt(x)
        [result] = pltriton.elementwise_inline_asm(
            "rsqrt.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
        )  # fmt: skip
        return result

    def values(self, profile: str, t):
        """The kernel values of exponents ``t`` (``profiles.kernel_values``; ``exp2(t)`` for
        the Gaussian kernel)."""
        return profiles.kernel_values(profile, t, exp2=self.exp2, rsqrt=self.rsqrt,
                                      fast=isinstance(self.distance, Expansion))

    def values_and_weights(self, profile: str, t):
        """``(kernel values, pair weights)`` of exponents ``t``
        (``profiles.values_and_weights``: one array twice for the Gaussian kernel)."""
        return profiles.values_and_weights(profile, t, exp2=self.exp2, rsqrt=self.rsqrt,
                                           fast=isinstance(self.distance, Expansion))

    def fma(self, a, b, c):
        """``a * b + c``, rounded once on a GPU. Pallas's Triton lowering emits the multiply and
        the add apart, separately rounded (ncu on the H200: not one fused instruction in the
        exact kernels, which spend most of their issue slots on them), so it is PTX there."""
        if self.backend == "interpret":
            return a * b + c
        [result] = pltriton.elementwise_inline_asm(
            "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
        )  # fmt: skip
        return result

    def exponent(self, points, scales, tile: _LoopTile):
        """``t <= 0`` for the loop tile's rows. The gradient kernels recompute the differences
        they sum rather than keep these: held across the exponent, they made the key-gradient
        kernel spill (312 bytes a thread at its H200 launch, none when recomputed)."""
        distance = self.distance
        if isinstance(distance, Expansion):
            y = split(tile.ref[tile.rows, :], distance.mode)
            return jnp.minimum(dot(points, y, distance.mode, self.backend, b_transposed=True), 0.0)

        def add_square(d, s):
            """``s + e_d^2``: one fused multiply-add, or (``rounded``) the square rounded
            first, in a form no compiler fuses."""
            e = self.difference(points, scales, tile, d)
            if distance.rounded:
                return s + jnp.maximum(e * e, 0.0)
            return e * e if s is None else self.fma(e, e, s)

        if distance.dim > HOISTED_DIMS:  # a loop over dimensions: compact code, few registers
            shape = (points.shape[-1], tile.rows.size)
            s = lax.fori_loop(0, distance.dim, add_square, jnp.zeros(shape, jnp.float32))
        else:
            s = None if not distance.rounded else jnp.zeros((points[0].size, tile.rows.size))
            for d in range(distance.dim):
                s = add_square(d, s)
        return s * -scales if not distance.per_dimension else -s


def _loop_tiles(body, carry, valid_l: int, block_l: int, y_ref, prefetch=None):
    """``body(j, carry, masked, tile)`` over the loop tiles ``tile`` (a :class:`_LoopTile` of
    ``y_ref``) holding rows ``[0, valid_l)``: a loop over the full ones, then the partial last
    tile (if any) with ``masked=True``. With ``prefetch`` (``_Pairs.prefetch``), each step
    loads the next tile's coordinates before it computes on its own."""
    full, partial = divmod(valid_l, block_l)
    last = full + (1 if partial else 0) - 1

    def step(j, state, masked):
        carry, coords = state
        following = prefetch(jnp.minimum(j + 1, last)) if prefetch else ()
        tile = _LoopTile(y_ref, _tile(j, block_l), coords if prefetch else None)
        return body(j, carry, masked, tile), following

    state = (carry, prefetch(0) if prefetch else ())
    state = lax.fori_loop(0, full, lambda j, s: step(j, s, False), state)
    if partial:
        state = step(full, state, True)
    return state[0]


def _valid_columns(j, block_l: int, valid_l: int) -> jax.Array:
    """``[1, block_l]`` booleans: which rows of loop tile ``j`` are below ``valid_l``."""
    index = j * block_l + lax.broadcasted_iota(jnp.int32, (1, block_l), 1)
    return index < valid_l


# --------------------------------------------------------------------------------------------
# out[i] = sum_l k(t[i, l]) v_l, k the kernel profile (exp2 for the Gaussian kernel)


def _kernel_matmul_kernel(x_ref, y_ref, *refs, pairs, names, valid_l, block_l, values, profile):
    optional, (v_ref, out_ref) = _split_refs(refs, names)
    points = pairs.program_points(x_ref)
    scales = pairs.scales(optional.get("scale"))

    def body(j, acc, masked, tile):
        rows = tile.rows
        p = pairs.values(profile, pairs.exponent(points, scales, tile))
        if masked:
            p = jnp.where(_valid_columns(j, block_l, valid_l), p, 0.0)
        return acc + dot(split(p, values), split(v_ref[rows, :], values), values, pairs.backend)

    acc = jnp.zeros(out_ref.shape, jnp.float32)
    acc = _loop_tiles(body, acc, valid_l, block_l, y_ref, pairs.prefetch(y_ref, block_l))
    out_ref[...] = acc.astype(out_ref.dtype)


def kernel_matmul(
    x: jax.Array,
    y: jax.Array,
    v: jax.Array,
    *,
    distance: Distance,
    valid_l: int,
    block_p: int,
    block_l: int,
    block_o: int,
    values: str,
    backend: Backend,
    scale: jax.Array | None = None,
    num_warps: int | None = 4,
    num_stages: int | None = 2,
    profile: str = "rbf",
) -> jax.Array:
    """``out[b, i, :] = sum_{l < valid_l} k(t[b, i, l]) * v[b, l, :]``, float32 ``[B, P, O]``,
    with ``k`` the kernel ``profile`` of the base-2 exponent (``tilax.rbf.profiles``; the
    Gaussian kernel's ``exp2(t)`` by default).

    ``x``, ``y``: points in ``distance``'s layout (module docstring) with ``P``, ``L`` multiples
    of ``block_p``, ``block_l``; ``v: [B, L, O]`` float32 (or bfloat16 for a ``"bf16"`` values
    mode), ``O`` a multiple of ``block_o``; ``scale: [Dr]`` for :class:`Difference`.
    Grid: (P tiles, O tiles, batch).
    """
    batch, num_p = x.shape[0], _num_rows(distance, x)
    num_l, num_o = v.shape[1], v.shape[2]
    program, loop = _point_specs(distance, block_p, x, y)
    names, optional, optional_specs = _row_vectors(block_p, num_l, dict(scale=scale))
    kernel = functools.partial(
        _kernel_matmul_kernel, pairs=_Pairs(distance, backend), names=names, valid_l=valid_l,
        block_l=block_l, values=values, profile=profile,
    )  # fmt: skip
    return pallas_call(
        kernel,
        backend=backend,
        num_warps=num_warps,
        num_stages=num_stages,
        grid=(num_p // block_p, num_o // block_o, batch),
        in_specs=[
            program, loop, *optional_specs,
            pl.BlockSpec((pl.squeezed, num_l, block_o), lambda i, o, b: (b, 0, o)),
        ],  # fmt: skip
        out_specs=pl.BlockSpec((pl.squeezed, block_p, block_o), lambda i, o, b: (b, i, o)),
        out_shape=jax.ShapeDtypeStruct((batch, num_p, num_o), jnp.float32),
        name="rbf_kernel_matmul",
    )(x, y, *optional, v)


# --------------------------------------------------------------------------------------------
# Gradient sums: with A[i, l] = phi(t[i, l]) * coefficient[i, l] (phi the profile's pair
# weight, tilax.rbf.profiles; exp2 for the Gaussian kernel),
#   Expansion:  sums[i] = sum_l A[i, l] y_l              (augmented columns, a dot)
#   Difference: sums[d, i] = sum_l A[i, l] e_d[i, l]    (e_d the scaled difference x_d - y_d)
#               squares[d, i] = sum_l A[i, l] e_d[i, l]^2   (with_squares, per dimension)
#               rows: sum_l A[i, l] (with_rowsum), then sum_l A[i, l] t[i, l] (with_squares,
#               shared scale): the lengthscale's gradient, pair by pair
# and optionally pw[i] = sum_l k(t[i, l]) w_l (k the kernel values). Difference kernels of
# more than DIM_CHUNK dimensions split the per-dimension sums over a grid axis of
# DIM_CHUNK-dimension chunks (each program recomputes the exponents): a program holds
# 2 DIM_CHUNK + 2 row accumulators at most.


def _kernel_matmul_grad_kernel(
    x_ref, y_ref, *refs, pairs, names, outputs, with_uw, with_rowsum, with_squares, valid_l,
    block_l, block_o, values, coords, profile,
):  # fmt: skip
    optional, refs = _split_refs(refs, names)
    u_ref, w_ref = refs[:2] if with_uw else (None, None)
    out = dict(zip(outputs, refs[2:] if with_uw else refs, strict=True))
    backend = pairs.backend
    distance = pairs.distance
    difference = isinstance(distance, Difference)
    points = pairs.program_points(x_ref)
    scales = pairs.scales(optional.get("scale"))
    x_offset = optional["x_offset"][...] if "x_offset" in optional else None
    x_coef = optional["x_coef"][...] if "x_coef" in optional else None
    y_offset_ref, y_coef_ref = optional.get("y_offset"), optional.get("y_coef")
    per_dim_squares = with_squares and difference and distance.per_dimension
    if difference:
        chunk = out["sums"].shape[0]  # dimensions of this program's sums
        first = pl.program_id(1) * chunk if distance.dim > chunk else 0
    chunks, hoisted_u = [], None
    if with_uw:
        chunks = [pl.ds(o * block_o, block_o) for o in range(u_ref.shape[1] // block_o)]
        # Narrow value tiles stay in registers for the whole loop; wide ones are re-read per tile.
        if len(chunks) * block_o <= 64:
            hoisted_u = [split(u_ref[:, c], values) for c in chunks]

    def body(j, carry, masked, tile):
        sums, squares, row_sums, pw_acc = carry
        rows = tile.rows
        t = distance_exponent = pairs.exponent(points, scales, tile)
        if y_offset_ref is not None or x_offset is not None:
            if y_offset_ref is not None:
                t = t + y_offset_ref[rows][None, :]
            if x_offset is not None:
                t = t + x_offset[:, None]
            t = jnp.minimum(t, EXPONENT_LIMIT)
        p, weights = pairs.values_and_weights(profile, t)
        if masked:
            valid = _valid_columns(j, block_l, valid_l)
            p = jnp.where(valid, p, 0.0)
            weights = p if profile == "rbf" else jnp.where(valid, weights, 0.0)
        a, new_pw = weights, []
        if with_uw:
            p_parts = split(p, values) if "pw" in out else None
            uw = None  # not zeros: 0.0 + x costs an add per pair (it is not x for x = -0.0)
            for o, c in enumerate(chunks):
                w = split(w_ref[rows, c], values)
                u = hoisted_u[o] if hoisted_u is not None else split(u_ref[:, c], values)
                uw_o = dot(u, w, values, backend, b_transposed=True)
                uw = uw_o if uw is None else uw + uw_o
                if "pw" in out:
                    new_pw.append(pw_acc[o] + dot(p_parts, w, values, backend))
            a = a * uw
        if x_coef is not None:
            a = a * x_coef[:, None]
        if y_coef_ref is not None:
            a = a * y_coef_ref[rows][None, :]
        if not difference:
            y = y_ref[rows, :]
            sums = sums + dot(split(a, coords), split(y, coords), coords, backend)
            return sums, squares, row_sums, tuple(new_pw)
        new_sums, new_squares = [], []
        for i in range(chunk):
            # Unscaled: the residual scale multiplies the sums once, after the loop.
            e = pairs.difference(points, scales, tile, first + i, scaled=False)
            ae = a * e
            new_sums.append(sums[i] + jnp.sum(ae, axis=1))
            if per_dim_squares:
                new_squares.append(squares[i] + jnp.sum(ae * e, axis=1))
        stats = []
        if with_rowsum:
            stats.append(jnp.sum(a, axis=1))
        if with_squares and not distance.per_dimension:
            # (t = -inf beyond float32 would give 0 * inf)
            stats.append(jnp.sum(a * jnp.maximum(distance_exponent, -FLOAT32_MAX), axis=1))
        row_sums = tuple(acc + s for acc, s in zip(row_sums, stats, strict=True))
        return tuple(new_sums), tuple(new_squares), row_sums, tuple(new_pw)

    num_p = x_ref.shape[-1] if difference else x_ref.shape[0]

    def zeros(count, shape=(num_p,)):
        return tuple(jnp.zeros(shape, jnp.float32) for _ in range(count))

    if difference:
        num_stats = int(with_rowsum) + int(with_squares and not distance.per_dimension)
        init = (zeros(chunk), zeros(chunk if per_dim_squares else 0), zeros(num_stats))
    else:
        init = (jnp.zeros(out["sums"].shape, jnp.float32), (), ())
    init += (zeros(len(chunks) if "pw" in out else 0, (num_p, block_o)),)
    # No prefetch: held across a step, the coordinates pushed the key-gradient kernel from 245
    # to 255 registers a thread and to twice its time on the H200 (long-scoreboard stalls).
    sums, squares, row_sums, pw_acc = _loop_tiles(body, init, valid_l, block_l, y_ref)
    if not difference:
        out["sums"][...] = sums
    elif distance.per_dimension:
        residual = [scales[first + i] for i in range(chunk)]
        sums = tuple(acc * r for acc, r in zip(sums, residual, strict=True))
        squares = tuple(acc * (r * r) for acc, r in zip(squares, residual, strict=False))
    for name, accs in (("sums", sums if difference else ()), ("squares", squares),
                       ("rows", row_sums)):  # fmt: skip
        for i, acc in enumerate(accs):
            out[name][i, :] = acc
    for c, acc in zip(chunks if "pw" in out else (), pw_acc, strict=True):
        out["pw"][:, c] = acc


def kernel_matmul_grad(
    x: jax.Array,
    y: jax.Array,
    *,
    distance: Distance,
    valid_l: int,
    block_p: int,
    block_l: int,
    backend: Backend,
    scale: jax.Array | None = None,
    x_offset: jax.Array | None = None,
    y_offset: jax.Array | None = None,
    u: jax.Array | None = None,
    w: jax.Array | None = None,
    x_coef: jax.Array | None = None,
    y_coef: jax.Array | None = None,
    with_pw: bool = False,
    with_rowsum: bool = False,
    with_squares: bool = False,
    block_o: int = 16,
    values: str = "ieee",
    coords: str = "ieee",
    num_warps: int | None = 4,
    num_stages: int | None = 2,
    profile: str = "rbf",
) -> dict[str, jax.Array]:
    """The pair sums of the backward passes, in one sweep over ``y`` (see the section comment).

    The coefficient of pair ``(i, l)`` is the product of those given: ``u_i . w_l``
    (``u: [B, P, O]``, ``w: [B, L, O]``, ``O`` a multiple of ``block_o``), ``x_coef[i]``
    (``[B, P]``) and ``y_coef[l]`` (``[B, L]``). Exponents get ``y_offset[l] + x_offset[i]``
    (``[B, L]``, ``[B, P]``). ``profile``: the kernel profile (``tilax.rbf.profiles``) whose
    pair weights form ``A`` and whose values form ``pw``; without offsets. Returns
    ``{"sums": ...}``: ``[B, P, W]`` for :class:`Expansion`,
    ``[B, dim, P]`` for :class:`Difference`, which also returns ``"squares"`` (``[B, dim, P]``,
    ``with_squares`` per dimension) and ``"rows"`` (``[B, S, P]``: the row sums, then the
    shared scale's squares); with ``with_pw`` (needs ``u``, ``w``; one dimension chunk) also
    ``"pw": [B, P, O]``. Other arguments as in ``kernel_matmul``.
    Grid: (P tiles, dimension chunks, batch).
    """
    difference = isinstance(distance, Difference)
    batch, num_p, num_l = x.shape[0], _num_rows(distance, x), _num_rows(distance, y)
    chunk = min(distance.dim, DIM_CHUNK) if difference else 1
    num_chunks = distance.dim // chunk if difference else 1
    if with_pw and num_chunks > 1:
        raise ValueError("with_pw needs one dimension chunk (every chunk would write pw)")
    program, loop = _point_specs(distance, block_p, x, y)
    names, optional, optional_specs = _row_vectors(
        block_p, num_l, dict(scale=scale, x_offset=x_offset, y_offset=y_offset, x_coef=x_coef,
                             y_coef=y_coef),
    )  # fmt: skip
    with_uw = u is not None
    value_arrays, value_specs = [], []
    if with_uw:
        value_arrays = [u, w]
        value_specs = [
            pl.BlockSpec((pl.squeezed, block_p, u.shape[2]), lambda i, c, b: (b, i, 0)),
            pl.BlockSpec((pl.squeezed, num_l, w.shape[2]), lambda i, c, b: (b, 0, 0)),
        ]
    outputs = {}  # name -> (shape, block, index map)
    if difference:
        by_chunk = (chunk, block_p), lambda i, c, b: (b, c, i)
        outputs["sums"] = ((batch, distance.dim, num_p), *by_chunk)
        if with_squares and distance.per_dimension:
            outputs["squares"] = ((batch, distance.dim, num_p), *by_chunk)
        num_stats = int(with_rowsum) + int(with_squares and not distance.per_dimension)
        if num_stats:  # (every chunk writes the same row sums)
            outputs["rows"] = ((batch, num_stats, num_p), (num_stats, block_p),
                               lambda i, c, b: (b, 0, i))  # fmt: skip
    else:
        width = x.shape[2]
        outputs["sums"] = ((batch, num_p, width), (block_p, width), lambda i, c, b: (b, i, 0))
    if with_pw:
        num_o = u.shape[2]
        outputs["pw"] = ((batch, num_p, num_o), (block_p, num_o), lambda i, c, b: (b, i, 0))
    kernel = functools.partial(
        _kernel_matmul_grad_kernel, pairs=_Pairs(distance, backend), names=names,
        outputs=tuple(outputs), with_uw=with_uw, with_rowsum=with_rowsum,
        with_squares=with_squares, valid_l=valid_l, block_l=block_l, block_o=block_o,
        values=values, coords=coords, profile=profile,
    )  # fmt: skip
    results = pallas_call(
        kernel,
        backend=backend,
        num_warps=num_warps,
        num_stages=num_stages,
        grid=(num_p // block_p, num_chunks, batch),
        in_specs=[program, loop, *optional_specs, *value_specs],
        out_specs=[pl.BlockSpec((pl.squeezed, *block), index) for _, block, index in
                   outputs.values()],
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for shape, _, _ in outputs.values()],
        name="rbf_kernel_matmul_grad",
    )(x, y, *optional, *value_arrays)
    return dict(zip(outputs, results, strict=True))


# --------------------------------------------------------------------------------------------
# Log-sum-exp: m[i] = max_l t[i, l] over weighted rows, s[i] = sum_l w_l exp2(t[i, l] - m[i]),
# streaming over tiles of y (running maximum and rescaled sum). log2 sum_l w_l exp2(t) is
# m + log2 s; the two stay apart: at exponents beyond 2^24 the sum would vanish in m's rounding.


def _kernel_logsumexp_kernel(x_ref, y_ref, *refs, pairs, names, valid_l, block_l):
    optional, (max_ref, sum_ref) = _split_refs(refs, names)
    points = pairs.program_points(x_ref)
    scales = pairs.scales(optional.get("scale"))
    weight_ref = optional.get("y_weight")

    def body(j, carry, masked, tile):
        running_max, running_sum = carry
        rows = tile.rows
        t = pairs.exponent(points, scales, tile)
        counted = None if weight_ref is None else weight_ref[rows][None, :] > 0
        if masked:
            valid = _valid_columns(j, block_l, valid_l)
            counted = valid if counted is None else counted & valid
        tile_max = jnp.max(t if counted is None else jnp.where(counted, t, -jnp.inf), axis=1)
        new_max = jnp.maximum(running_max, tile_max)
        # Rows whose exponents are all -inf so far (squared distances beyond float32) keep a
        # shift of 0, so that no -inf - -inf = NaN arises. The clamp keeps zero-weight points
        # closer than every weighted one finite (their weight then makes them 0).
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        p = pairs.exp2(jnp.minimum(t - shift[:, None], EXPONENT_LIMIT))
        if weight_ref is not None:
            p = p * weight_ref[rows][None, :]
        if masked:
            p = jnp.where(valid, p, 0.0)
        rescaled = running_sum * jnp.exp2(running_max - shift)
        return new_max, rescaled + jnp.sum(p, axis=1)

    init = (jnp.full(max_ref.shape, -jnp.inf, jnp.float32), jnp.zeros(sum_ref.shape, jnp.float32))
    max_ref[...], sum_ref[...] = _loop_tiles(body, init, valid_l, block_l, y_ref,
                                             pairs.prefetch(y_ref, block_l))


def kernel_logsumexp(
    x: jax.Array,
    y: jax.Array,
    *,
    distance: Distance,
    valid_l: int,
    block_p: int,
    block_l: int,
    backend: Backend,
    scale: jax.Array | None = None,
    y_weight: jax.Array | None = None,
    num_warps: int | None = 4,
    num_stages: int | None = 2,
) -> tuple[jax.Array, jax.Array]:
    """``(m, s)``, float32 ``[B, P]`` each, with ``log2 sum_{l < valid_l} w_l exp2(t[b, i, l])
    = m + log2 s`` (see the section comment): ``m`` the largest exponent of a row with positive
    weight ``y_weight[b, l]`` (``[B, L]``; all rows count without weights), ``s`` (at least the
    weight of that row) the weighted sum relative to ``m``. Finite even where every ``exp2(t)``
    underflows (queries far from all points); ``m = -inf`` only where every exponent is
    ``-inf``. Other arguments as in ``kernel_matmul``. Grid: (P tiles, batch).
    """
    batch, num_p, num_l = x.shape[0], _num_rows(distance, x), _num_rows(distance, y)
    program, loop = _point_specs(distance, block_p, x, y)
    names, optional, optional_specs = _row_vectors(
        block_p, num_l, dict(scale=scale, y_weight=y_weight)
    )
    kernel = functools.partial(
        _kernel_logsumexp_kernel, pairs=_Pairs(distance, backend), names=names, valid_l=valid_l,
        block_l=block_l,
    )  # fmt: skip
    row = pl.BlockSpec((pl.squeezed, block_p), lambda i, b: (b, i))
    return pallas_call(
        kernel,
        backend=backend,
        num_warps=num_warps,
        num_stages=num_stages,
        grid=(num_p // block_p, batch),
        in_specs=[program, loop, *optional_specs],
        out_specs=[row, row],
        out_shape=[jax.ShapeDtypeStruct((batch, num_p), jnp.float32)] * 2,
        name="rbf_kernel_logsumexp",
    )(x, y, *optional)
