"""The Mosaic GPU kernels lower for CUDA on a CPU-only machine (jax.export).

Lowering runs Mosaic GPU's own compiler passes in Python: layout inference, the wgmma and TMA
shape rules, and the shared-memory budget (227 KiB per block, the sm90 limit it assumes with
no GPU to ask). A whole train step of the layer is exported per dispatch, at the benchmark's
sizes, so every kernel is lowered with the tiles it gets there. What lowering cannot check
(PTX compilation, registers, results) is left to tests/moe/test_moe_mosaic_gpu.py on Hopper.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.experimental.mosaic.gpu import core as mosaic_core

import tilax
from tilax import _pallas
from tilax.moe import rules
from tilax.moe.mosaic import common

# Each case exports a whole train step (10-20 s on two cores): nox -s tests_kernels runs them.
pytestmark = pytest.mark.kernels

MOSAIC_CALL = "stablehlo.custom_call @mosaic_gpu_v2"
WS_KERNEL = "moe_gmm_ws_mosaic_mosaic_gpu"  # the symbol in each serialized kernel
COPY_KERNEL = "moe_copy_rows_mosaic_mosaic_gpu"
# Kernels per train step: forward (gate, up and down projections; gate/up/SwiGLU fused in one
# kernel for the fused dispatches) and backward (SwiGLU backward, dx, two weight gradients).
KERNELS = {"sorted": 3 + 4, "gather": 3 + 4, "fused": 2 + 4, "fused_gsum": 2 + 4}
# Plus, where every copy has a row, the sorted copies of x (forward) and dy (backward).
ROW_COPIES = 2
# Plus the router's softmax and top-k, and their backward (mosaic.router), where a block of
# its tokens divides the tokens.
ROUTER = 2
# Plus, with a shared expert whose shapes take whole tiles, its forward and backward
# (mosaic.shared).
SHARED = 2
SHARED_KERNELS = ("shared_swiglu_fwd_mosaic_mosaic_gpu", "shared_swiglu_bwd_mosaic_mosaic_gpu")
# Less, where d_model is a multiple of 128 and d_hidden 64 or 128 (the decoder): dx and the
# gate/up weight gradients as one kernel (mosaic.gmm_dx).
JOINED = 1
DX_KERNEL = "moe_gmm_dx_mosaic_mosaic_gpu"
ROUTER_KERNEL = "moe_router_rank_mosaic_mosaic_gpu"
LAYER = dict(d_model=512, d_hidden=1024, num_experts=8, top_k=2)
DECODER = dict(d_model=512, d_hidden=128, num_experts=64, top_k=8, shared_hidden=1024)


@pytest.fixture(autouse=True)
def as_on_hopper():
    # The joined dx kernel is off in the layer until measured on the H200: lower it here.
    with _pallas.assume_device(mosaic_unavailable_reason=None), rules.choose(joined_dx="on"):
        yield


def lower_train_step(config, tokens: int) -> str:
    """The CUDA module of a train step. Every kernel must fit the shared memory its program
    gets: lowered once with the warp-specialised plain grouped matmul (one program per SM)
    replaced by the per-item kernel (and the joined dx kernel by the two it joins), within
    what one of ``programs_per_sm`` programs gets (by default half an SM, less the 1 KiB
    CUDA keeps), and once as it runs, within a block's limit."""
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.ShapeDtypeStruct((tokens, config.d_model), config.dtype)

    def loss(params, x):
        return jnp.sum(tilax.moe_apply(params, x, config)[0].astype(jnp.float32))

    def lower():
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        return export.export(step, platforms=["cuda"])(params, x).mlir_module()

    programs = common.tiles_for(config).programs_per_sm
    limit = min(_pallas.shared_memory_per_block(),
                _pallas.shared_memory_per_sm() // programs - 1024)
    with (rules.choose(gmm_ws="off", joined_dx="off", shared="xla"),
          mosaic_core.artificial_shared_memory_limit(limit)):
        lower()
    with mosaic_core.artificial_shared_memory_limit(_pallas.shared_memory_per_block()):
        return lower()


@pytest.mark.parametrize("dispatch", list(KERNELS))
def test_train_step_lowers(dispatch):
    config = tilax.MoEConfig(**LAYER, impl="mosaic", dispatch=dispatch)
    expected = KERNELS[dispatch] + ROW_COPIES + ROUTER
    assert lower_train_step(config, 4096).count(MOSAIC_CALL) == expected


@pytest.mark.parametrize("dispatch", ["sorted", "fused_gsum"])
def test_fine_grained_decoder_lowers(dispatch):
    config = tilax.MoEConfig(**DECODER, impl="mosaic", dispatch=dispatch)
    expected = KERNELS[dispatch] + ROW_COPIES + ROUTER + SHARED - JOINED
    module = lower_train_step(config, 2048)
    assert module.count(MOSAIC_CALL) == expected
    assert all(module.count(name) == 1 for name in SHARED_KERNELS)
    assert module.count(DX_KERNEL) == 1


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
@pytest.mark.parametrize("dispatch", ["sorted", "fused"])
def test_activations_lower(activation, dispatch):
    # The decoder (shared expert, joined dx) with the activation in every epilogue. The
    # not-gated gelu has no gate product (one fewer in the sorted forward) and no joined dx
    # (its backward has one pre-activation gradient).
    config = tilax.MoEConfig(**DECODER, impl="mosaic", dispatch=dispatch, activation=activation)
    gated = activation != "gelu"
    expected = KERNELS[dispatch] + ROW_COPIES + ROUTER + SHARED
    expected -= JOINED if gated else int(dispatch == "sorted")
    module = lower_train_step(config, 2048)
    assert module.count(MOSAIC_CALL) == expected
    assert module.count(DX_KERNEL) == int(gated)
    for part in ("fwd", "bwd"):
        assert module.count(f"shared_{activation}_{part}_mosaic_mosaic_gpu") == 1
    assert module.count(f"moe_gmm_{activation}_bwd_mosaic_mosaic_gpu") == 1


def test_shared_expert_off_whole_tiles_stays_on_xla():
    # 2000 tokens: not a multiple of the shared kernels' 128-row tiles.
    config = tilax.MoEConfig(**DECODER, impl="mosaic", dispatch="fused")
    module = lower_train_step(config, 2000)
    assert all(module.count(name) == 0 for name in SHARED_KERNELS)


@pytest.mark.parametrize("overrides", [
    dict(dtype=jnp.float16, routing="capacity"),
    dict(block_m=64, block_n=64, block_k=128, num_stages=2),
    dict(d_model=200, d_hidden=352),  # padded to 256 and 384: 64-wide tiles
    dict(recompute=True, recompute_rows=1024),
])  # fmt: skip
def test_variants_lower(overrides):
    config = tilax.MoEConfig(**{**LAYER, "impl": "mosaic", **overrides})
    assert lower_train_step(config, 1000).count(MOSAIC_CALL) >= KERNELS["sorted"]


def test_one_program_per_sm_lowers():
    config = tilax.MoEConfig(**LAYER, impl="mosaic", dispatch="fused_gsum")
    expected = KERNELS["fused_gsum"] + ROW_COPIES + ROUTER
    with rules.choose(programs_per_sm=1):
        assert common.tiles_for(config).programs_per_sm == 1
        assert lower_train_step(config, 4096).count(MOSAIC_CALL) == expected


@pytest.mark.parametrize(("tokens", "ranked_by_kernel"), [(2048, True), (1000, False)])
def test_router_ranks_with_the_kernel_where_blocks_divide_the_tokens(tokens, ranked_by_kernel):
    """The router's softmax and top-k run as one kernel (``mosaic.router``) where blocks of 64
    tokens divide the token count; XLA's softmax and argmax passes (reductions) the others."""
    config = tilax.MoEConfig(**DECODER, impl="mosaic", dispatch="fused")
    module = lower_forward(config, tokens)
    assert module.count(ROUTER_KERNEL) == int(ranked_by_kernel)
    reductions = module.count("stablehlo.reduce")
    triton = lower_forward(dataclasses.replace(config, impl="triton"), tokens)
    # Triton's layer never uses the kernel: XLA's argmax passes are the reductions it has more
    assert triton.count(ROUTER_KERNEL) == 0
    more = triton.count("stablehlo.reduce") - reductions
    assert more > 0 if ranked_by_kernel else more == 0


def lower_forward(config, tokens: int) -> str:
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.ShapeDtypeStruct((tokens, config.d_model), config.dtype)
    forward = jax.jit(lambda params, x: tilax.moe_apply(params, x, config)[0])
    return export.export(forward, platforms=["cuda"])(params, x).mlir_module()


@pytest.mark.parametrize(("dims", "block_m", "in_kernel"), [
    (DECODER, None, True),  # 128-row items in 64-row sub-tiles, 1 column tile
    (DECODER, 64, True),  # 64-row items (block_n 128): one sub-tile each
    (LAYER, None, False),  # 16 column tiles: each would gather the rows again
])  # fmt: skip
def test_fused_forward_gathers_rows_in_the_kernel(dims, block_m, in_kernel):
    """The SwiGLU kernel of the fused dispatches reads ``x`` through the sort index itself
    (``mosaic.gmm_gather``) where it pays: then the forward has one XLA row gather fewer."""
    config = tilax.MoEConfig(**dims, impl="mosaic", dispatch="fused", block_m=block_m,
                             block_n=None if block_m is None else 128)
    gathers = lower_forward(config, 2048).count("stablehlo.gather")
    with rules.choose(gather_rows="off"):
        gathers_by_xla = lower_forward(config, 2048).count("stablehlo.gather")
    assert gathers_by_xla > gathers if in_kernel else gathers_by_xla == gathers


def test_train_step_reads_copied_rows():
    """A dropless train step's kernels read sorted copies of ``x`` and ``dy`` that
    ``mosaic.gmm_rows`` makes (each token read once), not XLA's gathers of them, and its
    forward never gathers in the kernel (the backward reads the same copy)."""
    config = tilax.MoEConfig(**DECODER, impl="mosaic", dispatch="fused")
    module = lower_train_step(config, 2048)
    assert module.count(COPY_KERNEL) == ROW_COPIES
    gathers = module.count("stablehlo.gather")
    with rules.choose(gather_rows="off"):
        assert lower_train_step(config, 2048).count("stablehlo.gather") == gathers
    # The kernels gathering through XLA instead: XLA's gathers of x and dy come back (four
    # in jax 0.10.2's module, one per kernel reading them; two in jax 0.11.2's).
    with rules.choose(train_rows="gather"):
        module = lower_train_step(config, 2048)
    assert module.count(COPY_KERNEL) == 0
    assert module.count("stablehlo.gather") >= gathers + 2


def test_capacity_drops_gather_in_xla():
    """With copies dropped by capacity some copies have no row: XLA gathers instead."""
    config = tilax.MoEConfig(**DECODER, impl="mosaic", dispatch="fused", routing="capacity",
                             capacity_factor=0.5)
    assert lower_train_step(config, 2048).count(COPY_KERNEL) == 0


@pytest.mark.parametrize(("dims", "dispatch", "launches", "narrow_launches"), [
    # The down projection (contraction 128); dx runs with the gate/up weight gradients
    # (mosaic.gmm_dx) at d_model 512.
    (DECODER, "fused", 1, 0),
    (DECODER, "fused_gsum", 1, 0),  # the combine's down projection (unscaled rows)
    (DECODER, "sorted", 1, 0),  # not gate and up: their contraction is d_model = 512
    (LAYER, "sorted", 0, 2),  # contractions of 512 and 1024; with d_model 192, gate and up
])  # fmt: skip
def test_short_plain_grouped_matmuls_are_warp_specialised(dims, dispatch, launches,
                                                          narrow_launches):
    """Unscaled plain grouped matmuls over a short contraction, whose columns split over two
    warpgroups' tiles, run the warp-specialised kernel; the others the per-item kernel."""
    config = tilax.MoEConfig(**dims, impl="mosaic", dispatch=dispatch)
    assert lower_train_step(config, 2048).count(WS_KERNEL) == launches
    # d_model 192: the down projection and dx have three 64-column tiles
    narrow = tilax.MoEConfig(**{**dims, "d_model": 192}, impl="mosaic", dispatch=dispatch)
    assert lower_train_step(narrow, 2048).count(WS_KERNEL) == narrow_launches


# DeepSeek-style routing on the decoder (issue 77): sigmoid scores run on the router kernels;
# with the balance bias and expert groups XLA routes and the other kernels are unchanged.
DEEPSEEK = dict(score_func="sigmoid", balance_bias=True, expert_groups=8, group_top_k=4,
                routed_scale=2.5)


@pytest.mark.parametrize(("router", "ranked_by_kernel"), [
    (dict(score_func="sigmoid", routed_scale=2.5), True),
    (DEEPSEEK, False),
])  # fmt: skip
def test_deepseek_style_routing_lowers(router, ranked_by_kernel):
    config = tilax.MoEConfig(**DECODER, impl="mosaic", dispatch="fused", **router)
    module = lower_train_step(config, 2048)
    expected = KERNELS["fused"] + ROW_COPIES + SHARED - JOINED + ROUTER * ranked_by_kernel
    assert module.count(MOSAIC_CALL) == expected
    assert module.count(ROUTER_KERNEL) == int(ranked_by_kernel)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_fp8_train_step_lowers(activation):
    # quantize="fp8": every expert product on the FP8 kernels (mosaic.gmm_fp8): forward and
    # input gradients (gate, up, down; d_act, dx from up and gate) and the weight gradients,
    # one each fewer without the gate; the router runs in XLA on this path (fp8.py).
    config = tilax.MoEConfig(**LAYER, impl="mosaic", quantize="fp8", activation=activation)
    products = 6 if activation == "swiglu" else 4
    module = lower_train_step(config, 4096)
    assert module.count("moe_gmm_fp8_mosaic_mosaic_gpu") == products
    assert module.count("moe_tgmm_fp8_mosaic_mosaic_gpu") == products // 2
    assert module.count(MOSAIC_CALL) == products + products // 2
