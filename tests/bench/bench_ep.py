"""Expert-parallel benchmark cases (suite ``ep``): the MoE layer over a mesh of local GPUs.

Two layers, bf16 train step (``value_and_grad`` of ``sum(y * dy)`` w.r.t. the parameters and
the input, as in ``bench_moe``): the E8 top-2 d512 h1024 layer (``sorted`` dispatch, its
fastest train step on the H200) and the E64 top-8 w128 decoder layer with a 1024-wide shared
expert (``fused``, likewise). Weak scaling: ``T`` tokens per GPU, ``T`` = 65536 and 131072, on
one GPU (no mesh: the plain layer) and on ``n`` local GPUs for every ``n`` from 2 up to the
host's count that divides the experts (``mesh_sizes``; ``n * T`` tokens, a 1-D ``expert`` mesh,
the experts split over it). Rows carry ``devices``, ``mesh`` (``"expert=n"``, ``None`` for one
GPU), ``tokens_per_device``, ``exchange`` (the transport, ``MoEConfig.exchange``) and ``part``:

- ``link``: a plain ``jax.lax.all_to_all`` of the bytes one trip of the copies moves (each GPU
  sends its ``T * top_k`` copies of ``d_model`` bf16 values, an equal share to every GPU;
  ``gbps`` counts the bytes that leave each GPU, ``(n - 1) / n`` of its buffer), and a plain
  ``jax.lax.all_gather`` of each GPU's ``T`` tokens (the ``all_gather`` exchange's trip;
  ``(n - 1) * T * d_model`` values leave each GPU). Run first.
- ``step``: the train step; ``tflops`` and ``tokens_per_s`` over all ``n * T`` tokens. The
  ``all_gather`` steps also with the tokens in 2 and 4 chunks (``exchange_chunks``, ``-c2``
  in the row name; XLA may overlap one chunk's collectives with another's experts).
- ``exchange``: the same step with the experts replaced by the identity and no shared expert:
  routing, the copies' trip there and back and the weighted combine, forward and backward. Its
  time over the ``step`` row of the same config is the exchange's share of the step
  (``exchange_share`` is left to the report: ratios are taken between rows of one file).

Weak-scaling efficiency (issue 14): ``tokens_per_s(n GPUs) / (n * tokens_per_s(1 GPU))`` from
the ``step`` rows of one file. Rows needing more devices than the host has are failure rows
``unavailable: needs N GPUs`` (not attempted); in smoke mode (CPU) the mesh rows run on virtual
CPU devices when the process has them (``JAX_NUM_CPU_DEVICES=2``), tiny shapes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import bench_moe

TOKENS_PER_DEVICE = (65536, 131072)
# (shape, dispatch): the E8 layer and the E64 decoder layer
SHAPES = ((bench_moe.SEED_LAYER, "sorted"), (bench_moe.SEED_DECODER, "fused"))
SMOKE_SHAPES = ((bench_moe.SMOKE_LAYER, "sorted"), (bench_moe.SMOKE_DECODER, "fused"))
TRANSPORTS = ("all_gather", "all_to_all")
LINKS = ("all_to_all", "all_gather")  # the collective each link row times
CHUNKS = (2, 4)  # all_gather steps also in this many chunks (MoEConfig.exchange_chunks)
MESH_AXIS = "expert"


@dataclasses.dataclass(frozen=True)
class EpCase:
    """One ``ep`` row (see the module docstring)."""

    part: str  # "link" | "step" | "exchange"
    devices: int
    tokens_per_device: int
    d_model: int
    d_hidden: int
    experts: int
    top_k: int
    shared_hidden: int = 0
    dispatch: str = "sorted"
    exchange: str | None = None  # the transport; None on one device
    chunks: int = 1  # MoEConfig.exchange_chunks
    impl: str = "pallas"
    routing: str = "dropless"
    dtype: str = "bfloat16"
    numerics: bool = True
    priority: int = 50
    seed: int = 0

    family = "moe"
    suite = "ep"

    @property
    def tokens(self) -> int:
        return self.tokens_per_device * self.devices

    @property
    def op(self) -> str:
        return "forward" if self.part == "link" else "train_step"

    @property
    def mesh(self) -> str | None:
        return None if self.devices == 1 else f"{MESH_AXIS}={self.devices}"

    @property
    def id(self) -> str:
        parts = ["ep", self.part]
        if self.part != "link":
            parts += [self.impl, self.dispatch]
        if self.exchange:
            parts.append(self.exchange)
        if self.chunks > 1:
            parts.append(f"c{self.chunks}")
        parts += ["bf16", f"T{self.tokens}-E{self.experts}k{self.top_k}-d{self.d_model}"
                  f"h{self.d_hidden}"]
        if self.shared_hidden:
            parts.append(f"S{self.shared_hidden}")
        parts += [f"n{self.devices}", self.op]
        return "-".join(parts)

    def extra_info(self) -> dict[str, Any]:
        info = {
            "family": "moe", "suite": "ep", "part": self.part,
            "impl": self.exchange if self.part == "link" else self.impl,
            "dispatch": None if self.part == "link" else self.dispatch,
            "routing": self.routing, "dtype": self.dtype, "op": self.op,
            "tokens": self.tokens, "tokens_per_device": self.tokens_per_device,
            "d_model": self.d_model, "d_hidden": self.d_hidden, "experts": self.experts,
            "top_k": self.top_k, "shared_hidden": self.shared_hidden, "skew": 0.0,
            "devices": self.devices, "mesh": self.mesh, "exchange": self.exchange,
        }
        if self.chunks > 1:
            info["exchange_chunks"] = self.chunks
        if self.part == "step":
            info["flops"] = self.work()
        else:
            info["bytes"] = self.link_bytes()
        return info

    def link_bytes(self) -> int:
        """Bytes that leave each device in one trip: its copies' share for the other devices
        (``all_to_all``), or its tokens once for each other device (``all_gather``)."""
        if self.exchange == "all_gather":
            return self.tokens_per_device * self.d_model * 2 * (self.devices - 1)
        copies = self.tokens_per_device * self.top_k
        return copies * self.d_model * 2 * (self.devices - 1) // max(self.devices, 1)

    def scale_key(self) -> tuple:
        fields = dataclasses.asdict(self)
        for name in ("tokens_per_device", "numerics", "priority"):
            fields.pop(name)
        return ("ep",) + tuple(sorted(fields.items()))

    def size_label(self) -> str:
        return f"tokens={self.tokens}"

    def work(self) -> float:
        if self.part == "step":
            case = dataclasses.replace(self.as_moe_case(), tokens=self.tokens)
            return float(bench_moe.layer_flops(case))
        return float(self.link_bytes())

    def rates(self, median_s: float) -> dict[str, float]:
        rates = {"tokens_per_s": self.tokens / median_s}
        if self.part == "step":
            rates["tflops"] = self.work() / median_s / 1e12
        if self.part == "link":
            rates["gbps"] = self.link_bytes() / median_s / 1e9
        return rates

    def unavailable_reason(self) -> str | None:
        import jax

        have = jax.device_count()
        if have < self.devices:
            kind = "GPUs" if jax.default_backend() == "gpu" else "devices"
            return f"unavailable: needs {self.devices} {kind}; this host has {have}"
        return None

    def precheck(self, state) -> str | None:
        return self.unavailable_reason()

    def as_moe_case(self) -> bench_moe.MoECase:
        """The single-device ``bench_moe`` case of one device's share (inputs, config)."""
        return bench_moe.MoECase(
            suite="ep", impl=self.impl, dispatch=self.dispatch, routing=self.routing,
            dtype=self.dtype, op="train_step", tokens=self.tokens_per_device,
            d_model=self.d_model, d_hidden=self.d_hidden, experts=self.experts,
            top_k=self.top_k, shared_hidden=self.shared_hidden, numerics=False, seed=self.seed,
        )

    def build(self, state):
        if self.part == "link":
            return build_link(self)
        return build_step(self, state)

    def to_spec(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_spec(cls, spec: dict) -> EpCase:
        return cls(**spec)


# ----------------------------------------------------------------------------- case list


def mesh_sizes(experts: int, have: int) -> list[int]:
    """The mesh sizes of a layer's multi-device rows on a host with ``have`` local devices:
    every count from 2 up to ``have`` that divides ``experts`` (each device holds as many
    experts), so that one process on a host of 8 GPUs measures 2, 4 and 8 against the same
    one-GPU rows; ``[2]`` where none fits (a one-GPU host stores what it could not run)."""
    return [n for n in range(2, have + 1) if experts % n == 0] or [2]


def ep_cases(mode: str) -> list[EpCase]:
    shapes, tokens = SHAPES, TOKENS_PER_DEVICE
    if mode == "smoke":
        shapes, tokens = SMOKE_SHAPES, (64,)
    elif mode == "quick":
        tokens = TOKENS_PER_DEVICE[:1]
    import jax

    cases = []
    for shape, dispatch in shapes:
        common = dict(d_model=shape["d_model"], d_hidden=shape["d_hidden"],
                      experts=shape["experts"], top_k=shape["top_k"],
                      shared_hidden=shape.get("shared_hidden", 0), dispatch=dispatch)
        sizes = mesh_sizes(shape["experts"], jax.local_device_count())
        for t in tokens:
            cases.append(EpCase(part="step", devices=1, tokens_per_device=t, priority=10,
                                **common))
            for n in sizes:
                cases += [EpCase(part="link", devices=n, tokens_per_device=t, priority=5,
                                 exchange=link, **common) for link in LINKS]
                for transport in TRANSPORTS:
                    for part in ("step", "exchange"):
                        cases.append(EpCase(part=part, devices=n, tokens_per_device=t,
                                            exchange=transport, priority=10, **common))
                cases += [EpCase(part="step", devices=n, tokens_per_device=t,
                                 exchange="all_gather", chunks=c, priority=10, **common)
                          for c in CHUNKS]
    return sorted(cases, key=lambda case: case.priority)  # links first, stable otherwise


# ----------------------------------------------------------------------------- workloads


def identity_experts(config, x, w_gate, w_up, w_down, copies):
    """Routed experts that return their input weighted by its kept copies' weights: the
    ``exchange`` part's stand-in."""
    import jax.numpy as jnp

    weight = jnp.sum(jnp.where(copies.kept, copies.weights, 0.0), axis=1, keepdims=True)
    return (x * weight).astype(x.dtype), None


def _mesh(case: EpCase):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[: case.devices]), (MESH_AXIS,))


def _placed_inputs(case: EpCase, mesh):
    """Parameters, tokens and cotangent of ``n * T`` tokens placed for the mesh."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    inputs = bench_moe.make_inputs(dataclasses.replace(case.as_moe_case(), tokens=case.tokens))
    if mesh is None:
        return inputs
    tokens = NamedSharding(mesh, P(MESH_AXIS))
    experts = NamedSharding(mesh, P(MESH_AXIS))
    replicated = NamedSharding(mesh, P())

    def place(path, leaf):
        name = jax.tree_util.keystr(path)
        sharded = name in ("['w_gate']", "['w_up']", "['w_down']")
        return jax.device_put(leaf, experts if sharded else replicated)

    params = jax.tree_util.tree_map_with_path(place, inputs.params)
    return bench_moe.MoEInputs(params, jax.device_put(inputs.x, tokens),
                               jax.device_put(inputs.dy, tokens), inputs.stats)


def build_step(case: EpCase, state):
    """The train step (``part="step"``) or its exchange alone (``part="exchange"``)."""
    import jax
    import jax.numpy as jnp

    import tilax
    from tilax.moe import expert_parallel

    mesh = None if case.devices == 1 else _mesh(case)
    config = bench_moe.moe_config(case.as_moe_case())
    if case.exchange:
        config = dataclasses.replace(config, exchange=case.exchange,
                                     exchange_chunks=case.chunks)
    inputs = _placed_inputs(case, mesh)

    if case.part == "exchange":
        config = dataclasses.replace(config, shared_hidden=0)
        params = {k: v for k, v in inputs.params.items() if k != "shared"}

        def apply(params, x):
            return expert_parallel.moe_apply_sharded(
                params, x, config, identity_experts, mesh=mesh, expert_axis=MESH_AXIS)
    else:
        params = inputs.params

        def apply(params, x):
            return tilax.moe_apply(params, x, config, mesh=mesh, expert_axis=MESH_AXIS)

    def loss(params, x, dy):
        y, aux = apply(params, x)
        return jnp.sum(y.astype(jnp.float32) * dy), (y, aux)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    def inspect(out) -> dict:
        (_, (y, aux)), _ = out
        info = {"max_expert_frac": float(aux["max_expert_frac"]),
                "empty_experts": int(aux["empty_experts"])}
        if case.part == "step" and mesh is not None and case.numerics:
            info["rel_err_out_vs_one_device"] = _versus_one_device(case, config, inputs, y)
        return info

    return bench_moe.JaxWorkload(step, (params, inputs.x, inputs.dy), inspect)


def _versus_one_device(case, config, inputs, y) -> float:
    """``||y - y_1|| / ||y_1||`` against the same layer on one device (untimed)."""
    import jax

    import tilax

    params, x = jax.device_get((inputs.params, inputs.x))
    y_one, _ = jax.jit(lambda p, x: tilax.moe_apply(p, x, config))(params, x)
    return bench_moe.rel_err(jax.device_get(y), y_one)


def build_link(case: EpCase) -> bench_moe.JaxWorkload:
    """A jitted all-to-all of ``[n, rows, d]`` bf16 blocks on every device, or (``all_gather``)
    an all-gather of each device's ``[T, d]`` tokens."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(case)
    n = case.devices
    if case.exchange == "all_gather":
        blocks = jnp.ones((n * case.tokens_per_device, case.d_model), jnp.bfloat16)

        def exchange(local):
            return jax.lax.all_gather(local, MESH_AXIS, tiled=True)[None]
    else:
        rows = math.ceil(case.tokens_per_device * case.top_k / n)
        blocks = jnp.ones((n * n, rows, case.d_model), jnp.bfloat16)

        def exchange(local):
            return jax.lax.all_to_all(local, MESH_AXIS, 0, 0)

    blocks = jax.device_put(blocks, NamedSharding(mesh, P(MESH_AXIS)))

    fn = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=P(MESH_AXIS),
                               out_specs=P(MESH_AXIS)))
    return bench_moe.JaxWorkload(fn, (blocks,))


def suite_cases(suite: str, mode: str) -> list[EpCase]:
    return {"ep": ep_cases}[suite](mode)
