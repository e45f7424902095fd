"""Paths and constants the report-generator tests share (imported by name: keep it unique)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "gen") not in sys.path:
    sys.path.insert(0, str(REPO / "gen"))

FIXTURES = Path(__file__).parent / "fixtures"
PYTEST_BENCHMARK_FIXTURE = FIXTURES / "h200-20260115-0a1b2c3.json"
SEED_FILES = {
    "rtx3090-moe-layer.json": "moe_layer_seed",
    "rtx3090-nn-suites.json": "nn_suites_seed",
    "h100-moe-decoder.json": "h100_decoder_seed",
    "rtx3090-rbf-kernels.json": "rbf_seed",
}
