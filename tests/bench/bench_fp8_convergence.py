"""FP8 convergence evidence (suite ``fp8_convergence``): one small MoE language model trained
twice with identical seeds and data, its experts in bfloat16 and with ``quantize="fp8"``.

The task is next-token prediction on a synthetic language with learnable structure and a known
floor: a *teacher* (a fixed random MoE model in float32, ``teacher_logits``) defines
``P(next | previous two tokens)``; each step draws ``tokens`` contexts uniformly and samples
their next tokens from the teacher (the same draws for both runs: keys from the step number).
The *student* (``student_logits``: the two tokens' embeddings summed, one residual MoE layer,
an RMS norm and an unembedding; float32 master weights, the layer in bfloat16 or FP8) is
trained with Adam (learning rate warmed up linearly over a tenth of the steps, at most 50) on
the cross-entropy plus ``0.01`` times the load-balance loss. The floor of
the loss is the teacher's conditional entropy on the same contexts (``entropy`` in each
record), so a curve says both how fast each run learns and how far it is from perfect.

Each row (one per ``quantize``) stores in ``extra_info``:

- ``quantize``: ``"fp8"`` or ``None``; ``steps``, ``log_every``, ``seed``, ``task``, ``vocab``,
  ``learning_rate``;
- ``loss_curve``: ``[step, mean loss of the log_every steps ending there, mean floor]`` every
  ``log_every`` steps (the curve a report plots, both rows on one chart);
- ``final_loss``: the mean loss of the last tenth of the steps; ``final_floor`` its floor.

The issue's check is the two rows' ``final_loss`` of one file: FP8 within 1% (relative) of
bfloat16. Then the harness times the training's own compiled call, ``log_every`` train steps
(``steps_per_call``; ``op="train_step"``, ``tokens`` per step; ``flops`` counts the calls'
MoE layers as ``bench_moe.layer_flops`` does, plus the unembedding), the teacher's forward
included. The training runs in ``build``, before the timed calls: a row takes the training's
time plus the usual timing rounds.

Sizes per mode (``SIZES``): ``full`` the E8 top-2 d512 h1024 layer of the headline configs at
16,384 tokens a step for 1,000 steps (16M tokens; about a minute a row on an H200 with the XLA
FP8 path, *estimated*, not measured); ``quick`` 300 steps; ``smoke`` a CPU-sized model for 40
steps. A CPU run of V256 d128 h256 E4 top-2 at 2,048 tokens a step (diagnostic, not stored)
ended at 2.6843 (bf16) and 2.6862 (FP8) after 400 steps, floor 1.773: 0.07% apart.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import bench_moe

TASK = "teacher-student next-token prediction, 2-token context, teacher MoE (float32)"

#: mode -> (vocab, d_model, d_hidden, experts, top_k, tokens per step, steps, log_every).
SIZES = {
    "full": (1024, 512, 1024, 8, 2, 16384, 1000, 25),
    "quick": (1024, 512, 1024, 8, 2, 16384, 300, 25),
    "smoke": (64, 64, 64, 4, 2, 256, 40, 10),
}
TEACHER_SHARPNESS = 4.0  # teacher logits scale: low-entropy, learnable next-token laws
BALANCE_WEIGHT = 0.01


@dataclasses.dataclass(frozen=True)
class ConvergenceCase:
    """One training run (see the module docstring)."""

    quantize: str | None
    vocab: int
    d_model: int
    d_hidden: int
    experts: int
    top_k: int
    tokens: int
    steps: int
    log_every: int
    seed: int = 0
    learning_rate: float = 2e-3
    priority: int = 60
    numerics: bool = False

    family = "moe"
    suite = "fp8_convergence"

    @property
    def id(self) -> str:
        precision = self.quantize or "bf16"
        return (
            f"fp8_convergence-{precision}-V{self.vocab}-E{self.experts}-k{self.top_k}"
            f"-d{self.d_model}-h{self.d_hidden}-T{self.tokens}-steps{self.steps}"
        )

    def config(self, impl: str = "auto"):
        import jax.numpy as jnp

        import tilax

        return tilax.MoEConfig(
            d_model=self.d_model,
            d_hidden=self.d_hidden,
            num_experts=self.experts,
            top_k=self.top_k,
            impl=impl,
            dtype=jnp.bfloat16,
            quantize=self.quantize,
        )

    def extra_info(self) -> dict[str, Any]:
        from tilax.moe import api

        try:
            impl = api.resolve_impl(self.config())
        except ValueError:  # a GPU without FP8 tensor cores: the row's build fails and says so
            impl = "ragged_dot"
        return {
            "family": "moe",
            "suite": self.suite,
            "impl": impl,
            "dispatch": None,
            "routing": "dropless",
            "dtype": "bfloat16",
            "op": "train_step",
            "tokens": self.tokens,
            "d_model": self.d_model,
            "d_hidden": self.d_hidden,
            "experts": self.experts,
            "top_k": self.top_k,
            "shared_hidden": 0,
            "skew": 0.0,
            "flops": self.work(),
            "quantize": self.quantize,
            "task": TASK,
            "vocab": self.vocab,
            "steps": self.steps,
            "log_every": self.log_every,
            "seed": self.seed,
            "learning_rate": self.learning_rate,
            "steps_per_call": self.log_every,
        }

    def scale_key(self) -> tuple:
        return ("fp8_convergence", self.quantize)

    def size_label(self) -> str:
        return f"tokens={self.tokens}"

    def work(self) -> float:
        """FLOPs of one timed call: ``log_every`` train steps of the student (its MoE layer as
        ``bench_moe.layer_flops`` counts it, and the unembedding)."""
        t, d = self.tokens, self.d_model
        layer = 2 * t * d * self.experts + 6 * t * self.top_k * d * self.d_hidden
        return float(3 * (layer + 2 * t * d * self.vocab) * self.log_every)

    def rates(self, median_s: float) -> dict[str, float]:
        return {"tflops": self.work() / median_s / 1e12}

    def precheck(self, state) -> str | None:
        return None

    def build(self, state):
        run = train(self)

        def inspect(out) -> dict:
            return {key: run[key] for key in ("loss_curve", "final_loss", "final_floor")}

        return bench_moe.JaxWorkload(run["chunk"], (run["state"], self.steps), inspect)


def suite_cases(suite: str, mode: str) -> list[ConvergenceCase]:
    """The two runs (bfloat16, then FP8) at the mode's sizes."""
    vocab, d, h, e, k, tokens, steps, log_every = SIZES[mode]
    common = dict(
        vocab=vocab,
        d_model=d,
        d_hidden=h,
        experts=e,
        top_k=k,
        tokens=tokens,
        steps=steps,
        log_every=log_every,
    )
    return [ConvergenceCase(quantize=None, **common), ConvergenceCase(quantize="fp8", **common)]


# ----------------------------------------------------------------------------------------------
# The task and the training loop


def _rms_norm(x):
    import jax
    import jax.numpy as jnp

    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)


def init_model(key, case: ConvergenceCase, config) -> dict:
    """Float32 parameters of the student (or, with another key, the teacher)."""
    import jax
    import jax.numpy as jnp

    import tilax

    k_a, k_b, k_out, k_moe = jax.random.split(key, 4)
    scale = 1 / math.sqrt(case.d_model)
    moe = jax.tree.map(lambda w: w.astype(jnp.float32), tilax.moe_init(k_moe, config))
    return {
        "embed_a": jax.random.normal(k_a, (case.vocab, case.d_model)),
        "embed_b": jax.random.normal(k_b, (case.vocab, case.d_model)),
        "unembed": jax.random.normal(k_out, (case.d_model, case.vocab)) * scale,
        "moe": moe,
    }


def model_logits(params, context, config):
    """``[T, vocab]`` float32 logits of the next token after ``context: [T, 2]``, and the
    layer's ``aux``."""
    import tilax

    h = params["embed_a"][context[:, 0]] + params["embed_b"][context[:, 1]]
    y, aux = tilax.moe_apply(params["moe"], _rms_norm(h), config)
    h = h + y.astype(h.dtype)
    return _rms_norm(h) @ params["unembed"], aux


def batch(case: ConvergenceCase, teacher, teacher_config, step):
    """The step's contexts, next tokens and the teacher's entropy on them (the floor)."""
    import jax
    import jax.numpy as jnp

    key = jax.random.fold_in(jax.random.key(case.seed + 1), step)
    k_context, k_next = jax.random.split(key)
    context = jax.random.randint(k_context, (case.tokens, 2), 0, case.vocab)
    logits, _ = model_logits(teacher, context, teacher_config)
    logits = TEACHER_SHARPNESS * logits
    targets = jax.random.categorical(k_next, logits)
    log_p = jax.nn.log_softmax(logits)
    entropy = -jnp.mean(jnp.sum(jnp.exp(log_p) * log_p, axis=-1))
    return context, targets, entropy


def train(case: ConvergenceCase) -> dict:
    """Train the student for ``case.steps`` steps; returns the curve, the final loss and the
    jitted ``chunk(state, first_step)`` (``log_every`` train steps, for timing) with the final
    state."""
    import jax
    import jax.numpy as jnp

    if case.steps % case.log_every:
        raise ValueError(f"steps ({case.steps}) must be a multiple of log_every ({case.log_every})")
    warmup = max(1, min(50, case.steps // 10))  # linear warm-up of the learning rate
    config = case.config()
    # the teacher in float32 on "blocked": the faster float32 XLA impl on the H200 and a CPU
    teacher_config = dataclasses.replace(config, dtype=jnp.float32, quantize=None, impl="blocked")
    teacher = init_model(jax.random.key(case.seed + 1000), case, teacher_config)
    params = init_model(jax.random.key(case.seed), case, config)
    adam = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params))

    def loss_fn(params, context, targets):
        logits, aux = model_logits(params, context, config)
        log_p = jax.nn.log_softmax(logits)
        nll = -jnp.mean(jnp.take_along_axis(log_p, targets[:, None], axis=1))
        return nll + BALANCE_WEIGHT * aux["load_balance_loss"], nll

    def one_step(state, step):
        params, (m, v) = state
        context, targets, entropy = batch(case, teacher, teacher_config, step)
        (_, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, context, targets)
        lr = case.learning_rate * jnp.minimum(1.0, (step + 1) / warmup)
        t = step + 1
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)

        def update(p, m, v):
            m_hat = m / (1 - 0.9**t)
            v_hat = v / (1 - 0.999**t)
            return p - lr * m_hat / (jnp.sqrt(v_hat) + 1e-8)

        params = jax.tree.map(update, params, m, v)
        return (params, (m, v)), (nll, entropy)

    @jax.jit
    def chunk(state, first_step):
        steps = first_step + jnp.arange(case.log_every)
        state, (nll, entropy) = jax.lax.scan(one_step, state, steps)
        return state, jnp.mean(nll), jnp.mean(entropy)

    state = (params, adam)
    curve = []
    for first in range(0, case.steps, case.log_every):
        state, nll, entropy = chunk(state, first)
        curve.append([first + case.log_every, float(nll), float(entropy)])
    tail = curve[-max(1, len(curve) // 10) :]
    return {
        "loss_curve": curve,
        "final_loss": sum(point[1] for point in tail) / len(tail),
        "final_floor": sum(point[2] for point in tail) / len(tail),
        "chunk": chunk,
        "state": state,
    }
