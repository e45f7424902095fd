"""Exact Gaussian-process regression on kernel sums: ``mll`` and ``posterior``.

The covariance of the targets is ``C = outputscale * K + noise * I`` with ``K`` the kernel
matrix of the training inputs. Nothing here forms ``K`` (or any ``n x n`` matrix): every product
with ``C`` is one kernel sum (``tilax.gp.kernels``) over all its right-hand sides at once, the
solves are batched preconditioned conjugate gradients (``tilax.gp.cg``) with a pivoted-Cholesky
preconditioner (``tilax.gp.preconditioner``), and ``log det C`` is stochastic Lanczos quadrature
on the coefficients of the same CG run (``tilax.gp.lanczos``), as in GPyTorch's blackbox
matrix-matrix inference (Gardner et al., 2018).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tilax import _pallas
from tilax.gp import cg, lanczos, preconditioner
from tilax.gp.kernels import kernel_sum

PARAM_NAMES = ("lengthscale", "outputscale", "noise")
# The default preconditioner: complete (rank n) up to this many points, where it makes the value
# and gradient exact to rounding (GPyTorch likewise solves by Cholesky up to 800 points); rank
# DEFAULT_RANK above, where the estimates' error depends on the data (the GP guide's table).
# 400, not 50: at 2 048-8 192 points (CPU) CG ran 2-6 times fewer iterations, a value and
# gradient took up to 2.4 times less (more only where CG converged in a few iterations
# anyway), and the value was as close or closer. At a million points its O(400^2 n) work is
# far less than one CG iteration's n^2 kernel sum (the gp_rank bench suite measures it).
FULL_RANK_MAX_N = 1024
DEFAULT_RANK = 400


# ------------------------------------------------------------------------------------------
# Validation


def _float_array(name: str, x: Any) -> jax.Array:
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a real floating-point array, got dtype {x.dtype}")
    return x


def _concrete(x: jax.Array) -> np.ndarray | None:
    """The value of ``x`` as NumPy, or ``None`` when it is a tracer (under jit, vmap, grad)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_params(params: Any, dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict with keys {PARAM_NAMES}, got {type(params)}")
    unknown = sorted(str(name) for name in params if name not in PARAM_NAMES)
    if unknown:
        raise ValueError(f"params has unknown key(s) {unknown}; expected exactly {PARAM_NAMES}")
    missing = [name for name in PARAM_NAMES if name not in params]
    if missing:
        raise ValueError(f"params is missing key(s) {missing}; expected exactly {PARAM_NAMES}")
    checked = []
    for name in PARAM_NAMES:
        label = f"params['{name}']"
        value = _float_array(label, params[name])
        allowed = [(), (dim,)] if name == "lengthscale" else [()]
        if value.shape not in allowed:
            expected = f"a scalar or shape ({dim},) (one per input dimension)" if (
                name == "lengthscale") else "a scalar (shape ())"
            raise ValueError(f"{label} must be {expected}, got shape {value.shape}")
        concrete = _concrete(value)
        if concrete is not None and not np.all((concrete > 0) & np.isfinite(concrete)):
            raise ValueError(f"{label} must be positive and finite, got {concrete}")
        checked.append(value)
    return tuple(checked)


def _check_points(name: str, x: Any, layout: str) -> jax.Array:
    x = _float_array(name, x)
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape {layout}, got shape {x.shape}")
    return x


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def _check_tol(tol: Any) -> float:
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < math.inf:
        raise ValueError(f"tol must be a positive finite number, got {tol!r}")
    return float(tol)


@dataclass(frozen=True)
class _Model:
    """The static settings of one GP computation (hashable: a ``custom_vjp`` static argument)."""

    kernel: str
    impl: str
    precision: str | None
    tol: float
    max_iters: int
    preconditioner_rank: int | None  # None: the default (``preconditioner_rank_for``)

    def kernel_mv(self, q, k, v, lengthscale):
        return kernel_sum(self.kernel)(
            q, k, v, lengthscale, impl=self.impl, precision=self.precision
        )

    def covariance_mv(self, lengthscale, outputscale, noise, x, v):
        """``(outputscale * K(x, x) + noise * I) @ v`` for ``v: [n, c]``: one kernel sum."""
        return outputscale * self.kernel_mv(x, x, v, lengthscale) + noise * v

    def preconditioner(self, lengthscale, outputscale, noise, x):
        """The pivoted-Cholesky preconditioner of ``C`` and its pivots."""
        n = x.shape[0]
        one = jnp.ones((1, 1), x.dtype)

        def column(i):
            point = jax.lax.dynamic_slice_in_dim(x, i, 1, axis=0)
            return outputscale * self.kernel_mv(x, point, one, lengthscale)[:, 0]

        # Every kernel of tilax.gp.kernels is stationary with k(x, x) = 1.
        diagonal = jnp.full((n,), outputscale, x.dtype)
        rank = preconditioner_rank_for(self.preconditioner_rank, n)
        pivoted = preconditioner.pivoted_cholesky(diagonal, column, rank)
        return preconditioner.Preconditioner.build(pivoted.factor, noise), pivoted

    def nystrom_factor(self, lengthscale, outputscale, x, pivoted):
        """The preconditioner's factor recomputed from its pivots, differentiably."""
        points = x[pivoted.pivots]
        identity = jnp.eye(points.shape[0], dtype=x.dtype)
        columns = outputscale * self.kernel_mv(x, points, identity, lengthscale)
        # The pivots' rows of the columns are the pivot block K(points, points): one kernel
        # sum fewer to compile and differentiate.
        block = columns[pivoted.pivots]
        return preconditioner.nystrom_factor(columns, block, pivoted)

    def solve(self, params, x, b, precond, lanczos_iters: int = 0) -> cg.CGResult:
        matvec = lambda v: self.covariance_mv(*params, x, v)
        return cg.preconditioned_cg(matvec, b, precond.solve, tol=self.tol,
                                    max_iters=self.max_iters, lanczos_iters=lanczos_iters)


def preconditioner_rank_for(requested: int | None, n: int) -> int:
    """The preconditioner's rank for ``n`` points: ``requested`` (at most ``n``), or by default
    ``n`` up to ``FULL_RANK_MAX_N`` points and ``DEFAULT_RANK`` above."""
    if requested is None:
        return n if n <= FULL_RANK_MAX_N else DEFAULT_RANK
    return min(requested, n)


def _model(kernel, impl, precision, tol, max_iters, preconditioner_rank) -> _Model:
    kernel_sum(kernel)  # a ValueError naming the supported kernels
    if preconditioner_rank is not None:
        preconditioner_rank = _check_int("preconditioner_rank", preconditioner_rank, 0)
    return _Model(kernel, impl, precision, _check_tol(tol), _check_int("max_iters", max_iters, 1),
                  preconditioner_rank)


def _compute_dtype(*arrays: jax.Array) -> jnp.dtype:
    # Half precision is too coarse for CG; float64 (with jax_enable_x64) stays float64.
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


# ------------------------------------------------------------------------------------------
# The log marginal likelihood and its gradient


@dataclass(frozen=True)
class _Estimator:
    model: _Model
    num_probes: int
    lanczos_iters: int


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mll(estimator, lengthscale, outputscale, noise, x, y, key):
    value, info, _ = _mll_forward(estimator, lengthscale, outputscale, noise, x, y, key)
    return value, info


def _mll_forward(estimator, lengthscale, outputscale, noise, x, y, key):
    model, params = estimator.model, (lengthscale, outputscale, noise)
    n = x.shape[0]
    precond, pivoted = model.preconditioner(*params, x)
    probes = precond.sample(key, estimator.num_probes)  # z ~ N(0, P)
    rhs = jnp.concatenate([y[:, None], probes], axis=1)
    solved = model.solve(params, x, rhs, precond, lanczos_iters=estimator.lanczos_iters)
    alpha = solved.solution[:, 0]
    logdet = precond.logdet() + lanczos.logdet_ratio(
        solved.alphas[:, 1:], solved.betas[:, 1:], solved.initial_norms[1:]
    )
    value = -0.5 * (preconditioner.matmul(y, alpha) + logdet + n * math.log(2 * math.pi))
    info = {"cg_iterations": solved.iterations,
            "relative_residual": jnp.max(solved.relative_residuals)}
    # For the gradient: alpha = C^-1 y, u_i = C^-1 z_i, w_i = P^-1 z_i and the pivots.
    residuals = (params, x, solved.solution, precond.solve(probes), pivoted, precond)
    return value, info, residuals


def _mll_fwd(estimator, lengthscale, outputscale, noise, x, y, key):
    value, info, residuals = _mll_forward(estimator, lengthscale, outputscale, noise, x, y, key)
    return (value, info), (residuals, key)


def _mll_bwd(estimator, saved, cotangents):
    (params, x, solutions, w, pivoted, precond), key = saved
    model, g = estimator.model, cotangents[0]
    alpha, u = solutions[:, :1], solutions[:, 1:]
    right = jnp.concatenate([alpha, w], axis=1)
    # d log det P = tr(P^-1 dP) = 2 <P^-1 L, dL> + tr(P^-1) d noise, with P^-1 held at theta.
    inverse_times_factor = precond.solve(precond.factor)
    trace_inverse = precond.trace_inverse()

    # d mll / d theta = 0.5 alpha^T (dC/dtheta) alpha - 0.5 tr(C^-1 dC/dtheta). The trace is
    # tr(P^-1 dP/dtheta) (= d log det P / dtheta, exact through the preconditioner's factor
    # with its pivots held) plus Hutchinson's estimate of tr(C^-1 dC - P^-1 dP) with the
    # probes z ~ N(0, P): E[u^T dC w - w^T dP w] for u = C^-1 z, w = P^-1 z. Where P is close
    # to C the two terms nearly cancel probe by probe, so the estimate varies far less than
    # Hutchinson's estimate of tr(C^-1 dC) alone. The gradient of this surrogate (with alpha,
    # u, w and P^-1 held) is that estimator; its products with dC/dtheta come from the VJP of
    # one kernel sum C @ [alpha, w].
    def surrogate(lengthscale, outputscale, noise, x):
        products = model.covariance_mv(lengthscale, outputscale, noise, x, right)
        data_fit = 0.5 * jnp.sum(alpha * products[:, :1])
        factor = model.nystrom_factor(lengthscale, outputscale, x, pivoted)
        logdet_p = 2 * jnp.sum(inverse_times_factor * factor) + trace_inverse * noise
        factor_w = preconditioner.matmul(factor.T, w)
        w_p_w = jnp.sum(factor_w**2, axis=0) + noise * jnp.sum(w**2, axis=0)
        u_c_w = jnp.sum(u * products[:, 1:], axis=0)
        return data_fit - 0.5 * (logdet_p + jnp.mean(u_c_w - w_p_w))

    grads = jax.grad(surrogate, argnums=(0, 1, 2, 3))(*params, x)
    d_lengthscale, d_outputscale, d_noise, d_x = (g * grad for grad in grads)
    d_y = -g * alpha[:, 0]
    d_key = np.zeros(key.shape, jax.dtypes.float0)
    return d_lengthscale, d_outputscale, d_noise, d_x, d_y, d_key


_mll.defvjp(_mll_fwd, _mll_bwd)


# Jitted also when called eagerly: the preconditioner and CG loops would otherwise compile
# piece by piece at every call. ``trace_facts`` (tilax._pallas) keys the trace on what "auto"
# reads of the device besides the arguments.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _mll_program(estimator, trace_facts, *args):
    del trace_facts
    return _mll(estimator, *args)


def mll(
    params: Mapping[str, Any],
    x,
    y,
    *,
    kernel: str = "rbf",
    key: jax.Array,
    num_probes: int = 16,
    tol: float = 1e-3,
    max_iters: int = 1000,
    lanczos_iters: int = 100,
    preconditioner_rank: int | None = None,
    impl: str = "auto",
    precision: str | None = "highest",
    return_info: bool = False,
):
    r"""Exact log marginal likelihood ``log p(y | x)`` of a Gaussian process, without ``K``.

    The GP has zero mean and covariance ``C = outputscale * k(x, x') + noise * I``, so

    ``log p(y | x) = -0.5 y^T C^-1 y - 0.5 log det C - 0.5 n log(2 pi)``

    (the sum over the ``n`` points, not divided by ``n``). ``C^-1 y`` and ``C^-1 z_i`` for
    ``num_probes`` probe vectors ``z_i ~ N(0, P)`` come from one batched preconditioned CG run
    (each iteration one kernel sum with ``num_probes + 1`` columns); ``log det C`` is
    ``log det P`` plus stochastic Lanczos quadrature on the probe columns' CG coefficients
    (no separate Lanczos run). ``P = L L^T + noise * I`` is the rank-``preconditioner_rank``
    pivoted-Cholesky preconditioner. The value is a stochastic estimate: its error falls as
    ``1 / sqrt(num_probes)`` and with a better preconditioner (a higher rank). Up to 1 024
    points the default preconditioner is complete (rank ``n``): ``P`` is then ``C`` up to
    rounding, and the value and gradient are all but exact whatever the kernel (over 96
    settings at 1 000 points in float32, relative errors at most ``2.2e-4`` and ``2.3e-2``).

    Differentiable (reverse mode, a ``custom_vjp``) with respect to ``params``, ``x`` and ``y``
    by the standard estimator ``d/dtheta = 0.5 alpha^T (dC/dtheta) alpha - 0.5 tr(C^-1
    dC/dtheta)`` with ``alpha = C^-1 y``. The trace is ``d log det P / dtheta`` (exact) plus
    the same probes' estimate of ``tr(C^-1 dC - P^-1 dP)``,
    ``mean_i [(C^-1 z_i)^T dC (P^-1 z_i) - (P^-1 z_i)^T dP (P^-1 z_i)]``: the preconditioner
    as a control variate, far less noisy than Hutchinson's estimate of ``tr(C^-1 dC)`` alone.
    The products with ``dC/dtheta`` come from the VJP of one kernel sum of the CG solutions (no
    second solve). The same ``key`` gives the same probes, so the value and gradient are those
    of one fixed estimator. Works under ``jax.jit`` (the keyword arguments are static Python
    values). Float32 needs ``noise`` well above the kernel sums' rounding (see the guide's
    "Limits of float32"); float64 inputs (``jax_enable_x64``) compute in float64.

    Args:
      params: ``{"lengthscale": scalar or [D], "outputscale": scalar, "noise": scalar}``,
        positive (checked when concrete, i.e. outside ``jax.jit``). ``noise`` is the variance
        of the observation noise. Exactly these keys.
      x: training inputs ``[n, D]``.
      y: training targets ``[n]``.
      kernel: the kernel ``k`` of ``r = |(x - x') / lengthscale|``: ``"rbf"``
        (``exp(-r^2 / 2)``), ``"matern12"``, ``"matern32"`` or ``"matern52"`` (the Matérn
        kernels of ``tilax.kernel_mv``).
      key: a JAX random key for the probe vectors.
      num_probes: number of probe vectors (default 16) for the log-determinant and the trace.
      tol: CG stops a column when its residual is below ``tol`` times its right-hand side's
        norm (default ``1e-3``).
      max_iters: most CG iterations (default 1000).
      lanczos_iters: the quadrature uses the coefficients of the first ``lanczos_iters`` CG
        iterations of each probe (default 100; fewer when its CG converges earlier).
      preconditioner_rank: rank of the pivoted-Cholesky preconditioner (0: none,
        ``P = noise * I``). Default ``None``: ``n`` up to 1 024 points (exact; ``O(n^3)``
        work: a value and gradient takes 0.06-0.12 s at 512 points and 0.5 s at 1 024 on a
        2-core CPU), 400 above (``O(400 n)`` memory: 1.6 GB at a million points in float32;
        raise it where the estimate must be closer: the Gaussian-process guide measures the
        error per kernel).
      impl: the kernel sum's implementation (``"auto"``: Pallas on a GPU, XLA on a CPU).
      precision: the kernel sum's precision (default ``"highest"``: on the default
        precision's bfloat16 products CG diverges, and on ``"high"``'s it converges to an
        answer 4-13 times less accurate; the Gaussian-process guide has the measurement).
      return_info: also return a dict with ``cg_iterations`` (int32: iterations run) and
        ``relative_residual`` (the largest ``|r| / |b|`` over the columns at the end); not
        differentiated.

    Returns:
      A scalar in the promoted dtype of the inputs (float32 for float32 or half inputs), or
      ``(value, info)`` with ``return_info=True``.

    Raises:
      TypeError: non-floating inputs, ``params`` not a dict, non-int counts.
      ValueError: unknown or missing ``params`` keys, wrong shapes, non-positive parameters
        (when concrete), an unknown ``kernel``, non-positive counts or tolerance.
    """
    model = _model(kernel, impl, precision, tol, max_iters, preconditioner_rank)
    estimator = _Estimator(model, _check_int("num_probes", num_probes, 1),
                           _check_int("lanczos_iters", lanczos_iters, 1))
    x = _check_points("x", x, "[n, D] (n points of dimension D)")
    y = _float_array("y", y)
    if y.shape != (x.shape[0],):
        raise ValueError(f"y must have shape [n] = ({x.shape[0]},) to match x of shape "
                         f"{x.shape}, got shape {y.shape}")
    if x.shape[0] == 0:
        raise ValueError("x must hold at least one point, got shape (0, D)")
    params = _check_params(params, x.shape[1])
    dtype = _compute_dtype(x, y, *params)
    params = tuple(p.astype(dtype) for p in params)
    value, info = _mll_program(estimator, _pallas.trace_facts(), *params, x.astype(dtype),
                               y.astype(dtype), key)
    return (value, info) if return_info else value


# ------------------------------------------------------------------------------------------
# The posterior


def posterior(
    params: Mapping[str, Any],
    x,
    y,
    x_star,
    *,
    kernel: str = "rbf",
    tol: float = 1e-6,
    max_iters: int = 1000,
    preconditioner_rank: int | None = None,
    query_batch: int = 256,
    impl: str = "auto",
    precision: str | None = "highest",
    return_variance: bool = True,
    return_info: bool = False,
):
    r"""Posterior mean and variance of the latent function at ``x_star``.

    ``mean = outputscale * K(x_star, x) C^-1 y`` and
    ``variance_j = outputscale - outputscale^2 k_j^T C^-1 k_j`` with ``k_j = K(x, x_star_j)``
    and ``C = outputscale * K(x, x) + noise * I``. The variance is of the noise-free function;
    the predictive variance of a new observation adds ``params["noise"]``.

    ``C^-1 y`` is one preconditioned CG solve. The variance is exact up to the CG tolerance:
    one batched CG solve per ``query_batch`` queries (their columns ``k_j`` solved together,
    each iteration one kernel sum with ``query_batch`` columns), not a low-rank cache (the
    Gaussian-process guide says why); it costs about as many kernel sums as a solve per batch,
    and memory ``O(n * query_batch)``: with many queries, the variance is nearly all of the
    cost (``return_variance=False`` skips it). Rounding can make a variance slightly
    negative; it is clamped at zero. Not differentiable (the CG loops are ``while`` loops);
    works under ``jax.jit``.

    Args:
      params: as in ``tilax.gp.mll``.
      x: training inputs ``[n, D]``; y: training targets ``[n]``.
      x_star: query points ``[m, D]``.
      kernel: as in ``tilax.gp.mll``.
      tol: CG relative residual tolerance (default ``1e-6``). The variance's error is about
        ``outputscale^2 tol^2 |k_j|^2 / noise``, which near dense data is a large part of a
        small variance: 500 points in 2 dimensions with noise 0.01 gave variances 22% off at
        ``1e-4`` and 0.1% at ``1e-6``, the solves taking 10-45% longer.
      max_iters: most CG iterations per solve (default 1000).
      preconditioner_rank: pivoted-Cholesky preconditioner rank, as in ``tilax.gp.mll``
        (default ``None``: ``n`` up to 1 024 points, 400 above).
      query_batch: queries per variance solve (default 256).
      impl, precision: the kernel sum's, as in ``tilax.gp.mll`` (default ``"highest"``).
      return_variance: compute the variance (default ``True``); ``False`` returns the mean
        alone, at the cost of one CG solve and one kernel sum.
      return_info: also return a dict with ``cg_iterations`` (int32: the most iterations any
        of the solves ran) and ``relative_residual`` (the largest final ``|r| / |b|`` over
        all their columns): a residual above ``tol`` says CG did not converge, e.g. with a
        ``noise`` too small for float32 (the guide's "Limits of float32").

    Returns:
      ``(mean, variance)``, each ``[m]``, or ``(mean, variance, info)`` with
      ``return_info=True``; without the variance (``return_variance=False``), ``mean`` or
      ``(mean, info)``.

    Raises:
      TypeError, ValueError: as ``tilax.gp.mll``, and for ``x_star`` of the wrong shape or a
        ``query_batch`` below 1.
    """
    model = _model(kernel, impl, precision, tol, max_iters, preconditioner_rank)
    query_batch = _check_int("query_batch", query_batch, 1)
    x = _check_points("x", x, "[n, D] (n points of dimension D)")
    y = _float_array("y", y)
    if y.shape != (x.shape[0],):
        raise ValueError(f"y must have shape [n] = ({x.shape[0]},) to match x of shape "
                         f"{x.shape}, got shape {y.shape}")
    if x.shape[0] == 0:
        raise ValueError("x must hold at least one point, got shape (0, D)")
    x_star = _check_points("x_star", x_star, f"[m, D] with D = {x.shape[1]} as in x")
    if x_star.shape[1] != x.shape[1]:
        raise ValueError(f"x_star must have shape [m, D] with D = {x.shape[1]} as in x (shape "
                         f"{x.shape}), got shape {x_star.shape}")
    params = _check_params(params, x.shape[1])
    dtype = _compute_dtype(x, y, x_star, *params)
    params = tuple(p.astype(dtype) for p in params)
    x, y, x_star = x.astype(dtype), y.astype(dtype), x_star.astype(dtype)
    if x_star.shape[0] == 0:
        mean = variance = jnp.zeros((0,), dtype)
        info = {"cg_iterations": jnp.int32(0), "relative_residual": jnp.zeros((), dtype)}
    else:
        batch = query_batch if return_variance else None
        mean, variance, info = _posterior(model, batch, _pallas.trace_facts(), params, x, y,
                                          x_star)
    outputs = (mean, variance) if return_variance else (mean,)
    outputs += (info,) if return_info else ()
    return outputs[0] if len(outputs) == 1 else outputs


@functools.partial(jax.jit, static_argnums=(0, 1, 2))  # as _mll_program
def _posterior(model, query_batch, trace_facts, params, x, y, x_star):
    """Mean, variance and info; ``query_batch=None``: the mean alone (variance ``None``)."""
    del trace_facts
    lengthscale, outputscale, _ = params
    precond, _ = model.preconditioner(*params, x)
    solved = model.solve(params, x, y[:, None], precond)
    mean = outputscale * model.kernel_mv(x_star, x, solved.solution, lengthscale)[:, 0]
    if query_batch is None:
        return mean, None, {"cg_iterations": solved.iterations,
                            "relative_residual": solved.relative_residuals[0]}

    m, dim = x_star.shape
    batch = min(query_batch, m)
    chunks = -(-m // batch)
    padding = jnp.broadcast_to(x_star[-1:], (chunks * batch - m, dim))
    batches = jnp.concatenate([x_star, padding]).reshape(chunks, batch, dim)
    identity = jnp.eye(batch, dtype=x.dtype)

    def batch_variance(points):
        cross = outputscale * model.kernel_mv(x, points, identity, lengthscale)  # [n, batch]
        solved_batch = model.solve(params, x, cross, precond)
        variance = outputscale - jnp.sum(cross * solved_batch.solution, axis=0)
        return variance, solved_batch.iterations, jnp.max(solved_batch.relative_residuals)

    variance, iterations, residuals = jax.lax.map(batch_variance, batches)
    info = {"cg_iterations": jnp.maximum(solved.iterations, jnp.max(iterations)),
            "relative_residual": jnp.maximum(solved.relative_residuals[0], jnp.max(residuals))}
    return mean, jnp.maximum(variance.reshape(-1)[:m], 0), info
