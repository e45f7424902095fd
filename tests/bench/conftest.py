"""tilax benchmark suite (pytest-benchmark): usage, modes, suites and the rows it writes.

Run on a GPU::

    nox -s bench                                   # full run, all suites
    nox -s bench -- --bench-suite moe              # MoE suites only
    nox -s bench -- --bench-quick                  # quick mode (every suite, small)
    TILAX_BENCH_SUITES=rbf nox -s bench            # the same through the environment

``nox -s bench`` writes ``data/results/<gpu>-<yyyymmdd>-<shortcommit>[-<tag>].json`` (tag: the
suites and mode when not a full run of everything; ``TILAX_BENCH_OUT`` picks another folder)
and a side file ``<same name>.rows.jsonl`` beside it. On an offline GPU host with JAX already
installed use the same options with the host's Python (``nox --no-venv -s bench -- ...``, or
plainly)::

    OUT_JSON=$(python tests/bench/bench_naming.py --dir "$OUT" --tag moe)
    PYTHONPATH=src python -m pytest tests/bench -p no:cacheprovider -q \\
        --bench-suite moe --benchmark-json "$OUT_JSON"

Extra wheels (tokamax 0.0.17 and its pure-Python needs, pykeops, keopscore) come from
``nox -s wheelhouse`` (``.wheelhouse/``); on the host::

    pip install --no-index --no-deps --target /tmp/site .wheelhouse/*.whl
    export PYTHONPATH=src:/tmp/site

tokamax's import wants xprof, which ``tokamax.ragged_dot`` never uses; ``bench_tokamax`` stands
in for the one xprof module it imports when xprof is missing. The PyTorch peer
(``bench_torch_moe``) uses the host's torch. A copy of the tree without git history names its
commit with ``TILAX_BENCH_COMMIT=$(python tests/bench/bench_naming.py --commit)``, run where the
history is: results are filed under the last commit that changed ``src/`` or ``tests/bench/``,
so every file made from one code state, in any number of calls, belongs to one run.

Options (each also read from the environment variable in brackets):

- ``--bench-suite NAME`` [``TILAX_BENCH_SUITES``, comma separated]: repeatable; suite names
  ``layer decoder pieces blockm maxtok kernel_mv kde_density kernel_mv_tiles
  kernel_mv_launches kernel_mv_peak kernel_mv_max_n gp gp_fit gp_rank ep guide_gp``, short names
  ``kde tiles launches peak max_n``, groups ``moe rbf ladders all`` (``ep``, on every local
  GPU, ``gp_fit``, ``gp_rank`` and ``guide_gp`` only by name: they are in no group).
- ``--bench-mode smoke|quick|full|auto`` [``TILAX_BENCH_MODE``], or ``--bench-quick`` /
  ``--bench-smoke``. ``auto`` (default): full on a GPU when the run asks for results
  (``--benchmark-json``) or suites (``--bench-suite``), smoke otherwise (so a plain
  ``pytest`` smoke-tests this code, on CPU or GPU).
- ``--bench-budget SECONDS`` [``TILAX_BENCH_BUDGET``]: wall-clock budget of the session (full
  480 s, quick 240 s), split among the selected suites (see *Budget and order* below). Rows
  that would start after their suite's time are stored as failure rows (``skipped: not
  attempted, the run's time budget ... was spent``), so a GPU call never runs past its limit
  and says what it left out.
- ``--bench-row-limit SECONDS`` [``TILAX_BENCH_ROW_LIMIT``]: the most one in-process row may
  take, predicted from the last size of its config (full 20 s, quick 10 s); rows predicted
  slower are skipped. Raise it for a call of only the largest sizes (``-k n1048576``). The
  launch sweep's rows have a limit of their own (8 s, or this one if lower) that also caps
  their timed rounds (see ``bench_harness``).
- ``--bench-rows PATH``: the JSON-lines side file (default: beside ``--benchmark-json``).

Modes: ``smoke`` (CPU, Pallas interpret mode: tiny shapes, 1-2 rounds, ladders of two tiny
steps, missing peers as failure rows; runs inside ``nox -s tests`` so this code cannot rot
unseen; about a minute on 2 cores), ``quick`` (every suite at one or two realistic sizes),
``full`` (the grids of the seed files, see ``bench_moe`` and ``bench_rbf``).

Budget and order: each selected suite is given a share of ``--bench-budget`` in proportion to
``SUITE_WEIGHTS`` (the minutes column below: maxtok 3, layer 10, decoder 6, pieces 0.5, blockm
0.5, variants 3, decode 4, kernel_mv_max_n 1.5, kernel_mv_peak 1.5, kernel_mv 4, kde_density
0.7, kernel_mv_tiles 0.5, kernel_mv_launches 5, ep 3). A suite's share is reserved for it until
its last row has run; a row may use its own suite's share plus whatever no other suite is still owed
(shares of finished suites, time they left unused), so the run stays within the budget and no
suite starves another. Rows run by priority: the ladders first (priority 0, while the
parent's memory pool is small; each ladder searches within an even part of its suite's share,
its first size always runs), then the headline comparisons (kernel_mv (8, 16) at every n, layer
32k/131k bf16+fp32 forward and train step for every impl, pieces and blockm at 32k bf16,
decoder 16k/131k), then the rest (the launch sweep nearest its defaults first: see
``bench_rbf.launch_cases``).
On the H200 (steps 12-22 s each) a ladder's share rarely brackets every limit in a combined
run: run ``--bench-suite maxtok`` (or ``max_n``) alone for exact brackets; a summary row says
whether its ``max_tokens``/``max_n`` is bracketed or a lower bound.

Estimated wall time on one H200 (compile time dominates most rows, about 1-3 s each; ladder
steps cost a fresh interpreter, 12-22 s each on the H200).

===============  =========================================================  ====  =======
suite            full grid (rows)                                           rows  minutes
===============  =========================================================  ====  =======
maxtok           8 ladders (7 impls, and pallas with recompute=True), bf16     ~45   ~11
                 train step, 131k..32M tokens (powers of two); jumps to the
                 largest size predicted to fit, then bisects
layer            11 impls x 32k/131k x fp32/bf16 x fwd/train (first; peers   148   ~11
                 bf16 only), then triton and mosaic (4 dispatches)
                 bf16, 5 impls at 4k, E64 top4 h256, skew 0.9
decoder          14 impl x dispatch x 16k/131k/1M x fwd/train, bf16         84    ~8
pieces           4 pieces x 4k/32k x fp32/bf16 (32k bf16 first)             16    ~0.3
blockm           block_m 32/64/128 x 32k x fp32/bf16 x fwd/train            12    ~0.4
decode           bf16 forward at 1/4/16/64/256/512 tokens, E128 top-8 d2048  98    ~6
                 h768 and E8 top-2 d4096 h14336: auto, decode, triton,
                 mosaic, ragged_dot, tokamax, torch eager and compiled; the
                 copy bandwidth (1 GiB buffer) first and last
moe              all seven (``--bench-suite moe``)                          ~361  ~26
kernel_mv_max_n  pallas/xla/dense fwd_bwd d8 o16, 64k..8M (jumping)         ~10   ~1.5
kernel_mv_peak   pallas/xla/dense x 4k/64k x fwd/fwd_bwd, subprocess each   12    ~1.5
kernel_mv        5 impls x n 1k..1M x (dim, out) x fwd/fwd_bwd; (8, 16) at  224   ~4
                 every n first; 262k and 1M only (8, 16) and (3, 1), and
                 only the matrix-free impls (pallas, xla, keops); plus the
                 precisions (high/highest at d8 o16, all at d20 o100) and
                 kernel_mv's Matérn kernels (pallas, 64k d8 o16, default
                 and highest, beside the Gaussian rows)
kde_density      3 impls x 1k/16k/64k x dim 2/8 x fwd/fwd_bwd               36    ~0.7
kernel_mv_tiles  6 tiles x 64k x out 1/16 x fwd/fwd_bwd                     24    ~0.5
kernel_mv_       Pallas launches (block_p x block_l x warps x stages) at    91    ~5
launches         64k d8 o16, each kernel family apart: fast fwd 36, fast
                 bwd 16 + 2 Mosaic GPU sweeps (fwd_bwd), exact
                 (``"highest"``) fwd 18, exact bwd 18 + 1 Mosaic GPU
                 sweep; each family's default launch first, then its
                 neighbours by distance
rbf              all six (``--bench-suite rbf``)                            ~370  ~13
quick            every suite at one or two sizes (``--bench-quick``)        ~64   ~3
ep               expert parallelism on n local GPUs (``bench_ep``): E8 top2   44    ~5
                 d512 h1024 and E64 top8 w128 + shared 1024, bf16 train      (2 GPUs)
                 step, 1 GPU at T and n GPUs at n*T tokens (T 65k, 131k;
                 n every count from 2 to the host's that divides the
                 experts), all_gather (also in 2 and 4 chunks) and
                 all_to_all exchange, the exchange alone, and the links (a
                 plain all-to-all and all-gather of the same bytes) first
guide_gp         the kernel-sums guide's Gaussian-process lengthscale step,  1     ~1
                 run as the page runs it (``bench_guides``; by name only)
gp               ``tilax.gp.mll`` + gradient at n 16k/65k/262k/1M, D 8      16    ~6
                 (``bench_gp``), beside GPyTorch + KeOps, tinygp and the
                 dense Cholesky reference where they fit; in ``all``
gp_fit           Adam on the MLL at 1M points until the hyperparameters     1     ~8
                 are within 10% of the generating ones (by name only)
gp_rank          ``tilax.gp.mll`` at preconditioner ranks 50..1600, 65k and  12    ~5
                 262k points (by name only)
fp8_convergence  a small MoE language model trained twice, bf16 and          2     ~3
                 ``quantize="fp8"``, same seeds and data, 1000 steps; the
                 loss curves in extra_info, then one step timed
                 (``bench_fp8_convergence``; by name only; estimated)
===============  =========================================================  ====  =======

Measured on the H200 (commit 4cab2a4): the layer suite's 32k and 4k rows took 185 s, its 131k,
E64 and skew rows 388 s, the decoder's 16k and 131k rows 221 s. A run of everything is longer
than one 10-minute GPU call, so split it: one suite, or part of one chosen with pytest's ``-k``
on the row ids, per call, each into its own file (``--tag`` names the part), with a budget that
the part fits well inside, so that no row is left as a budget skip::

    --bench-suite layer -k "(T32768 and E8k2 and not skew) or T4096"    # ~3 min
    --bench-suite layer -k "not ((T32768 and E8k2 and not skew) or T4096)"  # ~6.5 min
    --bench-suite decoder -k "T16384 or T131072"                        # ~4 min
    --bench-suite decoder -k T1048576
    --bench-suite decode -k "E128k8 or copy_bandwidth"                  # ~3 min
    --bench-suite decode -k "E8k2 or copy_bandwidth"                    # ~3 min
    --bench-suite launches                          # ~5 min (budget 450: one call)
    --bench-suite launches -k fast                  # or in two parts: ~2.5 min
    --bench-suite launches -k exact                 # ~2 min (more if many launches spill)
    --bench-suite gp -k "n16384 or n65536" --bench-row-limit 300   # then n262144, n1048576
    --bench-suite gp_fit --bench-budget 560         # the fit stops itself after 480 s

The files of one commit on one GPU are one run on the report site; ``bench_rows.py merge``
can still join files into one.

Rows: one pytest-benchmark benchmark per (suite, impl, dispatch, routing, dtype, shape, op),
``extra_info`` per the contract in ``bench_rows`` (family, suite, impl, dtype, op, compile_s,
shapes, TFLOP/s or pairs/s, numerics, router stats, peak_mb; ``error`` on failure rows, whose
stats are of a no-op and must be ignored). Each finished row is appended at once to the side
file; if a run dies before pytest-benchmark writes its JSON::

    python tests/bench/bench_rows.py convert OUT.json OUT.rows.jsonl

Timing: the first call (compile included) is timed alone as ``compile_s``, a second call warms
up (its time is stored as ``sync_call_s``), a probe of queued calls sizes the rounds; then
``benchmark.pedantic`` with 3-10 rounds of calls queued back to back (about 50 ms of them, 1 to
50 ``iterations``), the last call of each round ending in ``block_until_ready``. The
parent process runs with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (set here unless already set)
so the ladder subprocesses and torch can use the rest of the device.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from pathlib import Path  # noqa: E402

import bench_ep  # noqa: E402
import bench_fp8_convergence  # noqa: E402
import bench_gp  # noqa: E402
import bench_guides  # noqa: E402
import bench_moe  # noqa: E402
import bench_rbf  # noqa: E402
import pytest  # noqa: E402
from bench_harness import (  # noqa: E402
    Runner,
    Settings,
    State,
    split_budget,
    suite_of,
    with_external_timings,
)
from bench_ladder import LadderStep, ladder_steps  # noqa: E402
from bench_naming import short_commit  # noqa: E402
from bench_provenance import provenance  # noqa: E402
from bench_rows import append_row, check_extra_info, write_header  # noqa: E402

MOE_SUITES = ("layer", "decoder", "pieces", "blockm", "maxtok", "variants", "decode")
RBF_SUITES = ("kernel_mv", "kde_density", "kernel_mv_tiles", "kernel_mv_launches",
              "kernel_mv_peak", "kernel_mv_max_n")
# Gaussian processes (``bench_gp``): gp in ``all``; the million-point fit (it takes most of a
# device call by itself) and the preconditioner-rank sweep by name only.
GP_SUITES = ("gp",)
GP_BY_NAME = ("gp_fit", "gp_rank")
# Multi-device suites: asked for by name only (their rows need every local GPU; a one-GPU
# run stores them as "unavailable" rows).
MULTI_DEVICE_SUITES = ("ep",)
# Guide timings (``bench_guides``): asked for by name only, like the multi-device suites.
GUIDE_SUITES = ("guide_gp",)
# Training runs (``bench_fp8_convergence``): asked for by name only.
CONVERGENCE_SUITES = ("fp8_convergence",)
BY_NAME = (MOE_SUITES + RBF_SUITES + GP_SUITES + GP_BY_NAME + MULTI_DEVICE_SUITES
           + GUIDE_SUITES + CONVERGENCE_SUITES)
SUITE_GROUPS = {
    "all": MOE_SUITES + RBF_SUITES + GP_SUITES,
    "moe": MOE_SUITES,
    "rbf": RBF_SUITES,
    "ladders": ("maxtok", "kernel_mv_peak", "kernel_mv_max_n"),
    "kde": ("kde_density",),
    "tiles": ("kernel_mv_tiles",),
    "launches": ("kernel_mv_launches",),
    "peak": ("kernel_mv_peak",),
    "max_n": ("kernel_mv_max_n",),
    "maxtok_summary": ("maxtok",),
}
MODE_SETTINGS = {
    # budget, per-row limit, timed seconds per row, min rounds, max rounds, ladder step limit
    "smoke": dict(budget_s=1800, row_limit_s=120, target_time_s=0.0, min_rounds=1, max_rounds=2,
                  step_timeout_s=240),
    "quick": dict(budget_s=240, row_limit_s=10, target_time_s=0.3, min_rounds=3, max_rounds=5,
                  step_timeout_s=40),
    "full": dict(budget_s=480, row_limit_s=20, target_time_s=1.0, min_rounds=3, max_rounds=10,
                 step_timeout_s=60),
}
# Each suite's share of the budget, in proportion to its estimated full-run minutes (the table
# in the module docstring); a share is reserved for its suite until the suite's last row ran.
SUITE_WEIGHTS = {
    "maxtok": 3.0, "layer": 10.0, "decoder": 6.0, "pieces": 0.5, "blockm": 0.5, "variants": 3.0,
    "decode": 4.0,
    "kernel_mv_max_n": 1.5, "kernel_mv_peak": 1.5, "kernel_mv": 4.0, "kde_density": 0.7,
    "kernel_mv_tiles": 0.5, "kernel_mv_launches": 5.0, "ep": 3.0, "gp": 6.0, "gp_fit": 8.0,
    "gp_rank": 5.0,
}
STATE = pytest.StashKey[State]()
ROWS = pytest.StashKey[Path | None]()
FINISHED = pytest.StashKey[list]()


def pytest_addoption(parser):
    group = parser.getgroup("tilax-bench", "tilax benchmark suite (tests/bench)")
    group.addoption("--bench-suite", action="append", default=None,
                    help="suite or group to run (repeatable, comma separated); default all")
    group.addoption("--bench-mode", default=None, choices=("auto", "smoke", "quick", "full"))
    group.addoption("--bench-quick", action="store_true", help="quick mode")
    group.addoption("--bench-smoke", action="store_true", help="smoke mode (tiny, any device)")
    group.addoption("--bench-budget", type=float, default=None,
                    help="wall-clock budget of the session in seconds")
    group.addoption("--bench-row-limit", type=float, default=None,
                    help="most seconds one row may take (predicted); default per mode")
    group.addoption("--bench-rows", default=None, help="JSON-lines side file of finished rows")


def resolve_mode(config) -> str:
    if config.getoption("bench_smoke"):
        return "smoke"
    if config.getoption("bench_quick"):
        return "quick"
    mode = config.getoption("bench_mode") or os.environ.get("TILAX_BENCH_MODE") or "auto"
    if mode != "auto":
        return mode
    import jax

    # A plain `pytest` on a GPU host smoke-tests this code; a run that asks for results or
    # suites is the real thing.
    asked = (config.getoption("benchmark_json", None) is not None
             or config.getoption("bench_suite") or os.environ.get("TILAX_BENCH_SUITES"))
    return "full" if jax.default_backend() != "cpu" and asked else "smoke"


def resolve_suites(config) -> frozenset[str]:
    names = config.getoption("bench_suite") or [os.environ.get("TILAX_BENCH_SUITES") or "all"]
    suites: set[str] = set()
    for name in ",".join(names).split(","):
        name = name.strip()
        if not name:
            continue
        if name in SUITE_GROUPS:
            suites.update(SUITE_GROUPS[name])
        elif name in BY_NAME:
            suites.add(name)
        else:
            known = sorted(set(SUITE_GROUPS) | set(BY_NAME))
            raise pytest.UsageError(
                f"--bench-suite: unknown suite {name!r}; known: {', '.join(known)}")
    return frozenset(suites)


def _device_bytes() -> int | None:
    import jax

    if jax.default_backend() == "cpu":
        return None
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "bench_suite(name): a tests/bench benchmark of the named suite")
    mode = resolve_mode(config)
    values = dict(MODE_SETTINGS[mode])
    budget = config.getoption("bench_budget") or os.environ.get("TILAX_BENCH_BUDGET")
    if budget:
        values["budget_s"] = float(budget)
    row_limit = config.getoption("bench_row_limit") or os.environ.get("TILAX_BENCH_ROW_LIMIT")
    if row_limit:
        values["row_limit_s"] = float(row_limit)
    settings = Settings(mode=mode, suites=resolve_suites(config), **values)
    config.stash[STATE] = State(settings, device_bytes=_device_bytes())
    rows = config.getoption("bench_rows")
    if rows is None:
        json_file = config.getoption("benchmark_json", None)  # a Path (v5) or an open file (v4)
        name = json_file if isinstance(json_file, (str, Path)) else getattr(json_file, "name", None)
        if name and not str(name).startswith("<"):
            rows = str(Path(name).with_suffix("")) + ".rows.jsonl"
    config.stash[ROWS] = Path(rows) if rows else None
    config.stash[FINISHED] = []


def pytest_benchmark_update_machine_info(config, machine_info):
    from bench_env import environment_info

    machine_info.update(environment_info())
    settings = config.stash[STATE].settings
    machine_info["bench_mode"] = settings.mode
    machine_info["bench_suites"] = sorted(settings.suites)
    machine_info["bench_budget_s"] = settings.budget_s
    # the part of the suites this file holds when a run is split over calls with -k
    machine_info["bench_part"] = config.getoption("keyword") or None
    machine_info["tilax_provenance"] = provenance(short_commit())


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Rows timed in a child process (ladders) get the child's timings as their stats."""
    output_json["benchmarks"] = [with_external_timings(row) for row in output_json["benchmarks"]]


def pytest_benchmark_update_commit_info(config, commit_info):
    from bench_naming import declared_commit_info

    declared = declared_commit_info(dict(commit_info), os.environ.get("TILAX_BENCH_COMMIT"))
    commit_info.clear()
    commit_info.update(declared)


def pytest_sessionstart(session):
    rows = session.config.stash.get(ROWS, None)
    if rows is None:
        return
    config = session.config
    machine_info = config.hook.pytest_benchmark_generate_machine_info(config=config)
    config.hook.pytest_benchmark_update_machine_info(config=config, machine_info=machine_info)
    commit_info = config.hook.pytest_benchmark_generate_commit_info(config=config)
    config.hook.pytest_benchmark_update_commit_info(config=config, commit_info=commit_info)
    write_header(rows, machine_info, commit_info)


def suite_params(suite: str, mode: str) -> list:
    if suite == "maxtok":
        return [step for template, sizes in bench_moe.maxtok_ladders(mode)
                for step in ladder_steps(template, sizes, "tokens")]
    if suite == "kernel_mv_max_n":
        return [step for template, sizes in bench_rbf.max_n_ladders(mode)
                for step in ladder_steps(template, sizes, "n")]
    if suite == "kernel_mv_peak":
        return [step for case in bench_rbf.peak_cases(mode)  # one independent step each
                for step in ladder_steps(case, [case.n], "n", summary=False, name=case.id)]
    if suite in MOE_SUITES:
        return bench_moe.suite_cases(suite, mode)
    if suite in MULTI_DEVICE_SUITES:
        return bench_ep.suite_cases(suite, mode)
    if suite in GUIDE_SUITES:
        return bench_guides.suite_cases(suite, mode)
    if suite in CONVERGENCE_SUITES:
        return bench_fp8_convergence.suite_cases(suite, mode)
    if suite in GP_SUITES + GP_BY_NAME:
        return bench_gp.suite_cases(suite, mode)
    return bench_rbf.suite_cases(suite, mode)


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("bench_suite")
    if marker is None or "case" not in metafunc.fixturenames:
        return
    suite = marker.args[0]
    settings = metafunc.config.stash[STATE].settings
    cases = suite_params(suite, settings.mode) if suite in settings.suites else []
    metafunc.parametrize("case", cases, ids=[case.id for case in cases])


def pytest_collection_modifyitems(session, config, items):
    """Drop unselected suites; run bench rows by priority (ladders first, then the headline
    comparisons). The other tests of tests/bench (the harness's unit tests) run only in smoke
    mode, where they stay first: a quick or full run times rows and nothing else."""
    bench, other, dropped = [], [], []
    mode = config.stash[STATE].settings.mode
    for item in items:
        if item.get_closest_marker("bench_suite") is None:
            # (a GPU run would spend its budget's minutes on them; it checks each of its own
            # rows as it finishes instead of test_bench_contract's smoke run)
            (other if mode == "smoke" else dropped).append(item)
            continue
        elif benchmarks_disabled(config):
            # pytest-benchmark times nothing here (it turns itself off in xdist workers), and
            # a row needs its stats: test_bench_contract runs these rows in a plain pytest
            dropped.append(item)
            continue
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        (bench if hasattr(case, "priority") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    bench.sort(key=lambda item: item.callspec.params["case"].priority)
    items[:] = other + bench


def benchmarks_disabled(config) -> bool:
    """Whether pytest-benchmark is off in this process: ``--benchmark-disable``, or an xdist
    worker (``PYTEST_XDIST_WORKER``, where pytest-benchmark disables itself)."""
    return bool(config.getoption("benchmark_disable")) or "PYTEST_XDIST_WORKER" in os.environ


def pytest_collection_finish(session):
    """Split the budget among the suites of the rows that will run (after every deselection)."""
    state = session.config.stash[STATE]
    plan = state.budget
    for item in session.items:
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        suite = suite_of(case) if hasattr(case, "priority") else None
        if suite is None:
            continue
        plan.rows_left[suite] = plan.rows_left.get(suite, 0) + 1
        if isinstance(case, LadderStep):
            plan.ladders_left.setdefault(suite, set()).add(case.ladder)
    weights = {suite: SUITE_WEIGHTS.get(suite, 1.0) for suite in plan.rows_left}
    plan.shares = split_budget(state.settings.budget_s, weights)


@pytest.fixture
def bench(benchmark, request):
    """The runner of one benchmark row; on teardown the row is appended to the side file and
    checked against the extra_info contract."""
    state = request.config.stash[STATE]
    runner = Runner(benchmark, state)
    started = state.settings.elapsed()
    yield runner
    case = request.node.callspec.params.get("case")
    state.budget.finished(suite_of(case), state.settings.elapsed() - started)
    if benchmark.stats is None:
        return
    row = with_external_timings(benchmark.stats.as_dict(include_data=False))
    request.config.stash[FINISHED].append(row)
    rows = request.config.stash[ROWS]
    if rows is not None:
        append_row(rows, row)
    problems = check_extra_info(row["extra_info"])
    assert not problems, f"extra_info breaks the contract: {problems}"


def _failure_kind(error: str) -> str:
    if error.startswith("skipped: not attempted, the run's time budget"):
        return "budget spent"
    if error.startswith("skipped:"):
        return "predicted (not attempted)"
    if error.startswith(("unavailable:", "unsupported:")):
        return "unavailable/unsupported"
    if "RESOURCE_EXHAUSTED" in error or "out of memory" in error.lower():
        return "out of memory"
    if error.startswith("timeout"):
        return "timeout"
    return "other error"


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    """A short account of the rows (the last lines of a long GPU log)."""
    rows = config.stash.get(FINISHED, None)
    if not rows:
        return
    settings = config.stash[STATE].settings
    kinds: dict[str, int] = {}
    for row in rows:
        error = row["extra_info"].get("error")
        kind = "measured" if error is None else _failure_kind(error)
        kinds[kind] = kinds.get(kind, 0) + 1
    write = terminalreporter.write_line
    write(f"tilax bench: mode {settings.mode}, {len(rows)} rows in {settings.elapsed():.0f} s "
          f"(budget {settings.budget_s:.0f} s): "
          + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())))
    other = [row for row in rows if _failure_kind(row["extra_info"].get("error") or "x")
             in ("other error", "timeout") and "error" in row["extra_info"]]
    for row in other[:15]:
        write(f"  {row['name']}: {row['extra_info']['error'][:160]}")
    side = config.stash.get(ROWS, None)
    if side is not None:
        write(f"tilax bench: rows also in {side}")
