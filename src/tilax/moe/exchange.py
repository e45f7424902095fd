"""Expert parallelism's token exchange: where each token copy goes, and the collectives that
carry copies to their expert's device and results back (inside ``shard_map``).

On the sending device every kept copy gets a *slot* in a send buffer, grouped by destination
device and, within one, by expert (one ``argsort`` of the copies by expert, as on one device).
Two transports move the buffer along the expert axis; both are dropless (the third,
``all_gather``, moves tokens instead of copies: ``expert_parallel._gathered_experts``):

- ``all_to_all``: one ``jax.lax.all_to_all`` of ``[n, B, ...]`` blocks, block ``j`` for device
  ``j``. ``B = T_local * min(top_k, E_local)`` bounds the copies one device can send another
  (a token sends at most one copy to each expert), so no routing, however skewed, overflows
  it; the price is that every block travels whole, full or not. Runs on every backend.
- ``ragged``: ``jax.lax.ragged_all_to_all`` moves only the kept copies: the send buffer is the
  copies sorted by expert, each device's chunk lands packed behind the chunks of lower-ranked
  senders, and an ``all_gather`` of the per-destination counts first tells every device the
  offsets. XLA:CPU has no ragged all-to-all; there :func:`emulated_ragged_all_to_all` (built
  on ``all_to_all``, same signature and result) stands in, so the CPU tests run this path's
  offset logic and only the collective itself is GPU-only.

Either way the receiving device gets ``n * B`` rows (a worst-case size; rows past what arrived
are marked empty) with each row's expert on that device. Moving data between token space and
slots is a gather in both directions (custom VJPs below), as on one device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from tilax import _pallas
from tilax.moe import dispatch

TRANSPORTS = ("auto", "all_gather", "all_to_all", "ragged")


class Slots(NamedTuple):
    """Where the copies of one device's tokens sit in its send buffer (``S`` slots).

    Attributes:
        copy_slot: ``[T, k]`` int32 slot of each copy (in range, meaningless where not kept).
        copy_kept: ``[T, k]`` bool, the copy is sent.
        slot_copy: ``[S]`` int32 copy held by each slot (``t * k + j``; 0 where empty).
        slot_valid: ``[S]`` bool, the slot holds a copy.
        slot_expert: ``[S]`` int32 the copy's expert on its destination device (its index
            among that device's experts), ``E_local`` where empty.
        dest_start: ``[n]`` int32 first row of each destination's copies in expert order.
        dest_count: ``[n]`` int32 copies for each destination.
    """

    copy_slot: jax.Array
    copy_kept: jax.Array
    slot_copy: jax.Array
    slot_valid: jax.Array
    slot_expert: jax.Array
    dest_start: jax.Array
    dest_count: jax.Array


def block_rows(tokens: int, top_k: int, local_experts: int, capacity: int | None) -> int:
    """``B``: the most copies one device can send one destination (all its tokens' copies for
    that destination's experts), further bounded by the destination's capacity under capacity
    routing."""
    rows = tokens * min(top_k, local_experts)
    return rows if capacity is None else min(rows, local_experts * capacity)


def resolve_transport(transport: str) -> str:
    """``auto``: ``all_gather`` (``expert_parallel._gathered_experts``). It never moves more
    bytes than ``all_to_all`` (each trip sends a device's ``T_local`` tokens once, against
    ``T_local * min(top_k, E_local)`` rows per destination), and on two H200s (jax 0.11.2,
    ``ep`` suite, run ``fee7429``) its train step was the fastest of the three at every
    measured size; ``jax.lax.ragged_all_to_all`` was 15-50x slower there."""
    if transport == "auto":
        return "all_gather"
    return transport


def make_slots(expert_ids, kept, num_experts: int, devices: int, rows: int, packed: bool):
    """The send buffer's slots for copies ``expert_ids: [T, k]`` (``kept``: ``[T, k]`` bool).

    ``packed``: slot = the copy's row among the kept copies sorted by expert (``S = T * k``,
    the ``ragged`` transport); else slot ``j * rows + i`` for the ``i``-th copy to device
    ``j`` (``S = devices * rows``, the ``all_to_all`` transport).
    """
    local_experts = num_experts // devices
    layout = dispatch.sort_by_expert(expert_ids, num_experts, kept=kept)
    bounds = layout.group_offsets[::local_experts]  # [devices + 1]
    dest_start, dest_count = bounds[:-1], bounds[1:] - bounds[:-1]
    flat_expert = expert_ids.reshape(-1)
    if packed:
        slot_row = jnp.arange(layout.row_copy.shape[0], dtype=jnp.int32)
        slot_valid = layout.row_valid
        copy_slot = layout.copy_row
    else:
        dest = jnp.arange(devices * rows, dtype=jnp.int32) // rows
        within = jnp.arange(devices * rows, dtype=jnp.int32) % rows
        slot_valid = within < dest_count[dest]
        slot_row = jnp.where(slot_valid, dest_start[dest] + within, 0)
        copy_dest = expert_ids // local_experts
        copy_slot = copy_dest * rows + layout.copy_row - dest_start[copy_dest]
        copy_slot = jnp.where(layout.copy_kept, copy_slot, 0)
    slot_copy = jnp.where(slot_valid, layout.row_copy[slot_row], 0)
    slot_expert = jnp.where(slot_valid, flat_expert[slot_copy] % local_experts, local_experts)
    return Slots(copy_slot, layout.copy_kept, slot_copy, slot_valid,
                 slot_expert.astype(jnp.int32), dest_start, dest_count)


# ----------------------------------------------------------------------------------------------
# Token space <-> slots, gathers both ways


@jax.custom_vjp
def to_slots(x, slots: Slots):
    """``send[s] = x[token of slot s]`` (zero where empty): ``[S, d]``."""
    top_k = slots.copy_slot.shape[1]
    rows = jnp.take(x, slots.slot_copy // top_k, axis=0)
    return jnp.where(slots.slot_valid[:, None], rows, jnp.zeros((), x.dtype))


def _to_slots_fwd(x, slots):
    return to_slots(x, slots), (slots, x.shape[0])


def _to_slots_bwd(residuals, d_send):
    slots, _ = residuals
    values = jnp.take(d_send, slots.copy_slot, axis=0).astype(jnp.float32)
    values = jnp.where(slots.copy_kept[..., None], values, 0.0)
    return jnp.sum(values, axis=1).astype(d_send.dtype), None


to_slots.defvjp(_to_slots_fwd, _to_slots_bwd)


@jax.custom_vjp
def from_slots(back, weights, slots: Slots):
    """The weighted combine of returned results: ``y[t] = sum_j w[t, j] * back[slot(t, j)]``
    over sent copies (float32 sum), ``[T, d]`` in ``back.dtype``."""
    return _combine(back, weights, slots)[0]


def _combine(back, weights, slots):
    values = jnp.take(back, slots.copy_slot, axis=0)
    values = jnp.where(slots.copy_kept[..., None], values, jnp.zeros((), back.dtype))
    weights = jnp.where(slots.copy_kept, weights.astype(jnp.float32), 0.0)
    y = jnp.sum(values.astype(jnp.float32) * weights[..., None], axis=1).astype(back.dtype)
    return y, values


def _from_slots_fwd(back, weights, slots):
    y, values = _combine(back, weights, slots)
    return y, (values, weights, slots)


def _from_slots_bwd(residuals, dy):
    values, weights, slots = residuals
    top_k = weights.shape[1]
    slot_weight = jnp.take(weights.reshape(-1).astype(jnp.float32), slots.slot_copy)
    slot_dy = jnp.take(dy, slots.slot_copy // top_k, axis=0).astype(jnp.float32)
    d_back = jnp.where(slots.slot_valid[:, None], slot_weight[:, None] * slot_dy, 0.0)
    d_weights = jnp.sum(values.astype(jnp.float32) * dy[:, None, :].astype(jnp.float32), -1)
    d_weights = jnp.where(slots.copy_kept, d_weights, 0.0)
    return d_back.astype(values.dtype), d_weights.astype(weights.dtype), None


from_slots.defvjp(_from_slots_fwd, _from_slots_bwd)


# ----------------------------------------------------------------------------------------------
# Transports


class AllToAll(NamedTuple):
    """Whole ``[n, B]`` blocks through ``jax.lax.all_to_all`` (slots ``j * B + i``)."""

    axis: str
    devices: int
    rows: int

    def there(self, send):
        """Send buffer ``[n * B, ...]`` -> receive buffer ``[n * B, ...]`` (row ``i * B + r``
        from device ``i``)."""
        blocks = send.reshape((self.devices, self.rows) + send.shape[1:])
        return lax.all_to_all(blocks, self.axis, 0, 0).reshape(send.shape)

    def back(self, results):
        """Receive-buffer rows back to the slots they came from (the same exchange)."""
        return self.there(results)


class Ragged(NamedTuple):
    """Only the kept copies through ``jax.lax.ragged_all_to_all`` (packed slots).

    ``counts[i, j]``: copies device ``i`` sends device ``j`` (all-gathered first).
    """

    axis: str
    devices: int
    rows: int
    counts: jax.Array
    collective: object

    @classmethod
    def create(cls, axis: str, devices: int, rows: int, slots: Slots):
        counts = lax.all_gather(slots.dest_count, axis)
        collective = lax.ragged_all_to_all
        if _pallas.platform() == "cpu":
            collective = emulated_ragged_all_to_all
        return cls(axis, devices, rows, counts, collective)

    def _exclusive(self, values, axis):
        return jnp.cumsum(values, axis=axis) - values

    def there(self, send, fill=0):
        me = lax.axis_index(self.axis)
        received = self.counts[:, me]
        output = jnp.full((self.devices * self.rows,) + send.shape[1:], fill, send.dtype)
        return self.collective(
            send, output,
            self._exclusive(self.counts[me], 0),  # my chunk for j starts here in my buffer
            self.counts[me],
            self._exclusive(self.counts, 0)[me],  # ... and lands here on j
            received,
            axis_name=self.axis,
        )

    def back(self, results, num_slots: int):
        me = lax.axis_index(self.axis)
        received = self.counts[:, me]
        output = jnp.zeros((num_slots,) + results.shape[1:], results.dtype)
        return self.collective(
            results, output,
            self._exclusive(received, 0),  # sender i's chunk sits here in my buffer
            received,
            self._exclusive(self.counts, 1)[:, me],  # ... and came from here in i's buffer
            self.counts[me],
            axis_name=self.axis,
        )


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """``jax.lax.ragged_all_to_all`` with one slice per device, from ``all_to_all`` and
    gathers: for backends without the collective (XLA:CPU). Sends whole ``operand``-sized
    blocks (the receiver reads ``recv_sizes`` rows of each, which equal the senders'
    ``send_sizes``), so it is for tests and small problems."""
    del send_sizes
    size = operand.shape[0]
    within = jnp.arange(size, dtype=jnp.int32)
    source_rows = jnp.clip(input_offsets[:, None] + within[None, :], 0, size - 1)
    blocks = jnp.take(operand, source_rows, axis=0)  # [devices, size, ...]
    blocks = lax.all_to_all(blocks, axis_name, 0, 0)  # block i now from device i
    landing = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # i's chunk here
    rows = jnp.arange(output.shape[0], dtype=jnp.int32)
    inside = (rows[:, None] >= landing[None, :]) & (rows[:, None] < (landing + recv_sizes)[None])
    source = jnp.argmax(inside, axis=1)
    position = jnp.clip(rows - landing[source], 0, size - 1)
    received = blocks[source, position]
    hit = jnp.any(inside, axis=1).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(hit, received, output)

