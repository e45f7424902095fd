"""The contracts between the MoE layer's parts: what an expert implementation is given and
returns, and what a Pallas grouped-matmul backend must provide.

``api.py`` picks an implementation by name from its registry (``api.IMPLEMENTATIONS``); every
entry is a :class:`RoutedExperts`: the XLA ones in ``reference.py``, the Pallas path in
``pallas.py`` once per backend. The Pallas path owns the custom VJP and calls its backend only
through the :class:`GmmKernels` functions, so a backend is one kernel file (``triton.py``;
``mosaic/gmm.py``, with its building blocks in ``mosaic/common.py``) registered in
``pallas.KERNELS``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax

from tilax.moe.dispatch import GmmSchedule


class RoutedCopies(NamedTuple):
    """The token copies an expert implementation computes, and how it combines them.

    Attributes:
        expert_ids: ``[N, k]`` int32, each token's experts (distinct within a token).
        weights: ``[N, k]`` float32 combine weights.
        capacity: static; keep at most this many copies per expert, earliest tokens first
            (``None``: no limit).
        kept: ``[N, k]`` bool, the copies to compute when that was decided elsewhere (expert
            parallelism decides across devices); ``None``: all, or by ``capacity``.
        sparse_rows: static; the row space is sized for a worst case that is rarely filled
            (expert parallelism's receive buffer): compute only the kept copies' rows.
    """

    expert_ids: jax.Array
    weights: jax.Array
    capacity: int | None = None
    kept: jax.Array | None = None
    sparse_rows: bool = False


class RoutedExperts(Protocol):
    """An implementation of the routed experts (one entry of ``api.IMPLEMENTATIONS``)."""

    def __call__(
        self,
        config: Any,
        x: jax.Array,
        w_gate: jax.Array | None,
        w_up: jax.Array,
        w_down: jax.Array,
        copies: RoutedCopies,
    ) -> tuple[jax.Array, jax.Array | None]:
        """``y[t] = sum_j weights[t, j] * expert_{expert_ids[t, j]}(x[t])`` over kept copies,
        ``expert_e(x) = act_e(x) @ w_down[e]`` with ``act`` the ``config.activation``
        (``tilax.moe.activations``).

        Args:
            config: the layer's ``MoEConfig`` (dtype, dispatch, tiles, recompute,
                activation).
            x: ``[N, d]`` tokens in ``config.dtype``.
            w_gate, w_up: ``[E, d, h]``; w_down: ``[E, h, d]`` (``E`` may be a device's share
                of the experts: ``expert_ids`` index into these). ``w_gate`` is ``None`` for
                the not-gated ``activation="gelu"``.
            copies: the copies to compute.

        Returns:
            ``(y, kept_copies)``: ``y`` ``[N, d]`` in ``x.dtype`` and the number of copies
            kept (an int32 scalar), or ``None`` when every copy was kept by construction.
            Differentiable with respect to ``x``, the weights and ``copies.weights``.
        """
        ...


class GmmKernels(Protocol):
    """The kernel set of a Pallas grouped-matmul backend (a module such as ``triton``).

    Rows live in the *row space*: token copies sorted by expert (``dispatch.sort_by_expert``),
    padded to ``tiles.row_multiple``. Forward-type kernels follow a ``dispatch.GmmSchedule`` of
    (row tile, expert) work items, store only the rows ``[lo, hi)`` of their item and leave
    rows of no item unwritten; they take ``index`` to read their left rows through a gather
    instead of from a sorted copy. All accumulate in float32. The Pallas path's custom VJP
    (``pallas.py``) is written against exactly these functions:

    - ``copy_rows(x, layout)``: ``x[layout.row_token]``, a sorted copy for its kernels, for a
      layout in which every copy has a row (no capacity drops; the path gathers in XLA
      otherwise).
    - ``gathers_in_training()``: whether a train step's kernels gather rows through
      ``index``; where not, the path hands them copies of ``x`` and ``dy`` made by
      ``copy_rows``.
    - ``gmm(lhs, rhs, schedule, *, tiles, backend, index=None, transpose_rhs=False,
      lhs2=None, rhs2=None, row_scale=None, out_dtype=None)``:
      ``out[r] = scale[r] * (lhs[r] @ rhs[e(r)] + lhs2[r] @ rhs2[e(r)])``.
    - ``gmm_activation(x, w_gate, w_up, schedule, *, tiles, backend, index=None,
      row_scale=None, save_preactivations=False, activation="swiglu")``: ``a = w_r *
      f(x_r @ w_gate[e]) * (x_r @ w_up[e])`` (``w_r = 1`` without ``row_scale``; ``f`` the
      ``activation``'s nonlinearity, ``tilax.moe.activations``: ``silu`` for ``"swiglu"``,
      tanh-approximate ``gelu`` for ``"geglu"``), and the two pre-activations ``(gate, up)``
      when asked. For the not-gated ``"gelu"``, ``w_gate`` is ``None``: ``a = w_r * f(x_r @
      w_up[e])``, and the pre-activations are ``(None, up)``. Returns ``(a,)`` or
      ``(a, gate, up)``.
    - ``gmm_activation_bwd(dy, w_down, gate, up, row_scale, schedule, *, tiles, backend,
      index=None, activation="swiglu", deterministic=False)``: ``d_gate, d_up``
      (``activations.hidden_backward`` of ``w_r * dz``; ``d_gate`` is ``None`` where ``gate``
      is, not gated) and ``[P, R]`` float32 partial sums of ``dz . a`` (``dz = dy_r @
      w_down[e].T``, ``a`` unscaled), the combine weights' gradient once summed over ``P``
      (backend-defined: Triton gives one row per column tile, ``h / block_n``; Mosaic GPU adds
      its per-item sums up itself and gives one), with ``deterministic`` in a fixed order (no
      scatter-add with repeated indices).
    - ``gmm_combine(hidden, w_down, row_scale, row_target, schedule, *, num_tokens, tiles,
      backend)``: ``y[t] = sum over rows r of token t of w_r * hidden[r] @ w_down[e(r)]``,
      float32 ``[T, d]`` (``row_scale=None``: ``w_r = 1``).
      Its sum over a token's rows runs in no fixed order (atomics or a scatter-add):
      ``MoEConfig.deterministic`` never calls it.
    - ``tgmm(lhs, rhs, group_offsets, *, tiles, backend, lhs_index=None, rhs_index=None,
      rhs2=None, out_dtype=None)``: ``out[e] = lhs[rows of e].T @ rhs[rows of e]`` (weight
      gradients; rows outside every group are never read).
    - ``input_and_gate_up_grads(x_rows, d_gate, d_up, w_gate, w_up, group_offsets, *,
      tiles, backend)``: ``dx`` rows (``d_gate @ w_gate[e].T + d_up @ w_up[e].T``) with the
      gate and up weight gradients from one pass over ``d_gate`` and ``d_up``, or ``None``
      where the backend has no such kernel for these shapes (the path then calls ``gmm``
      and ``tgmm``). Called for gated activations only (the not-gated one has one
      gradient), with sorted copies of ``x`` only, and only where every row of ``d_gate``
      and ``d_up`` was written (the schedule covers the padding rows).
    - ``tiles_for(config)``: the backend's tiles for a config (a dataclass with at least
      ``block_m``, ``row_multiple`` and ``feature_multiple``: the layer pads ``d_model`` and
      ``d_hidden`` to a multiple of it, 16 for Triton, 64 for Mosaic GPU's 128-byte rows).
    """

    def gathers_in_training(self) -> bool: ...

    def copy_rows(self, x, layout) -> jax.Array: ...

    def gmm(self, lhs, rhs, schedule: GmmSchedule, **kwargs) -> jax.Array: ...

    def gmm_activation(self, x, w_gate, w_up, schedule: GmmSchedule, **kwargs) -> tuple: ...

    def gmm_activation_bwd(self, dy, w_down, gate, up, row_scale, schedule,
                           **kwargs) -> tuple: ...

    def gmm_combine(self, hidden, w_down, row_scale, row_target, schedule, **kwargs): ...

    def tgmm(self, lhs, rhs, group_offsets, **kwargs) -> tuple: ...

    def input_and_gate_up_grads(self, x_rows, d_gate, d_up, w_gate, w_up, group_offsets,
                                **kwargs) -> tuple | None: ...

    def tiles_for(self, config: Any) -> Any: ...
