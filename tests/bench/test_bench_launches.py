"""The launch sweep's case grid (``bench_rbf.launch_cases``), on CPU without running a kernel:
counts, ids, the default launch of each group, the order and the configs it builds; the smoke
rows themselves run in test_bench_rbf.py."""

import collections
import dataclasses
import importlib.util
import re
from pathlib import Path

import bench_rbf
import pytest
from bench_rows import check_extra_info

BENCH_DIR = Path(__file__).resolve().parent
GROUPS = ("fast_fwd", "fast_bwd", "exact_fwd", "exact_bwd")


@pytest.fixture(scope="module")
def full():
    return bench_rbf.launch_cases("full")


def test_full_grid_counts_and_unique_ids(full):
    counts = collections.Counter(case.group for case in full)
    assert counts == {"fast_fwd": 36, "fast_bwd": 18, "exact_fwd": 18, "exact_bwd": 19}
    ids = [case.id for case in full]
    assert len(set(ids)) == len(ids) == 91
    assert all(case.suite == "kernel_mv_launches" and case.n == case.keys == 65536
               and (case.dim, case.out) == (8, 16) for case in full)


def test_ids_select_the_groups_with_k(full):
    """Each -k word of the docs selects exactly its rows (pytest -k matches substrings)."""
    def selected(word):
        return {case.group for case in full if word in case.id}

    assert selected("fast") == {"fast_fwd", "fast_bwd"}
    assert selected("exact") == {"exact_fwd", "exact_bwd"}
    for group in GROUPS:
        assert selected(group) == {group}
    assert re.fullmatch(r"kernel_mv_launches-exact_bwd-bp64-bl32-w4-s2-n65536-d8-o16-highest-"
                        r"fwd_bwd", next(c.id for c in full if c.group == "exact_bwd"))


def test_each_group_has_its_default_launch_once(full):
    """On CPU the grid is listed with the GPU's rules (an sm90 device): the defaults are
    GPU_PREFERRED, the launches the H200 sweep chose; the exact backward's is no row (its dk
    launch has shorter loop tiles than its dq launch, and a row sets both alike)."""
    from tilax.rbf.config import GPU_PREFERRED

    defaults = [case for case in full if case.default_launch]
    assert sorted(case.group for case in defaults) == ["exact_fwd", "fast_bwd", "fast_fwd"]
    assert GPU_PREFERRED[("exact", "dk")].block_l < GPU_PREFERRED[("exact", "bwd")].block_l
    for case in defaults:
        preferred = GPU_PREFERRED[(case.path, case.kernel)]
        assert case.launch == (preferred.block_p, preferred.block_l, preferred.num_warps,
                               preferred.num_stages)
        assert case.block_o == 16  # the value tile at O = 16


def test_on_hopper_the_defaults_name_their_backend(full):
    """Where Mosaic GPU runs, the backwards' defaults are the Mosaic GPU sweeps (the fast
    path's with ``mosaic_grad.BLOCK_L``, the exact path's with
    ``mosaic_exact_grad.BLOCK_L``) and the forwards' (the Mosaic GPU forwards, fast and
    exact) are no rows of the Triton grid; the rows and their ids are the same as on any other
    device."""
    from tilax import _pallas
    from tilax.rbf.mosaic import exact_grad as mosaic_exact_grad
    from tilax.rbf.mosaic import grad as mosaic_grad

    with _pallas.assume_device(mosaic_unavailable_reason=None):
        hopper = bench_rbf.launch_cases("full")
        assert sorted(case.id for case in hopper) == sorted(case.id for case in full)
        defaults = {case.group: case for case in hopper if case.default_launch}
        assert sorted(defaults) == ["exact_bwd", "fast_bwd"]
        for group, block_l in (("fast_bwd", mosaic_grad.BLOCK_L),
                               ("exact_bwd", mosaic_exact_grad.BLOCK_L)):
            chosen = defaults[group]
            assert (chosen.grad_backend, chosen.block_p, chosen.block_l) == ("mosaic", 128, block_l)
            assert chosen.extra_info()["bwd_backend"] == "mosaic"


def test_defaults_then_neighbours_run_first(full):
    # each group's default (the exact backward's dq launch for both sweeps) first
    assert all(case.priority == bench_rbf.LAUNCH_PRIORITY for case in full[:4])
    assert [case.default_launch for case in full[:4]].count(True) == 3
    # then the Mosaic GPU gradient sweeps, the candidates for the backwards' defaults
    mosaic = [case for case in full if case.grad_backend]
    assert full[4:7] == mosaic
    assert [(c.group, c.block_p, c.block_l) for c in mosaic] == [
        ("fast_bwd", 128, 64), ("fast_bwd", 128, 128), ("exact_bwd", 128, 64)]
    assert [c.id for c in mosaic] == [
        *(f"kernel_mv_launches-fast_bwd-mosaic-bp128-bl{bl}-n65536-d8-o16-fwd_bwd"
          for bl in (64, 128)),
        "kernel_mv_launches-exact_bwd-mosaic-bp128-bl64-n65536-d8-o16-highest-fwd_bwd"]
    priorities = [case.priority for case in full]
    assert priorities == sorted(priorities)
    defaults = {case.group: case.launch for case in full[:4]}
    for case in full:
        if case.grad_backend:
            assert case.priority == bench_rbf.LAUNCH_PRIORITY and not case.default_launch
            continue
        distance = bench_rbf.launch_distance(case.launch, defaults[case.group])
        assert case.priority == bench_rbf.LAUNCH_PRIORITY + distance
    neighbours = [case for case in full if case.priority == bench_rbf.LAUNCH_PRIORITY + 1]
    assert {case.group for case in neighbours} == set(GROUPS)
    # the likeliest spills (the exact backward's largest loop tile with 8 warps) come late
    spill = next(case for case in full if case.id.startswith(
        "kernel_mv_launches-exact_bwd-bp32-bl128-w8-"))
    assert full.index(spill) > len(full) // 2


def test_rows_carry_the_launch_and_satisfy_the_contract(full):
    from tilax import _pallas

    for case in full:
        info = {**case.extra_info(), "compile_s": 1.0, "pairs_per_s": 1e12}
        assert check_extra_info(info) == [], case.id
        assert (info["path"], info["kernel"]) == (case.path, case.kernel)
        assert info["precision"] == ("highest" if case.path == "exact" else None)
        assert info["op"] == ("fwd" if case.kernel == "fwd" else "fwd_bwd")
        if case.grad_backend:  # its own kernel: no Triton shared-memory model
            assert "shared_memory_model_bytes" not in info
        else:
            assert isinstance(info["shared_memory_model_bytes"], int)
        # the sweeps a bwd row runs: its own launches' backend, whatever the default's
        assert info.get("bwd_backend") == (
            (case.grad_backend or _pallas.resolve_backend("pallas"))
            if case.kernel == "bwd" else None)
    bad = {**full[0].extra_info(), "compile_s": None, "error": "x"}
    del bad["num_stages"]
    assert check_extra_info(bad) == ["missing 'num_stages'"]


@pytest.mark.parametrize("group", GROUPS)
def test_config_replaces_only_its_group(full, group):
    from tilax.rbf import config as rbf_config

    case = next(c for c in full if c.group == group and not c.default_launch
                and not c.grad_backend)
    cfg = case.config("triton")
    default = rbf_config.default_config("triton", case.precision, batch=1, n=case.n,
                                           m=case.keys, out=case.out, dim=case.dim)
    launch = rbf_config.Launch(case.block_p, case.block_l, 16, case.num_warps,
                                  case.num_stages)
    path, other = (cfg.fast, cfg.exact) if case.path == "fast" else (cfg.exact, cfg.fast)
    default_path = getattr(default, case.path)
    changed = ("fwd",) if case.kernel == "fwd" else ("dq", "dk")
    for name in ("fwd", "dq", "dk"):
        expected = launch if name in changed else getattr(default_path, name)
        assert getattr(path, name) == expected, name
    assert other == getattr(default, "exact" if case.path == "fast" else "fast")
    assert dataclasses.replace(cfg, **{case.path: default_path}) == default


def test_mosaic_rows_set_both_sweeps_and_need_hopper(full):
    from tilax import _pallas
    from tilax.rbf import config as rbf_config

    case = next(c for c in full if c.grad_backend)
    cfg = case.config("triton")
    sweep = rbf_config.Launch(128, case.block_l, 16, case.num_warps, case.num_stages,
                                 backend="mosaic")
    assert cfg.fast.dq == cfg.fast.dk == sweep
    exact_case = next(c for c in full if c.grad_backend and c.path == "exact")
    exact = exact_case.config("triton").exact
    assert exact.dq == exact.dk == rbf_config.Launch(128, 64, 16, 4, 2, backend="mosaic")
    with _pallas.assume_device(mosaic_unavailable_reason="no Hopper here"):
        assert case.unavailable_reason().startswith(
            "unavailable: the Mosaic GPU gradient sweeps")
    with _pallas.assume_device(mosaic_unavailable_reason=None):
        assert case.unavailable_reason() is None


def test_quick_and_smoke_are_small():
    quick = bench_rbf.launch_cases("quick")
    # (the exact backward's default is no row of the grid: the kernel_mv suite times it)
    assert [case.group for case in quick] == ["fast_fwd", "fast_bwd", "exact_fwd", "fast_bwd",
                                              "fast_bwd", "exact_bwd"]
    assert all((case.default_launch or case.grad_backend) and case.n == 65536
               for case in quick)
    smoke = bench_rbf.launch_cases("smoke")
    assert [case.group for case in smoke] == list(GROUPS)
    assert all(case.n == case.keys == 64 and case.launch == bench_rbf.SMOKE_LAUNCH
               for case in smoke)


def test_suite_names_weights_and_docs_agree(full):
    spec = importlib.util.spec_from_file_location("bench_conftest", BENCH_DIR / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    assert conftest.SUITE_GROUPS["launches"] == ("kernel_mv_launches",)
    assert "kernel_mv_launches" in conftest.SUITE_GROUPS["rbf"]
    assert set(conftest.SUITE_WEIGHTS) == {*conftest.MOE_SUITES, *conftest.RBF_SUITES,
                                           *conftest.GP_SUITES, *conftest.GP_BY_NAME,
                                           *conftest.MULTI_DEVICE_SUITES}
    table_row = next(line for line in conftest.__doc__.splitlines()
                     if line.startswith("kernel_mv_ "))
    assert f" {len(full)} " in table_row
    assert f"launches {conftest.SUITE_WEIGHTS['kernel_mv_launches']:g}" in " ".join(
        conftest.__doc__.split())


def test_kernel_mv_rows_name_the_backends_that_ran():
    from tilax import _pallas

    cases = bench_rbf.kernel_mv_cases("smoke")
    both = next(c for c in cases if c.impl == "pallas" and c.op == "fwd_bwd")
    forward = next(c for c in cases if c.impl == "pallas" and c.op == "fwd")
    here = _pallas.resolve_backend("pallas")
    assert both.extra_info()["bwd_backend"] == both.extra_info()["fwd_backend"] == here
    assert "bwd_backend" not in forward.extra_info()
    assert "bwd_backend" not in next(c for c in cases if c.impl == "xla").extra_info()
