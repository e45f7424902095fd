"""The decode path of the routed experts: small batches, bound by reading the touched weights.

At 1 to a few hundred tokens a forward reads each touched expert's ``w_gate``, ``w_up`` and
``w_down`` (``3 * d * h`` elements; ``2 * d * h`` for the not-gated ``"gelu"``, which has no
``w_gate``) and does little arithmetic with them: its floor is the touched experts' weight
bytes over the GPU's copy bandwidth. The training-sized kernels
(``triton.py``, ``mosaic/``) tile rows by 64-128 and launch one program per row tile and
column tile, so at these sizes most of their rows are padding and few programs stream weights.
This path instead:

1. sorts the copies by expert (``dispatch.sort_by_expert``) and makes one work item per
   (touched expert, chunk of at most ``block_m`` of its rows) (:func:`decode_schedule`); the
   grid has a static bound on the items, and unused items end at once;
2. runs gate/up with the ``MoEConfig.activation`` (``tilax.moe.activations``) and the combine
   weight in its epilogue, then the down projection (``triton_decode.py``), each program
   streaming one column strip of one touched expert's weights: an expert's weights are read
   once per chunk of its rows, and the column tiles are sized so that the touched experts
   give every SM programs (:func:`decode_tiles`);
3. adds each token's weighted copies in XLA (``dispatch.sum_copies``, a fixed order).

Forward only: under differentiation the custom VJP runs the layer's training path instead
(``pallas.PallasExperts`` on the backend ``impl="auto"`` would take without this rule,
``rules.kernel_backend``), forward and backward, so a train step at a small batch is exactly
the training kernels' step; an inference call (no gradient) runs the decode kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tilax import _pallas
from tilax.moe import dispatch, pallas, rules
from tilax.moe.base import RoutedCopies


class DecodeSchedule(NamedTuple):
    """Work items of the decode kernels (arrays of ``W`` int32): item ``w`` computes rows
    ``[start[w], start[w] + rows[w])`` of the row space, all of expert ``expert[w]``;
    ``rows[w] == 0`` marks an unused item. ``W = min(E, R) + R // block_m`` bounds the count
    of (touched expert, chunk) pairs for ``R`` rows, so the grid is static."""

    expert: jax.Array
    start: jax.Array
    rows: jax.Array


def schedule_items(num_rows: int, num_experts: int, block_m: int) -> int:
    """The static item count ``W`` of :class:`DecodeSchedule` for ``num_rows`` rows."""
    return min(num_experts, num_rows) + num_rows // block_m


def decode_schedule(
    group_sizes: jax.Array, group_offsets: jax.Array, num_rows: int, block_m: int
) -> DecodeSchedule:
    """The work items for experts holding ``group_sizes`` rows each, expert ``e`` at rows
    ``[group_offsets[e], group_offsets[e + 1])`` of a row space of ``num_rows`` rows: each
    touched expert's rows in chunks of ``block_m``, experts in order."""
    num_experts = group_sizes.shape[0]
    num_items = schedule_items(num_rows, num_experts, block_m)
    chunks = -(-group_sizes // block_m)
    item_end = jnp.cumsum(chunks)
    items = jnp.arange(num_items, dtype=jnp.int32)
    expert = jnp.minimum(
        jnp.searchsorted(item_end, items, side="right", method="compare_all"), num_experts - 1
    ).astype(jnp.int32)
    chunk = items - (item_end - chunks)[expert]
    used = items < item_end[-1]
    rows = jnp.clip(group_sizes[expert] - chunk * block_m, 0, block_m)
    start = group_offsets[expert] + chunk * block_m
    return DecodeSchedule(
        expert=expert,
        start=jnp.where(used, start, 0).astype(jnp.int32),
        rows=jnp.where(used, rows, 0).astype(jnp.int32),
    )


def decode_tiles(num_rows: int, num_experts: int, d_model: int, d_hidden: int, dtype) -> Any:
    """The decode kernels' tiles (``triton_decode.DecodeTiles``) for ``num_rows`` token copies.

    - ``block_m``: 1.5 times the mean rows of a touched expert, as a power of two in
      ``[16, 128]`` (16 is ``tl.dot``'s smallest tile): most touched experts are read once.
    - column tiles: the widest of 128, 64, 32 columns whose programs over the touched experts
      (at most ``min(E, R)``) fill every SM twice; 32 where none does. A narrower strip puts
      more SMs on the weights; its rows stay 64 bytes or more of 16-bit weights.
    - ``block_k`` 128 (64 with 128-column strips), 4 warps (8 for 128 rows), and up to 4
      pipeline stages, as many as fit 70% of a block's shared memory (the rest for Triton's
      epilogue): about three 16-48 KiB stages of weights in flight per program.
    - float32: 64-column strips, ``block_k`` 32, 2 stages (no tensor-core path, less shared
      memory per element).

    Off GPUs (interpret mode) the same rules, with the tiles capped at 32: there they set the
    interpreter's loop counts only.
    """
    touched = max(1, min(num_experts, num_rows))
    mean_rows = -(-num_rows // touched)
    block_m = min(128, max(_pallas.MIN_BLOCK, _pallas.next_power_of_2(-(-3 * mean_rows // 2))))

    def strip(columns: int) -> int:
        for block_n in (128, 64):
            if touched * (columns // block_n) >= 2 * _pallas.sm_count():
                return block_n
        return 32

    block_n_gate_up, block_n_down = strip(d_hidden), strip(d_model)
    block_k = 64 if max(block_n_gate_up, block_n_down) == 128 else 128
    # one stage of the gate/up kernel (the larger): a row tile and two weight tiles
    stage_bytes = (block_m + 2 * block_n_gate_up) * block_k * jnp.dtype(dtype).itemsize
    stages = max(2, min(4, int(0.7 * _pallas.shared_memory_per_block()) // stage_bytes))
    if jnp.dtype(dtype) == jnp.float32:
        block_n_gate_up, block_n_down, block_k, stages = 64, 64, 32, 2
    if _pallas.platform() != "gpu":
        block_m = min(block_m, 32)
        block_n_gate_up, block_n_down, block_k = 32, 32, 32
    # local import: the kernel module loads Pallas's Triton lowering, which a CPU never uses
    from tilax.moe import triton_decode

    return triton_decode.DecodeTiles(
        block_m=block_m,
        block_n_gate_up=block_n_gate_up,
        block_n_down=block_n_down,
        block_k=block_k,
        num_warps=8 if block_m >= 128 else 4,
        num_stages=stages,
    )


def config_tiles(config, tiles):
    """``tiles`` with the ``MoEConfig`` tile fields that are set: ``block_m``, ``block_n`` (both
    kernels' column strips), ``block_k``, ``num_warps`` and ``num_stages`` (for A/B runs; a
    config with tiles set is outside the decode rule of ``impl="auto"``)."""
    overrides = {
        name: getattr(config, name)
        for name in ("block_m", "block_k", "num_warps", "num_stages")
        if getattr(config, name) is not None
    }
    if config.block_n is not None:
        overrides.update(block_n_gate_up=config.block_n, block_n_down=config.block_n)
    return dataclasses.replace(tiles, **overrides)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Static choices of one decode call: the layer's config, the decode kernels' backend and
    tiles, the backend of the training path (run under differentiation), the capacity and
    whether the row space is sparse (``base.RoutedCopies``)."""

    config: Any
    backend: str
    tiles: Any
    train_backend: str
    capacity: int | None
    sparse_rows: bool


def _forward(plan: DecodePlan, x, w_gate, w_up, w_down, weights, expert_ids, kept):
    """The decode kernels' ``y`` (``[T, d]`` in ``x.dtype``) and the layout's kept count."""
    from tilax.moe import triton_decode

    tiles, num_experts = plan.tiles, w_up.shape[0]
    layout = dispatch.sort_by_expert(expert_ids, num_experts, capacity=plan.capacity, kept=kept)
    num_rows = layout.row_token.shape[0]
    schedule = decode_schedule(layout.group_sizes, layout.group_offsets, num_rows, tiles.block_m)
    # one tile of padding: a chunk starting at any row reads and writes in bounds
    row_token = jnp.pad(layout.row_token, (0, tiles.block_m))
    row_scale = jnp.pad(dispatch.row_weights(weights, layout), (0, tiles.block_m))
    x, w_gate, w_up, w_down = pallas.pad_features(plan.config, tiles, x, w_gate, w_up, w_down)
    kw = dict(tiles=tiles, backend=plan.backend)
    act = triton_decode.gate_up_activation(
        x, w_gate, w_up, schedule, row_token, row_scale, activation=plan.config.activation, **kw
    )
    rows = triton_decode.down(act, w_down, schedule, **kw)[:num_rows, : plan.config.d_model]
    return dispatch.sum_copies(rows, layout), layout.group_offsets[-1]


def _training(plan: DecodePlan, x, w_gate, w_up, w_down, weights, expert_ids, kept):
    copies = RoutedCopies(expert_ids, weights, plan.capacity, kept, plan.sparse_rows)
    return pallas.PallasExperts(plan.train_backend)(plan.config, x, w_gate, w_up, w_down, copies)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def decode_experts(plan: DecodePlan, x, w_gate, w_up, w_down, weights, expert_ids, kept):
    """``y[t] = sum_j weights[t, j] * expert_{expert_ids[t, j]}(x[t])`` over the kept copies
    (the config's activation; ``w_gate`` ``None`` when not gated), by the decode kernels;
    differentiable through the training path (module docstring)."""
    return _forward(plan, x, w_gate, w_up, w_down, weights, expert_ids, kept)[0]


def _decode_experts_fwd(plan, x, w_gate, w_up, w_down, weights, expert_ids, kept):
    # The training path's own forward and VJP: its residuals (jax.vjp's Partial, a pytree of
    # arrays) are this rule's.
    y, vjp = jax.vjp(
        lambda *diff: _training(plan, *diff, expert_ids, kept), x, w_gate, w_up, w_down, weights
    )
    return y, vjp


def _decode_experts_bwd(plan, vjp, dy):
    return (*vjp(dy), None, None)


decode_experts.defvjp(_decode_experts_fwd, _decode_experts_bwd)


@dataclasses.dataclass(frozen=True)
class DecodeExperts:
    """The routed experts on the decode kernels (a ``base.RoutedExperts``): Triton on GPUs,
    the Pallas interpreter on CPU."""

    def __call__(self, config, x, w_gate, w_up, w_down, copies: RoutedCopies):
        num_tokens, top_k = copies.expert_ids.shape
        num_experts = w_up.shape[0]
        rows = dispatch.row_count(num_tokens, top_k, num_experts, copies.capacity)
        plan = DecodePlan(
            config=config,
            backend=_pallas.resolve_backend("triton"),
            tiles=config_tiles(
                config, decode_tiles(rows, num_experts, config.d_model, config.d_hidden, x.dtype)
            ),
            train_backend=rules.kernel_backend(config),
            capacity=copies.capacity,
            sparse_rows=copies.sparse_rows,
        )
        y = decode_experts(
            plan, x, w_gate, w_up, w_down, copies.weights, copies.expert_ids, copies.kept
        )
        kept = None
        if copies.capacity is not None or copies.kept is not None:
            kept = _forward_kept(copies, num_experts)
        return y, kept


def _forward_kept(copies: RoutedCopies, num_experts: int) -> jax.Array:
    """The number of kept copies (the layout's, recomputed outside the custom VJP: an int)."""
    layout = dispatch.sort_by_expert(
        copies.expert_ids, num_experts, capacity=copies.capacity, kept=copies.kept
    )
    return layout.group_offsets[-1]
