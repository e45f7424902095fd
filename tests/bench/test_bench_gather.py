"""bench_gather.gather_rows: the MoE peers' dispatch and combine gathers, with gathers as their
transposes, give what differentiating ``jnp.take`` gives."""

import jax
import jax.numpy as jnp
import numpy as np
from bench_gather import gather_rows


def test_dispatch_and_combine_gradients_equal_take():
    tokens, top_k, width = 50, 3, 4
    rng = np.random.default_rng(0)
    expert_of_copy = rng.integers(0, 5, tokens * top_k)
    order = jnp.argsort(expert_of_copy, stable=True)  # rows sorted by expert
    row_of_copy = jnp.argsort(order)
    token_of_row = order // top_k
    x = jnp.asarray(rng.standard_normal((tokens, width)), jnp.float32)

    def with_take(x):
        rows = jnp.take(x, token_of_row, axis=0) * 1.7
        return jnp.sum(jnp.take(rows, row_of_copy, axis=0) ** 3)

    def with_gathers(x):
        rows = gather_rows(x, token_of_row, row_of_copy.reshape(tokens, top_k)) * 1.7
        return jnp.sum(gather_rows(rows, row_of_copy, order[:, None]) ** 3)

    np.testing.assert_allclose(with_gathers(x), with_take(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(with_gathers)(x), jax.grad(with_take)(x), rtol=1e-5)
    # the transposes are gathers: no scatter in the gradient's program
    assert "scatter" not in jax.jit(jax.grad(with_gathers)).lower(x).as_text()
    assert "scatter" in jax.jit(jax.grad(with_take)).lower(x).as_text()
    # plain gathers both ways: no fill mask (a select per row), which slowed the peer 2x
    assert "select" not in jax.jit(jax.grad(with_gathers)).lower(x).as_text()
    assert "select" in jax.jit(jax.grad(with_take)).lower(x).as_text()
