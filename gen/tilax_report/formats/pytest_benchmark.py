"""pytest-benchmark JSON (``--benchmark-json``): tilax's own runs from ``nox -s bench``.

Shape: ``{"machine_info": {...}, "commit_info": {...}, "benchmarks": [...], "datetime": ...,
"version": ...}``. Everything a report needs is in each benchmark's ``extra_info`` (the contract
in docs/reports/schema.md); ``stats`` are in seconds, ``stats.data`` the time of every round. A
benchmark whose ``extra_info`` has an ``error`` timed nothing: its stats are ignored, as are the
stats of ladder summary rows (suite ``maxtok_summary``, rows with ``max_n`` or
``probed_sizes``). The run id is set from the GPU and commit of all files together
(`load.assign_runs`); here it is the file name without ``.json``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ._common import FormatError, as_list, as_mapping, require, split_rel_err, status_of

NAME = "pytest_benchmark"

FAMILIES = ("moe", "rbf", "gp")
REQUIRED = ["family", "suite", "impl", "dtype", "op"]
FULL_SHA = re.compile(r"[0-9a-f]{40}")
# extra_info keys copied under the same name.
SAME_NAME = [
    "family", "suite", "impl", "dtype", "op", "compile_s", "sync_call_s", "error",
    "power_w", "sm_clock_mhz", "power_limit_w", "power_samples", "power_field",
    # MoE
    "routing", "dispatch", "tokens", "d_model", "d_hidden", "experts", "top_k",
    "shared_hidden", "skew", "flops", "tflops", "max_expert_frac", "empty_experts",
    "rel_err_out", "rel_err_grad_x", "rel_err_grad_params", "piece", "block_m", "peak_mb",
    "max_tokens", "recompute", "quantize", "deterministic", "activation", "variant", "router",
    # MoE expert parallel (suite ep)
    "part", "devices", "mesh", "exchange", "exchange_chunks", "tokens_per_device", "tokens_per_s",
    "bytes", "gbps",
    "rel_err_out_vs_one_device",
    # MoE decode suite
    "touched_experts", "touched_weight_bytes",
    # RBF
    "n", "m", "dim", "out", "batch", "block_q", "block_k", "block_o", "pairs_per_s",
    "max_n", "precision", "profile", "fwd_backend",
    # RBF launch sweep
    "path", "kernel", "block_p", "block_l", "num_warps", "num_stages", "default_launch",
    "bwd_backend",
    # Ladder summaries
    "limit_kind", "max_is_lower_bound", "stopped_by",
    # Gaussian processes (suites gp, gp_fit)
    "mll", "mll_reference", "rel_err_mll", "rel_err_grad", "cg_iterations", "num_probes", "tol",
    "preconditioner_rank", "evals_per_s", "steps", "fit_s", "converged",
    # MoE FP8 convergence (suite fp8_convergence)
    "steps_per_call", "final_loss", "final_floor",
]
# extra_info keys read into other columns (or, for child_times_s, into round_ms when the stats
# carry no per-round data: a ladder step's child process times its calls itself).
CONSUMED = {"rel_err", "wall_s", "child_times_s", "limit_bracket", "probed_sizes",
            "loss_curve"}
# machine_info keys copied under the same name.
MACHINE = [
    "gpu_driver", "gpu_memory_gb", "compute_capability", "cuda", "jax", "jaxlib",
    "jax_cuda_plugin", "triton", "torch", "tokamax", "pykeops", "numpy", "python",
    "bench_mode", "bench_budget_s", "bench_part",
]
# Derived from the (ignored) stats of a row that timed nothing, so dropped there.
TIMING_DERIVED = ("flops", "tflops", "pairs_per_s", "tokens_per_s", "gbps",
                  "touched_weight_gbps", "evals_per_s")
SUMMARY_SUITES = ("maxtok_summary",)
REL_ERR_REF = {"moe": "float32 dense", "rbf": "float64 reference",
               "gp": "float64 dense Cholesky"}
_REL_ERR_COLUMNS = (
    "rel_err", "rel_err_dq", "rel_err_dk", "rel_err_dv", "rel_err_dlengthscale",
    "rel_err_out", "rel_err_grad_x", "rel_err_grad_params", "rel_err_mll", "rel_err_grad",
)


def matches(doc: dict[str, Any]) -> bool:
    return isinstance(doc.get("benchmarks"), list) and isinstance(doc.get("machine_info"), dict)


def load(doc: dict[str, Any], file_stem: str) -> list[dict[str, Any]]:
    rows = []
    common = _environment(doc, file_stem)
    for index, bench in enumerate(as_list(doc["benchmarks"], "benchmarks")):
        where = f"benchmarks[{index}]"
        bench = as_mapping(bench, where)
        where = f"benchmarks[{index}] ({bench.get('name', 'unnamed')})"
        rows.append({**common, **_row(bench, where), "source_row": index})
    return rows


def _environment(doc: dict[str, Any], file_stem: str) -> dict[str, Any]:
    machine = as_mapping(doc["machine_info"], "machine_info")
    commit_info = doc.get("commit_info") or {}
    # commit_info is "unknown" when the bench ran from a copy without .git; machine_info's
    # commit comes from TILAX_BENCH_COMMIT then.
    commit = str(machine.get("commit") or "") or str(commit_info.get("id") or "")[:7]
    provenance = machine.get("tilax_provenance")
    if provenance is not None:
        provenance = as_mapping(provenance, "machine_info.tilax_provenance")
        require(provenance, ["code_hash", "declared_commit", "tree_matches_declared"],
                "machine_info.tilax_provenance")
        commit = str(provenance["declared_commit"]) or commit
    if FULL_SHA.fullmatch(commit):  # TILAX_BENCH_COMMIT given as a full sha: one run all the same
        commit = commit[:7]
    suites = machine.get("bench_suites")
    started = str(doc["datetime"]) if doc.get("datetime") else None
    # What git said on the GPU host: host_git when the commit was given by TILAX_BENCH_COMMIT.
    head = commit_info.get("host_git") if isinstance(commit_info.get("host_git"), dict) \
        else commit_info
    head_id = str(head.get("id") or "")
    return {
        "run": file_stem,
        # a run on the CPU backend (no GPU) is named for it, not left as an unknown GPU
        "device": machine.get("gpu") or ("CPU" if machine.get("platform") == "cpu" else None),
        **{key: machine.get(key) for key in MACHINE},
        "bench_suites": ", ".join(map(str, suites)) if isinstance(suites, list) else suites,
        "started": started,
        "date": started[:10] if started else None,
        "commit": commit if commit and commit != "unknown" else None,
        "recorded_head": head_id[:7] if head_id and head_id != "unknown" else None,
        "recorded_dirty": head.get("dirty") if head_id and head_id != "unknown" else None,
        "code_hash": provenance["code_hash"] if provenance else None,
        "code_hash_source": "stored" if provenance else None,
        "tree_matches_declared": provenance["tree_matches_declared"] if provenance else None,
    }


def _row(bench: dict[str, Any], where: str) -> dict[str, Any]:
    extra = as_mapping(bench.get("extra_info"), f"{where}.extra_info")
    require(extra, REQUIRED, f"{where}.extra_info")
    if extra["family"] not in FAMILIES:
        raise FormatError(f"{where}: family {extra['family']!r} is not one of {FAMILIES}")
    row = {key: extra.get(key) for key in SAME_NAME}
    row.update(split_rel_err(extra.get("rel_err"), where))
    row["status"] = status_of(extra.get("error"))
    row["run_s"] = extra.get("wall_s")
    row["summary"] = (extra["suite"] in SUMMARY_SUITES or extra.get("max_n") is not None
                      or "probed_sizes" in extra)
    bracket = extra.get("limit_bracket")
    if isinstance(bracket, list) and len(bracket) == 2:
        row["limit_ran"], row["limit_failed"] = bracket
    if row["status"] == "measured" and not row["summary"]:
        row.update(_timing(bench.get("stats"), extra.get("child_times_s"), where))
        touched = extra.get("touched_weight_bytes")
        if isinstance(touched, (int, float)) and row["median_ms"] > 0:
            row["touched_weight_gbps"] = touched / (row["median_ms"] * 1e-3) / 1e9
    else:
        row.update({key: None for key in TIMING_DERIVED})
    if extra.get("loss_curve") is not None:
        row["loss_curve"] = _loss_curve(extra["loss_curve"], f"{where}.extra_info.loss_curve")
    if any(row.get(key) is not None for key in _REL_ERR_COLUMNS):
        row["rel_err_ref"] = REL_ERR_REF[extra["family"]]
    unknown = {k: v for k, v in extra.items() if k not in SAME_NAME and k not in CONSUMED}
    row["extra"] = json.dumps(unknown, sort_keys=True, default=str) if unknown else None
    return row


def _timing(stats: Any, child_times: Any, where: str) -> dict[str, Any]:
    stats = as_mapping(stats, f"{where}.stats")
    require(stats, ["median", "q1", "q3", "rounds"], f"{where}.stats")
    for key in ("median", "q1", "q3"):
        value = stats[key]
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise FormatError(f"{where}.stats.{key} is {value!r}, expected seconds >= 0")
    rounds = stats.get("data") or child_times
    if rounds is not None:
        rounds = as_list(rounds, f"{where}.stats.data")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in rounds):
            raise FormatError(f"{where}.stats.data holds a value that is not a finite number")
    return {
        "median_ms": stats["median"] * 1e3,
        "q1_ms": stats["q1"] * 1e3,
        "q3_ms": stats["q3"] * 1e3,
        "rounds": stats["rounds"],
        "round_ms": tuple(v * 1e3 for v in rounds) if rounds else None,
        "inner": stats.get("iterations"),
    }


def _loss_curve(curve: Any, where: str) -> tuple[tuple[int, float, float], ...]:
    """``[[step, loss, floor], ...]`` as a tuple of ``(step, loss, floor)`` tuples. A loss may
    be NaN or infinite (a training that diverged is a result); a step must be an integer."""
    points = []
    for index, point in enumerate(as_list(curve, where)):
        if not (isinstance(point, list) and len(point) == 3
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in point)):
            raise FormatError(f"{where}[{index}] is {point!r}, expected [step, loss, floor]")
        step, loss, floor = point
        if not float(step).is_integer():
            raise FormatError(f"{where}[{index}]: step {step!r} is not an integer")
        points.append((int(step), float(loss), float(floor)))
    return tuple(points)
