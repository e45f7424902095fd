"""Every bad input raises the documented error, naming the argument."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilax
from tilax import _pallas
from tilax.moe import api, triton

BASE = dict(d_model=16, d_hidden=32, num_experts=4, top_k=2)


def _config(**overrides):
    return tilax.MoEConfig(**{**BASE, "dtype": jnp.float32, **overrides})


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(top_k=5), r"top_k \(5\) must be <= num_experts \(4\)"),
        (dict(top_k=0), "top_k must be an integer >= 1"),
        (dict(d_model=0), "d_model must be an integer >= 1"),
        (dict(d_hidden=2.5), "d_hidden must be an integer"),
        (dict(shared_hidden=-1), "shared_hidden must be an integer >= 0"),
        (dict(impl="cuda"), "impl must be one of"),
        (dict(dispatch="scatter"), "dispatch must be one of"),
        (dict(routing="switch"), "routing must be one of"),
        (dict(capacity_factor=0.0), "capacity_factor must be a finite number > 0"),
        (dict(renormalize=1), "renormalize must be a bool"),
        (dict(block_m=48), "block_m must be a power of two"),
        (dict(block_n=8), "block_n must be an integer >= 16"),
        (dict(num_warps=3), "num_warps must be a power of two"),
        (dict(num_stages=0), "num_stages must be an integer >= 1"),
        (dict(recompute=1), "recompute must be a bool"),
        (dict(recompute_rows=0), "recompute_rows must be an integer >= 1"),
        (dict(exchange_chunks=0), "exchange_chunks must be an integer >= 1"),
        (dict(exchange="nccl"), "exchange must be one of"),
        (dict(exchange="ragged"), "exchange must be one of"),  # removed: 15-50x slower
        (dict(score_func="tanh"), r"score_func must be one of \('softmax', 'sigmoid'\)"),
        (dict(score_func=None), "score_func must be one of"),
        (dict(balance_bias=1), "balance_bias must be a bool"),
        (dict(expert_groups=3), r"num_experts \(4\) must be divisible by expert_groups \(3\)"),
        (dict(expert_groups=0), "expert_groups must be an integer >= 1"),
        (dict(expert_groups=2.0), "expert_groups must be an integer >= 1"),
        (dict(group_top_k=0), "group_top_k must be an integer >= 1"),
        (dict(expert_groups=2, group_top_k=3),
         r"group_top_k \(3\) must be in \[1, expert_groups\] = \[1, 2\]"),
        (dict(group_top_k=2), r"group_top_k \(2\) must be in \[1, expert_groups\]"),
        (dict(expert_groups=4, group_top_k=1),
         r"group_top_k \(1\) groups of 4 // 4 experts hold 1 experts, fewer than top_k \(2\)"),
        (dict(num_experts=8, top_k=5, expert_groups=4, group_top_k=2),
         "hold 4 experts, fewer than top_k"),
        (dict(routed_scale=0.0), "routed_scale must be a finite number > 0"),
        (dict(routed_scale=-2.5), "routed_scale must be a finite number > 0"),
        (dict(routed_scale=float("inf")), "routed_scale must be a finite number > 0"),
        (dict(routed_scale=float("nan")), "routed_scale must be a finite number > 0"),
        (dict(routed_scale="2.5"), "routed_scale must be a finite number > 0"),
        (dict(routed_scale=True), "routed_scale must be a finite number > 0"),
    ],
)
def test_bad_config(overrides, match):
    with pytest.raises(ValueError, match=match):
        tilax.MoEConfig(**{**BASE, **overrides})


def test_bad_dtype():
    with pytest.raises(TypeError, match="dtype must be one of"):
        tilax.MoEConfig(**BASE, dtype=jnp.int32)


def test_config_is_hashable_and_normalises_dtype():
    config = tilax.MoEConfig(**BASE, dtype="bfloat16")
    assert config.dtype == jnp.bfloat16
    assert hash(config) == hash(tilax.MoEConfig(**BASE, dtype=jnp.bfloat16))


@pytest.fixture
def setup():
    config = _config(shared_hidden=8, impl="ragged_dot")
    return config, tilax.moe_init(jax.random.key(0), config), jnp.ones((5, 16), jnp.float32)


def test_x_last_dim(setup):
    config, params, _ = setup
    with pytest.raises(ValueError, match=r"x must have shape \[..., d_model\] with d_model=16"):
        tilax.moe_apply(params, jnp.ones((5, 12)), config)


def test_x_dtype_and_empty(setup):
    config, params, _ = setup
    with pytest.raises(TypeError, match="x must be a real floating-point array"):
        tilax.moe_apply(params, jnp.ones((5, 16), jnp.int32), config)
    with pytest.raises(ValueError, match="at least one token"):
        tilax.moe_apply(params, jnp.ones((0, 16)), config)


@pytest.mark.parametrize(
    "leaf,shape,match",
    [
        ("w_up", (4, 16, 31), r"params\['w_up'\] has shape \(4, 16, 31\), but the config "
                              r"expects \(4, 16, 32\)"),
        ("router", (16, 3), r"params\['router'\] has shape \(16, 3\)"),
        ("w_down", (3, 32, 16), r"params\['w_down'\] has shape"),
    ],
)
def test_param_shapes(setup, leaf, shape, match):
    config, params, x = setup
    params = {**params, leaf: jnp.zeros(shape)}
    with pytest.raises(ValueError, match=match):
        tilax.moe_apply(params, x, config)


def test_shared_params_must_match(setup):
    config, params, x = setup
    bad = {**params, "shared": {**params["shared"], "w_down": jnp.zeros((9, 16))}}
    with pytest.raises(ValueError, match=r"params\['shared'\]\['w_down'\] has shape \(9, 16\)"):
        tilax.moe_apply(bad, x, config)
    missing = {k: v for k, v in params.items() if k != "shared"}
    with pytest.raises(ValueError, match="params is missing 'shared'"):
        tilax.moe_apply(missing, x, config)
    no_shared = _config(impl="ragged_dot")
    with pytest.raises(ValueError, match="config.shared_hidden is 0"):
        tilax.moe_apply(params, x, no_shared)


def test_router_bias_must_match_balance_bias(setup):
    _, params, x = setup
    config = _config(shared_hidden=8, impl="ragged_dot", balance_bias=True)
    with pytest.raises(ValueError, match=r"params is missing 'router_bias' \(expected shape "
                                         r"\(4,\)\).*balance_bias"):
        tilax.moe_apply(params, x, config)
    for shape in [(3,), (4, 1), ()]:
        bad = {**params, "router_bias": jnp.zeros(shape)}
        with pytest.raises(ValueError, match=rf"params\['router_bias'\] has shape "
                                             rf"{re.escape(str(shape))}, but the config "
                                             r"expects \(4,\)"):
            tilax.moe_apply(bad, x, config)
    with pytest.raises(TypeError, match=r"params\['router_bias'\] must be a real floating"):
        tilax.moe_apply({**params, "router_bias": jnp.zeros(4, jnp.int32)}, x, config)
    # a bias the config does not use must not pass silently either
    biased = {**params, "router_bias": jnp.zeros(4)}
    with pytest.raises(ValueError, match="params has a 'router_bias' but config.balance_bias "
                                         "is False"):
        tilax.moe_apply(biased, x, _config(shared_hidden=8, impl="ragged_dot"))


def test_update_bias_errors(setup):
    config, params, x = setup
    _, aux = tilax.moe_apply(params, x, config)
    with pytest.raises(ValueError, match="params has no 'router_bias' to update.*balance_bias"):
        tilax.moe_update_bias(params, aux, 0.01)
    biased = {**params, "router_bias": jnp.zeros(4)}
    with pytest.raises(ValueError, match="aux must be the dict moe_apply returns"):
        tilax.moe_update_bias(biased, {"load_balance_loss": 0.0}, 0.01)
    with pytest.raises(ValueError, match=r"aux\['expert_counts'\] has shape \(3,\)"):
        tilax.moe_update_bias(biased, {"expert_counts": jnp.ones(3, jnp.int32)}, 0.01)
    with pytest.raises(ValueError, match=r"rate must be a scalar, got shape \(4,\)"):
        tilax.moe_update_bias(biased, aux, jnp.ones(4))


def test_param_dtype(setup):
    config, params, x = setup
    with pytest.raises(TypeError, match=r"params\['w_gate'\] must be a real floating-point"):
        tilax.moe_apply({**params, "w_gate": jnp.zeros((4, 16, 32), jnp.int32)}, x, config)


def test_mosaic_off_hopper_gives_the_reason(setup):
    _, params, x = setup
    config = _config(shared_hidden=8, impl="mosaic")
    reason = _pallas.mosaic_unavailable_reason()
    assert reason is not None  # these tests run on CPU
    with pytest.raises(ValueError, match="impl='mosaic' cannot run on this device") as info:
        tilax.moe_apply(params, x, config)
    assert reason in str(info.value)


def test_dense_routing_ignores_impl_mosaic(setup):
    # dense routing runs every expert on every token, whatever impl says: no Mosaic error
    _, params, x = setup
    config = _config(shared_hidden=8, impl="mosaic", routing="dense")
    assert api.resolve_impl(config) == "dense"
    y, _ = tilax.moe_apply(params, x, config)
    assert y.shape == x.shape


def test_mosaic_on_hopper_runs_16_bit_experts_only(setup):
    _, params, x = setup
    with _pallas.assume_device(mosaic_unavailable_reason=None):
        assert api.resolve_impl(_config(impl="mosaic", dtype=jnp.bfloat16)) == "mosaic"
        assert api.resolve_impl(_config(impl="mosaic", dtype=jnp.float16)) == "mosaic"
        config = _config(shared_hidden=8, impl="mosaic")  # float32
        with pytest.raises(ValueError, match="impl='mosaic' runs bfloat16/float16 experts"):
            tilax.moe_apply(params, x, config)


def test_mosaic_without_its_jax_module_gives_the_reason():
    with (_pallas.assume_device(platform="gpu", compute_capability=(9, 0),
                                mosaic_import_error="no module named absl"),
          pytest.raises(ValueError, match="cannot run on this device: no module named absl")):
        api.resolve_impl(_config(impl="mosaic", dtype=jnp.bfloat16))


def test_mosaic_tiles():
    with _pallas.assume_device(mosaic_unavailable_reason=None):
        tiles = api.kernel_tiles(_config(impl="mosaic", dtype=jnp.bfloat16, block_n=64))
    assert (tiles.block_m, tiles.block_n, tiles.programs_per_sm) == (128, 64, 2)


def test_auto_picks_mosaic_only_by_a_rule():
    # This small config matches no measured rule (tilax.moe.rules): auto keeps Triton.
    with _pallas.assume_device(platform="gpu", device_kind="NVIDIA H200",
                               mosaic_unavailable_reason=None):
        for impl in ("auto", "pallas"):
            assert api.resolve_impl(_config(impl=impl, dtype=jnp.bfloat16)) == "triton"


def test_config_type(setup):
    _, params, x = setup
    with pytest.raises(TypeError, match="config must be a tilax.MoEConfig"):
        tilax.moe_apply(params, x, dict(BASE))


def test_resolve_impl_and_tiles():
    assert api.resolve_impl(_config(impl="auto")) == "blocked"  # plain XLA on a CPU
    assert api.resolve_impl(_config(impl="triton")) == "interpret"
    assert api.resolve_impl(_config(impl="blocked")) == "blocked"
    assert api.resolve_impl(_config(routing="dense", impl="ragged_dot")) == "dense"
    tiles = api.kernel_tiles(_config(block_m=64, num_warps=8))
    assert (tiles.block_m, tiles.num_warps) == (64, 8)
    assert tiles.block_n == triton.default_tiles(jnp.float32).block_n


def test_public_names():
    assert {"MoEConfig", "moe_init", "moe_apply"} <= set(tilax.__all__)
    config = _config(shared_hidden=8)
    params = tilax.moe_init(jax.random.key(0), config)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype.name), params)
    assert shapes == {
        "router": ((16, 4), "float32"),
        "w_gate": ((4, 16, 32), "float32"),
        "w_up": ((4, 16, 32), "float32"),
        "w_down": ((4, 32, 16), "float32"),
        "shared": {
            "w_gate": ((16, 8), "float32"),
            "w_up": ((16, 8), "float32"),
            "w_down": ((8, 16), "float32"),
        },
    }
    bf16 = tilax.moe_init(jax.random.key(0), _config(dtype=jnp.bfloat16))
    assert bf16["router"].dtype == jnp.float32 and bf16["w_up"].dtype == jnp.bfloat16


@pytest.mark.parametrize("integer", [np.int64(32), np.int32(32), np.uint8(32)])
def test_config_takes_numpy_integers(integer):
    config = tilax.MoEConfig(d_model=integer, d_hidden=np.int16(32), num_experts=np.int64(4),
                             top_k=np.int64(2), dtype=jnp.float32)
    assert type(config.d_model) is int and config.d_model == 32
    assert config == _config(d_model=32, d_hidden=32)
    assert hash(config) == hash(_config(d_model=32, d_hidden=32))


@pytest.mark.parametrize("value", [True, np.bool_(True)])
def test_config_rejects_bools_as_sizes(value):
    with pytest.raises(ValueError, match="d_model must be an integer"):
        _config(d_model=value)


@pytest.mark.parametrize("key", ["w_dwon", "bias"])
def test_unknown_params_keys_are_named(key):
    config = _config()
    params = tilax.moe_init(jax.random.key(0), config)
    params[key] = params["w_down"]
    with pytest.raises(ValueError, match=f"unknown keys \\['{key}'\\]"):
        tilax.moe_apply(params, jnp.ones((4, 16)), config)


def test_unknown_shared_params_keys_are_named():
    config = _config(shared_hidden=16)
    params = tilax.moe_init(jax.random.key(0), config)
    params["shared"]["w_dwon"] = params["shared"]["w_down"]
    with pytest.raises(ValueError, match=r"params\['shared'\] has unknown keys \['w_dwon'\]"):
        tilax.moe_apply(params, jnp.ones((4, 16)), config)
