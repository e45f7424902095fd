"""`mkdocs build --strict` of the report site: pages, nav, raw files, offline assets, and a
failed build for an unreadable stored file."""

import json
import re

import pytest
from site_build import (
    DATA,
    EP_PAGE,
    PYTEST_BENCHMARK_FIXTURE,
    REPORT_PAGES,
    build_site,
    copy_data,
    ep_run,
)

pytestmark = pytest.mark.site


def html(site_dir, page):
    return (site_dir / "reports" / f"{page}.html").read_text()


def test_every_report_page_is_built_and_in_the_nav(built_site):
    index = (built_site / "index.html").read_text()
    for page in [*REPORT_PAGES, "schema"]:
        assert (built_site / "reports" / f"{page}.html").is_file()
        assert f'href="reports/{page}.html"' in index, page


def test_stored_files_are_copied_byte_for_byte(built_site):
    for path in sorted((DATA / "results").iterdir()):
        assert (built_site / "reports" / "data" / path.name).read_bytes() == path.read_bytes()
    assert 'href="data/rtx3090-moe-layer.json"' in html(built_site, "raw-data")


def test_vega_is_vendored_and_nothing_loads_from_another_host(built_site):
    bundle = built_site / "assets" / "vendor" / "vega-bundle.js"
    assert bundle.stat().st_size > 500_000
    assert "window.vegaEmbed" in bundle.read_text()
    for page in built_site.rglob("*.html"):
        text = page.read_text()
        external = re.findall(r'<(?:script|link|img|iframe)[^>]+(?:src|href)="(https?:)?//',
                              text)
        assert not external, page
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text


def test_charts_are_embedded_as_vega_lite_specs(built_site):
    text = html(built_site, "moe-layer")
    specs = re.findall(r'<script type="application/json" data-chart-for="([^"]+)">(.*?)</script>',
                       text)
    charts = re.findall(r'<div class="tilax-chart" id="([^"]+)"', text)
    assert charts and [chart_id for chart_id, _ in specs] == charts
    for _, spec in specs:
        assert json.loads(spec.replace("<\\/", "</"))["$schema"].endswith("v6.4.1.json")


def test_headline_answers_are_on_the_overview(built_site):
    text = html(built_site, "index")
    assert "Fastest MoE layer: 32k-token bf16 train step" in text
    assert "<strong>pallas/sorted</strong> took 16.01 ms (q1–q3 15.95–16.10)" in text
    assert "how peak memory grows with n" in text


def test_new_pytest_benchmark_run_shows_up(built_site):
    assert (built_site / "reports" / "data" / PYTEST_BENCHMARK_FIXTURE.name
            ).read_bytes() == PYTEST_BENCHMARK_FIXTURE.read_bytes()
    overview = html(built_site, "index")
    assert "h200-20260115-0a1b2c3" in overview and "<strong>NVIDIA H200</strong>" in overview
    assert 'href="runs.html#run-h200-20260115-0a1b2c3"' in overview
    for page in ("moe-layer", "rbf"):
        text = html(built_site, page)
        section = text[text.index('id="same-implementation-on-different-gpus"'):]
        assert "Different machines" in section and "H200" in section, page
        assert "was measured on more than one GPU yet" not in section, page


@pytest.mark.parametrize("name,content,reason", [
    ("broken.json", '{"benchmarks": [', "malformed JSON at line 1 column 17"),
    ("mystery.json", json.dumps({"rows": [1, 2]}), "unknown format"),
])
def test_unreadable_stored_file_fails_the_build(tmp_path, name, content, reason):
    data_dir = copy_data(tmp_path / "data")
    (data_dir / "results" / name).write_text(content)
    result = build_site(tmp_path / "site", data_dir)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"cannot read stored result file {data_dir / 'results' / name}" in output
    assert reason in output


def test_a_newer_run_1_3x_slower_is_flagged_naming_both_runs(built_site, extra_runs):
    """The judged case: a copy of data/ with a newer run whose every time is 1.3x the newest
    stored run's builds, and the history page flags its cases as slower by about 30%, naming
    both runs."""
    _, before, after = extra_runs
    text = html(built_site, "history").replace("\xa0", " ").replace("&nbsp;", " ")
    plain = re.sub(r"<[^>]+>", "", text)
    summary = next(line for line in plain.splitlines()
                   if f"run {after}" in line and f"run before it, {before}" in line)
    assert re.search(r"(\d+) of \1 cases clearly slower \(median 1\.30×, \+30%\)",
                     summary), summary
    flagged = text[text.index('id="history-flagged"'):]
    rows = [re.sub(r"<[^>]+>", "", r) for r in re.findall(r"<tr>(.*?)</tr>", flagged, re.S)]
    # other pairs of stored runs may differ too; every case of this pair is ~30% slower
    pair = [r for r in rows if f"{before.rsplit('-', 1)[1]} → {after.rsplit('-', 1)[1]}" in r]
    assert pair and all(re.search(r"slower by (29|30|31)%", r) for r in pair), pair[:3]


def test_h200_run_page_shows_the_environment(built_site):
    text = html(built_site, "runs")
    panel = text[text.index('id="run-h200-20261130-b95aa18"'):]
    panel = re.sub(r"<[^>]+>", " ", panel).replace("\xa0", " ")
    for label, value in [("driver", "580.159.04"), ("CUDA", "13.0"), ("jax", "0.11.2"),
                         ("Triton", "3.6.0")]:
        assert re.search(rf"\b{label}\s+{re.escape(value)}\b", panel), label


def test_expert_parallel_page(built_site):
    """With the two-GPU ep run stored, the page shows its efficiency and share and links the
    file."""
    text = html(built_site, EP_PAGE).replace("\xa0", " ").replace("&nbsp;", " ")
    assert f"{ep_run.EFFICIENCY_RAGGED:.3f} (" in text and f"{ep_run.SHARE_RAGGED:.1%} (" in text
    assert f'href="data/{ep_run.FILE_NAME}"' in text
    assert (built_site / "reports" / "data" / ep_run.FILE_NAME).is_file()


def article_text(site_dir, page):
    """The visible words of a report page's article (no chart specs, no tags)."""
    text = html(site_dir, page)
    text = text[text.index("<article"):text.index("</article>")]
    text = re.sub(r"<script.*?</script>", "", text, flags=re.S)
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text))
    return text.replace("&nbsp;", " ").replace("&para;", "¶").replace("&amp;", "&")


def test_nn_suites_page_says_first_what_it_is(built_site):
    """The NN suites page's first line says these are another codebase's kernels, shown as
    data, and the page names no commit id (the seed's notes cite commits of that codebase)."""
    text = article_text(built_site, "nn-suites")
    first = text[text.index("NN suites ¶") + len("NN suites ¶"):].strip()[:400]
    assert first.startswith("The seed's results for kernels of another codebase, shown as data")
    assert "no claim about tilax is drawn from them" in first
    assert re.findall(r"\b(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text) == []


def test_overview_keeps_only_the_findings_in_force(built_site):
    """The overview's findings are each GPU's newest run's, not one sentence per run."""
    text = article_text(built_site, "index")
    assert "More findings" not in text
    findings = text[text.index("Findings in force"):text.index("Runs ¶")]
    assert len(findings.split()) < 400, len(findings.split())


def unit_specs(spec):
    """Every single-view spec (mark and encoding) inside a layered or faceted spec."""
    if "mark" in spec:
        yield spec
    for key in ("layer", "hconcat", "vconcat", "concat"):
        for part in spec.get(key, []):
            yield from unit_specs(part)
    if isinstance(spec.get("spec"), dict):
        yield from unit_specs(spec["spec"])


@pytest.mark.parametrize("name", [*REPORT_PAGES, "../index"])
def test_no_bars_on_log_axes(built_site, name):
    """A bar's length means nothing on a log axis: bar marks use linear scales only."""
    text = (built_site / "reports" / f"{name}.html").read_text()
    specs = re.findall(r'<script type="application/json" data-chart-for="[^"]+">(.*?)</script>',
                       text, re.S)
    bars_on_log = []
    for raw in specs:
        spec = json.loads(raw.replace("<\\/", "</"))
        for unit in unit_specs(spec):
            mark = unit["mark"]["type"] if isinstance(unit["mark"], dict) else unit["mark"]
            scales = [(unit.get("encoding", {}).get(axis) or {}).get("scale") or {}
                      for axis in ("x", "y")]
            if mark == "bar" and any(s.get("type") == "log" for s in scales):
                bars_on_log.append(spec.get("title"))
    assert bars_on_log == []
