"""Mesh checks of ``test_moe_transformations.py``, run by ``moe_testing.on_cpu_devices`` (here
or in a child interpreter with eight CPU devices): the mesh path differentiated outside
``jax.jit``, and ``y``'s sharding when the tokens do not divide over the devices."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from helpers import peak_rel_err
from jax.sharding import PartitionSpec as P

import tilax

LAYER = dict(d_model=16, d_hidden=16, num_experts=8, top_k=2, shared_hidden=8,
             impl="blocked", dtype=jnp.float32)


def _inputs(tokens, **overrides):
    config = tilax.MoEConfig(**{**LAYER, **overrides})
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (*np.atleast_1d(tokens), config.d_model))
    return params, x, config


def check_grads_outside_jit(mesh_shape, axis_names, tokens, impl, explicit):
    """``jax.grad`` w.r.t. params and x of the mesh call, not under ``jax.jit``, equals the
    single-device gradients (and so does ``jax.value_and_grad``): on a mesh of automatic axes
    as it is, on one of explicit axes (``jax.make_mesh``'s default) inside ``jax.set_mesh``, as
    JAX asks of any eager computation on explicit axes."""
    params, x, config = _inputs(tokens, impl=impl)
    mesh = _mesh(mesh_shape, axis_names, explicit)
    with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
        _check_grads(params, x, config, mesh)


def _mesh(mesh_shape, axis_names, explicit):
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return jax.make_mesh(mesh_shape, axis_names, axis_types=(kind,) * len(axis_names))


def check_grads_on_jax_make_mesh(tokens):
    """The issue's case: ``jax.make_mesh``'s explicit axes, inputs not placed, no mesh in
    context, eager ``jax.grad`` w.r.t. params and x."""
    params, x, config = _inputs(tokens)
    _check_grads(params, x, config, jax.make_mesh((4,), ("expert",)))


def _check_grads(params, x, config, mesh):
    def loss(params, x, mesh):
        y, aux = tilax.moe_apply(params, x, config, mesh=mesh)
        return jnp.sum(jnp.sin(y)) + 0.3 * aux["load_balance_loss"] + 0.2 * aux["router_z_loss"]

    expected = jax.grad(loss, argnums=(0, 1))(params, x, None)
    grad_params = jax.grad(loss)(params, x, mesh)
    grad_x = jax.grad(loss, argnums=1)(params, x, mesh)
    flat = jax.tree_util.tree_flatten_with_path(expected[0])[0]
    for (path, want), got in zip(flat, jax.tree.leaves(grad_params), strict=True):
        assert peak_rel_err(got, want) < 1e-5, jax.tree_util.keystr(path)
    assert grad_x.shape == x.shape
    assert peak_rel_err(grad_x, expected[1]) < 1e-5
    value, _ = jax.value_and_grad(loss)(params, x, mesh)
    assert abs(float(value) - float(loss(params, x, None))) < 1e-4


def check_y_sharding(mesh_shape, axis_names, tokens):
    """``y`` is split over the mesh along its first dimension where that divides over the
    devices, else replicated (JAX splits dimensions only evenly), and equals one device's."""
    params, x, config = _inputs(tokens)
    mesh = jax.make_mesh(mesh_shape, axis_names)
    y, _ = tilax.moe_apply(params, x, config, mesh=mesh)
    y_one, _ = tilax.moe_apply(params, x, config)
    assert y.shape == x.shape
    assert peak_rel_err(y, y_one) < 1e-5
    spec = P(tuple(axis_names)) if x.shape[0] % mesh.size == 0 else P()
    want = jax.sharding.NamedSharding(mesh, spec)
    assert y.sharding.is_equivalent_to(want, y.ndim), (y.sharding, spec)
