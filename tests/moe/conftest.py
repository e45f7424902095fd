"""tests/moe: give JAX eight CPU devices for the expert-parallel tests when it is not too late.

Running tests/moe alone, this file is imported before anything starts JAX's backend, so the
mesh tests run in this process. In a whole-suite run another folder's conftest starts the
backend first; the mesh tests then run their checks in a fresh interpreter with eight CPU
devices (``moe_testing.on_cpu_devices``).
"""

import jax
from moe_testing import MESH_DEVICES

try:
    jax.config.update("jax_num_cpu_devices", MESH_DEVICES)
except RuntimeError:  # the backend already started: the mesh tests use child processes
    pass
