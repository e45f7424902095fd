"""Expert parallelism across two processes (``jax.distributed`` on this machine, CPU
collectives): the two-process result equals the one-process, one-device result."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from ep_process import CONFIG, TOKENS, flat, train_step
from helpers import peak_rel_err
from moe_testing import TESTS_MOE, ep_inputs

import tilax


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.kernels  # two processes compile and run a mesh train step (about a minute)
def test_two_processes_match_one(tmp_path):
    out = tmp_path / "two_processes.npz"
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    command = [sys.executable, str(TESTS_MOE / "ep_process.py"), "", str(port), str(out)]
    processes = [
        subprocess.Popen(command[:2] + [str(i)] + command[3:], env=env, cwd=TESTS_MOE,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=300)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    assert [p.returncode for p in processes] == [0, 0], "\n".join(log[-3000:] for log in logs)

    config = tilax.MoEConfig(**CONFIG)
    params, x = ep_inputs(config, TOKENS)
    expected = flat(jax.jit(train_step(config, None))(params, x))
    got = dict(np.load(out))
    assert sorted(got) == sorted(expected)
    assert float(expected["aux_dropped_frac"]) > 0  # capacity routing dropped copies
    for name, value in expected.items():
        if name.startswith("aux_"):
            np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)
        else:
            assert peak_rel_err(got[name], value) < 1e-5, name
