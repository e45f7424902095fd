"""Benchmark rows: the JSON-lines side file, turning it back into pytest-benchmark JSON, and the
``extra_info`` contract check.

While a bench run goes on, every finished benchmark is appended to a side file (one JSON object a
line) so a killed run keeps what it measured. Line 1 is a header with ``machine_info`` and
``commit_info``; every other line is one benchmark exactly as pytest-benchmark writes it into
``benchmarks[]`` (name, fullname, params, extra_info, options, stats).

Command line::

    # a run died before pytest-benchmark wrote its JSON: rebuild it from the side file
    python tests/bench/bench_rows.py convert OUT.json OUT.rows.jsonl
    # join several runs of one machine (e.g. the moe call and the rbf call) into one file
    python tests/bench/bench_rows.py merge OUT.json a.json b.rows.jsonl ...
    # check files against the extra_info contract
    python tests/bench/bench_rows.py check a.json ...
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

MOE_SUITES = {"layer", "decoder", "pieces", "blockm", "maxtok", "maxtok_summary", "ep",
              "variants", "fp8_convergence", "decode"}
RBF_SUITES = {
    "kernel_mv", "kde_density", "kernel_mv_tiles", "kernel_mv_launches", "kernel_mv_crossover",
    "kernel_mv_peak", "kernel_mv_max_n", "guide_gp",
}
GP_SUITES = {"gp", "gp_fit", "gp_rank"}
GP_IMPLS = {"tilax", "dense", "tinygp", "gpytorch_keops"}
GP_PARAMS = {"lengthscale", "outputscale", "noise"}
# (tokamax_autotuned: a peer of stored rows, removed from the grids)
MOE_IMPLS = {"pallas", "triton", "mosaic", "blocked", "ragged_dot", "tokamax",
             "tokamax_autotuned", "torch_grouped_mm",
             "torch_grouped_mm_compile", "dense", "all_to_all", "all_gather",
             "auto", "decode", "copy_bandwidth"}
EP_PARTS = {"link", "step", "exchange"}  # the link alone, a full step, the exchange alone
RBF_IMPLS = {"pallas", "xla", "dense", "torch_dense", "keops"}
MOE_PIECES = {"route", "sort_permute", "experts_grouped_swiglu", "unpermute_combine"}
RBF_GRAD_KEYS = {"dq", "dk", "dv", "dlengthscale"}
# The launch sweep (suite kernel_mv_launches): the kernel family and the launch of each row.
LAUNCH_KEYS = ("path", "kernel", "block_p", "block_l", "block_o", "num_warps", "num_stages",
               "default_launch")
LAUNCH_GROUPS = {("fast", "fwd"), ("fast", "bwd"), ("exact", "fwd"), ("exact", "bwd")}
MACHINE_KEYS = (
    "gpu", "gpu_driver", "gpu_memory_gb", "compute_capability", "jax", "jaxlib", "cuda",
    "triton", "python", "commit", "platform",
)


def write_header(path: Path, machine_info: dict, commit_info: dict) -> None:
    """Start a side file with the run's environment."""
    header = {
        "kind": "header",
        "machine_info": machine_info,
        "commit_info": commit_info,
        "datetime": datetime.datetime.now(datetime.UTC).isoformat(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps(header, default=str) + "\n")


def append_row(path: Path, row: dict) -> None:
    """Append one finished benchmark; flushed at once so a killed run keeps it."""
    with path.open("a") as f:
        f.write(json.dumps({"kind": "benchmark", **row}, default=str) + "\n")
        f.flush()


def read_side_file(path: Path) -> dict:
    """A side file as pytest-benchmark JSON (a torn last line from a kill is skipped)."""
    header: dict[str, Any] = {}
    benchmarks = []
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = record.pop("kind", None)
        if kind == "header":
            header = record
        elif kind == "benchmark":
            benchmarks.append(record)
    return {
        "machine_info": header.get("machine_info", {}),
        "commit_info": header.get("commit_info", {}),
        "benchmarks": benchmarks,
        "datetime": header.get("datetime"),
        "version": "side-file",
    }


def load_any(path: Path) -> dict:
    """pytest-benchmark JSON or a side file."""
    path = Path(path)
    if path.suffix == ".jsonl":
        return read_side_file(path)
    return json.loads(path.read_text())


def merge(documents: list[dict]) -> dict:
    """One pytest-benchmark document from several of one machine; rows keep their order and a
    benchmark name seen twice keeps its first row."""
    if not documents:
        raise ValueError("nothing to merge")
    merged = dict(documents[0])
    gpus = {d.get("machine_info", {}).get("gpu") for d in documents}
    if len(gpus) > 1:
        raise ValueError(f"refusing to merge runs of different devices: {sorted(map(str, gpus))}")
    seen: set[str] = set()
    rows = []
    for document in documents:
        for row in document.get("benchmarks", []):
            if row.get("fullname") in seen:
                continue
            seen.add(row.get("fullname"))
            rows.append(row)
    merged["benchmarks"] = rows
    return merged


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_extra_info(info: dict) -> list[str]:
    """Problems of one row's ``extra_info`` against the contract (empty list: it conforms)."""
    problems = []

    def need(*keys: str) -> None:
        for key in keys:
            if key not in info:
                problems.append(f"missing {key!r}")

    need("family", "suite", "impl", "dtype", "op", "compile_s")
    failed = "error" in info
    if failed and not (isinstance(info["error"], str) and info["error"]):
        problems.append("error must be a non-empty string")
    if info.get("dtype") not in ("float32", "bfloat16"):
        problems.append(f"dtype {info.get('dtype')!r}")
    compile_s = info.get("compile_s")
    if not (compile_s is None and failed) and compile_s is not None and not _is_number(compile_s):
        problems.append(f"compile_s {compile_s!r}")
    family, suite = info.get("family"), info.get("suite")
    if family == "moe":
        if suite not in MOE_SUITES:
            problems.append(f"moe suite {suite!r}")
        if info.get("impl") not in MOE_IMPLS:
            problems.append(f"moe impl {info.get('impl')!r}")
        if info.get("impl") == "copy_bandwidth":  # the decode suite's copy of a buffer
            if info.get("op") != "copy":
                problems.append(f"copy_bandwidth op {info.get('op')!r}")
            need("bytes", *(() if failed else ("gbps",)))
            return problems
        if info.get("op") not in ("forward", "train_step"):
            problems.append(f"moe op {info.get('op')!r}")
        need("routing", "dispatch", "tokens", "d_model", "d_hidden", "experts", "top_k",
             "shared_hidden", "skew")
        if suite == "pieces":
            need("piece")
            if info.get("piece") not in MOE_PIECES:
                problems.append(f"piece {info.get('piece')!r}")
        if suite == "blockm":
            need("block_m")
        if suite == "ep":
            need("devices", "mesh", "part", "tokens_per_device", "exchange")
            if info.get("part") not in EP_PARTS:
                problems.append(f"ep part {info.get('part')!r}")
        if suite == "maxtok_summary":
            if not failed:
                need("max_tokens")
        elif suite == "ep" and info.get("part") != "step":
            if not failed:
                need("bytes", "tokens_per_s", *(("gbps",) if info.get("part") == "link" else ()))
        elif not failed:
            need("flops", "tflops")
            if not _is_number(info.get("tflops")):
                problems.append(f"tflops {info.get('tflops')!r}")
        if suite == "maxtok" and not failed:
            need("peak_mb")
        if suite == "fp8_convergence" and not failed:
            need("quantize", "steps", "loss_curve", "final_loss", "final_floor")
        if suite in ("layer", "decoder", "blockm", "decode") and not failed:
            need("max_expert_frac", "empty_experts")
        if suite == "decode" and not failed:
            need("touched_weight_bytes", "touched_experts")
    elif family == "rbf":
        if suite not in RBF_SUITES:
            problems.append(f"rbf suite {suite!r}")
        if info.get("impl") not in RBF_IMPLS:
            problems.append(f"rbf impl {info.get('impl')!r}")
        if info.get("op") not in ("fwd", "fwd_bwd"):
            problems.append(f"rbf op {info.get('op')!r}")
        if suite == "guide_gp":  # a guide's step: the page's own sizes, no pair count
            if not failed:
                need("n", "cg_iterations")
            return problems
        need("n", "m", "dim", "batch", "precision")
        if suite != "kde_density":
            need("out")
        if suite == "kernel_mv_tiles":
            need("block_q", "block_k", "block_o")
        if suite == "kernel_mv_launches":
            need(*LAUNCH_KEYS)
            if (info.get("path"), info.get("kernel")) not in LAUNCH_GROUPS:
                problems.append(f"launch group {info.get('path')!r}/{info.get('kernel')!r}")
            if not isinstance(info.get("default_launch"), bool):
                problems.append(f"default_launch {info.get('default_launch')!r}")
        if suite == "kernel_mv_max_n" and "max_n" in info:
            pass  # the ladder's summary row: the largest n that ran
        elif not failed:
            need("pairs_per_s")
            if not _is_number(info.get("pairs_per_s")):
                problems.append(f"pairs_per_s {info.get('pairs_per_s')!r}")
        if suite in ("kernel_mv_peak", "kernel_mv_max_n") and "max_n" not in info and not failed:
            need("peak_mb")
        rel_err = info.get("rel_err")
        if rel_err is not None:
            if info.get("op") == "fwd" and not _is_number(rel_err):
                problems.append(f"fwd rel_err {rel_err!r}")
            if info.get("op") == "fwd_bwd" and not (
                isinstance(rel_err, dict) and set(rel_err) <= RBF_GRAD_KEYS and rel_err
            ):
                problems.append(f"fwd_bwd rel_err {rel_err!r}")
    elif family == "gp":
        problems += _gp_problems(info, failed, need)
    else:
        problems.append(f"family {family!r}")
    return problems


def _gp_problems(info: dict, failed: bool, need) -> list[str]:
    """The Gaussian-process rows (``bench_gp``): an MLL-with-gradient evaluation or a fit."""
    problems = []
    suite, impl, op = info.get("suite"), info.get("impl"), info.get("op")
    if suite not in GP_SUITES:
        problems.append(f"gp suite {suite!r}")
    if impl not in GP_IMPLS:
        problems.append(f"gp impl {impl!r}")
    if op != {"gp": "mll_grad", "gp_rank": "mll_grad", "gp_fit": "fit"}.get(suite, op):
        problems.append(f"gp op {op!r} in suite {suite!r}")
    need("n", "dim", "kernel")
    if suite in ("gp", "gp_rank") and not failed:
        need("mll", "grad", "evals_per_s")
        if not _is_number(info.get("mll")):
            problems.append(f"mll {info.get('mll')!r}")
        if not (isinstance(info.get("grad"), dict) and set(info["grad"]) == GP_PARAMS):
            problems.append(f"grad {info.get('grad')!r}")
        if impl == "tilax":
            need("cg_iterations", "num_probes", "tol", "preconditioner_rank")
    if suite == "gp_fit":
        need("generating", "start", "stopping_rule")
        if "trajectory" in info:  # the fit ran (it may have stopped short: a failed row)
            need("steps", "fit_s", "converged", "final")
            if not failed and info.get("converged") is not True:
                problems.append("a measured fit row must have converged")
        elif not failed:
            problems.append("missing 'trajectory'")
    return problems


def check_document(document: dict) -> list[str]:
    """Problems of a whole pytest-benchmark document (machine_info keys and every row)."""
    problems = []
    machine = document.get("machine_info", {})
    for key in MACHINE_KEYS:
        if key not in machine:
            problems.append(f"machine_info missing {key!r}")
    for row in document.get("benchmarks", []):
        for problem in check_extra_info(row.get("extra_info", {})):
            problems.append(f"{row.get('name')}: {problem}")
        stats = row.get("stats", {})
        for key in ("median", "q1", "q3", "rounds"):
            if key not in stats:
                problems.append(f"{row.get('name')}: stats missing {key!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert", help="side file -> pytest-benchmark JSON")
    convert.add_argument("output")
    convert.add_argument("side_file")
    merge_cmd = sub.add_parser("merge", help="several files of one machine -> one JSON")
    merge_cmd.add_argument("output")
    merge_cmd.add_argument("inputs", nargs="+")
    check = sub.add_parser("check", help="report rows that break the extra_info contract")
    check.add_argument("inputs", nargs="+")
    args = parser.parse_args(argv)

    if args.command == "check":
        bad = 0
        for name in args.inputs:
            problems = check_document(load_any(Path(name)))
            bad += len(problems)
            for problem in problems:
                print(f"{name}: {problem}")
        return 1 if bad else 0
    if args.command == "convert":
        document = read_side_file(Path(args.side_file))
    else:
        document = merge([load_any(Path(name)) for name in args.inputs])
    output = Path(args.output)
    if output.exists():
        print(f"{output} exists; not overwriting it", file=sys.stderr)
        return 1
    output.write_text(json.dumps(document, indent=1, default=str) + "\n")
    print(f"wrote {output}: {len(document['benchmarks'])} benchmarks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
