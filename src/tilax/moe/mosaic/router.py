"""The router's scores (softmax or sigmoid), top-k and their gradient on Hopper: two Mosaic
GPU passes.

For bfloat16 tokens ``router.route`` computes the float32 logits as one bfloat16 matmul against
the router's three bfloat16 pieces (``router.router_logits``): ``parts = x @ [r0 | r1 | r2]``,
``[T, 3E]`` float32, whose thirds add up to the logits. In XLA what follows is a chain of small
kernels: the thirds' sum, the softmax's two, ``k`` argmax reductions and the gather of the
top probabilities forward; a scatter, the softmax's backward, three conversions to the
gradient's bfloat16 pieces and their concatenations backward. On the H200 at the E64 top-8
decoder's 131 072 tokens those took about 0.23 ms of a 7.5 ms train step (the top-k already one
kernel), these two kernels 0.09 ms (docs/performance/moe.md). Here each direction
is one kernel over blocks of tokens, a program bringing a block into shared memory by TMA
(two slots, the next block landing while one is worked on) and working in a warpgroup's
registers (row reductions):

- :func:`rank`: ``parts`` to the logits, the scores (``softmax`` over the experts, or a
  ``sigmoid`` of each logit), each token's ``k`` experts (``k`` rounds of "largest, then the
  lowest expert holding it, then mask it": the experts of ``router.top_k_experts``, ties to
  the lower expert, a NaN ranked first) and their scores;
- :func:`logit_grad_pieces`: from the top scores' gradient (and any dense gradient of the
  scores or logits), the logits' gradient through the softmax or the sigmoid, written as the
  bfloat16 pieces that the router's two gradient products read.

Used for ``impl="mosaic"`` (``router.route(..., backend="mosaic")``); :func:`block_tokens` says
where (token counts that blocks of ``BLOCK_TOKENS`` divide, expert counts a multiple of 8, and
experts ranked by their scores alone). A balance bias or group-limited routing
(``MoEConfig.balance_bias``, ``expert_groups > 1``) ranks by other values than the weights'
scores, which these kernels do not compute: XLA routes those configs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tilax import _pallas
from tilax.moe.mosaic import common
from tilax.moe.mosaic.common import plgpu

# Tokens per block: one tile of the warpgroup's register layout (``WGMMA``), whose rows come
# in tiles of 64; a block's three float32 pieces of the logits take 48 KiB of shared memory.
BLOCK_TOKENS = 64
SLOTS = 2
# Programs per SM: while one waits for its block, another computes (two fit an SM's shared
# memory: about 104 KiB each for rank). On the H200 the E64 decoder's train step at 131 072
# tokens took 7.88, 7.98, 8.01 ms with one against 7.74, 7.95, 7.98 ms with two (three
# interleaved rounds in one process).
PROGRAMS_PER_SM = 2
# The logits' three bfloat16 pieces (router.bf16_pieces).
PIECES = 3


SCORE_FUNCS = ("softmax", "sigmoid")


def block_tokens(
    num_tokens: int, num_experts: int, top_k: int, *, biased: bool = False,
    expert_groups: int = 1,
) -> int | None:
    """``BLOCK_TOKENS``, or ``None`` where the kernels do not apply (then XLA routes): a token
    count it does not divide, an expert count that is not a multiple of the register layout's
    8 columns, more choices than experts, or a selection other than by the scores themselves
    (a balance bias, ``biased``, or group-limited routing, ``expert_groups > 1``)."""
    if num_tokens % BLOCK_TOKENS or num_experts % 8 or top_k > num_experts:
        return None
    if biased or expert_groups > 1:
        return None
    return BLOCK_TOKENS


def _in_registers(value):
    """``value`` in the warpgroup's ``WGMMA`` layout, whose row reductions the kernels use (the
    interpreter has no register layouts)."""
    if _pallas.interpreted():
        return value
    return plgpu.layout_cast(value, plgpu.Layout.WGMMA)


def _rows(vector, shape):
    """A per-token vector broadcast along a block's experts."""
    return lax.broadcast_in_dim(vector, shape, [0])


def _launch(body, num_tokens: int, block: int, out_type, scratch_types, name: str):
    """A kernel whose programs each take every ``num_programs``-th block of tokens:
    ``body(block_loop, *refs)``, where ``block_loop(fetch, compute)`` starts the copies of a
    block into a slot with ``fetch(first_token, slot)`` one block ahead of ``compute``, once
    the block before has been stored (a slot's shared memory may stage its outputs)."""
    num_blocks = num_tokens // block
    num_programs = min(PROGRAMS_PER_SM * common.sm_count(), num_blocks)

    def block_loop(fetch, compute):
        pid = lax.axis_index("sm")
        count = (num_blocks - pid + num_programs - 1) // num_programs

        def first(i):
            return (pid + i * num_programs) * block

        fetch(first(0), 0)  # every program has a block: num_programs <= num_blocks

        @pl.loop(0, count)
        def _block(i):
            @pl.when(i + 1 < count)
            def _next():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                fetch(first(i + 1), (i + 1) % SLOTS)

            compute(first(i), i % SLOTS)

        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        lambda *refs: body(block_loop, *refs), out_type=out_type, grid=(num_programs,),
        grid_names=("sm",), scratch_types=scratch_types, kernel_name=name,
        compiler_params=common.compiler_params(),
    )


def rank(logit_parts: jax.Array, top_k: int, score_func: str = "softmax"):
    """Logits, scores and the top-k experts from the router product's pieces.

    Args:
        logit_parts: ``[T, 3E]`` float32, ``x @ [r0 | r1 | r2]``; its thirds add up to the
            logits as ``router.sum_thirds`` adds them (smallest first).
        top_k: experts per token.
        score_func: ``"softmax"`` (over each token's experts) or ``"sigmoid"`` (of each
            logit).

    Returns:
        ``logits, scores`` (``[T, E]`` float32, ``scores = softmax(logits)`` or
        ``sigmoid(logits)``) and, transposed, each token's experts best first (``[k, T]``
        int32) and their scores (``[k, T]`` float32); or ``None`` where :func:`block_tokens`
        says the kernel does not apply.
    """
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    num_tokens, three_e = logit_parts.shape
    num_experts = three_e // PIECES
    block = block_tokens(num_tokens, num_experts, top_k)
    if block is None or logit_parts.dtype != jnp.float32:
        return None
    tile = (block, num_experts)

    def body(block_loop, parts_g, logits_g, probs_g, ids_g, top_g,
             parts_smem, ids_smem, top_smem, loaded):
        def fetch(first, slot):
            for piece in range(PIECES):
                plgpu.copy_gmem_to_smem(
                    parts_g.at[pl.ds(first, block), pl.ds(piece * num_experts, num_experts)],
                    parts_smem.at[slot, piece], loaded.at[slot])

        def compute(first, slot):
            plgpu.barrier_wait(loaded.at[slot])
            third = [_in_registers(parts_smem[slot, piece]) for piece in range(PIECES)]
            logits = (third[2] + third[1]) + third[0]
            if score_func == "sigmoid":
                probs = 1.0 / (1.0 + jnp.exp(-logits))
            else:
                shifted = jnp.exp(logits - _rows(logits.max(axis=1), tile))
                probs = shifted / _rows(shifted.sum(axis=1), tile)
            # Staged in the slot's first two pieces, read above: each thread stores where it
            # loaded (the same register layout).
            logits_smem, probs_smem = parts_smem.at[slot, 0], parts_smem.at[slot, 1]
            logits_smem[...] = logits
            probs_smem[...] = probs
            # A NaN ranks first, as in argmax: as +inf, the first max found.
            remaining = jnp.where(probs != probs, jnp.inf, probs)
            experts = _in_registers(lax.broadcasted_iota(jnp.int32, tile, 1))
            for j in range(top_k):
                best = remaining.max(axis=1)
                hit = remaining == _rows(best, tile)
                expert = jnp.where(hit, experts, num_experts).min(axis=1)
                ids_smem[slot, j] = expert
                top_smem[slot, j] = jnp.where(best == jnp.inf, jnp.nan, best)
                remaining = jnp.where(experts == _rows(expert, tile), -jnp.inf, remaining)
            plgpu.commit_smem()
            tokens = pl.ds(first, block)
            for smem, out_g in ((logits_smem, logits_g), (probs_smem, probs_g)):
                plgpu.copy_smem_to_gmem(smem, out_g.at[tokens], commit_group=False)
            for smem, out_g in ((ids_smem, ids_g), (top_smem, top_g)):
                plgpu.copy_smem_to_gmem(smem.at[slot], out_g.at[:, tokens], commit_group=False)
            plgpu.commit_smem_to_gmem_group()

        block_loop(fetch, compute)

    token_major = jax.ShapeDtypeStruct((num_tokens, num_experts), jnp.float32)
    out_type = (token_major, token_major, jax.ShapeDtypeStruct((top_k, num_tokens), jnp.int32),
                jax.ShapeDtypeStruct((top_k, num_tokens), jnp.float32))
    scratch = [
        plgpu.SMEM((SLOTS, PIECES, *tile), jnp.float32),
        plgpu.SMEM((SLOTS, top_k, block), jnp.int32),
        plgpu.SMEM((SLOTS, top_k, block), jnp.float32),
        plgpu.Barrier(num_arrivals=PIECES, num_barriers=SLOTS),
    ]
    kernel = _launch(body, num_tokens, block, out_type, scratch, "moe_router_rank_mosaic")
    return kernel(logit_parts)


def logit_grad_pieces(
    probs: jax.Array,
    expert_ids: jax.Array,
    d_top: jax.Array,
    d_probs: jax.Array | None = None,
    d_logits: jax.Array | None = None,
    *,
    score_func: str = "softmax",
) -> tuple[jax.Array, jax.Array] | None:
    """The logits' gradient through the softmax (or the sigmoid), as the bfloat16 pieces of
    the router's gradient products.

    With ``dp = d_probs + (d_top scattered to expert_ids)``, the logits' gradient is
    ``g = probs * dp - probs * sum(probs * dp) + d_logits`` (softmax) or
    ``g = probs * (1 - probs) * dp + d_logits`` (sigmoid), and ``g = g0 + g1 + g2`` its three
    bfloat16 pieces (``router.bf16_pieces``).

    Args:
        probs: ``[T, E]`` float32 router scores (as :func:`rank` gives them).
        expert_ids: ``[k, T]`` int32, each token's distinct experts (as :func:`rank` gives).
        d_top: ``[k, T]`` float32, the gradient of their scores.
        d_probs, d_logits: ``[T, E]`` float32 dense gradients, or ``None`` for zeros.
        score_func: the scores' function, ``"softmax"`` or ``"sigmoid"``.

    Returns:
        ``([g0 | g1 | g2], [g0 | g0 | g1])``, each ``[T, 3E]`` bfloat16: the operands of the
        router weights' and the tokens' gradient products; or ``None`` where
        :func:`block_tokens` says the kernel does not apply.
    """
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    num_tokens, num_experts = probs.shape
    top_k = expert_ids.shape[0]
    block = block_tokens(num_tokens, num_experts, top_k)
    if block is None:
        return None
    tile = (block, num_experts)
    dense = [g for g in (d_probs, d_logits) if g is not None]

    def body(block_loop, probs_g, ids_g, top_g, *refs):
        dense_g, refs = refs[: len(dense)], refs[len(dense) :]
        pieces_g, x_pieces_g, probs_smem, ids_smem, top_smem, *dense_smem = refs[:-2]
        out_smem, loaded = refs[-2:]

        def fetch(first, slot):
            tokens = pl.ds(first, block)
            copies = [(probs_g.at[tokens], probs_smem), (ids_g.at[:, tokens], ids_smem),
                      (top_g.at[:, tokens], top_smem)]
            copies += [(g.at[tokens], smem) for g, smem in zip(dense_g, dense_smem, strict=True)]
            for src, smem in copies:
                plgpu.copy_gmem_to_smem(src, smem.at[slot], loaded.at[slot])

        def compute(first, slot):
            plgpu.barrier_wait(loaded.at[slot])
            p = _in_registers(probs_smem[slot])
            experts = _in_registers(lax.broadcasted_iota(jnp.int32, tile, 1))
            dp = (_in_registers(dense_smem[0][slot]) if d_probs is not None
                  else jnp.zeros(tile, jnp.float32))
            for j in range(top_k):  # the experts are distinct: one term a cell
                chosen = experts == _rows(ids_smem[slot, j], tile)
                dp = jnp.where(chosen, dp + _rows(top_smem[slot, j], tile), dp)
            if score_func == "sigmoid":  # as XLA's: dp * (p * (1 - p))
                grad = dp * (p * (1.0 - p))
            else:  # the softmax's transpose, as XLA's: p * dp - p * sum(p * dp)
                grad = p * dp - p * _rows((p * dp).sum(axis=1), tile)
            if d_logits is not None:
                grad = grad + _in_registers(dense_smem[-1][slot])
            pieces = []
            for _ in range(PIECES):
                piece = grad.astype(jnp.bfloat16)
                pieces.append(piece)
                grad = grad - piece.astype(jnp.float32)
            for index, piece in enumerate(pieces):
                out_smem[slot, index] = piece
            plgpu.commit_smem()
            tokens = pl.ds(first, block)
            for out_g, order in ((pieces_g, (0, 1, 2)), (x_pieces_g, (0, 0, 1))):
                for column, index in enumerate(order):
                    plgpu.copy_smem_to_gmem(
                        out_smem.at[slot, index],
                        out_g.at[tokens, pl.ds(column * num_experts, num_experts)],
                        commit_group=False)
            plgpu.commit_smem_to_gmem_group()

        block_loop(fetch, compute)

    out = jax.ShapeDtypeStruct((num_tokens, PIECES * num_experts), jnp.bfloat16)
    scratch = [
        plgpu.SMEM((SLOTS, *tile), jnp.float32),
        plgpu.SMEM((SLOTS, top_k, block), jnp.int32),
        plgpu.SMEM((SLOTS, top_k, block), jnp.float32),
        *[plgpu.SMEM((SLOTS, *tile), jnp.float32) for _ in dense],
        plgpu.SMEM((SLOTS, PIECES, *tile), jnp.bfloat16),
        plgpu.Barrier(num_arrivals=3 + len(dense), num_barriers=SLOTS),
    ]
    kernel = _launch(body, num_tokens, block, (out, out), scratch,
                     "moe_router_logit_grad_mosaic")
    return kernel(probs, expert_ids, d_top, *dense)
