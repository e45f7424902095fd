"""Standalone GPU timing of the MoE layer (not a pytest module): one call, one table.

Usage on the GPU host, from the repository root::

    PYTHONPATH=src python tests/moe/gpu_timing.py            # everything (~5-8 min on an H200)
    PYTHONPATH=src python tests/moe/gpu_timing.py --sections layer --rounds 20
    PYTHONPATH=src python tests/moe/gpu_timing.py --json moe_timing.json

Sections (``--sections``, comma separated):

- ``layer``: bfloat16, d_model 512, d_hidden 1024, 8 experts, top-2, 32768 tokens: forward and
  train step (``value_and_grad`` w.r.t. params and x) for ``impl="pallas"`` x every dispatch,
  capacity routing, ``ragged_dot``, ``blocked`` and dense routing, with the max relative error
  of the output, ``dx`` and the parameter gradients vs the float32 dense oracle.
- ``decoder``: the fine-grained decoder config (64 experts, top-8, width 128, shared expert
  1024, d_model 512) at 16384 tokens, same rows.
- ``sweep``: the Pallas ``sorted`` and ``fused_gsum`` paths of the ``layer`` config over
  block_m x num_warps x num_stages, to pick the device defaults.

Timing: jit, a warm-up call excluded (its time is reported as compile), every call ends in
``block_until_ready``, median and q1/q3 over ``--rounds`` rounds (>= 10). Rows are printed as
they finish; a failing row prints its error and the run goes on. Only jax, numpy and the stdlib.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

try:
    import tilax
except ImportError:  # run from a checkout without PYTHONPATH=src
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    import tilax
from tilax.moe import api, reference

LAYER = dict(d_model=512, d_hidden=1024, num_experts=8, top_k=2, tokens=32768)
DECODER = dict(d_model=512, d_hidden=128, num_experts=64, top_k=8, shared_hidden=1024,
               tokens=16384)
SMOKE = dict(d_model=32, d_hidden=48, num_experts=4, top_k=2, shared_hidden=16, tokens=100)
DISPATCHES = ("sorted", "gather", "fused", "fused_gsum")
SWEEP = [
    dict(block_m=bm, num_warps=nw, num_stages=ns)
    for bm in (64, 128)
    for nw in (4, 8)
    for ns in (3, 4)
]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)), check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _time(fn, args, rounds):
    """(compile_s, [seconds per round]) of ``fn(*args)``, warm-up excluded."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return compile_s, times


def _stats(times):
    q1, median, q3 = np.percentile(np.asarray(times) * 1e3, [25, 50, 75])
    return float(median), float(q1), float(q3)


def _rel(actual, expected) -> float:
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    return float(np.max(np.abs(actual - expected)) / max(float(np.max(np.abs(expected))), 1e-30))


def _flops(dims, config) -> float:
    """Useful forward FLOPs: routed copies x 3 projections, shared expert, router."""
    tokens, d, h = dims["tokens"], dims["d_model"], dims["d_hidden"]
    copies = tokens * dims["top_k"]
    if config.routing == "capacity":
        capacity = math.ceil(config.capacity_factor * tokens * dims["top_k"] / dims["num_experts"])
        copies = min(copies, capacity * dims["num_experts"])
    shared = dims.get("shared_hidden", 0)
    return 2.0 * (3 * copies * d * h + 3 * tokens * d * shared + tokens * d * dims["num_experts"])


class Bench:
    """Builds inputs and the float32 oracle once per problem and times configurations."""

    def __init__(self, name, dims, rounds, dtype=jnp.bfloat16):
        self.name, self.dims, self.rounds = name, dims, rounds
        self.shape_kwargs = {k: v for k, v in dims.items() if k != "tokens"}
        base = tilax.MoEConfig(**self.shape_kwargs, dtype=dtype)
        self.params = tilax.moe_init(jax.random.key(0), base)
        self.x = jax.random.normal(jax.random.key(1), (dims["tokens"], dims["d_model"]), dtype)
        self.cotangent = jax.random.normal(jax.random.key(2), self.x.shape, jnp.float32)
        self.oracles = {}

    def _train(self, apply):
        cotangent = self.cotangent

        def loss(params, x):
            return jnp.sum(apply(params, x).astype(jnp.float32) * cotangent)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    def oracle(self, config):
        key = (config.routing, config.capacity_factor)
        if key not in self.oracles:
            fwd = jax.jit(lambda p, x: reference.moe_oracle(p, x, config))
            y = np.asarray(fwd(self.params, self.x))
            _, (g_params, g_x) = self._train(lambda p, x: reference.moe_oracle(p, x, config))(
                self.params, self.x
            )
            self.oracles[key] = (y, np.asarray(g_x), jax.tree.map(np.asarray, g_params))
        return self.oracles[key]

    def row(self, label, check=True, **config_kwargs):
        config = tilax.MoEConfig(**self.shape_kwargs, **config_kwargs)
        row = dict(section=self.name, label=label, impl=config.impl, dispatch=config.dispatch,
                   routing=config.routing, tokens=self.dims["tokens"])
        try:
            apply = lambda p, x: tilax.moe_apply(p, x, config)[0]  # noqa: E731
            resolved = api.resolve_impl(config)
            if resolved in ("triton", "interpret"):
                tiles = api.kernel_tiles(config)
                row["tiles"] = (f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k} "
                                f"w{tiles.num_warps} s{tiles.num_stages}")
            fwd = jax.jit(apply)
            train = self._train(apply)
            row["fwd_compile_s"], fwd_times = _time(fwd, (self.params, self.x), self.rounds)
            row["train_compile_s"], train_times = _time(train, (self.params, self.x), self.rounds)
            row["fwd_ms"] = _stats(fwd_times)
            row["train_ms"] = _stats(train_times)
            flops = _flops(self.dims, config)
            row["fwd_tflops"] = flops / (row["fwd_ms"][0] * 1e-3) / 1e12
            row["train_tflops"] = 3 * flops / (row["train_ms"][0] * 1e-3) / 1e12
            if check:
                y_ref, gx_ref, gp_ref = self.oracle(config)
                y = fwd(self.params, self.x)
                _, (g_params, g_x) = train(self.params, self.x)
                row["err_out"] = _rel(y, y_ref)
                row["err_dx"] = _rel(g_x, gx_ref)
                row["err_dparams"] = max(
                    _rel(a, b)
                    for a, b in zip(jax.tree.leaves(g_params), jax.tree.leaves(gp_ref), strict=True)
                )
            _, aux = jax.jit(lambda p, x: tilax.moe_apply(p, x, config))(self.params, self.x)
            row["max_expert_frac"] = float(aux["max_expert_frac"])
            row["dropped_frac"] = float(aux["dropped_frac"])
        except Exception as err:  # a failing row is reported, not fatal
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            traceback.print_exc(limit=2, file=sys.stderr)
        _print_row(row)
        return row


HEADER = (f"{'section':8} {'label':26} {'tiles':18} {'fwd ms (q1-q3)':22} "
          f"{'train ms (q1-q3)':24} {'TF/s tr':>7} {'comp s':>6} {'err out/dx/dW':>22}")


def _print_row(row):
    if "error" in row:
        print(f"{row['section']:8} {row['label']:26} ERROR {row['error']}", flush=True)
        return
    fwd = "{:.3f} ({:.3f}-{:.3f})".format(*row["fwd_ms"])
    train = "{:.3f} ({:.3f}-{:.3f})".format(*row["train_ms"])
    errs = ""
    if "err_out" in row:
        errs = f"{row['err_out']:.1e}/{row['err_dx']:.1e}/{row['err_dparams']:.1e}"
    compile_s = row["fwd_compile_s"] + row["train_compile_s"]
    print(f"{row['section']:8} {row['label']:26} {row.get('tiles', '-'):18} {fwd:22} "
          f"{train:24} {row['train_tflops']:7.1f} {compile_s:6.1f} {errs:>22}", flush=True)


def _problem_rows(bench):
    rows = [bench.row(f"pallas/{d}", impl="pallas", dispatch=d) for d in DISPATCHES]
    rows.append(bench.row("pallas/sorted capacity", impl="pallas", routing="capacity"))
    rows.append(bench.row("ragged_dot", impl="ragged_dot"))
    rows.append(bench.row("blocked", impl="blocked"))
    rows.append(bench.row("dense routing", routing="dense"))
    ragged = next((r for r in rows if r["label"] == "ragged_dot" and "train_ms" in r), None)
    if ragged:
        for r in rows:
            if r["label"].startswith("pallas/") and "train_ms" in r:
                print(f"  {bench.name}: ragged_dot train / {r['label']} train = "
                      f"{ragged['train_ms'][0] / r['train_ms'][0]:.2f}x", flush=True)
    return rows


def _sweep_rows(bench):
    rows = []
    for dispatch in ("sorted", "fused_gsum"):
        for tiles in SWEEP:
            label = f"{dispatch} m{tiles['block_m']} w{tiles['num_warps']} s{tiles['num_stages']}"
            rows.append(bench.row(label, check=False, impl="pallas", dispatch=dispatch, **tiles))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="layer,decoder,sweep")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes and 2 rounds: checks the script itself (CPU is fine)")
    args = parser.parse_args(argv)
    rounds = 2 if args.smoke else max(args.rounds, 10)
    device = jax.devices()[0]
    print(f"tilax {_commit()} | jax {jax.__version__} | {device.device_kind} | "
          f"backend {jax.default_backend()} | cc {getattr(device, 'compute_capability', '-')} | "
          f"rounds {rounds}", flush=True)
    print(HEADER, flush=True)
    rows = []
    sections = args.sections.split(",")
    started = time.perf_counter()
    if "layer" in sections:
        rows += _problem_rows(Bench("layer", SMOKE if args.smoke else LAYER, rounds))
    if "decoder" in sections:
        rows += _problem_rows(Bench("decoder", SMOKE if args.smoke else DECODER, rounds))
    if "sweep" in sections:
        bench = Bench("sweep", SMOKE if args.smoke else LAYER, rounds)
        if args.smoke:
            del SWEEP[2:]
        rows += _sweep_rows(bench)
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": _commit(), "jax": jax.__version__,
                       "device": device.device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
