"""Decode kernels of the MoE experts: Pallas, Triton backend (interpret mode on CPU).

At 1 to a few hundred tokens the routed experts' forward is bound by reading the weights of
the experts the batch touches, not by its FLOPs: an expert's few token copies fit one small
row tile, and the kernels stream each touched expert's weights once, split over many
programs so that every SM pulls weights. The work items (``decode.DecodeSchedule``) are
(expert, chunk of at most ``block_m`` of its rows) pairs of the touched experts only; the grid
is (column tile of the weights, work item), so each program streams one column strip of one
expert's matrices through a software pipeline of ``num_stages`` ``[block_k, block_n]`` tiles,
against its ``block_m`` rows (``tl.dot`` needs at least 16, padding rows are masked out).

Kernels (each wrapper builds one ``pallas_call``):

- :func:`gate_up_activation`: ``a_r = w_r * f(x_t @ w_gate[e]) * (x_t @ w_up[e])`` for each
  row ``r`` (a copy of token ``t`` routed to ``e`` with combine weight ``w_r``; ``f`` the
  ``MoEConfig.activation``'s nonlinearity, ``tilax.moe.activations``; ``a_r = w_r *
  f(x_t @ w_up[e])`` for the not-gated ``"gelu"``), the rows' tokens gathered from ``x``
  inside the kernel, both projections in one pass over the column strips.
- :func:`down`: ``out_r = a_r @ w_down[e]`` (the weighted copies; the combine adds a token's
  copies in XLA, in a fixed order).

Rows live in a row space of ``R + block_m`` rows (the copies sorted by expert, plus one tile of
padding so that a chunk starting anywhere stays in bounds); each work item stores only its own
rows, and every kept row is stored by exactly one item: exact and deterministic.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from tilax import _pallas
from tilax.moe import activations


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    """Tiles and Triton launch parameters of the decode kernels.

    ``block_m``: rows per work item (a power of two >= 16); ``block_n_gate_up`` and
    ``block_n_down``: columns of the weight strip one program streams in each kernel;
    ``block_k``: contraction step; ``num_warps``/``num_stages`` go to the Triton compiler
    (ignored in interpret mode).
    """

    block_m: int
    block_n_gate_up: int
    block_n_down: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def feature_multiple(self) -> int:
        """``d_model`` and ``d_hidden`` are zero-padded to a multiple of this."""
        return _pallas.MIN_BLOCK


def _item_rows_mask(rows, block_m: int) -> jax.Array:
    """``[block_m, 1]`` bool: the item's first ``rows`` tile rows."""
    return lax.broadcasted_iota(jnp.int32, (block_m, 1), 0) < rows


def _dot(a, b) -> jax.Array:
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _gate_up_kernel(
    expert_ref,
    start_ref,
    rows_ref,
    token_ref,
    scale_ref,
    x_ref,
    *refs,
    activation,
    block_m,
    block_n,
    block_k,
    num_k,
):
    # refs: (w_gate, w_up, out) for a gated activation, (w_up, out) for the not-gated one
    *w_refs, a_ref = refs
    n_tile, item = pl.program_id(0), pl.program_id(1)
    rows = rows_ref[item]

    @pl.when(rows > 0)
    def _compute():
        expert, start = expert_ref[item], start_ref[item]
        n_start = pl.multiple_of(n_tile * block_n, block_n)
        tokens = token_ref[pl.ds(start, block_m)]

        def body(k, accs):
            k_start = pl.multiple_of(k * block_k, block_k)
            cols = k_start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
            x = plt.load(x_ref.at[tokens[:, None], cols])
            return tuple(
                acc + _dot(x, w_ref[expert, pl.ds(k_start, block_k), pl.ds(n_start, block_n)])
                for acc, w_ref in zip(accs, w_refs, strict=True)
            )

        zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in w_refs)
        *gate, up = lax.fori_loop(0, num_k, body, zeros)
        hidden = activations.hidden(activation, gate[0] if gate else None, up)
        act = hidden * scale_ref[pl.ds(start, block_m)][:, None]
        plt.store(
            a_ref.at[pl.ds(start, block_m), pl.ds(n_start, block_n)],
            act.astype(a_ref.dtype),
            mask=_item_rows_mask(rows, block_m),
        )


def gate_up_activation(
    x,
    w_gate,
    w_up,
    schedule,
    row_token,
    row_scale,
    *,
    tiles: DecodeTiles,
    backend: str,
    activation: str = "swiglu",
) -> jax.Array:
    """The scaled activations of the row space, ``[R + block_m, h]`` in ``x.dtype``.

    Args:
        x: ``[T, d]`` tokens.
        w_gate, w_up: ``[E, d, h]`` (``w_gate`` ``None`` for the not-gated ``"gelu"``).
        schedule: a ``decode.DecodeSchedule`` (expert, first row and row count per item).
        row_token: ``[R + block_m]`` int32, the token of each row (any valid token on padding).
        row_scale: ``[R + block_m]`` float32 combine weight of each row.
        tiles, backend: the decode tiles; ``"triton"`` or ``"interpret"``.
        activation: ``MoEConfig.activation`` (static): the epilogue's
            ``activations.hidden``.

    Rows that no item keeps are left unwritten.

    Raises:
        ValueError: ``w_gate`` given for the not-gated activation, or missing for a gated
            one.
    """
    gated = activations.check_gate(activation, w_gate, "w_gate")
    d_dim, h_dim = w_up.shape[1], w_up.shape[2]
    block_n = _pallas.fit_block(tiles.block_n_gate_up, h_dim)
    block_k = _pallas.fit_block(tiles.block_k, d_dim)
    kernel = functools.partial(
        _gate_up_kernel,
        activation=activation,
        block_m=tiles.block_m,
        block_n=block_n,
        block_k=block_k,
        num_k=d_dim // block_k,
    )
    return _pallas.pallas_call(
        kernel,
        backend=backend,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        grid=(h_dim // block_n, schedule.expert.shape[0]),
        out_shape=jax.ShapeDtypeStruct((row_token.shape[0], h_dim), x.dtype),
        name=f"moe_decode_gate_up_{activation}",
    )(*schedule, row_token, row_scale, x, *((w_gate, w_up) if gated else (w_up,)))


def _down_kernel(
    expert_ref, start_ref, rows_ref, a_ref, w_ref, out_ref, *, block_m, block_n, block_k, num_k
):
    n_tile, item = pl.program_id(0), pl.program_id(1)
    rows = rows_ref[item]

    @pl.when(rows > 0)
    def _compute():
        expert, start = expert_ref[item], start_ref[item]
        n_start = pl.multiple_of(n_tile * block_n, block_n)

        def body(k, acc):
            k_start = pl.multiple_of(k * block_k, block_k)
            a = a_ref[pl.ds(start, block_m), pl.ds(k_start, block_k)]
            w = w_ref[expert, pl.ds(k_start, block_k), pl.ds(n_start, block_n)]
            return acc + _dot(a, w)

        acc = lax.fori_loop(0, num_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        plt.store(
            out_ref.at[pl.ds(start, block_m), pl.ds(n_start, block_n)],
            acc.astype(out_ref.dtype),
            mask=_item_rows_mask(rows, block_m),
        )


def down(act, w_down, schedule, *, tiles: DecodeTiles, backend: str) -> jax.Array:
    """``out_r = act_r @ w_down[e(r)]`` over the row space, ``[R + block_m, d]`` in
    ``act.dtype`` (rows that no item keeps are left unwritten).

    Args:
        act: ``[R + block_m, h]`` rows from :func:`gate_up_activation`.
        w_down: ``[E, h, d]``.
        schedule, tiles, backend: as for :func:`gate_up_activation`.
    """
    h_dim, d_dim = w_down.shape[1], w_down.shape[2]
    block_n = _pallas.fit_block(tiles.block_n_down, d_dim)
    block_k = _pallas.fit_block(tiles.block_k, h_dim)
    kernel = functools.partial(
        _down_kernel,
        block_m=tiles.block_m,
        block_n=block_n,
        block_k=block_k,
        num_k=h_dim // block_k,
    )
    return _pallas.pallas_call(
        kernel,
        backend=backend,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        grid=(d_dim // block_n, schedule.expert.shape[0]),
        out_shape=jax.ShapeDtypeStruct((act.shape[0], d_dim), act.dtype),
        name="moe_decode_down",
    )(*schedule, act, w_down)
