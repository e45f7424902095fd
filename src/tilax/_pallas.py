"""Shared Pallas helpers: backend detection, device facts, padding to tiles, dtype policy.

Every op family calls these instead of asking JAX about the device itself, so that the
choice "interpret on CPU, Triton on any GPU, Mosaic GPU on sm90+" is made in one place, and
the device facts the kernels size themselves by (shared memory per block and per SM, SM
count, compute capability) are written here and nowhere else. :func:`assume_device` states
those facts for a device that is not here: tests on a CPU, or lowering with ``jax.export``
for a GPU of another size.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp

Backend = Literal["interpret", "triton", "mosaic"]


# Device facts stated by ``assume_device`` (name -> value); empty: the device's own.
_ASSUMED: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "tilax_assumed_device", default={}  # noqa: B039 (never mutated: assume_device copies it)
)
_FACTS = ("platform", "device_kind", "compute_capability", "sm_count", "mosaic_import_error",
          "mosaic_unavailable_reason")


@contextlib.contextmanager
def assume_device(**facts: Any) -> Iterator[None]:
    """Within the block, answer as if the device had these facts (the others stay its own).

    ``platform`` (``"cpu"``/``"gpu"``), ``device_kind`` (e.g. ``"NVIDIA H200"``),
    ``compute_capability`` (e.g. ``(9, 0)``), ``sm_count`` (persistent kernels launch per SM),
    ``mosaic_import_error`` (``None``: Mosaic GPU imports) and
    ``mosaic_unavailable_reason`` (``None``: the Mosaic GPU backend can run). The tests run
    the Mosaic GPU kernels in JAX's GPU interpreter on a CPU with
    ``mosaic_unavailable_reason=None`` and ``sm_count=2`` (the interpreter runs every
    program). The facts are read when a function is traced: a function already jitted
    outside the block keeps what it saw.

    Examples:
        >>> from tilax import _pallas
        >>> with _pallas.assume_device(platform="gpu", device_kind="NVIDIA H200"):
        ...     _pallas.gpu_device_kind()
        'NVIDIA H200'
    """
    unknown = set(facts) - set(_FACTS)
    if unknown:
        raise TypeError(f"assume_device takes {_FACTS}, got {sorted(unknown)}")
    token = _ASSUMED.set({**_ASSUMED.get(), **facts})
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def platform() -> str:
    """The default JAX platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``."""
    return _ASSUMED.get().get("platform") or jax.default_backend()


def interpreted() -> bool:
    """Whether Pallas kernels traced now run in JAX's GPU interpret mode (on a CPU): its context
    manager (``jax._src.pallas.mosaic_gpu.interpret.params.force_gpu_interpret_mode``, which
    the tests use) sets this config. Kernels that inline Mosaic GPU code, which the
    interpreter cannot run, compute the same values with JAX operations there."""
    from jax._src import config

    state = getattr(config, "pallas_tpu_interpret_mode_context_manager", None)
    return state is not None and state.value is not None


def trace_facts() -> tuple:
    """What a trace reads of the device besides JAX's own cache key: the facts of
    :func:`assume_device` and whether kernels run in the interpreter. A function jitted inside
    tilax takes it as a static argument, so each setting gets its own trace."""
    return tuple(sorted(_ASSUMED.get().items())), interpreted()


def gpu_compute_capability() -> tuple[int, int] | None:
    """Compute capability of the first CUDA device, or ``None`` off CUDA GPUs."""
    assumed = _ASSUMED.get()
    if "compute_capability" in assumed:
        return assumed["compute_capability"]
    return _reported_compute_capability() if platform() == "gpu" else None


@functools.cache
def _reported_compute_capability() -> tuple[int, int] | None:
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if not capability:
        return None
    major, _, minor = str(capability).partition(".")
    return int(major), int(minor or 0)


def gpu_device_kind() -> str | None:
    """``device_kind`` of the first GPU (e.g. ``"NVIDIA H200"``), or ``None`` off GPUs."""
    assumed = _ASSUMED.get()
    if "device_kind" in assumed:
        return assumed["device_kind"]
    return jax.devices()[0].device_kind if platform() == "gpu" else None


def gpu_core_count() -> int | None:
    """Streaming multiprocessors of the first CUDA device (persistent kernels launch one
    program per SM), or ``None`` off CUDA GPUs."""
    assumed = _ASSUMED.get()
    if "sm_count" in assumed:
        return assumed["sm_count"]
    return _reported_core_count() if platform() == "gpu" else None


@functools.cache
def _reported_core_count() -> int | None:
    return getattr(jax.devices()[0], "core_count", None) or None


#: SMs of an H100/H200 SXM: the count where JAX does not say (lowering without a GPU).
DEFAULT_SM_COUNT = 132


def sm_count() -> int:
    """This GPU's SMs, ``DEFAULT_SM_COUNT`` where JAX does not say (off GPUs)."""
    return gpu_core_count() or DEFAULT_SM_COUNT


#: Per-block shared memory (bytes, the opt-in maximum) by compute capability, for devices that
#: do not report ``shared_memory_per_block_optin`` (CUDA's tables; sm90: 227 KiB).
SHARED_MEMORY_PER_BLOCK_BY_CAPABILITY = {
    (7, 0): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912,
    (8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (12, 0): 101376,
}  # fmt: skip
#: Shared memory the system keeps per block: an SM's shared memory is the per-block opt-in
#: maximum plus this (sm90: 228 KiB = 227 KiB + 1 KiB).
RESERVED_SHARED_MEMORY_PER_BLOCK = 1024


def shared_memory_per_block(capability: tuple[int, int] | None = None) -> int:
    """The most shared memory one block may have (bytes, the opt-in maximum): of a GPU of
    compute ``capability``; without one, of the first GPU as it reports it, else by its
    capability. Capabilities between the known ones of ``SHARED_MEMORY_PER_BLOCK_BY_CAPABILITY``
    take the nearest lower one's; where none is known (no GPU: launches planned on a CPU), the
    sm90 value (H100, H200)."""
    if capability is None:
        reported = _reported_shared_memory() if platform() == "gpu" else None
        if reported:
            return reported
        capability = gpu_compute_capability()
    table = SHARED_MEMORY_PER_BLOCK_BY_CAPABILITY
    known = [cc for cc in table if capability and cc <= capability]
    return table[max(known)] if known else table[(9, 0)]


@functools.cache
def _reported_shared_memory() -> int | None:
    return int(getattr(jax.devices()[0], "shared_memory_per_block_optin", 0) or 0) or None


def shared_memory_per_sm() -> int:
    """Shared memory of one SM (bytes): what blocks sharing it divide between them."""
    return shared_memory_per_block() + RESERVED_SHARED_MEMORY_PER_BLOCK


def is_hopper_or_newer() -> bool:
    """True on sm90+ (H100, H200, ...): the devices where Mosaic GPU kernels run."""
    capability = gpu_compute_capability()
    return capability is not None and capability >= (9, 0)


def mosaic_import_error() -> str | None:
    """Why ``jax.experimental.pallas.mosaic_gpu`` does not import here, or ``None``."""
    assumed = _ASSUMED.get()
    if "mosaic_import_error" in assumed:
        return assumed["mosaic_import_error"]
    return _mosaic_import_error()


@functools.cache
def _mosaic_import_error() -> str | None:
    try:
        import jax.experimental.pallas.mosaic_gpu  # noqa: F401
    except ImportError as err:  # jax 0.10's Mosaic GPU imports absl-py, not a jax dependency
        return f"jax.experimental.pallas.mosaic_gpu does not import: {err}"
    return None


def mosaic_unavailable_reason() -> str | None:
    """Why the Mosaic GPU backend cannot run here, or ``None`` when it can."""
    assumed = _ASSUMED.get()
    if "mosaic_unavailable_reason" in assumed:
        return assumed["mosaic_unavailable_reason"]
    if platform() != "gpu":
        return f"Mosaic GPU kernels need an NVIDIA GPU; the default JAX platform is {platform()!r}"
    capability = gpu_compute_capability()
    if capability is None or capability < (9, 0):
        return (
            f"Mosaic GPU kernels need compute capability 9.0+ (Hopper); this GPU has {capability}"
        )
    return mosaic_import_error()


def resolve_backend(requested: str) -> Backend:
    """Map a user-facing kernel choice to the Pallas backend that will run it.

    ``"auto"``/``"pallas"`` pick Triton on GPUs and interpret mode on CPU (the MoE layer's
    ``impl="auto"`` consults its measured table first, ``tilax.moe.rules``, and runs plain XLA
    on a CPU).
    ``"triton"`` runs the Triton kernel, interpreted on CPU (the same kernel code, so CPU tests
    cover it). ``"mosaic"`` needs Hopper and raises ``ValueError`` with the reason elsewhere.
    """
    if requested == "mosaic":
        reason = mosaic_unavailable_reason()
        if reason is not None:
            raise ValueError(f"impl='mosaic' cannot run on this device: {reason}")
        return "mosaic"
    if requested in ("auto", "pallas", "triton"):
        return "triton" if platform() == "gpu" else "interpret"
    raise ValueError(f"unknown Pallas backend request {requested!r}")


def pallas_call(
    kernel: Callable[..., None],
    *,
    backend: Backend,
    num_warps: int | None = None,
    num_stages: int | None = None,
    **kwargs: Any,
) -> Callable[..., Any]:
    """``pl.pallas_call`` for the Triton backend, or interpret mode on CPU (the Mosaic GPU
    kernels launch through ``plgpu.kernel`` themselves).

    Passing Triton compiler params explicitly selects the Triton lowering on GPUs even where
    JAX's default Pallas GPU backend is Mosaic GPU. Pallas is imported here, when a kernel is
    built, not with ``tilax``: it loads JAX's Mosaic GPU bindings, which a CPU never uses.
    """
    from jax.experimental import pallas as pl

    if backend == "interpret":
        return pl.pallas_call(kernel, interpret=True, **kwargs)
    if backend == "triton":
        from jax.experimental.pallas import triton as pltriton

        params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
        return pl.pallas_call(kernel, compiler_params=params, **kwargs)
    raise ValueError(f"pallas_call helper serves interpret/triton, not {backend!r}")


def transposed_ref(ref):
    """A 2-D Mosaic GPU ref read as its transpose: ``ref.transpose`` from jax 0.11 (where
    ``plgpu.transpose_ref`` is deprecated), ``plgpu.transpose_ref`` before."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.transpose_ref(ref, (1, 0))


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, multiple: int, value: float = 0.0) -> jax.Array:
    """Pad ``x`` along ``axis`` at the end up to a multiple of ``multiple``."""
    size = x.shape[axis]
    extra = round_up(max(size, 1), multiple) - size
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def next_power_of_2(value: int) -> int:
    """Smallest power of two >= ``value`` (and >= 1)."""
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()


#: The smallest tile of the grouped-matmul kernels (rows, columns or contraction), any backend.
MIN_BLOCK = 16


def fit_block(block: int, dim: int) -> int:
    """The largest power of two <= ``block`` that divides ``dim`` (at least ``MIN_BLOCK``)."""
    fitted = min(block, next_power_of_2(dim))
    while dim % fitted:
        fitted //= 2
    if fitted < MIN_BLOCK:
        raise ValueError(f"dimension {dim} needs a multiple of {MIN_BLOCK} for the kernels")
    return fitted


# dtype policy: kernels accept these and accumulate in float32.
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_float_array(name: str, x: Any) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``x`` is a real floating-point array."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a real floating-point array, got dtype {dtype}")


def kernel_dtype(*dtypes: Any) -> jnp.dtype:
    """The dtype a kernel computes its inputs in: their common float type, float64 -> float32.

    float64 exists only with ``jax_enable_x64``; Pallas GPU dots have no float64 path, so the
    kernels run it in float32 (the XLA references keep float64).
    """
    dtype = jnp.result_type(*dtypes)
    if dtype == jnp.float64:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(dtype)


ACCUM_DTYPE = jnp.float32


def dot_precision(precision: str | None) -> jax.lax.Precision | None:
    """Map ``precision`` names ("highest", "high", "default", None) to ``lax.Precision``."""
    if precision is None:
        return None
    names = {
        "highest": jax.lax.Precision.HIGHEST,
        "high": jax.lax.Precision.HIGH,
        "default": jax.lax.Precision.DEFAULT,
    }
    if precision not in names:
        raise ValueError(
            f"precision must be one of {sorted(names)} or None, got {precision!r}"
        )
    return names[precision]
