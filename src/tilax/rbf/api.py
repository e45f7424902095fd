"""Public RBF entry points: input validation and the choice of implementation.

``kernel_mv`` (the stationary kernels of ``tilax.rbf.profiles``; ``rbf_kernel_mv`` is its
Gaussian kernel) and ``rbf_kde_density`` validate their inputs (a ``TypeError`` or
``ValueError`` naming the argument, its shape and what was expected), pick an implementation
(``impl``) and call it: ``tilax.rbf.reference`` for ``"xla"`` and ``"dense"``,
``tilax.rbf.forward_mode`` over ``tilax.rbf.vjp`` (launch settings from ``tilax.rbf.config``)
for ``"pallas"``.
How each keeps kernel values right at every scale is ``tilax.rbf.numerics``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from tilax import _pallas
from tilax.rbf import config, forward_mode, numerics, profiles, reference

IMPLS = ("auto", "pallas", "xla", "dense")
PRECISIONS = config.PRECISIONS


# ------------------------------------------------------------------------------------------
# Validation


def _as_float_array(name: str, x: Any) -> jax.Array:
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    _pallas.check_float_array(name, x)
    return x


def _check_points(name: str, x: jax.Array, layout: str) -> None:
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape {layout} (rank >= 2), got shape {x.shape}")


def _check_batch(names: tuple[str, ...], arrays: tuple[jax.Array, ...], core: tuple[int, ...]):
    batches = [a.shape[: a.ndim - c] for a, c in zip(arrays, core, strict=True)]
    if any(b != batches[0] for b in batches):
        described = ", ".join(
            f"{n} has shape {a.shape} (batch {b})"
            for n, a, b in zip(names, arrays, batches, strict=True)
        )
        joined = ", ".join(names)
        raise ValueError(f"{joined} must share their leading batch dimensions: {described}")


def _concrete_value(x: jax.Array) -> np.ndarray | None:
    """The value of ``x`` as NumPy, or ``None`` when it is a tracer (under jit, vmap, grad)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_scale(name: str, scale: Any, dim: int, *, per_dimension: bool) -> jax.Array:
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        # Strongly typed: a weakly typed scalar is another signature to the jitted paths, so
        # calls with 0.5 and with jnp.float32(0.5) would each compile them.
        scale = jnp.asarray(float(scale), dtype=jnp.result_type(float))
    scale = _as_float_array(name, scale)
    allowed = [()] + ([(dim,)] if per_dimension else [])
    if scale.shape not in allowed:
        expected = f"a scalar or shape ({dim},) (one per input dimension)" if per_dimension else (
            "a scalar (shape ())"
        )
        raise ValueError(f"{name} must be {expected}, got shape {scale.shape}")
    value = _concrete_value(scale)
    if value is not None and not np.all((value > 0) & np.isfinite(value)):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return scale


def _check_weights(weights: Any, batch_shape: tuple[int, ...], data: jax.Array) -> jax.Array:
    m = data.shape[-2]
    weights = _as_float_array("weights", weights)
    if weights.shape != (*batch_shape, m):
        raise ValueError(
            f"weights must have shape [..., M] = {(*batch_shape, m)} to match data of shape "
            f"{data.shape}, got shape {weights.shape}"
        )
    value = _concrete_value(weights)
    if value is None:
        return weights
    if not np.all(np.isfinite(value)):
        bad = value[~np.isfinite(value)]
        raise ValueError(
            f"weights must be finite, got {bad.size} non-finite value(s), e.g. {bad[0]}"
        )
    if np.any(value < 0):
        raise ValueError(f"weights must be non-negative, got minimum {value.min()}")
    # Any positive weight, not a positive sum: the sum of large weights overflows.
    if m > 0 and not np.all(np.any(value > 0, axis=-1)):
        raise ValueError("weights must not be all zero (over M, for every batch entry)")
    return weights


def _check_block(name: str, block: Any) -> None:
    if block is None:
        return
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise TypeError(f"{name} must be an int (a power of two >= 16) or None, got {block!r}")
    if block < 16 or block & (block - 1):
        raise ValueError(
            f"{name} must be a power of two >= 16 (Triton dots need every dimension >= 16), "
            f"got {block}"
        )


def _resolve_impl(impl: Any, dtype: jnp.dtype) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return config.auto_impl(dtype, _pallas.platform())


def _resolve_precision(precision: Any) -> str | None:
    """The precision name (``None``: the default, as ``"default"``)."""
    if precision is None:
        return None
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
    return precision


# ------------------------------------------------------------------------------------------
# Public functions


def rbf_kernel_mv(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    lengthscale: ArrayLike,
    *,
    impl: str = "auto",
    precision: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    block_o: int | None = None,
) -> jax.Array:
    r"""RBF (Gaussian) kernel matrix times values, without materialising the kernel matrix.

    Computes ``out[..., i, o] = sum_j exp(-0.5 * sum_d ((q[i, d] - k[j, d]) / l[d])**2) * v[j, o]``.
    Kernel values are always in ``[0, 1]`` and finite for finite inputs, at any positive
    lengthscale, subnormal float32 ones (down to ``1e-45``) and huge ones (``3e38``) included,
    on every ``impl`` and ``precision``.

    Differentiable in every array argument in reverse and forward mode (``jax.grad``,
    ``jax.vjp``, ``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``), to any order, under ``jax.jit``
    and ``jax.vmap``. With ``impl="pallas"``, reverse mode runs the Pallas backward kernels;
    forward-mode tangents, and every derivative of a derivative, are those of ``impl="xla"``
    (``tilax.rbf.forward_mode``: a ``custom_jvp`` whose tangent transposes to the backward
    kernels).

    Args:
      q: queries, shape ``[..., N, D]``.
      k: keys, shape ``[..., M, D]`` (same leading batch dimensions and ``D`` as ``q``).
      v: values, shape ``[..., M, O]``.
      lengthscale: positive, finite scalar, or shape ``[D]`` for one lengthscale per input
        dimension (ARD). Its gradient has the same shape.
      impl: ``"auto"`` (default: ``"pallas"`` on GPU, ``"xla"`` on CPU and for float64 inputs),
        ``"pallas"`` (fused tiled kernel; Triton on GPU, interpret mode on CPU, which is slow and
        meant for tests), ``"xla"`` (plain XLA in chunks of queries, memory ``O((N + M) * chunk)``,
        differentiable to any order) or ``"dense"`` (materialises the ``N x M`` matrix).
      precision: how distances and products are computed; accumulation is always float32.
        With ``rho = max_i |(q_i - c) / l| + max_j |(k_j - c) / l|`` (``c`` the mean key; the
        spread of the data in lengthscales):

        * ``"highest"``: squared distances from coordinate differences (exact to float32 at any
          ``rho`` and wherever the data sit), value products in three TF32 passes (Pallas) or
          IEEE float32 (XLA): float32-accurate, ~1e-6 relative. Several times slower than the
          default on GPUs. Use it for solves and other ill-conditioned uses.
        * ``None`` (the default) or ``"default"``: distances from the expansion
          ``|a|^2 + |b|^2 - 2 a.b`` of centred, scaled points (three-pass TF32 on tensor
          cores), whose relative error per kernel value is at most ``(7 D + 31) 2^-25 rho^2``
          (a worst case; typically 10-100x less); value products from single bfloat16
          operands (~2.5e-3 relative, as measured on an H200 at ``rho`` ~ 5 with
          N = M = 65536, D = 8, O = 16). The fastest setting.
        * ``"high"``: the same distances, value products from three bfloat16 passes (~1e-5).

        The fast precisions use the expansion only while its bound is within a budget
        (``2^-8 - 2^-16`` for the default, ``2^-12`` for ``"high"``: ``rho`` up to about 39
        and 10 at ``D = 8``); beyond it they compute distances from differences, as
        ``"highest"`` does.
        ``impl="xla"`` and ``"dense"`` follow the same rules for distances and multiply by
        ``v`` at ``HIGHEST`` precision with ``"highest"``, else at XLA's default (TF32 on
        recent GPUs).
      block_q: query tile size of the forward and both backward kernels for ``impl="pallas"``
        (a power of two, at least 16); ``None`` picks it per problem and device (see
        ``tilax.rbf.config.default_config``; on GPUs, for large problems, 128 queries
        in the fast path's kernels and 64 in the exact path's). Tiles shrink where a launch
        would not fit the device's shared memory. On Hopper, tiles the Mosaic GPU kernels
        cannot take (program tiles other than 128 rows) run the Triton kernels instead.
      block_k: key tile size (a power of two, at least 16); ``None`` picks it (for large
        problems on GPUs, 128 keys in the fast path's forward and Hopper gradient sweeps, 64
        in its Triton gradient kernels, 32 in the exact path's).
      block_o: value column tile size (a power of two, at least 16); ``None`` gives
        ``min(64, next_power_of_2(O))``, at least 16.

    Returns:
      ``[..., N, O]`` in the result dtype of ``q``, ``k`` and ``v`` on every ``impl``
      (bfloat16 in, bfloat16 out; computed in float32, float64 stays float64).
      Empty ``M`` gives zeros, empty ``N`` or ``O`` an empty array.

    Raises:
      TypeError: an input is not a real floating-point array (integer, bool, complex), or a
        block size is not an int.
      ValueError: wrong ranks, mismatched batch or feature dimensions, ``v`` rows not matching
        ``k``, a lengthscale of the wrong shape or (when concrete) not positive and finite, an
        unknown ``impl`` or ``precision``, a block size that is not a power of two >= 16.

    Examples:
      >>> import jax, jax.numpy as jnp, tilax
      >>> q = jax.random.normal(jax.random.key(0), (1000, 3))
      >>> k = jax.random.normal(jax.random.key(1), (2000, 3))
      >>> v = jax.random.normal(jax.random.key(2), (2000, 4))
      >>> out = tilax.rbf_kernel_mv(q, k, v, jnp.array([0.5, 1.0, 2.0]))
      >>> out.shape
      (1000, 4)
      >>> grad_l = jax.grad(lambda l: tilax.rbf_kernel_mv(q, k, v, l).sum())(1.0)
    """
    return kernel_mv(q, k, v, lengthscale, kernel="rbf", impl=impl, precision=precision,
                     block_q=block_q, block_k=block_k, block_o=block_o)


def kernel_mv(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    lengthscale: ArrayLike,
    *,
    kernel: str = "rbf",
    impl: str = "auto",
    precision: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    block_o: int | None = None,
) -> jax.Array:
    r"""Stationary kernel matrix times values, without materialising the kernel matrix.

    Computes ``out[..., i, o] = sum_j k(r_ij) * v[j, o]`` with
    ``r_ij = ||(q[i] - k[j]) / l||`` (``l`` scalar or per dimension) and the kernel ``k``:

    * ``"rbf"`` (default): ``exp(-r^2 / 2)``, exactly ``rbf_kernel_mv``;
    * ``"matern12"``: ``exp(-r)`` (the exponential kernel);
    * ``"matern32"``: ``(1 + sqrt(3) r) exp(-sqrt(3) r)``;
    * ``"matern52"``: ``(1 + sqrt(5) r + 5 r^2 / 3) exp(-sqrt(5) r)``.

    The contract of ``rbf_kernel_mv`` holds for every kernel: batch dimensions, scalar or ARD
    lengthscales, values in ``[0, 1]`` at any positive lengthscale, reverse mode by the Pallas
    backward kernels (``impl="pallas"``), forward mode and higher orders by plain XLA, the same
    ``impl``, ``precision`` and tile arguments.

    Gradients at coincident points (``r = 0``) are finite: the Matérn-3/2 and 5/2 kernels are
    differentiable there; the Matérn-1/2 kernel is a cone, whose gradient in ``q``, ``k`` and
    the lengthscale at ``r = 0`` is taken to be 0 (the subgradient of the symmetric cone), and a
    pair closer than ``r_0 ~ 1e-15`` lengthscales (but not coincident) contributes its gradient
    scaled by ``r / r_0`` (so that no gradient overflows; ``tilax.rbf.profiles``). On the fast
    precisions' expansion, which cannot tell pairs closer than its rounding error from
    coincident ones, Matérn-1/2 distances below ``2^-12`` lengthscales are taken as ``2^-12``
    (values within ``2^-12`` of 1, gradients of such pairs scaled by ``r / 2^-12``).
    Second and higher derivatives are exact away from ``r = 0`` (the Matérn-1/2 and 3/2 kernels
    have none there).

    Precision: as in ``rbf_kernel_mv``. ``"highest"`` is float32-accurate for every kernel,
    wherever the data sit. The fast precisions use the expansion of squared distances while
    the kernel's worst-case relative value error stays within the precision's budget: the
    Gaussian kernel's bound ``b = (7 D + 31) 2^-25 rho^2`` becomes ``5 b / 3`` (Matérn-5/2),
    ``3 b`` (Matérn-3/2) and ``sqrt(2 b)`` (Matérn-1/2, whose value has an unbounded slope in
    ``r^2`` at 0: a squared distance off by ``b`` moves ``r`` by up to ``sqrt(2 b)``). At the
    default precision and ``D = 8`` the fast path then holds up to ``rho`` of about 39
    (Gaussian), 30 (Matérn-5/2), 22 (Matérn-3/2) and only 1.7 (Matérn-1/2); beyond, the
    kernels compute distances from differences, as ``"highest"`` does, at about its speed.

    Args:
      q: queries, shape ``[..., N, D]``.
      k: keys, shape ``[..., M, D]`` (same leading batch dimensions and ``D`` as ``q``).
      v: values, shape ``[..., M, O]``.
      lengthscale: positive, finite scalar, or shape ``[D]`` (ARD). Its gradient has its shape.
      kernel: ``"rbf"``, ``"matern12"``, ``"matern32"`` or ``"matern52"``.
      impl: as in ``rbf_kernel_mv`` (``"auto"``: Pallas on GPU, XLA on CPU and for float64).
      precision: as in ``rbf_kernel_mv``, with the kernel's value error bound (above).
      block_q: as in ``rbf_kernel_mv``.
      block_k: as in ``rbf_kernel_mv``.
      block_o: as in ``rbf_kernel_mv``.

    Returns:
      ``[..., N, O]`` in the result dtype of ``q``, ``k`` and ``v``, as ``rbf_kernel_mv``.

    Raises:
      TypeError: as ``rbf_kernel_mv``.
      ValueError: an unknown ``kernel``, and every case of ``rbf_kernel_mv``.

    Examples:
      >>> import jax, jax.numpy as jnp, tilax
      >>> x = jax.random.normal(jax.random.key(0), (1000, 3))
      >>> v = jax.random.normal(jax.random.key(1), (1000, 2))
      >>> out = tilax.kernel_mv(x, x, v, jnp.array([0.5, 1.0, 2.0]), kernel="matern52")
      >>> out.shape
      (1000, 2)
      >>> grad_l = jax.grad(lambda l: tilax.kernel_mv(x, x, v, l, kernel="matern12").sum())(1.0)
    """
    kernel = profiles.check_kernel(kernel)
    q = _as_float_array("q", q)
    k = _as_float_array("k", k)
    v = _as_float_array("v", v)
    _check_points("q", q, "[..., N, D]")
    _check_points("k", k, "[..., M, D]")
    _check_points("v", v, "[..., M, O]")
    _check_batch(("q", "k", "v"), (q, k, v), (2, 2, 2))
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same feature dimension D: q has shape {q.shape} "
            f"(D={q.shape[-1]}), k has shape {k.shape} (D={k.shape[-1]})"
        )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"v must have one row per key: k has shape {k.shape} (M={k.shape[-2]}), "
            f"v has shape {v.shape} (expected [..., {k.shape[-2]}, O])"
        )
    dim = q.shape[-1]
    lengthscale = _check_scale("lengthscale", lengthscale, dim, per_dimension=True)
    for name, block in (("block_q", block_q), ("block_k", block_k), ("block_o", block_o)):
        _check_block(name, block)
    out_dtype = jnp.result_type(q, k, v)
    impl = _resolve_impl(impl, out_dtype)
    precision = _resolve_precision(precision)

    batch_shape, (n, m, out_dim) = q.shape[:-2], (q.shape[-2], k.shape[-2], v.shape[-1])
    if m == 0 or n == 0 or out_dim == 0 or math.prod(batch_shape) == 0:
        return jnp.zeros((*batch_shape, n, out_dim), out_dtype)
    if impl == "dense":
        return reference.kernel_mv_dense(q, k, v, lengthscale, precision=precision, kernel=kernel)
    if impl == "xla":
        return reference.kernel_mv_xla(q, k, v, lengthscale, precision=precision, kernel=kernel)
    cfg = config.default_config(
        _pallas.resolve_backend("pallas"), precision, batch=math.prod(batch_shape), n=n, m=m,
        out=out_dim, dim=dim, block_q=block_q, block_k=block_k, block_o=block_o, kernel=kernel,
    )  # fmt: skip
    batch = math.prod(batch_shape)
    out = forward_mode.kernel_mv(
        q.astype(jnp.float32).reshape(batch, n, dim),
        k.astype(jnp.float32).reshape(batch, m, dim),
        v.astype(jnp.float32).reshape(batch, m, out_dim),
        lengthscale.astype(jnp.float32),
        cfg,
    )
    return out.reshape(*batch_shape, n, out_dim).astype(out_dtype)


def rbf_kde_density(
    query: ArrayLike,
    data: ArrayLike,
    bandwidth: ArrayLike,
    *,
    weights: ArrayLike | None = None,
    log: bool = False,
    impl: str = "auto",
    precision: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:
    r"""Normalised Gaussian kernel density estimate, optionally weighted, or its logarithm.

    ``p(x_i) = sum_j w_j (2 pi h^2)^(-D/2) exp(-||x_i - x_j||^2 / (2 h^2))`` with the weights
    normalised to sum to one (uniform ``1/M`` by default).

    Right at every positive bandwidth, subnormal float32 ones included: a query whose squared
    distance to every weighted point is beyond float32 in bandwidths gets ``log p = -inf``
    (``p = 0``), a query on the data the normaliser's peak (whose ``p`` overflows to ``inf`` below
    ``h ~ 1e-19`` in two dimensions). Differentiable like ``rbf_kernel_mv`` (reverse and forward
    mode, any order; ``impl="pallas"`` runs its backward kernels in reverse mode).

    Args:
      query: evaluation points, shape ``[..., N, D]``.
      data: sample points, shape ``[..., M, D]`` (same batch dimensions and ``D``).
      bandwidth: positive, finite scalar ``h``.
      weights: optional finite, non-negative ``[..., M]`` (not all zero); normalised to sum to
        one over ``M``, after an exact rescaling by a power of two, so that weights of any
        finite size work (all ``1e-45`` or all ``1e38`` alike). Gradients flow to them (through
        the normalisation).
      log: return ``log p(x)``. Every implementation computes a streaming log-sum-exp, so the
        log density is finite and accurate far from all data and at tiny bandwidths (as long
        as it is within float32 range), where ``p(x)`` itself underflows to 0; ``log=False``
        exponentiates it.
      impl: as in ``rbf_kernel_mv`` (``"auto"``: Pallas on GPU, XLA on CPU or for float64).
      precision: as in ``rbf_kernel_mv`` (distances, and the switch to differences beyond the
        fast distance's budget). The KDE has no value product, so ``None``, ``"default"`` and
        ``"high"`` differ only in that budget; backward sums are three-pass bfloat16 there
        (log density ~2e-7 relative, gradients ~1e-5); ``"highest"``: exact distances.
      block_q: query tile size (a power of two, at least 16) for ``impl="pallas"``.
      block_k: data point tile size (a power of two, at least 16) for ``impl="pallas"``.

    Returns:
      ``[..., N]`` in the result dtype of ``query`` and ``data`` on every ``impl`` (bfloat16 in,
      bfloat16 out). Empty ``M`` gives density 0
      (log: ``-inf``); empty ``N`` an empty array.

    Raises:
      TypeError: non-floating inputs (integer, bool, complex) or a non-int block size.
      ValueError: wrong ranks, mismatched batch or feature dimensions, ``weights`` not of shape
        ``[..., M]``, a non-scalar bandwidth, and, when the values are concrete, a bandwidth
        that is not positive and finite or weights that are not finite, negative or all zero;
        unknown ``impl`` or ``precision``; bad block sizes.

    Examples:
      >>> import jax, tilax
      >>> data = jax.random.normal(jax.random.key(0), (5000, 2))
      >>> grid = jax.random.uniform(jax.random.key(1), (100, 2), minval=-40.0, maxval=40.0)
      >>> log_p = tilax.rbf_kde_density(grid, data, 0.3, log=True)  # finite everywhere
      >>> log_p.shape
      (100,)
    """
    query = _as_float_array("query", query)
    data = _as_float_array("data", data)
    _check_points("query", query, "[..., N, D]")
    _check_points("data", data, "[..., M, D]")
    _check_batch(("query", "data"), (query, data), (2, 2))
    if query.shape[-1] != data.shape[-1]:
        raise ValueError(
            f"query and data must have the same feature dimension D: query has shape "
            f"{query.shape} (D={query.shape[-1]}), data has shape {data.shape} (D={data.shape[-1]})"
        )
    bandwidth = _check_scale("bandwidth", bandwidth, query.shape[-1], per_dimension=False)
    batch_shape, (n, dim), m = query.shape[:-2], query.shape[-2:], data.shape[-2]
    if weights is not None:
        weights = _check_weights(weights, batch_shape, data)
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        _check_block(name, block)
    out_dtype = jnp.result_type(query, data)
    impl = _resolve_impl(impl, out_dtype)
    precision = _resolve_precision(precision)

    if m == 0 or n == 0 or math.prod(batch_shape) == 0:
        return jnp.full((*batch_shape, n), -jnp.inf if log else 0.0, out_dtype)
    dtype = numerics.compute_dtype(query, data)
    if weights is None:
        weights = jnp.full((*batch_shape, m), 1.0 / m, dtype)
    else:
        weights = numerics.normalized_weights(weights.astype(dtype))
    if impl == "dense":
        return reference.kde_density_dense(query, data, bandwidth, weights, log=log,
                                           precision=precision)  # fmt: skip
    if impl == "xla":
        return reference.kde_density_xla(query, data, bandwidth, weights, log=log,
                                         precision=precision)  # fmt: skip

    batch = math.prod(batch_shape)
    cfg = config.default_config(
        _pallas.resolve_backend("pallas"), precision, batch=batch, n=n, m=m, out=1, dim=dim,
        block_q=block_q, block_k=block_k, op="kde",
    )  # fmt: skip
    h = bandwidth.astype(jnp.float32)
    log_sum = forward_mode.kde_log_sum(
        query.astype(jnp.float32).reshape(batch, n, dim),
        data.astype(jnp.float32).reshape(batch, m, dim),
        weights.astype(jnp.float32).reshape(batch, m),
        h,
        cfg,
    ).reshape(*batch_shape, n)
    log_p = log_sum - 0.5 * dim * math.log(2.0 * math.pi) - dim * numerics.log_positive(h)
    return (log_p if log else jnp.exp(log_p)).astype(out_dtype)
