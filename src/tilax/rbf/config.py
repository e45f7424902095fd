"""Launch rules of the RBF Pallas kernels: which kernel runs, with which tiles, as data.

``default_config`` picks, per problem and device, the dot modes of a precision and the kernel
and tiles of every launch, for both distance paths (``tilax.rbf.numerics``): the fast expansion
and the exact differences. Every choice it makes is a row of ``RULES`` (:class:`LaunchRule`)
naming the stored run (``data/results/``) that justifies it, or saying that none does yet;
``tests/rbf/test_rbf_rules.py`` holds every row against its run. The device it plans for is
data too (:class:`Device`: ``default_config(device=...)`` plans for another one). Triton tiles
start from the rules' launches and shrink until the launch's shared-memory estimate
(:func:`shared_memory_bytes`) fits the device's per-block limit with a margin.

Which kernel file runs a launch: ``Launch.backend`` ``"mosaic"`` names the Mosaic GPU kernel of
its path and role (``tilax.rbf.mosaic.forward``, ``grad``, ``exact``, ``exact_grad``), ``None``
the path's backend (``tilax.rbf.triton``, on a CPU in interpret mode); ``tilax.rbf.vjp`` calls it.

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

import jax.numpy as jnp

from tilax import _pallas
from tilax.rbf import profiles
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
    value and cotangent columns are padded to (a multiple of every launch's ``block_o``), and
    the kernel profile its kernels apply (``tilax.rbf.profiles``: ``"rbf"``, the Gaussian, or a
    Matérn kernel; the ``matern_launches`` rule)."""

    backend: _pallas.Backend
    modes: DotModes
    cols: int
    fwd: Launch
    dq: Launch
    dk: Launch
    kernel: str = "rbf"

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

    @property
    def kernel(self) -> str:
        """The kernel profile both paths apply (``PathConfig.kernel``)."""
        return self.exact.kernel


# ------------------------------------------------------------------------------------------
# The device the launches are planned for

#: Streaming multiprocessors assumed where no GPU reports its count (launches planned on a CPU,
#: as the bench lists its GPU grid there): an H100's or H200's.
PLANNED_CORES = 132


@dataclasses.dataclass(frozen=True)
class Device:
    """The device facts the launch rules read: ``mosaic`` (the Mosaic GPU kernels run here:
    Hopper), ``cores`` (streaming multiprocessors, for the ``occupancy`` rule) and
    ``shared_memory`` (bytes one block may use). :meth:`here` reads them from
    ``tilax._pallas``; ``default_config(device=...)`` plans for another device (the tests plan
    Hopper's launches on a CPU so)."""

    mosaic: bool
    cores: int
    shared_memory: int

    @classmethod
    def here(cls) -> Device:
        """The facts of this process's first device."""
        return cls(mosaic=_pallas.mosaic_unavailable_reason() is None,
                   cores=_pallas.gpu_core_count() or PLANNED_CORES,
                   shared_memory=_pallas.shared_memory_per_block())


# ------------------------------------------------------------------------------------------
# The rules: every choice between kernels and launches, with the stored run that justifies it

#: ``Evidence.beaten`` for every other measured row of the chosen row's launch group
#: (``extra_info`` ``path`` and ``kernel``) in the file: a launch sweep.
SWEEP = "sweep"


@dataclasses.dataclass(frozen=True)
class Evidence:
    """Rows of one stored run (``data/results/<file>``, one process) that justify a rule: the
    ``chosen`` row was faster than every row of ``beaten`` beyond the spread (its upper quartile
    under their lower quartiles). Rows are named by their benchmark id (the pytest-benchmark
    name's part in brackets); ``beaten`` is those ids, or ``SWEEP``."""

    file: str
    chosen: str
    beaten: tuple[str, ...] | str


@dataclasses.dataclass(frozen=True)
class LaunchRule:
    """One choice ``default_config`` (or ``rbf_kernel_mv``'s ``impl="auto"``) makes.

    ``choice`` says what it picks and where; ``launch`` holds the tiles it prefers (``None``:
    the rule picks no tiles). ``evidence``: the stored runs that hold it; ``unmeasured``: where
    none does, why not and what stands for it (such a rule owes an H200 run).
    """

    name: str
    choice: str
    launch: Launch | None
    evidence: tuple[Evidence, ...] = ()
    unmeasured: str = ""


_FAST_SWEEP = "h200-20261201-b0ccf0d-launches-fast.json"
_EXACT_SWEEPS = ("h200-20261201-b0ccf0d-launches-exact.json",
                 "h200-20261201-f371e68-launches-exact.json")
_LAUNCH_ID = "kernel_mv_launches-{}-n65536-d8-o16-{}"  # (group and launch, precision and op)

RULES: tuple[LaunchRule, ...] = (
    LaunchRule(
        "auto_impl",
        "impl='auto' runs the Pallas kernels on GPUs, plain XLA (impl='xla') on CPUs (where the "
        "kernels only run in the interpreter) and for float64 inputs (the kernels compute in "
        "float32)",
        None,
        (Evidence("h200-20261201-e6271ea-rbf-mosaic.json", "kernel_mv-pallas-n65536-d8-o16-fwd",
                  ("kernel_mv-xla-n65536-d8-o16-fwd",)),
         Evidence("h200-20261201-e6271ea-rbf-mosaic.json",
                  "kernel_mv-pallas-n65536-d8-o16-fwd_bwd",
                  ("kernel_mv-xla-n65536-d8-o16-fwd_bwd",))),
    ),
    LaunchRule(
        "triton_fast_fwd",
        "the fast path's forward on Triton: 128 x 128 tiles, 4 warps, 3 stages",
        Launch(128, 128, 64, num_warps=4, num_stages=3),
        unmeasured="the sweep that chose it is not stored; the stored one "
        f"({_FAST_SWEEP}) has four launches faster beyond the spread (bp256-bl64-w4-s2 "
        "2.43 ms against 2.60 ms). On Hopper the Mosaic GPU forward runs instead "
        "(mosaic_fast_fwd, measured).",
    ),
    LaunchRule(
        "triton_fast_bwd",
        "the fast path's gradient sweeps (dq and dk) on Triton: 128 x 64 tiles, 4 warps, 3 "
        "stages",
        Launch(128, 64, 64, num_warps=4, num_stages=3),
        (Evidence(_FAST_SWEEP, _LAUNCH_ID.format("fast_bwd-bp128-bl64-w4-s3", "fwd_bwd"),
                  SWEEP),),
    ),
    LaunchRule(
        "triton_exact_fwd",
        "the exact path's forward on Triton: 64 x 32 tiles, 4 warps, 2 stages (the difference "
        "kernels hold D coordinates per program row in registers: larger tiles spill)",
        Launch(64, 32, 64, num_warps=4, num_stages=2),
        tuple(Evidence(name, _LAUNCH_ID.format("exact_fwd-bp64-bl32-w4-s2", "highest-fwd"),
                       SWEEP) for name in _EXACT_SWEEPS),
    ),
    LaunchRule(
        "triton_exact_dq",
        "the exact path's query-gradient sweep on Triton: 64 x 32 tiles, 4 warps, 2 stages "
        "(measured with the key sweep at the same tiles)",
        Launch(64, 32, 64, num_warps=4, num_stages=2),
        tuple(Evidence(name, _LAUNCH_ID.format("exact_bwd-bp64-bl32-w4-s2", "highest-fwd_bwd"),
                       SWEEP) for name in _EXACT_SWEEPS),
    ),
    LaunchRule(
        "triton_exact_dk",
        "the exact path's key-gradient sweep (dk and dv) on Triton: loop tiles of 16 (with 32 "
        "it spilled registers, ncu)",
        Launch(64, 16, 64, num_warps=4, num_stages=2),
        unmeasured="a diagnostic script's A/B (H200, N = M = 65536, D = 8, O = 16: fwd_bwd "
        "50.7 ms against 58.3 ms with loop tiles of 32) was not stored; the stored rows are "
        "two commits apart (h200-20261201-d156166-kmv-highest.json at 16, "
        "h200-20261201-d98132e-kmv-highest.json at 32).",
    ),
    LaunchRule(
        "occupancy",
        "a program tile halves while the grid has fewer than two programs per core, down to "
        "32 rows (forward) or 64 (gradient sweeps)",
        None,
        unmeasured="no stored run compares the tiles of problems too small to fill the GPU.",
    ),
    LaunchRule(
        "value_tile",
        "the value tile is min(64, next_power_of_2(O)), at least 16",
        None,
        unmeasured="the stored tile sweep (h200-20261130-cf11ba3-tiles.json) has value tiles "
        "of 16 only.",
    ),
    LaunchRule(
        "interpret_tiles",
        "in interpret mode (a CPU) every tile is min(128, next_power_of_2(size)): fewer, larger "
        "tiles interpret faster",
        None,
        unmeasured="a CPU choice (the Pallas interpreter); no stored run.",
    ),
    LaunchRule(
        "mosaic_fast_fwd",
        "on Hopper, the fast path's forward on tilax.rbf.mosaic.forward wherever it takes the "
        "settings (TF32-parts distance, bfloat16 values, parts up to 64 columns, value tiles up "
        "to 256) and the Triton launch has program tiles of 128 and loop tiles a multiple of 64",
        Launch(128, 128, 64, backend="mosaic"),
        (Evidence("h200-20261201-e6271ea-rbf-mosaic.json", "kernel_mv-pallas-n65536-d8-o16-fwd",
                  (_LAUNCH_ID.format("fast_fwd-bp128-bl128-w4-s3", "fwd"),)),),
    ),
    LaunchRule(
        "mosaic_fast_bwd",
        "on Hopper, rbf_kernel_mv's fast backward as one sweep on tilax.rbf.mosaic.grad "
        "(default precision; program tiles of 128, loop tiles of 128 or the caller's) wherever "
        "it takes the widths and its buffers fit",
        Launch(128, 128, 64, backend="mosaic"),
        (Evidence("h200-20261201-2c3d544-launches-mosaic.json",
                  "kernel_mv_launches-fast_bwd-mosaic-bp128-bl128-n65536-d8-o16-fwd_bwd",
                  ("kernel_mv_launches-fast_bwd-mosaic-bp128-bl64-n65536-d8-o16-fwd_bwd",)),
         Evidence("h200-20261201-42a1217-launches-mosaic-bwd.json",
                  "kernel_mv_launches-fast_bwd-mosaic-bp128-bl128-n65536-d8-o16-fwd_bwd",
                  (_LAUNCH_ID.format("fast_bwd-bp128-bl64-w4-s3", "fwd_bwd"),))),
    ),
    LaunchRule(
        "mosaic_fast_bwd_narrow",
        "the same sweep with loop tiles of 64 where those of 128 do not fit its shared memory",
        Launch(128, 64, 64, backend="mosaic"),
        (Evidence("h200-20261201-42a1217-launches-mosaic-bwd.json",
                  "kernel_mv_launches-fast_bwd-mosaic-bp128-bl64-n65536-d8-o16-fwd_bwd",
                  (_LAUNCH_ID.format("fast_bwd-bp128-bl64-w4-s3", "fwd_bwd"),)),),
    ),
    LaunchRule(
        "mosaic_exact_fwd",
        "on Hopper, precision='highest''s forward on tilax.rbf.mosaic.exact (128 x 128 tiles) "
        "where it takes the settings (unrounded differences of at most 16 dimensions, values "
        "at float32 accuracy), no tiles are given and its program tiles keep the occupancy "
        "rule",
        Launch(128, 128, 64, backend="mosaic"),
        unmeasured="stored beside other commits' Triton rows only "
        "(h200-20261201-d98132e-kmv-highest.json: 7.56 ms; the Triton difference kernel "
        "11.0 ms in h200-20261201-86daa73-kmv-pallas.json); no one process holds both.",
    ),
    LaunchRule(
        "mosaic_exact_bwd",
        "on Hopper, rbf_kernel_mv's exact backward as one sweep on tilax.rbf.mosaic.exact_grad "
        "(program tiles of 128, loop tiles of 64) where it takes the settings (as "
        "mosaic_exact_fwd, value columns up to 64), no tiles are given and its program tiles "
        "keep the occupancy rule",
        Launch(128, 64, 64, backend="mosaic"),
        unmeasured="one commit, two processes: h200-20261201-d156166-exact-mosaic-bwd.json "
        "(fwd_bwd 35.1 ms) and h200-20261201-d156166-kmv-highest.json (the Triton sweeps, "
        "50.7 ms).",
    ),
    LaunchRule(
        "matern_launches",
        "the Matérn kernels (kernel_mv's kernel='matern12', 'matern32', 'matern52') run the "
        "Gaussian kernel's kernels and launches, every row above as for kernel='rbf': the "
        "profile changes only each pair's arithmetic (an rsqrt beside the exp2, a few FMA-pipe "
        "instructions), not the tiles' memory or tensor-core work",
        None,
        unmeasured="the Gaussian rows' launches stand for them; no stored run times a Matérn "
        "kernel yet (the rbf bench suite's kernel_mv-*-matern* rows at N = 65536 will).",
    ),
)


def rule(name: str) -> LaunchRule:
    """The row of ``RULES`` called ``name``."""
    return next(row for row in RULES if row.name == name)


#: Programs per core below which the ``occupancy`` rule halves a program tile.
PROGRAMS_PER_CORE = 2


def auto_impl(dtype, platform: str) -> str:
    """``impl="auto"``'s implementation for inputs of ``dtype`` on ``platform`` (the
    ``auto_impl`` rule): ``"pallas"`` on GPUs, ``"xla"`` elsewhere and for float64."""
    return "pallas" if platform == "gpu" and jnp.dtype(dtype) != jnp.float64 else "xla"


# ------------------------------------------------------------------------------------------
# What the Mosaic GPU kernels take (each kernel file checks the same and says why not; the
# rules' tests hold the two together)

#: Rows a Mosaic GPU program owns (two compute warpgroups of 64).
MOSAIC_BLOCK_P = 128
#: Widest TF32-parts and coordinate operands (columns) of the fast kernels.
MOSAIC_MAX_WIDTH = 64
#: Widest value tile of the forwards, and value operand (columns) of the sweeps.
MOSAIC_MAX_VALUE_TILE, MOSAIC_MAX_COLUMNS = 256, 64
#: Most dimensions the exact kernels hold in registers.
MOSAIC_EXACT_MAX_DIMS = 16
#: Loop tiles of the fast sweep, and its tiles in flight.
MOSAIC_SWEEP_LOOP_TILES, MOSAIC_SWEEP_STAGES = (64, 128), 2
#: Shared memory the fast sweep leaves for its barriers (bytes).
MOSAIC_BARRIER_BYTES = 2048


def mosaic_sweep_shared_memory_bytes(parts_width: int, coords_width: int, columns: int,
                                     block_l: int, stages: int = MOSAIC_SWEEP_STAGES) -> int:
    """Bytes of the buffers of the fast sweep's kernel (``tilax.rbf.mosaic.grad``; the list in
    its ``entry``, in order): the program's and the loop tiles' parts, values and coordinates,
    the pair weights and the staged sums."""
    rows, wgs = MOSAIC_BLOCK_P // 2, 2
    own = wgs * rows * (4 * parts_width + 2 * columns + 2 * 2 * coords_width)
    loop = stages * block_l * (4 * parts_width + 2 * columns + 2 * 2 * coords_width)
    weights = wgs * rows * block_l * 2
    staging = wgs * (block_l * coords_width + rows * columns) * 4  # sums: the loop's
    return own + loop + weights + staging


def _mosaic_forward_takes(launch: Launch, distance: Distance, values: str, width: int) -> bool:
    """``tilax.rbf.mosaic.forward`` takes this fast forward."""
    return (distance == Expansion("tf32_parts") and values == "bf16"
            and width % 16 == 0 and width <= MOSAIC_MAX_WIDTH
            and launch.block_o % 16 == 0 and launch.block_o <= MOSAIC_MAX_VALUE_TILE
            and launch.block_p == MOSAIC_BLOCK_P and launch.block_l % 64 == 0)


def _mosaic_sweep_takes(launch: Launch, modes: DotModes, parts_width: int, coords_width: int,
                        columns: int, device: Device) -> bool:
    """``tilax.rbf.mosaic.grad`` takes this fast sweep, and its buffers fit ``device``."""
    widths_ok = all(w % 16 == 0 and w <= MOSAIC_MAX_WIDTH for w in (parts_width, coords_width))
    need = mosaic_sweep_shared_memory_bytes(parts_width, coords_width, columns, launch.block_l)
    return ((modes.values, modes.coords) == ("bf16", "bf16x2") and widths_ok
            and columns % 16 == 0 and columns <= MOSAIC_MAX_COLUMNS
            and launch.block_l in MOSAIC_SWEEP_LOOP_TILES and launch.block_p == MOSAIC_BLOCK_P
            and need <= device.shared_memory - MOSAIC_BARRIER_BYTES)


def _mosaic_exact_takes(distance: Distance, values: str) -> bool:
    """The exact Mosaic GPU kernels take this distance and values mode."""
    return (isinstance(distance, Difference) and not distance.rounded
            and distance.dim <= MOSAIC_EXACT_MAX_DIMS and values == "tf32x3")


# ------------------------------------------------------------------------------------------
# Kernel launches and their shared memory

#: Fraction of the limit a launch's estimate may use (the model is an estimate).
SHARED_MEMORY_MARGIN = 0.9


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


def _occupancy_tile(preferred: int, size: int, other_programs: int, smallest: int,
                    cores: int) -> int:
    """Largest tile <= ``preferred`` (down to ``smallest``) giving >= ``PROGRAMS_PER_CORE``
    programs per core (the ``occupancy`` rule)."""
    tile = _fit_tile(preferred, size)
    target = PROGRAMS_PER_CORE * cores
    while tile > smallest and other_programs * (-(-size // tile)) < target:
        tile //= 2
    return tile


def _path_config(
    modes: DotModes, backend, path: str, *, op, batch, n, m, out, dim, block_q, block_k, block_o,
    device: Device | None,
) -> PathConfig:  # fmt: skip
    value_tile = block_o or _fit_tile(64, out)
    cols = _pallas.round_up(out, value_tile)
    if backend == "interpret":  # the interpret_tiles rule; no shared memory to fit
        q_tile = block_q or _fit_tile(128, n)
        k_tile = block_k or _fit_tile(128, m)
        fwd = dq = Launch(q_tile, k_tile, value_tile)
        dk = Launch(k_tile, q_tile, value_tile)
        return PathConfig(backend, modes, cols, fwd, dq, dk)
    config = _gpu_path_config(modes, backend, path, batch, n, m, cols, value_tile, dim, block_q,
                              block_k, device)  # fmt: skip
    if not device.mosaic:
        return config
    if path == "fast" and _mosaic_forward_takes(config.fwd, forward_distance(modes, dim),
                                                modes.values, parts_width(dim)):
        config = dataclasses.replace(config, fwd=dataclasses.replace(config.fwd, backend="mosaic"))
    if path == "fast" and op == "kernel_mv":
        config = _mosaic_fast_bwd(config, dim, block_q, block_k, device)
    if path == "exact" and op == "kernel_mv" and block_q is None and block_k is None:
        config = _mosaic_exact(config, batch, n, m, dim, device)
    return config


def _mosaic_exact(config: PathConfig, batch: int, n: int, m: int, dim: int,
                  device: Device) -> PathConfig:
    """``config`` with ``rbf_kernel_mv``'s exact forward and backward on Mosaic GPU, each where
    its rule (``mosaic_exact_fwd``, ``mosaic_exact_bwd``) applies."""
    distance = Difference(difference_dims(dim), per_dimension=True)
    if not _mosaic_exact_takes(distance, config.modes.values):
        return config

    def fits(launch, size, programs):
        return _occupancy_tile(launch.block_p, size, programs, 32, device.cores) == launch.block_p

    preferred = rule("mosaic_exact_fwd").launch
    fwd = dataclasses.replace(config.fwd, block_p=preferred.block_p, block_l=preferred.block_l,
                              backend="mosaic")
    if (fwd.block_o % 16 == 0 and fwd.block_o <= MOSAIC_MAX_VALUE_TILE
            and fits(fwd, n, batch * (config.cols // fwd.block_o))):
        config = dataclasses.replace(config, fwd=fwd)
    preferred = rule("mosaic_exact_bwd").launch
    sweep = dict(block_p=preferred.block_p, block_l=preferred.block_l, backend="mosaic")
    dq, dk = (dataclasses.replace(launch, **sweep) for launch in (config.dq, config.dk))
    if (config.cols % 16 == 0 and config.cols <= MOSAIC_MAX_COLUMNS
            and all(fits(launch, size, batch) for launch, size in ((dq, n), (dk, m)))):
        config = dataclasses.replace(config, dq=dq, dk=dk)
    return config


def _mosaic_fast_bwd(config: PathConfig, dim: int, block_q, block_k,
                     device: Device) -> PathConfig:
    """``config`` with ``rbf_kernel_mv``'s fast backward as one Mosaic GPU sweep (with the
    ``dk`` launch's tiles), where both launches are taken: with the caller's loop tiles, else
    the ``mosaic_fast_bwd`` rule's or, where its buffers do not fit, the
    ``mosaic_fast_bwd_narrow`` rule's."""
    widths = (parts_width(dim), expansion_width(dim), config.cols)
    for name in ("mosaic_fast_bwd", "mosaic_fast_bwd_narrow"):
        loop_tile = rule(name).launch.block_l
        dq = dataclasses.replace(config.dq, block_l=block_k or loop_tile, backend="mosaic")
        dk = dataclasses.replace(config.dk, block_l=block_q or loop_tile, backend="mosaic")
        if all(_mosaic_sweep_takes(launch, config.modes, *widths, device) for launch in (dq, dk)):
            return dataclasses.replace(config, dq=dq, dk=dk)
    return config


#: The ``RULES`` row of each path's Triton launches.
_TRITON_RULES = {
    ("fast", "fwd"): "triton_fast_fwd", ("fast", "dq"): "triton_fast_bwd",
    ("fast", "dk"): "triton_fast_bwd", ("exact", "fwd"): "triton_exact_fwd",
    ("exact", "dq"): "triton_exact_dq", ("exact", "dk"): "triton_exact_dk",
}  # fmt: skip


#: The Triton rules' launches by the bench's launch groups (``tests/bench/bench_rbf.py``
#: sweeps each group around its launch): a path's forward, its gradient sweeps (``"bwd"``) and
#: the exact path's key sweep apart (``"dk"``).
GPU_PREFERRED = {
    ("fast", "fwd"): rule("triton_fast_fwd").launch,
    ("fast", "bwd"): rule("triton_fast_bwd").launch,
    ("exact", "fwd"): rule("triton_exact_fwd").launch,
    ("exact", "bwd"): rule("triton_exact_dq").launch,
    ("exact", "dk"): rule("triton_exact_dk").launch,
}  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _gpu_path_config(
    modes, backend, path, batch, n, m, cols, value_tile, dim, block_q, block_k, device: Device
) -> PathConfig:
    """GPU launches of one path on Triton (cached: they depend on ``O`` only through the value
    tile and the padded column count)."""
    pf, pq, pk = (rule(_TRITON_RULES[(path, kernel)]).launch for kernel in ("fwd", "dq", "dk"))
    o_tiles = cols // value_tile
    fwd = dataclasses.replace(
        pf,
        block_p=block_q or _occupancy_tile(pf.block_p, n, batch * o_tiles, 32, device.cores),
        block_l=block_k or _fit_tile(pf.block_l, m),
        block_o=value_tile,
    )
    dq = dataclasses.replace(
        pq,
        block_p=block_q or _occupancy_tile(pq.block_p, n, batch, 64, device.cores),
        block_l=block_k or _fit_tile(pq.block_l, m),
        block_o=value_tile,
    )
    dk = dataclasses.replace(
        pk,
        block_p=block_k or _occupancy_tile(pk.block_p, m, batch, 64, device.cores),
        block_l=block_q or _fit_tile(pk.block_l, n),
        block_o=value_tile,
    )
    calls = path_calls(modes, dim, cols)
    limit = device.shared_memory
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
    device: Device | None = None,
    op: str = "kernel_mv",
    kernel: str = "rbf",
) -> PallasConfig:
    """The settings ``rbf_kernel_mv`` (``op="kernel_mv"``) or ``rbf_kde_density``
    (``op="kde"``) use unless told otherwise, by the rows of ``RULES``.

    ``precision`` names the dot modes (``FAST_MODES``, ``EXACT_MODES``; ``None`` is
    ``"default"``). On GPUs (Triton) the launches start from the ``triton_*`` rules' tiles; a
    program tile halves by the ``occupancy`` rule, no tile exceeds the next power of two of
    its dimension (min 16), the value tile follows the ``value_tile`` rule, and then every
    launch shrinks until its shared-memory estimate fits the device's with the margin. In
    interpret mode (CPU) the ``interpret_tiles`` rule sets every tile. Explicit
    ``block_q``/``block_k`` set the query/key tiles of all kernels, ``block_o`` the value tile
    (shared memory may still shrink them). Where ``device.mosaic``, the ``mosaic_*`` rules put
    launches on the Mosaic GPU kernels. ``device``: the facts planned for (default
    ``Device.here()``; the backend stays ``backend``). ``kernel``: the kernel profile of
    ``op="kernel_mv"`` (``tilax.rbf.profiles.KERNELS``), on the same launches (the
    ``matern_launches`` rule); the KDE is Gaussian.
    """
    if op not in ("kernel_mv", "kde"):
        raise ValueError(f"op must be 'kernel_mv' or 'kde', not {op!r}")
    if kernel not in profiles.KERNELS or (op == "kde" and kernel != "rbf"):
        raise ValueError(f"kernel must be one of {profiles.KERNELS} ('rbf' for op='kde'), "
                         f"not {kernel!r}")
    precision = precision or "default"
    device = device or Device.here()
    common = dict(op=op, batch=batch, n=n, m=m, out=out, dim=dim, block_q=block_q,
                  block_k=block_k, block_o=block_o, device=device)  # fmt: skip
    fast = None
    if precision in FAST_MODES:
        fast = _path_config(FAST_MODES[precision], backend, "fast", **common)
    exact = _path_config(EXACT_MODES[precision], backend, "exact", **common)
    if kernel != "rbf":  # the matern_launches rule: the Gaussian kernel's launches
        fast = fast and dataclasses.replace(fast, kernel=kernel)
        exact = dataclasses.replace(exact, kernel=kernel)
    return PallasConfig(precision=precision, fast=fast, exact=exact)
