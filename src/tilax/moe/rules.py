"""Every kernel choice of the MoE layer, as data, each row naming the stored run behind it.

One table, ``RULES``, of four kinds of rows:

- ``PLATFORM_RULES``: what ``impl="auto"`` runs off GPUs (:class:`PlatformRule`): a plain-XLA
  impl, never the Pallas interpreter (which runs only when asked for, ``impl="pallas"``), each
  row naming the measurement that chose between the XLA impls;
- ``BACKEND_RULES``: which Pallas backend ``impl="auto"`` runs. Each row names a GPU
  (``jax.Device.device_kind``), a dtype, a dispatch and the expert count and top-k it was
  measured at, the backend whose bf16 train step was faster there, and the stored result files
  (``data/results/``) that hold both backends' rows from one process. A config that matches no
  row runs Triton, the backend every configuration has been measured with. Rows apply to the
  measured settings only: dropless routing, the default tiles and no ``recompute`` (the Mosaic
  GPU kernels have their own tile constraints). ``docs/guides/moe.md`` lists the table.
- ``QUANTIZE_RULES``: what ``impl="auto"`` runs with ``MoEConfig(quantize=...)``
  (:class:`QuantizeRule`), per platform; a row with no measurement behind it says so
  (``unmeasured``) and why it is taken anyway.
- ``DECODE_RULES``: where ``impl="auto"`` runs the decode kernels (``decode.py``) for small
  batches on GPUs (:class:`DecodeRule`), each row naming the ``decode`` suite's stored runs
  or, until one exists, why it stands unmeasured;
- ``VARIANT_RULES``: inside the Mosaic GPU backend, which kernel each step takes (one row per
  choice: its options, the one the layer takes, the measured limits of where it takes it).
  A row's evidence is a before/after pair of stored runs (:class:`Comparison`: the same case
  with and without the variant, in two files, the runs of the commits that made the change);
  where no stored run holds the choice, ``unstored`` names the figures of the kernel's
  docstring, which came from diagnostic runs that were not stored (such rows need an H200
  run in one process).

Each kernel's own launch constants (ring depths, warpgroup registers, the router and row-copy
kernels' programs per SM) stay beside it with the figures that set them: they tune a kernel,
they do not choose between kernels.

``tests/moe/test_moe_rules.py`` reads every row's files and fails unless the chosen side is
faster beyond the spread of both rows (its upper quartile under the other's lower), and fails
for a row that has neither evidence nor a named unstored figure.

The layer takes each variant row's ``pick``. :func:`choose` selects another option for the
code traced inside its block (tests compare variants this way, and an H200 A/B does)::

    with rules.choose(joined_dx="on", gmm_ws="off"):
        y, aux = tilax.moe_apply(params, x, config)   # traced here: the chosen kernels

Options are read when a function is traced: a function jitted and called outside the block
keeps the kernels it was traced with.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp

from tilax import _pallas

# ----------------------------------------------------------------------------------------------
# The platform rule


@dataclasses.dataclass(frozen=True)
class PlatformRule:
    """What ``impl="auto"`` runs on a JAX ``platform`` without GPU kernels: the plain-XLA
    ``impl`` measured fastest there, and how it was measured (a CPU measurement is not stored
    under ``data/results/``: ``measured`` names it)."""

    platform: str
    impl: str
    measured: str


_PLATFORM_ROWS = (
    PlatformRule(
        "cpu", "blocked",
        measured="jitted forward and train step (grad w.r.t. params and x), median of 5 after "
                 "a warm-up, `blocked` against `ragged_dot` in one process on a 2-core x86 "
                 "CPU, jax 0.10.2, at commit e653c2d: T512 d128 h256 E8 top-2 float32 "
                 "forward 6.9 ms against 21.8, train 52 against 135; T2048 d256 h512 E8 "
                 "top-2 bfloat16 82 against 174, 376 against 801; T1024 d128 h128 E32 "
                 "top-4 float32 60 against 166, 288 against 681",
    ),
)


def platform_rule(platform: str) -> PlatformRule | None:
    """The row for JAX ``platform`` (``"cpu"``, ...), or ``None`` (GPUs: the backend rules)."""
    return next((rule for rule in PLATFORM_RULES if rule.platform == platform), None)


# ----------------------------------------------------------------------------------------------
# The backend rule


@dataclasses.dataclass(frozen=True)
class AutoRule:
    """A measured win of ``backend`` for a layer's train step on one GPU kind."""

    device_kind: str
    dtype: str
    dispatch: str
    num_experts: int
    top_k: int
    backend: str
    evidence: tuple[str, ...]


_E8_LAYER_34E4F92 = (
    "h200-20261201-34e4f92-layer-mosaic-T131072.json",
    "h200-20261201-34e4f92-layer-mosaic-T32768.json",
)

_E8_LAYER_GATHER_FUSED = (
    "h200-20261201-e6271ea-layer-gf.json",
    "h200-20261202-ee91e69-layer-gf.json",
)
_E8_LAYER_SORTED = _E8_LAYER_34E4F92 + ("h200-20261202-ee91e69-layer.json",)
_E64_DECODER_24F4F42 = ("h200-20261201-24f4f42-decoder-T131072.json",)
_E64_DECODER_29D021F = ("h200-20261202-29d021f-decoder.json",)

_BACKEND_ROWS = (
    AutoRule("NVIDIA H200", "bfloat16", "sorted", 8, 2, "mosaic", _E8_LAYER_SORTED),
    AutoRule("NVIDIA H200", "bfloat16", "fused_gsum", 8, 2, "mosaic", _E8_LAYER_34E4F92),
    AutoRule("NVIDIA H200", "bfloat16", "gather", 8, 2, "mosaic", _E8_LAYER_GATHER_FUSED),
    AutoRule("NVIDIA H200", "bfloat16", "fused", 8, 2, "mosaic", _E8_LAYER_GATHER_FUSED),
    AutoRule("NVIDIA H200", "bfloat16", "sorted", 64, 8, "mosaic", _E64_DECODER_24F4F42),
    AutoRule("NVIDIA H200", "bfloat16", "fused", 64, 8, "mosaic", _E64_DECODER_29D021F),
)


def rule_for(device_kind, dtype, dispatch: str, num_experts: int, top_k: int) -> AutoRule | None:
    """The rule of a layer (dropless, default tiles) on a GPU of ``device_kind``, or ``None``."""
    for rule in BACKEND_RULES:
        if (rule.device_kind == device_kind and jnp.dtype(rule.dtype) == jnp.dtype(dtype)
                and (rule.dispatch, rule.num_experts, rule.top_k)
                == (dispatch, num_experts, top_k)):
            return rule
    return None


def matching_rule(config) -> AutoRule | None:
    """The rule for ``config`` (an ``MoEConfig``) on this device, or ``None``."""
    tiles_set = any(getattr(config, name) is not None for name in
                    ("block_m", "block_n", "block_k", "num_warps", "num_stages"))
    if config.routing != "dropless" or config.recompute or tiles_set:
        return None
    dispatch = config.dispatch
    if config.deterministic and dispatch == "fused_gsum":
        dispatch = "fused"  # its kernels: the deterministic combine is fused's (pallas.py)
    return rule_for(_pallas.gpu_device_kind(), config.dtype, dispatch,
                    config.num_experts, config.top_k)


def auto_backend(config, num_tokens: int | None = None) -> str:
    """What ``impl="auto"`` runs for ``config`` on ``num_tokens`` tokens: with
    ``config.quantize`` its quantize rule's impl; off GPUs the platform rule's plain-XLA impl
    (``"blocked"`` on a CPU); on GPUs the decode kernels (``"decode"``) where a decode rule
    holds for the batch (:func:`decode_rule_for`; ``num_tokens=None``, as under expert
    parallelism, matches none), else :func:`kernel_backend`."""
    if getattr(config, "quantize", None) is not None:
        return quantize_rule(config.quantize, _pallas.platform()).impl
    platform = platform_rule(_pallas.platform())
    if platform is not None:
        return platform.impl
    if decode_rule_for(config, num_tokens) is not None:
        return "decode"
    return kernel_backend(config)


def kernel_backend(config) -> str:
    """The Pallas backend of the training-sized kernels for ``config``: a backend rule's where
    one matches and can run here, else the default Pallas backend (Triton on GPUs, the
    interpreter on a CPU). The decode path trains on it."""
    rule = matching_rule(config)
    if rule is not None and rule.backend == "mosaic":
        if _pallas.mosaic_unavailable_reason() is None:
            return "mosaic"
    return _pallas.resolve_backend("auto")


# ----------------------------------------------------------------------------------------------
# The quantised layer


@dataclasses.dataclass(frozen=True)
class QuantizeRule:
    """What ``impl="auto"`` runs with ``MoEConfig(quantize=quantize)`` on ``platform``: the
    ``impl`` named, and ``unmeasured``: why a row with no stored run behind it is taken."""

    quantize: str
    platform: str
    impl: str
    unmeasured: str


_QUANTIZE_ROWS = (
    QuantizeRule(
        "fp8", "cpu", "blocked",
        unmeasured="the FP8 experts' kernels (impl='mosaic') run on Hopper only: a CPU runs "
                   "the XLA path (fp8.py); 'blocked' "
                   "because the platform rule measured it faster than 'ragged_dot' for the "
                   "bfloat16 layer on a CPU, not measured with quantize='fp8'",
    ),
    QuantizeRule(
        "fp8", "gpu", "ragged_dot",
        unmeasured="the Mosaic GPU FP8 kernels (impl='mosaic', tilax.moe.mosaic.gmm_fp8; "
                   "sm90) have no stored H200 run yet, so auto keeps the XLA FP8 path until "
                   "the layer suite's quantize='fp8' rows show them faster; that path runs "
                   "its products as bfloat16 ones, and for the bfloat16 layer 'ragged_dot' "
                   "was the faster "
                   "XLA impl on the H200 (E8 top-2 train step 81.75 ms against 115.83 at "
                   "131,072 tokens, h200-20261130-4cab2a4-layer-131k-e64-skew.json; 21.64 "
                   "against 29.61 at 32,768, h200-20261130-4cab2a4-layer-32k-4k.json); not "
                   "measured with quantize='fp8'",
    ),
)


# ----------------------------------------------------------------------------------------------
# The decode rule


@dataclasses.dataclass(frozen=True)
class DecodeRule:
    """Where ``impl="auto"`` runs the decode kernels (``decode.py``) on GPUs, once the row has
    stored evidence (:func:`decode_rule_for`): a call of at most
    ``max_tokens`` tokens, ``dtype`` among ``dtypes``, dropless routing, the default tiles and
    no ``recompute``, on one device (no mesh). Forward only: under differentiation the decode
    path runs the training kernels (:func:`kernel_backend`), so a train step is unchanged.

    Attributes:
        max_tokens: the largest batch the rule covers.
        dtypes: the dtypes it covers (names).
        evidence: stored result files (``data/results/``) of the ``decode`` suite: at every
            token count up to ``max_tokens``, the ``decode`` rows' forward is faster than every
            other tilax impl's of the same case, beyond the spread (tests hold each).
        unmeasured: why the row stands without evidence (such rows need an H200 run of the
            ``decode`` suite).
    """

    max_tokens: int
    dtypes: tuple[str, ...]
    evidence: tuple[str, ...] = ()
    unmeasured: str = ""


_DECODE_ROWS = (
    DecodeRule(
        512, ("bfloat16", "float16"),
        unmeasured="not yet run on a GPU: the decode kernels stream each touched expert's "
                   "weights once (one row tile per expert at these sizes), where the training "
                   "kernels' 128-row tiles are mostly padding and launch fewer weight-streaming "
                   "programs; the decode suite (tests/bench, --bench-suite decode) measures "
                   "both against the copy bandwidth in one process",
    ),
)


def quantize_rule(quantize: str, platform: str) -> QuantizeRule:
    """The row for ``quantize`` on JAX ``platform`` (a GPU platform other than ``"cpu"``
    takes the ``"gpu"`` row)."""
    platform = platform if platform == "cpu" else "gpu"
    return next(rule for rule in QUANTIZE_RULES
                if (rule.quantize, rule.platform) == (quantize, platform))


def decode_rule_for(config, num_tokens: int | None,
                    rows: tuple[DecodeRule, ...] | None = None) -> DecodeRule | None:
    """The decode rule in force for ``config`` on ``num_tokens`` tokens, or ``None``.

    Only a row with stored evidence is in force: a row still ``unmeasured`` documents the
    planned rule, and ``impl="auto"`` keeps the training kernels until the ``decode`` suite's
    run holds it (``impl="decode"`` runs the decode kernels on request). ``rows``: the rows to
    consult (default :data:`DECODE_RULES`).
    """
    if num_tokens is None:
        return None
    tiles_set = any(getattr(config, name) is not None for name in
                    ("block_m", "block_n", "block_k", "num_warps", "num_stages"))
    if config.routing != "dropless" or config.recompute or tiles_set:
        return None
    for rule in DECODE_RULES if rows is None else rows:
        if (rule.evidence and num_tokens <= rule.max_tokens
                and any(jnp.dtype(name) == jnp.dtype(config.dtype) for name in rule.dtypes)):
            return rule
    return None


# ----------------------------------------------------------------------------------------------
# The variant rules of the Mosaic GPU backend


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Evidence of a variant: the same case's stored row with the variant (``picked``, a file
    under ``data/results/``) and without it (``other``): the runs of the commits before and
    after the change, or one file of the ``variants`` suite holding both sides. ``case``
    filters the rows' ``extra_info`` (besides dropless routing, bfloat16, no skew and the
    default tiles); ``picked_options`` and ``other_options`` are the sides' :func:`choose`
    options in a ``variants`` run (its rows' ``variant``; none: the layer's picks)."""

    op: str
    case: tuple[tuple[str, Any], ...]
    picked: str
    other: str
    picked_options: tuple[tuple[str, Any], ...] = ()
    other_options: tuple[tuple[str, Any], ...] = ()

    def side_case(self, side: str) -> dict[str, Any]:
        """The ``extra_info`` filter of one side (``"picked"`` or ``"other"``)."""
        options = getattr(self, f"{side}_options")
        label = ",".join(f"{name}={option}" for name, option in options) or None
        return {**dict(self.case), "variant": label}


@dataclasses.dataclass(frozen=True)
class VariantRule:
    """One choice between kernels of the Mosaic GPU backend.

    Attributes:
        name: the choice (a keyword of :func:`choose`).
        options: what it can take; ``pick`` is the one the layer takes.
        where: where the picked kernel runs (shapes outside its limits or fits take the
            other path).
        limits: measured limits of where it runs, ``(name, value)`` pairs (:func:`limit`).
        evidence: stored before/after pairs that justify ``pick`` (tests hold each).
        unstored: the figures behind the row (or its limits) that no stored run holds: from
            the kernel's docstring, measured by diagnostic runs that were not stored.
    """

    name: str
    options: tuple[Any, ...]
    pick: Any
    where: str
    limits: tuple[tuple[str, int], ...] = ()
    evidence: tuple[Comparison, ...] = ()
    unstored: str = ""


_E64_FUSED_T131072 = (("impl", "mosaic"), ("dispatch", "fused"), ("experts", 64), ("top_k", 8),
                      ("tokens", 131072))

_VARIANT_ROWS = (
    VariantRule(
        "gmm_ws", ("short_contractions", "off"), "short_contractions",
        "the plain grouped matmul (unscaled rows) over a contraction of at most "
        "max_contraction per operand pair runs warp-specialised (mosaic/gmm_ws.py)",
        limits=(("max_contraction", 256),),
        evidence=(Comparison("train_step", _E64_FUSED_T131072,
                             picked="h200-20261203-f75d420-decoder-peers.json",
                             other="h200-20261203-9cd4196-decoder-peers.json"),),
        unstored="the limit: the E8 layer (contractions of 512 and 1024) took 6.58-6.82 ms "
                 "with it against 6.44-6.67 without (H200, 131 072 tokens, three interleaved "
                 "rounds in one process, mosaic/gmm_ws.py)",
    ),
    VariantRule(
        "gather_rows", ("few_column_tiles", "off"), "few_column_tiles",
        "an inference forward's activation kernel gathers its rows itself (mosaic/gmm_gather.py) "
        "where its output has at most max_column_tiles column tiles; elsewhere XLA gathers",
        limits=(("max_column_tiles", 2),),
        evidence=(Comparison("forward", _E64_FUSED_T131072,
                             picked="h200-20261202-29d021f-decoder.json",
                             other="h200-20261201-577db46-decoder.json"),),
        unstored="the limit: the E8 layer's 16 column tiles gathering made its forward 2.68 "
                 "ms against 1.81 with XLA's gather first (H200, 131 072 tokens, diagnostic "
                 "A/B, mosaic/gmm_gather.py)",
    ),
    VariantRule(
        "train_rows", ("copies", "gather"), "copies",
        "a train step's kernels read sorted copies of x and dy (made once, see copy_rows), "
        "not rows gathered for each kernel",
        unstored="no stored A/B: the backward reads the forward's rows again, so one copy "
                 "serves the forward and the weight gradients (mosaic/gmm.py)",
    ),
    VariantRule(
        "copy_rows", ("kernel", "xla"), "kernel",
        "the sorted copies come from the row-copy kernel (mosaic/gmm_rows.py) where blocks of "
        "at least min_block_tokens tokens divide the tokens; elsewhere from XLA's gather",
        limits=(("min_block_tokens", 8),),
        evidence=(Comparison("train_step", _E64_FUSED_T131072,
                             picked="h200-20261203-37bb3bf-decoder-peers.json",
                             other="h200-20261203-6210aad-decoder-peers.json"),),
    ),
    VariantRule(
        "router", ("kernels", "xla"), "kernels",
        "bfloat16 routing runs the softmax (or sigmoid) scores, top-k and their gradient as "
        "two kernels (mosaic/router.py) where blocks of 64 tokens divide the tokens, the expert "
        "count is a multiple of 8 and experts are chosen by their scores alone (a balance bias "
        "or expert groups route in XLA)",
        unstored="about 0.23 ms of XLA's small kernels against 0.09 ms of these two in the "
                 "E64 decoder's train step at 131 072 tokens (H200, mosaic/router.py); the "
                 "stored runs around the change (37bb3bf, 414ab32, 01e664a decoder-peers) "
                 "also changed the row layout's sort",
    ),
    VariantRule(
        "shared", ("kernels", "xla"), "kernels",
        "the shared expert's activation runs in its products' epilogues (mosaic/shared.py) where "
        "its shapes take whole tiles; elsewhere XLA's products and elementwise passes",
        unstored="no stored run shows it faster: across the change the E64 decoder's train "
                 "step at 131 072 tokens was 7.534 ms (IQR 7.499-7.558, "
                 "h200-20261204-f53ca07-decoder-peers-131k.json) before and 7.608 (IQR "
                 "7.582-7.638, h200-20261205-eae54e0-decoder-peers-131k.json) after; an "
                 "H200 A/B in one process decides",
    ),
    VariantRule(
        "joined_dx", ("off", "on", "overlap"), "off",
        "dx and the gate/up weight gradients in one kernel (mosaic/gmm_dx.py) where its "
        "shapes fit; 'overlap' runs its dx epilogue while the weight-gradient MMAs run",
        unstored="not yet run on a GPU: off until an H200 A/B in one process against "
                 "gmm_ws + tgmm finds it faster",
    ),
    VariantRule(
        "programs_per_sm", (2, 1), 2,
        "the persistent grouped-matmul kernels run two programs per SM, so that one's "
        "pipeline prologue and epilogue overlap the other's MMAs",
        unstored="the default tiles (mosaic/common.py default_config) are not measured yet",
    ),
)

#: The one table: every kernel choice of the layer, backend rows first.
RULES: tuple[PlatformRule | AutoRule | QuantizeRule | DecodeRule | VariantRule, ...] = (
    *_PLATFORM_ROWS, *_BACKEND_ROWS, *_QUANTIZE_ROWS, *_DECODE_ROWS, *_VARIANT_ROWS)
PLATFORM_RULES = tuple(rule for rule in RULES if isinstance(rule, PlatformRule))
BACKEND_RULES = tuple(rule for rule in RULES if isinstance(rule, AutoRule))
QUANTIZE_RULES = tuple(rule for rule in RULES if isinstance(rule, QuantizeRule))
DECODE_RULES = tuple(rule for rule in RULES if isinstance(rule, DecodeRule))
VARIANT_RULES = tuple(rule for rule in RULES if isinstance(rule, VariantRule))
RULES_BY_NAME = {rule.name: rule for rule in VARIANT_RULES}

# The options chosen by ``choose`` (name -> option); empty: every row's pick.
_CHOSEN: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "tilax_moe_variants", default={}  # noqa: B039 (never mutated: choose copies it)
)


@contextlib.contextmanager
def choose(**options: Any) -> Iterator[None]:
    """Within the block, take these options of the variant rules instead of their picks
    (keywords: the rule names of ``VARIANT_RULES``, values among its ``options``). For tests
    and A/B runs: the layer's own choice is each row's ``pick``.

    Raises:
        ValueError: an unknown rule name or an option the rule does not have.
    """
    for name, option in options.items():
        if name not in RULES_BY_NAME:
            raise ValueError(f"unknown variant rule {name!r}; rules: {sorted(RULES_BY_NAME)}")
        if option not in RULES_BY_NAME[name].options:
            raise ValueError(f"variant rule {name!r} takes one of "
                             f"{RULES_BY_NAME[name].options}, got {option!r}")
    token = _CHOSEN.set({**_CHOSEN.get(), **options})
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def chosen() -> tuple:
    """The options :func:`choose` sets around the caller, as a hashable key: a function jitted
    inside tilax takes it as a static argument, so that each choice gets its own trace."""
    return tuple(sorted(_CHOSEN.get().items()))


def variant(name: str) -> Any:
    """The option of variant rule ``name`` in force: its ``pick``, or what :func:`choose`
    selected around the trace."""
    return _CHOSEN.get().get(name, RULES_BY_NAME[name].pick)


def limit(name: str, key: str) -> int:
    """The measured limit ``key`` of variant rule ``name``."""
    return dict(RULES_BY_NAME[name].limits)[key]
