"""Helpers shared by the MoE tests (a plain module: test folders share no conftest names)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

# CPU devices the expert-parallel tests need (meshes of 2 x 2, 4 and 8 devices).
MESH_DEVICES = 8
TESTS_MOE = Path(__file__).resolve().parent


def rel_err(actual, expected) -> float:
    """Max absolute difference relative to the largest reference magnitude."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


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
    lead = (tokens,) if isinstance(tokens, int) else tuple(tokens)
    x = jax.random.normal(jax.random.key(1), lead + (config.d_model,))
    if skew_to is not None:
        # feature 0 carries a large logit for experts skew_to and skew_to + 1
        router = params["router"].at[0, skew_to].set(8.0).at[0, skew_to + 1].set(7.0)
        params = {**params, "router": router}
        x = x.at[..., 0].set(3.0)
    return params, x.astype(config.dtype)


def router_logit_parts(rng, tokens: int, experts: int):
    """``[T, 3E]`` float32 pieces of router logits (``router._bf16_logits``'s product) whose
    thirds add up to logits that tie on a coarse grid for a tenth of the tokens, with one NaN."""
    import jax.numpy as jnp

    logits = rng.standard_normal((tokens, experts)) * 3
    logits[: tokens // 10] = np.round(logits[: tokens // 10])  # equal logits: tied experts
    logits[tokens // 2, experts // 2] = np.nan
    small = rng.standard_normal((tokens, experts)) * 1e-4
    # thirds that add up to the logits, the smallest first as router._sum_thirds adds them
    return jnp.asarray(np.concatenate([logits - 2 * small, small, small], axis=1), jnp.float32)
