"""Gaussian-process benchmark cases (family ``gp``): the log marginal likelihood with its
gradient at up to a million points, its peers, and a whole hyperparameter fit.

Suites (``extra_info["suite"]``):

- ``gp``: one evaluation of ``tilax.gp.mll`` and its gradient with respect to the three
  hyperparameters (``jax.value_and_grad``, op ``mll_grad``), at the generating hyperparameters,
  ``n`` = 16 384, 65 536, 262 144 and 1 048 576, ``D = 8``; beside it the peers
  ``gpytorch_keops`` (GPyTorch's ``ExactMarginalLogLikelihood`` on its KeOps RBF kernel, the
  same CG settings, ``backward()`` for the gradient), ``tinygp`` (tinygp's dense Cholesky,
  ``jax.value_and_grad``) and ``dense`` (``tilax.gp.reference.dense_mll``, tilax's own dense
  Cholesky), the dense ones where ``DENSE_COPIES`` matrices of ``n x n`` fit on the device (a
  skipped row with "does not fit" beyond).
- ``gp_rank``: ``tilax.gp.mll`` at the preconditioner ranks of ``RANK_SWEEP`` at 65 536 and
  262 144 points: the CG iterations and time that choose ``MLL_SETTINGS``' rank.
- ``gp_fit``: Adam on the log marginal likelihood at ``n = 1 048 576`` from ``FIT_START`` until
  every hyperparameter is within ``FIT_TOLERANCE`` (10%) of the generating one; the row's time
  is the fit's wall time, with its steps, final hyperparameters and every step's values. A fit
  that reaches its time limit first is a failed row that keeps its steps (``stopped: ...``).

The data: a known GP. ``x ~ N(0, I_D)``; ``f`` is a draw of the zero-mean GP with covariance
``outputscale * k_F`` where ``k_F`` is the random-Fourier-feature approximation of the RBF
kernel with ``F = RFF_FEATURES`` features (Rahimi and Recht, 2007):
``f(x) = sqrt(2 outputscale / F) sum_j a_j cos(w_j . x + b_j)`` with ``w_j ~ N(0, I / l^2)``,
``b_j ~ U[0, 2 pi)``, ``a_j ~ N(0, 1)``, whose covariance has expectation ``outputscale *
exp(-|x - x'|^2 / (2 l^2))`` and deviates from it by ``O(1 / sqrt(F))``; ``y = f(x) +
sqrt(noise) * eps``. Drawing the exact GP at a million points densely is impossible (the
Cholesky factor of a 10^6 x 10^6 matrix); this draw costs ``O(n F D)``.
The generating hyperparameters are ``GENERATING``; ``test_bench_gp`` checks on a CPU that the
dense likelihood's maximiser on these data is within 10% of them.

Numerics of a ``gp`` row: ``mll`` (the value, float32), ``grad`` (``d mll / d`` each
hyperparameter), ``cg_iterations`` and ``relative_residual`` (tilax), and where the float64
dense reference fits on the device (value and gradient: ``REFERENCE_GRAD_COPIES`` matrices of
``n x n`` float64; value alone: ``REFERENCE_VALUE_COPIES``): ``rel_err_mll`` ``|mll - ref| /
|ref|`` and ``rel_err_grad``, the norm-wise relative error of the gradient with respect to the
log-hyperparameters (``theta * d mll / d theta``: the three on one scale), against
``dense_mll`` in float64 on the same data.

The unit of work (``work``, for predicting a size's time from the last one of its config) is
``n^2.5``: each CG iteration is a kernel sum over ``n^2`` pairs, and the iterations grow about
as ``sqrt(n)`` at fixed hyperparameters (see ``MLL_SETTINGS``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import time
from typing import Any

import numpy as np
from bench_harness import JaxWorkload, Unavailable, record_external_timings, torch_device_memory

PARAM_NAMES = ("lengthscale", "outputscale", "noise")
#: The hyperparameters of the known GP the data are drawn from (a scalar lengthscale).
GENERATING = {"lengthscale": 2.0, "outputscale": 1.0, "noise": 0.1}
DIM = 8
RFF_FEATURES = 8192
DATA_CHUNK = 65536  # rows of x per chunk of the feature draw ([chunk, F] floats at a time)
SIZES = (16384, 65536, 262144, 1048576)
#: The kernels of the ``gp`` suite; each peer maps a name to its own kernel class below.
KERNELS = ("rbf",)
# torch's rows first at each n: JAX's memory pool keeps what the dense rows grew it to.
MLL_IMPLS = ("gpytorch_keops", "tilax", "tinygp", "dense")
DENSE_IMPLS = ("tinygp", "dense")
#: float32 ``n x n`` arrays a dense MLL-with-gradient holds at its peak (the covariance, its
#: Cholesky factor, and the backward pass's solves of the factor): an estimate for skipping.
DENSE_COPIES = 6
REFERENCE_GRAD_COPIES = 6  # float64 n x n arrays of the reference's value and gradient
REFERENCE_VALUE_COPIES = 4  # ... of its value alone (distances, covariance, factor, workspace)
#: tilax.gp.mll's settings in the suite, shared by the GPyTorch peer (its settings of the same
#: names: cg_tolerance, max_cg_iterations, num_trace_samples, max_preconditioner_size,
#: max_lanczos_quadrature_iterations): tilax's defaults except tol (0.01 instead of 1e-3), with
#: the default rank above 1 024 points, 400, written out (a row keeps its rank whatever the
#: default; Wang et al. 2019 used 100 at a million points). The rank: CG's iterations grow
#: about as sqrt(n) on these data (on a CPU, tol 0.01, rank 100: 9 at n = 2 048, 18 at 8 192)
#: and fall with the rank (8 192 points: 33, 18, 13, 6 at ranks 50, 100, 200, 400), while a
#: rank-400 factor's O(400^2 n) work is far less than one CG iteration's n^2 kernel sum at a
#: million points (an estimate); ``gp_rank`` measures the choice on the GPU.
MLL_SETTINGS = {"num_probes": 16, "tol": 0.01, "preconditioner_rank": 400, "max_iters": 1000,
                "lanczos_iters": 100}

#: The fit starts where GPyTorch's modules start (every raw parameter 0: softplus(0) = 0.693).
FIT_START = {"lengthscale": 0.693, "outputscale": 0.693, "noise": 0.693}
FIT_TOLERANCE = 0.1  # the stopping rule: every |theta / theta_generating - 1| <= 0.1
#: The fit's MLL settings: a looser CG tolerance and fewer probes than an evaluation's, as
#: GPyTorch trains (its training cg_tolerance is 1); see ``FitCase``.
FIT_SETTINGS = {"num_probes": 8, "tol": 0.1, "preconditioner_rank": 400, "max_iters": 1000,
                "lanczos_iters": 100}


SMOKE_SETTINGS = {"preconditioner_rank": 10, "lanczos_iters": 10}


@dataclasses.dataclass(frozen=True)
class GpCase:
    """One ``gp`` row: ``value_and_grad`` of the log marginal likelihood of one impl at one n."""

    impl: str
    n: int
    kernel: str = "rbf"
    dim: int = DIM
    num_probes: int = MLL_SETTINGS["num_probes"]
    tol: float = MLL_SETTINGS["tol"]
    preconditioner_rank: int = MLL_SETTINGS["preconditioner_rank"]
    max_iters: int = MLL_SETTINGS["max_iters"]
    lanczos_iters: int = MLL_SETTINGS["lanczos_iters"]
    precision: str | None = "highest"
    priority: int = 40
    seed: int = 0
    suite: str = "gp"  # or "gp_rank"

    family = "gp"
    op = "mll_grad"
    dtype = "float32"
    # A row's own limit (the session's --bench-row-limit applies where lower): with a raised
    # session limit, a million-point row's timed rounds are cut to what fits 400 s after its
    # compile and warm-up calls, at least one (see bench_harness.Runner.capped_plan).
    row_limit_s = 400.0

    @property
    def id(self) -> str:
        rank = f"-r{self.preconditioner_rank}" if self.suite == "gp_rank" else ""
        return f"{self.suite}-{self.impl}-{self.kernel}-n{self.n}-d{self.dim}{rank}-mll_grad"

    @property
    def iterative(self) -> bool:
        """CG and stochastic Lanczos quadrature (the settings apply), not a Cholesky."""
        return self.impl in ("tilax", "gpytorch_keops")

    def extra_info(self) -> dict[str, Any]:
        info = {"family": "gp", "suite": self.suite, "impl": self.impl, "dtype": self.dtype,
                "op": self.op, "n": self.n, "dim": self.dim, "kernel": self.kernel,
                "hyperparameters": dict(GENERATING), "data": data_description(self.seed)}
        if self.iterative:
            info.update(num_probes=self.num_probes, tol=self.tol,
                        preconditioner_rank=self.preconditioner_rank, max_iters=self.max_iters,
                        lanczos_iters=self.lanczos_iters)
        if self.impl == "tilax":
            info["precision"] = self.precision
        return info

    def scale_key(self) -> tuple:
        fields = dataclasses.asdict(self)
        for name in ("n", "priority"):
            fields.pop(name)
        return ("gp",) + tuple(sorted(fields.items()))

    def size_label(self) -> str:
        return f"n={self.n}"

    def work(self) -> float:
        return float(self.n) ** 2.5

    def rates(self, median_s: float) -> dict[str, float]:
        return {"evals_per_s": 1.0 / median_s}

    def precheck(self, state) -> str | None:
        if self.impl in DENSE_IMPLS and state.device_bytes is not None:
            needed = DENSE_COPIES * self.n**2 * 4
            if needed > 0.9 * state.device_bytes:
                return (f"skipped: not attempted, does not fit: a dense Cholesky MLL with its "
                        f"gradient keeps about {DENSE_COPIES} n x n float32 matrices, "
                        f"{needed / 2**30:.0f} GiB; the device has "
                        f"{state.device_bytes / 2**30:.0f} GiB")
        if (self.impl == "gpytorch_keops" and self.n > SIZES[1]
                and self.scale_key() not in state.last_call):
            # A KeOps MLL at 262k+ points may run for many minutes, and no call can be stopped
            # from inside the process: only sizes whose time a smaller one predicts are tried.
            return ("skipped: not attempted, no smaller size of gpytorch_keops ran in this "
                    "process to predict this one's time from (run it with the smaller sizes)")
        needs = {"gpytorch_keops": ("torch", "gpytorch", "pykeops"), "tinygp": ("tinygp",)}
        for module in needs.get(self.impl, ()):
            if importlib.util.find_spec(module) is None:
                return f"unavailable: {module} is not installed here"
        return None

    def build(self, state):
        data = state.inputs.get(("gp", self.n, self.dim, self.seed),
                                lambda: known_gp_data(self.n, self.dim, self.seed))
        if self.impl == "gpytorch_keops":
            return GpytorchWorkload(self, state, data)
        return build_jax(self, state, data)

    def to_spec(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- case lists


def mll_cases(mode: str) -> list[GpCase]:
    """The ``gp`` suite: every impl at every size, size-major (a size's time predicts the
    next one's; every impl at one n shares its data and reference)."""
    sizes = {"smoke": (64,), "quick": SIZES[:2]}.get(mode, SIZES)
    # Smoke: the machinery only; a short quadrature (100 Lanczos steps take seconds on a CPU).
    settings = SMOKE_SETTINGS if mode == "smoke" else {}
    return [GpCase(impl, n, kernel=kernel, priority=40 + index, **settings)
            for index, n in enumerate(sizes) for kernel in KERNELS for impl in MLL_IMPLS]


@dataclasses.dataclass(frozen=True)
class FitCase:
    """The ``gp_fit`` row: Adam on ``-mll / n`` in log-hyperparameters from ``start``
    (``FIT_START``; Adam's moments 0.9 and 0.999, epsilon 1e-8, ``learning_rate``), a fresh
    probe key per step, until every hyperparameter is within ``FIT_TOLERANCE`` of
    ``GENERATING`` (checked after each update), or ``max_steps``, or ``time_limit_s`` of
    fitting (the budget left to the suite if less)."""

    n: int
    kernel: str = "rbf"
    dim: int = DIM
    start: tuple[float, ...] = tuple(FIT_START[k] for k in PARAM_NAMES)  # PARAM_NAMES' order
    # From FIT_START, Adam with the exact (dense) gradient met the rule after 29 steps at
    # learning rate 0.2 (46 at 0.1, 23 at 0.3; n = 2048 on a CPU): 0.2 keeps the million-point
    # fit inside one device call.
    learning_rate: float = 0.2
    max_steps: int = 300
    time_limit_s: float = 480.0
    num_probes: int = FIT_SETTINGS["num_probes"]
    tol: float = FIT_SETTINGS["tol"]
    preconditioner_rank: int = FIT_SETTINGS["preconditioner_rank"]
    max_iters: int = FIT_SETTINGS["max_iters"]
    lanczos_iters: int = FIT_SETTINGS["lanczos_iters"]
    precision: str | None = "highest"
    priority: int = 45
    seed: int = 0

    family = "gp"
    suite = "gp_fit"
    impl = "tilax"
    op = "fit"
    dtype = "float32"

    @property
    def id(self) -> str:
        return f"gp_fit-tilax-{self.kernel}-n{self.n}-d{self.dim}-adam"

    def extra_info(self) -> dict[str, Any]:
        return {"family": "gp", "suite": "gp_fit", "impl": "tilax", "dtype": self.dtype,
                "op": "fit", "n": self.n, "dim": self.dim, "kernel": self.kernel,
                "generating": dict(GENERATING),
                "start": dict(zip(PARAM_NAMES, self.start, strict=True)),
                "stopping_rule": (f"every hyperparameter within {FIT_TOLERANCE:.0%} of the "
                                  f"generating one"),
                "optimizer": f"adam lr={self.learning_rate} on log-hyperparameters",
                "max_steps": self.max_steps, "time_limit_s": self.time_limit_s,
                "num_probes": self.num_probes, "tol": self.tol,
                "preconditioner_rank": self.preconditioner_rank, "max_iters": self.max_iters,
                "lanczos_iters": self.lanczos_iters, "precision": self.precision,
                "data": data_description(self.seed)}

    def scale_key(self) -> tuple:
        return ("gp_fit", self.kernel, self.dim)

    def size_label(self) -> str:
        return f"n={self.n}"

    def work(self) -> float:
        return 0.0  # one fit: no time per call to scale

    def rates(self, median_s: float) -> dict[str, float]:
        return {}

    def precheck(self, state) -> str | None:
        return None


def fit_cases(mode: str) -> list[FitCase]:
    if mode == "smoke":  # the machinery only: a few steps, stopped by max_steps
        return [FitCase(128, max_steps=2, time_limit_s=120.0, **SMOKE_SETTINGS)]
    return [FitCase(65536 if mode == "quick" else 1048576)]


#: The preconditioner ranks of the ``gp_rank`` sweep: CG's iterations fall with the rank (on
#: a CPU at n = 8 192, tol 0.01: 33 at rank 50, 18 at 100, 13 at 200, 6 at 400) while the
#: preconditioner's cost grows; the sweep measures where the sum is least at scale.
RANK_SWEEP = (50, 100, 200, 400, 800, 1600)


def rank_cases(mode: str) -> list[GpCase]:
    """The ``gp_rank`` suite: ``tilax.gp.mll`` at each preconditioner rank, the suite's other
    settings, 65 536 and 262 144 points (smoke: two ranks at 64 points)."""
    if mode == "smoke":
        return [GpCase("tilax", 64, preconditioner_rank=rank, lanczos_iters=10, suite="gp_rank",
                       priority=46) for rank in (4, 16)]
    sizes = (65536,) if mode == "quick" else (65536, 262144)
    return [GpCase("tilax", n, preconditioner_rank=rank, suite="gp_rank", priority=46 + index)
            for index, n in enumerate(sizes) for rank in RANK_SWEEP]


def suite_cases(suite: str, mode: str) -> list:
    return {"gp": mll_cases, "gp_fit": fit_cases, "gp_rank": rank_cases}[suite](mode)


# ----------------------------------------------------------------------------- data


def data_description(seed: int) -> str:
    return (f"x ~ N(0, I), y = f(x) + sqrt(noise) eps, f a draw of the GP with the generating "
            f"params' RBF kernel approximated by {RFF_FEATURES} random Fourier features "
            f"(seed {seed})")


def known_gp_data(n: int, dim: int, seed: int = 0, generating: dict | None = None,
                  features: int = RFF_FEATURES):
    """``(x [n, dim], y [n])`` float32 on the default device: the known GP of the module
    docstring with hyperparameters ``generating`` (default ``GENERATING``)."""
    import jax
    import jax.numpy as jnp

    generating = GENERATING if generating is None else generating
    key_x, key_w, key_b, key_a, key_e = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(key_x, (n, dim), jnp.float32)
    frequencies = jax.random.normal(key_w, (dim, features), jnp.float32)
    frequencies = frequencies / generating["lengthscale"]
    phases = jax.random.uniform(key_b, (features,), jnp.float32, 0.0, 2 * math.pi)
    weights = jax.random.normal(key_a, (features,), jnp.float32)
    scale = math.sqrt(2 * generating["outputscale"] / features)
    chunk = min(n, DATA_CHUNK)
    chunks = -(-n // chunk)
    padded = jnp.concatenate([x, jnp.zeros((chunks * chunk - n, dim), x.dtype)])

    @jax.jit
    def draw(points):
        def one(block):
            angles = jnp.dot(block, frequencies, precision=jax.lax.Precision.HIGHEST)
            return scale * jnp.dot(jnp.cos(angles + phases), weights,
                                   precision=jax.lax.Precision.HIGHEST)

        return jax.lax.map(one, points.reshape(chunks, chunk, dim)).reshape(-1)

    f = draw(padded)[:n]
    y = f + math.sqrt(generating["noise"]) * jax.random.normal(key_e, (n,), jnp.float32)
    return jax.block_until_ready((x, y))


def params_array(values: dict):
    import jax.numpy as jnp

    return {name: jnp.float32(values[name]) for name in PARAM_NAMES}


# ----------------------------------------------------------------------------- reference


def reference(case: GpCase, state, data) -> dict | None:
    """The float64 dense MLL (and its gradient where it fits) at the generating params, or
    ``None`` where not even the value fits. Cached per data set for the rows of one n."""
    def compute():
        import jax
        import jax.numpy as jnp

        from tilax.gp.reference import dense_mll

        copies = (REFERENCE_GRAD_COPIES, REFERENCE_VALUE_COPIES)
        fits = [state.device_bytes is None or c * case.n**2 * 8 <= 0.8 * state.device_bytes
                for c in copies]
        if not any(fits):
            return None
        with jax.enable_x64(True):
            x = jnp.asarray(np.asarray(data[0]), jnp.float64)
            y = jnp.asarray(np.asarray(data[1]), jnp.float64)
            params = {name: jnp.float64(GENERATING[name]) for name in PARAM_NAMES}
            fn = lambda p: dense_mll(p, x, y, kernel=case.kernel)  # noqa: E731
            if fits[0]:
                value, grads = jax.jit(jax.value_and_grad(fn))(params)
                return {"mll": float(value), "grad": {k: float(v) for k, v in grads.items()}}
            return {"mll": float(jax.jit(fn)(params)), "grad": None}

    return state.references.get(("gp", case.n, case.dim, case.seed, case.kernel), compute)


def numerics(case: GpCase, state, data, value, grads, extra: dict | None = None) -> dict:
    """The row's values, and their errors against the float64 reference where it ran."""
    info = {"mll": float(value), "grad": {k: float(grads[k]) for k in PARAM_NAMES}}
    info.update(extra or {})
    ref = reference(case, state, data)
    if ref is None:
        info["reference"] = "none: the float64 dense reference does not fit on the device"
        return info
    info["reference"] = "float64 dense Cholesky (tilax.gp.reference.dense_mll)"
    info["mll_reference"] = ref["mll"]
    info["rel_err_mll"] = abs(float(value) - ref["mll"]) / abs(ref["mll"])
    if ref["grad"] is not None:
        scale = np.array([GENERATING[k] for k in PARAM_NAMES])
        ours = scale * np.array([float(grads[k]) for k in PARAM_NAMES])
        theirs = scale * np.array([ref["grad"][k] for k in PARAM_NAMES])
        info["grad_reference"] = ref["grad"]
        info["rel_err_grad"] = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
    return info


# ----------------------------------------------------------------------------- JAX impls

#: tinygp's kernel class for each kernel name (``outputscale * Kernel(scale=lengthscale)``).
TINYGP_KERNELS = {"rbf": "ExpSquared"}


def jax_mll(case: GpCase):
    """``params -> (mll, info)`` of the case's impl on given data: ``(params, x, y, key)``."""
    import tilax.gp
    from tilax.gp.reference import dense_mll

    if case.impl == "tilax":
        settings = {name: getattr(case, name) for name in MLL_SETTINGS}
        return lambda p, x, y, key: tilax.gp.mll(p, x, y, kernel=case.kernel, key=key,
                                                 precision=case.precision, return_info=True,
                                                 **settings)
    if case.impl == "dense":
        return lambda p, x, y, key: (dense_mll(p, x, y, kernel=case.kernel), {})
    if case.impl == "tinygp":
        try:
            from tinygp import GaussianProcess, kernels
        except ImportError as exc:
            raise Unavailable(f"unavailable: tinygp cannot be imported ({exc})") from exc
        kernel_class = getattr(kernels, TINYGP_KERNELS[case.kernel])

        def tinygp_mll(p, x, y, key):
            kernel = p["outputscale"] * kernel_class(scale=p["lengthscale"])
            return GaussianProcess(kernel, x, diag=p["noise"]).log_probability(y), {}

        return tinygp_mll
    raise ValueError(f"no JAX impl {case.impl!r}")


def build_jax(case: GpCase, state, data) -> JaxWorkload:
    import jax

    x, y = data
    fn = jax_mll(case)
    step = jax.jit(jax.value_and_grad(fn, has_aux=True))
    args = (params_array(GENERATING), x, y, jax.random.key(case.seed + 1))

    def inspect(out) -> dict:
        (value, info), grads = out
        extra = {key: (int(v) if key == "cg_iterations" else float(v))
                 for key, v in info.items()}
        return numerics(case, state, data, value, grads, extra)

    return JaxWorkload(step, args, inspect)


# ----------------------------------------------------------------------------- GPyTorch peer

#: GPyTorch's KeOps kernel class for each kernel name, with its keyword arguments.
GPYTORCH_KERNELS = {"rbf": ("RBFKernel", {})}


class GpytorchWorkload:
    """GPyTorch's exact GP (zero mean, ``ScaleKernel`` of a KeOps kernel, Gaussian likelihood)
    at the generating hyperparameters: ``ExactMarginalLogLikelihood`` times ``n`` (GPyTorch
    divides by ``n``) and ``backward()``, with CG forced at every size
    (``max_cholesky_size(0)``) and the case's CG settings. The gradients with respect to the
    raw (softplus) parameters are turned into gradients with respect to the hyperparameters."""

    def __init__(self, case: GpCase, state, data):
        import bench_rbf

        try:
            import gpytorch
            import torch
        except ImportError as exc:
            raise Unavailable(f"unavailable: gpytorch cannot be imported ({exc})") from exc
        bench_rbf.probe_keops(state)  # KeOps compiles at first use: a failure row if it cannot
        self.torch, self.gpytorch, self.case, self.state, self.data = (
            torch, gpytorch, case, state, data)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        x = torch.from_numpy(np.array(data[0])).to(self.device)
        y = torch.from_numpy(np.array(data[1])).to(self.device)
        name, kwargs = GPYTORCH_KERNELS[case.kernel]
        base = getattr(gpytorch.kernels.keops, name)(**kwargs)

        class ExactGP(gpytorch.models.ExactGP):
            def __init__(self, likelihood):
                super().__init__(x, y, likelihood)
                self.mean_module = gpytorch.means.ZeroMean()
                self.covar_module = gpytorch.kernels.ScaleKernel(base)

            def forward(self, points):
                return gpytorch.distributions.MultivariateNormal(
                    self.mean_module(points), self.covar_module(points))

        self.likelihood = gpytorch.likelihoods.GaussianLikelihood()
        self.model = ExactGP(self.likelihood).to(self.device)
        self.model.covar_module.base_kernel.lengthscale = GENERATING["lengthscale"]
        self.model.covar_module.outputscale = GENERATING["outputscale"]
        self.model.likelihood.noise = GENERATING["noise"]
        self.model.train()
        self.mll = gpytorch.mlls.ExactMarginalLogLikelihood(self.likelihood, self.model)
        self.x, self.y = x, y
        self.raw = {"lengthscale": self.model.covar_module.base_kernel.raw_lengthscale,
                    "outputscale": self.model.covar_module.raw_outputscale,
                    "noise": self.model.likelihood.noise_covar.raw_noise}

    def _settings(self):
        import contextlib

        settings, case = self.gpytorch.settings, self.case
        stack = contextlib.ExitStack()
        for setting in (settings.max_cholesky_size(0), settings.cg_tolerance(case.tol),
                        settings.max_cg_iterations(case.max_iters),
                        settings.num_trace_samples(case.num_probes),
                        settings.max_preconditioner_size(case.preconditioner_rank),
                        settings.max_lanczos_quadrature_iterations(case.lanczos_iters)):
            stack.enter_context(setting)
        return stack

    def start(self):
        self.model.zero_grad()
        with self._settings():
            value = self.mll(self.model(self.x), self.y) * self.case.n
            value.backward()
        return value.detach()

    def finish(self, pending):
        if self.device == "cuda":
            self.torch.cuda.synchronize()
        return pending

    def call(self):
        return self.finish(self.start())

    def inspect(self, out) -> dict:
        torch = self.torch
        # d theta / d raw = sigmoid(raw) for theta = softplus(raw) (+ a constant bound)
        grads = {name: float((raw.grad / torch.sigmoid(raw.detach())).sum())
                 for name, raw in self.raw.items()}
        with self._settings():  # whether GPyTorch's KeOps kernel ran KeOps at these settings
            keops = self.gpytorch.kernels.keops.keops_kernel._use_keops(self.x, self.x)
        return numerics(self.case, self.state, self.data, float(out), grads,
                        {"keops_used": bool(keops)})

    def memory(self) -> tuple[int | None, int | None]:
        return torch_device_memory(self.torch)

    def close(self) -> None:
        self.model = self.mll = self.x = self.y = None
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the fit


def within(params: dict, tolerance: float = FIT_TOLERANCE) -> bool:
    """The stopping rule: every hyperparameter within ``tolerance`` of the generating one."""
    return all(abs(params[k] / GENERATING[k] - 1) <= tolerance for k in PARAM_NAMES)


def fit_step(case: FitCase):
    """One jitted Adam step on ``-mll / n`` in log-hyperparameters:
    ``(log_params, moments, step, x, y, key) -> (log_params, moments, mll / n, info)``."""
    import jax
    import jax.numpy as jnp

    import tilax.gp

    settings = {name: getattr(case, name) for name in FIT_SETTINGS}

    def loss(log_params, x, y, key):
        params = jax.tree.map(jnp.exp, log_params)
        value, info = tilax.gp.mll(params, x, y, kernel=case.kernel, key=key,
                                   precision=case.precision, return_info=True, **settings)
        return -value / x.shape[0], info

    @jax.jit
    def step(log_params, moments, count, x, y, key):
        (value, info), grads = jax.value_and_grad(loss, has_aux=True)(log_params, x, y, key)
        first, second = moments
        first = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, first, grads)
        second = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, second, grads)
        t = count + 1.0
        update = jax.tree.map(
            lambda m, v: (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-8),
            first, second)
        log_params = jax.tree.map(lambda p, u: p - case.learning_rate * u, log_params, update)
        return log_params, (first, second), -value, info

    return step


def run_fit(runner, case: FitCase) -> None:
    """Run the fit into ``runner``'s row (see ``FitCase``); its stats are the fit's wall time
    (one round), from the first step's dispatch (compile included) to the last step."""
    import jax
    import jax.numpy as jnp

    info = runner.info
    info.update(case.extra_info())
    info.setdefault("compile_s", None)
    reason = runner.precheck(case)
    if reason is not None:
        runner.fail(reason)
        return
    try:
        start = time.perf_counter()
        x, y = known_gp_data(case.n, case.dim, case.seed)
        info["data_s"] = time.perf_counter() - start
        step = fit_step(case)
        log_params = {k: jnp.log(jnp.float32(v))
                      for k, v in zip(PARAM_NAMES, case.start, strict=True)}
        zeros = {k: jnp.float32(0) for k in PARAM_NAMES}
        moments = (zeros, zeros)
        limit = min(case.time_limit_s, runner.state.available(case.suite))
        trajectory = []
        key = jax.random.key(case.seed + 1)
        started = time.perf_counter()
        reached = False
        for count in range(case.max_steps):
            before = time.perf_counter()
            log_params, moments, value, step_info = jax.block_until_ready(step(
                log_params, moments, jnp.float32(count), x, y, jax.random.fold_in(key, count)))
            seconds = time.perf_counter() - before
            params = {k: float(jnp.exp(v)) for k, v in log_params.items()}
            trajectory.append({"step": count + 1, "s": seconds, "mll_per_n": float(value),
                               "cg_iterations": int(step_info["cg_iterations"]), **params})
            if count == 0:
                info["compile_s"] = seconds
            if within(params):
                reached = True
                break
            if time.perf_counter() - started + seconds > limit:
                break
        fit_s = time.perf_counter() - started
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row
        from bench_harness import describe_error

        runner.fail(describe_error(exc))
        return
    info.update(steps=len(trajectory), fit_s=fit_s, converged=reached,
                final=trajectory[-1] if trajectory else None, trajectory=trajectory,
                step_s=float(np.median([t["s"] for t in trajectory[1:]]))
                if len(trajectory) > 1 else None)
    if not reached:
        last = {k: round(trajectory[-1][k], 4) for k in PARAM_NAMES}
        runner.fail(f"stopped: the hyperparameters were not within {FIT_TOLERANCE:.0%} of "
                    f"{GENERATING} after {len(trajectory)} steps in {fit_s:.0f} s (the limit "
                    f"was {case.max_steps} steps or {limit:.0f} s); last {last}")
        return
    record_external_timings(runner.benchmark, [fit_s])
