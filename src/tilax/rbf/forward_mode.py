"""Every JAX transformation of the Pallas path: forward mode beside the fast custom VJPs.

``tilax.rbf.vjp`` defines the Pallas sums as ``jax.custom_vjp`` functions, which JAX cannot
differentiate in forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``). Here each sum is a
``jax.custom_jvp`` function instead, whose tangent is one *linear* primitive, ``rbf_linear``:

* its ``"tangent"`` direction ``(primals, tangents) -> J @ tangents`` is the tangent of the
  plain-XLA sum (``tilax.rbf.reference``, the same distances and precision);
* its transpose is the ``"cotangent"`` direction ``(primals, cotangent) -> J.T @ cotangent``,
  which runs the Pallas custom VJP's backward kernels (``tilax.rbf.vjp``).

So ``jax.grad`` and ``jax.vjp`` transpose the tangent into today's fast backward pass, forward
mode evaluates the XLA tangent (memory-light, in chunks of queries), and derivatives of either
direction (``jax.hessian`` is ``jacfwd(jacrev)``) are those of the plain-XLA sum, which is
differentiable to any order. Under ``vmap`` the tangent binds itself again (folded into the
batch dimension), so that ``grad`` of a mapped loss still runs the backward kernels, and the
cotangent maps the backward kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from tilax.rbf import reference, vjp
from tilax.rbf.config import PallasConfig


def _pallas_sum(op: str, cfg: PallasConfig):
    """The Pallas sum (custom VJP) of ``op``: ``kernel_mv(q, k, v, l)`` or ``kde_log_sum(query,
    data, weights, h)``, on ``[B, N, D]`` float32 operands."""
    if op == "mv":
        return lambda q, k, v, lengthscale: vjp.kernel_mv(q, k, v, lengthscale, cfg)
    return lambda query, data, w, h: vjp.kde_log_sum(query, data, w, h, cfg)


def _xla_sum(op: str, cfg: PallasConfig):
    """The plain-XLA sum of ``op`` at ``cfg``'s precision, with the Pallas sum's arguments."""
    precision = None if cfg.precision == "default" else cfg.precision
    if op == "mv":
        return functools.partial(reference.kernel_mv_xla, precision=precision, kernel=cfg.kernel)
    return lambda query, data, w, h: reference.kde_log_sum_xla(query, data, h, w,
                                                               precision=precision)  # fmt: skip


def _tangent_impl(*args, op: str, cfg: PallasConfig):
    """``J @ tangents`` of the plain-XLA sum: ``args`` are the four primals, then tangents."""
    return jax.jvp(_xla_sum(op, cfg), args[:4], args[4:])[1]


def _cotangent_impl(*args, op: str, cfg: PallasConfig):
    """``J.T @ cotangent`` by the Pallas backward kernels: ``args`` are the primals, then it."""
    _, pullback = jax.vjp(_pallas_sum(op, cfg), *args[:4])
    return list(pullback(args[4]))


def _xla_cotangent(*args, op: str, cfg: PallasConfig):
    return list(jax.vjp(_xla_sum(op, cfg), *args[:4])[1](args[4]))


def _tangent_abstract_eval(*avals, op: str, cfg: PallasConfig):
    out = jax.eval_shape(_pallas_sum(op, cfg), *avals[:4])
    return avals[0].update(shape=out.shape, dtype=out.dtype)


def _cotangent_abstract_eval(*avals, op: str, cfg: PallasConfig):
    return list(avals[:4])


def _jvp_by_xla(primitive, xla_fn):
    """The jvp rule of a direction: its value by ``primitive``, its derivatives in every
    argument by ``xla_fn`` (the plain-XLA form, differentiable to any order)."""

    def rule(args, tangents, **params):
        out = primitive.bind(*args, **params)
        tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
        return out, jax.jvp(functools.partial(xla_fn, **params), tuple(args), tangents)[1]

    return rule


def _tangent_transpose(ct, *args, op: str, cfg: PallasConfig):
    primals, tangents = args[:4], args[4:]
    if any(ad.is_undefined_primal(p) for p in primals):
        raise NotImplementedError("the RBF tangent is linear in its tangents only")
    if type(ct) is ad.Zero:
        return [None] * 8
    cts = rbf_cotangent_p.bind(*primals, ct, op=op, cfg=cfg)
    return [None] * 4 + [c if ad.is_undefined_primal(t) else None
                         for c, t in zip(cts, tangents, strict=True)]  # fmt: skip


def _cotangent_transpose(cts, *args, op: str, cfg: PallasConfig):
    primals = args[:4]
    if any(ad.is_undefined_primal(p) for p in primals):
        raise NotImplementedError("the RBF cotangent is linear in the output cotangent only")
    cts = [jnp.zeros(p.shape, p.dtype) if type(c) is ad.Zero else c
           for c, p in zip(cts, primals, strict=True)]  # fmt: skip
    return [None] * 4 + [rbf_tangent_p.bind(*primals, *cts, op=op, cfg=cfg)]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _mapped_cotangent(op: str, cfg: PallasConfig, a, b, c, d, cotangent):
    """The cotangent direction as a function to ``vmap`` (the Pallas backward kernels batch
    natively) that an enclosing ``jvp`` still differentiates by the plain-XLA sum."""
    return _cotangent_impl(a, b, c, d, cotangent, op=op, cfg=cfg)


@_mapped_cotangent.defjvp
def _mapped_cotangent_jvp(op, cfg, args, tangents):
    out = _mapped_cotangent(op, cfg, *args)
    return out, jax.jvp(functools.partial(_xla_cotangent, op=op, cfg=cfg), args, tangents)[1]


def _tangent_batch(args, dims, *, op: str, cfg: PallasConfig):
    """Batching of the tangent that binds it again, so that its transpose is still the Pallas
    backward pass (``grad`` of a ``vmap``-ed loss): the mapped axis is folded into the leading
    batch dimension where the scale and its tangent are not mapped, otherwise the tangent runs
    once per mapped entry (``lax.map``)."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    args = [jnp.broadcast_to(a, (size, *jnp.shape(a))) if d is None else jnp.moveaxis(a, d, 0)
            for a, d in zip(args, dims, strict=True)]  # fmt: skip
    if dims[3] is None and dims[7] is None:
        folded = [a[0] if i in (3, 7) else a.reshape(size * a.shape[1], *a.shape[2:])
                  for i, a in enumerate(args)]  # fmt: skip
        out = rbf_tangent_p.bind(*folded, op=op, cfg=cfg)
        return out.reshape(size, -1, *out.shape[1:]), 0
    return lax.map(lambda a: rbf_tangent_p.bind(*a, op=op, cfg=cfg), tuple(args)), 0


def _cotangent_batch(args, dims, *, op: str, cfg: PallasConfig):
    out = jax.vmap(functools.partial(_mapped_cotangent, op, cfg), in_axes=tuple(dims))(*args)
    return list(out), [0] * len(out)


def _primitive(name, impl, abstract_eval, xla_fn, transpose, batch, *, multiple_results):
    primitive = Primitive(name)
    primitive.multiple_results = multiple_results
    primitive.def_impl(impl)
    primitive.def_abstract_eval(abstract_eval)
    mlir.register_lowering(primitive, mlir.lower_fun(impl, multiple_results=multiple_results))
    ad.primitive_jvps[primitive] = _jvp_by_xla(primitive, xla_fn)
    ad.primitive_transposes[primitive] = transpose
    batching.primitive_batchers[primitive] = batch
    return primitive


#: ``(q, k, v, l, dq, dk, dv, dl) -> d out`` (``op="mv"``) or ``(query, data, w, h, ...) ->
#: d log_sum`` (``op="kde"``): linear in the tangents.
rbf_tangent_p = _primitive("rbf_tangent", _tangent_impl, _tangent_abstract_eval, _tangent_impl,
                           _tangent_transpose, _tangent_batch, multiple_results=False)  # fmt: skip
#: ``(primals..., cotangent) -> [cotangents of the primals]``: linear in the cotangent.
rbf_cotangent_p = _primitive(
    "rbf_cotangent", _cotangent_impl, _cotangent_abstract_eval, _xla_cotangent,
    _cotangent_transpose, _cotangent_batch, multiple_results=True,
)  # fmt: skip


def _with_forward_mode(op: str):
    @functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
    def fn(a, b, c, d, cfg: PallasConfig):
        return _pallas_sum(op, cfg)(a, b, c, d)

    @fn.defjvp
    def fn_jvp(cfg, primals, tangents):
        return fn(*primals, cfg), rbf_tangent_p.bind(*primals, *tangents, op=op, cfg=cfg)

    return fn


#: ``rbf_kernel_mv`` for float32 ``q: [B, N, D]``, ``k: [B, M, D]``, ``v: [B, M, O]`` and the
#: lengthscale, differentiable in both modes.
kernel_mv = _with_forward_mode("mv")
#: ``log sum_j w_j exp(-0.5 |(x_i - x_j) / h|^2)`` as ``[B, N]`` for float32 ``query``,
#: ``data``, ``weights: [B, M]`` and scalar ``bandwidth``, differentiable in both modes.
kde_log_sum = _with_forward_mode("kde")
