"""RBF benchmark cases: kernel matrix-vector products and KDE, their peers and numerics.

Suites (``extra_info["suite"]``, the seed file's family names):

- ``kernel_mv``: ``tilax.rbf_kernel_mv`` impls pallas / xla / dense and the peers torch_dense
  (PyTorch, the full kernel matrix) and keops (KeOps LazyTensor), ``n = m`` from 1k to 1M,
  ``(dim, out)`` in (2, 1), (8, 16), (32, 16), (3, 1); ``fwd`` and ``fwd_bwd``. Beside the
  Gaussian headline rows, in the same process, ``tilax.kernel_mv``'s Matérn kernels
  (``profile``: matern12, matern32, matern52) on the Pallas path at 65k, d8 o16 (default
  precision, and ``"highest"`` in full mode): their time over the Gaussian kernel's is read off
  one file (``matern_cases``).
- ``kde_density``: ``tilax.rbf_kde_density`` impls pallas / xla / dense, dims 2 and 8.
- ``kernel_mv_tiles``: the Pallas tile sweep (block_q, block_k, block_o).
- ``kernel_mv_launches``: the launch sweep of each Pallas kernel family (program tile, loop
  tile, warps, stages; fast and exact distance paths, forward and backward kernels apart), with
  each group's default launch (see ``launch_cases``).
- ``kernel_mv_peak``, ``kernel_mv_max_n``: peak memory and the largest n per impl, each size in
  a fresh subprocess (see ``bench_ladder``).

``fwd_bwd`` is ``jax.vjp`` of the op with a fixed random cotangent, returning the output and
the gradients with respect to q, k, v and the lengthscale (query, data, bandwidth for KDE).
The work unit is the kernel pair: ``pairs_per_s = batch * n * m / median``.

Numerics: ``rel_err`` is the norm-wise relative error ``||a - r|| / ||r||`` against a float64
reference (exact differences, chunked over keys, computed with ``jax.enable_x64``) on the first
``min(n, 1024)`` query rows: the forward output of those rows, and for ``fwd_bwd`` the
gradients of ``sum(out[:R] * g[:R])`` (``dq`` on those rows, ``dk``, ``dv`` and
``dlengthscale`` in full), from one extra, untimed call of the impl with that cotangent.
Peers (torch, KeOps) are checked the same way through torch autograd.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import math
import signal
import subprocess
import sys
from typing import Any

import numpy as np
from bench_harness import JaxWorkload, Unavailable, torch_device_memory
from helpers import rel_err

NUMERICS_ROWS = 1024
REFERENCE_CHUNK_ELEMENTS = 1 << 24
JAX_IMPLS = ("pallas", "xla", "dense")
PEERS = ("torch_dense", "keops")


@dataclasses.dataclass(frozen=True)
class RbfCase:
    """One RBF benchmark row."""

    suite: str
    impl: str
    op: str  # "fwd" | "fwd_bwd"
    n: int
    dim: int
    out: int | None  # None for KDE
    m: int | None = None  # defaults to n
    batch: int = 1
    block_q: int | None = None
    block_k: int | None = None
    block_o: int | None = None
    precision: str | None = None
    numerics: bool = True
    priority: int = 50
    seed: int = 0
    profile: str | None = None  # tilax.kernel_mv's kernel; None: the Gaussian (rbf_kernel_mv)

    family = "rbf"
    dtype = "float32"

    @property
    def keys(self) -> int:
        return self.m if self.m is not None else self.n

    @property
    def id(self) -> str:
        parts = [self.suite, self.impl, f"n{self.n}", f"d{self.dim}"]
        if self.out is not None:
            parts.append(f"o{self.out}")
        if self.block_q is not None:
            parts.append(f"bq{self.block_q}-bk{self.block_k}-bo{self.block_o}")
        if self.profile is not None:
            parts.append(self.profile)
        if self.precision is not None:
            parts.append(self.precision)
        parts.append(self.op)
        return "-".join(parts)

    def extra_info(self) -> dict[str, Any]:
        info = {
            "family": "rbf", "suite": self.suite, "impl": self.impl, "dtype": self.dtype,
            "op": self.op, "n": self.n, "m": self.keys, "dim": self.dim, "out": self.out,
            "batch": self.batch, "precision": self.precision,
        }
        for name in ("block_q", "block_k", "block_o", "profile"):
            if getattr(self, name) is not None:
                info[name] = getattr(self, name)
        if self.impl == "pallas" and self.suite != "kde_density":
            info["fwd_backend"] = self.forward_backend()
            if self.op == "fwd_bwd":
                info["bwd_backend"] = self.backward_backend()
        return info

    def _default_path(self):
        """The fast path of the default config here (the exact path's for ``"highest"``)."""
        from tilax import _pallas
        from tilax.rbf import config as rbf_config

        backend = _pallas.resolve_backend("pallas")
        cfg = rbf_config.default_config(
            backend, self.precision, batch=self.batch, n=self.n, m=self.keys,
            out=self.out or 1, dim=self.dim, block_q=self.block_q, block_k=self.block_k,
            block_o=self.block_o, kernel=self.profile or "rbf",
        )  # fmt: skip
        return cfg.fast or cfg.exact

    def forward_backend(self) -> str:
        """The backend of ``rbf_kernel_mv``'s forward kernel here: the fast path's (the exact
        path's for ``"highest"``): ``"triton"``, ``"mosaic"`` (Hopper) or ``"interpret"``."""
        path = self._default_path()
        return path.fwd.backend or path.backend

    def backward_backend(self) -> str:
        """The backend of the gradient sweeps here, as ``forward_backend``."""
        path = self._default_path()
        return path.dq.backend or path.backend

    def scale_key(self) -> tuple:
        fields = dataclasses.asdict(self)
        for name in ("n", "m", "numerics", "priority"):
            fields.pop(name)
        return ("rbf",) + tuple(sorted(fields.items()))

    def size_label(self) -> str:
        return f"n={self.n}"

    def work(self) -> float:
        return float(self.batch * self.n * self.keys)

    def rates(self, median_s: float) -> dict[str, float]:
        return {"pairs_per_s": self.work() / median_s}

    def unavailable_reason(self) -> str | None:
        needs = {"torch_dense": ("torch",), "keops": ("torch", "pykeops")}.get(self.impl, ())
        for module in needs:
            if importlib.util.find_spec(module) is None:
                return f"unavailable: {module} is not installed here"
        return None

    def precheck(self, state) -> str | None:
        reason = self.unavailable_reason()
        if reason or state.device_bytes is None or self.impl not in ("dense", "torch_dense"):
            return reason
        copies = 2 if self.op == "fwd" else 4
        needed = self.batch * self.n * self.keys * 4 * copies
        if needed > 0.9 * state.device_bytes:
            return (f"skipped: not attempted, RESOURCE_EXHAUSTED predicted: the dense path keeps "
                    f"about {needed / 2**30:.0f} GiB of n x m kernel matrices; the device has "
                    f"{state.device_bytes / 2**30:.0f} GiB")
        return None

    def build(self, state):
        if self.impl == "torch_dense":
            return TorchWorkload(self, state, keops=False)
        if self.impl == "keops":
            probe_keops(state)
            return TorchWorkload(self, state, keops=True)
        return build_jax(self, state)

    def to_spec(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_spec(cls, spec: dict) -> RbfCase:
        return cls(**spec)


# ----------------------------------------------------------------------------- case lists

SEED_DIM_OUT = ((2, 1), (8, 16), (32, 16), (3, 1))
# torch before JAX's dense: JAX's memory pool keeps what dense rows grew it to, torch's cache
# is emptied after each of its rows
ALL_IMPLS = ("pallas", "xla", "torch_dense", "dense", "keops")
MATRIX_FREE_IMPLS = ("pallas", "xla", "keops")
BOTH_OPS = ("fwd", "fwd_bwd")
SEED_TILES = ((64, 64, 64), (64, 64, 16), (128, 64, 16), (64, 128, 16), (128, 128, 16),
              (32, 64, 16))


def kernel_mv_cases(mode: str) -> list[RbfCase]:
    if mode == "smoke":
        sizes, dim_out = [64], ((8, 16),)  # the suite's code path; tests/rbf covers shapes
    elif mode == "quick":
        sizes, dim_out = [4096, 65536], ((8, 16),)
    else:
        sizes, dim_out = [1024, 4096, 16384, 65536, 262144, 1048576], SEED_DIM_OUT
    cases = []
    for n in sizes:  # n-major: a size's time predicts the next one's
        shapes = dim_out if n <= 65536 else ((8, 16), (3, 1))
        # The n x m matrix of the dense impls outgrows the GPU beyond 64k (16 GiB per matrix
        # at 64k, 256 GiB at 262k): kernel_mv_max_n brackets their limit instead.
        impls = ALL_IMPLS if n <= 65536 else MATRIX_FREE_IMPLS
        for dim, out in shapes:
            for impl in impls:
                for op in BOTH_OPS:
                    # every n of one shape first; KeOps compiles each formula on first use
                    priority = 10 if (dim, out) == (8, 16) else 12
                    priority += 3 if impl == "keops" else 0
                    cases.append(RbfCase("kernel_mv", impl, op, n, dim, out, priority=priority))
    return cases + matern_cases(mode) + precision_cases(mode)


MATERN = ("matern12", "matern32", "matern52")


def matern_cases(mode: str) -> list[RbfCase]:
    """``tilax.kernel_mv``'s Matérn kernels on the Pallas path, at the headline shape and the
    Gaussian headline rows' priority (the same process and file): their forward time within
    1.3x of the Gaussian kernel's at 65k is the target, read off one file. Smoke: one
    Matérn-1/2 fwd_bwd row (CPU, interpret mode)."""
    if mode == "smoke":
        return [RbfCase("kernel_mv", "pallas", "fwd_bwd", 64, 8, 16, priority=10,
                        profile="matern12")]
    precisions = (None,) if mode == "quick" else (None, "highest")
    return [RbfCase("kernel_mv", "pallas", op, 65536, 8, 16, precision=precision,
                    priority=10 if precision is None else 11, profile=profile)
            for precision in precisions for profile in MATERN for op in BOTH_OPS]


# The precisions besides the default: "high" and "highest" on the headline shape, and every
# precision on a wide shape (D = 20, O = 100), which needs the most shared memory per tile.
PRECISIONS = ("high", "highest")
WIDE_DIM_OUT = (20, 100)


def precision_cases(mode: str) -> list[RbfCase]:
    if mode == "smoke":
        return [RbfCase("kernel_mv", "pallas", op, 64, 8, 16, precision="highest", priority=11)
                for op in BOTH_OPS]
    if mode == "quick":
        sizes, wide_sizes = [65536], []
    else:
        sizes, wide_sizes = [4096, 16384, 65536], [16384, 65536]
    cases = [RbfCase("kernel_mv", "pallas", op, n, 8, 16, precision=precision, priority=11)
             for n in sizes for precision in PRECISIONS for op in BOTH_OPS]
    dim, out = WIDE_DIM_OUT
    for n in wide_sizes:
        for impl, precision in [("pallas", None), ("pallas", "high"), ("pallas", "highest"),
                                ("xla", "highest")]:
            cases += [RbfCase("kernel_mv", impl, op, n, dim, out, precision=precision,
                              priority=14) for op in BOTH_OPS]
    return cases


def kde_cases(mode: str) -> list[RbfCase]:
    if mode == "smoke":
        sizes, dims, ops = [64], (2,), BOTH_OPS
    elif mode == "quick":
        sizes, dims, ops = [16384], (8,), ("fwd",)
    else:
        sizes, dims, ops = [1024, 16384, 65536], (2, 8), BOTH_OPS
    return [RbfCase("kde_density", impl, op, n, dim, None, priority=20)
            for n in sizes for dim in dims for impl in JAX_IMPLS for op in ops]


def tiles_cases(mode: str) -> list[RbfCase]:
    if mode == "smoke":
        sizes, outs, tiles, ops = [64], (16,), ((32, 32, 16),), ("fwd",)
    elif mode == "quick":
        sizes, outs, tiles, ops = [65536], (16,), SEED_TILES[1:3], ("fwd",)
    else:
        sizes, outs, tiles, ops = [65536], (1, 16), SEED_TILES, BOTH_OPS
    return [RbfCase("kernel_mv_tiles", "pallas", op, n, 8, out, block_q=bq, block_k=bk,
                    block_o=bo, priority=22 if (out, op) == (16, "fwd") else 30, numerics=False)
            for n in sizes for out in outs for bq, bk, bo in tiles for op in ops]


def peak_cases(mode: str) -> list[RbfCase]:
    if mode == "smoke":
        combos = [("pallas", 64, "fwd")]
    elif mode == "quick":
        combos = [(impl, 65536, "fwd") for impl in ("pallas", "dense")]
    else:
        combos = [(impl, n, op) for n in (4096, 65536) for impl in JAX_IMPLS for op in BOTH_OPS]
    return [RbfCase("kernel_mv_peak", impl, op, n, 8, 16, priority=1, numerics=False)
            for impl, n, op in combos]


def max_n_ladders(mode: str) -> list[tuple[RbfCase, list[int]]]:
    """(template case, n ladder) per impl: fwd_bwd, dim 8, out 16."""
    if mode == "smoke":
        impls, ladder = ("pallas",), [64, 128]
    elif mode == "quick":
        impls, ladder = ("pallas",), [2**18, 2**20, 2**22]
    else:
        # dense (the [n, m, D] differences) ran out of memory at 2^16 on the H200: its ladder
        # starts where it runs, so that its limit is bracketed too
        return [(RbfCase("kernel_mv_max_n", impl, "fwd_bwd", 2**low, 8, 16, priority=0,
                         numerics=False), [2**k for k in range(low, 24)])
                for impl, low in (("pallas", 16), ("xla", 16), ("dense", 12))]
    return [(RbfCase("kernel_mv_max_n", impl, "fwd_bwd", ladder[0], 8, 16, priority=0,
                     numerics=False), ladder) for impl in impls]


# ----------------------------------------------------------------------------- launch sweep

LAUNCH_SUITE = "kernel_mv_launches"
#: (path, kernel) -> (precision, op, program tiles, loop tiles, warps, stages): the sweep that
#: chose ``tilax.rbf.config.GPU_PREFERRED`` (H200, N = M = 65536, D = 8, O = 16, float32). The
#: fast path runs at the default precision (its expansion kernels), the exact path at
#: ``"highest"`` (always the difference kernels). A ``bwd`` row times forward + backward
#: (``fwd_bwd``) with the two gradient launches (dq over query tiles, dk over key tiles) set to
#: the same tiles and the forward launch left at its default.
LAUNCH_GROUPS = {
    ("fast", "fwd"): (None, "fwd", (64, 128, 256), (32, 64, 128), (4, 8), (2, 3)),
    ("fast", "bwd"): (None, "fwd_bwd", (64, 128), (64, 128), (4, 8), (2, 3)),
    ("exact", "fwd"): ("highest", "fwd", (64, 128, 256), (32, 64, 128), (4, 8), (2,)),
    ("exact", "bwd"): ("highest", "fwd_bwd", (32, 64, 128), (32, 64, 128), (4, 8), (2,)),
}
LAUNCH_SHAPE = (65536, 8, 16)  # n = m, dim, out
#: Loop tiles of the Mosaic GPU gradient sweeps (``grad_backend="mosaic"`` rows of each
#: backward family; program tile 128), beside the Triton launches: the fast path's
#: (``mosaic.grad``) and the exact path's (``mosaic.exact_grad``); on Hopper
#: each is its group's default, with its ``BLOCK_L``.
MOSAIC_GRAD_LOOPS = {("fast", "bwd"): (64, 128), ("exact", "bwd"): (64,)}
#: Smoke (CPU, interpret mode: warps and stages are ignored): one launch per group at n = 64,
#: off the default (64 x 64 there), so that every path and kernel runs a replaced launch.
SMOKE_LAUNCH = (32, 32, 4, 2)
SMOKE_LAUNCH_SHAPE = (64, 8, 16)
#: The most one launch row may take (or ``--bench-row-limit`` if lower), its timed rounds
#: included: a launch that spills registers (10x slower; seconds per call on the exact path's
#: backward) is timed in fewer rounds instead of eating the call (``Runner``).
LAUNCH_ROW_LIMIT_S = 8.0
LAUNCH_PRIORITY = 25  # + the launch's distance from its group's default
# Wall time on one H200, estimated from the stored kernel_mv_tiles run (cf11ba3: 24 rows at 64k
# in 73 s; first call with compile 0.6-2.8 s forward, 1.6-10 s forward + backward) and the
# sweep's call times. Each row: its first call (compile included), a warm-up call, then up to
# 10 timed rounds (1 s of calls, at least 3 rounds), plus one untimed call for the gradient
# errors of a fwd_bwd row:
#   fast fwd   36 rows x ~2 s   (compile ~1.5 s, calls 2-6 ms)                    ~70 s
#   fast bwd   16 rows x ~4.5 s (compile 2-10 s, calls ~12 ms)                    ~70 s
#   exact fwd  18 rows x ~2 s   (compile ~1 s, calls 14-190 ms)                   ~35 s
#   exact bwd  18 rows x ~4.5 s (compile ~2 s, calls 70-600 ms; a spilling launch
#              of ~2 s a call is cut to one timed round by LAUNCH_ROW_LIMIT_S: ~9 s) ~80 s
# about 255 s of rows plus start-up: ~5 min; run it alone with --bench-budget 450 (one call of
# at most 8 minutes), or as two calls, -k fast (54 rows, ~2.5 min) and -k exact (36 rows,
# ~2 min, more if many exact launches spill).


@dataclasses.dataclass(frozen=True)
class RbfLaunchCase(RbfCase):
    """One row of the launch sweep: ``rbf_kernel_mv``'s Pallas path with one kernel family's
    launch replaced (bench-only: the config is built here, through
    ``tilax.rbf.config.default_config`` and ``tilax.rbf.vjp.kernel_mv_with_config``).

    ``path``: ``"fast"`` (expansion) or ``"exact"`` (differences); ``kernel``: ``"fwd"`` (the
    forward launch) or ``"bwd"`` (the dq and dk launches); ``default_launch``: the launch is the
    one ``default_config`` picks for this problem on this device. ``block_o`` (the value tile)
    stays the default's. ``grad_backend``: ``"mosaic"`` runs a ``bwd`` row's sweeps on
    ``tilax.rbf.mosaic.grad`` (Hopper; its program tile is 128 rows, warps and stages
    are its own), ``None`` the path's backend.
    """

    path: str = "fast"
    kernel: str = "fwd"
    block_p: int = 64
    block_l: int = 64
    num_warps: int = 4
    num_stages: int = 2
    default_launch: bool = False
    grad_backend: str | None = None

    row_limit_s = LAUNCH_ROW_LIMIT_S

    @property
    def group(self) -> str:
        return f"{self.path}_{self.kernel}"

    @property
    def launch(self) -> tuple[int, int, int, int]:
        return (self.block_p, self.block_l, self.num_warps, self.num_stages)

    @property
    def id(self) -> str:
        parts = [self.suite, self.group, *([self.grad_backend] if self.grad_backend else []),
                 f"bp{self.block_p}", f"bl{self.block_l}"]
        if not self.grad_backend:
            parts += [f"w{self.num_warps}", f"s{self.num_stages}"]
        parts += [f"n{self.n}", f"d{self.dim}", f"o{self.out}"]
        if self.precision is not None:
            parts.append(self.precision)
        parts.append(self.op)
        return "-".join(parts)

    def forward_backend(self) -> str:
        """A replaced forward launch runs the path's backend (the sweep measures Triton's
        launches on a GPU)."""
        if self.kernel == "fwd":
            from tilax import _pallas

            return _pallas.resolve_backend("pallas")
        return super().forward_backend()

    def extra_info(self) -> dict[str, Any]:
        return {**super().extra_info(), "path": self.path, "kernel": self.kernel,
                "block_p": self.block_p, "block_l": self.block_l,
                "num_warps": self.num_warps, "num_stages": self.num_stages,
                "default_launch": self.default_launch,
                **({} if self.grad_backend else {
                    "shared_memory_model_bytes": self.shared_memory_model()})}

    def backward_backend(self) -> str:
        """A ``bwd`` row's sweeps run its own launches: ``grad_backend``, else the path's."""
        if self.kernel == "bwd":
            from tilax import _pallas

            return self.grad_backend or _pallas.resolve_backend("pallas")
        return super().backward_backend()

    def config(self, backend: str):
        """The ``PallasConfig`` of this row: the default for the problem, with this row's
        launch in place of its group's (``dq`` and ``dk`` together for ``bwd``)."""
        from tilax.rbf import config as rbf_config

        cfg = default_launch_config(backend, self.precision, self.n, self.keys, self.dim,
                                    self.out)
        path = getattr(cfg, self.path)
        launch = rbf_config.Launch(self.block_p, self.block_l, self.block_o, self.num_warps,
                                      self.num_stages, backend=self.grad_backend)
        kernels = {"fwd": ("fwd",), "bwd": ("dq", "dk")}[self.kernel]
        path = dataclasses.replace(path, **dict.fromkeys(kernels, launch))
        return dataclasses.replace(cfg, **{self.path: path})

    def shared_memory_model(self) -> int:
        """``tilax.rbf.config``'s shared-memory estimate of this launch in bytes (the largest over
        the kernel calls it serves; no device needed), to set beside launches that fail to
        compile for want of shared memory."""
        from tilax import _pallas
        from tilax.rbf import config as rbf_config

        name = self.precision or "default"
        modes = (rbf_config.FAST_MODES if self.path == "fast" else
                 rbf_config.EXACT_MODES)[name]
        calls = rbf_config.path_calls(modes, self.dim, _pallas.round_up(self.out,
                                                                           self.block_o))
        launch = rbf_config.Launch(self.block_p, self.block_l, self.block_o, self.num_warps,
                                      self.num_stages)
        names = {"fwd": ("fwd",), "bwd": ("dq", "dk")}[self.kernel]
        return max(rbf_config.shared_memory_bytes(call, launch)
                   for name in names for call in calls[name])

    def unavailable_reason(self) -> str | None:
        if self.grad_backend == "mosaic":
            from tilax import _pallas

            reason = _pallas.mosaic_unavailable_reason()
            if reason:
                return f"unavailable: the Mosaic GPU gradient sweeps need Hopper ({reason})"
        return super().unavailable_reason()

    def build(self, state):
        from tilax import _pallas
        from tilax.rbf import numerics
        from tilax.rbf import vjp as rbf_vjp

        cfg = self.config(_pallas.resolve_backend("pallas"))
        if self.path == "fast":  # the run-time switch must take the path this row times
            inputs = state.inputs.get(_inputs_key(self), lambda: make_inputs(self))
            scaled = numerics.centered_scaled(inputs.q, inputs.k, inputs.scale)
            if not bool(numerics.fast_distance_ok(*scaled, cfg.precision)):
                raise ValueError("these inputs fail the fast path's error bound: the row would "
                                 "time the exact path")

        def op(q, k, v, scale):
            return rbf_vjp.kernel_mv_with_config(q, k, v, scale, cfg)

        return build_jax(self, state, op=op)


def default_launch_config(backend: str, precision, n: int, m: int, dim: int, out: int):
    from tilax.rbf import config as rbf_config

    return rbf_config.default_config(backend, precision, batch=1, n=n, m=m, out=out,
                                        dim=dim)


def group_default(path: str, kernel: str, backend: str, n: int, dim: int, out: int):
    """The ``tilax.rbf.config.Launch`` that ``default_config`` gives the group's kernel on this
    device; for ``bwd`` the dq launch (dk has the same tiles at n = m). Its ``backend`` is
    ``"mosaic"`` where a Hopper GPU runs the group on Mosaic GPU."""
    precision = LAUNCH_GROUPS[(path, kernel)][0]
    cfg = default_launch_config(backend, precision, n, n, dim, out)
    return getattr(getattr(cfg, path), "fwd" if kernel == "fwd" else "dq")


def _sweeps_agree(path: str, backend: str, n: int, dim: int, out: int) -> bool:
    """Whether the path's default dq and dk launches have the same tiles, warps and stages
    (on a GPU the exact path's dk takes shorter loop tiles: ``GPU_PREFERRED``)."""
    precision = LAUNCH_GROUPS[(path, "bwd")][0]
    cfg = getattr(default_launch_config(backend, precision, n, n, dim, out), path)
    return dataclasses.replace(cfg.dq, block_o=0) == dataclasses.replace(cfg.dk, block_o=0)


def launch_distance(launch: tuple, default: tuple) -> int:
    """Steps from the default: doublings of each tile and of the warps, plus stages apart."""
    steps = sum(abs(round(math.log2(a / b))) for a, b in zip(launch[:3], default[:3],
                                                            strict=True))
    return steps + abs(launch[3] - default[3])


def launch_cases(mode: str) -> list[RbfLaunchCase]:
    """The launch sweep. Full: ``LAUNCH_GROUPS`` (88 launches; the default launch is added
    where a device's default is off the grid) and the Mosaic GPU gradient sweeps at
    ``MOSAIC_GRAD_LOOPS`` in the backward families (3 rows); quick: each group's default that
    is a row of the grid, and those 3; smoke: ``SMOKE_LAUNCH`` at n = 64 (4 rows).

    Rows run nearest-first: priority ``LAUNCH_PRIORITY`` + the launch's distance from its
    group's default tiles (``launch_distance``), so the four defaults run first, then every
    launch one step from its default, and so on; the far corners (the exact path's large tiles,
    the likeliest to spill) last. ``default_launch`` marks the row that runs what
    ``default_config`` picks on this device, backend included: on Hopper the backwards' are
    Mosaic GPU rows, and the forwards' (the Mosaic GPU forwards, fast and exact) are none of
    the sweep's Triton rows (the ``kernel_mv`` suite times them); on other GPUs the exact
    backward's is none either (its dk launch differs from its dq launch; its distances count
    from the dq launch).
    """
    from tilax import _pallas

    if mode == "smoke":
        backend, (n, dim, out) = _pallas.resolve_backend("pallas"), SMOKE_LAUNCH_SHAPE
    else:  # the GPU's defaults, also when the grid is listed on a CPU
        backend, (n, dim, out) = "triton", LAUNCH_SHAPE
    cases = []
    for order, ((path, kernel), spec) in enumerate(LAUNCH_GROUPS.items()):
        precision, op, programs, loops, warps, stages = spec
        chosen = group_default(path, kernel, backend, n, dim, out)
        default = (chosen.block_p, chosen.block_l, chosen.num_warps, chosen.num_stages)
        # A row sets dq and dk to the same tiles: it is the default only where they agree.
        in_grid = chosen.backend is None and (kernel == "fwd" or _sweeps_agree(
            path, backend, n, dim, out))
        block_o = chosen.block_o
        if mode == "full":
            launches = list(itertools.product(programs, loops, warps, stages))
        elif mode == "quick":
            launches = []
        else:
            launches = [SMOKE_LAUNCH]
        if default not in launches and in_grid and mode != "smoke":
            launches.insert(0, default)
        for launch in launches:
            distance = launch_distance(launch, default)
            bp, bl, w, s = launch
            cases.append((distance, order, RbfLaunchCase(
                LAUNCH_SUITE, "pallas", op, n, dim, out, block_o=block_o, precision=precision,
                priority=LAUNCH_PRIORITY + distance, path=path, kernel=kernel, block_p=bp,
                block_l=bl, num_warps=w, num_stages=s,
                default_launch=launch == default and in_grid)))
        if mode != "smoke":
            for bl in MOSAIC_GRAD_LOOPS.get((path, kernel), ()):  # right after the defaults
                cases.append((0.5, order, RbfLaunchCase(
                    LAUNCH_SUITE, "pallas", op, n, dim, out, block_o=block_o,
                    precision=precision, priority=LAUNCH_PRIORITY, path=path, kernel=kernel,
                    block_p=128, block_l=bl, grad_backend="mosaic",
                    default_launch=(chosen.backend, chosen.block_l) == ("mosaic", bl))))
    cases.sort(key=lambda item: item[:2])  # stable: the grid order within a group and step
    return [case for _, _, case in cases]


def suite_cases(suite: str, mode: str) -> list[RbfCase]:
    return {"kernel_mv": kernel_mv_cases, "kde_density": kde_cases,
            "kernel_mv_tiles": tiles_cases, "kernel_mv_launches": launch_cases}[suite](mode)


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class RbfInputs:
    """Host (numpy float32) inputs of one shape: q, k, v, lengthscale, cotangent g."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray | None
    scale: np.ndarray  # [dim] lengthscale, or [] bandwidth for KDE
    g: np.ndarray


def make_inputs(case: RbfCase) -> RbfInputs:
    rng = np.random.default_rng(case.seed)
    q = rng.standard_normal((case.n, case.dim), dtype=np.float32)
    k = rng.standard_normal((case.keys, case.dim), dtype=np.float32)
    if case.suite == "kde_density":
        # Silverman-like bandwidth: the density stays well above underflow at these sizes.
        scale = np.float32(1.06 * case.keys ** (-1.0 / (case.dim + 4)) * 2.0)
        return RbfInputs(q, k, None, np.asarray(scale), rng.standard_normal(case.n, np.float32))
    v = rng.standard_normal((case.keys, case.out), dtype=np.float32)
    # sqrt(dim) keeps typical scaled squared distances near 2 whatever the dimension.
    scale = (math.sqrt(case.dim) * rng.uniform(0.8, 1.2, case.dim)).astype(np.float32)
    g = rng.standard_normal((case.n, case.out), dtype=np.float32)
    return RbfInputs(q, k, v, scale, g)


def _inputs_key(case: RbfCase) -> tuple:
    return ("rbf", case.suite == "kde_density", case.n, case.keys, case.dim, case.out, case.seed)


def masked_cotangent(g: np.ndarray, rows: int) -> np.ndarray:
    masked = np.zeros_like(g)
    masked[:rows] = g[:rows]
    return masked


# ----------------------------------------------------------------------------- reference


#: ``c`` of ``z = c r`` per Matérn kernel (tilax.kernel_mv's).
MATERN_RATES = {"matern12": 1.0, "matern32": math.sqrt(3.0), "matern52": math.sqrt(5.0)}


def _profile(profile: str | None, half_sq):
    """Kernel values and pair weights ``phi = -dk/ds`` of ``s = r^2 / 2`` (float64; for
    Matérn-1/2 ``phi = 0`` at ``r = 0``, tilax.kernel_mv's convention)."""
    import jax.numpy as jnp

    if profile is None:
        kernel = jnp.exp(-half_sq)
        return kernel, kernel
    r = jnp.sqrt(2.0 * half_sq)
    z = MATERN_RATES[profile] * r
    decay = jnp.exp(-z)
    if profile == "matern12":
        return decay, jnp.where(r > 0, decay / jnp.where(r > 0, r, 1.0), 0.0)
    if profile == "matern32":
        return (1 + z) * decay, 3 * decay
    return (1 + z + z * z / 3) * decay, 5 / 3 * (1 + z) * decay


def _reference_chunk(u, w, v, g, profile=None):
    """Float64 kernel sum and its gradients for one key chunk, in scaled coordinates
    ``u = q / l``, ``w = k / l`` (no autodiff: closed-form, chunk-local); ``profile`` a
    Matérn kernel or ``None`` (the Gaussian)."""
    import jax.numpy as jnp

    half_sq = 0.5 * (jnp.sum(u * u, 1)[:, None] + jnp.sum(w * w, 1)[None, :]) - u @ w.T
    kernel, weight = _profile(profile, jnp.maximum(half_sq, 0.0))
    a = weight * (g @ v.T)  # d loss / d (-s) of each pair
    row_a, col_a = jnp.sum(a, 1), jnp.sum(a, 0)
    a_w = a @ w
    d_u = a_w - u * row_a[:, None]
    d_w = a.T @ u - w * col_a[:, None]
    d_l = (jnp.sum(u * u * row_a[:, None], 0) - 2 * jnp.sum(u * a_w, 0)
           + jnp.sum(w * w * col_a[:, None], 0))
    return kernel @ v, kernel.T @ g, d_u, d_w, d_l


def reference(case: RbfCase, inputs: RbfInputs) -> dict:
    """Float64 output rows and gradients of ``sum(out[:R] * g[:R])`` (see module docstring),
    chunked over keys so any ``m`` fits."""
    import jax
    import jax.numpy as jnp

    rows = min(case.n, NUMERICS_ROWS)
    kde = case.suite == "kde_density"
    f64 = jnp.float64
    with jax.enable_x64(True):
        if kde:
            bandwidth = float(inputs.scale)
            scale = jnp.full((case.dim,), bandwidth, f64)
            norm = (2 * math.pi * bandwidth**2) ** (-case.dim / 2)
            values = np.full((case.keys, 1), norm / case.keys)
            g = jnp.asarray(inputs.g[:rows, None], f64)
        else:
            scale = jnp.asarray(inputs.scale, f64)
            values = inputs.v
            g = jnp.asarray(inputs.g[:rows], f64)
        u = jnp.asarray(inputs.q[:rows], f64) / scale
        chunk = max(1, min(case.keys, REFERENCE_CHUNK_ELEMENTS // rows))
        step = jax.jit(functools.partial(_reference_chunk, profile=case.profile))
        out = d_u = d_l = 0.0
        d_w, d_v = [], []
        for start in range(0, case.keys, chunk):
            stop = min(start + chunk, case.keys)
            w = np.zeros((chunk, case.dim))
            v = np.zeros((chunk, values.shape[1]))
            w[: stop - start] = inputs.k[start:stop]
            v[: stop - start] = values[start:stop]
            parts = step(u, jnp.asarray(w, f64) / scale, jnp.asarray(v, f64), g)
            out, d_u, d_l = out + parts[0], d_u + parts[2], d_l + parts[4]
            d_v.append(np.asarray(parts[1])[: stop - start])
            d_w.append(np.asarray(parts[3])[: stop - start])
        scale = np.asarray(scale)
        grads = {"dq": np.asarray(d_u) / scale, "dk": np.concatenate(d_w) / scale,
                 "dlengthscale": np.asarray(d_l) / scale}
        out = np.asarray(out)
        if kde:
            # the normaliser depends on the bandwidth too: d norm / dh = -dim / h * norm
            density_grad = float(np.sum(np.asarray(g) * out) * (-case.dim / bandwidth))
            grads["dlengthscale"] = float(np.sum(grads["dlengthscale"])) + density_grad
            return {"out": out[:, 0], **grads}
        return {"out": out, "dv": np.concatenate(d_v), **grads}


def numerics_info(case: RbfCase, state, inputs: RbfInputs, out, masked_grads) -> dict:
    """``rel_err`` for a row: ``out`` the impl's forward output, ``masked_grads`` (callable) the
    impl's gradients for the masked cotangent (fwd_bwd rows only)."""
    if not case.numerics:
        return {}
    rows = min(case.n, NUMERICS_ROWS)
    # (the inputs are shared across kernels; each kernel has its own reference)
    ref = state.references.get((*_inputs_key(case), case.profile),
                               lambda: reference(case, inputs))  # fmt: skip
    if case.op == "fwd":
        return {"rel_err": rel_err(np.asarray(out)[:rows], ref["out"])}
    grads = masked_grads()
    errors = {}
    for name, value in grads.items():
        value = np.asarray(value)
        errors[name] = rel_err(value[:rows] if name == "dq" else value, ref[name])
    return {"rel_err": errors}


# ----------------------------------------------------------------------------- JAX impls


def tilax_op(case: RbfCase):
    import tilax

    tiles = {name: getattr(case, name) for name in ("block_q", "block_k", "block_o")
             if getattr(case, name) is not None}
    if case.suite == "kde_density":
        return lambda q, k, h: tilax.rbf_kde_density(q, k, h, impl=case.impl, **tiles)
    if case.profile is not None:
        return lambda q, k, v, scale: tilax.kernel_mv(q, k, v, scale, kernel=case.profile,
                                                      impl=case.impl, precision=case.precision,
                                                      **tiles)  # fmt: skip
    return lambda q, k, v, scale: tilax.rbf_kernel_mv(q, k, v, scale, impl=case.impl,
                                                      precision=case.precision, **tiles)


def build_jax(case: RbfCase, state, op=None) -> JaxWorkload:
    """``op`` (default: the public API, ``tilax_op``) jitted as a forward call or as
    ``jax.vjp`` of it, with the case's inputs."""
    import jax
    import jax.numpy as jnp

    op = op or tilax_op(case)
    inputs = state.inputs.get(_inputs_key(case), lambda: make_inputs(case))
    kde = case.suite == "kde_density"
    primals = [jnp.asarray(inputs.q), jnp.asarray(inputs.k)]
    if not kde:
        primals.append(jnp.asarray(inputs.v))
    primals.append(jnp.asarray(inputs.scale))
    names = ("dq", "dk", "dlengthscale") if kde else ("dq", "dk", "dv", "dlengthscale")

    @jax.jit
    def fwd_bwd(*args):
        *primal_args, g = args
        out, vjp = jax.vjp(op, *primal_args)
        return out, vjp(g)

    def masked_grads():
        # The timed function itself, with another cotangent of the same shape: no new compile.
        g = jnp.asarray(masked_cotangent(inputs.g, min(case.n, NUMERICS_ROWS)))
        _, grads = fwd_bwd(*primals, g)
        return dict(zip(names, grads, strict=True))

    def inspect(out) -> dict:
        forward = out if case.op == "fwd" else out[0]
        return numerics_info(case, state, inputs, forward, masked_grads)

    if case.op == "fwd":
        return JaxWorkload(jax.jit(op), tuple(primals), inspect)
    return JaxWorkload(fwd_bwd, (*primals, jnp.asarray(inputs.g)), inspect)


# ----------------------------------------------------------------------------- torch peers


def _import_torch():
    try:
        import torch
    except ModuleNotFoundError as exc:  # not installed: not attempted; any other error fails
        raise Unavailable(
            f"unavailable: torch or a module it needs is not installed here ({exc})") from exc
    return torch


def torch_kernel_mv(torch, q, k, v, scale):
    """The full kernel matrix in PyTorch (float32 matmuls; TF32 stays off, torch's default)."""
    qs, ks = q / scale, k / scale
    half_sq = 0.5 * ((qs * qs).sum(-1)[:, None] + (ks * ks).sum(-1)[None, :]) - qs @ ks.T
    return torch.exp(-half_sq.clamp_min(0.0)) @ v


def keops_kernel_mv(q, k, v, scale):
    """The kernel sum as a KeOps LazyTensor reduction (never materialises n x m)."""
    from pykeops.torch import LazyTensor

    q_i = LazyTensor((q / scale)[:, None, :])
    k_j = LazyTensor((k / scale)[None, :, :])
    weights = (-0.5 * ((q_i - k_j) ** 2).sum(-1)).exp()
    return weights @ v


KEOPS_PROBE = """
import torch
from pykeops.torch import LazyTensor
device = "cuda" if torch.cuda.is_available() else "cpu"
q = torch.randn(64, 3, device=device, requires_grad=True)
k = torch.randn(80, 3, device=device)
v = torch.randn(80, 2, device=device)
w = (-0.5 * ((LazyTensor(q[:, None, :]) - LazyTensor(k[None, :, :])) ** 2).sum(-1)).exp()
out = w @ v
out.sum().backward()
ref = torch.exp(-0.5 * torch.cdist(q, k) ** 2) @ v
assert torch.allclose(out, ref, atol=1e-4), float((out - ref).abs().max())
print("keops probe ok")
"""


def exit_status(returncode: int) -> str:
    """"exit code 1", or for a process a signal ended, "crashed: SIGSEGV (signal 11)"."""
    if returncode < 0:
        try:
            return f"crashed: {signal.Signals(-returncode).name} (signal {-returncode})"
        except ValueError:
            return f"ended by signal {-returncode}"
    return f"exit code {returncode}"


class KeOpsFailed(RuntimeError):
    """KeOps ran its probe and crashed or hung: its rows are failures, with the probe's error."""


def probe_keops(state) -> None:
    """Run a tiny KeOps reduction (forward + backward) in a fresh subprocess once per session:
    KeOps compiles C++/CUDA at first use and has crashed the process doing so. Time limit: six
    times the per-row limit (120 s full, 60 s quick), within what is left of the budget.

    A probe that ran and crashed is an attempt: every KeOps row then fails (not skipped) with
    the probe's error. Only a missing module makes the rows "unavailable" (``precheck``)."""
    if "keops" not in state.probes:
        settings = state.settings
        timeout = max(30.0, min(6 * settings.row_limit_s, settings.remaining()))
        try:
            proc = subprocess.run([sys.executable, "-c", KEOPS_PROBE], capture_output=True,
                                  text=True, timeout=timeout)
            if proc.returncode == 0:
                state.probes["keops"] = None
            else:
                tail = (proc.stderr or proc.stdout).strip()[-1200:]
                state.probes["keops"] = (f"KeOps failed its probe in a fresh subprocess "
                                         f"({exit_status(proc.returncode)}): {tail}")
        except subprocess.TimeoutExpired:
            state.probes["keops"] = (f"KeOps probe timed out after {timeout:.0f} s "
                                     f"(compiling its first formula)")
    if state.probes["keops"]:
        raise KeOpsFailed(state.probes["keops"])



class TorchWorkload:
    """torch_dense or keops on the GPU (CPU where torch has no CUDA). ``start`` runs one call
    without waiting for the device, ``finish`` synchronises, ``call`` does both."""

    def __init__(self, case: RbfCase, state, keops: bool):
        torch = _import_torch()
        if case.suite == "kde_density":
            raise Unavailable(f"unsupported: no {case.impl} KDE peer")
        self.torch, self.case, self.state = torch, case, state
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.op = keops_kernel_mv if keops else (
            lambda q, k, v, s: torch_kernel_mv(torch, q, k, v, s))
        self.inputs = state.inputs.get(_inputs_key(case), lambda: make_inputs(case))
        self.tensors = [torch.from_numpy(a).to(self.device) for a in
                        (self.inputs.q, self.inputs.k, self.inputs.v, self.inputs.scale)]
        self.g = torch.from_numpy(self.inputs.g).to(self.device)

    def _sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def _fwd_bwd(self, g):
        torch = self.torch
        leaves = [t.detach().requires_grad_(True) for t in self.tensors]
        out = self.op(*leaves)
        grads = torch.autograd.grad(out, leaves, g)
        return out.detach(), grads

    def start(self):
        if self.case.op == "fwd":
            with self.torch.no_grad():
                return self.op(*self.tensors)
        return self._fwd_bwd(self.g)

    def finish(self, pending):
        self._sync()
        return pending

    def call(self):
        return self.finish(self.start())

    def inspect(self, out) -> dict:
        forward = out if self.case.op == "fwd" else out[0]

        def masked_grads():
            rows = min(self.case.n, NUMERICS_ROWS)
            g = self.torch.from_numpy(masked_cotangent(self.inputs.g, rows)).to(self.device)
            _, grads = self._fwd_bwd(g)
            return {name: grad.cpu().numpy() for name, grad in
                    zip(("dq", "dk", "dv", "dlengthscale"), grads, strict=True)}

        return numerics_info(self.case, self.state, self.inputs, forward.cpu().numpy(),
                             masked_grads)

    def memory(self) -> tuple[int | None, int | None]:
        return torch_device_memory(self.torch)

    def close(self) -> None:
        self.tensors, self.g = [], None
        if self.device == "cuda":
            self.torch.cuda.empty_cache()
