"""Paths and constants the report-generator tests share (imported by name: keep it unique).

Importing it (conftest.py does, before any test module) puts gen/ on ``sys.path`` for
``tilax_report``, and tests/bench for the bench's own cases, which the synthetic runs are made of.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for folder in (REPO / "gen", REPO / "tests" / "bench"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

FIXTURES = Path(__file__).parent / "fixtures"
PYTEST_BENCHMARK_FIXTURE = FIXTURES / "h200-20260115-0a1b2c3.json"
SEED_FILES = {
    "rtx3090-moe-layer.json": "moe_layer_seed",
    "rtx3090-nn-suites.json": "nn_suites_seed",
    "h100-moe-decoder.json": "h100_decoder_seed",
    "rtx3090-rbf-kernels.json": "rbf_seed",
}
