"""The grouped-matmul kernels (interpret mode) against numpy, on awkward row layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import peak_rel_err
from moe_testing import gmm_oracle, row_experts

from tilax.moe import dispatch, triton
from tilax.moe.triton import Tiles

TILES = Tiles(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
# Expert 1 and 4 get no rows, expert 0 ends mid-tile, expert 2 spans three tiles.
GROUP_SIZES = np.array([7, 0, 37, 5, 0, 9])
NUM_ROWS = int(GROUP_SIZES.sum())  # 58: not a multiple of the row tile
PADDED_ROWS = 64


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def _offsets():
    return jnp.asarray(np.concatenate([[0], np.cumsum(GROUP_SIZES)]), jnp.int32)


def _schedule():
    return dispatch.gmm_schedule(_offsets(), PADDED_ROWS, TILES.block_m)


def _row_experts():
    return row_experts(GROUP_SIZES, PADDED_ROWS)


def _normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _reference_gmm(lhs_rows, rhs, transpose=False):
    return gmm_oracle(lhs_rows, rhs, GROUP_SIZES, transpose)


def test_schedule_covers_every_row_once():
    schedule = jax.tree.map(np.asarray, _schedule())
    owner = np.full(PADDED_ROWS, -1)
    for expert, tile, lo, hi in zip(*schedule, strict=True):
        for local in range(lo, hi):
            assert owner[tile * 16 + local] == -1, "row stored twice"
            owner[tile * 16 + local] = expert
    np.testing.assert_array_equal(owner, _row_experts())
    assert len(schedule.expert) == PADDED_ROWS // 16 + len(GROUP_SIZES) - 1


@pytest.mark.parametrize("variant", ["plain", "gather", "transposed_dual_scaled"])
def test_gmm(rng, variant):
    k_dim, n_dim = 32, 48
    rhs = _normal(rng, len(GROUP_SIZES), k_dim, n_dim)
    kwargs = {}
    if variant == "gather":
        source = _normal(rng, 11, k_dim)
        index = rng.integers(0, 11, PADDED_ROWS).astype(np.int32)
        lhs_rows, lhs = source[index], source
        kwargs["index"] = jnp.asarray(index)
        expected = _reference_gmm(lhs_rows, rhs)
    elif variant == "plain":
        lhs = lhs_rows = _normal(rng, PADDED_ROWS, k_dim)
        expected = _reference_gmm(lhs_rows, rhs)
    else:
        lhs = lhs_rows = _normal(rng, PADDED_ROWS, k_dim)
        lhs2 = _normal(rng, PADDED_ROWS, k_dim)
        rhs = _normal(rng, len(GROUP_SIZES), n_dim, k_dim)
        rhs2 = _normal(rng, len(GROUP_SIZES), n_dim, k_dim)
        scale = _normal(rng, PADDED_ROWS)
        kwargs.update(transpose_rhs=True, lhs2=jnp.asarray(lhs2), rhs2=jnp.asarray(rhs2),
                      row_scale=jnp.asarray(scale))
        expected = scale[:, None] * (
            _reference_gmm(lhs_rows, rhs, True) + _reference_gmm(lhs2, rhs2, True)
        )
    out = triton.gmm(
        jnp.asarray(lhs), jnp.asarray(rhs), _schedule(), tiles=TILES, backend="interpret",
        **kwargs,
    )
    assert out.shape == (PADDED_ROWS, n_dim)
    assert peak_rel_err(out, expected) < 1e-5


def test_gmm_activation_swiglu_and_backward(rng):
    d_dim, h_dim, tokens = 32, 32, 13
    x = _normal(rng, tokens, d_dim)
    index = rng.integers(0, tokens, PADDED_ROWS).astype(np.int32)
    w_gate, w_up = _normal(rng, 6, d_dim, h_dim), _normal(rng, 6, d_dim, h_dim)
    w_down = _normal(rng, 6, h_dim, d_dim)
    act, gate, up = triton.gmm_activation(
        jnp.asarray(x), jnp.asarray(w_gate), jnp.asarray(w_up), _schedule(), tiles=TILES,
        backend="interpret", index=jnp.asarray(index), save_preactivations=True,
    )
    gate_ref = _reference_gmm(x[index], w_gate)
    up_ref = _reference_gmm(x[index], w_up)
    silu = gate_ref / (1 + np.exp(-gate_ref))
    assert peak_rel_err(gate, gate_ref) < 1e-5 and peak_rel_err(up, up_ref) < 1e-5
    assert peak_rel_err(act, silu * up_ref) < 1e-5

    scale = _normal(rng, PADDED_ROWS)
    (act_scaled,) = triton.gmm_activation(
        jnp.asarray(x), jnp.asarray(w_gate), jnp.asarray(w_up), _schedule(), tiles=TILES,
        backend="interpret", index=jnp.asarray(index), row_scale=jnp.asarray(scale),
    )
    assert peak_rel_err(act_scaled, scale[:, None] * silu * up_ref) < 1e-5

    dy = _normal(rng, tokens, d_dim)
    d_gate, d_up, dw_partial = triton.gmm_activation_bwd(
        jnp.asarray(dy), jnp.asarray(w_down), gate, up, jnp.asarray(scale), _schedule(),
        tiles=TILES, backend="interpret", index=jnp.asarray(index),
    )
    dz = _reference_gmm(dy[index], w_down, transpose=True)
    sig = 1 / (1 + np.exp(-gate_ref))
    d_act = scale[:, None] * dz
    assert peak_rel_err(d_up, d_act * silu) < 1e-5
    assert peak_rel_err(d_gate, d_act * up_ref * sig * (1 + gate_ref * (1 - sig))) < 1e-5
    assert peak_rel_err(dw_partial.sum(0), np.sum(dz * silu * up_ref, axis=1)) < 1e-5


@pytest.mark.parametrize("scaled", [True, False])
def test_gmm_combine_sums_into_tokens(rng, scaled):
    h_dim, d_dim, tokens = 32, 16, 41
    hidden = _normal(rng, PADDED_ROWS, h_dim)
    w_down = _normal(rng, 6, h_dim, d_dim)
    scale = _normal(rng, PADDED_ROWS) if scaled else np.ones(PADDED_ROWS, np.float32)
    # Each expert's rows hold distinct tokens; rows past the groups are skipped (target T).
    target = np.concatenate(
        [rng.permutation(tokens)[:size] for size in GROUP_SIZES]
        + [np.full(PADDED_ROWS - NUM_ROWS, tokens)]
    ).astype(np.int32)
    out = triton.gmm_combine(
        jnp.asarray(hidden), jnp.asarray(w_down), jnp.asarray(scale) if scaled else None,
        jnp.asarray(target),
        _schedule(), num_tokens=tokens, tiles=TILES, backend="interpret",
    )
    rows = scale[:, None] * _reference_gmm(hidden, w_down)
    expected = np.zeros((tokens, d_dim))
    for row in range(NUM_ROWS):
        expected[target[row]] += rows[row]
    assert out.dtype == jnp.float32
    assert peak_rel_err(out, expected) < 1e-5


@pytest.mark.parametrize("gathered", [False, True])
def test_tgmm_ragged_contraction(rng, gathered):
    k_dim, n_dim = 32, 16
    offsets = np.asarray(_offsets())
    rhs = _normal(rng, PADDED_ROWS, n_dim)
    rhs2 = _normal(rng, PADDED_ROWS, n_dim)
    kwargs = {}
    if gathered:
        source = _normal(rng, 9, k_dim)
        index = rng.integers(0, 9, PADDED_ROWS).astype(np.int32)
        lhs, lhs_rows = source, source[index]
        kwargs["lhs_index"] = jnp.asarray(index)
    else:
        lhs = lhs_rows = _normal(rng, PADDED_ROWS, k_dim)
    # Garbage past the groups must not leak into any expert's gradient.
    rhs[NUM_ROWS:] = np.nan
    out, out2 = triton.tgmm(
        jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(offsets, jnp.int32), tiles=TILES,
        backend="interpret", rhs2=jnp.asarray(rhs2), **kwargs,
    )
    for expert in range(len(GROUP_SIZES)):
        rows = slice(offsets[expert], offsets[expert + 1])
        np.testing.assert_allclose(out[expert], lhs_rows[rows].T @ rhs[rows], atol=1e-4)
        np.testing.assert_allclose(out2[expert], lhs_rows[rows].T @ rhs2[rows], atol=1e-4)
    assert not np.any(out[1]) and not np.any(out[4])  # experts without rows


def test_fit_block():
    assert triton.fit_block(64, 48) == 16
    assert triton.fit_block(128, 1024) == 128
    assert triton.fit_block(64, 32) == 32
    with pytest.raises(ValueError, match="multiple of 16"):
        triton.fit_block(64, 24)
