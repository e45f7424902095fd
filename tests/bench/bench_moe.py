"""MoE benchmark cases: what each suite measures, the workloads, counted FLOPs and numerics.

Suites (``extra_info["suite"]``) mirror the stored seed files:

- ``layer``: the E8 top-2 d512 h1024 layer at 4k/32k/131k tokens, E64 top-4 h256 at 32k, and
  skewed routing (skew 0.9) at 32k; every impl x dispatch x routing; float32 and bfloat16;
  ``forward`` and ``train_step``. The peers (``tokamax``, ``torch_grouped_mm``,
  ``torch_grouped_mm_compile``: see ``bench_tokamax`` and ``bench_torch_moe``) run bfloat16
  only, the one dtype their grouped matmuls take. The other expert activations
  (``MoEConfig.activation``: ``geglu``, ``gelu``; rows carry ``activation`` and its name in
  theirs) run the 131k bfloat16 train step on Mosaic GPU (sorted, the H200's default) and
  Triton, beside the SwiGLU rows of the same process. And the DeepSeek-style router on the E64
  decoder's shape (:data:`DEEPSEEK_ROUTER`: sigmoid scores, the balance bias, 8 groups of 8
  experts with 4 kept, top-8, ``routed_scale`` 2.5, the shared expert) beside the same shape's
  softmax router, bfloat16 train steps at 16k and 131k tokens in one process: tilax's default
  (Mosaic GPU, sorted) and fused, PyTorch compiled in the same math; tokamax's glue routes
  softmax top-k only (a recorded ``unsupported:`` row). And FP8 experts
  (``MoEConfig(quantize="fp8")``, rows carry ``quantize`` and ``fp8`` in their name) on the FP8
  Mosaic GPU kernels (``impl="mosaic"``), each right after the bfloat16 row of the default
  impl (Mosaic GPU, sorted) of the same case: the E8 layer at 131k tokens (forward and train
  step) and the E64 decoder's train step at 131k; beside them the PyTorch peer's FP8 rows
  (``torch_grouped_mm``/``torch_grouped_mm_compile`` with ``quantize="fp8"``, after their
  bfloat16 rows: ``torch._scaled_grouped_mm`` with torchao's rowwise recipe, a coarser one
  than tilax's 1 x 128 / 128 x 128 tiles; ``bench_torch_moe`` says how, and its rows carry
  ``fp8_scaling``, ``fp8_weight_grad``, ``fp8_fast_accum``, ``fp8_bound_out`` and
  ``fp8_bound_grad``).
- ``decoder``: the decoder layer of the H100 seed (E64 top-8, expert width 128, shared expert
  1024, d512) at 16k/131k/1M tokens, bfloat16.
- ``pieces``: the train-step cost split of the sorted Pallas path (route, sort_permute,
  experts_grouped_swiglu, unpermute_combine), each timed forward + backward.
- ``blockm``: the Pallas row-tile sweep (block_m 32/64/128).
- ``maxtok`` / ``maxtok_summary``: largest bfloat16 train step per impl (see ``bench_ladder``),
  and for the Pallas path with ``MoEConfig(recompute=True)`` (the memory-saving option: rows
  carry ``recompute: true`` and ``-recompute`` in their name).

A ``train_step`` is ``value_and_grad`` of ``sum(y * dy)`` (``dy`` a fixed random cotangent)
with respect to the parameters and the input, returning ``y`` too: forward plus backward, no
optimizer update.

Counted FLOPs (``flops``, identical for every impl of a shape so TFLOP/s ranks impls as time
does): forward ``2*T*d*E`` (router) ``+ 6*T*k*d*h`` (k SwiGLU experts per token, three
matmuls) ``+ 6*T*d*S`` (shared expert); a train step counts three times that. Dense routing's
extra work on unrouted experts and capacity routing's dropped copies are not counted.

Numerics (``rel_err_out``, ``rel_err_grad_x``, ``rel_err_grad_params``): norm-wise relative
errors ``||a - r|| / ||r||`` against ``routing="dense"`` in float32 at ``"highest"`` matmul
precision, on the same inputs (rounded to the row's dtype) and the same cotangent; the
parameter error is over all leaves together. Measured at every size (the reference runs over
chunks of tokens: each token's output depends on that token alone, and the loss's gradients
are sums over tokens), not for capacity routing (it drops copies by design).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from typing import Any

from bench_harness import JaxWorkload, Unavailable
from helpers import rel_err

MOE_IMPLS_WITH_DISPATCH = ("pallas", "triton", "mosaic", "blocked", "ragged_dot")
TORCH_IMPLS = ("torch_grouped_mm", "torch_grouped_mm_compile")
TOKAMAX_IMPLS = ("tokamax",)
# peers whose grouped matmuls take bfloat16/float16 only: no float32 rows are made for them
BF16_ONLY_IMPLS = TOKAMAX_IMPLS + TORCH_IMPLS
PIECES = ("route", "sort_permute", "experts_grouped_swiglu", "unpermute_combine")
# Device memory one chunk of the float32 dense reference may keep alive (its train step keeps
# about T*E*(3h+d)*4 B*2.5: [T, E, h] and [T, E, d] activations).
REFERENCE_CHUNK_BYTES = 24 * 2**30
# The tokamax peer's ragged_dot backend (its Mosaic GPU kernel); "xla" lets the layer code be
# checked on a CPU.
TOKAMAX_IMPLEMENTATION = os.environ.get("TILAX_BENCH_TOKAMAX_IMPL", "mosaic")


@dataclasses.dataclass(frozen=True)
class MoECase:
    """One MoE benchmark row (see the module docstring for the suites)."""

    suite: str
    impl: str  # "pallas", "triton", "blocked", "ragged_dot", "dense", or a peer (see above)
    dispatch: str | None
    routing: str  # "dropless", "capacity", "dense"
    dtype: str  # "float32" | "bfloat16"
    op: str  # "forward" | "train_step"
    tokens: int
    d_model: int
    d_hidden: int
    experts: int
    top_k: int
    shared_hidden: int = 0
    skew: float = 0.0
    piece: str | None = None
    block_m: int | None = None
    recompute: bool = False  # MoEConfig.recompute, the memory-saving option
    deterministic: bool = False  # MoEConfig.deterministic, bitwise repeatable results
    activation: str = "swiglu"  # MoEConfig.activation
    quantize: str | None = None  # MoEConfig.quantize ("fp8": the FP8 experts)
    # options of tilax.moe.rules' variant rules, ``(rule, option)`` pairs taken with
    # ``rules.choose`` while the row's function is traced (the ``variants`` suite)
    variants: tuple[tuple[str, Any], ...] = ()
    # the router: MoEConfig's routing fields (the defaults: softmax top-k)
    score_func: str = "softmax"
    balance_bias: bool = False
    expert_groups: int = 1
    group_top_k: int = 1
    routed_scale: float = 1.0
    numerics: bool = True
    priority: int = 50
    seed: int = 0

    family = "moe"

    @property
    def id(self) -> str:
        parts = [self.suite, self.impl]
        if self.dispatch and self.impl in MOE_IMPLS_WITH_DISPATCH:
            parts.append(self.dispatch)
        if self.routing != "dropless" and self.impl != "dense":
            parts.append(self.routing)
        parts.append("bf16" if self.dtype == "bfloat16" else "f32")
        if self.quantize:
            parts.append(self.quantize)
        parts.append(f"T{self.tokens}-E{self.experts}k{self.top_k}-d{self.d_model}h{self.d_hidden}")
        if self.shared_hidden:
            parts.append(f"S{self.shared_hidden}")
        if self.skew:
            parts.append(f"skew{self.skew:g}")
        if self.piece:
            parts.append(self.piece)
        if self.block_m:
            parts.append(f"bm{self.block_m}")
        if self.recompute:
            parts.append("recompute")
        if self.deterministic:
            parts.append("deterministic")
        if self.activation != "swiglu":
            parts.append(self.activation)
        parts += [f"{rule}={option}" for rule, option in self.variants]
        if self.router_label():  # e.g. sigmoid-bias-groups8of4-scale2.5
            parts.append(self.router_label().replace("groups ", "groups").replace(
                "scale ", "scale").replace("/", "of").replace(" ", "-"))
        parts.append(self.op)
        return "-".join(parts)

    def router_label(self) -> str:
        """The router when it is not the softmax top-k, e.g. ``"sigmoid bias groups 8/4 scale
        2.5"`` (``extra_info["router"]``); ``""`` for the softmax top-k."""
        parts = []
        if self.score_func != "softmax":
            parts.append(self.score_func)
        if self.balance_bias:
            parts.append("bias")
        if self.expert_groups > 1:
            parts.append(f"groups {self.expert_groups}/{self.group_top_k}")
        if self.routed_scale != 1.0:
            parts.append(f"scale {self.routed_scale:g}")
        return " ".join(parts)

    def extra_info(self) -> dict[str, Any]:
        info = {
            "family": "moe",
            "suite": self.suite,
            "impl": self.impl,
            "dispatch": self.dispatch if self.impl in MOE_IMPLS_WITH_DISPATCH else None,
            "routing": self.routing,
            "dtype": self.dtype,
            "op": self.op,
            "tokens": self.tokens,
            "d_model": self.d_model,
            "d_hidden": self.d_hidden,
            "experts": self.experts,
            "top_k": self.top_k,
            "shared_hidden": self.shared_hidden,
            "skew": self.skew,
            "flops": self.work(),
        }
        if self.piece is not None:
            info["piece"] = self.piece
        if self.block_m is not None:
            info["block_m"] = self.block_m
        if self.recompute:
            info["recompute"] = True
        if self.deterministic:
            info["deterministic"] = True
        if self.activation != "swiglu":  # missing: the default (every run before the option)
            info["activation"] = self.activation
        if self.quantize:  # missing: no quantisation (every run before the option)
            info["quantize"] = self.quantize
            if self.impl in TORCH_IMPLS:  # the peer's recipe (rowwise scales, not tilax's)
                import bench_torch_moe

                info.update(bench_torch_moe.FP8_RECIPE)
        if self.variants:
            info["variant"] = ",".join(f"{rule}={option}" for rule, option in self.variants)
        if self.router_label():
            info["router"] = self.router_label()
        return info

    def scale_key(self) -> tuple:
        fields = dataclasses.asdict(self)
        for name in ("tokens", "numerics", "priority"):
            fields.pop(name)
        return ("moe",) + tuple(sorted(fields.items()))

    def size_label(self) -> str:
        return f"tokens={self.tokens}"

    def work(self) -> float:
        if self.piece is not None:
            return float(piece_flops(self))
        return float(layer_flops(self))

    def rates(self, median_s: float) -> dict[str, float]:
        return {"tflops": self.work() / median_s / 1e12}

    def unavailable_reason(self) -> str | None:
        if self.impl in TOKAMAX_IMPLS and importlib.util.find_spec("tokamax") is None:
            return "unavailable: tokamax is not installed here"
        if self.impl in TORCH_IMPLS and importlib.util.find_spec("torch") is None:
            return "unavailable: torch is not installed here"
        return None

    def precheck(self, state) -> str | None:
        reason = self.unavailable_reason()
        if reason or state.device_bytes is None or self.routing != "dense":
            return reason
        needed = dense_routing_bytes(self)
        if needed > 0.9 * state.device_bytes:
            return (f"skipped: not attempted, RESOURCE_EXHAUSTED predicted: dense routing keeps "
                    f"about {needed / 2**30:.0f} GiB of [tokens, experts, hidden] activations; "
                    f"the device has {state.device_bytes / 2**30:.0f} GiB")
        return None

    def build(self, state):
        if self.piece is not None:
            return build_piece(self, state)
        return build_layer(self, state)

    def to_spec(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_spec(cls, spec: dict) -> MoECase:
        spec = dict(spec)
        spec["variants"] = tuple(tuple(pair) for pair in spec.get("variants", ()))
        return cls(**spec)


def layer_flops(case: MoECase) -> int:
    t, d = case.tokens, case.d_model
    # three products of d x hidden per expert (gate, up, down); two for the not-gated gelu
    products = 2 if case.activation == "gelu" else 3
    forward = 2 * t * d * case.experts + 2 * products * t * case.top_k * d * case.d_hidden
    forward += 2 * products * t * d * case.shared_hidden
    return forward * (3 if case.op == "train_step" else 1)


def piece_flops(case: MoECase) -> int:
    t, d = case.tokens, case.d_model
    if case.piece == "route":
        return 3 * 2 * t * d * case.experts
    if case.piece == "experts_grouped_swiglu":
        return 3 * 6 * t * case.top_k * d * case.d_hidden
    return 0  # sort_permute, unpermute_combine move data only


def dense_routing_bytes(case: MoECase) -> int:
    """A lower bound of what dense routing keeps alive: gate, up and activation [T, E, h] plus
    the per-expert outputs [T, E, d]; the backward keeps about 2.5 times that."""
    itemsize = 4 if case.dtype == "float32" else 2
    forward = case.tokens * case.experts * (3 * case.d_hidden + case.d_model) * itemsize
    return int(forward * (2.5 if case.op == "train_step" else 1))


def wants_numerics(routing: str) -> bool:
    """Numerics against the dense reference, except for capacity routing (it drops copies)."""
    return routing != "capacity"


def reference_chunk_tokens(case: MoECase) -> int:
    """Tokens per chunk of the float32 dense reference: the largest power of two (so that the
    power-of-two token counts split into equal chunks, one compile) whose train step keeps at
    most ``REFERENCE_CHUNK_BYTES``, and at most the case's tokens."""
    per_token = case.experts * (3 * case.d_hidden + case.d_model) * 4 * 2.5
    fitting = max(1, int(REFERENCE_CHUNK_BYTES // per_token))
    return min(case.tokens, 1 << (fitting.bit_length() - 1))


# ----------------------------------------------------------------------------- case lists


def _layer_cases(suite, impls, tokens, dtypes, ops, shape, priority, skew=0.0,
                 activation="swiglu"):
    """Cases shape-major (tokens, dtype, impl, op) so inputs and references are reused."""
    cases = []
    for t in tokens:
        for dtype in dtypes:
            for impl, dispatch, routing in impls:
                if dtype == "float32" and impl in BF16_ONLY_IMPLS:
                    continue
                for op in ops:
                    cases.append(MoECase(
                        suite=suite, impl=impl, dispatch=dispatch, routing=routing, dtype=dtype,
                        op=op, tokens=t, skew=skew, priority=priority, activation=activation,
                        numerics=wants_numerics(routing),
                        **shape,
                    ))
    return cases


BOTH_OPS = ("forward", "train_step")
BOTH_DTYPES = ("bfloat16", "float32")
SEED_LAYER = dict(d_model=512, d_hidden=1024, experts=8, top_k=2)
SEED_WIDE = dict(d_model=512, d_hidden=256, experts=64, top_k=4)
SEED_DECODER = dict(d_model=512, d_hidden=128, experts=64, top_k=8, shared_hidden=1024)
SMOKE_LAYER = dict(d_model=32, d_hidden=64, experts=4, top_k=2)
SMOKE_DECODER = dict(d_model=32, d_hidden=16, experts=8, top_k=4, shared_hidden=32)
# DeepSeek-V3's router (sigmoid scores, the auxiliary-loss-free balance bias, 8 groups of which
# each token keeps 4, the routed output scaled by 2.5) on the E64 top-8 decoder's shape.
DEEPSEEK_ROUTER = dict(score_func="sigmoid", balance_bias=True, expert_groups=8, group_top_k=4,
                       routed_scale=2.5)
SMOKE_DEEPSEEK_ROUTER = dict(DEEPSEEK_ROUTER, expert_groups=4, group_top_k=2)

P_SORTED = ("pallas", "sorted", "dropless")
P_GATHER = ("pallas", "gather", "dropless")
P_FUSED = ("pallas", "fused", "dropless")
P_GSUM = ("pallas", "fused_gsum", "dropless")
TRITON = ("triton", "sorted", "dropless")
# the Mosaic GPU backend (Hopper; bfloat16/float16 only), every dispatch
MOSAIC = tuple(("mosaic", d, "dropless") for d in ("sorted", "gather", "fused", "fused_gsum"))
BLOCKED = ("blocked", "sorted", "dropless")
RAGGED = ("ragged_dot", "sorted", "dropless")
TOKAMAX = ("tokamax", None, "dropless")
TORCH = ("torch_grouped_mm", None, "dropless")
TORCH_COMPILE = ("torch_grouped_mm_compile", None, "dropless")
DENSE = ("dense", None, "dense")
CAPACITY = ("pallas", "sorted", "capacity")

LAYER_ALL = (P_SORTED, P_GATHER, P_FUSED, P_GSUM, BLOCKED, RAGGED, TOKAMAX, TORCH, TORCH_COMPILE,
             DENSE, CAPACITY)
LAYER_CORE = (P_SORTED, P_GSUM, RAGGED, TOKAMAX, DENSE)
# The DeepSeek-style rows and their softmax baseline: tilax's default on the H200 (Mosaic GPU,
# sorted), its fastest dispatch at the E64 decoder's shape (fused), and the peers in the same
# math.
ROUTER_IMPLS = (MOSAIC[0], MOSAIC[2], TORCH_COMPILE, TOKAMAX)


def router_cases(tokens, router: dict, shape: dict, impls, priority: int) -> list[MoECase]:
    """bfloat16 train steps of ``shape`` with the softmax router, each followed by the same
    case with the router fields ``router``: the pair a ratio is formed from runs back to back
    in one process, so a run cut short by its budget keeps whole pairs."""
    cases = _layer_cases("layer", impls, tokens, ["bfloat16"], ["train_step"], shape, priority)
    return [pair for case in cases for pair in (case, dataclasses.replace(case, **router))]


# Impls with FP8 rows in the layer suite: tilax's default on the H200 (Mosaic GPU, sorted) and
# the PyTorch peer on torch._scaled_grouped_mm (rowwise scales), eager and compiled.
FP8_IMPLS = (MOSAIC[0], TORCH, TORCH_COMPILE)


def fp8_cases(tokens, shape, ops, priority: int) -> list[MoECase]:
    """bfloat16 rows of :data:`FP8_IMPLS`, each followed by the same case with
    ``quantize="fp8"`` (the FP8 Mosaic GPU kernels; the PyTorch peer's FP8 path): the pair a
    ratio is formed from runs back to back in one process."""
    cases = _layer_cases("layer", FP8_IMPLS, tokens, ["bfloat16"], ops, shape, priority)
    return [pair for case in cases for pair in (case, dataclasses.replace(case, quantize="fp8"))]


def layer_cases(mode: str) -> list[MoECase]:
    if mode == "smoke":
        shape = SMOKE_LAYER
        return (
            _layer_cases("layer", (P_SORTED, RAGGED, DENSE), [64], ["float32"], BOTH_OPS,
                         shape, 10)
            + _layer_cases("layer", (P_GSUM, TRITON, BLOCKED, CAPACITY), [64], ["float32"],
                           ["forward"], shape, 10)
            + _layer_cases("layer", (TOKAMAX, TORCH), [64], ["bfloat16"], BOTH_OPS, shape, 10)
            + _layer_cases("layer", (P_SORTED,), [64], ["bfloat16"], ["forward"], shape, 10)
            + _layer_cases("layer", (P_SORTED,), [64], ["bfloat16"], ["forward"], shape, 10,
                           skew=0.9)
            + router_cases([64], SMOKE_DEEPSEEK_ROUTER, SMOKE_DECODER,
                           (P_SORTED, TORCH_COMPILE, TOKAMAX), 10)
            # the quantize field's code path, on the XLA FP8 path a CPU runs, and the PyTorch
            # FP8 peer (an unavailable row without torch or a GPU)
            + [dataclasses.replace(case, quantize="fp8") for case in _layer_cases(
                "layer", (RAGGED, TORCH), [64], ["bfloat16"], ["forward"], shape, 10)]
        )
    if mode == "quick":
        return (_layer_cases("layer", LAYER_CORE[:1] + LAYER_CORE[2:], [32768], BOTH_DTYPES,
                             BOTH_OPS, SEED_LAYER, 10)
                + router_cases([16384], DEEPSEEK_ROUTER, SEED_DECODER, ROUTER_IMPLS, 12))
    return _first_of_each_id(
        # the DeepSeek-style router against the same shape's softmax router, then the rest
        router_cases([16384, 131072], DEEPSEEK_ROUTER, SEED_DECODER, ROUTER_IMPLS, 8)
        # the FP8 experts beside the bfloat16 default: the E8 headline and the E64 decoder
        + fp8_cases([131072], SEED_LAYER, BOTH_OPS, 9)
        + fp8_cases([131072], SEED_DECODER, ["train_step"], 9)
        +
        # the headline comparison first: every impl at 32k and 131k, both dtypes and ops
        _layer_cases("layer", LAYER_ALL, [32768, 131072], BOTH_DTYPES, BOTH_OPS, SEED_LAYER, 10)
        + _layer_cases("layer", (TRITON, *MOSAIC), [32768, 131072], ["bfloat16"], BOTH_OPS,
                       SEED_LAYER, 11)
        + _layer_cases("layer", LAYER_CORE, [4096], BOTH_DTYPES, BOTH_OPS, SEED_LAYER, 30)
        + _layer_cases("layer", (P_SORTED, P_GSUM, BLOCKED, RAGGED, TOKAMAX, DENSE), [32768],
                       BOTH_DTYPES, BOTH_OPS, SEED_WIDE, 31)
        + _layer_cases("layer", (P_SORTED, P_FUSED, P_GSUM, CAPACITY, RAGGED, TOKAMAX), [32768],
                       ["bfloat16"], BOTH_OPS, SEED_LAYER, 32, skew=0.9)
        # the other activations' cost, against the SwiGLU rows of the same process: the
        # default impl (Mosaic GPU, sorted, on the H200) and Triton
        + [case for activation in ACTIVATIONS_MEASURED for case in _layer_cases(
            "layer", (MOSAIC[0], TRITON), [131072], ["bfloat16"], ["train_step"], SEED_LAYER,
            12, activation=activation)]
        + deterministic_cases()
    )


def _first_of_each_id(cases: list[MoECase]) -> list[MoECase]:
    """``cases`` without repeats of an id (a case two groups both need, such as the E64
    softmax train step beside the DeepSeek router and beside the deterministic mode), each
    where it first comes."""
    seen = set()
    return [case for case in cases if not (case.id in seen or seen.add(case.id))]


# MoEConfig.activation values other than the default with layer-suite rows
ACTIVATIONS_MEASURED = ("geglu", "gelu")


# MoEConfig.deterministic's train step beside the default, in the same file: the backends
# impl="auto" takes on the H200 (Mosaic GPU; fused_gsum's combine becomes fused's) and Triton.
DETERMINISTIC_IMPLS = (MOSAIC[0], MOSAIC[3], P_SORTED)


def deterministic_cases() -> list[MoECase]:
    """The deterministic train step at 131k tokens: the E8 layer (its default rows are the
    headline rows above) and the E64 decoder with its shared expert, default and deterministic
    (the decoder suite's rows run in another file)."""
    layer = _layer_cases("layer", DETERMINISTIC_IMPLS, [131072], ["bfloat16"], ["train_step"],
                         SEED_LAYER, 11)
    decoder = _layer_cases("layer", DETERMINISTIC_IMPLS, [131072], ["bfloat16"],
                           ["train_step"], SEED_DECODER, 12)
    return ([dataclasses.replace(case, deterministic=True) for case in layer]
            + [c for case in decoder for c in (case, dataclasses.replace(case,
                                                                          deterministic=True))])


DECODER_IMPLS = (TRITON, ("triton", "fused_gsum", "dropless"), P_SORTED, RAGGED, TOKAMAX, TORCH,
                 TORCH_COMPILE, DENSE, MOSAIC[0], MOSAIC[3])
# the H100 seed's other Triton dispatches, after the rest
DECODER_MORE = (("triton", "gather", "dropless"), ("triton", "fused", "dropless"), MOSAIC[1],
                MOSAIC[2])


def decoder_cases(mode: str) -> list[MoECase]:
    if mode == "smoke":  # numerics are the layer's code path, checked there
        return [dataclasses.replace(case, numerics=False) for case in _layer_cases(
            "decoder", (P_SORTED, TOKAMAX, TORCH_COMPILE), [64], ["bfloat16"], ["forward"],
            SMOKE_DECODER, 20)]
    if mode == "quick":
        return _layer_cases("decoder", (P_SORTED, RAGGED, TOKAMAX, TORCH_COMPILE), [16384],
                            ["bfloat16"], BOTH_OPS, SEED_DECODER, 20)
    return (_layer_cases("decoder", DECODER_IMPLS, [16384, 131072], ["bfloat16"], BOTH_OPS,
                         SEED_DECODER, 20)
            + _layer_cases("decoder", DECODER_IMPLS, [1048576], ["bfloat16"], BOTH_OPS,
                           SEED_DECODER, 25)
            + _layer_cases("decoder", DECODER_MORE, [16384, 131072, 1048576], ["bfloat16"],
                           BOTH_OPS, SEED_DECODER, 26))


def pieces_cases(mode: str) -> list[MoECase]:
    shape, tokens, dtypes = SEED_LAYER, [4096, 32768], BOTH_DTYPES
    if mode == "smoke":
        shape, tokens, dtypes = SMOKE_LAYER, [64], ["float32"]
    elif mode == "quick":
        tokens, dtypes = [32768], ["bfloat16"]
    return [
        MoECase(suite="pieces", impl="pallas", dispatch="sorted", routing="dropless",
                dtype=dtype, op="train_step", tokens=t, piece=piece, numerics=False,
                priority=15 if (t, dtype) == (32768, "bfloat16") else 40, **shape)
        for t in tokens for dtype in dtypes for piece in PIECES
    ]


def blockm_cases(mode: str) -> list[MoECase]:
    shape, tokens, dtypes, ops, sizes = SEED_LAYER, [32768], BOTH_DTYPES, BOTH_OPS, (32, 64, 128)
    if mode == "smoke":
        shape, tokens, dtypes, ops, sizes = SMOKE_LAYER, [64], ["float32"], ["forward"], (16, 32)
    elif mode == "quick":
        dtypes, ops = ["bfloat16"], ["forward"]
    return [
        MoECase(suite="blockm", impl="pallas", dispatch="sorted", routing="dropless",
                dtype=dtype, op=op, tokens=t, block_m=bm,
                priority=16 if dtype == "bfloat16" else 45,
                numerics=wants_numerics("dropless"),
                **shape)
        for t in tokens for dtype in dtypes for bm in sizes for op in ops
    ]


# (impl, dispatch, routing, recompute): the memory-saving option first, the one ladder that
# should climb past 4M tokens (issue 14: at least 8,388,608 tokens on one H200)
P_RECOMPUTE = ("pallas", "fused", "dropless", True)
MAXTOK_IMPLS = (P_RECOMPUTE,) + tuple(
    impl + (False,) for impl in (P_SORTED, P_GSUM, BLOCKED, RAGGED, TOKAMAX, DENSE, CAPACITY))


def maxtok_ladders(mode: str) -> list[tuple[MoECase, list[int]]]:
    """(template case, token ladder) per impl: bf16 train step of the E8 top-2 layer."""
    if mode == "smoke":
        impls, shape, ladder = (P_SORTED + (False,), P_RECOMPUTE), SMOKE_LAYER, [64]
    elif mode == "quick":
        impls, shape = (P_SORTED + (False,), RAGGED + (False,), P_RECOMPUTE), SEED_LAYER
        ladder = [2**20, 2**22, 2**24]
    else:
        impls, shape = MAXTOK_IMPLS, SEED_LAYER
        # every power of two from 131k, the largest layer size every impl runs (ragged_dot ran out
        # of memory at 262k on the H200): each ladder has a size that ran, so it is bracketed
        ladder = [2**k for k in range(17, 26)]
    return [
        (MoECase(suite="maxtok", impl=impl, dispatch=dispatch, routing=routing,
                 dtype="bfloat16", op="train_step", tokens=ladder[0], numerics=False,
                 recompute=recompute, priority=0, **shape), ladder)
        for impl, dispatch, routing, recompute in impls
    ]


# ----------------------------------------------------------------------------- workloads


def _jnp_dtype(name: str):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def moe_config(case: MoECase, *, dtype=None, routing=None, impl=None, dispatch=None):
    """The tilax.MoEConfig of a case (``impl="dense"`` is ``routing="dense"``)."""
    import tilax

    kwargs: dict[str, Any] = dict(
        d_model=case.d_model, d_hidden=case.d_hidden, num_experts=case.experts,
        top_k=case.top_k, shared_hidden=case.shared_hidden, activation=case.activation,
        dtype=dtype if dtype is not None else _jnp_dtype(case.dtype),
    )
    if case.router_label():
        kwargs.update(score_func=case.score_func, balance_bias=case.balance_bias,
                      expert_groups=case.expert_groups, group_top_k=case.group_top_k,
                      routed_scale=case.routed_scale)
    routing = routing or ("dense" if case.impl == "dense" else case.routing)
    kwargs["routing"] = routing
    impl = impl or case.impl
    if impl in MOE_IMPLS_WITH_DISPATCH:
        kwargs["impl"] = impl
        kwargs["dispatch"] = dispatch or case.dispatch or "sorted"
    if case.block_m is not None:
        names = {f.name for f in dataclasses.fields(tilax.MoEConfig)}
        if "block_m" not in names:
            raise Unavailable("unsupported: tilax.MoEConfig has no block_m option")
        kwargs["block_m"] = case.block_m
    if case.recompute:
        kwargs["recompute"] = True
    if case.deterministic:
        kwargs["deterministic"] = True
    if case.quantize and routing != "dense" and dtype is None and impl == case.impl:
        kwargs["quantize"] = case.quantize  # the case's own layer (not its dense reference)
    return tilax.MoEConfig(**kwargs)


@dataclasses.dataclass
class MoEInputs:
    params: Any
    x: Any
    dy: Any
    stats: dict


def make_inputs(case: MoECase) -> MoEInputs:
    """Parameters, tokens (skewed when asked) and the cotangent of one shape and dtype. With
    the balance bias, a small random ``router_bias`` (as after some balancing steps: it moves
    some choices)."""
    import jax
    import jax.numpy as jnp

    import tilax
    from tilax.moe.router import route_layer, skew_tokens

    dtype = _jnp_dtype(case.dtype)
    key_params, key_x, key_dy = jax.random.split(jax.random.key(case.seed), 3)
    config = moe_config(case, routing="dropless", impl="pallas")
    params = tilax.moe_init(key_params, config)
    if case.balance_bias:
        bias_key = jax.random.fold_in(key_params, 1)
        params["router_bias"] = 0.01 * jax.random.normal(bias_key, (case.experts,), jnp.float32)
    x = jax.random.normal(key_x, (case.tokens, case.d_model), jnp.float32)
    if case.skew:
        x = skew_tokens(x, params["router"], case.skew)
    x = x.astype(dtype)
    dy = jax.random.normal(key_dy, (case.tokens, case.d_model), jnp.float32)
    routed = route_layer(x, params, config)
    counts = jnp.sum(routed.expert_ids.reshape(-1, 1) == jnp.arange(case.experts), axis=0)
    stats = {
        "max_expert_frac": float(jnp.max(counts)) / (case.tokens * case.top_k),
        "empty_experts": int(jnp.sum(counts == 0)),
    }
    return MoEInputs(params, x, dy, stats)


def _inputs_key(case: MoECase) -> tuple:
    return ("moe", case.tokens, case.d_model, case.d_hidden, case.experts, case.top_k,
            case.shared_hidden, case.skew, case.dtype, case.seed, case.router_label(),
            case.activation)


def layer_apply_fn(case: MoECase):
    """``apply(params, x) -> (y, aux)`` of the case's implementation."""
    if case.impl in TOKAMAX_IMPLS:
        if case.router_label():
            raise Unavailable(f"unsupported: the tokamax peer's glue routes softmax top-k only, "
                              f"not this router ({case.router_label()})")
        try:
            import bench_tokamax
        except ModuleNotFoundError as exc:  # not installed: not attempted; any other error fails
            raise Unavailable(
                f"unavailable: tokamax or a module it needs is not installed here ({exc})") from exc
        return bench_tokamax.make_apply(case, TOKAMAX_IMPLEMENTATION)
    import tilax

    config = moe_config(case)
    return lambda params, x: tilax.moe_apply(params, x, config)


def reference(case: MoECase, inputs: MoEInputs) -> dict:
    """Float32 dense-routing outputs and gradients at "highest" matmul precision, computed over
    chunks of ``reference_chunk_tokens`` tokens (outputs and input gradients joined, parameter
    gradients summed), so any token count fits the device."""
    import jax
    import jax.numpy as jnp

    import tilax

    config = moe_config(case, dtype=jnp.float32, routing="dense")
    params32 = jax.tree.map(lambda a: a.astype(jnp.float32), inputs.params)
    x32 = inputs.x.astype(jnp.float32)

    def forward(params, x):
        return tilax.moe_apply(params, x, config)[0]

    @jax.jit
    def run(params, x, dy):
        y, vjp = jax.vjp(forward, params, x)
        grad_params, grad_x = vjp(dy)
        return y, grad_x, grad_params

    chunk = reference_chunk_tokens(case)
    ys, grad_xs, grad_params = [], [], None
    with jax.default_matmul_precision("highest"):
        for start in range(0, case.tokens, chunk):
            part = slice(start, start + chunk)
            y, grad_x, grads = run(params32, x32[part], inputs.dy[part])
            ys.append(y)
            grad_xs.append(grad_x)
            grad_params = grads if grad_params is None else jax.tree.map(
                jnp.add, grad_params, grads)
    return jax.block_until_ready({"y": jnp.concatenate(ys), "grad_x": jnp.concatenate(grad_xs),
                                  "grad_params": grad_params})


def numerics_info(case: MoECase, state, inputs: MoEInputs, y, grad_x=None,
                  grad_params=None) -> dict:
    """Router statistics, and the errors against the float32 dense reference where wanted
    (``grad_x``/``grad_params`` for train steps; arrays of any framework, as float32)."""
    info = dict(inputs.stats)
    if not case.numerics:
        return info
    ref = state.references.get(_inputs_key(case), lambda: reference(case, inputs))
    info["rel_err_out"] = rel_err(y, ref["y"])
    if grad_x is not None:
        info["rel_err_grad_x"] = rel_err(grad_x, ref["grad_x"])
        info["rel_err_grad_params"] = rel_err(grad_params, ref["grad_params"])
    return info


def build_layer(case: MoECase, state):
    import jax
    import jax.numpy as jnp

    inputs = state.inputs.get(_inputs_key(case), lambda: make_inputs(case))
    if case.impl in TORCH_IMPLS:
        import bench_torch_moe

        return bench_torch_moe.TorchMoEWorkload(
            case, inputs, lambda *out: numerics_info(case, state, inputs, *out))
    apply = layer_apply_fn(case)

    def numerics(out) -> dict:
        if case.op == "forward":
            return numerics_info(case, state, inputs, out[0])
        (_, y), (grad_params, grad_x) = out
        return numerics_info(case, state, inputs, y, grad_x, grad_params)

    if case.op == "forward":
        fn, args = jax.jit(apply), (inputs.params, inputs.x)
    else:
        def loss(params, x, dy):
            y, _ = apply(params, x)
            return jnp.sum(y.astype(jnp.float32) * dy), y

        # y rides along as an output (it is computed anyway) so numerics need no extra forward
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        args = (inputs.params, inputs.x, inputs.dy)
    if case.variants:
        from tilax.moe import rules

        # the variant rules are read while tracing: compile here, inside the choice
        with rules.choose(**dict(case.variants)):
            fn = fn.lower(*args).compile()
    return JaxWorkload(fn, args, numerics)


# ----------------------------------------------------------------------------- pieces


def _moe_internal(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise Unavailable(f"unsupported: {module}.{name} is not available ({exc})") from exc


def build_piece(case: MoECase, state) -> JaxWorkload:
    """One piece of the sorted Pallas train step, timed forward + backward.

    route, sort_permute and unpermute_combine are ``jax.vjp`` of tilax.moe's router and
    dispatch functions; experts_grouped_swiglu see :func:`build_experts_piece`.
    """
    import jax
    import jax.numpy as jnp

    route = _moe_internal("tilax.moe.router", "route")
    sort_by_expert = _moe_internal("tilax.moe.dispatch", "sort_by_expert")
    permute = _moe_internal("tilax.moe.dispatch", "permute")
    combine = _moe_internal("tilax.moe.dispatch", "combine")
    kernel_tiles = _moe_internal("tilax.moe.pallas", "kernel_tiles")
    config = moe_config(case)
    tiles = kernel_tiles(config)

    inputs = state.inputs.get(_inputs_key(case), lambda: make_inputs(case))
    params, x = inputs.params, inputs.x
    routed = route(x, params["router"], case.top_k, True)
    layout = sort_by_expert(routed.expert_ids, case.experts, row_multiple=tiles.row_multiple)
    rows = permute(x, layout)
    key = jax.random.key(case.seed + 1)

    def fwd_bwd(fn, *primals):
        def run(*args):
            out, vjp = jax.vjp(fn, *args)
            cotangent = jax.tree.map(
                lambda o: jax.random.normal(key, o.shape, jnp.float32).astype(o.dtype), out)
            return out, vjp(cotangent)
        return JaxWorkload(jax.jit(run), primals)

    if case.piece == "route":
        return fwd_bwd(lambda x, r: route(x, r, case.top_k, True).weights, x, params["router"])
    if case.piece == "sort_permute":
        ids = routed.expert_ids

        def sort_permute(x):
            return permute(x, sort_by_expert(ids, case.experts, row_multiple=tiles.row_multiple))
        return fwd_bwd(sort_permute, x)
    if case.piece == "unpermute_combine":
        return fwd_bwd(lambda rows, w: combine(rows, w, layout), rows, routed.weights)
    if case.piece == "experts_grouped_swiglu":
        return build_experts_piece(case, config, tiles, layout, rows, params, key)
    raise ValueError(f"unknown piece {case.piece!r}")


def build_experts_piece(case, config, tiles, layout, rows, params, key) -> JaxWorkload:
    """The layer's own sorted-dispatch expert function (and custom VJP) on token copies that
    are already sorted by expert: an identity permutation and unit weights, so it times the
    three grouped matmuls, the SwiGLU and their backward (plus an identity gather and scale,
    a few percent of the matmuls' time)."""
    import jax
    import jax.numpy as jnp

    pallas_experts = _moe_internal("tilax.moe.pallas", "pallas_experts")
    plan_type = _moe_internal("tilax.moe.pallas", "Plan")
    resolve_impl = _moe_internal("tilax.moe.api", "resolve_impl")
    sort_by_expert = _moe_internal("tilax.moe.dispatch", "sort_by_expert")
    gmm_schedule = _moe_internal("tilax.moe.dispatch", "gmm_schedule")
    copies = case.tokens * case.top_k
    sorted_rows = rows[:copies]
    row_expert = jnp.searchsorted(layout.group_offsets[1:], jnp.arange(copies), side="right")
    identity = sort_by_expert(row_expert.astype(jnp.int32)[:, None], case.experts,
                              row_multiple=tiles.row_multiple)
    schedule = gmm_schedule(identity.group_offsets, identity.row_token.shape[0], tiles.block_m)
    plan = plan_type("sorted", resolve_impl(config), tiles, copies)
    unit_weights = jnp.ones((copies, 1), jnp.float32)
    dtype = _jnp_dtype(case.dtype)
    weights = [params[name].astype(dtype) for name in ("w_gate", "w_up", "w_down")]
    dy_rows = jax.random.normal(key, sorted_rows.shape, dtype)

    def experts(rows, w_gate, w_up, w_down):
        return pallas_experts(plan, rows, w_gate, w_up, w_down, unit_weights, identity, schedule)

    def run(rows, w_gate, w_up, w_down, dy_rows):
        out, vjp = jax.vjp(experts, rows, w_gate, w_up, w_down)
        return out, vjp(dy_rows)

    return JaxWorkload(jax.jit(run), (sorted_rows, *weights, dy_rows))


# ----------------------------------------------------------------------------- registry


# The variant rules' A/B (tilax.moe.rules: each row's pick against its other options, one
# process): the E64 decoder's bf16 train step, where every Mosaic GPU variant applies, and the
# E8 layer's for the rules that reach it.
VARIANT_OPTIONS = (
    (), (("joined_dx", "on"),), (("joined_dx", "overlap"),), (("shared", "xla"),),
    (("router", "xla"),), (("train_rows", "gather"),), (("programs_per_sm", 1),),
    (("copy_rows", "xla"),), (("gmm_ws", "off"),),
)
LAYER_VARIANT_OPTIONS = ((), (("programs_per_sm", 1),), (("router", "xla"),))


def variants_cases(mode: str) -> list[MoECase]:
    mosaic_fused = ("mosaic", "fused", "dropless")
    if mode == "smoke":  # the suite's code path: a variant row compiles inside its choice
        shape, tokens, options, layer_options = SMOKE_DECODER, [64], VARIANT_OPTIONS[:2], ()
        mosaic_fused = P_FUSED
    elif mode == "quick":
        shape, tokens, options, layer_options = SEED_DECODER, [16384], VARIANT_OPTIONS, ()
    else:
        shape, tokens, options = SEED_DECODER, [131072], VARIANT_OPTIONS
        layer_options = LAYER_VARIANT_OPTIONS
    cases = []
    for variants in options:
        for case in _layer_cases("variants", (mosaic_fused,), tokens, ["bfloat16"],
                                 ["train_step"], shape, 15):
            cases.append(dataclasses.replace(case, variants=variants, numerics=False))
    for variants in layer_options:
        for case in _layer_cases("variants", (mosaic_fused,), tokens, ["bfloat16"],
                                 ["train_step"], SEED_LAYER, 16):
            cases.append(dataclasses.replace(case, variants=variants, numerics=False))
    return cases


# ----------------------------------------------------------------------------- decode suite

# The decode suite: bfloat16 forwards of small batches, bound by reading the touched experts'
# weights. Two layers: a Qwen3-30B-A3B-like one (E128 top-8, d2048, h768) and a Mixtral-like
# one (E8 top-2, d4096, h14336), each at 1 to 512 tokens, every tilax path (``auto``, the
# decode kernels, the training kernels on Triton and Mosaic GPU) beside the peers, and the
# GPU's copy bandwidth measured in the same process (first and last row). Routing is the
# layer's own on the inputs of ``make_inputs``: ``moe_init`` weights and standard normal
# tokens from the fixed key ``jax.random.key(seed)``, seed 0 (about uniform over the experts);
# each row records the bytes of the experts its batch touches (``touched_weight_bytes``), from
# which the report derives the touched-weight bytes per second (``touched_weight_gbps``).
DECODE_SHAPES = {
    "qwen3": dict(d_model=2048, d_hidden=768, experts=128, top_k=8),
    "mixtral": dict(d_model=4096, d_hidden=14336, experts=8, top_k=2),
}
DECODE_TOKENS = (1, 4, 16, 64, 256, 512)
DECODE_IMPLS = (("auto", None, "dropless"), ("decode", None, "dropless"), TRITON, MOSAIC[0],
                RAGGED, TOKAMAX, TORCH, TORCH_COMPILE)
# Bytes of the copy_bandwidth row's buffer: far past the H200's 50 MB L2.
COPY_BYTES = {"smoke": 2**20, "quick": 2**30, "full": 2**30}


@dataclasses.dataclass(frozen=True)
class DecodeCase(MoECase):
    """A row of the decode suite: a layer forward whose ``extra_info`` also carries the bytes of
    the expert weights its batch touches (``touched_weight_bytes``, ``touched_experts``)."""

    def build(self, state):
        inputs = state.inputs.get(_inputs_key(self), lambda: make_inputs(self))
        touched = touched_weights(self, inputs)
        if self.impl == "decode":
            import jax

            import tilax

            config = dataclasses.replace(moe_config(self), impl="decode")
            workload = JaxWorkload(
                jax.jit(lambda params, x: tilax.moe_apply(params, x, config)),
                (inputs.params, inputs.x),
                lambda out: numerics_info(self, state, inputs, out[0]))
        else:
            workload = build_layer(self, state)
        return WithInfo(workload, touched)


def touched_weights(case: MoECase, inputs: MoEInputs) -> dict:
    """The experts the case's batch routes to (the layer's routing of its actual inputs) and
    the bytes a forward must read at least: ``w_gate``, ``w_up`` and ``w_down`` of each touched
    expert in the case's dtype, the float32 router and the shared expert's three matrices."""
    import jax.numpy as jnp

    from tilax.moe.router import route

    routed = route(inputs.x, inputs.params["router"], case.top_k, True)
    counts = jnp.sum(routed.expert_ids.reshape(-1, 1) == jnp.arange(case.experts), axis=0)
    touched = int(jnp.sum(counts > 0))
    itemsize = 4 if case.dtype == "float32" else 2
    expert_bytes = 3 * case.d_model * case.d_hidden * itemsize
    shared_bytes = 3 * case.d_model * case.shared_hidden * itemsize
    router_bytes = case.d_model * case.experts * 4
    return {"touched_experts": touched,
            "touched_weight_bytes": touched * expert_bytes + shared_bytes + router_bytes}


class WithInfo:
    """A workload whose ``inspect`` adds fixed fields to the row's ``extra_info``."""

    def __init__(self, workload, info: dict):
        self.workload, self.info = workload, info

    def start(self):
        return self.workload.start()

    def finish(self, pending):
        return self.workload.finish(pending)

    def call(self):
        return self.workload.call()

    def inspect(self, out) -> dict:
        return {**self.workload.inspect(out), **self.info}

    def memory(self):
        return self.workload.memory()

    def close(self) -> None:
        self.workload.close()


@dataclasses.dataclass(frozen=True)
class CopyBandwidthCase:
    """The GPU's device-to-device copy bandwidth in the bench process: XLA copies a buffer of
    ``nbytes`` (far past L2) into a new one; ``bytes`` counts the read and the write, ``gbps``
    is ``bytes / median / 1e9``. The decode rows' touched-weight bytes per second are read
    against it."""

    suite: str
    nbytes: int
    label: str  # "first" or "last": the run's first and last row
    priority: int
    dtype: str = "bfloat16"

    family = "moe"
    impl = "copy_bandwidth"

    @property
    def id(self) -> str:
        return f"{self.suite}-copy_bandwidth-{self.nbytes // 2**20}MiB-{self.label}"

    def extra_info(self) -> dict:
        return {"family": "moe", "suite": self.suite, "impl": self.impl, "dtype": self.dtype,
                "op": "copy", "bytes": 2 * self.nbytes, "copy_label": self.label}

    def scale_key(self) -> tuple:
        return ("moe", "copy_bandwidth", self.label)

    def size_label(self) -> str:
        return f"bytes={self.nbytes}"

    def work(self) -> float:
        return float(2 * self.nbytes)

    def rates(self, median_s: float) -> dict[str, float]:
        return {"gbps": 2 * self.nbytes / median_s / 1e9}

    def precheck(self, state) -> str | None:
        return None

    def build(self, state):
        import jax
        import jax.numpy as jnp

        buffer = jnp.zeros((self.nbytes // 4,), jnp.uint32)
        return JaxWorkload(jax.jit(jnp.copy), (buffer,))


def decode_cases(mode: str) -> list:
    shapes, tokens, impls = DECODE_SHAPES, DECODE_TOKENS, DECODE_IMPLS
    if mode == "smoke":
        shapes, tokens = {"smoke": SMOKE_DECODER}, (1, 16)
        impls = (("auto", None, "dropless"), ("decode", None, "dropless"), RAGGED)
    elif mode == "quick":
        tokens = (1, 64, 512)
    cases = [CopyBandwidthCase("decode", COPY_BYTES[mode], "first", 4)]
    for shape in shapes.values():
        cases += [DecodeCase(**dataclasses.asdict(case)) for case in _layer_cases(
            "decode", impls, tokens, ["bfloat16"], ["forward"], shape, 5)]
    cases.append(CopyBandwidthCase("decode", COPY_BYTES[mode], "last", 6))
    return cases


def suite_cases(suite: str, mode: str) -> list[MoECase]:
    return {
        "layer": layer_cases,
        "decoder": decoder_cases,
        "pieces": pieces_cases,
        "blockm": blockm_cases,
        "variants": variants_cases,
        "decode": decode_cases,
    }[suite](mode)

