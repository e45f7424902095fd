"""tilax.gp rejects bad inputs with errors that name them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tilax

X = np.random.default_rng(0).uniform(size=(20, 2)).astype(np.float32)
Y = np.sin(X[:, 0]).astype(np.float32)
PARAMS = {"lengthscale": 0.5, "outputscale": 1.0, "noise": 0.1}
KEY = jax.random.key(0)


def mll(params=PARAMS, x=X, y=Y, **kwargs):
    return tilax.gp.mll(params, x, y, key=KEY, impl="xla", **kwargs)


def posterior(params=PARAMS, x=X, y=Y, x_star=X[:3], **kwargs):
    return tilax.gp.posterior(params, x, y, x_star, impl="xla", **kwargs)


@pytest.mark.parametrize("fn", [mll, posterior])
def test_params_keys(fn):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['scale'\].*lengthscale"):
        fn(params={**PARAMS, "scale": 1.0})
    with pytest.raises(ValueError, match=r"missing key\(s\) \['noise'\]"):
        fn(params={"lengthscale": 0.5, "outputscale": 1.0})
    with pytest.raises(TypeError, match="params must be a dict"):
        fn(params=(0.5, 1.0, 0.1))


@pytest.mark.parametrize("name, value, match", [
    ("lengthscale", jnp.ones(3), r"params\['lengthscale'\] must be a scalar or shape \(2,\)"),
    ("outputscale", jnp.ones(2), r"params\['outputscale'\] must be a scalar \(shape \(\)\)"),
    ("noise", 0.0, r"params\['noise'\] must be positive"),
    ("lengthscale", jnp.array([0.5, -1.0]), r"params\['lengthscale'\] must be positive"),
    ("outputscale", float("nan"), r"params\['outputscale'\] must be positive and finite"),
    ("noise", jnp.int32(1), r"params\['noise'\] must be a real floating-point array"),
])
def test_params_values(name, value, match):
    error = TypeError if "floating" in match else ValueError
    with pytest.raises(error, match=match):
        mll(params={**PARAMS, name: value})


def test_shapes():
    with pytest.raises(ValueError, match=r"x must have shape \[n, D\].*got shape \(20,\)"):
        mll(x=X[:, 0])
    with pytest.raises(ValueError, match=r"y must have shape \[n\] = \(20,\).*got shape \(19,\)"):
        mll(y=Y[:19])
    with pytest.raises(ValueError, match=r"x_star must have shape \[m, D\] with D = 2"):
        posterior(x_star=np.zeros((3, 3), np.float32))
    with pytest.raises(TypeError, match="x must be a real floating-point array"):
        mll(x=X.astype(np.int32))


def test_kernel_and_settings():
    with pytest.raises(ValueError, match=r"kernel must be one of 'rbf'.*got 'matern72'"):
        mll(kernel="matern72")
    with pytest.raises(ValueError, match=r"kernel must be one of 'rbf'.*got 'periodic'"):
        posterior(kernel="periodic")
    with pytest.raises(ValueError, match="num_probes must be at least 1"):
        mll(num_probes=0)
    with pytest.raises(ValueError, match="tol must be a positive finite number"):
        mll(tol=0.0)
    with pytest.raises(TypeError, match="max_iters must be an int"):
        mll(max_iters=10.0)
    with pytest.raises(ValueError, match="query_batch must be at least 1"):
        posterior(query_batch=0)
