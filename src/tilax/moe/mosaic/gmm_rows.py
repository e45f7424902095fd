"""Token rows copied into the row space on Hopper: each token read once, written to each of its
copies' rows.

The Mosaic GPU kernels read sorted copies of ``x`` and ``dy`` in a train step (Hopper's TMA
copies tiles, not gathered rows). XLA makes such a copy as a gather, ``x[row_token]``, which
reads a token's row once for each of its ``k`` copies: at the E64 top-8 decoder's 131 072
tokens, the gather of ``x`` and ``dy`` moved about 2 GB in and 2 GB out (1.02 ms on the H200).
Where every copy has a row (no capacity drops), the copy is a permutation of the copies, and
this kernel scatters instead: a block of tokens comes into shared memory by one bulk copy,
and each of its rows leaves by one bulk copy per copy row (``cp.async.bulk``: a contiguous
row, so any row of the output, with no tensor map), about 0.25 GB in for the same 2 GB out.

Every program walks the token blocks ``pid, pid + P, ...`` with two slots: block ``i + 1``
lands while block ``i``'s rows go out, and a slot is refilled once the stores of the block
before have read it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.moe.dispatch import RowLayout
from tilax.moe.mosaic import common
from tilax.moe.mosaic.common import plgpu

# Tokens per block: 32 rows of 512 16-bit values are 32 KiB a slot.
BLOCK_TOKENS = 32
SLOTS = 2
# Programs per SM: two programs' slots overlap one's waits with the other's copies.
PROGRAMS_PER_SM = 2


def block_tokens(num_tokens: int, width: int, itemsize: int, top_k: int,
                 min_block_tokens: int) -> int | None:
    """Tokens per block: the largest power of two up to ``BLOCK_TOKENS`` dividing
    ``num_tokens`` whose slots (rows and their copies' row numbers) fit the shared memory
    of ``PROGRAMS_PER_SM`` programs; ``None`` below ``min_block_tokens`` (smaller blocks copy
    too little per step: the ``copy_rows`` rule of ``tilax.moe.rules``) or with no tokens."""
    if num_tokens == 0:
        return None
    block = BLOCK_TOKENS
    while block >= min_block_tokens:
        slots = SLOTS * block * (width * itemsize + top_k * 4)
        fits = PROGRAMS_PER_SM * (slots + common.SMEM_SLACK) <= _pallas.shared_memory_per_sm()
        if num_tokens % block == 0 and fits:
            return block
        block //= 2
    return None


def copies_fit(x: jax.Array, layout: RowLayout) -> bool:
    """Whether the kernel can copy these rows: whole 16-byte chunks a row (each bulk copy
    moves whole chunks) and a row for every copy."""
    return (x.shape[1] * x.dtype.itemsize) % 16 == 0 and (
        layout.row_token.shape[0] >= layout.copy_row.size)


def copy_rows(x: jax.Array, layout: RowLayout, block: int) -> jax.Array:
    """``x[layout.row_token]``, ``[R_pad, d]``, for a layout in which every copy has a row
    (``sort_by_expert`` without ``capacity``, or with one that keeps a row for every copy;
    :func:`copies_fit`), ``block`` tokens at a time (:func:`block_tokens`): rows past the
    copies (padding) hold ``x[0]``, as the gather gives them."""
    num_tokens, width = x.shape
    num_rows = layout.row_token.shape[0]
    copy_row = layout.copy_row
    num_copies, top_k = copy_row.size, copy_row.shape[1]
    num_blocks = num_tokens // block
    num_programs = min(PROGRAMS_PER_SM * common.sm_count(), num_blocks)
    num_padding = num_rows - num_copies

    def body(x_g, dest_g, rows_g, x_smem, dest_smem, loaded):
        pid = lax.axis_index("sm")
        count = (num_blocks - pid + num_programs - 1) // num_programs

        def fetch(i, slot):
            first = (pid + i * num_programs) * block
            # In bounds by construction: then a contiguous slab is one bulk copy (a tiled TMA
            # copy would take at most 256 columns). The copies' rows come flat: a [T, k] table
            # would need rows of a multiple of 16 bytes.
            for src, dst in ((x_g.at[pl.ds(first, block)], x_smem),
                             (dest_g.at[pl.ds(first * top_k, block * top_k)], dest_smem)):
                plgpu.copy_gmem_to_smem(src, dst.at[slot], loaded.at[slot],
                                        oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

        fetch(0, 0)  # every program has a block: num_programs <= num_blocks

        @pl.loop(0, count)
        def _block(i):
            slot = i % SLOTS
            plgpu.barrier_wait(loaded.at[slot])

            @pl.loop(0, block)
            def _token(t):
                for j in range(top_k):
                    row = dest_smem[slot, t * top_k + j]
                    plgpu.copy_smem_to_gmem(x_smem.at[slot, t], rows_g.at[row], commit_group=False)

            if num_padding:
                @pl.when((pid == 0) & (i == 0))
                def _padding():  # token 0 is the first row of this program's first block
                    @pl.loop(0, num_padding)
                    def _row(r):
                        plgpu.copy_smem_to_gmem(x_smem.at[slot, 0], rows_g.at[num_copies + r],
                                                commit_group=False)

            plgpu.commit_smem_to_gmem_group()
            # The block before's stores have read the other slot: refill it.
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)

            @pl.when(i + 1 < count)
            def _next():
                fetch(i + 1, (i + 1) % SLOTS)

        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_rows, width), x.dtype),
        grid=(num_programs,),
        grid_names=("sm",),
        scratch_types=[
            plgpu.SMEM((SLOTS, block, width), x.dtype),
            plgpu.SMEM((SLOTS, block * top_k), jnp.int32),
            plgpu.Barrier(num_arrivals=2, num_barriers=SLOTS),
        ],
        kernel_name="moe_copy_rows_mosaic",
        compiler_params=common.compiler_params(),
    )
    return kernel(x, copy_row.reshape(-1).astype(jnp.int32))
