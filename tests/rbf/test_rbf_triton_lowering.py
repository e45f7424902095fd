"""The RBF kernels lower to Triton on a CPU-only machine (jax.export for the CUDA platform).

Interpret mode (the other CPU tests) runs the kernels' JAX semantics; this runs the Pallas Triton
lowering itself, which enforces what interpret mode does not (power-of-two tensor sizes, the
supported primitives). Triton's own compilation (shared memory, registers) needs the GPU:
tests/rbf/test_rbf_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

from tilax.rbf import config as rbf_config
from tilax.rbf import vjp as rbf_vjp

TRITON_CALL = "__gpu$xla.gpu.triton"


def lower_for_cuda(fn, *shapes) -> str:
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
    try:
        exported = export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
        )(*args)  # fmt: skip
    except RuntimeError as err:
        # jax 0.11's Triton lowering reads the GPU it lowers for: without one it cannot run
        # here (jax 0.10, this project's CPU environment, lowers without a GPU)
        if "No supported GPU devices found" in str(err) and jax.default_backend() == "cpu":
            pytest.skip(f"jax {jax.__version__} lowers Pallas Triton only with a GPU present")
        raise
    return exported.mlir_module()


#: The launches are Triton's on an H200 (no Mosaic GPU: this test lowers the Triton kernels).
TRITON_H200 = rbf_config.Device(mosaic=False, cores=132, shared_memory=232448)


@pytest.mark.parametrize(
    "precision, dim, out, per_dimension",
    [("highest", 8, 16, True), (None, 20, 100, False), ("high", 3, 1, True),
     ("highest", 17, 70, False)],
)  # fmt: skip
def test_kernel_mv_forward_and_backward_lower(precision, dim, out, per_dimension):
    n, m = 300, 200
    cfg = rbf_config.default_config("triton", precision, batch=1, n=n, m=m, out=out, dim=dim,
                                    device=TRITON_H200)

    def fwd_bwd(q, k, v, lengthscale, g):
        out, vjp = jax.vjp(lambda *a: rbf_vjp.kernel_mv(*a, cfg), q, k, v, lengthscale)
        return out, vjp(g)

    module = lower_for_cuda(fwd_bwd, (1, n, dim), (1, m, dim), (1, m, out),
                            (dim,) if per_dimension else (), (1, n, out))  # fmt: skip
    # forward, query and key gradients (+ dv when O > 64), for each distance path
    paths = 1 if precision == "highest" else 2
    assert module.count(TRITON_CALL) >= 3 * paths


@pytest.mark.parametrize("precision, dim", [(None, 3), ("highest", 17)])
def test_kde_forward_and_backward_lower(precision, dim):
    n, m = 300, 200
    cfg = rbf_config.default_config("triton", precision, batch=1, n=n, m=m, out=1, dim=dim,
                                    device=TRITON_H200)

    def fwd_bwd(query, data, weights, bandwidth, g):
        out, vjp = jax.vjp(lambda *a: rbf_vjp.kde_log_sum(*a, cfg), query, data, weights,
                           bandwidth)  # fmt: skip
        return out, vjp(g)

    module = lower_for_cuda(fwd_bwd, (1, n, dim), (1, m, dim), (1, m), (), (1, n))
    assert module.count(TRITON_CALL) >= 3 * (1 if precision == "highest" else 2)
