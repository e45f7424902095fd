"""The experts' activations (``MoEConfig.activation``), written once for every implementation.

- ``"swiglu"`` (gated): ``silu(x @ w_gate) * (x @ w_up)``;
- ``"geglu"`` (gated): ``gelu(x @ w_gate) * (x @ w_up)``;
- ``"gelu"`` (not gated): ``gelu(x @ w_up)``; its experts (and shared expert) have no
  ``w_gate``.

``gelu`` is the tanh approximation, ``jax.nn.gelu(approximate=True)``:
``0.5 x (1 + tanh(u))`` with ``u = sqrt(2 / pi) (x + 0.044715 x^3)``. As
``0.5 (1 + tanh(u)) = sigmoid(2 u)``, both nonlinearities are ``x * sigmoid(z(x))``: ``z = x``
for ``silu``, ``z = 2 u`` for ``gelu``. So each costs one sigmoid per element, computed by the
sigmoid the caller passes (the Mosaic GPU kernels' approximate one, ``mosaic.common.sigmoid``;
``jax.nn.sigmoid`` elsewhere), and one derivative serves both:
``f'(x) = s (1 + x (1 - s) z'(x))`` with ``s = sigmoid(z(x))``.

The functions are plain ``jax.numpy`` on float32 values: the XLA implementations call them
(and JAX differentiates them), and the Pallas kernels trace them in their epilogues, forward
(:func:`hidden`) and backward (:func:`hidden_backward`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import jax

ACTIVATIONS = ("swiglu", "geglu", "gelu")
"""The values of ``MoEConfig.activation``."""

# z(x) = x * (GELU_LINEAR + GELU_CUBIC * x * x) = 2 sqrt(2 / pi) (x + 0.044715 x^3).
GELU_LINEAR = 2.0 * math.sqrt(2.0 / math.pi)
GELU_CUBIC = GELU_LINEAR * 0.044715

Sigmoid = Callable[[jax.Array], jax.Array]


def check_activation(activation) -> None:
    """Raise ``ValueError`` naming ``activation`` unless it is one of ``ACTIVATIONS``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def is_gated(activation: str) -> bool:
    """Whether the activation multiplies by a second projection (``w_gate`` and ``w_up``)."""
    check_activation(activation)
    return activation != "gelu"


def check_gate(activation: str, gate, name: str) -> bool:
    """Whether ``activation`` is gated; raise ``ValueError`` unless the kernel operand
    ``name`` is given exactly then (``None`` for the not-gated activation)."""
    gated = is_gated(activation)
    if gated != (gate is not None):
        expected = "an array" if gated else "None"
        raise ValueError(f"activation={activation!r} takes {name} {expected}")
    return gated


def expert_weight_names(activation: str) -> tuple[str, ...]:
    """The expert weights of ``activation``, in the order the implementations take them:
    ``("w_gate", "w_up", "w_down")``, or ``("w_up", "w_down")`` when not gated."""
    return ("w_gate", "w_up", "w_down") if is_gated(activation) else ("w_up", "w_down")


def _sigmoid_part(activation: str, x, sigmoid: Sigmoid):
    """``(s, z'(x))`` with ``s = sigmoid(z(x))``: ``z'`` is ``None`` for ``silu`` (``z = x``)."""
    if activation == "swiglu":
        return sigmoid(x), None
    square = x * x
    z = x * (GELU_LINEAR + GELU_CUBIC * square)
    return sigmoid(z), GELU_LINEAR + 3.0 * GELU_CUBIC * square


def _slope(x, s, z_slope):
    """``f'(x) = s (1 + x (1 - s) z'(x))`` of ``f(x) = x * s``."""
    if z_slope is None:
        return s * (1.0 + x * (1.0 - s))
    return s * (1.0 + x * (1.0 - s) * z_slope)


def nonlinearity(activation: str, x, sigmoid: Sigmoid = jax.nn.sigmoid):
    """``f(x)``: ``silu`` for ``"swiglu"``, the tanh-approximate ``gelu`` otherwise."""
    return x * _sigmoid_part(activation, x, sigmoid)[0]


def hidden(activation: str, gate, up, sigmoid: Sigmoid = jax.nn.sigmoid):
    """The hidden activation from the pre-activations: ``f(gate) * up`` for a gated
    activation, ``f(up)`` otherwise (``gate`` is then ``None``)."""
    if gate is None:
        return nonlinearity(activation, up, sigmoid)
    return nonlinearity(activation, gate, sigmoid) * up


def hidden_backward(
    activation: str, gate, up, dz, row_weight=None, sigmoid: Sigmoid = jax.nn.sigmoid
) -> Iterator[tuple[str, jax.Array]]:
    """The activation's backward, as an epilogue stores it: yields ``("act", a)`` (the
    unscaled :func:`hidden`, for the combine weights' gradient ``dz . a``), then
    ``("up", d_up)`` and, when gated, ``("gate", d_gate)``: the pre-activations' gradients
    given the activation's, ``d_act = dz * row_weight`` (``dz`` without ``row_weight``).

    A generator so that each value is computed only once the epilogue has stored the one
    before: fewer float32 tiles are live at once (the kernels' registers).
    """
    if gate is None:
        s, z_slope = _sigmoid_part(activation, up, sigmoid)
        yield "act", up * s
        d_act = dz if row_weight is None else dz * row_weight
        yield "up", d_act * _slope(up, s, z_slope)
        return
    s, z_slope = _sigmoid_part(activation, gate, sigmoid)
    f = gate * s
    yield "act", f * up
    d_act = dz if row_weight is None else dz * row_weight
    yield "up", d_act * f
    yield "gate", d_act * up * _slope(gate, s, z_slope)
