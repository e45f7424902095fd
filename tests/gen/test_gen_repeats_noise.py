"""One value per case and run, how ratios between collapsed rows are formed, superseded peer
rows, rows without a spread, and the between-run noise model of the history page.

Numbers are read from the stored files with plain json here, independently of the loaders."""

import json
import math
import shutil

import pandas as pd
import pytest
from report_fixtures import REPO
from slower_run import write_slower_copy
from tilax_report import analysis, history, repeats, runs, schema, verdict
from tilax_report.load import load_results
from tilax_report.pages import history as history_page
from tilax_report.pages import runs as runs_page

RESULTS = REPO / "data" / "results"
EAE = ["h200-20261205-eae54e0-decoder-peers-131k-2.json",
       "h200-20261205-eae54e0-decoder-peers-131k.json",
       "h200-20261205-eae54e0-decoder-peers-16k-131k.json"]
PAIR = ["h200-20261204-bca31f0-decoder-peers-131k.json",
        "h200-20261204-6358c5c-decoder-peers-16k-131k.json"]
BEFORE_FIX = "h200-20261203-a84ba7d-decoder.json"  # tokamax glue before 9cd4196
AFTER_FIX = "h200-20261203-9cd4196-decoder-peers.json"
E64_STEP = {"suite": "decoder", "op": "train_step", "tokens": 131072, "experts": 64}


def stored_ms(name: str, impl: str, dispatch: str | None, **case) -> float:
    """The median of one stored benchmark, ms, read with plain json."""
    doc = json.loads((RESULTS / name).read_text())
    found = [b["stats"]["median"] * 1e3 for b in doc["benchmarks"]
             if b["extra_info"]["impl"] == impl and b["extra_info"].get("dispatch") == dispatch
             and all(b["extra_info"].get(k) == v for k, v in case.items())
             and not b["extra_info"].get("error")]
    assert len(found) == 1, (name, impl, dispatch)
    return found[0]


def select(frame: pd.DataFrame, **values) -> pd.DataFrame:
    for key, value in values.items():
        frame = frame[frame[key] == value]
    return frame


@pytest.fixture(scope="module")
def real(real_data_dir):
    return load_results(real_data_dir)


@pytest.fixture(scope="module")
def labelled(real):
    return analysis.with_labels(real.table)


def data_with(folder, names):
    """A data/ folder with the named stored files and the committed provenance tables."""
    (folder / "results").mkdir()
    for name in names:
        shutil.copy(RESULTS / name, folder / "results" / name)
    shutil.copytree(REPO / "data" / "provenance", folder / "provenance")
    return folder


# One value per case and run


def test_every_stored_row_is_kept_and_the_table_has_one_row_per_case_and_run(real):
    assert len(real.rows) == real.files["table_rows"].sum()
    timed = real.table[~real.table["summary"].fillna(False).astype(bool)]
    assert not timed.duplicated(["run", "device", *schema.CASE_COLUMNS]).any()
    # every stored row is in exactly one row of the table
    assert real.table["attempts"].sum() == len(real.rows)


def test_three_files_of_one_run_become_the_median_with_count_range_and_files(real):
    row = select(real.table, run="h200-20261205-eae54e0", impl="mosaic", dispatch="fused",
                 **E64_STEP)
    assert len(row) == 1
    row = row.iloc[0]
    stored = sorted(stored_ms(name, "mosaic", "fused", op="train_step", tokens=131072)
                    for name in EAE)  # 7.364, 7.596, 7.608
    assert row["median_ms"] == pytest.approx(stored[1])
    assert (row["repeat_min_ms"], row["repeat_max_ms"]) == pytest.approx((stored[0], stored[2]))
    assert row["repeats"] == 3 and row["attempts"] == 3
    assert row["source_files"] == tuple(sorted(EAE))
    assert row["source_file"] == "h200-20261205-eae54e0-decoder-peers-131k-2.json"  # 7.596
    assert row["q1_ms"] <= row["median_ms"] <= row["q3_ms"]
    per_file = select(real.rows, run="h200-20261205-eae54e0", impl="mosaic", dispatch="fused",
                      **E64_STEP)
    assert row["rounds"] == per_file["rounds"].sum()
    assert len(row["round_ms"]) == sum(len(r) for r in per_file["round_ms"])


def test_a_pivot_taking_the_first_cell_cannot_hide_a_repeat(labelled):
    decoder = select(labelled, run="h200-20261205-eae54e0", suite="decoder",
                     status="measured")
    counts = decoder.pivot_table(index="label", columns=["op", "tokens"], values="median_ms",
                                 aggfunc="count")
    assert (counts.fillna(1) == 1).all().all()
    first = decoder.pivot_table(index="label", columns=["op", "tokens"], values="median_ms",
                                aggfunc="first")
    median = decoder.pivot_table(index="label", columns=["op", "tokens"], values="median_ms",
                                 aggfunc="median")
    pd.testing.assert_frame_equal(first, median)


def test_the_keys_the_pages_pivot_on_name_one_row(labelled):
    """moe_decoder and nn_suites pivot with aggfunc="first" on these keys: one row each."""
    decoder = labelled[(labelled["family"] == "moe") & (labelled["suite"] == "decoder")]
    assert not decoder.duplicated(["run", "label", "op", "tokens"]).any()
    nn = labelled[labelled["family"] == "nn"]
    nn = nn.assign(variant=nn["impl"].fillna(nn["suite"]))
    assert not nn.duplicated(["run", "suite", "variant", "tokens", "resolution", "dtype",
                              "op"]).any()


def test_throughput_follows_the_collapsed_median():
    def rows(*times):
        return schema.conform(pd.DataFrame([
            {"source_file": f"{name}.json", "source_row": 0, "run": "r", "device": "GPU",
             "family": "moe", "suite": "layer", "impl": "pallas", "op": "forward",
             "status": "measured", "median_ms": ms, "q1_ms": ms - 0.1, "q3_ms": ms + 0.1,
             "rounds": 10, "flops": 1e12, "tflops": 1e12 / (ms * 1e9)}
            for name, ms in zip("abc", times, strict=False)]))

    odd = repeats.collapse(rows(1.0, 2.0, 4.0))
    assert len(odd) == 1 and odd["repeats"].item() == 3
    assert odd["median_ms"].item() == 2.0 and odd["tflops"].item() == pytest.approx(500.0)
    assert odd["source_file"].item() == "b.json"
    even = repeats.collapse(rows(1.0, 2.0))
    assert even["median_ms"].item() == 1.5
    assert even["tflops"].item() == pytest.approx(1e12 / 1.5e9)  # the time shown, not a file's
    assert even["q1_ms"].item() == pytest.approx(1.4) and even["rounds"].item() == 20


def test_a_case_measured_in_one_file_and_failed_in_another_is_one_measured_row():
    base = {"source_row": 0, "run": "r", "device": "GPU", "family": "moe", "suite": "layer",
            "impl": "pallas", "op": "forward"}
    rows = schema.conform(pd.DataFrame([
        base | {"source_file": "a.json", "status": "failed", "error": "out of memory"},
        base | {"source_file": "b.json", "status": "measured", "median_ms": 2.0}]))
    one = repeats.collapse(rows)
    assert one[["status", "repeats", "attempts"]].to_dict("records") == [
        {"status": "measured", "repeats": 1, "attempts": 2}]
    assert one["source_files"].item() == ("a.json", "b.json")


# How a ratio between two collapsed rows is formed


def test_repeats_that_overlap_give_no_verdict_between_implementations(labelled):
    ranked = analysis.rank_within_run(
        select(labelled, run="h200-20261205-eae54e0", suite="decoder"),
        ["config", "dtype", "op", "tokens"])
    step = select(ranked, op="train_step", tokens=131072).iloc[0]
    # sorted 7.551 (one file) against fused 7.596 (median of 7.364, 7.596, 7.608): a 0.6%
    # difference inside the 3.3% between fused's own repeats
    assert (step["fastest"], step["runner_up"]) == ("mosaic/sorted", "mosaic/fused")
    assert step["ratio"] == pytest.approx(
        step["runner_up_ms"] / step["fastest_ms"])
    assert not pd.isna(step["clear"]) and not step["clear"]
    assert step["method"].endswith("+ run-to-run spread")
    assert step["runner_up_repeats"] == 3


def test_rows_of_two_files_that_share_none_are_never_paired():
    base = {"run": "r", "device": "GPU", "family": "moe", "suite": "layer", "dtype": "bfloat16",
            "op": "forward", "tokens": 4096, "dispatch": "sorted", "routing": "dropless",
            "status": "measured", "q1_ms": None, "rounds": 10}
    rows = pd.DataFrame([
        base | {"source_file": "a.json", "impl": "pallas", "median_ms": 1.0, "q1_ms": 0.99,
                "q3_ms": 1.01},
        base | {"source_file": "b.json", "impl": "ragged_dot", "median_ms": 3.0, "q1_ms": 2.9,
                "q3_ms": 3.1}])
    table = analysis.with_labels(repeats.single_rows(schema.conform(rows)))
    ranked = analysis.rank_within_run(table, analysis.MOE_CASE)
    assert ranked["method"].item() == "different files" and math.isnan(ranked["ratio"].item())
    assert ranked["clear"].item() is None
    speed = analysis.speedups(table, analysis.MOE_CASE, "ragged_dot/sorted")
    assert set(speed["label"]) == {"ragged_dot/sorted"}  # only the baseline against itself


# No stale claims


def test_peer_rows_before_the_peers_fix_are_superseded(real):
    before = select(real.rows, source_file=BEFORE_FIX, impl="tokamax")
    after = select(real.rows, source_file=AFTER_FIX, impl="tokamax")
    assert not before.empty and before["superseded"].all()
    assert set(before["superseded_by"]) == {"9cd4196"}
    assert not after.empty and not after["superseded"].any()
    assert not select(real.rows, source_file=BEFORE_FIX, impl="mosaic")["superseded"].any()


def test_superseded_rows_feed_no_ranking_baseline_or_verdict(labelled):
    rows = select(labelled, run="h200-20261203-a84ba7d", suite="decoder")
    ranked = analysis.rank_within_run(rows, ["config", "dtype", "op", "tokens"])
    assert not ranked.empty and "tokamax" not in set(ranked["fastest"]) | set(
        ranked["runner_up"])
    assert (ranked["superseded"] > 0).any()
    assert analysis.speedups(rows, ["config", "dtype", "op", "tokens"], "tokamax").empty
    stale = select(rows, impl="tokamax", op="train_step", tokens=131072).iloc[0]
    ours = select(rows, impl="mosaic", dispatch="fused", op="train_step",
                  tokens=131072).iloc[0]
    assert verdict.compare(ours, stale) == {
        "ratio": pytest.approx(stale["median_ms"] / ours["median_ms"]), "clear": None,
        "method": "superseded", "p_value": pytest.approx(math.nan, nan_ok=True)}


def test_rows_without_a_spread_never_get_a_verdict(real):
    h100 = analysis.with_labels(real.table[real.table["source_file"] == "h100-moe-decoder.json"])
    timed = analysis.timed(h100)
    assert not timed.empty and not timed["spread_stored"].any()
    assert verdict.quality(timed)["no_spread"].all()
    a, b = timed.iloc[0], timed.iloc[1]
    assert verdict.compare(a, b)["method"] == "no spread stored"
    assert verdict.compare(a, b)["clear"] is None
    ranked = analysis.rank_within_run(h100, ["config", "dtype", "op", "tokens"])
    assert not ranked.empty and ranked["clear"].isna().all()
    assert set(ranked["method"]) == {"no spread stored"}
    one_round = {"median_ms": 1.0, "q1_ms": 1.0, "q3_ms": 1.0, "rounds": 1, "round_ms": (1.0,),
                 "status": "measured"}
    from tilax_report.load import spread_stored

    assert not spread_stored(schema.conform(pd.DataFrame([one_round]))).item()


# Noise between runs


def test_a_cases_spread_comes_from_its_identical_code_repeats_and_never_below_the_floor(real):
    row = select(real.table, run="h200-20261205-eae54e0", impl="mosaic", dispatch="fused",
                 **E64_STEP).iloc[0]
    stored = [stored_ms(name, "mosaic", "fused", op="train_step", tokens=131072)
              for name in EAE]
    assert row["run_spread"] == pytest.approx(math.log(max(stored) / min(stored)))
    assert row["run_spread_basis"] == "identical code"
    groups = history.identical_code_groups(real.rows)
    limits = history.noise_limits(groups).loc["NVIDIA H200"]
    within = groups[(groups["device"] == "NVIDIA H200")
                    & (groups["log_range"] <= limits["fence"])]["log_range"]
    assert limits["floor"] == pytest.approx(within.quantile(history.FLOOR_QUANTILE))
    h200 = real.table[real.table["device"] == "NVIDIA H200"]
    assert (h200["run_spread"] >= limits["floor"] - 1e-12).all()
    assert set(h200["run_spread_basis"]) == {"identical code", "floor"}


def test_runs_of_identical_code_show_no_change(real, labelled):
    # bca31f0 and 6358c5c: the same src/ and tests/bench/ (two declared commits)
    catalogue = runs.catalogue(real.rows).set_index("run")
    assert catalogue.loc["h200-20261204-bca31f0", "same_code_runs"] == [
        "h200-20261204-6358c5c"]
    changes = history.changes(history.timeline(labelled, runs.run_order(real.rows)))
    pair = changes[(changes["before_run"] == "h200-20261204-bca31f0")
                   & (changes["after_run"] == "h200-20261204-6358c5c")]
    assert len(pair) >= 10 and pair["same_code"].all()
    assert not pair["clear"].eq(True).any()
    # the example: the E64 mosaic/fused step, 7.823 -> 7.640 ms, is not "faster by 2%"
    step = select(pair, impl="mosaic", dispatch="fused", **E64_STEP)
    assert step["ratio"].item() == pytest.approx(
        stored_ms(PAIR[1], "mosaic", "fused", op="train_step", tokens=131072)
        / stored_ms(PAIR[0], "mosaic", "fused", op="train_step", tokens=131072))
    assert step["clear"].item() is False
    text = history_page.build(real)
    row = next(line for line in text.splitlines() if line.startswith("|")
               and "runs.md#run-h200-20261204-bca31f0) → [`6358c5c`]" in line)
    assert "| identical |" in row and "| 0 | 0 |" in row


def later_runs(folder, *copies):
    """Every stored file, plus later runs made from the eae54e0 files: (commit, factor,
    identical code?, days later) each. Returns the results and the run pairs by later run."""
    shutil.copytree(RESULTS, folder / "results")
    shutil.copytree(REPO / "data" / "provenance", folder / "provenance")
    table = json.loads((REPO / "data" / "provenance" / "declared-commits.json").read_text())
    for commit, factor, identical, days in copies:
        for name in EAE:
            write_slower_copy(RESULTS / name, folder / "results", factor, commit,
                              days_later=days,
                              code_hash=table["eae54e0"]["code_hash"] if identical else None)
    results = load_results(folder)
    table = analysis.with_labels(results.table)
    pairs = history.run_pairs(history.changes(history.timeline(
        table, runs.run_order(results.rows)))).set_index("after_run")
    return results, pairs


@pytest.fixture(scope="module")
def identical(tmp_path_factory):
    """Identical code 1% slower (noise), then identical code 1.3x slower (a faulty
    machine)."""
    return later_runs(tmp_path_factory.mktemp("identical"), ("aaaaaa1", 1.01, True, 1),
                      ("ccccccc", 1.3, True, 2))


@pytest.fixture(scope="module")
def slower(tmp_path_factory):
    """New code (a commit of unknown code), 1.3x slower on every case."""
    return later_runs(tmp_path_factory.mktemp("slower"), ("bbbbbb2", 1.3, False, 1))


def test_an_identical_code_run_within_the_noise_is_unchanged(identical):
    results, pairs = identical
    noise = pairs.loc["h200-20261206-aaaaaa1"]
    assert noise["before_run"] == "h200-20261205-eae54e0"
    assert noise["same_code"] and noise["compared"] >= 10
    assert noise["slower"] == 0 and noise["faster"] == 0
    rows = results.rows[results.rows["commit"] == "aaaaaa1"]
    assert set(rows["code_hash_source"]) == {"stored"} and rows["tree_matches_declared"].all()


def test_a_run_slower_on_every_case_is_flagged_at_the_top(slower):
    results, pairs = slower
    run = pairs.loc["h200-20261206-bbbbbb2"]
    assert not run["same_code"] and run["before_run"] == "h200-20261205-eae54e0"
    assert run["slower"] == run["compared"] >= 10
    assert run["slower_ratio"] == pytest.approx(1.3)
    text = history_page.build(results)
    top = text[:text.index("## Changes between consecutive runs")]
    assert '!!! danger "Slower run: h200-20261206-bbbbbb2"' in top


def test_a_slower_run_on_identical_code_is_still_flagged(identical):
    results, pairs = identical
    faulty = pairs.loc["h200-20261207-ccccccc"]
    assert faulty["same_code"] and faulty["slower"] == faulty["compared"] >= 10
    text = history_page.build(results)
    top = text[:text.index("## Changes between consecutive runs")]
    box = top[top.index('"Slower run: h200-20261207-ccccccc"'):]
    assert "Both runs measured identical code: look at the machine." in box.split("!!!")[0]


def test_history_drill_down_opens_on_a_tilax_kernel_case(real):
    text = history_page.build(real)
    spec = text[text.rindex('<script type="application/json"'):]
    opening = json.loads(spec[spec.index(">") + 1:spec.index("</script>")])
    value = next(p["value"] for p in opening["params"] if p["name"] == "shown_case")
    label = value.split(" · ")[1]
    assert label.split("/")[0].split(" ")[0] in history_page.TILAX_IMPLS, value


def test_runs_page_shows_provenance_newest_first_and_folds_older_runs(real, identical):
    text = runs_page.build(real)
    newest = text[text.index("## Newest run of each GPU"):text.index("## Earlier runs")]
    assert "### `h200-20261205-eae54e0`" in newest
    assert ("Code: declared commit `eae54e0` (a label, not checked at bench time); code hash "
            f"`{real.rows.loc[real.rows['commit'] == 'eae54e0', 'code_hash'].iloc[0]}`"
            ) in newest
    earlier = text[text.index("## Earlier runs"):]
    assert '<details class="tilax-details tilax-run" id="run-h200-20261204-bca31f0"' in earlier
    assert "Identical code to [`h200-20261204-6358c5c`]" in earlier
    stored = runs_page.build(identical[0])
    panel = stored[stored.index("### `h200-20261207-ccccccc`"):]
    assert "recorded at bench time; the benched tree was the declared commit's" in panel


def chart_specs(text: str) -> list[dict]:
    specs = []
    for part in text.split('<script type="application/json"')[1:]:
        specs.append(json.loads(part[part.index(">") + 1:part.index("</script>")]))
    return specs


def units(spec: dict):
    """Every single-view part of a spec (layers and facets unfolded)."""
    for key in ("layer", "hconcat", "vconcat", "concat"):
        for part in spec.get(key, []):
            yield from units(part)
    if "spec" in spec:
        yield from units(spec["spec"])
    if "mark" in spec:
        yield spec


def test_history_and_runs_charts_are_readable(real):
    """No bars on log axes, no chart taller than 1000 px, at most 8 series a chart."""
    specs = chart_specs(history_page.build(real)) + chart_specs(runs_page.build(real))
    assert len(specs) >= 2
    for spec in specs:
        for unit in [spec, *units(spec)]:
            height = unit.get("height", 0)
            assert isinstance(height, int) and height <= 1000, spec.get("title")
        for unit in units(spec):
            mark = unit["mark"]["type"] if isinstance(unit["mark"], dict) else unit["mark"]
            encoding = unit.get("encoding", {})
            if mark == "bar":
                assert all((c.get("scale") or {}).get("type") != "log"
                           for c in encoding.values() if isinstance(c, dict)), spec
            colour = encoding.get("color", {})
            domain = (colour.get("scale") or {}).get("domain", [])
            assert len(domain) <= 8, spec.get("title")
