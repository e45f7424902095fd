"""One process of the two-process expert-parallel test (``test_moe_ep_processes.py``).

    python ep_process.py PROCESS_ID PORT OUT.npz

Joins a two-process JAX cluster on this machine (coordinator ``127.0.0.1:PORT``; CPU
collectives over gloo), two CPU devices each, and runs a jitted train step of the MoE layer
on a four-device expert mesh that spans both processes, so token copies cross between the
processes. Process 0 writes ``y``, ``aux`` and the gradients (replicated to every process
first) to ``OUT.npz``.
"""

import sys

import jax
import numpy as np
from moe_testing import ep_inputs

import tilax

# the layer the test compares: 8 experts over the 4 devices, 2 of them per device
CONFIG = dict(d_model=24, d_hidden=40, num_experts=8, top_k=2, shared_hidden=16,
              block_m=16, block_n=16, block_k=16, dtype="float32", impl="pallas",
              dispatch="sorted", routing="capacity", capacity_factor=1.0)
TOKENS = 46


def train_step(config, mesh):
    """value_and_grad of a loss of y and both aux losses (mesh=None: one device)."""
    import jax.numpy as jnp

    def loss(params, x):
        y, aux = tilax.moe_apply(params, x, config, mesh=mesh)
        cotangent = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
        value = jnp.sum(y * cotangent) + 0.3 * aux["load_balance_loss"]
        return value + 0.2 * aux["router_z_loss"], (y, aux)

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def flat(result) -> dict:
    """``{name: array}`` of ``((loss, (y, aux)), grads)`` for an npz file."""
    (_, (y, aux)), grads = result
    out = {"y": np.asarray(y), **{f"aux_{k}": np.asarray(v) for k, v in aux.items()}}
    for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        out[f"grad{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return out


def main(process_id: int, port: int, out: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    config = tilax.MoEConfig(**CONFIG)
    params, x = jax.tree.map(np.asarray, ep_inputs(config, TOKENS))
    mesh = Mesh(np.array(jax.devices()), ("expert",))  # devices of both processes
    assert len({d.process_index for d in mesh.devices.flat}) == 2
    replicated = NamedSharding(mesh, P())

    def global_array(value):
        return jax.make_array_from_callback(value.shape, replicated, lambda index: value[index])

    step = jax.jit(train_step(config, mesh), out_shardings=replicated)
    result = step(jax.tree.map(global_array, params), global_array(x))
    if process_id == 0:
        np.savez(out, **flat(result))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
