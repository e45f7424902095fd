"""Tiles and in-kernel building blocks of the Mosaic GPU grouped matmuls (``mosaic/gmm.py``).

Tiles: :class:`Config` with :func:`tiles_for` (the backend's ``base.GmmKernels.tiles_for``), and
the per-kernel fits: output columns within the registers an epilogue can hold
(:func:`capped_block_n`), pipeline stages within shared memory (:func:`fit_pipeline`).

Building blocks, traced inside the kernels: a persistent loop over the work items
(:func:`for_each_item`), a TMA pipeline feeding ``wgmma`` (:func:`pipeline`,
:func:`accumulate`), TMA fetches that overlap it (:func:`with_fetched`), and the stores of an
item's rows ``[lo, hi)`` from a tile staged in SMEM (:func:`stage_and_store`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.moe import rules
from tilax.moe.dispatch import take_rows

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # tilax imports anyway; _pallas.mosaic_unavailable_reason says why
    plgpu = None  # (jax 0.10's Mosaic GPU imports absl-py, which jax does not depend on)

# Tile sides are powers of two >= 16; wgmma takes M in multiples of 64 per warpgroup.
MIN_BLOCK = _pallas.MIN_BLOCK
WGMMA_ROWS = 64
fit_block = _pallas.fit_block
# Feature dimensions are multiples of this (the layer pads them): 64 16-bit values are the
# 128-byte rows a TMA store of a row slice needs (shared-memory addresses 128-byte aligned at
# any row), and every feature tile is then at least 64 wide (wgmma's M and a full swizzle).
FEATURE_MULTIPLE = 64
# Widest output tile: Mosaic GPU (jax 0.10.2) finds no register layout for a 256-column
# accumulator stored into the row-sliceable staging tile, and at block_m = 128 it would not
# fit one warpgroup's registers anyway.
MAX_BLOCK_N = 128
# Shared memory a kernel leaves unplanned: the system's 1 KiB per block, and 2 KiB for the
# pipelines' barriers and alignment (the device's sizes: _pallas.shared_memory_per_block/_sm).
SMEM_SLACK = _pallas.RESERVED_SHARED_MEMORY_PER_BLOCK + 2048
# Registers per thread that the float32 tiles live through an epilogue may take: one
# warpgroup (128 threads) holds a [block_m, block_n] tile in block_m * block_n / 128.
TILE_REGISTERS = 128


@dataclasses.dataclass(frozen=True)
class Config:
    """Mosaic GPU kernel tiles.

    ``block_m``: rows of the sorted token copies per tile (a multiple of 64: one warpgroup's
    ``wgmma`` rows) and, for ``tgmm``, the output tile's first dimension; ``block_n``: output
    columns per tile (at most ``MAX_BLOCK_N``); ``block_k``: contraction step (features for
    forward-type kernels, rows for ``tgmm``); ``num_stages``: TMA buffers in flight. Powers
    of two. Each kernel may narrow them (``capped_block_n``, ``fit_pipeline``).
    ``programs_per_sm``: persistent programs sharing an SM, each with that share of its
    shared memory: with two, one program's pipeline prologue and epilogue overlap the other's
    MMAs, which matters when the contraction is a few steps long.
    """

    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    programs_per_sm: int = 2

    @property
    def row_multiple(self) -> int:
        """Row-space arrays must have a multiple of this many rows."""
        return max(self.block_m, self.block_k)

    @property
    def feature_multiple(self) -> int:
        """``d_model`` and ``d_hidden`` are zero-padded to a multiple of this: see
        ``FEATURE_MULTIPLE``."""
        return FEATURE_MULTIPLE


def default_config(dtype) -> Config:
    """128 x 128 x 64 tiles, up to 4 stages, two programs per SM, for bfloat16 and float16
    alike: 64-wide K steps are one 128-byte swizzle of 16-bit operands, and a plain grouped
    matmul's stage is 32 KiB, three of which fit in half an SM's shared memory. Not measured
    yet: the first H200 run sets these (the ``programs_per_sm`` rule of ``tilax.moe.rules``)."""
    del dtype
    return Config(block_m=128, block_n=128, block_k=64, num_stages=4,
                  programs_per_sm=rules.variant("programs_per_sm"))


def smem_budget(tiles: Config) -> int:
    """Shared memory one program may use."""
    per_sm = _pallas.shared_memory_per_sm() // tiles.programs_per_sm
    return min(_pallas.shared_memory_per_block(), per_sm) - SMEM_SLACK


def whole_block_smem() -> int:
    """Shared memory a kernel of one program per SM may plan for."""
    return _pallas.shared_memory_per_block() - SMEM_SLACK


CONFIG_FIELDS = ("block_m", "block_n", "block_k", "num_stages")


def tiles_for(config) -> Config:
    """The tiles for an ``MoEConfig``: :func:`default_config` overridden by the config's
    ``block_m``/``block_n``/``block_k``/``num_stages`` (``num_warps`` is Triton's: these
    kernels run one warpgroup per block).

    Raises:
        ValueError: ``block_m`` is not a multiple of 64, or ``block_n`` is over 128.
    """
    overrides = {
        name: getattr(config, name) for name in CONFIG_FIELDS if getattr(config, name) is not None
    }
    tiles = dataclasses.replace(default_config(config.dtype), **overrides)
    if tiles.block_m % 64:
        raise ValueError(
            f"impl='mosaic' needs block_m a multiple of 64 (wgmma rows), got {tiles.block_m}"
        )
    if tiles.block_n > MAX_BLOCK_N:
        raise ValueError(f"impl='mosaic' needs block_n <= {MAX_BLOCK_N}, got {tiles.block_n}")
    return tiles


def capped_block_n(tiles: Config, dim: int, live_tiles: int) -> int:
    """``block_n`` for a kernel whose epilogue keeps ``live_tiles`` float32
    ``[block_m, block_n]`` tiles in registers: within ``TILE_REGISTERS`` per thread."""
    cap = max(MIN_BLOCK, TILE_REGISTERS * 128 // (live_tiles * tiles.block_m))
    return fit_block(min(tiles.block_n, _pallas.next_power_of_2(cap + 1) // 2), dim)


def fit_pipeline(
    tiles: Config, block_k: int, row_bytes: int, live_bytes: int = 0, min_block_k: int = MIN_BLOCK
) -> tuple[int, int]:
    """``(block_k, num_stages)`` for a pipeline whose stage holds ``row_bytes * block_k``
    bytes next to ``live_bytes`` of SMEM allocated around it: the stages shrunk to fit, and
    ``block_k`` halved (not below ``min_block_k``) while two do not. SMEM of scopes that end
    before the pipeline or start after it is reused, so the staged outputs do not count.
    """
    budget = smem_budget(tiles)
    while True:
        stages = (budget - live_bytes) // (row_bytes * block_k)
        if stages >= 2:
            return block_k, min(tiles.num_stages, stages)
        if block_k // 2 < min_block_k:
            raise ValueError(
                f"tiles {tiles} leave no room in {budget} bytes of shared memory for two "
                "pipeline stages: use smaller block_m/block_n"
            )
        block_k //= 2


def check_features(*dims: int) -> None:
    """Raise ``ValueError`` unless every feature dimension is a multiple of 64."""
    for dim in dims:
        if dim % FEATURE_MULTIPLE:
            raise ValueError(
                f"Mosaic GPU grouped matmuls need feature dimensions that are multiples of "
                f"{FEATURE_MULTIPLE} (the layer pads them), got {dim}"
            )


def check_dtypes(*arrays) -> None:
    """Raise ``ValueError`` unless every array given is bfloat16 or float16."""
    for array in arrays:
        if array is not None and jnp.dtype(array.dtype) not in (jnp.bfloat16, jnp.float16):
            raise ValueError(
                "Mosaic GPU grouped matmuls take bfloat16/float16 operands, got "
                f"{jnp.dtype(array.dtype).name}; float32 experts run on Triton (impl='triton')"
            )


def gathered(x: jax.Array | None, index: jax.Array | None) -> jax.Array | None:
    """``x[index]`` in XLA: Hopper's TMA copies tiles, not gathered rows."""
    return x if x is None or index is None else take_rows(x, index)


def sm_count() -> int:
    """This GPU's SMs (``_pallas.sm_count``: an H200's where JAX does not say, off GPU)."""
    return _pallas.sm_count()


def num_programs(tiles: Config) -> int:
    """Programs of a persistent kernel: ``programs_per_sm`` per SM."""
    return tiles.programs_per_sm * sm_count()


def compiler_params():
    """Warpgroup lowering (the default from jax 0.11, asked for explicitly on 0.10), and
    approximate transcendentals (``exp``, ``rsqrt``: the activations' sigmoid in the epilogues)."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                approx_math=True)


def launch(body, out_type, name: str, tiles: Config):
    """``plgpu.kernel`` with :func:`num_programs` programs (grid axis ``"sm"``), each looping
    over work items."""
    return plgpu.kernel(
        body, out_type=out_type, grid=(num_programs(tiles),), grid_names=("sm",),
        kernel_name=name, compiler_params=compiler_params(),
    )


# ----------------------------------------------------------------------------------------------
# In-kernel building blocks.


def sigmoid(x):
    """float32 ``sigmoid(x)`` as ``rsqrt(1 + exp(-x))**2`` (``1 + exp(-x)`` is positive): with
    ``approx_math`` (``common.compiler_params``) two MUFU instructions, ``ex2.approx`` and
    ``rsqrt.approx`` (relative errors near 2**-22), where ``jax.nn.sigmoid`` lowers to a
    precise ``exp`` and an IEEE division: the SwiGLU backward at the E8 layer's shapes took
    1.44 ms instead of 1.57 on the H200. The epilogues pass it to ``tilax.moe.activations``,
    whose silu and gelu both take one sigmoid per element."""
    root = lax.rsqrt(1.0 + jnp.exp(-x))
    return root * root


def mma_transforms(minor: int, dtype, swizzle: int | None = None) -> tuple:
    """The SMEM layout ``wgmma`` and TMA want: 8-row tiles, swizzled (by default with the
    widest swizzle the minor dimension allows)."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = swizzle or plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def row_transforms(minor: int, dtype) -> tuple:
    """Swizzled SMEM whose rows can be sliced anywhere (1-row tiles): the staged outputs."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((1, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


class Item(NamedTuple):
    """A work item: expert, first row of its row tile, the tile-local rows it keeps
    ``[lo, hi)``, its column tile."""

    expert: jax.Array
    row_start: jax.Array
    lo: jax.Array
    hi: jax.Array
    n: jax.Array


def for_each_item(schedule_refs, n_tiles: int, block_m: int, fn) -> None:
    """``fn(item, index)`` for every (schedule item with rows, column tile), spread over the
    SMs; the column tiles of one row tile are neighbours (their rows meet in L2)."""
    expert_g, tile_g, lo_g, hi_g = schedule_refs

    @plgpu.nd_loop((expert_g.shape[0], n_tiles), collective_axes="sm")
    def _loop(info):
        index, n = info.index
        lo, hi = lo_g[index], hi_g[index]

        @pl.when(lo < hi)
        def _():
            fn(Item(expert_g[index], tile_g[index] * block_m, lo, hi, n), index)


def pipeline(step, num_steps, operands, stages: int) -> None:
    """A TMA pipeline over ``num_steps`` contraction steps: ``operands`` are
    ``(gmem_ref, block_shape, index_map)``; ``step(indices, *smem_refs)`` issues the MMAs,
    which run while the next steps' copies land (``delay_release=1``).

    The operands of one ``wgmma`` share a swizzle: the widest that every tile's minor
    dimension allows (a 32-column tile narrows it for the others).
    """
    bits = jnp.dtype(operands[0][0].dtype).itemsize * 8
    swizzle = min(plgpu.find_swizzle(shape[1] * bits) for _, shape, _ in operands)
    specs = [
        plgpu.BlockSpec(shape, index_map, delay_release=1,
                        transforms=mma_transforms(shape[1], ref.dtype, swizzle))
        for ref, shape, index_map in operands
    ]
    plgpu.emit_pipeline(step, grid=(num_steps,), in_specs=specs, max_concurrent_steps=stages)(
        *[ref for ref, _, _ in operands]
    )


def accumulate(num_accs: int, block_m: int, block_n: int, run) -> tuple:
    """Zeroed float32 accumulators filled by ``run(*acc_refs)``; returns their values."""

    def scope(*accs):
        run(*accs)
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(scope, *[plgpu.ACC((block_m, block_n))] * num_accs)


def row_slice(ref, item: Item, block_m: int) -> tuple:
    """A :func:`with_fetched` source: the item tile's ``[block_m]`` slice of a 1-D ref (the
    accumulator's row layout cannot be loaded from global memory, only from SMEM)."""
    return ref.at[pl.ds(item.row_start, block_m)], plgpu.SMEM((block_m,), ref.dtype)


def with_fetched(sources, fn) -> None:
    """Run ``fn(wait)`` while TMA copies each ``(gmem view, SMEM type)`` of ``sources`` into
    new SMEM; ``wait()`` waits for the copies and returns the SMEM refs."""
    if not sources:
        fn(lambda: [])
        return

    def scope(*scoped):
        *smems, barrier = scoped
        for (view, _), smem in zip(sources, smems, strict=True):
            plgpu.copy_gmem_to_smem(view, smem, barrier)

        def wait():
            plgpu.barrier_wait(barrier)
            return smems

        fn(wait)

    pl.run_scoped(
        scope, *[smem for _, smem in sources], plgpu.Barrier(num_arrivals=len(sources))
    )


def rows_to_tile(rows: jax.Array, shape) -> jax.Array:
    """Broadcast per-row values (float32) along a tile's columns."""
    return lax.broadcast_in_dim(rows.astype(jnp.float32), shape, (0,))


def _copy_rows(o_smem, o_gmem, row_start, start, length: int, col_start) -> None:
    block_n = o_smem.shape[1]
    plgpu.copy_smem_to_gmem(
        o_smem.at[pl.ds(start, length)],
        o_gmem.at[pl.ds(row_start + start, length), pl.ds(col_start, block_n)],
        commit_group=False,
    )


def store_rows(o_smem, o_gmem, item: Item, col_start) -> None:
    """TMA-store the staged tile's rows ``[lo, hi)``: a TMA store has a static row count and
    no row mask, so one store per set bit of ``hi - lo``, largest first."""
    size, start, length = item.hi - item.lo, item.lo, o_smem.shape[0]
    while length:
        copy = functools.partial(_copy_rows, o_smem, o_gmem, item.row_start, start, length,
                                 col_start)
        pl.when(size & length != 0)(copy)
        start = start + (size & length)
        length //= 2


def stage_and_store(outs, item: Item, block_m: int, block_n: int, write) -> None:
    """Stage a ``[block_m, block_n]`` tile per output ref in SMEM (``write(*smem_refs)``
    fills them) and store the item's rows of each."""

    def scope(*smems):
        write(*smems)
        plgpu.commit_smem()
        for smem, out in zip(smems, outs, strict=True):
            store_rows(smem, out, item, item.n * block_n)
        plgpu.commit_smem_to_gmem_group()
        # The next item reuses this SMEM: the stores must have read it.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(
        scope,
        *[plgpu.SMEM((block_m, block_n), out.dtype, transforms=row_transforms(block_n, out.dtype))
          for out in outs],
    )


def row_blocks(*tiles: jax.Array):
    """``(rows, *tile_blocks)`` per ``WGMMA_ROWS``-row block of float32 register tiles.

    An epilogue that works a block at a time holds half the registers per intermediate
    tile: on a [128, 64] tile, the SwiGLU backward's seven float32 intermediates would need
    448 registers per thread, and ptxas spilled them to local memory (ncu on the H200)."""
    for start in range(0, tiles[0].shape[0], WGMMA_ROWS):
        yield (pl.ds(start, WGMMA_ROWS),
               *(tile[start : start + WGMMA_ROWS] for tile in tiles))


def store_vector(pieces, length: int, out_g) -> None:
    """TMA-store a 1-D float32 vector of ``length`` (e.g. per-row sums) through SMEM, given as
    ``(rows, values)`` pieces that cover it."""

    def scope(smem):
        for rows, value in pieces:
            smem[rows] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, out_g)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scope, plgpu.SMEM((length,), jnp.float32))
