"""The kernel sums tilax.gp builds on, looked up by name in this one place.

Every kernel here is stationary with ``k(x, x) = 1`` (the preconditioner relies on it) and is a
kernel sum with the contract of ``tilax.kernel_mv``: ``f(q, k, v, lengthscale, impl=...,
precision=...)`` returns ``K(q, k) @ v`` without forming ``K``, differentiable in ``q``, ``k``,
``v`` and the (scalar or ``[D]``) lengthscale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from tilax.rbf import kernel_mv, rbf_kernel_mv

KernelSum = Callable[..., jax.Array]

#: ``"rbf"``: the Gaussian kernel; ``"matern12"``, ``"matern32"``, ``"matern52"``: the Matérn
#: kernels of ``tilax.kernel_mv`` (each with ``k(x, x) = 1``).
KERNEL_SUMS: dict[str, KernelSum] = {
    "rbf": rbf_kernel_mv,
    **{name: functools.partial(kernel_mv, kernel=name)
       for name in ("matern12", "matern32", "matern52")},
}  # fmt: skip


def kernel_sum(kernel: str) -> KernelSum:
    """The kernel sum named ``kernel``; a ``ValueError`` naming the supported ones otherwise."""
    if not isinstance(kernel, str) or kernel not in KERNEL_SUMS:
        supported = ", ".join(repr(name) for name in KERNEL_SUMS)
        raise ValueError(f"kernel must be one of {supported} (the kernels tilax.gp supports), "
                         f"got {kernel!r}")
    return KERNEL_SUMS[kernel]
