"""Launch settings of the RBF Pallas kernels: dot modes, tiles, and the shared-memory budget.

``default_config`` picks, per problem and device, the dot modes of a precision and the tiles of
every kernel launch, for both distance paths (``tilax.rbf.numerics``): the fast expansion and
the exact differences. Tiles start from preferred launches (the best of the H200 sweeps for the
fast path) and shrink until the launch's shared-memory estimate (:func:`shared_memory_bytes`)
fits the device's per-block limit with a margin.

Shared-memory model (Triton 3.x). A launch holds, per block:

* ``num_stages`` copies of every tile it loads per loop step, as stored (software pipelining);
* one copy of every tile it loads once per program and multiplies on tensor cores, as stored
  (the program's augmented points, the value tile ``u`` of the gradient kernels);
* the largest register tile it converts into a dot operand (kernel values or gradient weights
  ``[block_p, block_l]``, split parts of loaded tiles), in the operand type, times its parts;
* scratch for row reductions (exact gradients, log-sum-exp), and, after the loop, the output
  tile's layout conversion (the larger of the two phases counts).

It is meant as an upper bound. The one overflow measured on an H200 (Triton 3.6,
``precision="high"``, D = 20, O = 100: gradient kernel of 64 x 128 tiles, 3 stages) requested
237568 bytes, exactly 3 stages of the 128 x 128 float32 cotangent tile plus the value and point
tiles; the model counts 319488 there (the loop's point tile and a conversion buffer too), and
204800 for the same launch at ``"default"`` precision (bfloat16 cotangents), which ran.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from tilax import _pallas
from tilax.rbf.mosaic import exact as mosaic_exact
from tilax.rbf.mosaic import exact_grad as mosaic_exact_grad
from tilax.rbf.mosaic import forward as mosaic_forward
from tilax.rbf.mosaic import grad as mosaic_grad
from tilax.rbf.numerics import Difference, Distance, Expansion, difference_dims

PRECISIONS = ("highest", "high", "default")


@dataclasses.dataclass(frozen=True)
class DotModes:
    """How a path's kernels multiply (mode names as in ``numerics.DOT_MODES``).

    ``distance``: ``"difference"`` (exact, FMA units) or the dot mode of the augmented-point
    expansion (``"tf32x3"``; the forward kernels may read it as TF32 parts). ``values``: products
    with the values and cotangents (``K @ v``, ``g @ v.T``, ``K.T @ g``). ``coords``: products
    with coordinates in the expansion's gradients (``A @ ks``), differenced with ``qs * rowsum``.
    """

    distance: str
    values: str
    coords: str


#: precision name -> dot modes of its fast (expansion) path; ``precision=None`` is ``"default"``.
#: The expansion is never a single low-precision pass: its exponent error would grow like
#: eps * |qs|^2. Coordinates are never single bfloat16 either: ``sum_j A_ij ks_j - qs_i
#: sum_j A_ij`` cancels, so their rounding would be amplified. The default rounds the pair
#: weights ``A`` to bfloat16 (``"bf16x2"``): they come from bfloat16 values and cotangents
#: already, and the row sum comes from the same product. ``"highest"`` has no fast path.
FAST_MODES = {
    "high": DotModes(distance="tf32x3", values="bf16x3", coords="bf16x3"),
    "default": DotModes(distance="tf32x3", values="bf16", coords="bf16x2"),
}
#: precision name -> dot modes of its exact (difference) path: ``"highest"`` always, the others
#: where the expansion's error bound exceeds their budget. Values keep the precision's mode;
#: ``"highest"`` multiplies them in three TF32 passes (float32-accurate, on tensor cores).
EXACT_MODES = {
    "highest": DotModes(distance="difference", values="tf32x3", coords="ieee"),
    "high": DotModes(distance="difference", values="bf16x3", coords="ieee"),
    "default": DotModes(distance="difference", values="bf16", coords="ieee"),
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel's tiles and Triton launch settings.

    ``block_p``: rows of the point set one program owns (its grid axis); ``block_l``: rows of
    the other point set per step of the in-kernel loop; ``block_o``: value columns per program
    (forward) or per dot (gradients). ``backend``: ``"mosaic"`` where ``rbf_kernel_mv``'s fast
    forward runs ``tilax.rbf.mosaic.forward`` (Hopper; ``num_stages`` is then its key/value
    tiles in flight, ``num_warps`` unused) or its exact forward ``tilax.rbf.mosaic.exact``
    (``"highest"``), else ``None``: the path's backend (the KDE's forward, which has no Mosaic
    GPU kernel, always runs Triton with these tiles). On the
    ``dq`` and ``dk`` launches of the fast path, ``"mosaic"`` runs ``rbf_kernel_mv``'s
    backward as one sweep on ``tilax.rbf.mosaic.grad`` with the ``dk`` launch's tiles
    (program tile 128; set both; the KDE, which has no Mosaic GPU sweep, is never given such
    launches); on those of the exact
    path, ``"mosaic"`` runs the backward as one sweep on ``tilax.rbf.mosaic.exact_grad``
    with the ``dk`` launch's tiles (``"highest"``; program tile 128, loop tile 64; set both).
    """

    block_p: int
    block_l: int
    block_o: int = 16
    num_warps: int = 4
    num_stages: int = 2
    backend: str | None = None


@dataclasses.dataclass(frozen=True)
class PathConfig:
    """The launches of one distance path: ``fwd`` (programs over query tiles, loop over keys;
    the KDE's log-sum-exp too), ``dq`` (the same roles) and ``dk`` (programs over *key* tiles,
    loop over queries; also dv), with the backend, the dot modes and the width ``cols`` the
    value and cotangent columns are padded to (a multiple of every launch's ``block_o``)."""

    backend: _pallas.Backend
    modes: DotModes
    cols: int
    fwd: Launch
    dq: Launch
    dk: Launch

    def query_rows(self, n: int, *, backward: bool) -> int:
        """``n`` padded to every query tile of the pass."""
        if not backward:
            return _pallas.round_up(n, self.fwd.block_p)
        return _pallas.round_up(n, max(self.dq.block_p, self.dk.block_l))

    def key_rows(self, m: int, *, backward: bool) -> int:
        """``m`` padded to every key tile of the pass."""
        if not backward:
            return _pallas.round_up(m, self.fwd.block_l)
        return _pallas.round_up(m, max(self.dq.block_l, self.dk.block_p))


@dataclasses.dataclass(frozen=True)
class PallasConfig:
    """Static settings of the Pallas path: the precision and its two distance paths.

    ``fast`` is ``None`` for ``"highest"`` (always exact); otherwise the kernels switch between
    the two paths at run time (``tilax.rbf.numerics.fast_distance_ok``).
    """

    precision: str
    fast: PathConfig | None
    exact: PathConfig


#: Preferred GPU launches on large problems: the fastest of a sweep on the H200 (N = M = 65536,
#: D = 8, O = 16, program tile 64/128/256 x loop tile 32/64/128 x 4/8 warps x 2/3 stages, each
#: path's forward and backward apart; the ``kernel_mv_launches`` bench suite stores that sweep).
#: The exact path's difference kernels hold D coordinates per program row in registers: larger
#: tiles spill, and 64 x 32 was fastest (32-row tiles were slower). The sweep ran at the default
#: precision; at ``"high"`` (bfloat16 x 3 value products) the fast kernels' 128-row launches spill
#: (sm_90 offline compile: 152 bytes a thread forward, 408 in the key gradient).
GPU_PREFERRED = {
    ("fast", "fwd"): Launch(128, 128, 64, num_warps=4, num_stages=3),
    ("fast", "bwd"): Launch(128, 64, 64, num_warps=4, num_stages=3),
    ("exact", "fwd"): Launch(64, 32, 64, num_warps=4, num_stages=2),
    ("exact", "bwd"): Launch(64, 32, 64, num_warps=4, num_stages=2),
    # The exact key-gradient sweep (dk and dv) alone: with loop tiles of 32 it spilled
    # registers (ncu), with 16 rbf_kernel_mv's "highest" fwd_bwd took 50.7 ms against 58.3 ms
    # (H200, N = M = 65536, D = 8, O = 16, diagnostic script; the query sweep at 16 was slower).
    ("exact", "dk"): Launch(64, 16, 64, num_warps=4, num_stages=2),
}
#: Per-block shared memory (bytes, opt-in maximum) by compute capability, where the device does
#: not report ``shared_memory_per_block_optin``.
SHARED_MEMORY_BY_CAPABILITY = {
    (7, 0): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 7): 166912,
    (8, 9): 101376, (9, 0): 232448, (10, 0): 232448, (12, 0): 101376,
}  # fmt: skip
#: Fraction of the limit a launch's estimate may use (the model is an estimate).
SHARED_MEMORY_MARGIN = 0.9


# ------------------------------------------------------------------------------------------
# Device limit


@functools.cache
def _gpu_sm_count() -> int:
    """Streaming multiprocessors of the first GPU (132 on an H100/H200 SXM when unknown)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


@functools.cache
def shared_memory_limit() -> int:
    """Per-block shared memory of the first GPU in bytes (the opt-in maximum).

    From the device where JAX exposes it, else ``SHARED_MEMORY_BY_CAPABILITY`` (nearest lower
    compute capability), else the sm90 value.
    """
    reported = getattr(jax.devices()[0], "shared_memory_per_block_optin", None)
    if reported:
        return int(reported)
    capability = _pallas.gpu_compute_capability()
    known = [cc for cc in SHARED_MEMORY_BY_CAPABILITY if capability and cc <= capability]
    return SHARED_MEMORY_BY_CAPABILITY[max(known)] if known else SHARED_MEMORY_BY_CAPABILITY[(9, 0)]


# ------------------------------------------------------------------------------------------
# Kernel launches and their shared memory


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """What one launch computes, as far as its shared memory is concerned.

    ``kind``: ``"matmul"`` (forward / dv), ``"grad"`` or ``"logsumexp"``; ``distance``: the
    kernel's ``numerics.Distance``; ``width``: columns of the augmented points (expansion);
    ``cols``: value columns of a gradient kernel (all loaded each step; a ``matmul`` program
    reads its launch's ``block_o``);
    ``values``/``coords``: dot modes; ``value_coefficient``: a gradient kernel multiplies
    ``u . w`` (else a per-row coefficient); ``with_pw``: it also sums ``K @ w``.
    """

    kind: str
    distance: Distance
    width: int = 0
    cols: int = 0
    values: str = "ieee"
    coords: str = "ieee"
    value_coefficient: bool = True
    with_pw: bool = False


def _operand_bytes(mode: str) -> tuple[int, int]:
    """(bytes per element, parts) of a register tile converted to a ``mode`` dot operand."""
    return {"bf16": (2, 1), "bf16x3": (2, 2), "bf16x2": (2, 2), "tf32x3": (4, 2),
            "tf32_parts": (4, 1), "ieee": (4, 1)}[mode]  # fmt: skip


def _stored_bytes(mode: str) -> int:
    """Bytes per element of values stored for a ``mode`` dot (bfloat16 for single bfloat16)."""
    return 2 if mode == "bf16" else 4


def shared_memory_bytes(call: KernelCall, launch: Launch) -> int:
    """Estimated shared memory of ``call`` launched with ``launch`` (module docstring model)."""
    bp, bl, stages = launch.block_p, launch.block_l, launch.num_stages
    v_bytes, v_parts = _operand_bytes(call.values)
    stored = _stored_bytes(call.values)
    converted = []  # register tiles that become dot operands (one at a time)
    if isinstance(call.distance, Expansion):
        d_bytes, d_parts = _operand_bytes(call.distance.mode)
        once = bp * call.width * 4  # the program's points, a dot operand
        per_step = bl * call.width * 4
        if d_parts > 1:  # split in registers: both parts of both operands
            converted += [bp * call.width * d_bytes * d_parts, bl * call.width * d_bytes * d_parts]
    else:
        once = 0  # the program's coordinates are vectors in registers
        per_step = call.distance.dim * bl * 4
    reduce = bp * launch.num_warps * 4
    if call.kind == "matmul":
        per_step += bl * launch.block_o * stored
        converted += [bp * bl * v_bytes * v_parts, bl * launch.block_o * v_bytes * v_parts]
        epilogue = bp * launch.block_o * 4
    elif call.kind == "logsumexp":
        converted.append(2 * reduce)
        epilogue = 2 * bp * 4
    else:
        if call.value_coefficient:
            per_step += bl * call.cols * stored
            once += bp * call.cols * stored  # u: hoisted, or re-read and kept
            # u and w are split and multiplied one block_o chunk at a time.
            chunk = min(call.cols, launch.block_o)
            converted += [bp * chunk * v_bytes * v_parts, bl * chunk * v_bytes * v_parts]
            if call.with_pw:
                converted.append(bp * bl * v_bytes * v_parts)
        if isinstance(call.distance, Expansion):
            c_bytes, c_parts = _operand_bytes(call.coords)
            converted += [bp * bl * c_bytes * c_parts, bl * call.width * c_bytes * c_parts]
            out_width = call.width
        else:
            converted.append(reduce)
            out_width = call.distance.dim + 1
        epilogue = bp * out_width * 4 + (bp * call.cols * 4 if call.with_pw else 0)
    return max(stages * per_step + once + max(converted), epilogue)


def fit_launch(call: KernelCall, launch: Launch, limit: int) -> Launch:
    """``launch`` shrunk until ``shared_memory_bytes`` is within ``SHARED_MEMORY_MARGIN * limit``:
    fewer pipeline stages first, then smaller loop tiles, value tiles and program tiles (each
    down to 16 rows). The smallest launch is accepted within the limit itself (no margin);
    beyond it, ``ValueError``."""
    while shared_memory_bytes(call, launch) > SHARED_MEMORY_MARGIN * limit:
        if launch.num_stages > 1:
            launch = dataclasses.replace(launch, num_stages=launch.num_stages - 1)
        elif launch.block_l > 16:
            launch = dataclasses.replace(launch, block_l=launch.block_l // 2)
        elif call.kind == "matmul" and launch.block_o > 16:
            launch = dataclasses.replace(launch, block_o=launch.block_o // 2)
        elif launch.block_p > 16:
            launch = dataclasses.replace(launch, block_p=launch.block_p // 2)
        elif shared_memory_bytes(call, launch) <= limit:
            return launch
        else:
            raise ValueError(
                f"no RBF kernel tiles fit {limit} bytes of shared memory for {call} "
                f"(smallest launch needs {shared_memory_bytes(call, launch)})"
            )
    return launch


# ------------------------------------------------------------------------------------------
# Operand widths (the layout module pads to these)


def expansion_width(dim: int) -> int:
    """Columns of the augmented points split in registers: ``max(16, next_pow2(D + 2))``."""
    return max(16, _pallas.next_power_of_2(dim + 2))


def parts_width(dim: int) -> int:
    """Columns of the augmented points laid out as TF32 parts: ``max(16, next_pow2(3 (D + 2)))``."""
    return max(16, _pallas.next_power_of_2(3 * (dim + 2)))


def forward_distance(
    modes: DotModes, dim: int, per_dimension: bool = True, rounded: bool = False
) -> Distance:
    """The forward kernels' distance: exact, or the expansion read as TF32 parts from memory
    where the one parts dot is no wider than the three split dots (small ``D``).
    ``per_dimension``, ``rounded``: as in ``numerics.Difference`` (exact path)."""
    if modes.distance == "difference":
        return Difference(difference_dims(dim), per_dimension, rounded)
    if modes.distance == "tf32x3" and parts_width(dim) <= 3 * expansion_width(dim):
        return Expansion("tf32_parts")
    return Expansion(modes.distance)


def backward_distance(
    modes: DotModes, dim: int, per_dimension: bool = True, rounded: bool = False
) -> Distance:
    """The backward kernels' distance (the expansion split in registers: less memory)."""
    if modes.distance == "difference":
        return Difference(difference_dims(dim), per_dimension, rounded)
    return Expansion(modes.distance)


def distance_width(distance: Distance, dim: int) -> int:
    if isinstance(distance, Difference):
        return 0
    return parts_width(dim) if distance.mode == "tf32_parts" else expansion_width(dim)


def path_calls(modes: DotModes, dim: int, cols: int) -> dict[str, list[KernelCall]]:
    """Every kernel call each launch of a path serves (``rbf_kernel_mv`` and the KDE), for the
    shared-memory fit. ``cols``: the padded value columns (the gradient kernels read them all;
    a forward program reads ``block_o`` of them)."""
    fwd, bwd = forward_distance(modes, dim), backward_distance(modes, dim)
    fwd_width, bwd_width = distance_width(fwd, dim), distance_width(bwd, dim)
    grad = dict(distance=bwd, width=bwd_width, values=modes.values, coords=modes.coords)
    kde_grad = dict(distance=bwd, width=bwd_width, cols=0, coords=kde_coords(modes),
                    value_coefficient=False)  # fmt: skip
    return {
        "fwd": [
            KernelCall("matmul", fwd, fwd_width, values=modes.values),
            KernelCall("logsumexp", fwd, fwd_width),
        ],
        "dq": [KernelCall("grad", cols=cols, **grad), KernelCall("grad", **kde_grad)],
        "dk": [
            KernelCall("grad", cols=cols, with_pw=fuses_dv(modes, dim, cols), **grad),
            KernelCall("matmul", bwd, bwd_width, values=modes.values),
            KernelCall("grad", **kde_grad),
        ],
    }


def kde_coords(modes: DotModes) -> str:
    """The KDE gradients' coordinates mode: ``"bf16x3"`` where ``rbf_kernel_mv``'s is
    ``"bf16x2"``. The KDE's pair weights come from float32 weights (no bfloat16 value product
    rounds them), and its weights' gradient is their row sum itself."""
    return "bf16x3" if modes.coords == "bf16x2" else modes.coords


def fuses_dv(modes: DotModes, dim: int, cols: int) -> bool:
    """Whether the key-gradient kernel also sums dv = K.T @ g: while its accumulator fits in
    registers (at most 64 padded value columns) and the kernel is one program per key tile
    (the exact path splits more than ``DIM_CHUNK`` dimensions over programs)."""
    return cols <= 64 and (modes.distance != "difference" or difference_dims(dim) <= 16)


def _fit_all(calls: list[KernelCall], launch: Launch, limit: int) -> Launch:
    for call in calls:
        launch = fit_launch(call, launch, limit)
    return launch


# ------------------------------------------------------------------------------------------
# Default tiles


def _fit_tile(preferred: int, size: int) -> int:
    """``preferred`` shrunk to the problem: never more than ``next_power_of_2(size)``, >= 16."""
    return max(16, min(preferred, _pallas.next_power_of_2(size)))


def _occupancy_tile(preferred: int, size: int, other_programs: int, smallest: int) -> int:
    """Largest tile <= ``preferred`` (down to ``smallest``) giving >= 2 programs per GPU SM."""
    tile = _fit_tile(preferred, size)
    target = 2 * _gpu_sm_count()
    while tile > smallest and other_programs * (-(-size // tile)) < target:
        tile //= 2
    return tile


def _path_config(
    modes: DotModes, backend, path: str, *, op, batch, n, m, out, dim, block_q, block_k, block_o,
    limit,
) -> PathConfig:  # fmt: skip
    value_tile = block_o or _fit_tile(64, out)
    cols = _pallas.round_up(out, value_tile)
    if backend == "interpret":
        # Fewer, larger tiles interpret faster; no shared memory to fit.
        q_tile = block_q or _fit_tile(128, n)
        k_tile = block_k or _fit_tile(128, m)
        fwd = dq = Launch(q_tile, k_tile, value_tile)
        dk = Launch(k_tile, q_tile, value_tile)
        return PathConfig(backend, modes, cols, fwd, dq, dk)
    config = _gpu_path_config(modes, backend, path, batch, n, m, cols, value_tile, dim, block_q,
                              block_k, limit)  # fmt: skip
    # Not cached with the launches: whether Mosaic GPU runs is the device's (tests stand in).
    if path == "fast" and mosaic_forward.runs(config.fwd, forward_distance(modes, dim),
                                             modes.values, parts_width(dim)):
        config = dataclasses.replace(config, fwd=dataclasses.replace(config.fwd, backend="mosaic"))
    if path == "fast" and op == "kernel_mv":
        config = _mosaic_gradients(config, dim, block_q, block_k)
    if path == "exact" and op == "kernel_mv" and block_q is None and block_k is None:
        config = _mosaic_exact(config, batch, n, m, dim)
    return config


def _mosaic_exact(config: PathConfig, batch: int, n: int, m: int, dim: int) -> PathConfig:
    """``config`` with ``rbf_kernel_mv``'s exact forward on ``tilax.rbf.mosaic.exact``
    and its backward on ``tilax.rbf.mosaic.exact_grad`` (one sweep), each where it runs
    (``runs``: Hopper, ``"highest"``'s float32 values, at most ``MAX_DIMS`` dimensions, value
    columns the sweeps take) and its 128-row program tiles still give two programs per SM (the
    rule of the Triton launches), with its own tiles; explicit tiles keep the Triton kernels. On
    the H200 at N = M = 65536, D = 8, O = 16 the forward took 7.56 ms on it against 11.0 ms on
    the Triton difference kernel, and forward + backward 35.1 ms against 50.7 ms with the Triton
    sweeps when the Mosaic GPU backward was two sweeps (the ``kernel_mv`` and
    ``kernel_mv_launches`` bench suites' ``"highest"`` rows; see
    docs/performance/rbf-kernels.md)."""
    distance = Difference(difference_dims(dim), per_dimension=True)

    def fits(launch, size, programs):
        return _occupancy_tile(launch.block_p, size, programs, 32) == launch.block_p

    fwd = dataclasses.replace(config.fwd, block_p=mosaic_exact.BLOCK_P,
                              block_l=mosaic_exact.BLOCK_L, backend="mosaic")
    if (mosaic_exact.runs(fwd, distance, config.modes.values)
            and fits(fwd, n, batch * (config.cols // fwd.block_o))):
        config = dataclasses.replace(config, fwd=fwd)
    sweep = dict(block_p=mosaic_exact_grad.BLOCK_P, block_l=mosaic_exact_grad.BLOCK_L,
                 backend="mosaic")
    dq, dk = (dataclasses.replace(launch, **sweep) for launch in (config.dq, config.dk))
    if all(mosaic_exact_grad.runs(launch, distance, config.modes.values, config.cols)
           and fits(launch, size, batch) for launch, size in ((dq, n), (dk, m))):
        config = dataclasses.replace(config, dq=dq, dk=dk)
    return config


def _mosaic_gradients(config: PathConfig, dim: int, block_q, block_k) -> PathConfig:
    """``config`` with ``rbf_kernel_mv``'s backward on ``tilax.rbf.mosaic.grad`` (one
    sweep, with the ``dk`` launch's tiles) where both launches run
    (``mosaic_grad.runs``: Hopper, the default precision's modes, program tiles of 128
    rows as the Triton launches chose, buffers that fit in shared memory), with the caller's
    loop tiles, else ``mosaic_grad.BLOCK_L`` or, where its buffers do not fit, 64."""
    widths = (parts_width(dim), expansion_width(dim), config.cols)
    for loop_tile in (mosaic_grad.BLOCK_L, 64):
        dq = dataclasses.replace(config.dq, block_l=block_k or loop_tile, backend="mosaic")
        dk = dataclasses.replace(config.dk, block_l=block_q or loop_tile, backend="mosaic")
        if all(mosaic_grad.runs(launch, config.modes.values, config.modes.coords,
                                       *widths) for launch in (dq, dk)):
            return dataclasses.replace(config, dq=dq, dk=dk)
    return config


@functools.lru_cache(maxsize=4096)
def _gpu_path_config(
    modes, backend, path, batch, n, m, cols, value_tile, dim, block_q, block_k, limit
) -> PathConfig:
    """GPU launches of one path (cached: they depend on ``O`` only through the value tile and
    the padded column count)."""
    pf, pb = GPU_PREFERRED[(path, "fwd")], GPU_PREFERRED[(path, "bwd")]
    pk = GPU_PREFERRED.get((path, "dk"), pb)
    o_tiles = cols // value_tile
    fwd = dataclasses.replace(
        pf,
        block_p=block_q or _occupancy_tile(pf.block_p, n, batch * o_tiles, 32),
        block_l=block_k or _fit_tile(pf.block_l, m),
        block_o=value_tile,
    )
    dq = dataclasses.replace(
        pb,
        block_p=block_q or _occupancy_tile(pb.block_p, n, batch, 64),
        block_l=block_k or _fit_tile(pb.block_l, m),
        block_o=value_tile,
    )
    dk = dataclasses.replace(
        pk,
        block_p=block_k or _occupancy_tile(pk.block_p, m, batch, 64),
        block_l=block_q or _fit_tile(pk.block_l, n),
        block_o=value_tile,
    )
    calls = path_calls(modes, dim, cols)
    fwd = _fit_all(calls["fwd"], fwd, limit)
    dq = _fit_all(calls["dq"], dq, limit)
    dk = _fit_all(calls["dk"], dk, limit)
    return PathConfig(backend, modes, cols, fwd, dq, dk)


def default_config(
    backend: _pallas.Backend,
    precision: str | None,
    *,
    batch: int,
    n: int,
    m: int,
    out: int,
    dim: int,
    block_q: int | None = None,
    block_k: int | None = None,
    block_o: int | None = None,
    shared_memory: int | None = None,
    op: str = "kernel_mv",
) -> PallasConfig:
    """The settings ``rbf_kernel_mv`` (``op="kernel_mv"``) or ``rbf_kde_density``
    (``op="kde"``) use unless told otherwise.

    ``precision`` names the dot modes (``FAST_MODES``, ``EXACT_MODES``; ``None`` is
    ``"default"``). On GPUs (Triton) the launches start from ``GPU_PREFERRED``; a program tile
    halves while the grid would have fewer than two programs per SM (small ``N`` or ``M``), down
    to 32 rows forward and 64 backward, no tile exceeds the next power of two of its dimension
    (min 16), the value tile is ``min(64, next_power_of_2(O))``, and then every launch shrinks
    until its shared-memory estimate fits ``shared_memory`` bytes (default: the device's
    limit, :func:`shared_memory_limit`) with the margin. In interpret mode (CPU) every tile is
    ``min(128, next_power_of_2(size))``. Explicit ``block_q``/``block_k`` set the query/key
    tiles of all kernels, ``block_o`` the value tile (shared memory may still shrink them).
    On Hopper, the fast path's forward (``tilax.rbf.mosaic.forward``) and ``rbf_kernel_mv``'s
    gradient sweep (``tilax.rbf.mosaic.grad``, loop tiles of 128) run on Mosaic GPU
    where those kernels support the settings and the Triton launch has program tiles of 128.
    """
    if op not in ("kernel_mv", "kde"):
        raise ValueError(f"op must be 'kernel_mv' or 'kde', not {op!r}")
    precision = precision or "default"
    limit = None
    if backend != "interpret":
        limit = shared_memory or shared_memory_limit()
    common = dict(op=op, batch=batch, n=n, m=m, out=out, dim=dim, block_q=block_q,
                  block_k=block_k, block_o=block_o, limit=limit)  # fmt: skip
    fast = None
    if precision in FAST_MODES:
        fast = _path_config(FAST_MODES[precision], backend, "fast", **common)
    exact = _path_config(EXACT_MODES[precision], backend, "exact", **common)
    return PallasConfig(precision=precision, fast=fast, exact=exact)
