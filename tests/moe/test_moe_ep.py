"""Expert parallelism (``moe_apply(..., mesh=)``) on virtual CPU devices against the
single-device call: outputs, every ``aux`` entry and the gradients of a loss that uses ``y``
and both auxiliary losses, under ``jax.jit``, for every impl x dispatch x routing (with the
default exchange, ``all_gather``; the other exchanges on the cases that stress them).

Each check is a module-level function run by ``moe_testing.on_cpu_devices`` (here, or in a
child process with eight CPU devices). Token counts are not multiples of the device count (the
layer pads and masks), Pallas runs in interpret mode with 16-row tiles.
"""

import math

import numpy as np
import pytest
from helpers import peak_rel_err
from moe_testing import ep_inputs, on_cpu_devices

# Every case compiles a train step on a mesh of CPU devices, most with the Pallas kernels in
# interpret mode (10-40 s a case on two cores): nox -s tests_kernels runs them.
pytestmark = pytest.mark.kernels

LAYER = dict(d_model=24, d_hidden=40, num_experts=8, top_k=2, shared_hidden=16,
             block_m=16, block_n=16, block_k=16, capacity_factor=0.75, dtype="float32")
TOKENS = 45
PALLAS = [("pallas", d) for d in ("sorted", "gather", "fused", "fused_gsum")]
XLA = [("blocked", "sorted"), ("ragged_dot", "sorted")]


def _run(params, x, config, mesh, expert_axis="expert"):
    """``(y, aux, grads)`` of a jitted train step whose loss uses y and both aux losses."""
    import jax
    import jax.numpy as jnp

    import tilax

    cotangent = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape)

    def loss(params, x):
        y, aux = tilax.moe_apply(params, x, config, mesh=mesh, expert_axis=expert_axis)
        value = jnp.sum(y.astype(jnp.float32) * cotangent)
        value += 0.3 * aux["load_balance_loss"] + 0.2 * aux["router_z_loss"]
        return value, (y, aux)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (y, aux)), grads = step(params, x)
    return y, aux, grads


def _mesh(shape, names, explicit=False):
    """A mesh of the first devices; ``explicit``: ``jax.make_mesh``'s explicit-axes kind."""
    import jax
    from jax.sharding import Mesh

    devices = jax.devices()[: math.prod(shape)]
    if explicit:
        return jax.make_mesh(shape, names, devices=devices)
    return Mesh(np.array(devices).reshape(shape), names)


def check_matches_one_device(mesh_shape, axis_names, config_kwargs, tokens=TOKENS,
                             skew_to=None, tol=1e-5, explicit=False):
    """The mesh call equals the single-device call: y, aux and all gradients."""
    import jax

    import tilax

    config = tilax.MoEConfig(**config_kwargs)
    params, x = ep_inputs(config, tokens, skew_to)
    y_one, aux_one, grads_one = _run(params, x, config, None)
    y, aux, grads = _run(params, x, config, _mesh(mesh_shape, axis_names, explicit))
    assert y.shape == x.shape and y.dtype == y_one.dtype
    assert peak_rel_err(y, y_one) < tol, f"y: {peak_rel_err(y, y_one)}"
    for key in ("expert_counts", "empty_experts"):
        np.testing.assert_array_equal(aux[key], aux_one[key], err_msg=key)
    for key in ("max_expert_frac", "dropped_frac", "router_z_loss", "load_balance_loss"):
        np.testing.assert_allclose(aux[key], aux_one[key], rtol=1e-6, atol=1e-7, err_msg=key)
    flat_one = jax.tree_util.tree_flatten_with_path(grads_one)[0]
    for (path, expected), actual in zip(flat_one, jax.tree.leaves(grads), strict=True):
        assert peak_rel_err(actual, expected) < tol, f"gradient {jax.tree_util.keystr(path)}"
    if skew_to is not None:  # every copy went to two experts: the case is really skewed
        assert int(aux["empty_experts"]) == config.num_experts - 2
    if config.routing == "capacity":  # and capacity routing really dropped copies
        assert float(aux["dropped_frac"]) > 0


# Every impl and dispatch dropless; capacity routing with the two dispatches that share no
# kernel and both XLA impls (the 2-D mesh and skew tests add gather and fused_gsum).
MATRIX = ([(i, d, "dropless") for i, d in PALLAS + XLA]
          + [(i, d, "capacity") for i, d in [PALLAS[0], PALLAS[3], *XLA]])


@pytest.mark.parametrize("impl,dispatch,routing", MATRIX)
def test_expert_mesh_matches_one_device(impl, dispatch, routing):
    on_cpu_devices(check_matches_one_device, (4,), ("expert",),
                   dict(LAYER, impl=impl, dispatch=dispatch, routing=routing))


# DeepSeek-style routing: every device routes its tokens with the replicated bias and groups.
DEEPSEEK = dict(score_func="sigmoid", balance_bias=True, expert_groups=4, group_top_k=2,
                routed_scale=2.5)


@pytest.mark.parametrize("impl,dispatch,exchange", [
    ("blocked", "sorted", "all_gather"),
    ("blocked", "sorted", "all_to_all"),
    ("pallas", "fused_gsum", "all_gather"),
])  # fmt: skip
def test_deepseek_routing_on_a_mesh(impl, dispatch, exchange):
    on_cpu_devices(check_matches_one_device, (2, 2), ("data", "expert"),
                   dict(LAYER, impl=impl, dispatch=dispatch, exchange=exchange, **DEEPSEEK))


def test_dense_routing_on_a_mesh():
    on_cpu_devices(check_matches_one_device, (2, 2), ("data", "expert"),
                   dict(LAYER, routing="dense"))


@pytest.mark.parametrize(
    "impl,dispatch,routing",
    [("pallas", "sorted", "dropless"), ("pallas", "fused_gsum", "capacity"),
     ("ragged_dot", "sorted", "capacity")],
)
def test_data_by_expert_mesh(impl, dispatch, routing):
    on_cpu_devices(check_matches_one_device, (2, 2), ("data", "expert"),
                   dict(LAYER, impl=impl, dispatch=dispatch, routing=routing))


@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
@pytest.mark.parametrize(
    "impl,dispatch,routing,skew_to",
    [("pallas", "sorted", "dropless", 0), ("pallas", "fused_gsum", "dropless", 6),
     ("ragged_dot", "sorted", "dropless", 0), ("pallas", "gather", "capacity", 0)],
)
def test_all_tokens_to_one_device(impl, dispatch, routing, skew_to, exchange):
    # 8 experts on 4 devices: every copy goes to experts skew_to, skew_to + 1, both on one
    # device, which receives the worst-case buffer from every device (all_to_all) or computes
    # every copy of the group (all_gather).
    on_cpu_devices(check_matches_one_device, (4,), ("expert",),
                   dict(LAYER, impl=impl, dispatch=dispatch, routing=routing,
                        exchange=exchange), TOKENS, skew_to)


@pytest.mark.parametrize(
    "impl,dispatch,routing,mesh_shape,axis_names,skew_to",
    [("pallas", "sorted", "dropless", (4,), ("expert",), None),
     ("pallas", "fused_gsum", "capacity", (2, 2), ("data", "expert"), None),
     ("pallas", "gather", "dropless", (4,), ("expert",), 0),
     ("pallas", "fused", "dropless", (2, 2), ("expert", "data"), 6),
     ("ragged_dot", "sorted", "capacity", (4,), ("expert",), None),
     ("blocked", "sorted", "dropless", (2, 2), ("data", "expert"), None)],
)
def test_all_gather_exchange(impl, dispatch, routing, mesh_shape, axis_names, skew_to):
    # tokens gathered over the expert axis, partial outputs reduce-scattered: the same layer
    on_cpu_devices(check_matches_one_device, mesh_shape, axis_names,
                   dict(LAYER, impl=impl, dispatch=dispatch, routing=routing,
                        exchange="all_gather"), TOKENS, skew_to)


@pytest.mark.parametrize("impl,dispatch,routing,chunks",
                         [("pallas", "sorted", "dropless", 3), ("pallas", "fused", "capacity", 2),
                          ("ragged_dot", "sorted", "dropless", 5)])
def test_all_gather_exchange_in_chunks(impl, dispatch, routing, chunks):
    # 45 tokens on 4 devices: 12 per device (3 padding) in chunks of unequal sizes
    on_cpu_devices(check_matches_one_device, (4,), ("expert",),
                   dict(LAYER, impl=impl, dispatch=dispatch, routing=routing,
                        exchange="all_gather", exchange_chunks=chunks))


@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
def test_expert_axis_of_eight_with_top_k_above_local_experts(exchange):
    # one expert per device: a token's copies go to top_k different devices
    on_cpu_devices(check_matches_one_device, (8,), ("expert",),
                   dict(LAYER, impl="pallas", top_k=3, exchange=exchange), 29)


def test_bfloat16_and_leading_dimensions():
    on_cpu_devices(check_matches_one_device, (2, 2), ("expert", "data"),
                   dict(LAYER, impl="pallas", dispatch="fused_gsum", dtype="bfloat16"),
                   (3, 15), None, 2e-2)


@pytest.mark.parametrize("impl,tokens", [("pallas", TOKENS), ("ragged_dot", (3, 13))])
def test_explicit_axes_mesh(impl, tokens):
    # jax.make_mesh makes explicit-sharding axes: inputs are resharded with jax.reshard
    on_cpu_devices(check_matches_one_device, (2, 2), ("data", "expert"),
                   dict(LAYER, impl=impl), tokens, None, 1e-5, True)


def test_recompute_on_a_mesh():
    on_cpu_devices(check_matches_one_device, (4,), ("expert",),
                   dict(LAYER, impl="pallas", dispatch="gather", recompute=True,
                        recompute_rows=32))


def check_errors():
    import jax
    import jax.numpy as jnp

    import tilax

    config = tilax.MoEConfig(**dict(LAYER, impl="ragged_dot"))
    params, x = ep_inputs(config, 8, None)
    with pytest.raises(ValueError, match=r"num_experts \(8\) must be divisible by the size of "
                                         r"mesh axis 'expert' \(3\)"):
        tilax.moe_apply(params, x, config, mesh=_mesh((3,), ("expert",)))
    with pytest.raises(ValueError, match=r"expert_axis 'experts' is not an axis of the mesh "
                                         r"\(its axes are \('data', 'expert'\)\)"):
        tilax.moe_apply(params, x, config, mesh=_mesh((2, 2), ("data", "expert")),
                        expert_axis="experts")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        tilax.moe_apply(params, x, config, mesh=jax.devices())
    with pytest.raises(ValueError, match="exchange must be one of"):
        tilax.MoEConfig(**dict(LAYER, exchange="nccl"))
    # inputs are validated before anything is sharded
    with pytest.raises(ValueError, match=r"x must have shape \[..., d_model\]"):
        tilax.moe_apply(params, jnp.ones((8, 5)), config, mesh=_mesh((4,), ("expert",)))


def test_errors_name_the_axis_and_sizes():
    on_cpu_devices(check_errors)


def check_program_exchanges_tokens(exchange_name, routing):
    """The compiled program moves data between devices with the expected collectives."""
    import jax

    import tilax

    config = tilax.MoEConfig(**dict(LAYER, impl="ragged_dot", routing=routing,
                                    exchange=exchange_name))
    params, x = ep_inputs(config, 64, None)
    mesh = _mesh((4,), ("expert",))
    step = jax.jit(jax.grad(
        lambda p, x: tilax.moe_apply(p, x, config, mesh=mesh)[0].sum(), argnums=(0, 1)))
    lowered = step.lower(params, x)
    compiled = lowered.compile().as_text()
    if routing == "dense" or exchange_name == "all_gather":
        assert "all-gather" in compiled and "reduce-scatter" in compiled
        return
    assert "all-to-all" in compiled  # not optimised away
    # 16 tokens per device, B = 16 * min(top_k, 2 experts per device) = 32 slots for each of
    # the 4 devices (capacity: at most 2 * C = 24 fit a device's experts): the forward's trip
    # there and back and the backward's, over all devices
    rows = 32 if routing == "dropless" else 24
    blocks = [line for line in lowered.as_text().splitlines()
              if "stablehlo.all_to_all" in line and f"tensor<4x{rows}x24xf32>" in line
              and "split_count = 4" in line]  # among all 4 devices (jax 0.11 names mesh axes)
    assert len(blocks) >= 4, lowered.as_text()
    if routing == "capacity":  # every device learns how many copies earlier devices hold
        assert "all-gather" in compiled or "all-reduce" in compiled


@pytest.mark.parametrize("routing", ["dropless", "capacity", "dense"])
def test_compiled_program_exchanges_tokens(routing):
    on_cpu_devices(check_program_exchanges_tokens, "all_to_all", routing)


def test_compiled_all_gather_exchange_gathers_and_scatters():
    on_cpu_devices(check_program_exchanges_tokens, "all_gather", "dropless")


def check_always_fails():
    raise AssertionError("a failing check must fail its test")


def test_a_failing_check_fails_its_test():
    with pytest.raises((AssertionError, pytest.fail.Exception), match="must fail its test"):
        on_cpu_devices(check_always_fails)


@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
@pytest.mark.parametrize("impl,dispatch,routing", [
    ("pallas", "fused_gsum", "dropless"), ("blocked", "sorted", "capacity"),
    ("ragged_dot", "sorted", "dropless"),
])  # fmt: skip
def test_deterministic_on_a_mesh(impl, dispatch, routing, exchange):
    # MoEConfig.deterministic under expert parallelism: its gathering combine and gradients on
    # every device's share of the copies, against the single-device deterministic call, and
    # no order-dependent sum in the mesh's train step (the collectives' sums are NCCL's)
    kwargs = dict(LAYER, impl=impl, dispatch=dispatch, routing=routing, exchange=exchange,
                  deterministic=True)
    on_cpu_devices(check_matches_one_device, (4,), ("expert",), kwargs)
    on_cpu_devices(check_no_order_dependent_sum, (4,), ("expert",), kwargs)


def check_no_order_dependent_sum(mesh_shape, axis_names, config_kwargs):
    """The mesh's train step has no scatter-add or atomic (``moe_testing.order_dependent_ops``)
    with ``deterministic``, and the default's has (the check can see them)."""
    import jax
    import jax.numpy as jnp
    from moe_testing import order_dependent_ops

    import tilax

    mesh = _mesh(mesh_shape, axis_names)
    found = {}
    for flag in (False, True):
        config = tilax.MoEConfig(**dict(config_kwargs, deterministic=flag))
        params, x = ep_inputs(config, TOKENS)

        def loss(params, x, config=config):
            y, aux = tilax.moe_apply(params, x, config, mesh=mesh)
            return jnp.sum(y.astype(jnp.float32)) + aux["load_balance_loss"]

        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x)
        found[flag] = order_dependent_ops(jaxpr.jaxpr)
    assert found[False] and not found[True], found
