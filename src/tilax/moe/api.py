"""The MoE layer's public entry points: ``MoEConfig``, ``moe_init`` and ``moe_apply``.

``moe_apply`` validates its inputs, routes the tokens (``router.py``), picks the implementation
of the routed experts and owns the ``custom_vjp`` of the Pallas grouped-matmul path:

- forward, per ``dispatch``: ``sorted`` (permuted copy of ``x``, three grouped matmuls, SwiGLU
  and combine in XLA), ``gather`` (the grouped matmuls read rows of ``x`` through the sort index),
  ``fused`` (gather, plus gate/up/SwiGLU in one kernel), ``fused_gsum`` (fused, plus the weighted
  combine in the down projection's epilogue, float32 atomics);
- backward: ``dx`` by grouped matmuls against the transposed weights, the weight gradients by the
  transposed grouped matmul (ragged contraction over each expert's rows), all Pallas. ``sorted``
  keeps permuted copies and does the SwiGLU backward in XLA; the other dispatches gather rows in
  the kernels, and ``fused``/``fused_gsum`` fuse the SwiGLU backward (and the combine weights'
  gradient) into the down projection's backward kernel.

The router, the aux losses, the shared expert, feature padding and the casts stay in plain JAX
and are differentiated by JAX around the custom-gradient expert path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from tilax import _pallas
from tilax.moe import dispatch, gmm_triton, reference, router
from tilax.moe.gmm_triton import Tiles

IMPLS = ("auto", "pallas", "triton", "mosaic", "blocked", "ragged_dot")
DISPATCHES = ("sorted", "gather", "fused", "fused_gsum")
ROUTINGS = ("dropless", "capacity", "dense")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Feature dimensions are zero-padded to a multiple of this for the kernels (tl.dot needs >= 16).
FEATURE_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Configuration of a Mixture-of-Experts layer with SwiGLU experts (frozen, hashable).

    Args:
        d_model: token width ``d``.
        d_hidden: hidden width ``h`` of each routed expert.
        num_experts: number of routed experts ``E``.
        top_k: experts per token ``k`` (``1 <= k <= E``).
        shared_hidden: hidden width ``S`` of the shared expert (a dense SwiGLU added to every
            token's output); ``0`` for none.
        routing: ``"dropless"`` (every copy computed), ``"capacity"`` (at most
            ``C = ceil(capacity_factor * T * k / E)`` copies per expert, earliest tokens first,
            the rest dropped) or ``"dense"`` (every expert on every token, weighted).
        impl: routed-expert implementation: ``"auto"``/``"pallas"`` (the best Pallas backend
            for the device: Triton on GPUs, interpret mode on CPU), ``"triton"``, ``"mosaic"``
            (Mosaic GPU, Hopper only; not available yet), ``"blocked"`` (padded expert blocks in
            XLA) or ``"ragged_dot"`` (``jax.lax.ragged_dot``). Ignored by ``routing="dense"``.
        dispatch: data movement of the Pallas path: ``"sorted"``, ``"gather"``, ``"fused"`` or
            ``"fused_gsum"`` (see the module docstring). All are exact up to float rounding.
        capacity_factor: ``> 0``, used by capacity routing.
        renormalize: divide the top-k probabilities by their sum.
        dtype: expert weights and activations (``float32``, ``bfloat16`` or ``float16``);
            matmuls accumulate in float32 and the router always runs in float32.
        block_m, block_n, block_k: kernel tiles (powers of two >= 16); ``None`` picks the
            device default (see :func:`kernel_tiles`).
        num_warps, num_stages: Triton launch parameters; ``None`` picks the device default.

    Raises:
        ValueError: a size is not a positive integer, ``top_k > num_experts``, an unknown
            ``routing``/``impl``/``dispatch`` name, ``capacity_factor <= 0``, or a bad tile.
        TypeError: ``dtype`` is not one of the supported float types.

    Example:
        >>> import jax.numpy as jnp
        >>> import tilax
        >>> config = tilax.MoEConfig(d_model=512, d_hidden=1024, num_experts=8, top_k=2)
        >>> config.dispatch, config.routing
        ('sorted', 'dropless')
    """

    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int
    shared_hidden: int = 0
    routing: str = "dropless"
    impl: str = "auto"
    dispatch: str = "sorted"
    capacity_factor: float = 1.25
    renormalize: bool = True
    dtype: Any = jnp.bfloat16
    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def __post_init__(self):
        for name in ("d_model", "d_hidden", "num_experts", "top_k"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("shared_hidden", self.shared_hidden, minimum=0)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})"
            )
        for name, allowed in (
            ("routing", ROUTINGS),
            ("impl", IMPLS),
            ("dispatch", DISPATCHES),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        factor = self.capacity_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise ValueError(f"capacity_factor must be a number > 0, got {factor!r}")
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"capacity_factor must be a finite number > 0, got {factor!r}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"renormalize must be a bool, got {self.renormalize!r}")
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError as err:
            raise TypeError(f"dtype must be one of {[str(d) for d in DTYPES]}: {err}") from err
        if dtype not in DTYPES:
            raise TypeError(f"dtype must be one of {[str(d) for d in DTYPES]}, got {dtype}")
        object.__setattr__(self, "dtype", dtype)
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=gmm_triton.MIN_BLOCK)
                if value & (value - 1):
                    raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps is not None:
            _check_int("num_warps", self.num_warps, minimum=1)
            if self.num_warps & (self.num_warps - 1) or self.num_warps > 32:
                raise ValueError(f"num_warps must be a power of two <= 32, got {self.num_warps}")
        if self.num_stages is not None:
            _check_int("num_stages", self.num_stages, minimum=1)


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


# ----------------------------------------------------------------------------------------------
# Parameters


def param_shapes(config: MoEConfig) -> dict:
    """The parameter pytree's leaf shapes for ``config`` (the structure ``moe_init`` returns)."""
    d, h, e, s = config.d_model, config.d_hidden, config.num_experts, config.shared_hidden
    shapes = {
        "router": (d, e),
        "w_gate": (e, d, h),
        "w_up": (e, d, h),
        "w_down": (e, h, d),
    }
    if s > 0:
        shapes["shared"] = {"w_gate": (d, s), "w_up": (d, s), "w_down": (s, d)}
    return shapes


def moe_init(key: jax.Array, config: MoEConfig) -> dict:
    """Random parameters for ``config``.

    Leaves: ``router: [d_model, E]`` float32; ``w_gate, w_up: [E, d_model, d_hidden]`` and
    ``w_down: [E, d_hidden, d_model]`` in ``config.dtype``; with ``shared_hidden = S > 0`` a
    ``shared`` dict of ``w_gate, w_up: [d_model, S]`` and ``w_down: [S, d_model]``. Every
    matrix is normal with standard deviation ``1 / sqrt(fan_in)``, so logits and activations
    keep unit scale for unit-scale inputs.

    Args:
        key: a JAX PRNG key.
        config: the layer configuration.

    Example:
        >>> import jax
        >>> import tilax
        >>> config = tilax.MoEConfig(d_model=32, d_hidden=64, num_experts=4, top_k=2)
        >>> params = tilax.moe_init(jax.random.key(0), config)
        >>> params["w_down"].shape
        (4, 64, 32)
    """
    shapes = param_shapes(config)
    leaves, treedef = jax.tree_util.tree_flatten(
        shapes, is_leaf=lambda s: isinstance(s, tuple)
    )
    paths = [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_flatten_with_path(
            shapes, is_leaf=lambda s: isinstance(s, tuple)
        )[0]
    ]
    keys = jax.random.split(key, len(leaves))
    values = []
    for subkey, shape, path in zip(keys, leaves, paths, strict=True):
        dtype = jnp.float32 if path == "['router']" else config.dtype
        fan_in = shape[-2]
        values.append(
            (jax.random.normal(subkey, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)
        )
    return jax.tree_util.tree_unflatten(treedef, values)


def _check_params(params: Any, config: MoEConfig) -> None:
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict (from moe_init), got {type(params).__name__}")
    expected = param_shapes(config)
    if "shared" in params and "shared" not in expected:
        raise ValueError(
            "params has a 'shared' expert but config.shared_hidden is 0; set shared_hidden to "
            "its width or drop params['shared']"
        )
    for name, shape in expected.items():
        if name not in params:
            raise ValueError(f"params is missing {name!r} (expected shape {shape})")
        if isinstance(shape, dict):
            if not isinstance(params[name], dict):
                raise TypeError(f"params['{name}'] must be a dict of arrays")
            for sub, sub_shape in shape.items():
                _check_leaf(f"params['{name}']['{sub}']", params[name].get(sub), sub_shape)
        else:
            _check_leaf(f"params['{name}']", params[name], shape)


def _check_leaf(name: str, value: Any, shape: tuple[int, ...]) -> None:
    if value is None:
        raise ValueError(f"{name} is missing (expected shape {shape})")
    _pallas.check_float_array(name, value)
    if tuple(jnp.shape(value)) != shape:
        raise ValueError(
            f"{name} has shape {tuple(jnp.shape(value))}, but the config expects {shape}"
        )


# ----------------------------------------------------------------------------------------------
# Implementation choice and kernel tiles


def resolve_impl(config: MoEConfig) -> str:
    """The implementation ``moe_apply`` runs for ``config`` on this device.

    Returns ``"dense"`` for dense routing, ``"blocked"``/``"ragged_dot"`` for the XLA
    baselines, and for the Pallas names the backend: ``"triton"`` on GPUs, ``"interpret"``
    on CPU.

    Raises:
        ValueError: ``impl="mosaic"`` on a device that cannot run Mosaic GPU (with the reason).
        NotImplementedError: ``impl="mosaic"`` on Hopper: the Mosaic GPU grouped matmul is not
            available yet.
    """
    if config.impl == "mosaic":
        reason = _pallas.mosaic_unavailable_reason()
        if reason is not None:
            raise ValueError(f"impl='mosaic' cannot run on this device: {reason}")
        raise NotImplementedError(
            "impl='mosaic' is not available yet: tilax has no Mosaic GPU grouped matmul for "
            "the MoE layer; use impl='triton' (or 'pallas'/'auto', which pick Triton here)"
        )
    if config.routing == "dense":
        return "dense"
    if config.impl in ("blocked", "ragged_dot"):
        return config.impl
    return _pallas.resolve_backend(config.impl)


def default_tiles(dtype: Any) -> Tiles:
    """Device-default kernel tiles for activations of ``dtype``.

    - CPU (interpret mode): 32 x 32 x 32 (the tiles only set the interpreter's loop counts).
    - GPU, float32 operands (IEEE float32 dots, no tensor-core path): 64 x 64 x 32,
      4 warps, 2 stages.
    - Hopper and newer (sm90+), 16-bit operands: 128 x 128 x 64, 8 warps, 3 stages.
    - Older GPUs (sm80-sm89), 16-bit operands: 64 x 128 x 32, 4 warps, 3 stages.
    """
    if _pallas.platform() != "gpu":
        return Tiles(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)
    if jnp.dtype(dtype) == jnp.float32:
        return Tiles(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)
    if _pallas.is_hopper_or_newer():
        return Tiles(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    return Tiles(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=3)


def kernel_tiles(config: MoEConfig) -> Tiles:
    """The tiles the Pallas path uses: :func:`default_tiles` overridden by the config's fields."""
    tiles = default_tiles(config.dtype)
    overrides = {
        name: getattr(config, name)
        for name in ("block_m", "block_n", "block_k", "num_warps", "num_stages")
        if getattr(config, name) is not None
    }
    return dataclasses.replace(tiles, **overrides)


# ----------------------------------------------------------------------------------------------
# The Pallas expert path and its custom VJP


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static choices of one Pallas expert call."""

    dispatch: str
    backend: str
    tiles: Tiles
    num_tokens: int


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pallas_experts(plan, x, w_gate, w_up, w_down, weights, layout, schedule):
    """``y[t] = sum_j weights[t, j] * SwiGLU_{e(t, j)}(x[t])`` over kept copies, ``[T, d]``."""
    return _experts_forward(plan, x, w_gate, w_up, w_down, weights, layout, schedule, False)[0]


def _experts_forward(plan, x, w_gate, w_up, w_down, weights, layout, schedule, save):
    """The forward for ``plan.dispatch``; returns ``(y, dispatch-specific residuals)``."""
    kw = dict(tiles=plan.tiles, backend=plan.backend)
    tokens = layout.row_token
    if plan.dispatch in ("sorted", "gather"):
        if plan.dispatch == "sorted":
            lhs, index = dispatch.permute(x, layout), None
        else:
            lhs, index = x, tokens
        gate = gmm_triton.gmm(lhs, w_gate, schedule, index=index, **kw)
        up = gmm_triton.gmm(lhs, w_up, schedule, index=index, **kw)
        rows = gmm_triton.gmm(reference.swiglu_activation(gate, up), w_down, schedule, **kw)
        y = dispatch.combine(rows, weights, layout)
        extra = (lhs if index is None else None, gate, up, rows)
        return y, (extra if save else None)
    act, *pre = gmm_triton.gmm_swiglu(
        x, w_gate, w_up, schedule, index=tokens, save_preactivations=save, **kw
    )
    if plan.dispatch == "fused":
        y = dispatch.combine(gmm_triton.gmm(act, w_down, schedule, **kw), weights, layout)
    else:
        w_rows = dispatch.row_weights(weights, layout)
        y = gmm_triton.gmm_combine(
            act, w_down, w_rows, layout.row_target, schedule, num_tokens=plan.num_tokens, **kw
        ).astype(x.dtype)
    return y, (tuple(pre) if save else None)


def _pallas_experts_fwd(plan, x, w_gate, w_up, w_down, weights, layout, schedule):
    y, extra = _experts_forward(
        plan, x, w_gate, w_up, w_down, weights, layout, schedule, True
    )
    return y, (x, w_gate, w_up, w_down, weights, layout, schedule, extra)


def _pallas_experts_bwd(plan, residuals, dy):
    x, w_gate, w_up, w_down, weights, layout, schedule, extra = residuals
    kw = dict(tiles=plan.tiles, backend=plan.backend)
    offsets, tokens = layout.group_offsets, layout.row_token
    w_rows = dispatch.row_weights(weights, layout)
    if plan.dispatch in ("sorted", "gather"):
        xs, gate, up, rows = extra
        dy_rows = dispatch.permute(dy, layout)
        dw_rows = jnp.sum(dy_rows.astype(jnp.float32) * rows.astype(jnp.float32), axis=-1)
        act = reference.swiglu_activation(gate, up)
        if plan.dispatch == "sorted":
            # Permuted copies: dy_scaled = w * dy[token] feeds both the input and weight grads.
            dy_scaled = (dy_rows.astype(jnp.float32) * w_rows[:, None]).astype(dy.dtype)
            d_act = gmm_triton.gmm(dy_scaled, w_down, schedule, transpose_rhs=True, **kw)
            (dw_down,) = gmm_triton.tgmm(act, dy_scaled, offsets, out_dtype=w_down.dtype, **kw)
            lhs, lhs_index = xs, None
        else:
            d_act = gmm_triton.gmm(
                dy, w_down, schedule, index=tokens, transpose_rhs=True, row_scale=w_rows, **kw
            )
            act_scaled = (act.astype(jnp.float32) * w_rows[:, None]).astype(act.dtype)
            (dw_down,) = gmm_triton.tgmm(
                act_scaled, dy, offsets, rhs_index=tokens, out_dtype=w_down.dtype, **kw
            )
            lhs, lhs_index = x, tokens
        d_gate, d_up = reference.swiglu_activation_bwd(gate, up, d_act)
    else:
        gate, up = extra
        d_gate, d_up, act_scaled, dw_partial = gmm_triton.gmm_swiglu_bwd(
            dy, w_down, gate, up, w_rows, schedule, index=tokens, **kw
        )
        dw_rows = jnp.sum(dw_partial, axis=0)
        (dw_down,) = gmm_triton.tgmm(
            act_scaled, dy, offsets, rhs_index=tokens, out_dtype=w_down.dtype, **kw
        )
        lhs, lhs_index = x, tokens
    dx_rows = gmm_triton.gmm(
        d_gate, w_gate, schedule, transpose_rhs=True, lhs2=d_up, rhs2=w_up,
        out_dtype=x.dtype, **kw,
    )
    dw_gate, dw_up = gmm_triton.tgmm(
        lhs, d_gate, offsets, lhs_index=lhs_index, rhs2=d_up, out_dtype=w_gate.dtype, **kw
    )
    dx = dispatch.sum_copies(dx_rows, layout)
    d_weights = dispatch.copy_values(dw_rows, layout).astype(weights.dtype)
    return dx, dw_gate, dw_up, dw_down, d_weights, None, None


_pallas_experts.defvjp(_pallas_experts_fwd, _pallas_experts_bwd)


def _pad_features(config: MoEConfig, x, w_gate, w_up, w_down):
    """Zero-pad ``d_model`` and ``d_hidden`` to multiples of 16 (exact: zeros add nothing)."""
    d_pad = _pallas.round_up(config.d_model, FEATURE_MULTIPLE) - config.d_model
    h_pad = _pallas.round_up(config.d_hidden, FEATURE_MULTIPLE) - config.d_hidden
    if d_pad == 0 and h_pad == 0:
        return x, w_gate, w_up, w_down
    x = jnp.pad(x, ((0, 0), (0, d_pad)))
    w_gate = jnp.pad(w_gate, ((0, 0), (0, d_pad), (0, h_pad)))
    w_up = jnp.pad(w_up, ((0, 0), (0, d_pad), (0, h_pad)))
    w_down = jnp.pad(w_down, ((0, 0), (0, h_pad), (0, d_pad)))
    return x, w_gate, w_up, w_down


def _pallas_routed(config, backend, x, w_gate, w_up, w_down, routed, capacity):
    tiles = kernel_tiles(config)
    num_tokens = x.shape[0]
    layout = dispatch.sort_by_expert(
        routed.expert_ids, config.num_experts, capacity=capacity, row_multiple=tiles.row_multiple
    )
    schedule = dispatch.gmm_schedule(
        layout.group_offsets, layout.row_token.shape[0], tiles.block_m
    )
    plan = _Plan(config.dispatch, backend, tiles, num_tokens)
    padded = _pad_features(config, x, w_gate, w_up, w_down)
    y = _pallas_experts(plan, *padded, routed.weights, layout, schedule)
    return y[:, : config.d_model], layout


# ----------------------------------------------------------------------------------------------
# The layer


def moe_apply(params: dict, x: jax.Array, config: MoEConfig) -> tuple[jax.Array, dict]:
    """Apply the MoE layer: ``y = sum_k w_k * expert_k(x) + shared(x)``.

    ``logits = x @ router`` in float32, ``probs = softmax(logits)``, each token's top-k experts
    with weights ``w`` (renormalised to sum 1 when ``config.renormalize``); expert ``e`` is the
    SwiGLU ``(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]``. Experts run in
    ``config.dtype`` with float32 accumulation. Differentiable (reverse mode) w.r.t. ``params``
    and ``x``; jit-compatible (``config`` is static).

    Args:
        params: the pytree from :func:`moe_init` (leaves may be float32 masters: they are cast
            to ``config.dtype``, the router to float32).
        x: ``[T, d_model]`` or ``[..., d_model]`` tokens (any float dtype; cast to
            ``config.dtype`` for the experts).
        config: the layer configuration.

    Returns:
        ``(y, aux)``: ``y`` with the shape of ``x`` in ``config.dtype``; ``aux`` a dict with
        ``expert_counts`` ([E] int32, copies per expert before any drop), ``max_expert_frac``,
        ``empty_experts``, ``dropped_frac``, ``router_z_loss`` and ``load_balance_loss``
        (float32 scalars; the two losses are differentiable).

    Raises:
        ValueError: ``x``'s last dimension is not ``d_model``, ``x`` holds no token, a
            parameter is missing or has the wrong shape, or ``impl="mosaic"`` on a device that
            cannot run it (with the reason).
        TypeError: ``x`` or a parameter is not a float array.
        NotImplementedError: ``impl="mosaic"`` on Hopper (no Mosaic GPU kernel yet).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import tilax
        >>> config = tilax.MoEConfig(d_model=32, d_hidden=64, num_experts=4, top_k=2,
        ...                          impl="ragged_dot", dtype=jnp.float32)
        >>> params = tilax.moe_init(jax.random.key(0), config)
        >>> x = jax.random.normal(jax.random.key(1), (10, 32))
        >>> y, aux = tilax.moe_apply(params, x, config)
        >>> y.shape, aux["expert_counts"].sum()
        ((10, 32), Array(20, dtype=int32))
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a tilax.MoEConfig, got {type(config).__name__}")
    _check_params(params, config)
    _pallas.check_float_array("x", x)
    if jnp.ndim(x) < 1 or jnp.shape(x)[-1] != config.d_model:
        raise ValueError(
            f"x must have shape [..., d_model] with d_model={config.d_model}, "
            f"got shape {tuple(jnp.shape(x))}"
        )
    num_tokens = math.prod(jnp.shape(x)[:-1])
    if num_tokens == 0:
        raise ValueError(f"x must hold at least one token, got shape {tuple(jnp.shape(x))}")
    impl = resolve_impl(config)

    x2 = jnp.reshape(x, (num_tokens, config.d_model))
    routed = router.route(x2, params["router"], config.top_k, config.renormalize)
    dtype = config.dtype
    xc = x2.astype(dtype)
    w_gate, w_up, w_down = (params[n].astype(dtype) for n in ("w_gate", "w_up", "w_down"))
    kept = None
    if impl == "dense":
        y = reference.experts_dense(xc, w_gate, w_up, w_down, routed.expert_ids, routed.weights)
    else:
        capacity = None
        if config.routing == "capacity":
            capacity = dispatch.expert_capacity(
                num_tokens, config.top_k, config.num_experts, config.capacity_factor
            )
        if impl in ("blocked", "ragged_dot"):
            layout = dispatch.sort_by_expert(
                routed.expert_ids, config.num_experts, capacity=capacity
            )
            if impl == "blocked":
                rows = num_tokens if capacity is None else min(num_tokens, capacity)
                y = reference.experts_blocked(
                    xc, w_gate, w_up, w_down, routed.weights, layout, rows
                )
            else:
                y = reference.experts_ragged_dot(xc, w_gate, w_up, w_down, routed.weights, layout)
        else:
            y, layout = _pallas_routed(
                config, impl, xc, w_gate, w_up, w_down, routed, capacity
            )
        if capacity is not None:
            kept = layout.group_offsets[-1]
    if config.shared_hidden:
        shared = {n: params["shared"][n].astype(dtype) for n in ("w_gate", "w_up", "w_down")}
        y = y + reference.shared_expert(xc, shared)
    aux = router.router_aux(routed, config.num_experts, kept)
    return y.reshape(jnp.shape(x)[:-1] + (config.d_model,)).astype(dtype), aux
