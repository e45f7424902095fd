"""The memory-saving option (``MoEConfig.recompute``): the same results and gradients as the
default path, and a compiled train step that needs much less memory.

Pallas runs in interpret mode with 16-row tiles and ``recompute_rows=32``: the 74-copy row
space is three slices, groups straddle slice boundaries, the last slice is mostly padding.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import peak_rel_err
from moe_testing import interpreted_marked

import tilax

LAYER = dict(d_model=24, d_hidden=40, num_experts=4, top_k=2, shared_hidden=16,
             block_m=16, block_n=16, block_k=16, capacity_factor=0.75)


def _train_step(config, params, x):
    cotangent = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

    def loss(params, x):
        y, aux = tilax.moe_apply(params, x, config)
        return jnp.sum(y.astype(jnp.float32) * cotangent) + aux["load_balance_loss"], y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


def check_same_as_default(tol, **kwargs):
    config = tilax.MoEConfig(**{**LAYER, **kwargs})
    saving = dataclasses.replace(config, recompute=True, recompute_rows=32)
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (37, config.d_model)).astype(config.dtype)
    y, grads = _train_step(config, params, x)
    y_saving, grads_saving = _train_step(saving, params, x)
    assert peak_rel_err(y_saving, y) < tol, "output"
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, expected), actual in zip(flat, jax.tree.leaves(grads_saving), strict=True):
        assert actual.dtype == expected.dtype
        assert peak_rel_err(actual, expected) < tol, f"gradient {jax.tree_util.keystr(path)}"


# every dispatch (each reads its rows differently); capacity routing only changes the layout
@pytest.mark.kernels  # the Pallas interpreter: 13-20 s a case on two cores
@pytest.mark.parametrize(
    "dispatch,routing",
    [(d, "dropless") for d in ("sorted", "gather", "fused", "fused_gsum")]
    + [("sorted", "capacity"), ("fused_gsum", "capacity")],
)
def test_pallas_slices_match_one_pass(dispatch, routing):
    check_same_as_default(1e-5, impl="pallas", dispatch=dispatch, routing=routing,
                          dtype=jnp.float32)


@pytest.mark.kernels
def test_bfloat16():
    check_same_as_default(1e-2, impl="pallas", dispatch="fused", dtype=jnp.bfloat16)


@pytest.mark.parametrize("impl,routing", interpreted_marked(
    [("ragged_dot", "dropless"), ("blocked", "capacity"), ("auto", "dense")]))
def test_xla_impls_under_checkpoint(impl, routing):
    check_same_as_default(1e-6, impl=impl, routing=routing, dtype=jnp.float32)


@pytest.mark.kernels
@pytest.mark.parametrize("dispatch", ["sorted", "fused_gsum"])
def test_train_step_needs_much_less_memory(dispatch):
    # 1024 tokens x top-2 = 2048 copies of width 512 (float32): 4 MiB per hidden activation;
    # slices of 128 copies keep each at 0.25 MiB.
    config = tilax.MoEConfig(d_model=32, d_hidden=512, num_experts=4, top_k=2, impl="pallas",
                             dispatch=dispatch, dtype=jnp.float32, block_m=32, block_n=32,
                             block_k=32)
    params = tilax.moe_init(jax.random.key(0), config)
    x = jnp.ones((1024, config.d_model))

    def temp_bytes(config):
        step = jax.jit(jax.grad(lambda p, x: jnp.sum(tilax.moe_apply(p, x, config)[0] ** 2),
                                argnums=(0, 1)))
        return step.lower(params, x).compile().memory_analysis().temp_size_in_bytes

    default = temp_bytes(config)
    saving = temp_bytes(dataclasses.replace(config, recompute=True, recompute_rows=128))
    assert default > 5 * 2**20 * 4  # at least five [2048, 512] float32 arrays live at once
    assert saving < default / 4, (saving, default)


def test_slice_rows_follow_the_row_tile():
    from tilax.moe import pallas

    config = tilax.MoEConfig(**LAYER, recompute=True, recompute_rows=1)
    tiles = pallas.kernel_tiles(config)
    assert pallas.slice_rows(config, tiles, 74) == 16  # rounded up to the row tile
    wide = dataclasses.replace(config, recompute_rows=1000)
    assert pallas.slice_rows(wide, tiles, 74) == 80  # at most the padded row space
    assert pallas.slice_rows(dataclasses.replace(config, recompute=False), tiles, 74) is None
    assert tilax.MoEConfig(**LAYER).recompute is False  # off by default
