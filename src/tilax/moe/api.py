"""The MoE layer's public entry points: ``MoEConfig``, ``moe_init`` and ``moe_apply``.

This file validates inputs and chooses the implementation; the work happens elsewhere:

- ``rules.py`` holds every kernel choice as data (the backend ``impl="auto"`` runs, and each
  Mosaic GPU kernel variant), each row naming the stored run behind it;
- ``router.py`` routes tokens and computes ``aux``; ``dispatch.py`` builds the row layout;
- ``IMPLEMENTATIONS`` maps an implementation name (``resolve_impl``) to its routed experts
  (a ``base.RoutedExperts``): the Pallas path (``pallas.py``, which owns the custom VJP) once
  per kernel backend (``triton.py``, ``mosaic/gmm.py``), and the plain-XLA ones of
  ``reference.py``;
- with a mesh, ``expert_parallel.py`` runs the same pieces on every device and moves the token
  copies between the devices that own their experts.

The router, the aux losses, the shared expert, feature padding and the casts stay in plain JAX
and are differentiated by JAX around the custom-gradient expert path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tilax import _pallas
from tilax.moe import (
    activations,
    decode,
    dispatch,
    expert_parallel,
    fp8,
    pallas,
    reference,
    router,
    rules,
)
from tilax.moe.base import RoutedCopies

IMPLS = ("auto", "pallas", "triton", "mosaic", "decode", "blocked", "ragged_dot")
DISPATCHES = ("sorted", "gather", "fused", "fused_gsum")
ROUTINGS = ("dropless", "capacity", "dense")
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
QUANTIZE = ("fp8",)
FP8_IMPLS = ("auto", "blocked", "ragged_dot", "mosaic")  # the impls with an FP8 path (fp8.py)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Configuration of a Mixture-of-Experts layer (frozen, hashable).

    A pytree with no leaves (``jax.tree_util.register_static``): it is static under every JAX
    transformation, so ``jax.jit(tilax.moe_apply)(params, x, config)``, ``jax.grad`` and
    ``jax.vmap`` take it positionally without ``static_argnums``. Integer fields accept any
    integral number (Python or NumPy integers, not bools) and hold Python ``int``.

    Args:
        d_model: token width ``d``.
        d_hidden: hidden width ``h`` of each routed expert.
        num_experts: number of routed experts ``E``.
        top_k: experts per token ``k`` (``1 <= k <= E``).
        shared_hidden: hidden width ``S`` of the shared expert (a dense expert of the same
            ``activation`` added to every token's output); ``0`` for none.
        routing: ``"dropless"`` (every copy computed), ``"capacity"`` (at most
            ``C = ceil(capacity_factor * T * k / E)`` copies per expert, earliest tokens first,
            the rest dropped) or ``"dense"`` (every expert on every token, weighted).
        impl: routed-expert implementation: ``"auto"`` (on GPUs the Pallas kernels on the
            backend measured faster for this config and GPU, ``tilax.moe.rules``: Mosaic GPU
            where a stored run shows it winning, else Triton; the decode kernels for small
            16-bit batches once the decode suite's stored run holds their rule; on a CPU the
            plain-XLA ``"blocked"``, measured faster there than ``"ragged_dot"``; the Pallas
            interpreter runs only when asked for),
            ``"pallas"``/``"triton"`` (Triton on GPUs, interpret mode on CPU), ``"mosaic"``
            (Mosaic GPU kernels, Hopper and newer, bfloat16/float16 only), ``"decode"`` (the
            small-batch forward kernels, ``tilax.moe.decode``: each touched expert's weights
            streamed once; Triton on GPUs, interpret mode on CPU; under differentiation the
            training kernels run), ``"blocked"`` (padded expert blocks in XLA) or
            ``"ragged_dot"`` (``jax.lax.ragged_dot``).
            Ignored by ``routing="dense"``.
        dispatch: data movement of the Pallas path: ``"sorted"``, ``"gather"``, ``"fused"`` or
            ``"fused_gsum"`` (see the module docstring). All are exact up to float rounding.
        capacity_factor: ``> 0``, used by capacity routing.
        renormalize: divide the top-k probabilities by their sum.
        dtype: expert weights and activations (``float32``, ``bfloat16`` or ``float16``);
            matmuls accumulate in float32 and the router always runs in float32.
        block_m: rows per kernel tile (a power of two >= 16; a multiple of 64 for
            ``impl="mosaic"``); ``None`` picks the device default (see ``kernel_tiles``).
        block_n: output columns per kernel tile (power of two >= 16); ``None``: device default.
        block_k: contraction slice per kernel step (power of two >= 16); ``None``: device
            default.
        num_warps: Triton warps per program; ``None`` picks the device default (the Mosaic GPU
            kernels run one warpgroup per block and ignore it).
        num_stages: software-pipelining depth (Triton stages, or the Mosaic GPU kernels' TMA
            buffers); ``None`` picks the device default.
        recompute: save memory in training: the Pallas path runs the experts over slices of
            ``recompute_rows`` token copies and recomputes the gate/up projections in the
            backward instead of saving them (one more pair of grouped matmuls; the hidden
            activations exist one slice at a time); the XLA impls run under
            ``jax.checkpoint``. Results equal the default up to float rounding.
        recompute_rows: token copies per slice with ``recompute`` (rounded up to the row
            tile); smaller saves more memory, larger launches fewer kernels.
        exchange: how expert parallelism (``moe_apply(..., mesh=)``) moves tokens between
            devices: ``"all_gather"`` (each device gets its expert group's tokens, computes
            the copies for its own experts, and the partial outputs are reduce-scattered),
            ``"all_to_all"`` (copies in fixed worst-case blocks) or ``"auto"``
            (``"all_gather"``: the fewer bytes of the two and the faster measured on
            H200s). Both are dropless and give the same result up to float rounding.
        exchange_chunks: with ``exchange="all_gather"`` (or ``"auto"``), split each device's
            tokens into this many chunks, each gathered, computed and reduce-scattered on its
            own, so that XLA can overlap one chunk's collectives with another's experts.
        score_func: the router's scores ``s``: ``"softmax"`` (over each token's experts) or
            ``"sigmoid"`` (``s = sigmoid(logits)`` per expert, DeepSeek-V3's router). The
            combine weights are the chosen experts' ``s``; with ``"sigmoid"`` keep
            ``renormalize=True`` (the scores of the chosen experts do not sum to 1).
        balance_bias: auxiliary-loss-free load balancing (DeepSeek-V3): ``moe_init`` adds
            ``params["router_bias"]``, float32 ``[E]`` zeros; experts are *selected* by
            ``s + router_bias`` while the combine weights stay the unbiased ``s`` of the
            selected experts. No gradient reaches ``router_bias`` (its gradient is zeros):
            update it between steps with :func:`moe_update_bias`.
        expert_groups: group-limited routing: the experts form ``expert_groups`` contiguous
            groups of ``E / expert_groups`` (``1``: no groups). A group's score is the sum of
            its two largest selection scores (``s`` plus the bias; its one score for groups
            of one expert); each token keeps its ``group_top_k`` best groups and picks its
            ``top_k`` experts among their experts only. Ties go to the lower index.
        group_top_k: groups each token keeps, ``1 <= group_top_k <= expert_groups``; they
            must hold at least ``top_k`` experts.
        routed_scale: finite, ``> 0``: the routed experts' combined output is multiplied by it
            (the combine weights are: ``s`` of the chosen experts, divided by their sum when
            ``renormalize``, times ``routed_scale``); the shared expert is not scaled.

        quantize: ``None`` (bfloat16/float16/float32 experts as ``dtype``) or ``"fp8"``:
            every expert matmul of the forward, the input gradient and the weight gradient
            on ``float8_e4m3fn`` operands with fine-grained scales from the data (1 x 128
            tiles of activations and gradients, 128 x 128 blocks of weights, float32
            accumulation promoted every 128 of the contraction, bfloat16 outputs; DeepSeek-V3's
            recipe, ``tilax.moe.quantize``). Needs ``dtype=bfloat16``, routed (not dense)
            routing, ``impl`` in ``"auto"``/``"blocked"``/``"ragged_dot"`` (the XLA path,
            ``tilax.moe.fp8``) or ``"mosaic"`` (the Mosaic GPU FP8 kernels on Hopper,
            ``tilax.moe.mosaic.gmm_fp8``; ``d_model`` and ``d_hidden`` multiples of 128;
            not yet measured, so ``"auto"`` keeps the XLA path) and, on a GPU, FP8 tensor
            cores (compute capability 8.9+). Router, shared expert and master weights stay as
            they are.
        deterministic: bitwise repeatable results: repeated calls of one compiled train step
            on the same inputs give bitwise identical ``y`` and gradients on the GPU, for
            every impl. Every sum runs in a fixed order: no float atomics and no scatter-add
            with repeated indices. ``dispatch="fused_gsum"`` then combines as ``"fused"``
            does (gathering each token's rows and adding them in slot order instead of the
            atomic adds of its epilogue), the gradients of the layer's gathers (the router's
            top-k, the combine, the ``"blocked"`` impl's blocks) are gathers summing in a
            fixed order, and the Mosaic GPU backward adds its per-item partial sums by a
            gather instead of a scatter-add. Results equal the default up to float rounding;
            the cost (a few gathers in place of scatter-adds, and ``fused_gsum``'s combine)
            is measured in the layer suite. With a ``mesh`` the collectives' sums are NCCL's,
            whose order is fixed for a given algorithm (see the MoE guide).
        activation: the experts' activation (routed and shared alike), fused into the
            kernels' epilogues forward and backward on every impl (the decode kernels' and
            the FP8 experts' too): ``"swiglu"`` (``silu(x @ w_gate) * (x @ w_up)``),
            ``"geglu"`` (``gelu(x @ w_gate) * (x @ w_up)``) or ``"gelu"`` (``gelu(x @
            w_up)``, not gated: its parameters have no ``w_gate``, routed or shared).
            ``gelu`` is the tanh approximation (``jax.nn.gelu(approximate=True)``). See
            ``tilax.moe.activations``.

    With the routing fields at their defaults (``score_func="softmax"``, no bias, no groups,
    ``routed_scale=1``) the layer is exactly the softmax top-k layer. On ``impl="mosaic"``
    the router's Mosaic GPU kernels take softmax and sigmoid scores; with a balance bias or
    groups XLA routes (``tilax.moe.mosaic.router.block_tokens``).

    Raises:
        ValueError: a size is not a positive integer, ``top_k > num_experts``, an unknown
            ``routing``/``impl``/``dispatch``/``score_func``/``activation`` name,
            ``capacity_factor <= 0``, a bad tile, ``num_experts`` not divisible by
            ``expert_groups``, ``group_top_k`` outside ``[1, expert_groups]``, fewer than
            ``top_k`` experts in ``group_top_k`` groups, ``routed_scale`` not a finite number
            ``> 0``, or ``quantize`` unknown or with a ``dtype``/``impl``/``routing`` it cannot
            run.
        TypeError: ``dtype`` is not one of the supported float types.

    Examples:
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
    recompute: bool = False
    recompute_rows: int = 262144
    exchange: str = "auto"
    exchange_chunks: int = 1
    score_func: str = "softmax"
    balance_bias: bool = False
    expert_groups: int = 1
    group_top_k: int = 1
    routed_scale: float = 1.0
    quantize: str | None = None
    deterministic: bool = False
    activation: str = "swiglu"

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if _is_integral(value):
                object.__setattr__(self, name, int(value))
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
            ("exchange", expert_parallel.TRANSPORTS),
            ("score_func", router.SCORE_FUNCS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        activations.check_activation(self.activation)
        factor = self.capacity_factor
        if isinstance(factor, (bool, np.bool_)) or not isinstance(factor, numbers.Real):
            raise ValueError(f"capacity_factor must be a number > 0, got {factor!r}")
        object.__setattr__(self, "capacity_factor", float(factor))
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"capacity_factor must be a finite number > 0, got {factor!r}")
        for name in ("renormalize", "recompute", "deterministic", "balance_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("recompute_rows", self.recompute_rows, minimum=1)
        _check_int("exchange_chunks", self.exchange_chunks, minimum=1)
        self._check_groups()
        scale = self.routed_scale
        if (isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real)
                or not (math.isfinite(scale) and scale > 0)):
            raise ValueError(f"routed_scale must be a finite number > 0, got {scale!r}")
        object.__setattr__(self, "routed_scale", float(scale))
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError as err:
            raise TypeError(f"dtype must be one of {[str(d) for d in DTYPES]}: {err}") from err
        if dtype not in DTYPES:
            raise TypeError(f"dtype must be one of {[str(d) for d in DTYPES]}, got {dtype}")
        object.__setattr__(self, "dtype", dtype)
        if self.quantize is not None:
            if self.quantize not in QUANTIZE:
                raise ValueError(f"quantize must be None or one of {QUANTIZE}, "
                                 f"got {self.quantize!r}")
            if dtype != jnp.bfloat16 or self.impl not in FP8_IMPLS or self.routing == "dense":
                raise ValueError(
                    f"quantize={self.quantize!r} runs with dtype=bfloat16, routing "
                    f"'dropless' or 'capacity' and impl in {FP8_IMPLS}, "
                    f"got dtype={dtype}, routing={self.routing!r}, impl={self.impl!r}")
            if self.impl == "mosaic" and (self.d_model % 128 or self.d_hidden % 128):
                raise ValueError(
                    f"quantize={self.quantize!r} with impl='mosaic' needs d_model and d_hidden "
                    f"multiples of 128 (one FP8 scale tile a wgmma step), got d_model="
                    f"{self.d_model}, d_hidden={self.d_hidden}")
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=_pallas.MIN_BLOCK)
                if value & (value - 1):
                    raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_warps is not None:
            _check_int("num_warps", self.num_warps, minimum=1)
            if self.num_warps & (self.num_warps - 1) or self.num_warps > 32:
                raise ValueError(f"num_warps must be a power of two <= 32, got {self.num_warps}")
        if self.num_stages is not None:
            _check_int("num_stages", self.num_stages, minimum=1)

    def _check_groups(self) -> None:
        _check_int("expert_groups", self.expert_groups, minimum=1)
        _check_int("group_top_k", self.group_top_k, minimum=1)
        if self.num_experts % self.expert_groups:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by expert_groups "
                f"({self.expert_groups}): the groups are contiguous and of equal size"
            )
        if self.group_top_k > self.expert_groups:
            raise ValueError(
                f"group_top_k ({self.group_top_k}) must be in [1, expert_groups] "
                f"= [1, {self.expert_groups}]"
            )
        kept_experts = self.group_top_k * (self.num_experts // self.expert_groups)
        if kept_experts < self.top_k:
            raise ValueError(
                f"group_top_k ({self.group_top_k}) groups of {self.num_experts} // "
                f"{self.expert_groups} experts hold {kept_experts} experts, fewer than top_k "
                f"({self.top_k}): raise group_top_k or lower expert_groups"
            )


_INT_FIELDS = ("d_model", "d_hidden", "num_experts", "top_k", "shared_hidden", "block_m",
               "block_n", "block_k", "num_warps", "num_stages", "recompute_rows",
               "exchange_chunks", "expert_groups", "group_top_k")


def _is_integral(value: Any) -> bool:
    """A Python or NumPy integer, not a bool (``True`` is no width)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if not _is_integral(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


# ----------------------------------------------------------------------------------------------
# Parameters


def param_shapes(config: MoEConfig) -> dict[str, Any]:
    """The parameter pytree's leaf shapes for ``config`` (the structure ``moe_init`` returns)."""
    d, h, e, s = config.d_model, config.d_hidden, config.num_experts, config.shared_hidden
    names = activations.expert_weight_names(config.activation)
    expert = {"w_gate": (e, d, h), "w_up": (e, d, h), "w_down": (e, h, d)}
    shapes = {"router": (d, e), **{name: expert[name] for name in names}}
    if s > 0:
        shared = {"w_gate": (d, s), "w_up": (d, s), "w_down": (s, d)}
        shapes["shared"] = {name: shared[name] for name in names}
    if config.balance_bias:
        shapes["router_bias"] = (e,)
    return shapes


def moe_init(key: jax.Array, config: MoEConfig) -> dict[str, Any]:
    """Random parameters for ``config``.

    Leaves: ``router: [d_model, E]`` float32; ``w_gate, w_up: [E, d_model, d_hidden]`` and
    ``w_down: [E, d_hidden, d_model]`` in ``config.dtype``; with ``shared_hidden = S > 0`` a
    ``shared`` dict of ``w_gate, w_up: [d_model, S]`` and ``w_down: [S, d_model]``; with
    ``balance_bias`` a ``router_bias: [E]`` of float32 zeros. With ``activation="gelu"`` (not
    gated) there is no ``w_gate``, routed or shared. Every matrix is normal with standard
    deviation ``1 / sqrt(fan_in)``, so logits and activations keep unit scale for unit-scale
    inputs (the matrices do not depend on ``balance_bias``).

    Args:
        key: a JAX PRNG key.
        config: the layer configuration.

    Examples:
        >>> import jax
        >>> import tilax
        >>> config = tilax.MoEConfig(d_model=32, d_hidden=64, num_experts=4, top_k=2)
        >>> params = tilax.moe_init(jax.random.key(0), config)
        >>> params["w_down"].shape
        (4, 64, 32)
    """
    return _random_params(key, config)


# Compiled as one program with one draw for every matrix: eager, each matrix's sampler compiled
# for its own shape (about 0.5 s each on a CPU, 4 s for a layer with a shared expert); one
# program with a sampler per matrix compiles as slowly. One draw: under 1 s.
@functools.partial(jax.jit, static_argnames="config")
def _random_params(key: jax.Array, config: MoEConfig) -> dict[str, Any]:
    shapes = param_shapes(config)
    bias_shape = shapes.pop("router_bias", None)
    named, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda s: isinstance(s, tuple))
    sizes = [math.prod(shape) for _, shape in named]
    draw = jax.random.normal(key, (sum(sizes),), jnp.float32)
    values, offset = [], 0
    for (path, shape), size in zip(named, sizes, strict=True):
        dtype = jnp.float32 if jax.tree_util.keystr(path) == "['router']" else config.dtype
        fan_in = shape[-2]
        matrix = draw[offset:offset + size].reshape(shape) / math.sqrt(fan_in)
        values.append(matrix.astype(dtype))
        offset += size
    params = jax.tree_util.tree_unflatten(treedef, values)
    if bias_shape is not None:
        params["router_bias"] = jnp.zeros(bias_shape, jnp.float32)
    return params


def moe_update_bias(params: dict[str, Any], aux: dict[str, jax.Array], rate) -> dict[str, Any]:
    """DeepSeek-V3's auxiliary-loss-free balancing step: nudge each expert's router bias
    towards an even load.

    Returns ``params`` with ``router_bias += rate * sign(mean(counts) - counts)``, where
    ``counts = aux["expert_counts"]`` (token copies routed to each expert): overloaded experts
    become less likely to be selected, underloaded ones more (the combine weights never see
    the bias). Call it between optimizer steps with the ``aux`` of the step's forward (the
    bias gets no gradient, so optimizers leave it alone). With ``aux`` of a ``jax.vmap``-ed
    call (``expert_counts: [..., E]``) the counts are summed over the leading dimensions
    first. Works under ``jax.jit`` (``rate`` may be a traced scalar) and returns a new dict;
    the other leaves are the same arrays.

    Args:
        params: the layer's parameters (from :func:`moe_init` with ``balance_bias=True``).
        aux: the ``aux`` dict from :func:`moe_apply`.
        rate: the bias update speed (DeepSeek-V3 used 0.001), a scalar.

    Raises:
        ValueError: ``params`` has no ``router_bias`` (the config has no ``balance_bias``),
            ``aux`` has no ``expert_counts``, their sizes differ, or ``rate`` is not a scalar.

    Examples:
        >>> import jax
        >>> import tilax
        >>> config = tilax.MoEConfig(d_model=16, d_hidden=32, num_experts=4, top_k=2,
        ...                          score_func="sigmoid", balance_bias=True)
        >>> params = tilax.moe_init(jax.random.key(0), config)
        >>> x = jax.random.normal(jax.random.key(1), (64, 16))
        >>> _, aux = tilax.moe_apply(params, x, config)
        >>> params = tilax.moe_update_bias(params, aux, 1e-3)
        >>> params["router_bias"].shape
        (4,)
    """
    if not isinstance(params, dict) or "router_bias" not in params:
        raise ValueError(
            "params has no 'router_bias' to update: create the parameters with "
            "MoEConfig(balance_bias=True) (moe_init adds it)"
        )
    if not isinstance(aux, dict) or "expert_counts" not in aux:
        raise ValueError("aux must be the dict moe_apply returns, with 'expert_counts'")
    bias = params["router_bias"]
    counts = jnp.asarray(aux["expert_counts"])
    if jnp.ndim(bias) != 1 or counts.ndim < 1 or counts.shape[-1] != jnp.shape(bias)[0]:
        raise ValueError(
            f"aux['expert_counts'] has shape {tuple(counts.shape)} and params['router_bias'] "
            f"{tuple(jnp.shape(bias))}: expected [..., E] counts for an [E] bias"
        )
    if jnp.ndim(rate) != 0:
        raise ValueError(f"rate must be a scalar, got shape {tuple(jnp.shape(rate))}")
    counts = jnp.sum(counts.reshape(-1, counts.shape[-1]), axis=0).astype(jnp.float32)
    step = jnp.sign(jnp.mean(counts) - counts)
    new_bias = (bias.astype(jnp.float32) + jnp.asarray(rate, jnp.float32) * step)
    return {**params, "router_bias": new_bias.astype(bias.dtype)}


def _check_params(params: Any, config: MoEConfig) -> None:
    if not isinstance(params, dict):
        raise TypeError(f"params must be a dict (from moe_init), got {type(params).__name__}")
    expected = param_shapes(config)
    if "shared" in params and "shared" not in expected:
        raise ValueError(
            "params has a 'shared' expert but config.shared_hidden is 0; set shared_hidden to "
            "its width or drop params['shared']"
        )
    _check_gate("params", params, config.activation)
    if "router_bias" in params and "router_bias" not in expected:
        raise ValueError(
            "params has a 'router_bias' but config.balance_bias is False; set "
            "balance_bias=True or drop params['router_bias']"
        )
    _check_no_unknown_keys("params", params, expected)
    for name, shape in expected.items():
        if name not in params:
            hint = (" (config.balance_bias is True: moe_init adds it as float32 zeros)"
                    if name == "router_bias" else "")
            raise ValueError(f"params is missing {name!r} (expected shape {shape}){hint}")
        if isinstance(shape, dict):
            if not isinstance(params[name], dict):
                raise TypeError(f"params['{name}'] must be a dict of arrays")
            _check_gate(f"params['{name}']", params[name], config.activation)
            _check_no_unknown_keys(f"params['{name}']", params[name], shape)
            for sub, sub_shape in shape.items():
                _check_leaf(f"params['{name}']['{sub}']", params[name].get(sub), sub_shape)
        else:
            _check_leaf(f"params['{name}']", params[name], shape)


def _check_gate(name: str, given: dict, activation: str) -> None:
    """``w_gate`` present exactly when the activation is gated, said in its terms."""
    gated = activations.is_gated(activation)
    if gated and "w_gate" not in given:
        raise ValueError(
            f"{name} is missing 'w_gate': activation={activation!r} is gated (its experts "
            "compute f(x @ w_gate) * (x @ w_up)); only activation='gelu' has no w_gate"
        )
    if not gated and "w_gate" in given:
        raise ValueError(
            f"{name} has 'w_gate', but activation={activation!r} is not gated (its experts "
            "compute gelu(x @ w_up)): drop w_gate, or use a gated activation ('swiglu', "
            "'geglu')"
        )


def _check_no_unknown_keys(name: str, given: dict, expected: dict) -> None:
    """A typo (``w_dwon`` beside ``w_down``) must not pass silently as an unused leaf."""
    unknown = sorted(str(key) for key in set(given) - set(expected))
    if unknown:
        raise ValueError(
            f"{name} has unknown keys {unknown}; the config expects exactly {sorted(expected)}"
        )


def _check_leaf(name: str, value: Any, shape: tuple[int, ...]) -> None:
    if value is None:
        raise ValueError(f"{name} is missing (expected shape {shape})")
    _pallas.check_float_array(name, value)
    if tuple(jnp.shape(value)) != shape:
        raise ValueError(
            f"{name} has shape {tuple(jnp.shape(value))}, but the config expects {shape}"
        )


# ----------------------------------------------------------------------------------------------
# Implementation choice

# resolve_impl's names -> routed experts (base.RoutedExperts). A Pallas backend is one entry
# here and one kernel module in pallas.KERNELS. With quantize="fp8": FP8_IMPLEMENTATIONS.
IMPLEMENTATIONS = {
    "dense": reference.routed_dense,
    "blocked": reference.routed_blocked,
    "ragged_dot": reference.routed_ragged_dot,
    **{backend: pallas.PallasExperts(backend) for backend in pallas.KERNELS},
    "decode": decode.DecodeExperts(),
}
FP8_IMPLEMENTATIONS = {"blocked": fp8.routed_blocked, "ragged_dot": fp8.routed_ragged_dot,
                       "mosaic": fp8.routed_mosaic}


def routed_experts(config: MoEConfig, num_tokens: int | None = None):
    """The routed experts (a ``base.RoutedExperts``) ``moe_apply`` runs for ``config`` on
    ``num_tokens`` tokens (``None``: unknown, as under expert parallelism)."""
    registry = FP8_IMPLEMENTATIONS if config.quantize == "fp8" else IMPLEMENTATIONS
    return registry[resolve_impl(config, num_tokens)]


def resolve_impl(config: MoEConfig, num_tokens: int | None = None) -> str:
    """The implementation ``moe_apply`` runs for ``config`` on ``num_tokens`` tokens on this
    device (``None``: a batch of unknown size, as under expert parallelism).

    Returns ``"dense"`` for dense routing, ``"blocked"``/``"ragged_dot"`` for the XLA
    baselines, ``"mosaic"`` for ``impl="mosaic"``, ``"decode"`` for ``impl="decode"``, and for
    ``"pallas"``/``"triton"`` the backend: ``"triton"`` on GPUs, ``"interpret"`` on CPU.
    ``impl="auto"`` follows ``tilax.moe.rules``: on a CPU its platform rule (``"blocked"``),
    on GPUs ``"decode"`` where a decode rule covers the batch, ``"mosaic"`` where a backend
    rule holds a measured win for the config on this GPU, else ``"triton"``. With
    ``quantize="fp8"`` the impl it names runs the FP8 experts (``fp8.py``: the XLA impls, or
    ``"mosaic"``'s FP8 kernels); ``"auto"`` takes the rules' ``QUANTIZE_RULES`` row for the
    platform.

    Raises:
        ValueError: ``impl="mosaic"`` on a device that cannot run Mosaic GPU (with the reason),
            or with ``dtype=float32`` (the Mosaic GPU kernels take 16-bit operands; float32
            experts run on Triton); ``quantize="fp8"`` on a GPU without FP8 tensor cores.
    """
    if config.quantize == "fp8":
        capability = _pallas.gpu_compute_capability()
        if _pallas.platform() == "gpu" and (capability is None or capability < (8, 9)):
            raise ValueError(f"quantize='fp8' needs FP8 tensor cores (compute capability 8.9+: "
                             f"Ada, Hopper or newer); this GPU has {capability}")
    if config.routing == "dense":  # every expert on every token: no grouped matmul, no impl
        return "dense"
    if config.impl == "mosaic":
        reason = _pallas.mosaic_unavailable_reason()
        if reason is not None:
            raise ValueError(f"impl='mosaic' cannot run on this device: {reason}")
        if config.dtype == jnp.float32:
            raise ValueError(
                "impl='mosaic' runs bfloat16/float16 experts; dtype=float32 runs on Triton: "
                "use impl='triton' (or 'pallas'/'auto')"
            )
        return "mosaic"
    if config.impl in ("blocked", "ragged_dot", "decode"):
        return config.impl
    if config.impl == "auto":
        return rules.auto_backend(config, num_tokens)
    return _pallas.resolve_backend(config.impl)


def kernel_tiles(config: MoEConfig) -> Any:
    """The tiles the Pallas path uses for ``config`` on this device: the defaults of the
    backend ``config.impl`` runs (the default Pallas backend for the XLA impls), overridden by
    the config's tile fields. Raises as :func:`resolve_impl` does."""
    backend = resolve_impl(config)
    if backend == "decode":  # the decode path trains on the training-sized kernels
        backend = rules.kernel_backend(config)
    return pallas.kernel_tiles(config, backend if backend in pallas.KERNELS else None)


# ----------------------------------------------------------------------------------------------
# The layer


def moe_apply(
    params: dict[str, Any],
    x: jax.Array,
    config: MoEConfig,
    *,
    mesh: jax.sharding.Mesh | None = None,
    expert_axis: str = "expert",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Apply the MoE layer: ``y = sum_k w_k * expert_k(x) + shared(x)``.

    ``logits = x @ router`` in float32, scores ``s = softmax(logits)`` (or
    ``sigmoid(logits)`` with ``config.score_func="sigmoid"``), each token's top-k experts by
    ``s`` (plus ``params["router_bias"]`` with ``config.balance_bias``, among the experts of
    its ``group_top_k`` best groups with ``expert_groups > 1``) with weights ``w``: their
    ``s``, renormalised to sum 1 when ``config.renormalize``, times ``config.routed_scale``;
    expert ``e`` is ``act_e(x) @ w_down[e]`` with ``act_e`` the ``config.activation``: the
    SwiGLU ``silu(x @ w_gate[e]) * (x @ w_up[e])`` by default, the GeGLU ``gelu(x @ w_gate[e])
    * (x @ w_up[e])`` or the (not gated) ``gelu(x @ w_up[e])``. Experts run in
    ``config.dtype`` with float32 accumulation. Differentiable (reverse mode) w.r.t. ``params``
    and ``x``; ``jax.jit``, ``jax.grad`` and ``jax.vmap`` take ``config`` as a positional
    argument (a pytree without leaves: static). Under ``jax.vmap`` (over ``x``, the
    parameters, or both) every impl works and each batch element is its own layer call:
    its own routing, capacity and ``aux`` (every ``aux`` entry gets the batch dimension, the
    statistics of that element's tokens); ``impl="ragged_dot"`` then runs the elements one
    after another (JAX cannot batch ``ragged_dot``). To route a batch as one set of tokens
    (one ``aux`` for all), pass ``x`` as ``[..., d_model]`` instead of vmapping.

    With a ``mesh``, expert parallelism: the experts' leading dimension is sharded over the
    mesh axis ``expert_axis`` and the tokens over all mesh axes; every device routes its own
    tokens, each token copy travels to the device owning its expert and its result travels
    back (dropless: no copy is dropped, however skewed the routing), and ``y``, ``aux`` and the
    gradients equal the single-device call up to float rounding (capacity routing keeps the
    same copies: earliest tokens first over the whole batch). ``y`` comes back split over all
    mesh axes along its first dimension where that dimension is a multiple of the device
    count, else replicated on every device (JAX splits a dimension only evenly: pad the tokens
    to a multiple of ``mesh.size`` to keep ``y`` split). Gradients work under ``jax.jit`` and
    outside it; on a mesh of explicit axes (``jax.make_mesh``'s default) with inputs already
    placed on it or inside ``jax.set_mesh``, JAX's own rules for explicit axes apply (eager
    ``jax.grad`` there needs ``jax.set_mesh``, where JAX cannot yet infer ``ragged_dot``'s
    sharding: use ``impl="blocked"``).
    See ``expert_parallel.py`` for how.

    Args:
        params: the pytree from `moe_init` (leaves may be float32 masters: they are cast
            to ``config.dtype``, the router to float32).
        x: ``[T, d_model]`` or ``[..., d_model]`` tokens (any float dtype; cast to
            ``config.dtype`` for the experts).
        config: the layer configuration.
        mesh: a ``jax.sharding.Mesh`` for expert parallelism, or ``None`` (one device).
        expert_axis: the mesh axis the experts are sharded over.

    Returns:
        ``(y, aux)``: ``y`` with the shape of ``x`` in ``config.dtype``; ``aux`` a dict with
        ``expert_counts`` ([E] int32, copies per expert before any drop), ``max_expert_frac``,
        ``empty_experts`` (int32 scalar), ``dropped_frac``, ``router_z_loss`` and
        ``load_balance_loss`` (float32 scalars; the two losses are differentiable).
        ``load_balance_loss`` is ``E * sum_e f_e * P_e`` with ``f_e`` expert ``e``'s share
        of the ``T * k`` copies and ``P_e`` its mean probability over the tokens: the
        softmax probability, or with sigmoid scores the token's scores normalised to sum 1
        (DeepSeek-V3's sequence-wise balance loss, the call's tokens as one sequence: vmap
        over sequences for one loss each). ``router_z_loss`` is ``logsumexp(logits)**2``
        whatever the scores.

    Raises:
        ValueError: ``x``'s last dimension is not ``d_model``, ``x`` holds no token, a
            parameter is missing or has the wrong shape (``router_bias`` with
            ``config.balance_bias``, or present without it), ``impl="mosaic"`` on a device that
            cannot run it (with the reason) or with ``dtype=float32``, ``quantize="fp8"`` on a
            GPU without FP8 tensor cores (compute capability below 8.9), ``expert_axis`` is
            not an axis of ``mesh``, or ``num_experts`` is not divisible by its size.
        TypeError: ``x`` or a parameter is not a float array, or ``mesh`` is not a ``Mesh``.

    Examples:
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
    if mesh is not None:
        expert_parallel.check_mesh(mesh, expert_axis, config.num_experts)
        experts = routed_experts(config, None)
        return expert_parallel.moe_apply_sharded(
            params, x, config, experts, mesh=mesh, expert_axis=expert_axis
        )
    experts = routed_experts(config, num_tokens)  # here: its errors come at every call
    trace_key = (_pallas.trace_facts(), rules.chosen())
    return _layer_on_one_device(params, x, config, experts, trace_key)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _layer_on_one_device(params, x, config, experts, trace_key):
    """The layer on one device, compiled as one program: called eagerly, the layer would
    dispatch (and compile) each of its operations apart, several times slower on a CPU. Inside
    a caller's ``jax.jit`` this jit is inlined. ``config`` is a pytree without leaves;
    ``trace_key`` keys the trace on what the trace reads besides its arguments: the assumed
    device (``_pallas.trace_facts``) and the variant choices (``rules.chosen``)."""
    del trace_key
    num_tokens = math.prod(jnp.shape(x)[:-1])
    x2 = jnp.reshape(x, (num_tokens, config.d_model))
    routed = router.route_layer(x2, params, config, backend=_router_backend(experts))
    dtype = config.dtype
    xc = x2.astype(dtype)
    w_gate = params["w_gate"].astype(dtype) if "w_gate" in params else None  # gelu: none
    w_up, w_down = (params[n].astype(dtype) for n in ("w_up", "w_down"))
    capacity = None
    if config.routing == "capacity":
        capacity = dispatch.expert_capacity(
            num_tokens, config.top_k, config.num_experts, config.capacity_factor
        )
    copies = RoutedCopies(routed.expert_ids, routed.weights, capacity)
    y, kept = experts(config, xc, w_gate, w_up, w_down, copies)
    if config.shared_hidden:
        y = y + shared_expert(params, xc, config, backend=_router_backend(experts))
    aux = router.router_aux(routed, config.num_experts, kept)
    return y.reshape(jnp.shape(x)[:-1] + (config.d_model,)).astype(dtype), aux


def _router_backend(experts) -> str | None:
    """The Pallas backend of ``experts`` (the router ranks with its kernel), or ``None``."""
    return experts.backend if isinstance(experts, pallas.PallasExperts) else None


def shared_expert(
    params: dict, x: jax.Array, config: MoEConfig, backend: str | None = None
) -> jax.Array:
    """The shared expert on tokens ``x`` (already in ``config.dtype``): with the routed experts
    on Mosaic GPU, its activation in the products' epilogues (``mosaic.shared``) where its
    shapes allow and the ``shared`` rule of ``tilax.moe.rules`` takes it, else XLA's products
    and elementwise passes (``reference.shared_expert``)."""
    names = activations.expert_weight_names(config.activation)
    shared = {n: params["shared"][n].astype(config.dtype) for n in names}
    if backend == "mosaic" and rules.variant("shared") == "kernels":
        from tilax.moe.mosaic import shared as shared_mosaic  # a GPU backend: imported here

        if shared_mosaic.applies(x, shared):
            return shared_mosaic.shared_expert(
                config.activation, x, shared.get("w_gate"), shared["w_up"], shared["w_down"])
    return reference.shared_expert(x, shared, config.activation)
