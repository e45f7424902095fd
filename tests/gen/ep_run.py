"""A synthetic expert-parallel run (suite ``ep``) on two H200s, as ``nox -s bench -- --bench-suite
ep`` would store it (imported by name: keep it unique).

The rows' ``extra_info`` come from the bench's own cases (tests/bench/bench_ep.py: ``EpCase``,
its ``extra_info()`` and ``rates()``), so the file follows the bench's contract as it stands;
the times are chosen here so the tests can check the report's ratios by hand:

- E8 top-2 d512 h1024 (``pallas/sorted``), 65,536 tokens per GPU: one GPU 10.0 ms; two GPUs
  over ``ragged`` 11.5 ms (efficiency 10.0 / 11.5 = 0.870), its exchange alone 3.0 ms (share
  3.0 / 11.5 = 26.1%); over ``all_to_all`` 12.5 ms (efficiency 0.800), its exchange row
  failed (out of memory). Link rows at 65,536 and 131,072 tokens per GPU.
- E64 top-8 d512 h128 shared 1024 (``pallas/fused``), 65,536 tokens per GPU: one GPU 20.0 ms;
  two GPUs over ``all_to_all`` 25.0 ms (efficiency 0.800), exchange 8.0 ms (share 32.0%);
  the ``ragged`` step and exchange were skipped (the run's time budget). Link rows of both
  collectives.
"""

from __future__ import annotations

import json
from pathlib import Path

import bench_ep  # tests/bench is on sys.path (report_fixtures, site_build)
import bench_moe
import bench_rows
import synthetic_runs

COMMIT = "e9a0b1c"
STARTED = "2026-02-01T10:00:00+00:00"
FILE_NAME = "h200-20260201-e9a0b1c-ep.json"
RUN = "h200-20260201-e9a0b1c"
T = 65536
OOM = ("XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
       "4294967296 bytes.")
BUDGET = ("skipped: not attempted, the run's time budget of 480 s was spent before this row "
          "(or what is left is owed to other suites)")
LAYER = dict(**bench_moe.SEED_LAYER, dispatch="sorted")
DECODER = dict(**bench_moe.SEED_DECODER, dispatch="fused")

# (case, median ms or None, error or None); medians with a ±1% spread over 10 rounds
ROWS = [
    (bench_ep.EpCase(part="link", devices=2, tokens_per_device=T, exchange="all_to_all",
                     **LAYER), 0.20, None),
    (bench_ep.EpCase(part="link", devices=2, tokens_per_device=2 * T, exchange="all_to_all",
                     **LAYER), 0.38, None),
    (bench_ep.EpCase(part="link", devices=2, tokens_per_device=T, exchange="all_to_all",
                     **DECODER), 0.70, None),
    (bench_ep.EpCase(part="link", devices=2, tokens_per_device=T, exchange="all_gather",
                     **LAYER), 0.25, None),
    (bench_ep.EpCase(part="step", devices=1, tokens_per_device=T, **LAYER), 10.0, None),
    (bench_ep.EpCase(part="step", devices=2, tokens_per_device=T, exchange="ragged", **LAYER),
     11.5, None),
    (bench_ep.EpCase(part="exchange", devices=2, tokens_per_device=T, exchange="ragged",
                     **LAYER), 3.0, None),
    (bench_ep.EpCase(part="step", devices=2, tokens_per_device=T, exchange="all_to_all",
                     **LAYER), 12.5, None),
    (bench_ep.EpCase(part="exchange", devices=2, tokens_per_device=T, exchange="all_to_all",
                     **LAYER), None, OOM),
    (bench_ep.EpCase(part="step", devices=2, tokens_per_device=T, exchange="all_gather",
                     chunks=2, **LAYER), 11.0, None),
    (bench_ep.EpCase(part="step", devices=1, tokens_per_device=T, **DECODER), 20.0, None),
    (bench_ep.EpCase(part="step", devices=2, tokens_per_device=T, exchange="ragged",
                     **DECODER), None, BUDGET),
    (bench_ep.EpCase(part="exchange", devices=2, tokens_per_device=T, exchange="ragged",
                     **DECODER), None, BUDGET),
    (bench_ep.EpCase(part="step", devices=2, tokens_per_device=T, exchange="all_to_all",
                     **DECODER), 25.0, None),
    (bench_ep.EpCase(part="exchange", devices=2, tokens_per_device=T, exchange="all_to_all",
                     **DECODER), 8.0, None),
]
# The ratios the report must show (from the medians above).
EFFICIENCY_RAGGED = 10.0 / 11.5
EFFICIENCY_ALL_TO_ALL = 10.0 / 12.5
EFFICIENCY_TWO_CHUNKS = 10.0 / 11.0
SHARE_RAGGED = 3.0 / 11.5
LINK_GBPS = ROWS[0][0].link_bytes() / 0.20e-3 / 1e9
LINK_GATHER_GBPS = ROWS[3][0].link_bytes() / 0.25e-3 / 1e9  # each GPU sends its T tokens


def _rounds(median_ms: float) -> list[float]:
    """Ten rounds, in seconds, with the given median and a ±1% spread."""
    spread = [-0.01, -0.008, -0.005, -0.002, -0.0005, 0.0005, 0.002, 0.005, 0.008, 0.01]
    return [median_ms * 1e-3 * (1 + s) for s in spread]


def benchmark(case: bench_ep.EpCase, median_ms: float | None, error: str | None) -> dict:
    """One benchmark as pytest-benchmark writes it, with the harness's extra_info."""
    measured = {}
    if case.part != "link":
        measured.update(max_expert_frac=0.14, empty_experts=0)
    if case.part == "step" and case.devices > 1:
        measured["rel_err_out_vs_one_device"] = 0.0041
    timed = None if error else _rounds(median_ms)
    return synthetic_runs.benchmark(case, "test_bench_ep.py::test_ep", timed, error, group="ep",
                                    compile_s=2.5, **measured)


def document() -> dict:
    """The whole pytest-benchmark document."""
    return synthetic_runs.document([benchmark(*row) for row in ROWS], commit=COMMIT,
                                   suites=["ep"], budget_s=480.0, started=STARTED)


def write_ep_run(results_dir: Path) -> Path:
    """Store the synthetic run in ``results_dir``; returns its path."""
    path = Path(results_dir) / FILE_NAME
    path.write_text(json.dumps(document(), indent=1))
    return path


def contract_problems() -> list[str]:
    """What the bench's own contract check (bench_rows) finds wrong with the document."""
    return bench_rows.check_document(document())
