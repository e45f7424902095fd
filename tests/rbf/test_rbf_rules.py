"""The RBF launch rules (``tilax.rbf.config.RULES``): every row's stored run holds it, the rows
without one are the known ones, ``default_config`` follows the rows, and the rows agree with
what the Mosaic GPU kernels take."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import pytest

from tilax import _pallas
from tilax.rbf import config as rbf_config
from tilax.rbf.mosaic import common as mosaic_common
from tilax.rbf.mosaic import exact as mosaic_exact
from tilax.rbf.mosaic import exact_grad as mosaic_exact_grad
from tilax.rbf.mosaic import forward as mosaic_forward
from tilax.rbf.mosaic import grad as mosaic_grad

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "data" / "results"
API_PAGE = REPO / "docs" / "api" / "rbf.md"
H200_FACTS = dict(cores=132, shared_memory=232448)
HOPPER = rbf_config.Device(mosaic=True, **H200_FACTS)
TRITON_GPU = rbf_config.Device(mosaic=False, **H200_FACTS)
#: The rows no stored run holds yet (each owes an H200 run; see its ``unmeasured``).
UNMEASURED = {"triton_fast_fwd", "triton_exact_dk", "occupancy", "value_tile", "interpret_tiles",
              "mosaic_exact_fwd", "mosaic_exact_bwd", "matern_launches"}


def _rows(name: str) -> tuple[dict, dict]:
    """``machine_info`` and ``{benchmark id: (extra_info, stats)}`` of a stored file's measured
    rows."""
    data = json.loads((RESULTS / name).read_text())
    rows = {}
    for bench in data["benchmarks"]:
        if bench["extra_info"].get("error") or not bench.get("stats"):
            continue
        rows[bench["name"].partition("[")[2].rstrip("]")] = (bench["extra_info"], bench["stats"])
    return data["machine_info"], rows


def _beaten(evidence: rbf_config.Evidence, rows: dict) -> list[str]:
    if evidence.beaten != rbf_config.SWEEP:
        return list(evidence.beaten)
    info = rows[evidence.chosen][0]
    return [row for row, (other, _) in rows.items() if row != evidence.chosen
            and (other.get("path"), other.get("kernel")) == (info["path"], info["kernel"])]


@pytest.mark.parametrize("rule", [r for r in rbf_config.RULES if r.evidence],
                         ids=lambda r: r.name)
def test_each_rule_wins_in_its_stored_run(rule):
    for evidence in rule.evidence:
        machine, rows = _rows(evidence.file)
        assert machine["gpu"] == "NVIDIA H200", evidence.file
        chosen = rows[evidence.chosen]
        beaten = _beaten(evidence, rows)
        assert beaten, evidence
        for name in beaten:
            other = rows[name][1]
            # faster beyond the spread: the chosen row's upper quartile under the other's lower
            assert chosen[1]["q3"] < other["q1"], (evidence.file, evidence.chosen, name)


@pytest.mark.parametrize("rule", [r for r in rbf_config.RULES if r.launch and r.evidence],
                         ids=lambda r: r.name)
def test_each_launch_is_the_one_its_stored_run_chose(rule):
    """The chosen row ran the rule's tiles (launch rows name them in ``extra_info``), and a
    Mosaic GPU rule's row ran Mosaic GPU."""
    for evidence in rule.evidence:
        info = _rows(evidence.file)[1][evidence.chosen][0]
        if "block_p" in info:
            assert (info["block_p"], info["block_l"]) == (rule.launch.block_p,
                                                          rule.launch.block_l), evidence
        if rule.launch.backend is None:
            assert (info["num_warps"], info["num_stages"]) == (rule.launch.num_warps,
                                                               rule.launch.num_stages)
        else:
            role = "bwd_backend" if info.get("op") == "fwd_bwd" else "fwd_backend"
            assert info[role] == rule.launch.backend, evidence


def test_the_rows_without_a_stored_run_are_the_known_ones():
    assert {r.name for r in rbf_config.RULES if not r.evidence} == UNMEASURED
    for rule in rbf_config.RULES:
        assert bool(rule.unmeasured) != bool(rule.evidence), rule.name
        for evidence in rule.evidence:
            assert (RESULTS / evidence.file).is_file(), evidence.file
    assert len({r.name for r in rbf_config.RULES}) == len(rbf_config.RULES)


def _config(precision=None, *, device=TRITON_GPU, n=65536, dim=8, out=16, **kwargs):
    return rbf_config.default_config("triton", precision, batch=1, n=n, m=n, out=out, dim=dim,
                                     device=device, **kwargs)


def _tiles(launch):
    return launch.block_p, launch.block_l, launch.num_warps, launch.num_stages


@pytest.mark.parametrize("path, precision, kernel, name", [
    ("fast", None, "fwd", "triton_fast_fwd"), ("fast", None, "dq", "triton_fast_bwd"),
    ("fast", None, "dk", "triton_fast_bwd"), ("exact", "highest", "fwd", "triton_exact_fwd"),
    ("exact", "highest", "dq", "triton_exact_dq"), ("exact", "highest", "dk", "triton_exact_dk"),
])
def test_large_problems_take_the_triton_rules_launches(path, precision, kernel, name):
    launch = getattr(getattr(_config(precision), path), kernel)
    assert _tiles(launch) == _tiles(rbf_config.rule(name).launch)
    assert launch.backend is None


def test_hopper_takes_the_mosaic_rules():
    fast = _config(device=HOPPER).fast
    assert _tiles(fast.fwd)[:2] == (128, 128) and fast.fwd.backend == "mosaic"
    sweep = rbf_config.rule("mosaic_fast_bwd").launch
    assert (fast.dk.block_p, fast.dk.block_l, fast.dk.backend) == (128, sweep.block_l, "mosaic")
    exact = _config("highest", device=HOPPER).exact
    for kernel, name in (("fwd", "mosaic_exact_fwd"), ("dq", "mosaic_exact_bwd"),
                         ("dk", "mosaic_exact_bwd")):
        launch, chosen = getattr(exact, kernel), rbf_config.rule(name).launch
        assert (launch.block_p, launch.block_l, launch.backend) == (
            chosen.block_p, chosen.block_l, "mosaic"), kernel
    # the KDE has no Mosaic GPU sweeps; explicit tiles keep the exact path on Triton
    assert _config(device=HOPPER, op="kde").fast.dk.backend is None
    assert _config("highest", device=HOPPER, block_q=64).exact.fwd.backend is None


def test_narrow_loop_tiles_where_the_wide_sweep_does_not_fit():
    wide, narrow = (rbf_config.rule(name).launch.block_l
                    for name in ("mosaic_fast_bwd", "mosaic_fast_bwd_narrow"))
    # D = 14: parts of 64 columns, coordinates of 16; 64 value columns
    need = rbf_config.mosaic_sweep_shared_memory_bytes(64, 16, 64, wide)
    assert need > HOPPER.shared_memory - rbf_config.MOSAIC_BARRIER_BYTES
    dk = _config(device=HOPPER, dim=14, out=64).fast.dk
    assert (dk.block_l, dk.backend) == (narrow, "mosaic")


@pytest.mark.parametrize("dtype, platform, impl", [
    (jnp.float32, "gpu", "pallas"), (jnp.bfloat16, "gpu", "pallas"),
    (jnp.float64, "gpu", "xla"), (jnp.float32, "cpu", "xla"),
])
def test_auto_impl_rule(dtype, platform, impl):
    assert rbf_config.auto_impl(dtype, platform) == impl


def test_the_device_here_comes_from_pallas():
    here = rbf_config.Device.here()
    assert here.mosaic == (_pallas.mosaic_unavailable_reason() is None)
    assert here.shared_memory == _pallas.shared_memory_per_block()
    assert here.cores == (_pallas.gpu_core_count() or rbf_config.PLANNED_CORES)


def test_shared_memory_by_compute_capability():
    assert _pallas.shared_memory_per_block((8, 6)) == 101376
    assert _pallas.shared_memory_per_block((8, 8)) == 166912  # the nearest lower: 8.7
    assert _pallas.shared_memory_per_block((9, 0)) == 232448
    assert _pallas.shared_memory_per_block((6, 1)) == 232448  # unknown: sm90's


def test_the_rules_agree_with_what_the_mosaic_kernels_take():
    """The config's copy of each Mosaic GPU kernel's limits is the kernel's: every launch the
    rules choose passes the kernel's own check, and one step past each limit fails it."""
    assert rbf_config.MOSAIC_BLOCK_P == mosaic_common.BLOCK_P
    assert rbf_config.MOSAIC_MAX_WIDTH == mosaic_common.MAX_WIDTH
    assert rbf_config.MOSAIC_MAX_COLUMNS == mosaic_grad.MAX_COLUMNS == mosaic_exact_grad.MAX_COLUMNS
    assert rbf_config.MOSAIC_EXACT_MAX_DIMS == mosaic_common.MAX_DIMS
    assert rbf_config.MOSAIC_SWEEP_STAGES == mosaic_grad.STAGES
    assert rbf_config.rule("mosaic_fast_bwd").launch.block_l == mosaic_grad.BLOCK_L
    assert rbf_config.rule("mosaic_exact_fwd").launch.block_l == mosaic_exact.BLOCK_L
    assert rbf_config.rule("mosaic_exact_bwd").launch.block_l == mosaic_exact_grad.BLOCK_L
    for dim, out in ((1, 1), (8, 16), (14, 64), (16, 200), (17, 16), (8, 300)):
        for precision in (None, "high", "highest"):
            cfg = _config(precision, device=HOPPER, dim=dim, out=out)
            for path in (cfg.fast, cfg.exact):
                if path is None:
                    continue
                _check_kernels_take(path, dim)


def _check_kernels_take(path, dim):
    modes = path.modes
    if path.fwd.backend == "mosaic" and modes.distance != "difference":
        distance = rbf_config.forward_distance(modes, dim)
        assert mosaic_forward.unsupported_reason(distance, modes.values,
                                                 rbf_config.parts_width(dim),
                                                 path.fwd.block_o) is None
    if path.fwd.backend == "mosaic" and modes.distance == "difference":
        distance = rbf_config.forward_distance(modes, dim)
        assert mosaic_exact.unsupported_reason(distance, modes.values, path.fwd.block_o) is None
    if path.dk.backend == "mosaic" and modes.distance != "difference":
        assert mosaic_grad.unsupported_reason(rbf_config.parts_width(dim),
                                              rbf_config.expansion_width(dim), path.cols,
                                              path.dk.block_l) is None
    if path.dk.backend == "mosaic" and modes.distance == "difference":
        distance = rbf_config.backward_distance(modes, dim)
        assert mosaic_exact_grad.unsupported_reason(distance, modes.values, path.cols) is None


def test_explicit_tiles_and_the_device_are_the_documented_options():
    """Tests and tuning select launches through ``block_q``/``block_k``/``block_o`` and
    ``device``: a device with one core plans the tiles of problems that fill a GPU."""
    small = dict(n=520, dim=8, out=16)
    one_core = dataclasses.replace(TRITON_GPU, cores=1)
    assert _config(device=one_core, **small).fast.fwd.block_p == 128
    assert _config(**small).fast.fwd.block_p == 32  # occupancy: 5 programs of 128 rows
    explicit = _config(block_q=32, block_k=64, block_o=16, **small).fast
    assert (explicit.fwd.block_p, explicit.fwd.block_l, explicit.fwd.block_o) == (32, 64, 16)


def test_the_api_page_lists_every_rule_and_its_stored_runs():
    page = API_PAGE.read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [r.name for r in rbf_config.RULES]
    for rule, row in zip(rbf_config.RULES, rows, strict=True):
        for evidence in rule.evidence:
            assert f"(../reports/data/{evidence.file})" in row, (rule.name, evidence.file)
        assert ("none" in row.split("|")[3]) == (not rule.evidence), rule.name
