"""Helpers shared by the MoE tests (a plain module: test folders share no conftest names): the
grouped matmul's oracle (the layer's is ``tilax.moe.reference.moe_oracle``), the mesh runner and
inputs. Errors are measured with ``tests/helpers.py``'s ``rel_err``/``peak_rel_err``."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# CPU devices the expert-parallel tests need (meshes of 2 x 2, 4 and 8 devices).
MESH_DEVICES = 8
TESTS_MOE = Path(__file__).resolve().parent


# Implementations whose layer runs the Pallas kernels in interpret mode on a CPU ("auto" runs
# plain XLA there).
INTERPRETED_IMPLS = ("pallas", "triton", "mosaic")


def interpreted_marked(cases):
    """``cases`` for ``pytest.mark.parametrize``, those naming an impl of
    ``INTERPRETED_IMPLS`` marked ``kernels``: a layer in the Pallas interpreter takes 5-40 s
    a case on two cores, so ``nox -s tests_kernels`` runs them and ``nox -s tests`` the rest."""
    marked = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        if any(isinstance(value, str) and value in INTERPRETED_IMPLS for value in values):
            marked.append(pytest.param(*values, marks=pytest.mark.kernels))
        else:
            marked.append(case)
    return marked


def row_experts(group_sizes, padded_rows: int) -> np.ndarray:
    """Expert of every row of a padded row space holding ``group_sizes[e]`` rows of expert
    ``e`` in order; padding rows belong to the last expert, as ``dispatch.gmm_schedule``
    schedules them."""
    experts = np.repeat(np.arange(len(group_sizes)), group_sizes)
    return np.concatenate([experts, np.full(padded_rows - len(experts), len(group_sizes) - 1)])


def gmm_oracle(lhs_rows, rhs, group_sizes, transpose: bool = False) -> np.ndarray:
    """The grouped matmul's oracle (float32 numpy): ``out[r] = lhs_rows[r] @ rhs[e(r)]``
    (``rhs[e(r)].T`` with ``transpose``), ``e`` from :func:`row_experts`."""
    lhs_rows = np.asarray(lhs_rows, np.float32)
    weights = np.asarray(rhs, np.float32)
    weights = np.swapaxes(weights, 1, 2) if transpose else weights
    experts = row_experts(group_sizes, lhs_rows.shape[0])
    return np.einsum("rk,rkn->rn", lhs_rows, weights[experts])


def on_cpu_devices(check, *args, timeout: float = 600) -> None:
    """Run ``check(*args)`` where JAX has ``MESH_DEVICES`` CPU devices.

    Here when this process has them (tests/moe run alone: see its conftest); otherwise in a
    fresh interpreter started with that many virtual CPU devices, failing with the child's
    traceback if the check fails there. ``check`` is a module-level function of a module in
    tests/moe; ``args`` are Python literals (their ``repr`` is the child's source).
    """
    import jax

    if jax.default_backend() == "cpu" and jax.device_count() >= MESH_DEVICES:
        check(*args)
        return
    import pytest

    module = check.__module__
    code = (f"import sys; sys.path.insert(0, {str(TESTS_MOE)!r}); import {module}; "
            f"{module}.{check.__name__}(*{args!r})")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(MESH_DEVICES))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{check.__name__}{args!r} failed in a child process with "
                    f"{MESH_DEVICES} CPU devices:\n{proc.stderr[-6000:]}", pytrace=False)


def ep_inputs(config, tokens, skew_to=None):
    """Parameters and tokens for the expert-parallel tests: ``tokens`` is a count or a leading
    shape; ``skew_to`` names the first of two experts that every token then picks."""
    import jax

    import tilax

    params = tilax.moe_init(jax.random.key(0), config)
    if config.balance_bias:  # a bias that moves the choice of experts
        params["router_bias"] = jax.random.normal(jax.random.key(2), (config.num_experts,)) * 0.3
    lead = (tokens,) if isinstance(tokens, int) else tuple(tokens)
    x = jax.random.normal(jax.random.key(1), lead + (config.d_model,))
    if skew_to is not None:
        # feature 0 carries a large logit for experts skew_to and skew_to + 1
        router = params["router"].at[0, skew_to].set(8.0).at[0, skew_to + 1].set(7.0)
        params = {**params, "router": router}
        x = x.at[..., 0].set(3.0)
    return params, x.astype(config.dtype)


def router_logit_parts(rng, tokens: int, experts: int):
    """``[T, 3E]`` float32 pieces of router logits (``router.router_logits``'s product) whose
    thirds add up to logits that tie on a coarse grid for a tenth of the tokens, with one NaN."""
    import jax.numpy as jnp

    logits = rng.standard_normal((tokens, experts)) * 3
    logits[: tokens // 10] = np.round(logits[: tokens // 10])  # equal logits: tied experts
    logits[tokens // 2, experts // 2] = np.nan
    small = rng.standard_normal((tokens, experts)) * 1e-4
    # thirds that add up to the logits, the smallest first as router.sum_thirds adds them
    return jnp.asarray(np.concatenate([logits - 2 * small, small, small], axis=1), jnp.float32)


def order_dependent_ops(jaxpr) -> list[str]:
    """The primitives of ``jaxpr`` (Pallas kernels' bodies and nested jaxprs included) whose
    result may depend on the order the GPU runs their parts: scatter-adds (XLA's GPU backend
    runs them with atomics), atomic read-modify-writes, and scatter assignments other than
    the row layout's inverse permutations (where indices may repeat, which write lands
    last is open). ``MoEConfig.deterministic``'s train step has none."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("scatter-add", "scatter_add", "scatter-mul", "atomic_rmw"):
            found.append(name)
        elif (
            name == "scatter"
            and not eqn.params.get("unique_indices")
            and not _row_layout_permutation(eqn)
        ):
            # an assignment is deterministic where its indices are distinct, as in the row
            # layout's inverse permutations
            found.append(name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += order_dependent_ops(inner)
    return found


def _row_layout_permutation(eqn) -> bool:
    """Whether a scatter assignment is one of the row layout's inverse permutations
    (``dispatch.sort_by_expert``, ``copy_ranks``), by its traceback."""
    frames = eqn.source_info.traceback.frames if eqn.source_info.traceback else []
    return any(
        f.file_name.endswith("moe/dispatch.py")
        and f.function_name in ("sort_by_expert", "copy_ranks")
        for f in frames
    )
