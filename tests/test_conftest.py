"""The suite's own settings (tests/conftest.py) as nox uses them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_codegen_test_outside_the_codegen_folders_stops_the_run():
    # nox's first run collects only CODEGEN_FOLDERS: a codegen test elsewhere would never run.
    # (tests/conftest.py already removes the xdist worker variables from this environment)
    env = dict(os.environ, TILAX_CODEGEN_FOLDERS="tests/gp")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", "-m", "not codegen", "tests/rbf/test_rbf_edges.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "marked codegen outside tests/gp" in proc.stderr
    assert "tests/rbf/test_rbf_edges.py::" in proc.stderr
