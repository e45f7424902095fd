"""Run the Mosaic GPU kernels on CPU in JAX's GPU interpret mode (a plain test module).

JAX's GPU interpreter (private in jax 0.10/0.11: ``jax._src.pallas.mosaic_gpu.interpret``)
simulates SMs, SMEM, TMA copies, barriers and ``wgmma`` on the CPU, on logical arrays: it checks
what a kernel computes (indices, masks, the stored rows, the epilogues), not layouts, swizzles,
register pressure or timing, which only the GPU tests do. Its ``wgmma`` reads operands through
index transforms only; :func:`gpu_interpreter` teaches it transposed operands
(``plgpu.transpose_ref``) by transposing what it reads, an operand A held in registers, TMA
stores that add into their destination (``reduction_op="add"``) and stores into a ``wgmma``
accumulator (``acc_ref[...] = value``).
Used by the MoE and RBF Mosaic GPU tests.
"""

from __future__ import annotations

import contextlib
import threading
import types

import numpy as np

_transposed = threading.local()
_reduce_lock = threading.Lock()


def available() -> str | None:
    """Why the interpreter cannot run here, or ``None``."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, params  # noqa: F401
        from jax._src.state.types import TransposeTransform  # noqa: F401
    except ImportError as err:
        return f"JAX's GPU interpret mode is not importable: {err}"
    if not callable(getattr(gpu_callbacks, "wgmma", None)):
        return "JAX's GPU interpreter has no wgmma callback"
    return None


def _strip_transpose(transforms):
    """``transforms`` without a trailing 2-D transpose, and whether there was one."""
    from jax._src.state.types import TransposeTransform

    if transforms and isinstance(transforms[-1], TransposeTransform):
        if tuple(transforms[-1].permutation) != (1, 0):
            raise NotImplementedError(f"transpose {transforms[-1].permutation}")
        return tuple(transforms[:-1]), True
    return tuple(transforms), False


@contextlib.contextmanager
def gpu_interpreter():
    """Kernels traced inside run in GPU interpret mode, transposed ``wgmma`` operands included.

    The wrapped callback drops the transpose from the operand's transforms (the interpreter
    reads the stored, untransposed tile) and the matmul it then calls transposes that tile.
    """
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, params

    original_wgmma, original_np = gpu_callbacks.wgmma, gpu_callbacks.np

    def matmul(a, b, **kwargs):
        a_t, b_t = getattr(_transposed, "flags", (False, False))
        registers = getattr(_transposed, "registers", None)
        if registers is not None:
            a = registers
        return np.matmul(a.T if a_t else a, b.T if b_t else b, **kwargs)

    def wgmma(*, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array,
              b_transforms, **kwargs):
        # An operand A held in registers arrives as its value where a buffer key would be: read
        # B's buffer in its place (a valid key) and multiply the value instead.
        a_value = np.asarray(a_allocation_key_as_array)
        registers = a_value if a_value.ndim > 1 else None
        if registers is not None:
            a_allocation_key_as_array, a_transforms = b_allocation_key_as_array, b_transforms
        a_transforms, a_t = _strip_transpose(a_transforms)
        b_transforms, b_t = _strip_transpose(b_transforms)
        _transposed.flags = (a_t and registers is None, b_t)
        _transposed.registers = registers
        try:
            return original_wgmma(
                a_allocation_key_as_array=a_allocation_key_as_array, a_transforms=a_transforms,
                b_allocation_key_as_array=b_allocation_key_as_array, b_transforms=b_transforms,
                **kwargs)
        finally:
            _transposed.flags, _transposed.registers = (False, False), None

    numpy_view = types.SimpleNamespace(**{n: getattr(np, n) for n in dir(np) if not n[:2] == "__"})
    numpy_view.matmul = matmul
    gpu_callbacks.wgmma, gpu_callbacks.np = wgmma, numpy_view
    try:
        with (params.force_gpu_interpret_mode(params.InterpretGPUParams()), _adding_stores(),
              _accumulator_stores()):
            yield
    finally:
        gpu_callbacks.wgmma, gpu_callbacks.np = original_wgmma, original_np


@contextlib.contextmanager
def _adding_stores():
    """TMA stores with ``reduction_op="add"`` (which the interpreter refuses) as stores that add:
    their destination buffers are remembered, and every store into one of them adds to what it
    holds (read, add and write under one lock, so that programs' additions are not lost)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.shared_memory import GPUSharedMemory

    original_copy, original_store = gpu_callbacks.copy_smem_to_gmem, (
        GPUSharedMemory.store_buffer_content)
    targets = []

    def copy_smem_to_gmem(*, reduction_op=None, dst_allocation_key_as_array, **kwargs):
        if reduction_op is not None:
            if str(reduction_op) != "add":
                raise NotImplementedError(f"reduction_op {reduction_op!r}")
            key = gpu_callbacks.HostAllocationKey.from_array(dst_allocation_key_as_array)
            if key not in targets:
                targets.append(key)
        return original_copy(reduction_op=None,
                             dst_allocation_key_as_array=dst_allocation_key_as_array, **kwargs)

    def store_buffer_content(self, key, access, value, thread, *args, **kwargs):
        if key not in targets:
            return original_store(self, key, access, value, thread, *args, **kwargs)
        with _reduce_lock:
            held, _, _ = self.get_buffer_content(key, access, thread)
            return original_store(self, key, access, held + value, thread, *args, **kwargs)

    gpu_callbacks.copy_smem_to_gmem = copy_smem_to_gmem
    GPUSharedMemory.store_buffer_content = store_buffer_content
    try:
        yield
    finally:
        gpu_callbacks.copy_smem_to_gmem = original_copy
        GPUSharedMemory.store_buffer_content = original_store


@contextlib.contextmanager
def _accumulator_stores():
    """Stores into a ``wgmma`` accumulator (``wgmma_accumulator_store_p``, which the interpreter
    has no rule for) as what they are there: a swap of the accumulator's whole buffer. Every
    jaxpr the interpreter runs has those equations rewritten first (sub-jaxprs too: the
    interpreter runs them through the same method)."""
    import jax
    from jax._src import core as jax_core
    from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
    from jax._src.pallas.mosaic_gpu.interpret.jaxpr_interpret import JaxprInterpreter
    from jax._src.state import primitives as state_primitives

    original = JaxprInterpreter.interpret
    store = gpu_primitives.wgmma_accumulator_store_p

    def as_swap(eqn):
        if eqn.primitive is not store:
            return eqn
        dropped = jax_core.DropVar(eqn.invars[1].aval)  # (accumulator, value)
        return eqn.replace(primitive=state_primitives.swap_p, outvars=[dropped],
                           params={"tree": jax.tree.structure(())})

    def interpret(self, jaxpr, token, *args):
        if any(eqn.primitive is store for eqn in jaxpr.eqns):
            jaxpr = jaxpr.replace(eqns=[as_swap(eqn) for eqn in jaxpr.eqns])
        return original(self, jaxpr, token, *args)

    JaxprInterpreter.interpret = interpret
    try:
        yield
    finally:
        JaxprInterpreter.interpret = original


def interpreter_for_loads():
    """:func:`gpu_interpreter`, for kernels that read vectors with ``plgpu.load`` and cast
    layouts: skips the test where the interpreter cannot run them (jax 0.10's has no
    ``plgpu.load``; the tests_jax011 session runs them) and makes layout casts identities
    (they only choose registers; the interpreter has no rule for them)."""
    import jax
    import pytest

    reason = available()
    if reason:
        pytest.skip(reason)
    if tuple(int(part) for part in jax.__version__.split(".")[:2]) < (0, 11):
        pytest.skip("jax 0.10's GPU interpreter cannot run plgpu.load (jax 0.11's can: the "
                    "tests_jax011 session runs this)")
    from jax._src.interpreters import mlir
    from jax._src.pallas.mosaic_gpu.core import layout_cast_p

    mlir.register_lowering(layout_cast_p, lambda ctx, x, **_: [x], platform="cpu")
    return gpu_interpreter()
