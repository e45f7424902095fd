"""The router's top-k on Hopper: one Mosaic GPU pass over the probabilities.

``router.top_k_experts`` in XLA takes ``k`` argmax passes over the ``[T, E]`` probabilities,
each its own reduction kernel: at the E64 top-8 decoder's 131 072 tokens 0.153 ms on the H200,
0.040 ms with this kernel (reading the probabilities once takes about 0.01 ms). XLA's own
alternatives were slower there (``jax.lax.top_k`` and a row sort, 0.47 and 0.46 ms against
0.28 ms for the router's forward; the argmax passes over an expert-major layout, 0.61 against
0.57 ms forward and backward). Here a program brings a block of tokens' probabilities into
shared memory by one TMA copy, runs the ``k`` rounds of "largest, then the lowest expert
holding it, then mask it" in registers (a warpgroup's row reductions) and writes the
``k`` experts of each token.

:func:`top_k_experts` gives exactly ``router.top_k_experts``'s experts (ties to the lower
expert index; a NaN ranks above every number). Used for ``impl="mosaic"``; token counts
without a block of ``MIN_BLOCK_TOKENS`` and expert counts that are not a multiple of 8 (the
register layout's column tile) take the XLA passes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.moe import gmm_mosaic_parts as parts
from tilax.moe.gmm_mosaic_parts import plgpu

# Tokens per block: the warpgroup's register layout (``WGMMA``) holds rows in tiles of 64.
BLOCK_TOKENS = 128
MIN_BLOCK_TOKENS = 64
SLOTS = 2
# Programs per SM: while one waits for its block, another ranks. On the H200 at 131 072 x 64
# (medians of 15 rounds of 50 calls) blocks of 128 took 0.054, 0.040, 0.043 and 0.038 ms
# with 1, 2, 3 and 6 programs per SM, blocks of 64 0.041-0.054 ms.
PROGRAMS_PER_SM = 2


def block_tokens(num_tokens: int, num_experts: int, top_k: int) -> int | None:
    """The largest block of ``MIN_BLOCK_TOKENS`` to ``BLOCK_TOKENS`` tokens dividing
    ``num_tokens``, or ``None`` where the kernel does not apply (then XLA ranks)."""
    if num_experts % 8 or top_k > num_experts:
        return None
    block = BLOCK_TOKENS
    while block >= MIN_BLOCK_TOKENS:
        if num_tokens % block == 0:
            return block
        block //= 2
    return None


def top_k_experts(probs: jax.Array, top_k: int) -> jax.Array | None:
    """``[T, k]`` int32: each token's ``top_k`` experts by ``probs: [T, E]`` float32 (>= 0),
    best first, ties to the lower expert; ``None`` where :func:`block_tokens` says the
    kernel does not apply."""
    num_tokens, num_experts = probs.shape
    block = block_tokens(num_tokens, num_experts, top_k)
    if block is None or probs.dtype != jnp.float32:
        return None
    num_blocks = num_tokens // block
    num_programs = min(PROGRAMS_PER_SM * parts.sm_count(), num_blocks)
    if _pallas.interpreted():  # the interpreter has no register layouts
        def in_registers(value):
            return value
    else:
        def in_registers(value):
            return plgpu.layout_cast(value, plgpu.Layout.WGMMA)

    def body(probs_g, ids_g, probs_smem, ids_smem, loaded):
        pid = lax.axis_index("sm")
        count = (num_blocks - pid + num_programs - 1) // num_programs

        def fetch(i, slot):
            first = (pid + i * num_programs) * block
            plgpu.copy_gmem_to_smem(probs_g.at[pl.ds(first, block)], probs_smem.at[slot],
                                    loaded.at[slot])

        fetch(0, 0)  # every program has a block: num_programs <= num_blocks

        @pl.loop(0, count)
        def _block(i):
            slot = i % SLOTS
            first = (pid + i * num_programs) * block

            @pl.when(i + 1 < count)
            def _next():
                fetch(i + 1, (i + 1) % SLOTS)

            plgpu.barrier_wait(loaded.at[slot])
            p = in_registers(probs_smem[slot])
            # A NaN ranks first, as in argmax: as +inf, the first max found.
            p = jnp.where(p != p, jnp.inf, p)
            experts = in_registers(lax.broadcasted_iota(jnp.int32, (block, num_experts), 1))
            # The stores of the block before this slot's last use have read ids_smem[slot].
            plgpu.wait_smem_to_gmem(SLOTS - 1, wait_read_only=True)
            for j in range(top_k):
                best = p.max(axis=1)
                hit = p == lax.broadcast_in_dim(best, p.shape, [0])
                expert = jnp.where(hit, experts, num_experts).min(axis=1)
                ids_smem[slot, j] = expert
                p = jnp.where(experts == lax.broadcast_in_dim(expert, p.shape, [0]),
                              -jnp.inf, p)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(ids_smem.at[slot], ids_g.at[:, pl.ds(first, block)])

        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((top_k, num_tokens), jnp.int32),
        grid=(num_programs,),
        grid_names=("sm",),
        scratch_types=[
            plgpu.SMEM((SLOTS, block, num_experts), jnp.float32),
            plgpu.SMEM((SLOTS, top_k, block), jnp.int32),
            plgpu.Barrier(num_barriers=SLOTS),
        ],
        kernel_name="moe_router_top_k_mosaic",
        compiler_params=parts.compiler_params(),
    )
    return kernel(probs).T
