"""The decode path (``tilax.moe.decode``, ``impl="decode"``): its schedule against a NumPy
enumeration, its Triton kernels in the Pallas interpreter against a float64 NumPy oracle (at
1, 3 and 16 tokens, experts without tokens, a token routed to most experts, an expert whose
rows take several chunks, capacity drops, the other expert activations and their Triton
lowering), its gradient (the training kernels' under the custom VJP), and the rule that makes
``impl="auto"`` take it for small batches on GPUs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_err

import tilax
from tilax import _pallas
from tilax.moe import api, decode, dispatch, rules
from tilax.moe.base import RoutedCopies

H200 = dict(platform="gpu", device_kind="NVIDIA H200", mosaic_unavailable_reason=None, sm_count=132)


def _np_gelu(v):
    """The tanh-approximate gelu in float64."""
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))


def experts_oracle(
    x, w_gate, w_up, w_down, expert_ids, weights, kept=None, activation="swiglu"
) -> np.ndarray:
    """float64 ``y[t] = sum_j kept * weights[t, j] * expert_{expert_ids[t, j]}(x[t])``: the
    SwiGLU expert, or the GeGLU one, or ``gelu(x @ w_up) @ w_down`` (``w_gate`` unused)."""
    x, w_up, w_down, weights = (np.asarray(a, np.float64) for a in (x, w_up, w_down, weights))
    expert_ids = np.asarray(expert_ids)
    kept = np.ones(expert_ids.shape, bool) if kept is None else np.asarray(kept)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(expert_ids[t]):
            if kept[t, j]:
                up = x[t] @ w_up[e]
                if activation == "gelu":
                    hidden = _np_gelu(up)
                else:
                    gate = x[t] @ np.asarray(w_gate[e], np.float64)
                    f = gate / (1 + np.exp(-gate)) if activation == "swiglu" else _np_gelu(gate)
                    hidden = f * up
                y[t] += weights[t, j] * (hidden @ w_down[e])
    return y


def _inputs(num_tokens, d, h, num_experts, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (num_tokens, d), jnp.float32).astype(dtype)
    w_gate = (jax.random.normal(keys[1], (num_experts, d, h)) / np.sqrt(d)).astype(dtype)
    w_up = (jax.random.normal(keys[2], (num_experts, d, h)) / np.sqrt(d)).astype(dtype)
    w_down = (jax.random.normal(keys[3], (num_experts, h, d)) / np.sqrt(h)).astype(dtype)
    return x, w_gate, w_up, w_down


def _config(d, h, num_experts, top_k, dtype=jnp.float32, **kw):
    return tilax.MoEConfig(
        d_model=d,
        d_hidden=h,
        num_experts=num_experts,
        top_k=top_k,
        impl="decode",
        dtype=dtype,
        **kw,
    )


def _random_choices(num_tokens, num_experts, top_k, seed=1):
    """Distinct experts per token and positive weights (fixed seed)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)])
    weights = rng.uniform(0.1, 1.0, (num_tokens, top_k))
    return jnp.asarray(ids, jnp.int32), jnp.asarray(weights, jnp.float32)


# ----------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("sizes,block_m", [
    ([0, 3, 0, 0, 1, 0, 0, 2], 16),  # T=1-like: few touched experts, most empty
    ([40, 0, 5, 16, 17, 0, 0, 2], 16),  # experts of several chunks, a chunk of exactly 16
    ([0, 0, 0, 0], 16),  # nothing kept
    ([33, 31], 32),
])  # fmt: skip
def test_schedule_covers_each_kept_row_once(sizes, block_m):
    sizes = np.array(sizes, np.int32)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    num_rows = max(int(sizes.sum()), 1)
    schedule = decode.decode_schedule(jnp.asarray(sizes), jnp.asarray(offsets), num_rows, block_m)
    expert, start, rows = (np.asarray(a) for a in schedule)
    assert expert.shape[0] == decode.schedule_items(num_rows, len(sizes), block_m)
    covered = []
    for e, s, n in zip(expert, start, rows, strict=True):
        assert 0 <= n <= block_m
        if n:
            assert offsets[e] <= s and s + n <= offsets[e + 1], (e, s, n)
            covered += list(range(s, s + n))
    assert sorted(covered) == list(range(int(sizes.sum())))
    touched = int(np.sum(sizes > 0))
    assert int(np.sum(rows > 0)) == int(np.sum(-(-sizes // block_m))) <= touched + num_rows // 16


# ----------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [
    (1, 8, 2),  # six experts without a token
    pytest.param(3, 8, 6, marks=pytest.mark.kernels),  # each token on most experts
    pytest.param(16, 8, 2, marks=pytest.mark.kernels),
])  # fmt: skip
def test_decode_layer_matches_the_oracle(num_tokens, num_experts, top_k):
    d, h = 32, 48  # h pads to 64: padded columns stay exact zeros
    config = _config(d, h, num_experts, top_k)
    params = tilax.moe_init(jax.random.key(num_tokens), config)
    x = jax.random.normal(jax.random.key(7), (num_tokens, d), jnp.float32)
    y, aux = tilax.moe_apply(params, x, config)
    routed = tilax.moe.router.route(x, params["router"], top_k, True)
    expected = experts_oracle(
        x, params["w_gate"], params["w_up"], params["w_down"], routed.expert_ids, routed.weights
    )
    assert rel_err(y, expected) < 1e-5
    assert int(aux["expert_counts"].sum()) == num_tokens * top_k


@pytest.mark.parametrize("activation,num_tokens", [
    ("gelu", 1),  # not gated: the kernel's one accumulator, no w_gate
    pytest.param("geglu", 5, marks=pytest.mark.kernels),
])  # fmt: skip
def test_decode_kernels_follow_the_activation(activation, num_tokens):
    """The gate/up kernel's epilogue computes ``MoEConfig.activation`` (activations.hidden)."""
    num_experts, top_k, d, h = 8, 2, 32, 48
    config = _config(d, h, num_experts, top_k, activation=activation)
    params = tilax.moe_init(jax.random.key(num_tokens), config)
    assert ("w_gate" in params) == (activation != "gelu")
    x = jax.random.normal(jax.random.key(7), (num_tokens, d), jnp.float32)
    y, _ = tilax.moe_apply(params, x, config)
    routed = tilax.moe.router.route(x, params["router"], top_k, True)
    expected = experts_oracle(
        x,
        params.get("w_gate"),
        params["w_up"],
        params["w_down"],
        routed.expert_ids,
        routed.weights,
        activation=activation,
    )
    assert rel_err(y, expected) < 1e-5
    # and not SwiGLU's result on the same up/down weights: the epilogue is the activation's
    if activation == "geglu":
        swiglu = experts_oracle(
            x, params["w_gate"], params["w_up"], params["w_down"], routed.expert_ids, routed.weights
        )
        assert rel_err(y, swiglu) > 1e-2


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_decode_kernels_lower_for_cuda(activation):
    """The Pallas Triton lowering of the activation's epilogue (interpret mode skips it): both
    decode kernels, the gate/up one named after the activation."""
    from jax import export

    triton_call = "__gpu$xla.gpu.triton"
    config = tilax.MoEConfig(
        d_model=256, d_hidden=512, num_experts=8, top_k=2, impl="decode", activation=activation
    )
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.ShapeDtypeStruct((4, config.d_model), config.dtype)
    with _pallas.assume_device(**H200, compute_capability=(9, 0)):
        try:
            module = export.export(
                jax.jit(lambda p, x: tilax.moe_apply(p, x, config)[0]),
                platforms=["cuda"],
                disabled_checks=[export.DisabledSafetyCheck.custom_call(triton_call)],
            )(params, x).mlir_module()
        except RuntimeError as err:
            if "No supported GPU devices found" in str(err):
                pytest.skip(f"jax {jax.__version__} lowers Pallas Triton only with a GPU")
            raise
    assert module.count(triton_call) == 2
    assert f"moe_decode_gate_up_{activation}" in module


@pytest.mark.kernels
def test_gelu_gradients_are_the_training_paths():
    """The not-gated activation through the custom VJP: the training kernels' gradients (no
    ``w_gate``), equal to the plain-XLA layer's."""
    num_tokens, d, h, num_experts, top_k = 3, 16, 16, 4, 2
    config = _config(d, h, num_experts, top_k, activation="gelu")
    reference = dataclasses.replace(config, impl="blocked")
    params = tilax.moe_init(jax.random.key(2), config)
    x = jax.random.normal(jax.random.key(3), (num_tokens, d))

    def loss(cfg):
        return jax.grad(lambda p: jnp.sum(jnp.sin(tilax.moe_apply(p, x, cfg)[0])))

    grads = jax.jit(loss(config))(params)
    assert "w_gate" not in grads
    assert rel_err(grads, loss(reference)(params)) < 1e-5


@pytest.mark.kernels
def test_an_expert_of_several_chunks_and_bfloat16():
    """20 tokens all on expert 2 among their choices: 20 rows, two chunks of the interpreter's
    16-row tile (its block_m for 40 copies on 8 experts)."""
    num_tokens, num_experts, top_k, d, h = 20, 8, 2, 32, 32
    x, w_gate, w_up, w_down = _inputs(num_tokens, d, h, num_experts, jnp.bfloat16)
    ids, weights = _random_choices(num_tokens, num_experts - 1, 1, seed=3)
    ids = jnp.concatenate(
        [jnp.full((num_tokens, 1), 2, jnp.int32), jnp.where(ids >= 2, ids + 1, ids)], axis=1
    )
    weights = jnp.concatenate([weights, weights[:, ::-1] * 0.5], axis=1)
    config = _config(d, h, num_experts, top_k, jnp.bfloat16)
    assert decode.decode_tiles(num_tokens * top_k, num_experts, d, h, jnp.bfloat16).block_m == 16
    y, kept = decode.DecodeExperts()(config, x, w_gate, w_up, w_down, RoutedCopies(ids, weights))
    assert kept is None and y.dtype == jnp.bfloat16
    expected = experts_oracle(x, w_gate, w_up, w_down, ids, weights)
    assert rel_err(y, expected) < 2e-2


@pytest.mark.kernels
def test_config_tiles_override_the_decode_tiles():
    """The MoEConfig tile fields reach the decode kernels (A/B runs): 32-row items and 16-column
    strips give the same result."""
    num_tokens, num_experts, top_k, d, h = 3, 4, 2, 32, 32
    x, w_gate, w_up, w_down = _inputs(num_tokens, d, h, num_experts)
    ids, weights = _random_choices(num_tokens, num_experts, top_k, seed=9)
    config = _config(d, h, num_experts, top_k, block_m=32, block_n=16, block_k=16)
    tiles = decode.config_tiles(config, decode.decode_tiles(6, num_experts, d, h, jnp.float32))
    assert (tiles.block_m, tiles.block_n_gate_up, tiles.block_n_down, tiles.block_k) == (
        32,
        16,
        16,
        16,
    )
    y, _ = decode.DecodeExperts()(config, x, w_gate, w_up, w_down, RoutedCopies(ids, weights))
    assert rel_err(y, experts_oracle(x, w_gate, w_up, w_down, ids, weights)) < 1e-5


@pytest.mark.kernels
def test_capacity_drops_copies_like_the_oracle():
    num_tokens, num_experts, top_k, d, h = 12, 4, 2, 16, 32
    x, w_gate, w_up, w_down = _inputs(num_tokens, d, h, num_experts)
    ids, weights = _random_choices(num_tokens, num_experts, top_k, seed=5)
    capacity = 4
    config = _config(d, h, num_experts, top_k, routing="capacity")
    y, kept = decode.DecodeExperts()(
        config, x, w_gate, w_up, w_down, RoutedCopies(ids, weights, capacity)
    )
    ranks = np.asarray(dispatch.copy_ranks(ids, num_experts, jnp.ones(ids.shape, bool)))
    keep = ranks < capacity
    assert int(kept) == int(keep.sum())
    assert rel_err(y, experts_oracle(x, w_gate, w_up, w_down, ids, weights, keep)) < 1e-5


@pytest.mark.kernels
def test_gradients_are_the_training_paths():
    """Forward-only kernels: under jax.grad the custom VJP runs the training kernels, so the
    gradients equal the plain-XLA layer's (and the primal output the decode kernels')."""
    num_tokens, d, h, num_experts, top_k = 3, 16, 16, 4, 3
    config = _config(d, h, num_experts, top_k)
    reference = tilax.MoEConfig(
        d_model=d,
        d_hidden=h,
        num_experts=num_experts,
        top_k=top_k,
        impl="blocked",
        dtype=jnp.float32,
    )
    params = tilax.moe_init(jax.random.key(2), config)
    x = jax.random.normal(jax.random.key(3), (num_tokens, d))
    dy = jax.random.normal(jax.random.key(4), (num_tokens, d))

    def loss(cfg):
        return jax.value_and_grad(
            lambda p, x: jnp.sum(tilax.moe_apply(p, x, cfg)[0] * dy), argnums=(0, 1)
        )

    value, grads = jax.jit(loss(config))(params, x)
    expected_value, expected = loss(reference)(params, x)
    assert abs(float(value - expected_value)) < 1e-4 * max(1.0, abs(float(expected_value)))
    assert rel_err(grads, expected) < 1e-5


# ----------------------------------------------------------------------------- the rule


def _bf16(**kw):
    return tilax.MoEConfig(
        **{**dict(d_model=2048, d_hidden=768, num_experts=128, top_k=8, dtype=jnp.bfloat16), **kw}
    )


def test_a_decode_rule_with_evidence_covers_small_batches_on_gpus():
    measured = rules.DecodeRule(512, ("bfloat16",), evidence=("a-stored-decode-run.json",))
    unmeasured = dataclasses.replace(measured, evidence=(), unmeasured="not run yet")
    with _pallas.assume_device(**H200):
        for tokens in (1, 16, 512):
            assert rules.decode_rule_for(_bf16(), tokens, (measured,)) == measured
            assert rules.decode_rule_for(_bf16(), tokens, (unmeasured,)) is None
        assert rules.decode_rule_for(_bf16(), 513, (measured,)) is None
        assert rules.decode_rule_for(_bf16(), None, (measured,)) is None  # expert parallelism
        for other in (
            dict(dtype=jnp.float32),
            dict(routing="capacity"),
            dict(recompute=True),
            dict(block_m=64),
        ):
            assert rules.decode_rule_for(_bf16(**other), 1, (measured,)) is None, other


def test_auto_keeps_the_training_kernels_while_the_decode_rule_is_unmeasured():
    with _pallas.assume_device(**H200):
        in_force = any(rule.evidence for rule in rules.DECODE_RULES)
        assert api.resolve_impl(_bf16(), 16) == ("decode" if in_force else "triton")
        assert api.resolve_impl(_bf16(), 513) == "triton"  # no backend rule for E128
        assert api.resolve_impl(_bf16(num_experts=8, top_k=2), 4096) == "mosaic"
        assert api.resolve_impl(_bf16(impl="triton"), 1) == "triton"
        assert api.resolve_impl(_bf16(impl="decode"), 1) == "decode"
        # the decode path trains on the training kernels the backend rules pick
        assert rules.kernel_backend(_bf16(num_experts=8, top_k=2)) == "mosaic"
        assert api.kernel_tiles(_bf16(impl="decode", num_experts=8, top_k=2)).block_m % 64 == 0


def test_auto_on_a_cpu_stays_plain_xla_at_small_batches():
    config = tilax.MoEConfig(d_model=16, d_hidden=16, num_experts=4, top_k=2)
    assert api.resolve_impl(config, 1) == "blocked"
    params = tilax.moe_init(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (1, 16))
    y, _ = tilax.moe_apply(params, x, config)
    expected = tilax.moe.reference.moe_oracle(params, x, config)
    assert rel_err(y, expected) < 2e-2  # bfloat16 experts


def test_decode_tiles_fill_the_h200_at_the_bench_shapes():
    """Each touched expert's rows fit one tile at the mean load, and the column strips give
    at least two programs per SM wherever 32-column strips can."""
    with _pallas.assume_device(**H200):
        qwen = dict(num_experts=128, d_model=2048, d_hidden=768, dtype=jnp.bfloat16)
        mixtral = dict(num_experts=8, d_model=4096, d_hidden=14336, dtype=jnp.bfloat16)
        assert decode.decode_tiles(8, **qwen).block_m == 16
        assert decode.decode_tiles(512 * 8, **qwen).block_m == 64
        assert decode.decode_tiles(512 * 2, **mixtral).block_m == 128
        for rows, shape in ((8, qwen), (4096, qwen), (2, mixtral), (1024, mixtral)):
            tiles = decode.decode_tiles(rows, **shape)
            touched = min(shape["num_experts"], rows)
            for columns, block_n in (
                (shape["d_hidden"], tiles.block_n_gate_up),
                (shape["d_model"], tiles.block_n_down),
            ):
                programs = touched * columns // block_n
                assert programs >= 2 * 132 or block_n == 32, (rows, shape, tiles)
            stage = (tiles.block_m + 2 * tiles.block_n_gate_up) * tiles.block_k * 2
            assert 2 <= tiles.num_stages <= 4 and tiles.num_stages * stage <= 0.7 * 227 * 1024
        assert decode.decode_tiles(512 * 2, **mixtral).num_stages == 3  # 48 KiB stages
