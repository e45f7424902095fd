"""The JAX transformations users reach for: jit without static_argnums, grad and vmap with the
config positional, the mesh path outside jit, and vmap over every impl."""

import dataclasses

import ep_transformations
import jax
import jax.numpy as jnp
import pytest
from helpers import rel_err
from moe_testing import on_cpu_devices

import tilax
from tilax import _pallas

CONFIG = dict(d_model=32, d_hidden=32, num_experts=4, top_k=2, dtype=jnp.float32)


def _setup(impl="ragged_dot", **overrides):
    config = tilax.MoEConfig(**{**CONFIG, "impl": impl, **overrides})
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (12, config.d_model))
    return params, x, config


def test_config_is_a_pytree_without_leaves():
    _, _, config = _setup()
    leaves, treedef = jax.tree_util.tree_flatten(config)
    assert leaves == []
    assert jax.tree_util.tree_unflatten(treedef, []) == config


def test_an_eager_call_runs_the_layer_as_one_compiled_program():
    """Outside ``jax.jit`` the layer still compiles as one program (a ``jit`` inside
    ``moe_apply``), not one dispatch per operation: on a CPU that is the difference between
    about 1 s and 5 s for a small layer's first call. The argument checks stay outside it,
    and a change of the assumed device retraces it (``_pallas.trace_facts``)."""
    params, x, config = _setup("blocked")
    jaxpr = jax.make_jaxpr(lambda p, x: tilax.moe_apply(p, x, config))(params, x)
    assert [eqn.primitive.name for eqn in jaxpr.eqns] == ["jit"]
    y, _ = tilax.moe_apply(params, x, config)
    fp8 = dataclasses.replace(config, dtype=jnp.bfloat16, quantize="fp8")
    tilax.moe_apply(params, x, fp8)  # compiled for the CPU: the GPU's check still runs
    with _pallas.assume_device(platform="gpu", device_kind="NVIDIA A100",
                               compute_capability=(8, 0)):
        with pytest.raises(ValueError, match="needs FP8 tensor cores"):
            tilax.moe_apply(params, x, fp8)
    with pytest.raises(ValueError, match="d_model"):
        tilax.moe_apply(params, x[:, :3], config)
    assert rel_err(tilax.moe_apply(params, x, config)[0], y) == 0


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_jit_takes_the_config_positionally(impl):
    params, x, config = _setup(impl)
    y, aux = jax.jit(tilax.moe_apply)(params, x, config)
    y_ref, aux_ref = tilax.moe_apply(params, x, config)
    assert rel_err(y, y_ref) < 1e-6
    assert (aux["expert_counts"] == aux_ref["expert_counts"]).all()


def test_grad_and_vmap_take_the_config_positionally():
    params, x, config = _setup("blocked")

    def loss(p, x, config):
        return tilax.moe_apply(p, x, config)[0].sum()

    grads = jax.grad(loss)(params, x, config)
    grads_ref = jax.jit(jax.grad(lambda p: loss(p, x, config)))(params)
    assert rel_err(grads["w_down"], grads_ref["w_down"]) < 1e-6
    xb = jnp.stack([x, -x])
    y = jax.jit(jax.vmap(lambda x, config: tilax.moe_apply(params, x, config)[0]))(xb, config)
    assert y.shape == xb.shape
    assert rel_err(y[1], tilax.moe_apply(params, -x, config)[0]) < 1e-6


def test_jit_of_grad_takes_the_config_positionally():
    params, x, config = _setup("blocked")
    grad = jax.jit(jax.grad(lambda p, x, c: tilax.moe_apply(p, x, c)[0].sum()))
    first = grad(params, x, config)
    again = grad(params, x, tilax.MoEConfig(**{**CONFIG, "impl": "blocked"}))  # equal: cached
    assert rel_err(first["w_up"], again["w_up"]) == 0


def _ran_pallas(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU rule")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_auto_on_a_cpu_runs_blocked_xla_not_the_interpreter(dtype):
    params, x, config = _setup("auto", dtype=dtype)
    blocked = tilax.MoEConfig(**{**CONFIG, "impl": "blocked", "dtype": dtype})

    def loss(p, x, config):
        return tilax.moe_apply(p, x, config)[0].astype(jnp.float32).sum()

    assert not _ran_pallas(lambda p, x: jax.grad(loss)(p, x, config), params, x)
    assert _ran_pallas(lambda p, x: tilax.moe_apply(p, x, _setup("pallas")[2])[0], params, x)
    y, _ = tilax.moe_apply(params, x, config)
    y_blocked, _ = tilax.moe_apply(params, x, blocked)
    assert (y == y_blocked).all()  # the same function, so the same bits
    grads = jax.grad(loss)(params, x, config)
    assert (grads["w_gate"] == jax.grad(loss)(params, x, blocked)["w_gate"]).all()


# Run in a fresh interpreter: every import statement in a tilax module that names a JAX Pallas,
# Mosaic GPU or Triton module, or tilax's own Mosaic GPU or Triton modules (already imported or
# not), with the importing module.
_WATCH_IMPORTS = """
import builtins
culprits = []
plain_import = builtins.__import__

def gpu_backend(name):
    if name.startswith("jax"):
        return any(word in name for word in ("pallas", "mosaic", "triton"))
    return name.startswith("tilax") and ("mosaic" in name or "triton" in name)

def watched(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "")
    names = [name] + [name + "." + item for item in fromlist or ()]
    if importer.startswith("tilax") and any(gpu_backend(full) for full in names):
        culprits.append((name, importer))
    return plain_import(name, globals, locals, fromlist, level)

builtins.__import__ = watched
import jax, jax.numpy as jnp
import tilax
config = tilax.MoEConfig(d_model=16, d_hidden=16, num_experts=4, top_k=2)
params = tilax.moe_init(jax.random.key(0), config)
jax.block_until_ready(tilax.moe_apply(params, jnp.ones((8, 16)), config))
points = jnp.ones((8, 2))
jax.block_until_ready(tilax.rbf_kernel_mv(points, points, jnp.ones((8, 1)), 1.0))
jax.block_until_ready(tilax.rbf_kde_density(points, points, 1.0))
print(repr(sorted(set(culprits))))
"""


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="what a CPU imports")
def test_import_tilax_and_auto_on_a_cpu_load_no_gpu_backend():
    """``import tilax``, an ``impl="auto"`` layer and ``impl="auto"`` kernel sums on a CPU
    import no Mosaic GPU or Triton module (tilax's or JAX's) from anywhere in the package."""
    import ast
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _WATCH_IMPORTS], capture_output=True,
                          text=True, timeout=120, check=True)
    culprits = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert culprits == [], culprits


@pytest.mark.parametrize("mesh_shape,axis_names,tokens,impl,explicit", [
    ((4,), ("expert",), 12, "blocked", False),
    ((4,), ("expert",), 12, "blocked", True),  # inside jax.set_mesh
    ((2, 2), ("data", "expert"), 10, "ragged_dot", False),  # T not a multiple of 4
])  # fmt: skip
def test_mesh_grads_outside_jit(mesh_shape, axis_names, tokens, impl, explicit):
    on_cpu_devices(ep_transformations.check_grads_outside_jit, mesh_shape, axis_names, tokens,
                   impl, explicit)


@pytest.mark.parametrize("tokens", [12, 10])
def test_mesh_grads_outside_jit_on_jax_make_mesh(tokens):
    on_cpu_devices(ep_transformations.check_grads_on_jax_make_mesh, tokens)


@pytest.mark.parametrize("mesh_shape,axis_names,tokens", [
    ((4,), ("expert",), 12), ((4,), ("expert",), 10), ((4,), ("expert",), (4, 3)),
    ((2, 2), ("data", "expert"), (2, 5)),
])  # fmt: skip
def test_mesh_y_split_over_tokens_where_they_divide(mesh_shape, axis_names, tokens):
    on_cpu_devices(ep_transformations.check_y_sharding, mesh_shape, axis_names, tokens)


# Every day each impl and each routing at least once; the other pairs in tests_kernels.
VMAP_CASES = [
    pytest.param("ragged_dot", "dropless", False, marks=pytest.mark.kernels),
    pytest.param("ragged_dot", "capacity", False, marks=pytest.mark.kernels),
    ("ragged_dot", "dropless", True), ("blocked", "dropless", False),
    ("blocked", "capacity", False), ("auto", "dense", False),
    pytest.param("pallas", "dropless", False, marks=pytest.mark.kernels),
]


@pytest.mark.parametrize("impl,routing,recompute", VMAP_CASES)
def test_vmap_over_tokens_equals_each_call(impl, routing, recompute):
    """``jax.vmap`` of the layer over a batch of token sets: each element's ``y`` and ``aux``
    are its own call's (capacity per element), and so are the gradients."""
    params, _, config = _setup(impl, routing=routing, recompute=recompute, capacity_factor=0.5)
    xb = jax.random.normal(jax.random.key(2), (3, 10, config.d_model))

    apply = jax.jit(lambda x: tilax.moe_apply(params, x, config))
    y, aux = jax.jit(jax.vmap(apply))(xb)
    for i in range(xb.shape[0]):
        y_one, aux_one = apply(xb[i])
        assert rel_err(y[i], y_one) < 1e-6
        for key, value in aux_one.items():
            assert jnp.allclose(aux[key][i], value, rtol=1e-6), key

    def loss(p, x):
        return jnp.sum(jnp.sin(tilax.moe_apply(p, x, config)[0]))

    grads = jax.jit(jax.grad(lambda p: jnp.sum(jax.vmap(lambda x: loss(p, x))(xb))))(params)
    grads_x = jax.jit(jax.vmap(jax.grad(loss, argnums=1), in_axes=(None, 0)))(params, xb)
    grad_each = jax.jit(jax.grad(loss, argnums=(0, 1)))
    grads_each = [grad_each(params, xb[i]) for i in range(xb.shape[0])]
    for name in ("router", "w_gate", "w_up", "w_down"):
        want = sum(g[0][name] for g in grads_each)
        assert rel_err(grads[name], want) < 1e-5, name
    for i, (_, grad_x) in enumerate(grads_each):
        assert rel_err(grads_x[i], grad_x) < 1e-5


def test_vmap_over_parameters_and_under_jit():
    """An ensemble: vmap over stacked parameters and tokens together, jitted."""
    params, x, config = _setup()
    other = tilax.moe_init(jax.random.key(5), config)
    stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params, other)
    xb = jnp.stack([x, 2 * x])
    y = jax.jit(jax.vmap(lambda p, x: tilax.moe_apply(p, x, config)[0]))(stacked, xb)
    assert rel_err(y[0], tilax.moe_apply(params, x, config)[0]) < 1e-6
    assert rel_err(y[1], tilax.moe_apply(other, 2 * x, config)[0]) < 1e-6
