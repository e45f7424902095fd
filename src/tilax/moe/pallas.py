"""The Pallas expert path: row layout, work schedule and the custom VJP over a kernel backend.

The path is backend-neutral: it calls the grouped-matmul kernels of a backend module through
the ``base.GmmKernels`` contract, and ``KERNELS`` names the modules (``"interpret"`` is the
Triton kernel file run by the Pallas interpreter on CPU; ``"mosaic"`` the Mosaic GPU kernels
of Hopper). Per ``dispatch``:

- forward: ``sorted`` (permuted copy of ``x``, three grouped matmuls, activation and combine
  in XLA), ``gather`` (the grouped matmuls read rows of ``x`` through the sort index),
  ``fused`` (gather, plus gate/up/activation in one kernel), ``fused_gsum`` (fused, plus the
  combine in the down projection's epilogue, float32 atomics; with ``deterministic`` it
  combines as ``fused``). Every dispatch scales the
  activation by its row's combine weight before the down projection (the combine then
  only adds a token's copies) and keeps it for the backward, where it is the left operand of
  the ``w_down`` gradient: the activation's backward kernel then writes two ``[rows,
  d_hidden]`` arrays instead of three (SwiGLU on the H200 at the E8 layer's shapes, 1.24 ms
  instead of 1.44);
- backward, shared by all dispatches: the down projection's input gradient with the
  activation's backward and the combine weights' gradient fused into its epilogue, ``dx`` by a
  grouped matmul against the transposed gate/up weights, and the weight gradients by the transposed
  grouped matmul (ragged contraction over each expert's rows); where the backend has a
  kernel for both that reads the gate and up gradients once (``input_and_gate_up_grads``),
  ``dx`` and the gate/up weight gradients come from it.

The activation (``MoEConfig.activation``, ``Plan.activation``) is a static parameter of the
kernels that compute it. The not-gated ``"gelu"`` has no ``w_gate`` (``None`` here): its
experts run one input projection, and where a gated activation has two (gate and up, their
gradients, the two products summed into ``dx``) it has the ``up`` one alone.

Where the kernels read sorted copies of ``x`` and ``dy`` (the ``sorted`` dispatch, and a train
step on a backend whose kernels do not gather rows in training: Mosaic GPU), the backend's
``copy_rows`` makes them; elsewhere the kernels gather rows through the sort index.

With ``MoEConfig.recompute`` the experts run over slices of the row space instead
(``pallas_slices.py``): nothing of size ``[rows, d_hidden]`` is saved for the backward, which
recomputes it slice by slice.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any

import jax
import jax.numpy as jnp

from tilax import _pallas
from tilax.moe import dispatch, pallas_slices, reference
from tilax.moe.base import RoutedCopies

# Pallas backend name (``_pallas.resolve_backend``) -> its kernel module (``base.GmmKernels``),
# imported when a kernel first runs: ``import tilax`` loads no GPU backend (Triton's and Mosaic
# GPU's lowerings import GPU compiler bindings a CPU never uses).
KERNELS = {"triton": "tilax.moe.triton", "interpret": "tilax.moe.triton",
           "mosaic": "tilax.moe.mosaic.gmm"}


def kernel_module(backend: str) -> Any:
    """The kernel module (``base.GmmKernels``) of Pallas ``backend``, imported on first use."""
    return importlib.import_module(KERNELS[backend])


def kernel_tiles(config, backend: str | None = None):
    """The tiles the Pallas path uses for ``config`` on ``backend`` (default: this device's)."""
    backend = backend or _pallas.resolve_backend("pallas")
    return kernel_module(backend).tiles_for(config)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static choices of one Pallas expert call.

    Attributes:
        dispatch: the ``MoEConfig.dispatch``.
        backend: the Pallas backend (a key of ``KERNELS``).
        tiles: the backend's tiles.
        num_tokens: rows of the token-space input ``x``.
        slice_rows: ``None``: one pass over the row space, saving the hidden activations for
            the backward; else recompute them in slices of this many rows.
        cover_tail: compute the rows past the kept copies too (``dispatch.gmm_schedule``).
        copies_have_rows: every token copy has a row (no capacity drops): the row space is a
            permutation of the copies, which the backend's ``copy_rows`` can fill.
        activation: the ``MoEConfig.activation`` the kernels compute.
        deterministic: ``MoEConfig.deterministic``: no float atomics and no scatter-add with
            repeated indices (``fused_gsum`` combines as ``fused``; the backend's activation
            backward adds its partial sums in a fixed order).
    """

    dispatch: str
    backend: str
    tiles: Any
    num_tokens: int
    slice_rows: int | None = None
    cover_tail: bool = True
    copies_have_rows: bool = False
    activation: str = "swiglu"
    deterministic: bool = False

    @property
    def kernels(self):
        return kernel_module(self.backend)

    def row_copy(self, x: jax.Array, layout) -> jax.Array:
        """``x[layout.row_token]``: by the backend's ``copy_rows`` where every copy has a
        row, else by XLA's gather."""
        if self.copies_have_rows:
            return self.kernels.copy_rows(x, layout)
        return dispatch.take_rows(x, layout.row_token)

    def copies_rows(self, save: bool) -> bool:
        """Whether the kernels read sorted copies of ``x`` (and in the backward of ``dy``):
        the sorted dispatch's always, a train step's where the backend's kernels do not
        gather in training."""
        return self.dispatch == "sorted" or (save and not self.kernels.gathers_in_training())

    def schedule(self, group_offsets: jax.Array, num_rows: int) -> dispatch.GmmSchedule:
        return dispatch.gmm_schedule(
            group_offsets, num_rows, self.tiles.block_m, cover_tail=self.cover_tail
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def pallas_experts(plan, x, w_gate, w_up, w_down, weights, layout, schedule):
    """``y[t] = sum_j weights[t, j] * expert_{e(t, j)}(x[t])`` over kept copies, ``[T, d]``
    (``w_gate`` is ``None`` for the not-gated activation)."""
    if plan.slice_rows is not None:
        return pallas_slices.forward(plan, x, w_gate, w_up, w_down, weights, layout)
    return _forward(plan, x, w_gate, w_up, w_down, weights, layout, schedule, False)[0]


def _forward(plan, x, w_gate, w_up, w_down, weights, layout, schedule, save):
    """The forward for ``plan.dispatch``; returns ``(y, residuals)`` (``None`` unless ``save``):
    the sorted copy of ``x`` (where the kernels read one: ``Plan.copies_rows``), the gate/up
    pre-activations and the activation scaled by the combine weights."""
    kernels = plan.kernels
    kw = dict(tiles=plan.tiles, backend=plan.backend)
    w_rows = dispatch.row_weights(weights, layout)
    if plan.copies_rows(save):
        lhs, index = plan.row_copy(x, layout), None
    else:
        lhs, index = x, layout.row_token
    if plan.dispatch in ("sorted", "gather"):
        gate = None
        if w_gate is not None:
            gate = kernels.gmm(lhs, w_gate, schedule, index=index, **kw)
        up = kernels.gmm(lhs, w_up, schedule, index=index, **kw)
        act = reference.expert_activation(plan.activation, gate, up, w_rows)
        pre = (gate, up)
    else:
        act, *pre = kernels.gmm_activation(
            lhs, w_gate, w_up, schedule, index=index, row_scale=w_rows,
            save_preactivations=save, activation=plan.activation, **kw,
        )
    pre = (lhs if index is None else None, *pre)
    if plan.dispatch == "fused_gsum" and not plan.deterministic:  # float32 atomics
        y = kernels.gmm_combine(
            act, w_down, None, layout.row_target, schedule, num_tokens=plan.num_tokens, **kw
        ).astype(x.dtype)
    else:
        y = dispatch.sum_copies(kernels.gmm(act, w_down, schedule, **kw), layout)
    return y, ((*pre, act) if save else None)


def _pallas_experts_fwd(plan, x, w_gate, w_up, w_down, weights, layout, schedule):
    inputs = (x, w_gate, w_up, w_down, weights, layout, schedule)
    if plan.slice_rows is not None:
        return pallas_experts(plan, *inputs), (*inputs, None)
    y, saved = _forward(plan, *inputs, True)
    return y, (*inputs, saved)


def _pallas_experts_bwd(plan, residuals, dy):
    """Backward: the activation's backward is fused into the down projection's input-gradient
    kernel for every dispatch; where the forward saved a sorted copy of ``x`` the kernels get one of
    ``dy`` too, elsewhere they gather rows through the sort index themselves."""
    if plan.slice_rows is not None:
        return (*pallas_slices.backward(plan, residuals[:-2], dy), None, None)
    x, w_gate, w_up, w_down, weights, layout, schedule, (xs, gate, up, act_scaled) = residuals
    kernels = plan.kernels
    kw = dict(tiles=plan.tiles, backend=plan.backend)
    offsets = layout.group_offsets
    if xs is not None:
        dy_src, x_src, index = plan.row_copy(dy, layout), xs, None
    else:
        dy_src, x_src, index = dy, x, layout.row_token
    w_rows = dispatch.row_weights(weights, layout)
    d_gate, d_up, dw_partial = kernels.gmm_activation_bwd(
        dy_src, w_down, gate, up, w_rows, schedule, index=index, activation=plan.activation,
        deterministic=plan.deterministic, **kw,
    )
    joined = None
    if xs is not None and plan.cover_tail and w_gate is not None:  # all of d_gate, d_up written
        joined = kernels.input_and_gate_up_grads(xs, d_gate, d_up, w_gate, w_up, offsets, **kw)
    if joined is not None:
        dx_rows, dw_gate, dw_up = joined
    else:
        dx_rows, dw_gate, dw_up = pallas_slices.input_grads(
            kernels, x_src, index, d_gate, d_up, w_gate, w_up, schedule, offsets,
            x.dtype, w_up.dtype, kw,
        )
    (dw_down,) = kernels.tgmm(
        act_scaled, dy_src, offsets, rhs_index=index, out_dtype=w_down.dtype, **kw
    )
    dx = dispatch.sum_copies(dx_rows, layout)
    d_weights = dispatch.copy_values(jnp.sum(dw_partial, axis=0), layout)
    return dx, dw_gate, dw_up, dw_down, d_weights.astype(weights.dtype), None, None


pallas_experts.defvjp(_pallas_experts_fwd, _pallas_experts_bwd)


def pad_features(config, tiles, x, w_gate, w_up, w_down):
    """Zero-pad ``d_model`` and ``d_hidden`` to multiples of the backend's
    ``tiles.feature_multiple`` (exact: zeros add nothing)."""
    multiple = tiles.feature_multiple
    d_pad = _pallas.round_up(config.d_model, multiple) - config.d_model
    h_pad = _pallas.round_up(config.d_hidden, multiple) - config.d_hidden
    if d_pad == 0 and h_pad == 0:
        return x, w_gate, w_up, w_down
    x = jnp.pad(x, ((0, 0), (0, d_pad)))
    if w_gate is not None:
        w_gate = jnp.pad(w_gate, ((0, 0), (0, d_pad), (0, h_pad)))
    w_up = jnp.pad(w_up, ((0, 0), (0, d_pad), (0, h_pad)))
    w_down = jnp.pad(w_down, ((0, 0), (0, h_pad), (0, d_pad)))
    return x, w_gate, w_up, w_down


def slice_rows(config, tiles, num_rows: int) -> int | None:
    """Rows per slice under ``config.recompute`` (``None`` without it): the config's
    ``recompute_rows`` rounded up to the row tile, at most the padded row space."""
    if not config.recompute:
        return None
    multiple = tiles.row_multiple
    whole = _pallas.round_up(max(num_rows, 1), multiple)
    return min(_pallas.round_up(config.recompute_rows, multiple), whole)


@dataclasses.dataclass(frozen=True)
class PallasExperts:
    """The routed experts on a Pallas backend (a ``base.RoutedExperts``)."""

    backend: str

    def __call__(self, config, x, w_gate, w_up, w_down, copies: RoutedCopies):
        tiles = kernel_tiles(config, self.backend)
        num_tokens, top_k = copies.expert_ids.shape
        num_experts = w_up.shape[0]
        rows = dispatch.row_count(num_tokens, top_k, num_experts, copies.capacity)
        slices = slice_rows(config, tiles, rows)
        layout = dispatch.sort_by_expert(
            copies.expert_ids, num_experts, capacity=copies.capacity, kept=copies.kept,
            row_multiple=slices or tiles.row_multiple,
        )
        plan = Plan(config.dispatch, self.backend, tiles, num_tokens, slices,
                    cover_tail=not copies.sparse_rows,
                    copies_have_rows=rows == num_tokens * top_k,
                    activation=config.activation,
                    deterministic=config.deterministic)
        schedule = plan.schedule(layout.group_offsets, layout.row_token.shape[0])
        padded = pad_features(config, tiles, x, w_gate, w_up, w_down)
        y = pallas_experts(plan, *padded, copies.weights, layout, schedule)
        kept = None
        if copies.capacity is not None or copies.kept is not None:
            kept = layout.group_offsets[-1]
        return y[:, : config.d_model], kept
