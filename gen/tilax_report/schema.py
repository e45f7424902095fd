"""The tidy results table: one row per measured (or failed) benchmark case.

Every loader returns a frame with exactly these columns, in this order, with these dtypes.
docs/reports/schema.md documents them for readers; tests/gen/test_schema.py keeps the two in step.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

# name -> (pandas dtype, one-line meaning). Missing values mean "not recorded / not measured".
COLUMNS: dict[str, tuple[str, str]] = {
    # Where the row comes from.
    "source_file": ("str", "file name under data/results/"),
    "source_format": ("str", "loader that read it: moe_layer_seed, nn_suites_seed, "
                             "h100_decoder_seed, rbf_seed or pytest_benchmark"),
    "source_row": ("Int64", "index of the row in the file's results[] or benchmarks[] list"),
    "run": ("str", "run id: everything measured at one commit on one GPU (our runs: "
                   "<gpu>-<yyyymmdd>-<commit>, from its files; seed files: the file's own run "
                   "ids)"),
    "code": ("str", "which code a run measured, where the file says: before, final, sweep, "
                    "intermediate"),
    "run_note": ("str", "the file's note about the run"),
    "device": ("str", "GPU name"),
    "gpu_memory_gb": ("float64", "GPU memory in GB"),
    "date": ("str", "date the file was written (YYYY-MM-DD) where it records it"),
    "started": ("str", "time the file's run started (ISO 8601, UTC) where it records it"),
    "commit": ("str", "tilax commit measured (pytest-benchmark runs): the commit the run was "
                      "filed under (declared), or machine_info.tilax_provenance.declared_commit"),
    # Provenance: which code the run measured (docs/reports/schema.md#provenance).
    "recorded_head": ("str", "the HEAD pytest-benchmark found on the GPU host (commit_info; "
                             "host_git when the commit was given by TILAX_BENCH_COMMIT)"),
    "recorded_dirty": ("boolean", "that HEAD's working tree had uncommitted changes"),
    "code_hash": ("str", "SHA-256 of the contents of src/ and tests/bench/ (tilax_report."
                         "provenance.code_hash): equal hashes, identical code"),
    "code_hash_source": ("str", "stored (recorded at bench time in machine_info."
                                "tilax_provenance) or declared (computed from git for the "
                                "declared commit: data/provenance/declared-commits.json)"),
    "tree_matches_declared": ("boolean", "stored provenance: the benched tree was the declared "
                                         "commit's (missing for declared labels: not checked)"),
    # The software and hardware of the run (machine_info; the seed files' device block).
    "gpu_driver": ("str", "NVIDIA driver version"),
    "compute_capability": ("str", "GPU compute capability"),
    "cuda": ("str", "CUDA version"),
    "jax": ("str", "jax version"),
    "jaxlib": ("str", "jaxlib version"),
    "jax_cuda_plugin": ("str", "jax CUDA plugin version"),
    "triton": ("str", "Triton version"),
    "torch": ("str", "PyTorch version"),
    "tokamax": ("str", "tokamax version"),
    "pykeops": ("str", "pykeops version"),
    "numpy": ("str", "numpy version"),
    "python": ("str", "Python version"),
    "bench_mode": ("str", "bench mode of the call that wrote the file (full, quick, smoke)"),
    "bench_suites": ("str", "suites the call was asked to run, comma-separated"),
    "bench_budget_s": ("float64", "time budget of the call, s"),
    "bench_part": ("str", "which part of a split suite the file holds, e.g. 1/3"),
    # What was measured.
    "family": ("str", "moe, rbf, gp (Gaussian processes) or nn"),
    "suite": ("str", "benchmark suite (MoE: layer, decoder, pieces, blockm, maxtok, "
                     "maxtok_summary, ep, variants, decode, fp8_convergence; RBF: "
                     "kernel_mv, kde_density, kernel_mv_tiles, kernel_mv_launches, "
                     "kernel_mv_crossover, kernel_mv_peak, kernel_mv_max_n; GP: gp, "
                     "gp_rank, gp_fit; NN: transformer, diffusion, moe, ssm, unet)"),
    "impl": ("str", "implementation (NN suites: attention variant or SSM cell)"),
    "dispatch": ("str", "MoE token dispatch: sorted, gather, fused, fused_gsum"),
    "routing": ("str", "MoE routing: dropless, capacity, dense"),
    "dtype": ("str", "float32 or bfloat16"),
    "op": ("str", "forward, train_step, fwd+bwd (MoE pieces); fwd, fwd_bwd (RBF); mll_grad "
                  "(the log marginal likelihood with its gradient), fit (GP)"),
    "piece": ("str", "train-step piece (suite pieces)"),
    "part": ("str", "what an expert-parallel row (suite ep) times: link (a plain all-to-all "
                    "or all-gather of the exchange's bytes), step (the train step) or exchange "
                    "(the step with identity experts: routing and the token copies' trips "
                    "alone)"),
    "exchange": ("str", "how token copies travel between GPUs (suite ep, MoEConfig.exchange): "
                        "all_gather, ragged or all_to_all; missing on one GPU"),
    "exchange_chunks": ("Int64", "chunks the all_gather exchange splits each GPU's tokens into "
                                 "(suite ep, MoEConfig.exchange_chunks; missing: 1)"),
    "mesh": ("str", "device mesh of the call, e.g. expert=2 (suite ep; missing: one device, no "
                    "mesh)"),
    "devices": ("Int64", "GPUs the call ran on (suite ep)"),
    "precision": ("str", "RBF dot precision"),
    "profile": ("str", "RBF kernel_mv rows: the stationary kernel (kernel_mv's kernel: "
                       "matern12, matern32, matern52); missing: the Gaussian, rbf"),
    "fwd_backend": ("str", "RBF pallas rows: backend of the forward kernel (triton, mosaic, "
                    "interpret)"),
    "bwd_backend": ("str", "RBF pallas fwd_bwd rows: backend of the gradient sweeps (triton, "
                    "mosaic, interpret)"),
    # Problem shape and tuning knobs.
    "tokens": ("Int64", "MoE / NN tokens per call (suite ep: over all its GPUs)"),
    "tokens_per_device": ("Int64", "tokens per GPU (suite ep: weak scaling keeps it fixed)"),
    "d_model": ("Int64", "model width"),
    "d_hidden": ("Int64", "expert hidden width"),
    "experts": ("Int64", "number of experts"),
    "top_k": ("Int64", "experts per token"),
    "shared_hidden": ("Int64", "shared-expert hidden width (0 or missing: none)"),
    "skew": ("float64", "router skew of the synthetic tokens (0: balanced)"),
    "block_m": ("Int64", "grouped-matmul row tile (suite blockm, pieces)"),
    "recompute": ("boolean", "MoE: expert activations recomputed in the backward instead of "
                             "saved (MoEConfig.recompute)"),
    "quantize": ("str", "MoE: the experts' quantisation (MoEConfig.quantize: fp8; missing: "
                        "none, the experts in dtype)"),
    "deterministic": ("boolean", "MoE: bitwise repeatable train step, no order-dependent sums "
                                 "(MoEConfig.deterministic)"),
    "activation": ("str", "MoE: the experts' activation (MoEConfig.activation; missing: swiglu, "
                          "the default)"),
    "variant": ("str", "MoE: the options of tilax.moe.rules' variant rules the row was traced "
                       "with, 'rule=option' joined by commas (suite variants; missing: the "
                       "rules' picks)"),
    "router": ("str", "MoE: the router when it is not the softmax top-k (MoEConfig's "
                      "score_func, balance_bias, expert_groups/group_top_k, routed_scale), "
                      "e.g. 'sigmoid bias groups 8/4 scale 2.5' (missing: softmax top-k)"),
    "slab_elems": ("Int64", "scatter slab size in elements (slab sweep runs; 0: one slab)"),
    "n": ("Int64", "RBF query points; GP training points"),
    "m": ("Int64", "RBF data points"),
    "dim": ("Int64", "RBF and GP input dimension"),
    "out": ("Int64", "RBF value columns"),
    "batch": ("Int64", "batch size"),
    "block_q": ("Int64", "RBF query tile"),
    "block_k": ("Int64", "RBF key tile"),
    "block_o": ("Int64", "RBF value-column tile"),
    "path": ("str", "RBF launch sweep: the distance path whose kernels it launches, fast "
                    "(expansion) or exact (differences)"),
    "kernel": ("str", "GP: the covariance kernel (rbf, ...); RBF launch sweep: the kernel "
                      "family, fwd (the forward launch) or bwd "
                      "(the dq and dk launches, timed as fwd_bwd)"),
    "block_p": ("Int64", "RBF launch sweep: program tile (rows of the point set a program "
                         "owns)"),
    "block_l": ("Int64", "RBF launch sweep: loop tile (rows of the other point set per step)"),
    "num_warps": ("Int64", "RBF launch sweep: Triton warps per program"),
    "num_stages": ("Int64", "RBF launch sweep: Triton pipeline stages"),
    "default_launch": ("boolean", "RBF launch sweep: the launch rbf_kernel_mv picks by "
                                  "default for this problem on this GPU"),
    "num_probes": ("Int64", "GP: probe vectors of the log-determinant and trace estimates"),
    "tol": ("float64", "GP: CG's relative residual tolerance"),
    "preconditioner_rank": ("Int64", "GP: rank of the pivoted-Cholesky preconditioner"),
    "repeat": ("Int64", "repeat index (crossover probe)"),
    "resolution": ("Int64", "image side (NN unet)"),
    "model_dim": ("Int64", "model width (NN suites)"),
    "params": ("Int64", "parameter count (NN suites)"),
    "max_expert_frac": ("float64", "largest expert's share of the routed token copies"),
    "empty_experts": ("Int64", "experts that received no token"),
    # Time.
    "median_ms": ("float64", "median time of one call, ms"),
    "q1_ms": ("float64", "first quartile, ms"),
    "q3_ms": ("float64", "third quartile, ms"),
    "rounds": ("Int64", "timed rounds"),
    "round_ms": ("object", "the time of every round, ms (a tuple; pytest-benchmark stats.data); "
                           "for repeats, the rounds of every repeat, pooled"),
    # One value per case and run (gen/tilax_report/repeats.py).
    "repeats": ("Int64", "timed measurements of this case in this run collapsed into the row "
                         "(0: none timed)"),
    "attempts": ("Int64", "stored rows of this case in this run (any status) collapsed into "
                          "the row"),
    "repeat_min_ms": ("float64", "smallest median among the repeats, ms"),
    "repeat_max_ms": ("float64", "largest median among the repeats, ms"),
    "source_files": ("object", "every file the row's repeats came from (a tuple of names)"),
    "spread_stored": ("boolean", "the row has a spread to judge: per-round times or quartiles "
                                 "of at least two rounds"),
    "run_spread": ("float64", "the case's run-to-run spread on this GPU, as log(max/min) of "
                              "identical-code measurements, never below the floor"),
    "run_spread_basis": ("str", "where run_spread comes from: identical code (n files), floor, "
                                "or none stored"),
    "inner": ("Int64", "calls per timed sample (seed files: inner; pytest-benchmark: iterations)"),
    "steps_per_call": ("Int64", "train steps in one timed call (suite fp8_convergence: "
                                "log_every; missing: one)"),
    "compile_s": ("float64", "first call including compilation, s"),
    "sync_call_s": ("float64", "one warm call and its wait on its own (host latency included: "
                               "the timed rounds queue calls back to back), s"),
    "run_s": ("float64", "wall time of the fresh subprocess (memory ladders), s"),
    # Power (our GPU runs from this column's introduction: nvidia-smi during the timed rounds).
    "power_w": ("float64", "board power during the timed rounds, median of nvidia-smi's samples, "
                           "W (power_field names the reading)"),
    "sm_clock_mhz": ("float64", "SM clock during the timed rounds, median, MHz"),
    "power_limit_w": ("float64", "the GPU's enforced power limit, W"),
    "power_samples": ("Int64", "nvidia-smi samples inside the timed rounds"),
    "power_field": ("str", "nvidia-smi's power reading: power.draw.instant, or power.draw "
                           "(averaged over a second on Hopper)"),
    # Throughput.
    "flops": ("float64", "counted useful FLOPs of one call (pytest-benchmark MoE rows)"),
    "tflops": ("float64", "flops / median / 1e12"),
    "pairs_per_s": ("float64", "RBF kernel pairs per second: n · m · batch / median"),
    "tokens_per_s": ("float64", "tokens per second: tokens / median (suite ep)"),
    "bytes": ("Int64", "bytes that leave each GPU in one trip of the token copies (suite ep "
                       "link and exchange rows); bytes read and written by one copy (suite "
                       "decode, impl copy_bandwidth)"),
    "gbps": ("float64", "bandwidth: bytes / median / 1e9, GB/s (suite ep link rows: the link; "
                        "suite decode copy_bandwidth rows: the GPU's device-to-device copy)"),
    "touched_experts": ("Int64", "experts the batch routes at least one token copy to (suite "
                                 "decode)"),
    "touched_weight_bytes": ("Int64", "bytes of the touched experts' w_gate, w_up and w_down, "
                                      "the router and any shared expert: what a forward must "
                                      "read at least (suite decode)"),
    "touched_weight_gbps": ("float64", "touched_weight_bytes / median / 1e9, GB/s (suite "
                                       "decode)"),
    "evals_per_s": ("float64", "GP: log-likelihood evaluations (with gradient) per second: "
                               "1 / median"),
    "cg_iterations": ("Int64", "GP: CG iterations of the evaluation (the most any column ran)"),
    "steps": ("Int64", "GP fit: optimiser steps run; suite fp8_convergence: train steps of "
                       "the run"),
    "fit_s": ("float64", "GP fit: wall time of the steps, compile included, s"),
    "converged": ("boolean", "GP fit: the stopping rule was met (every hyperparameter within "
                             "10% of the generating one)"),
    # Memory.
    "peak_mb": ("float64", "device peak_bytes_in_use, MiB"),
    "xla_temp_mb": ("float64", "XLA temp buffer size of the compiled call, MiB"),
    "xla_arg_mb": ("float64", "XLA argument size, MiB"),
    "xla_out_mb": ("float64", "XLA output size, MiB"),
    "max_tokens": ("Int64", "largest token count that ran (suite maxtok_summary)"),
    "max_n": ("Int64", "largest n that ran (suite kernel_mv_max_n summary rows)"),
    "summary": ("boolean", "a ladder's summary row (largest size that ran): it times nothing"),
    "limit_ran": ("Int64", "ladder summary: largest size that ran, when the limit is bracketed"),
    "limit_failed": ("Int64", "ladder summary: the size above it that failed"),
    "limit_kind": ("str", "ladder summary: how the limit was found (out of memory, timeout, "
                          "budget, ...)"),
    "max_is_lower_bound": ("boolean", "ladder summary: the largest size is only a lower bound"),
    "stopped_by": ("str", "ladder summary: the error or reason that stopped the ladder"),
    # Numerics.
    "rel_err": ("float64", "RBF forward relative error"),
    "rel_err_dq": ("float64", "RBF gradient relative error, dq"),
    "rel_err_dk": ("float64", "RBF gradient relative error, dk"),
    "rel_err_dv": ("float64", "RBF gradient relative error, dv"),
    "rel_err_dlengthscale": ("float64", "RBF gradient relative error, dlengthscale"),
    "rel_err_out": ("float64", "MoE output relative error"),
    "rel_err_grad_x": ("float64", "MoE input-gradient relative error"),
    "rel_err_grad_params": ("float64", "MoE parameter-gradient relative error"),
    "rel_err_out_vs_one_device": ("float64", "suite ep, step rows on several GPUs: output "
                                             "relative error against the same layer on one "
                                             "device"),
    "mll": ("float64", "GP: the log marginal likelihood computed (float32)"),
    "mll_reference": ("float64", "GP: the float64 dense Cholesky value on the same data"),
    "rel_err_mll": ("float64", "GP: |mll - mll_reference| / |mll_reference|"),
    "rel_err_grad": ("float64", "GP: norm-wise relative error of the gradient with respect "
                                "to the log-hyperparameters, against the float64 dense one"),
    "rel_err_ref": ("str", "what the relative errors compare against"),
    "finite": ("boolean", "outputs were finite (NN suites)"),
    # Training (suite fp8_convergence).
    "loss_curve": ("object", "suite fp8_convergence: the training's loss curve, a tuple of "
                             "(step, mean loss of the steps since the previous point, mean "
                             "floor) tuples"),
    "final_loss": ("float64", "suite fp8_convergence: mean loss of the last tenth of the "
                              "steps"),
    "final_floor": ("float64", "suite fp8_convergence: the loss floor (the teacher's entropy) "
                               "over the same steps"),
    # Outcome.
    "superseded": ("boolean", "a peer's row measured before a later fix of that peer's glue "
                              "(data/provenance/peer-fixes.json): shown, never claimed"),
    "superseded_by": ("str", "the commit whose fix supersedes the row"),
    "status": ("str", "measured, failed (attempted, with the error) or skipped (not attempted, "
                      "with why)"),
    "error": ("str", "failed rows: the error; skipped rows: why it was not attempted"),
    "extra": ("str", "extra_info keys the schema does not know, as JSON, shown as stored and "
                     "never read by the reports (pytest-benchmark)"),
}

COLUMN_NAMES = list(COLUMNS)

# What a row measured (with run and device): the rows of one run that agree on all of these are
# repeats of one case (repeats.py collapses them into one row).
CASE_COLUMNS = [
    "code", "family", "suite", "impl", "dispatch", "routing", "dtype", "op", "piece", "part",
    "exchange", "exchange_chunks", "mesh", "devices", "precision", "profile", "fwd_backend",
    "bwd_backend",
    "tokens", "tokens_per_device", "d_model", "d_hidden", "experts", "top_k", "shared_hidden",
    "skew", "block_m", "recompute", "quantize", "deterministic", "activation", "variant",
    "router", "slab_elems", "n", "m", "dim", "out", "batch", "block_q", "block_k", "block_o",
    "path", "kernel", "block_p", "block_l", "num_warps", "num_stages", "num_probes", "tol",
    "preconditioner_rank", "repeat", "resolution",
    "model_dim", "params", "summary",
]

# Columns whose values are integers (possibly missing); seed files store some as floats.
INTEGER_COLUMNS = [name for name, (dtype, _) in COLUMNS.items() if dtype == "Int64"]


def empty_table() -> pd.DataFrame:
    """A zero-row table with the schema's columns and dtypes."""
    return conform(pd.DataFrame(columns=COLUMN_NAMES))


def conform(frame: pd.DataFrame) -> pd.DataFrame:
    """Return ``frame`` with exactly the schema's columns (missing ones added), in order, typed.

    Raises ``ValueError`` naming the column when a value does not fit its dtype (e.g. 4096.5
    tokens), so a loader bug never turns into a silently wrong table.
    """
    check_columns(frame)
    columns = {}
    for name, (dtype, _) in COLUMNS.items():
        if name not in frame:  # built directly: casting a column of nothing costs the most
            columns[name] = _missing(len(frame), dtype)
            continue
        try:
            columns[name] = _cast(frame[name], dtype).to_numpy() if dtype == "object" else \
                _cast(frame[name], dtype).array
        except (TypeError, ValueError) as exc:
            raise ValueError(f"column {name!r} does not fit dtype {dtype}: {exc}") from exc
    return pd.DataFrame(columns)


def check_columns(frame: pd.DataFrame) -> None:
    """Raise ``ValueError`` naming the columns of ``frame`` that the schema does not have."""
    unknown = sorted(set(frame.columns) - set(COLUMN_NAMES))
    if unknown:
        raise ValueError(f"columns not in the schema: {unknown}")


def _missing(length: int, dtype: str):
    if dtype == "float64":
        return np.full(length, np.nan)
    if dtype == "object":
        return np.full(length, np.nan, dtype=object)
    return pd.array([None] * length, dtype=dtype)


def _cast(column: pd.Series, dtype: str) -> pd.Series:
    if dtype == "Int64":
        numbers = pd.to_numeric(column, errors="raise")
        return numbers.astype("Int64")
    if dtype == "float64":
        return pd.to_numeric(column, errors="raise").astype("float64")
    if dtype == "boolean":
        return column.astype("boolean")
    if dtype == "object":
        return column.astype("object")
    return column.astype("str")
