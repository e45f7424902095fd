"""The MoE layer's rules table (``tilax.moe.rules``): every row is a win in its stored evidence
(or names the unstored figures it rests on), the guide lists every backend rule,
``resolve_impl`` applies a backend rule only where it holds, and ``rules.choose`` selects a
variant."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import tilax
from tilax import _pallas
from tilax.moe import api, rules

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "data" / "results"
GUIDE = REPO / "docs" / "guides" / "moe.md"
TRITON_IMPLS = ("triton", "pallas")  # "pallas" rows run Triton: "auto" alone consults the table
H200 = dict(platform="gpu", device_kind="NVIDIA H200", mosaic_unavailable_reason=None)


def _measured_rows(path: Path, op: str, case: dict) -> tuple[dict, list[dict]]:
    """``machine_info`` and the ``(extra_info, stats)`` of the file's measured ``op`` rows of
    ``case`` (dropless, bfloat16, unskewed, default tiles)."""
    data = json.loads(path.read_text())
    rows = []
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        if (info.get("family") == "moe" and info.get("op") == op and not info.get("error")
                and info.get("routing") == "dropless" and info.get("dtype") == "bfloat16"
                and not info.get("skew") and info.get("block_m") is None
                and all(info.get(key) == value for key, value in case.items())):
            rows.append((info, bench["stats"]))
    return data["machine_info"], rows


@pytest.mark.parametrize("rule", rules.BACKEND_RULES,
                         ids=lambda r: f"{r.device_kind}-{r.dtype}-{r.dispatch}-E{r.num_experts}")
def test_each_backend_rule_is_a_win_in_its_evidence(rule):
    case = dict(dispatch=rule.dispatch, experts=rule.num_experts, top_k=rule.top_k)
    for name in rule.evidence:
        machine, found = _measured_rows(RESULTS / name, "train_step", case)
        assert machine["gpu"] == rule.device_kind, name
        rows = {(info["impl"], info["tokens"]): stats for info, stats in found}
        sizes = sorted(tokens for impl, tokens in rows if impl == rule.backend)
        assert sizes, f"{name} has no {rule.backend} train step for {rule}"
        for tokens in sizes:
            chosen = rows[(rule.backend, tokens)]
            others = [rows[(impl, tokens)] for impl in TRITON_IMPLS if (impl, tokens) in rows]
            assert others, f"{name} has no Triton train step at {tokens} tokens beside it"
            best_other = min(others, key=lambda stats: stats["median"])
            # a win beyond the spread: the chosen backend's upper quartile under the other's lower
            assert chosen["q3"] < best_other["q1"], (name, tokens, chosen, best_other)


@pytest.mark.parametrize("rule", rules.VARIANT_RULES, ids=lambda r: r.name)
def test_each_variant_rule_is_held_by_its_stored_runs(rule):
    """A variant row's pick is among its options, and either each stored before/after pair
    shows it faster beyond the spread of both rows, or the row names the unstored figures it
    rests on (those rows need a run on the GPU)."""
    assert rule.pick in rule.options and len(set(rule.options)) == len(rule.options)
    assert rule.evidence or rule.unstored, f"{rule.name}: neither stored evidence nor a figure"
    for comparison in rule.evidence:
        stats = {}
        for side in ("picked", "other"):
            name = getattr(comparison, side)
            case = comparison.side_case(side)
            machine, found = _measured_rows(RESULTS / name, comparison.op, case)
            assert machine["gpu"] == "NVIDIA H200", name
            assert len(found) == 1, f"{name}: {len(found)} {comparison.op} rows of {case}"
            stats[side] = found[0][1]
        assert stats["picked"]["q3"] < stats["other"]["q1"], (rule.name, comparison, stats)


# the tilax impls a decode row must beat at each size of its evidence (the peers are the
# report's business: tests/gen and the decode page compare against them)
DECODE_OTHERS = ("triton", "mosaic", "pallas")


@pytest.mark.parametrize("rule", rules.DECODE_RULES, ids=lambda r: f"T{r.max_tokens}")
def test_each_decode_rule_is_a_win_in_its_evidence_or_says_why_not(rule):
    """A decode row names the decode suite's stored files where, at every token count up to
    its ``max_tokens`` and in each of its dtypes, the ``decode`` forward beats every training
    kernel's beyond the spread of both; or, until such a run is stored, why it stands."""
    assert rule.evidence or rule.unmeasured, f"{rule}: neither stored evidence nor a reason"
    for name in rule.evidence:
        data = json.loads((RESULTS / name).read_text())
        rows = {}
        for bench in data["benchmarks"]:
            info = bench["extra_info"]
            if (info.get("suite") == "decode" and info.get("op") == "forward"
                    and not info.get("error") and info.get("dtype") in rule.dtypes):
                case = (info["dtype"], info["experts"], info["top_k"], info["tokens"])
                rows.setdefault(case, {})[info["impl"]] = bench["stats"]
        covered = [case for case in rows if case[3] <= rule.max_tokens and "decode" in rows[case]]
        assert covered, f"{name} has no decode row up to {rule.max_tokens} tokens"
        for case in covered:
            others = [rows[case][impl] for impl in DECODE_OTHERS if impl in rows[case]]
            assert others, f"{name} has no training-kernel row beside decode at {case}"
            best = min(others, key=lambda stats: stats["median"])
            assert rows[case]["decode"]["q3"] < best["q1"], (name, case)


def test_a_comparison_names_each_side_of_a_variants_run():
    comparison = rules.Comparison("train_step", (("experts", 64),), "run.json", "run.json",
                                  other_options=(("joined_dx", "on"), ("gmm_ws", "off")))
    assert comparison.side_case("picked") == {"experts": 64, "variant": None}
    assert comparison.side_case("other") == {"experts": 64,
                                             "variant": "joined_dx=on,gmm_ws=off"}


def test_variant_limits_are_read_from_the_table():
    assert rules.limit("gmm_ws", "max_contraction") == 256
    assert rules.limit("gather_rows", "max_column_tiles") == 2
    assert rules.limit("copy_rows", "min_block_tokens") == 8
    assert [rule.name for rule in rules.RULES if isinstance(rule, rules.VariantRule)] == [
        rule.name for rule in rules.VARIANT_RULES]


def test_choose_selects_a_variant_inside_its_block_only():
    assert rules.variant("joined_dx") == "off"  # not yet measured on a GPU: off in the layer
    with rules.choose(joined_dx="overlap", gmm_ws="off"):
        assert (rules.variant("joined_dx"), rules.variant("gmm_ws")) == ("overlap", "off")
        with rules.choose(joined_dx="on"):
            assert (rules.variant("joined_dx"), rules.variant("gmm_ws")) == ("on", "off")
        assert rules.variant("joined_dx") == "overlap"
    assert (rules.variant("joined_dx"), rules.variant("gmm_ws")) == ("off", "short_contractions")


@pytest.mark.parametrize("options,match", [
    (dict(joined_dx="sometimes"), "takes one of"),
    (dict(no_such_rule="on"), "unknown variant rule"),
])  # fmt: skip
def test_choose_rejects_unknown_names_and_options(options, match):
    with pytest.raises(ValueError, match=match), rules.choose(**options):
        pass


def test_the_guide_lists_every_backend_rule():
    guide = GUIDE.read_text()
    for rule in rules.BACKEND_RULES:
        row = (f"| {rule.device_kind} | `{rule.dtype}` | `{rule.dispatch}` | {rule.num_experts} "
               f"| {rule.top_k} | `{rule.backend}` |")
        assert row in guide, row
        for name in rule.evidence:
            assert name in guide, name


def _config(**overrides):
    return tilax.MoEConfig(**{**dict(d_model=512, d_hidden=1024, num_experts=8, top_k=2,
                                     dtype=jnp.bfloat16), **overrides})


E64 = dict(num_experts=64, top_k=8, d_hidden=128)


@pytest.mark.parametrize("overrides", [dict(dispatch="sorted"), dict(dispatch="fused_gsum"),
                                       dict(dispatch="gather"), dict(dispatch="fused"),
                                       dict(E64, dispatch="sorted"), dict(E64, dispatch="fused")])
def test_auto_runs_a_rules_backend(overrides):
    with _pallas.assume_device(**H200):
        assert api.resolve_impl(_config(**overrides)) == "mosaic"
        assert api.kernel_tiles(_config(**overrides)).block_m % 64 == 0  # Mosaic's tiles


@pytest.mark.parametrize(
    "overrides",
    [
        dict(impl="pallas"),  # an explicit Pallas request keeps Triton
        dict(dtype=jnp.float32),
        dict(dtype=jnp.float16),  # measured in bfloat16 only
        dict(E64, dispatch="gather"),  # a train-step win of 3%, but a forward 9-19% slower
        dict(E64, dispatch="fused_gsum"),
        dict(num_experts=64, top_k=4, d_hidden=128),  # not measured with Mosaic
        dict(routing="capacity"),
        dict(recompute=True),
        dict(block_m=64),
    ],
)
def test_auto_keeps_triton_where_no_rule_holds(overrides):
    with _pallas.assume_device(**H200):
        assert api.resolve_impl(_config(**overrides)) == "triton"


def test_auto_keeps_triton_on_other_gpus_and_without_mosaic():
    with _pallas.assume_device(**{**H200, "device_kind": "NVIDIA H100 80GB HBM3"}):
        assert api.resolve_impl(_config()) == "triton"
    with _pallas.assume_device(**{**H200, "mosaic_unavailable_reason": "no module named absl"}):
        assert api.resolve_impl(_config()) == "triton"


def test_auto_on_cpu_runs_plain_xla():
    assert api.resolve_impl(_config()) == "blocked"
    assert rules.platform_rule("cpu").impl == "blocked"


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the facts of a CPU-only machine")
def test_device_facts_and_assumed_devices():
    """The Mosaic GPU kernels size themselves by ``_pallas``'s device facts: off GPUs an
    sm90's (227 KiB a block, 228 KiB an SM, 132 SMs), or those ``assume_device`` states."""
    assert _pallas.shared_memory_per_block() == 227 * 1024
    assert _pallas.shared_memory_per_sm() == 228 * 1024
    assert _pallas.sm_count() == _pallas.DEFAULT_SM_COUNT == 132
    with _pallas.assume_device(platform="gpu", compute_capability=(8, 6), sm_count=2):
        assert _pallas.shared_memory_per_block() == 101376
        assert _pallas.sm_count() == 2 and not _pallas.is_hopper_or_newer()
        assert "capability 9.0+" in _pallas.mosaic_unavailable_reason()
    assert _pallas.platform() == "cpu" and _pallas.gpu_compute_capability() is None
    with pytest.raises(TypeError, match="assume_device takes"), _pallas.assume_device(cores=2):
        pass
