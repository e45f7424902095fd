"""Building blocks of the RBF Mosaic GPU kernels (Hopper), shared by the four kernel files.

Every RBF Mosaic GPU kernel has one shape: per program, two compute warpgroups of
``ROWS_PER_WARPGROUP`` rows each (``BLOCK_P`` rows a program) and one memory warpgroup that
streams tiles through TMA into a ring of slots (:func:`stream_tiles`). Here are that shape's
launches (:func:`launch_forward`, :func:`launch_on_refs`, :func:`batch_folding`), its compiler
settings, its shared-memory layouts, the exact bfloat16 splits of float32 values, and the
register layout the exact kernels (``exact.py``, ``exact_grad.py``) form their pairs in.
Kernels: ``forward.py`` (the fast forward), ``grad.py`` (the fast backward sweep), ``exact.py``
and ``exact_grad.py`` (``precision="highest"``'s forward and backward sweep).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.rbf.numerics import Difference, Distance

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # tilax imports anyway; _pallas.mosaic_unavailable_reason says why
    plgpu = None

ROWS_PER_WARPGROUP = 64
COMPUTE_WARPGROUPS = 2
#: Rows a program owns: the forward launch's ``block_p`` on this backend.
BLOCK_P = ROWS_PER_WARPGROUP * COMPUTE_WARPGROUPS
#: Widest TF32-parts (and coordinate) operand, in columns, the fast kernels' shared memory is
#: planned for.
MAX_WIDTH = 64


# ------------------------------------------------------------------------------------------
# Launches, the memory warpgroup's loop, shared-memory layouts


def swizzled(cols: int, itemsize: int):
    """Tiling and swizzle of a shared-memory tile ``cols`` wide of ``itemsize``-byte elements,
    as TMA copies and ``wgmma`` read it."""
    swizzle = plgpu.find_swizzle(cols * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def compiler_params():
    """Settings of every RBF Mosaic GPU kernel: the exp unit's approximate ``exp2``, and no
    warpgroup barriers around each load and store (``unsafe_no_auto_barriers``). Pallas puts
    them there in case a thread reads what another thread of its warpgroup stored; in these
    kernels nothing is read that way except through ``commit_smem`` (which has its own
    barrier), stored operand tiles are reused only after the ``wgmma`` that read them was waited
    for, and ring slots only after mbarriers say they were read. On the H200 the barriers
    (under jax 0.11, two a dimension a tile around the exact sweep's atomic column sums) cost
    4% of a forward+backward at either precision (docs/performance/rbf.md)."""
    return plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=True)


def stream_tiles(steps: int, stages: int, fetch, wait_free, *, one_warp: bool = True) -> None:
    """The memory warpgroup's loop: ``fetch(tile, slot)`` the first ``stages`` tiles, then
    each next tile into its slot once ``wait_free(slot)`` returns; at the end, wait for every
    slot's last release (a barrier phase nobody waits for is a bug in the eyes of JAX's GPU
    interpreter, and costs nothing here).

    With ``one_warp`` (on the GPU) one warp of the warpgroup runs it and the other three wait
    at the join: a waiting warp polls its barrier in a loop that takes issue slots from the
    compute warps (2% of them in the exact kernels, as ncu counted on the H200; the exact
    forward+backward ran 1.0% faster so, the fast one 1.2% slower)."""

    def loop():
        for slot in range(stages):
            fetch(slot, slot)

        @pl.loop(0, steps - stages)
        def _(step):
            slot = lax.rem(step, jnp.array(stages, step.dtype))
            wait_free(slot)
            fetch(step + stages, slot)

        for last in range(steps - stages, steps):
            wait_free(last % stages)

    if not one_warp or _pallas.interpreted():  # (the interpreter runs warpgroups, not warps)
        loop()
        return

    @plgpu.warp_map
    def _one_warp(warp):
        pl.when(warp == 0)(loop)


def launch_forward(entry, out_shape: tuple[int, int, int], block_p: int, block_o: int,
                   name: str):
    """``plgpu.kernel`` of a forward kernel ``entry``: float32 ``out_shape`` ``[B, P, O]``,
    grid (P tiles, O tiles, batch), the compute warpgroups and the memory warpgroup, with
    ``compiler_params()``."""
    batch, num_p, num_o = out_shape
    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(num_p // block_p, num_o // block_o, batch),
        grid_names=("p", "o", "b"),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=compiler_params(),
        kernel_name=name,
    )


def launch_on_refs(entry, refs, *, programs: int, batch: int, name: str) -> None:
    """Run ``entry(*refs)`` as a kernel of grid ``(programs, batch)`` with the compute
    warpgroups and the memory warpgroup, on the Refs of ``run_state``: the sweeps add their loop
    sums into a zeroed buffer, which ``plgpu.kernel`` cannot take (it aliases no input to an
    output)."""
    mesh = plgpu.Mesh(grid=(programs, batch), grid_names=("p", "b"),
                      num_threads=COMPUTE_WARPGROUPS + 1, thread_name="wg")
    params = dict(compiler_params=compiler_params(), name=name)
    # jax 0.11 deprecates core_map for pl.kernel; jax 0.10's GPU interpreter cannot run
    # pl.kernel with Ref operands (both lower for CUDA).
    if jax.__version_info__ >= (0, 11):
        pl.kernel(entry, out_type=(), mesh=mesh, **params)(*refs)
    else:
        pl.core_map(mesh, **params)(lambda: entry(*refs))


def batch_folding(kernel):
    """``kernel(*operands) -> tuple of arrays`` (each operand ``[B, R, C]``, each output with the
    batch axis first) with a ``vmap`` rule that folds the vmapped axis into the batch axis: the
    sweeps run under ``run_state``, which has no batching rule."""

    @jax.custom_batching.custom_vmap
    def batched(*operands):
        return kernel(*operands)

    @batched.def_vmap
    def _(axis_size, in_batched, *operands):
        merged = [(a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))).reshape(
            axis_size * a.shape[-3], *a.shape[-2:])
            for a, batched in zip(operands, in_batched, strict=True)]
        outs = batched(*merged)
        return (tuple(out.reshape(axis_size, -1, *out.shape[1:]) for out in outs),
                (True,) * len(outs))

    return batched


def rotated_tile(index, full_steps: int, offset):
    """The loop tile of step ``index``: the full tiles from ``offset`` on, wrapping around, then
    the partial tile, if any."""
    if full_steps == 0:
        return index
    return jnp.where(index < full_steps, lax.rem(index + offset, full_steps), index)


# ------------------------------------------------------------------------------------------
# float32 values as exact bfloat16 parts

_HIGH_HALF = 0xFFFF0000


def bfloat16_bits(bits: jax.Array) -> jax.Array:
    """The bfloat16 whose bits are the high half of ``bits`` (uint32): float32 truncated."""
    return lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)


def split3(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``a`` (float32) as bfloat16 ``(hi, mid, lo)`` with ``hi + mid + lo = a`` to 2^-24 of
    ``|a|`` (normal numbers), by truncation: each part is the high half of the float32 bits of
    what the parts before leave, and the rests are exact float32 subtractions."""
    bits0 = lax.bitcast_convert_type(a, jnp.uint32)
    rest1 = a - lax.bitcast_convert_type(bits0 & jnp.uint32(_HIGH_HALF), jnp.float32)
    bits1 = lax.bitcast_convert_type(rest1, jnp.uint32)
    rest2 = rest1 - lax.bitcast_convert_type(bits1 & jnp.uint32(_HIGH_HALF), jnp.float32)
    bits2 = lax.bitcast_convert_type(rest2, jnp.uint32)
    return bfloat16_bits(bits0), bfloat16_bits(bits1), bfloat16_bits(bits2)


# ------------------------------------------------------------------------------------------
# The exact kernels' pairs in the ``wgmma`` register layout

#: Most coordinates a program holds in registers (two a dimension a thread).
MAX_DIMS = 16
#: (kernel value part, value part) products, small terms first; parts are hi, mid, lo.
PRODUCTS = ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0))

# jax 0.10 takes the index as a separate, positional argument of plgpu.load; 0.11 deprecates it.
_LOAD_TAKES_INDEX = plgpu is not None and (
    inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty)


def load_in_layout(ref, layout):
    """``plgpu.load`` of the whole ``ref`` in ``layout``, on jax 0.10 and 0.11."""
    return plgpu.load(ref, (), layout=layout) if _LOAD_TAKES_INDEX else plgpu.load(
        ref, layout=layout)


def exact_distance_reason(distance: Distance, values: str) -> str | None:
    """Why the exact Mosaic GPU kernels (forward and sweeps) cannot take this distance and
    values mode, or ``None``."""
    if not isinstance(distance, Difference) or distance.rounded:
        return f"it forms exponents from unrounded differences, not {distance}"
    if distance.dim > MAX_DIMS:
        return f"{distance.dim} dimensions (at most {MAX_DIMS})"
    if values != "tf32x3":
        return f"it multiplies values at float32 accuracy (the 'tf32x3' mode), not {values!r}"
    return None


def paired_columns(y: jax.Array) -> jax.Array:
    """``y: [..., L]`` (``L`` a multiple of 16) with the columns of each 16 in the order that
    ``paired_keys`` reads: column ``16 m + 8 q + 2 c + p`` at ``16 m + 4 c + 2 q + p``, so that
    the four keys a thread of ``wgmma``'s register layout needs from two neighbouring 8-column
    chunks (``2 c + p`` of each) lie side by side."""
    *lead, n = y.shape
    return y.reshape(*lead, n // 16, 2, 4, 2).swapaxes(-3, -2).reshape(*lead, n)


def row_group(i32):
    """``(L, L >> 2)`` for this thread (``L`` its lane): ``L >> 2`` is its rows' index within 8
    in ``wgmma``'s register layout (rows ``16 w + (L >> 2)`` and 8 below), ``L & 3`` its
    columns' pair within each 8-column chunk."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir.dialects import arith

    lane = arith.remui(mgpu.utils.thread_idx(), mgpu.c(32, i32))
    return lane, arith.shrui(lane, mgpu.c(2, i32))


def wgmma_array(registers):
    """A ``[64, 8 J]`` float32 array of ``wgmma``'s register layout from its registers
    ``[chunk j < J][row half h]`` (vectors of two columns)."""
    import jax.experimental.mosaic.gpu as mgpu

    regs = np.empty((1, len(registers), 1, 1, 2, 1, 1, 1, 1), dtype=object)
    for j, halves in enumerate(registers):
        for h, register in enumerate(halves):
            regs[0, j, 0, 0, h, 0, 0, 0, 0] = register
    return mgpu.FragmentedArray(_registers=regs, _layout=plgpu.Layout.WGMMA.to_mgpu(),
                                _is_signed=None)


def paired_keys(keys_ref, shape, *, lane_permuted: bool = False) -> jax.Array:
    """Keys ``keys_ref: [W]`` (shared memory, ``paired_columns`` order) as the columns of a
    ``shape = [64, W]`` array of ``wgmma``'s register layout: one 16-byte load a thread for
    each 16 columns, where a plain load takes two 8-byte ones. With ``lane_permuted`` in the
    exact sweep's lane-permuted order instead (``tilax.rbf.mosaic.exact_grad``: the
    thread of lane ``L`` holds chunk ``j ^ (L >> 2)`` where the layout holds chunk ``j``), one
    8-byte load a chunk. In JAX's GPU interpreter the keys are in the plain order and loaded
    so (there nothing is permuted)."""
    if _pallas.interpreted():
        keys = load_in_layout(keys_ref, plgpu.Layout.WGMMA.reduce(0))
        return lax.broadcast_in_dim(keys, shape, (1,))
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct(shape, jnp.float32,
                                                          layout=plgpu.Layout.WGMMA))
    def load(ctx, ref):
        del ctx
        i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
        lane, group = row_group(i32)
        quad = arith.muli(arith.andi(lane, mgpu.c(3, i32)), mgpu.c(4, i32))
        base = mgpu.utils.memref_ptr(ref)

        def keys(column, count):
            ptr = mgpu.utils.getelementptr(base, [column], f32)
            return llvm.load(ir.VectorType.get((count,), f32), ptr)

        registers = []  # [chunk][row half]: keys vary by column only
        if lane_permuted:
            for j in range(shape[1] // 8):
                chunk = arith.xori(group, mgpu.c(j, i32))
                # chunk k's pair for this thread is at 16 (k >> 1) + 4 (L & 3) + 2 (k & 1)
                start = arith.addi(arith.muli(arith.shrui(chunk, mgpu.c(1, i32)), mgpu.c(16, i32)),
                                   arith.muli(arith.andi(chunk, mgpu.c(1, i32)), mgpu.c(2, i32)))
                pair = keys(arith.addi(start, quad), 2)
                registers.append((pair, pair))
        else:
            for first in range(0, shape[1], 16):  # chunks first / 8 and first / 8 + 1
                four = keys(arith.addi(quad, mgpu.c(first, i32)), 4)
                for q in range(2):
                    pair = mgpu.utils.vector_slice(four, slice(2 * q, 2 * q + 2))
                    registers.append((pair, pair))
        return wgmma_array(registers)

    return load(keys_ref)


def scale_rows(scale: jax.Array, per_dimension: bool, num_p: int, batch: int) -> jax.Array:
    """The residual scales as rows to go below the program's coordinates (then row vectors in
    registers, as the coordinates): ``r_d`` for each dimension, or ``r^2`` once;
    ``[B, S, P]``."""
    scale = scale.astype(jnp.float32)
    rows = scale if per_dimension else scale[:1] * scale[:1]
    return jnp.broadcast_to(rows[None, :, None], (batch, rows.size, num_p))
