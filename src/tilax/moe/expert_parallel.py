"""Expert parallelism: the MoE layer over a ``jax.sharding.Mesh`` (``moe_apply(..., mesh=)``).

One ``jax.shard_map`` over all mesh axes. The tokens are split over every axis (device ``i`` in
row-major mesh order holds tokens ``[i * T_local, (i + 1) * T_local)``, the batch zero-padded
to a multiple of the device count; padding tokens are masked out of everything), the routed
experts' leading dimension over ``expert_axis`` (device ``j`` along it owns experts
``[j * E_local, (j + 1) * E_local)``), the router (its balance bias too) and the shared expert
are replicated. On each device:

1. route its tokens (the same ``router.route_layer``: scores, bias, groups and scale as on one
   device);
2. decide which copies are kept: all of them (dropless), or under capacity routing the same
   copies as on one device: a copy's rank among the copies of its expert over the *whole*
   batch is its rank on this device plus the copies of that expert on lower-ranked devices
   (an ``all_gather`` of the per-device counts), and it is kept when below
   ``C = ceil(capacity_factor * T * k / E)`` with the global ``T``;
3. ``aux`` from sums over every device (``psum``): the same numbers as on one device;
4. send each kept copy along ``expert_axis`` to its expert's device (the exchange below: a
   dropless exchange sized for the worst case), run the local experts on what arrived with
   the same implementation as on one device (the Pallas kernels compute only the rows that
   arrived), send the results back and combine them with the routing weights where the token
   lives;
5. add the shared expert.

Dense routing runs every expert on every token instead: each device all-gathers the tokens of
its row of ``expert_axis``, applies its own experts weighted by the routing weights (float32
partial sums), and a ``psum_scatter`` adds the partial sums up and hands each device its own
tokens' outputs. Gradients come from JAX's transposes of the collectives and the custom VJPs
of the expert path and of the exchange's gathers.

The exchange (``all_to_all``): on the sending device every kept copy gets a *slot* in a send
buffer, grouped by destination device and, within one, by expert (one ``argsort`` of the
copies by expert, as on one device). One ``jax.lax.all_to_all`` moves ``[n, B, ...]`` blocks,
block ``j`` for device ``j``; ``B = T_local * min(top_k, E_local)`` bounds the copies one
device can send another (a token sends at most one copy to each expert), so no routing,
however skewed, overflows it; the price is that every block travels whole, full or not. The
receiving device gets ``n * B`` rows (rows past what arrived are marked empty) with each row's
expert on that device. Moving data between token space and slots is a gather in both
directions (custom VJPs below), as on one device. The ``all_gather`` transport
(:func:`_gathered_experts`) moves tokens instead of copies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tilax import _pallas
from tilax.moe import activations, dispatch, reference, router
from tilax.moe.base import RoutedCopies


def check_mesh(mesh, expert_axis: str, num_experts: int) -> None:
    """Raise unless ``mesh`` is a Mesh with an axis ``expert_axis`` dividing ``num_experts``."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if expert_axis not in mesh.axis_names:
        raise ValueError(
            f"expert_axis {expert_axis!r} is not an axis of the mesh "
            f"(its axes are {tuple(mesh.axis_names)})"
        )
    size = mesh.shape[expert_axis]
    if num_experts % size:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the size of mesh axis "
            f"{expert_axis!r} ({size}): each device along it owns num_experts / {size} experts"
        )


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """Static facts of one sharded call."""

    token_axes: tuple[str, ...]  # every mesh axis, in mesh order
    axis_sizes: tuple[int, ...]
    expert_axis: str
    num_tokens: int  # the real T (before padding)
    capacity: int | None
    transport: str

    @property
    def expert_devices(self) -> int:
        return self.axis_sizes[self.token_axes.index(self.expert_axis)]

    def token_shard(self) -> jax.Array:
        """This device's index among the token shards (row-major over the mesh axes)."""
        index = jnp.zeros((), jnp.int32)
        for name, size in zip(self.token_axes, self.axis_sizes, strict=True):
            index = index * size + lax.axis_index(name)
        return index


def moe_apply_sharded(params, x, config, experts, *, mesh, expert_axis):
    """``moe_apply`` with expert parallelism; inputs already validated (see module docs).

    One ``jax.jit`` program (inlined in the caller's ``jit``), so that an eager call or an
    eager ``jax.grad`` compiles the sharded layer once instead of running it op by op. Where
    nothing asks for explicit sharding types (no ``jax.set_mesh``, no input typed with a
    sharding) it runs over the mesh's devices with automatic axes (:func:`_automatic`).
    ``y`` comes back split along its first dimension over every mesh axis where that
    dimension divides over the devices, else replicated (JAX splits a dimension only
    evenly)."""
    if _untyped(params, x):
        mesh = _automatic(mesh)
    return _sharded(params, x, config, experts, mesh, expert_axis)


def _untyped(*trees) -> bool:
    """No mesh in context (``jax.set_mesh``) and no input typed with a sharding: the layer is
    free to run over automatic axes."""
    if not jax.sharding.get_abstract_mesh().empty:
        return False
    return all(jax.typeof(leaf).sharding.mesh.empty for leaf in jax.tree.leaves(trees))


def _automatic(mesh):
    """``mesh`` with automatic axes. With explicit ones (``jax.make_mesh``'s default) the
    outputs would be typed with their sharding, and a caller's eager ``jax.grad`` then fails
    outside ``jax.set_mesh`` (its seed cotangent lives on one device); with automatic ones they
    carry the same layout untyped."""
    automatic = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    if tuple(mesh.axis_types) == automatic:
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=automatic)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _sharded(params, x, config, experts, mesh, expert_axis):
    token_axes = tuple(mesh.axis_names)
    lead_shape = jnp.shape(x)[:-1]
    num_tokens = math.prod(lead_shape)
    devices = mesh.size
    padded = _pallas.round_up(num_tokens, devices)
    x2 = jnp.reshape(x, (num_tokens, config.d_model))
    if padded != num_tokens:
        x2 = jnp.pad(x2, ((0, padded - num_tokens), (0, 0)))
    capacity = None
    if config.routing == "capacity":
        capacity = dispatch.expert_capacity(
            num_tokens, config.top_k, config.num_experts, config.capacity_factor
        )
    plan = MeshPlan(token_axes, tuple(mesh.shape[a] for a in token_axes), expert_axis,
                    num_tokens, capacity, resolve_transport(config.exchange))
    expert_weights = activations.expert_weight_names(config.activation)
    used = {name: params[name] for name in ("router", *expert_weights)}
    specs = {"router": P(), **{name: P(expert_axis) for name in expert_weights}}
    if config.balance_bias:  # replicated, as the router: every device selects with it
        used["router_bias"] = params["router_bias"]
        specs["router_bias"] = P()
    if config.shared_hidden:
        used["shared"] = params["shared"]
        specs["shared"] = {name: P() for name in params["shared"]}
    token_spec = P(token_axes)
    used = jax.tree.map(lambda v, s: _placed(v, mesh, s), used, specs)
    x2 = _placed(x2, mesh, token_spec)

    def local(params, x):
        return _local_layer(params, x, config=config, experts=experts, plan=plan)

    # check_vma=False: pallas_call's output types say nothing of the mesh axes they vary over.
    # Without the check, shard_map's transpose still sums the gradients of the replicated
    # inputs (router, shared expert; expert weights over the axes other than expert_axis).
    y, aux = jax.shard_map(
        local, mesh=mesh, in_specs=(specs, token_spec), out_specs=(token_spec, P()),
        check_vma=False,
    )(used, x2)
    if padded != num_tokens or len(lead_shape) != 1:
        y = _placed(y, mesh, P())[:num_tokens].reshape(lead_shape + (config.d_model,))
        split = lead_shape[0] % devices == 0
        y = _constrained(y, mesh, token_spec if split else P())
    return y, aux


def _constrained(value, mesh, spec):
    """``value`` laid out as ``spec`` over ``mesh``, whatever the mesh's axis types."""
    explicit = jax.sharding.AxisType.Explicit
    if mesh.axis_types and all(t == explicit for t in mesh.axis_types):
        return jax.reshard(value, NamedSharding(mesh, spec))
    return lax.with_sharding_constraint(value, NamedSharding(mesh, spec))


def _placed(value, mesh, spec):
    """``value`` sharded as ``spec``: explicit-axis meshes need it said (``jax.reshard``);
    ``shard_map`` reshards its inputs itself over automatic axes."""
    explicit = jax.sharding.AxisType.Explicit
    if mesh.axis_types and all(t == explicit for t in mesh.axis_types):
        return jax.reshard(value, NamedSharding(mesh, spec))
    return value


def _local_layer(params, x, *, config, experts, plan: MeshPlan):
    """The layer on one device's tokens ``x: [T_local, d]``; returns ``(y, aux)``."""
    local_tokens = x.shape[0]
    first = plan.token_shard() * local_tokens
    token_valid = first + jnp.arange(local_tokens, dtype=jnp.int32) < plan.num_tokens
    routed = router.route_layer(x, params, config)
    copy_valid = jnp.broadcast_to(token_valid[:, None], routed.expert_ids.shape)
    kept = _kept_copies(routed.expert_ids, copy_valid, config.num_experts, plan)
    aux = _global_aux(routed, copy_valid, kept, config, plan)

    dtype = config.dtype
    xc = x.astype(dtype)
    # (w_gate, w_up, w_down), w_gate None for the not-gated activation
    weights = [params[n].astype(dtype) if n in params else None
               for n in ("w_gate", "w_up", "w_down")]
    if config.routing == "dense":
        y = _dense_experts(xc, weights, routed, token_valid, plan, config.activation)
    elif plan.transport == "all_gather":
        y = _gathered_experts(config, experts, xc, weights, routed, kept, plan)
    else:
        y = _exchanged_experts(config, experts, xc, weights, routed, kept, plan)
    if config.shared_hidden:
        shared = {n: params["shared"][n].astype(dtype)
                  for n in activations.expert_weight_names(config.activation)}
        y = y + reference.shared_expert(xc, shared, config.activation)
    return y.astype(dtype), aux


def _kept_copies(expert_ids, copy_valid, num_experts: int, plan: MeshPlan):
    """``[T_local, k]`` bool: the copies computed. Capacity routing keeps a copy when fewer
    than ``C`` copies of its expert come before it in the whole batch."""
    if plan.capacity is None:
        return copy_valid
    local_counts = dispatch.expert_counts(jnp.where(copy_valid, expert_ids, num_experts),
                                          num_experts)
    every_device = lax.all_gather(local_counts, plan.token_axes)  # [devices, E], mesh order
    earlier = jnp.arange(every_device.shape[0]) < plan.token_shard()
    before = jnp.sum(jnp.where(earlier[:, None], every_device, 0), axis=0)
    rank = before[expert_ids] + dispatch.copy_ranks(expert_ids, num_experts, copy_valid)
    return copy_valid & (rank < plan.capacity)


def _global_aux(routed, copy_valid, kept, config, plan: MeshPlan):
    """``aux`` of the whole batch: per-device sums added up over every mesh axis."""
    axes = plan.token_axes
    token_valid = copy_valid[:, 0]
    ids = jnp.where(copy_valid, routed.expert_ids, config.num_experts)
    z = jax.nn.logsumexp(routed.logits, axis=-1)
    kept_copies = None
    if plan.capacity is not None:
        kept_copies = lax.psum(jnp.sum(kept, dtype=jnp.int32), axes)
    return router.aux_from_sums(
        counts=lax.psum(dispatch.expert_counts(ids, config.num_experts), axes),
        prob_sums=lax.psum(jnp.sum(jnp.where(token_valid[:, None], routed.probs, 0.0), 0), axes),
        z_squared_sum=lax.psum(jnp.sum(jnp.where(token_valid, z * z, 0.0)), axes),
        num_tokens=plan.num_tokens,
        top_k=config.top_k,
        kept_copies=kept_copies,
    )


def _exchanged_experts(config, experts, x, weights, routed, kept, plan: MeshPlan):
    """Send the kept copies to their experts' devices, run the local experts, bring the
    results back and combine them: ``[T_local, d]``."""
    devices = plan.expert_devices
    local_experts = config.num_experts // devices
    rows = block_rows(x.shape[0], config.top_k, local_experts, plan.capacity)
    slots = make_slots(routed.expert_ids, kept, config.num_experts, devices, rows)
    transport = AllToAll(plan.expert_axis, devices, rows)
    received = transport.there(to_slots(x, slots))
    expert = transport.there(slots.slot_expert)
    arrived = expert < local_experts
    copies = RoutedCopies(
        expert_ids=jnp.where(arrived, expert, 0)[:, None],
        weights=arrived.astype(jnp.float32)[:, None],  # unit weights: combined at home
        kept=arrived[:, None],
        sparse_rows=True,
    )
    results, _ = experts(config, received, *weights, copies)
    return from_slots(transport.back(results), routed.weights, slots)


def _gathered_experts(config, experts, x, weights, routed, kept, plan: MeshPlan):
    """The ``all_gather`` transport: every device of an ``expert_axis`` group gets the group's
    tokens and routing (``all_gather``), computes the copies bound for its own experts, weighted
    (the same sparse expert path, other copies masked), and a ``psum_scatter`` adds the partial
    outputs up and hands each device its own tokens': ``[T_local, d]``. Per trip each device
    sends its ``T_local`` tokens once, whatever ``top_k``, and nothing is sized for a worst
    case; the partial sums travel in the activation dtype. With ``exchange_chunks`` the tokens
    go in independent chunks (one chunk's collectives can overlap another's experts)."""
    num_tokens = x.shape[0]
    chunks = min(config.exchange_chunks, num_tokens)
    bounds = [num_tokens * i // chunks for i in range(chunks + 1)]
    outputs = [
        _gathered_chunk(config, experts, x[lo:hi], weights, routed.expert_ids[lo:hi],
                        routed.weights[lo:hi], kept[lo:hi], plan)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return outputs[0] if chunks == 1 else jnp.concatenate(outputs)


def _gathered_chunk(config, experts, x, weights, expert_ids, combine_weights, kept,
                    plan: MeshPlan):
    """One chunk of :func:`_gathered_experts`: ``[chunk, d]``."""
    axis = plan.expert_axis
    local_experts = weights[1].shape[0]  # (w_gate, w_up, w_down): w_up's
    first_expert = lax.axis_index(axis) * local_experts
    group_x, group_ids, group_weights, group_kept = (
        lax.all_gather(v, axis, tiled=True) for v in (x, expert_ids, combine_weights, kept)
    )
    local_ids = group_ids - first_expert
    local = group_kept & (local_ids >= 0) & (local_ids < local_experts)
    copies = RoutedCopies(
        expert_ids=jnp.where(local, local_ids, 0),
        weights=jnp.where(local, group_weights, 0.0),
        kept=local,
        sparse_rows=True,
    )
    partial, _ = experts(config, group_x, *weights, copies)
    return lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)


def _dense_experts(x, weights, routed, token_valid, plan: MeshPlan, activation: str):
    """Dense routing: this device's experts on all tokens of its ``expert_axis`` group,
    weighted, summed over the group and scattered back (float32 partial sums)."""
    axis = plan.expert_axis
    local_experts = weights[1].shape[0]
    first_expert = lax.axis_index(axis) * local_experts
    combine = jnp.where(token_valid[:, None], routed.weights, 0.0)
    group_x, group_ids, group_combine = (
        lax.all_gather(v, axis, tiled=True) for v in (x, routed.expert_ids, combine)
    )
    partial = reference.experts_dense_float32(
        group_x, *weights, group_ids - first_expert, group_combine, activation
    )
    return lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)


# ----------------------------------------------------------------------------------------------
# The exchange: slots, gathers both ways, the transport

TRANSPORTS = ("auto", "all_gather", "all_to_all")


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
    """``auto``: ``all_gather`` (``_gathered_experts``). It never moves more
    bytes than ``all_to_all`` (each trip sends a device's ``T_local`` tokens once, against
    ``T_local * min(top_k, E_local)`` rows per destination), and on two H200s (jax 0.11.2,
    ``ep`` suite, run ``fee7429``) its train step was the fastest of the transports measured
    at every size."""
    if transport == "auto":
        return "all_gather"
    return transport


def make_slots(expert_ids, kept, num_experts: int, devices: int, rows: int):
    """The send buffer's slots for copies ``expert_ids: [T, k]`` (``kept``: ``[T, k]`` bool):
    slot ``j * rows + i`` for the ``i``-th copy to device ``j`` (``S = devices * rows``)."""
    local_experts = num_experts // devices
    layout = dispatch.sort_by_expert(expert_ids, num_experts, kept=kept)
    bounds = layout.group_offsets[::local_experts]  # [devices + 1]
    dest_start, dest_count = bounds[:-1], bounds[1:] - bounds[:-1]
    flat_expert = expert_ids.reshape(-1)
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
