"""Property-based tests of the public MoE functions against a float64 NumPy oracle (issue 76):
over shapes, dtypes, input scales, routings and the XLA impls (the Pallas kernels have their own
tests at fixed shapes). Few examples at small shapes, derandomized, so CI is repeatable. Marked
``kernels`` (``nox -s tests_kernels``) for the compiles at every new shape; tests/moe's unit
tests hold each impl against the oracle every day."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err
from hypothesis import assume, given, settings

import tilax

pytestmark = pytest.mark.kernels

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Against the oracle on the inputs as rounded to their dtype: float32 matmuls, or bfloat16
# activations and outputs (each rounding about 2^-8).
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
# The smallest gap between a token's k-th and (k+1)-th probability for which the oracle's
# choice of experts is the layer's (a float32 router on the same inputs).
SELECTION_MARGIN = 1e-4
PROPERTY_SETTINGS = settings(max_examples=6, deadline=None, derandomize=True, database=None)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def moe_oracle(params, x, top_k: int, routing: str, renormalize: bool):
    """``(y, probabilities)`` of the MoE layer in float64 (DESIGN.md's math), dense routing
    running every expert on every token with the same weights."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items() if k != "shared"}
    x = np.asarray(x, np.float64)
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, top, -1)
    if renormalize:
        weights /= weights.sum(-1, keepdims=True)
    y = np.zeros_like(x)
    for slot in range(top_k):
        e = top[:, slot]
        gate = np.einsum("td,tdh->th", x, p["w_gate"][e])
        up = np.einsum("td,tdh->th", x, p["w_up"][e])
        y += weights[:, slot, None] * np.einsum("th,thd->td", _silu(gate) * up, p["w_down"][e])
    return y, probs


@st.composite
def layers(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    experts = draw(st.integers(1, 6))
    config = tilax.MoEConfig(
        d_model=draw(st.sampled_from([8, 16])), d_hidden=draw(st.sampled_from([8, 24])),
        num_experts=experts, top_k=draw(st.integers(1, experts)),
        routing=draw(st.sampled_from(["dropless", "dense"])),
        impl=draw(st.sampled_from(["auto", "blocked", "ragged_dot"])),
        renormalize=draw(st.booleans()), dtype=DTYPES[dtype],
    )
    tokens = draw(st.integers(1, 13))
    scale = 10.0 ** draw(st.floats(-2.0, 1.0))
    seed = draw(st.integers(0, 2**16))
    return config, tokens, scale, seed


@PROPERTY_SETTINGS
@given(layers())
def test_moe_init_and_apply_match_the_float64_oracle(layer):
    config, tokens, scale, seed = layer
    key_params, key_x = jax.random.split(jax.random.key(seed))
    params = tilax.moe_init(key_params, config)
    e, d, h = config.num_experts, config.d_model, config.d_hidden
    assert params["router"].shape == (d, e) and params["router"].dtype == jnp.float32
    assert params["w_gate"].shape == params["w_up"].shape == (e, d, h)
    assert params["w_down"].shape == (e, h, d)
    assert {params[k].dtype for k in ("w_gate", "w_up", "w_down")} == {jnp.dtype(config.dtype)}
    x = (scale * jax.random.normal(key_x, (tokens, config.d_model))).astype(config.dtype)
    y, aux = jax.jit(tilax.moe_apply)(params, x, config)  # the config is static
    assert y.shape == x.shape and y.dtype == x.dtype
    expected, probs = moe_oracle(params, x, config.top_k, config.routing, config.renormalize)
    if config.top_k < config.num_experts:
        ordered = -np.sort(-probs, axis=-1)
        assume(np.min(ordered[:, config.top_k - 1] - ordered[:, config.top_k])
               > SELECTION_MARGIN)
    dtype = "float32" if config.dtype == jnp.float32 else "bfloat16"
    assert np.isfinite(np.asarray(y, np.float64)).all()
    assert rel_err(y, expected) <= TOLERANCE[dtype]
    counts = np.asarray(aux["expert_counts"])
    assert counts.sum() == tokens * config.top_k

