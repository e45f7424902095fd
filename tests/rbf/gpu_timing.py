"""Time the RBF kernels on a GPU in one run: ``python tests/rbf/gpu_timing.py [--json out.json]``.

Prints (and optionally writes as JSON rows):

1. ``rbf_kernel_mv`` at N = M = 65536, D = 8, O = 16, float32: ``impl="pallas"`` (each precision)
   against ``impl="xla"``, forward and forward+backward, with the speed-up over XLA and the
   relative error vs a float64 reference (forward on the first 2048 queries; gradients on all).
2. ``rbf_kde_density(log=True)`` at the same size, Pallas vs XLA.
3. A sweep of tiles and Triton launch settings (forward: block_q x block_k x num_warps;
   backward: bwd tiles x num_warps x num_stages) so the defaults can be picked from one run.
4. N = M = 1,048,576 forward+backward in a fresh subprocess: peak device memory
   (``memory_stats()["peak_bytes_in_use"]``) and time.

Timing: jit, the first call (compile) timed separately and excluded, one more warm-up call,
then ``--rounds`` timed calls each ending in ``block_until_ready``; median with q1/q3.
Uses only jax, numpy and the standard library (plus tilax from ``src/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import tilax  # noqa: E402
from tilax.rbf import api  # noqa: E402

N_MAIN, DIM, OUT = 65536, 8, 16
N_PEAK = 1 << 20
# Forward (block_q, block_k, num_warps); backward (program tile, loop tile, warps, stages),
# the same for the dq and dk kernels. Chosen from the spill-free Triton 3.6 sm_90 builds.
FWD_SWEEP = [(64, 64, 4), (64, 128, 4), (128, 32, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8),
             (256, 64, 4), (256, 64, 8)]  # fmt: skip
BWD_SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2),
             (128, 64, 8, 3), (128, 128, 8, 2), (256, 32, 8, 2)]  # fmt: skip
# The targets at N = M = 65536, D = 8, O = 16 (float32) and N = M = 2**20.
TARGET_SPEEDUP, TARGET_FWD_MS, TARGET_FWD_BWD_MS, TARGET_PEAK_MB = 8.0, 3.0, 9.7, 1e9 / 2**20


def make_inputs(n, m, dim, out, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (n, dim), dtype)
    k = jax.random.normal(keys[1], (m, dim), dtype)
    v = jax.random.normal(keys[2], (m, out), dtype)
    lengthscale = jnp.linspace(0.8, 1.6, dim, dtype=jnp.float32)
    cotangent = jax.random.normal(keys[3], (n, out), dtype)
    return q, k, v, lengthscale, cotangent


def timed(fn, *args, rounds):
    """(compile_s, [q1, median, q3] ms) of a jitted ``fn`` (warm-up excluded)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - start
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return compile_s, [float(x) * 1e3 for x in np.percentile(times, [25, 50, 75])]


def kernel_mv_fns(**kwargs):
    forward = jax.jit(lambda q, k, v, ls, cot: tilax.rbf_kernel_mv(q, k, v, ls, **kwargs))

    def loss(q, k, v, ls, cot):
        return jnp.sum(tilax.rbf_kernel_mv(q, k, v, ls, **kwargs) * cot)

    return forward, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def config_fns(cfg):
    forward = jax.jit(lambda q, k, v, ls, cot: api.kernel_mv_with_config(q, k, v, ls, cfg))

    def loss(q, k, v, ls, cot):
        return jnp.sum(api.kernel_mv_with_config(q, k, v, ls, cfg) * cot)

    return forward, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def float64_reference(inputs, subset):
    """Forward on the first ``subset`` queries and all four gradients, in float64 (xla path)."""
    q, k, v, ls, cot = inputs
    with jax.enable_x64(True):
        q64, k64, v64, ls64, cot64 = (jnp.asarray(np.asarray(x), jnp.float64) for x in inputs)
        out = tilax.rbf_kernel_mv(q64[:subset], k64, v64, ls64, impl="xla")

        def loss(q, k, v, ls):
            return jnp.sum(tilax.rbf_kernel_mv(q, k, v, ls, impl="xla") * cot64)

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q64, k64, v64, ls64)
        return np.asarray(out), [np.asarray(g) for g in grads]


ROWS: list[dict] = []


def emit(row):
    ROWS.append(row)
    if "error" in row:
        print(f"  {row['label']:<58} ERROR {row['error'][:150]}", flush=True)
        return
    q1, med, q3 = row["q1_ms"], row["median_ms"], row["q3_ms"]
    extra = "".join(
        f"  {key}={row[key]}" for key in ("speedup_vs_xla", "rel_err", "peak_mb") if key in row
    )
    print(
        f"  {row['label']:<58} {med:9.3f} ms  [q1 {q1:.3f}, q3 {q3:.3f}]  "
        f"compile {row['compile_s']:.1f}s{extra}",
        flush=True,
    )


def run_case(label, fn, args, rounds, **info):
    try:
        compile_s, (q1, med, q3) = timed(fn, *args, rounds=rounds)
    except Exception as err:  # a failing config is a row, not a crash
        emit(dict(label=label, error=f"{type(err).__name__}: {err}", **info))
        return None
    row = dict(label=label, compile_s=compile_s, q1_ms=q1, median_ms=med, q3_ms=q3,
               rounds=rounds, **info)  # fmt: skip
    pairs = info.get("n", 0) * info.get("m", 0) * info.get("batch", 1)
    if pairs:
        row["pairs_per_s"] = pairs / (med * 1e-3)
    return row


def main_comparison(n, rounds, reference):
    print(f"\n== rbf_kernel_mv N=M={n} D={DIM} O={OUT} float32 ==")
    inputs = make_inputs(n, n, DIM, OUT)
    subset = min(n, 2048)
    ref = float64_reference(inputs, subset) if reference else None
    shape = dict(family="rbf", suite="kernel_mv", n=n, m=n, dim=DIM, out=OUT, batch=1,
                 dtype="float32")  # fmt: skip
    xla_ms = {}
    # precision None is "default" (the same kernels), so it is timed once.
    runs = [("xla", None)] + [("pallas", p) for p in (None, "high", "highest")]
    for impl, precision in runs:
        forward, forward_backward = kernel_mv_fns(impl=impl, precision=precision)
        for op, fn in (("fwd", forward), ("fwd_bwd", forward_backward)):
            label = f"{impl:<6} precision={precision!s:<8} {op}"
            row = run_case(label, fn, inputs, rounds, impl=impl, op=op, precision=precision,
                           **shape)  # fmt: skip
            if row is None:
                continue
            if impl == "xla":
                xla_ms[op] = row["median_ms"]
            elif op in xla_ms:
                row["speedup_vs_xla"] = round(xla_ms[op] / row["median_ms"], 2)
            if ref is not None:
                result = fn(*inputs)
                if op == "fwd":
                    row["rel_err"] = float(f"{rel(result[:subset], ref[0]):.3g}")
                else:
                    row["rel_err"] = grad_errors(result, ref)
            emit(row)


def kde_comparison(n, rounds):
    print(f"\n== rbf_kde_density(log=True) N=M={n} D={DIM} float32 ==")
    query, data, _, _, _ = make_inputs(n, n, DIM, 1)
    cot = jnp.ones((n,), jnp.float32)
    xla_ms = {}
    for impl in ("xla", "pallas"):
        def log_density(q, d, h, c, impl=impl):
            return tilax.rbf_kde_density(q, d, h, log=True, impl=impl)

        forward = jax.jit(log_density)

        def loss(q, d, h, c, impl=impl):
            return jnp.sum(tilax.rbf_kde_density(q, d, h, log=True, impl=impl) * c)

        forward_backward = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        for op, fn in (("fwd", forward), ("fwd_bwd", forward_backward)):
            row = run_case(f"{impl:<6} {op}", fn, (query, data, jnp.float32(0.5), cot), rounds,
                           family="rbf", suite="kde_density", impl=impl, op=op, n=n, m=n,
                           dim=DIM, batch=1, dtype="float32")  # fmt: skip
            if row is None:
                continue
            if impl == "xla":
                xla_ms[op] = row["median_ms"]
            elif op in xla_ms:
                row["speedup_vs_xla"] = round(xla_ms[op] / row["median_ms"], 2)
            emit(row)


def sweep(n, rounds):
    print(f"\n== tile sweep, rbf_kernel_mv pallas precision=None N=M={n} D={DIM} O={OUT} ==")
    inputs = make_inputs(n, n, DIM, OUT)
    backend = "triton" if jax.default_backend() == "gpu" else "interpret"
    base = api.default_config(backend, None, batch=1, n=n, m=n, out=OUT)
    print(f"  defaults: {base}")
    info = dict(family="rbf", suite="kernel_mv_tiles", impl="pallas", precision=None,
                n=n, m=n, dim=DIM, out=OUT, batch=1, dtype="float32")  # fmt: skip
    # Forward: tiles x warps (stages stay at the default).
    for block_q, block_k, warps in FWD_SWEEP:
        fwd = api.Launch(block_q, block_k, num_warps=warps, num_stages=base.fwd.num_stages)
        forward, _ = config_fns(dataclasses.replace(base, fwd=fwd))
        label = f"fwd     block_q={block_q:<3} block_k={block_k:<3} warps={warps}"
        row = run_case(label, forward, inputs, rounds, op="fwd", block_q=block_q,
                       block_k=block_k, num_warps=warps, **info)  # fmt: skip
        if row is not None:
            emit(row)
    # Backward (timed as fwd+bwd with the default forward): the same program x loop tiles,
    # warps and stages for the dq kernel (programs over queries) and the dk kernel (over keys).
    for block_p, block_l, warps, stages in BWD_SWEEP:
        launch = api.Launch(block_p, block_l, num_warps=warps, num_stages=stages)
        _, forward_backward = config_fns(dataclasses.replace(base, dq=launch, dk=launch))
        label = f"fwd_bwd bwd program={block_p:<3} loop={block_l:<3} warps={warps} stages={stages}"
        row = run_case(label, forward_backward, inputs, rounds, op="fwd_bwd",
                       bwd_block_program=block_p, bwd_block_loop=block_l, num_warps=warps,
                       num_stages=stages, **info)  # fmt: skip
        if row is not None:
            emit(row)


def grad_errors(result, ref):
    names = ("dq", "dk", "dv", "dlengthscale")
    return {n: float(f"{rel(g, r):.3g}") for n, g, r in zip(names, result[1], ref[1], strict=True)}


def peak_child(n, impl):
    """Runs in a fresh process: one fwd+bwd at size n; prints a JSON line."""
    inputs = make_inputs(n, n, DIM, OUT)
    _, forward_backward = kernel_mv_fns(impl=impl)
    compile_s, (q1, med, q3) = timed(forward_backward, *inputs, rounds=3)
    stats = jax.devices()[0].memory_stats() or {}
    print(json.dumps(dict(compile_s=compile_s, q1_ms=q1, median_ms=med, q3_ms=q3,
                          peak_bytes=stats.get("peak_bytes_in_use"))))  # fmt: skip


def peak_memory(n, impl, timeout):
    print(f"\n== {impl} fwd+bwd N=M={n} D={DIM} O={OUT}: peak memory (fresh subprocess) ==")
    cmd = [sys.executable, __file__, "--child-peak", str(n), "--child-impl", impl]
    info = dict(family="rbf", suite="kernel_mv_peak", impl=impl, op="fwd_bwd", n=n, m=n,
                dim=DIM, out=OUT, batch=1, dtype="float32", label=f"{impl} fwd_bwd n={n}")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
    except subprocess.TimeoutExpired:
        emit(dict(info, error=f"timeout after {timeout} s"))
        return
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        emit(dict(info, error=(done.stderr.strip().splitlines() or ["no output"])[-1]))
        return
    result = json.loads(lines[-1])
    peak = result.pop("peak_bytes")
    row = dict(info, rounds=3, **result)
    if peak is not None:
        row["peak_mb"] = round(peak / 2**20, 1)
    emit(row)


def summary():
    """One line per target of the issue, from the rows measured above (default precision)."""
    print("\n== targets (pallas, precision=None, vs xla in this process) ==")

    def find(suite, impl, op):
        for row in ROWS:
            if (row.get("suite"), row.get("impl"), row.get("op")) == (suite, impl, op) and (
                row.get("precision") is None
            ):
                return row
        return None

    for op, limit in (("fwd", TARGET_FWD_MS), ("fwd_bwd", TARGET_FWD_BWD_MS)):
        row = find("kernel_mv", "pallas", op)
        if row is None or "error" in row:
            print(f"  {op:<8} no measurement")
            continue
        speedup = row.get("speedup_vs_xla", float("nan"))
        ok = speedup >= TARGET_SPEEDUP and row["median_ms"] <= limit
        print(f"  {op:<8} {row['median_ms']:.3f} ms (target <= {limit} ms), {speedup}x vs xla "
              f"(target >= {TARGET_SPEEDUP}x): {'PASS' if ok else 'FAIL'}")
    row = find("kernel_mv_peak", "pallas", "fwd_bwd")
    if row is None or "peak_mb" not in row:
        print("  peak     no measurement", (row or {}).get("error", ""))
    else:
        ok = row["peak_mb"] < TARGET_PEAK_MB
        print(f"  peak     {row['peak_mb']} MiB at N=M={row['n']} (target < 1 GB = "
              f"{TARGET_PEAK_MB:.0f} MiB): {'PASS' if ok else 'FAIL'}")


def environment():
    device = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=ROOT).stdout.strip()  # fmt: skip
    except OSError:
        commit = ""
    return dict(jax=jax.__version__, device=str(device), device_kind=device.device_kind,
                sm_count=getattr(device, "core_count", None), commit=commit)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per case")
    parser.add_argument("--n", type=int, default=N_MAIN, help="N = M of the comparisons")
    parser.add_argument("--peak-n", type=int, default=N_PEAK, help="N = M of the memory run")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-reference", action="store_true", help="skip float64 errors")
    parser.add_argument("--peak-timeout", type=int, default=900)
    parser.add_argument("--json", help="also write every row to this JSON file")
    parser.add_argument("--child-peak", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-impl", default="pallas", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_peak:
        peak_child(args.child_peak, args.child_impl)
        return
    env = environment()
    print("environment:", env)
    if jax.default_backend() != "gpu":
        print("warning: no GPU; Pallas runs in interpret mode and these sizes will take forever")
    main_comparison(args.n, args.rounds, reference=not args.no_reference)
    kde_comparison(args.n, args.rounds)
    peak_memory(args.peak_n, "pallas", args.peak_timeout)
    summary()
    if not args.no_sweep:
        sweep(args.n, max(5, args.rounds // 2))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(environment=env, rows=ROWS), indent=1))
        print(f"\nwrote {len(ROWS)} rows to {args.json}")


if __name__ == "__main__":
    main()
