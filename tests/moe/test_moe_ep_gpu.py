"""Expert parallelism on the GPUs of one host against the single-device call (skipped unless
the default backend is a GPU with at least two devices).

Run on a multi-GPU host (e.g. nvidia-h200-x2), NVLink multicast off as the host requires::

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python -m pytest tests/moe/test_moe_ep_gpu.py -m gpu -q

Every exchange, so ``jax.lax.ragged_all_to_all`` and its transpose (the CPU tests run a
stand-in) are checked on the real collective: outputs, aux and every gradient. Token counts
are not multiples of the device count or of any tile.
"""

import jax
import pytest
from test_moe_ep import check_matches_one_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                       reason="needs two or more GPUs"),
]

LAYER = dict(d_model=256, d_hidden=512, num_experts=8, top_k=2, shared_hidden=256,
             capacity_factor=0.8)
TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-2}  # float32 kernels use TF32 on GPUs


@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
@pytest.mark.parametrize(
    "impl,dispatch,routing,dtype",
    [("pallas", "sorted", "dropless", "bfloat16"), ("pallas", "fused_gsum", "capacity",
                                                    "bfloat16"),
     ("pallas", "gather", "dropless", "float32"), ("ragged_dot", "sorted", "dropless",
                                                   "bfloat16")],
)
def test_gpu_mesh_matches_one_device(impl, dispatch, routing, dtype, exchange):
    devices = 2 if LAYER["num_experts"] % jax.device_count() else jax.device_count()
    check_matches_one_device(
        (devices,), ("expert",),
        dict(LAYER, impl=impl, dispatch=dispatch, routing=routing, dtype=dtype,
             exchange=exchange),
        3001, None, TOLERANCE[dtype])


@pytest.mark.parametrize("exchange", ["all_gather", "all_to_all"])
def test_gpu_all_tokens_to_one_device(exchange):
    check_matches_one_device(
        (2,), ("expert",), dict(LAYER, impl="pallas", dtype="bfloat16", exchange=exchange),
        2049, 0, TOLERANCE["bfloat16"])
