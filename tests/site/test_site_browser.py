"""The built site in a real browser (Debian's Chromium driven by Playwright), served from a
local static server: every report page renders its charts without console errors, a table
value matches the stored file, and no request goes to any other host."""

import contextlib
import functools
import http.server
import json
import re
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from site_build import AWAITING_RUN, DATA, REPORT_PAGES

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run",
]
ALL_CHARTS_SETTLED = """() => [...document.querySelectorAll('div.tilax-chart')]
    .every(e => e.dataset.rendered === 'yes' || e.dataset.rendered === 'failed')"""
CHART_REPORT = """() => [...document.querySelectorAll('div.tilax-chart')].map(e => {
    const source = e.closest('.tilax-figure').nextElementSibling;
    return {id: e.id, rendered: e.dataset.rendered,
            drawn: !!e.querySelector('svg, canvas'),
            source: source && source.matches('p.tilax-source')
                    ? [...source.querySelectorAll('a')].map(a => a.getAttribute('href')) : []};
})"""
TABLE_ROWS = """(id) => [...document.querySelectorAll(`#${id} tr`)]
    .map(tr => [...tr.children].map(cell => cell.textContent.replace(/\\s+/g, ' ').trim()))"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(site_dir):
    """A static server for ``site_dir`` on 127.0.0.1 at a random port; yields its base URL."""
    handler = functools.partial(QuietHandler, directory=str(site_dir))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        thread.join()


@pytest.fixture(scope="module")
def server(built_site):
    """The site (conftest.py: the one build of the stored data and the extra runs), served
    locally."""
    with serving(built_site) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                              args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


def open_page(browser, server, path):
    """Load ``path`` and wait for its charts; returns the page, console errors and requests.
    Requests to any other host are recorded and blocked."""
    context = browser.new_context()
    page = context.new_page()
    errors, requests = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    local = urlsplit(server).netloc
    context.route("**/*", lambda route: route.continue_()
                  if urlsplit(route.request.url).netloc == local else route.abort())
    page.goto(f"{server}/{path}", wait_until="load")
    page.wait_for_function(ALL_CHARTS_SETTLED, timeout=60_000)
    return page, errors, requests


class ReportView:
    """One report page, loaded once for the checks below: its page, console errors and the
    requests it made while loading."""

    def __init__(self, name, page, errors, requests):
        self.name, self.page, self.errors, self.requests = name, page, errors, requests

    def resize(self, width, height):
        """Lay the page out at ``width`` x ``height`` (the charts follow their container)."""
        self.page.set_viewport_size({"width": width, "height": height})
        self.page.wait_for_timeout(100)
        self.page.wait_for_function(ALL_CHARTS_SETTLED, timeout=60_000)


@pytest.fixture(scope="module", params=REPORT_PAGES)
def report_view(request, browser, server):
    """Each report page, loaded once per module and shared by the checks that take it (a page
    load is most of a check's time); every check sets the viewport it needs."""
    page, errors, requests = open_page(browser, server, f"reports/{request.param}.html")
    yield ReportView(request.param, page, errors, requests)
    page.context.close()


def test_report_page_renders_offline(report_view, server):
    name, page, errors, requests = (report_view.name, report_view.page, report_view.errors,
                                    report_view.requests)
    charts = page.evaluate(CHART_REPORT)
    if name == "runs":  # run panels are tables only
        assert page.locator("div.tilax-table table").count() > 0
    elif name == "history" and not charts:  # the stored data may hold no second dated run
        assert "no history to show" in page.locator("article").inner_text()
        return
    elif name in AWAITING_RUN and not charts:  # no stored run may hold the suite yet
        assert AWAITING_RUN[name] in page.locator("article").inner_text()
        assert errors == []
        return
    else:
        assert charts, f"{name} has no charts"
    for chart in charts:
        assert chart["rendered"] == "yes" and chart["drawn"], chart["id"]
        assert any(href.startswith("data/") and href.endswith(".json")
                   for href in chart["source"]), chart
    assert page.locator("div.tilax-table table").count() > 0
    assert errors == []
    local = urlsplit(server).netloc
    foreign = [url for url in requests
               if urlsplit(url).scheme in ("http", "https", "ws", "wss")
               and urlsplit(url).netloc != local]
    assert foreign == []
    assert any(url.endswith("/assets/vendor/vega-bundle.js") for url in requests)


def test_headline_table_value_matches_the_stored_file(browser, server):
    stored = json.loads((DATA / "results" / "rtx3090-moe-layer.json").read_text())["results"]
    row = next(r for r in stored if r["run"] == "f_gpu_a" and r["impl"] == "pallas"
               and r["dispatch"] == "sorted" and r["dtype"] == "bfloat16"
               and r["tokens"] == 32768 and r["op"] == "train_step")
    expected = f"{row['median_ms']:.2f} ({row['q1_ms']:.2f}–{row['q3_ms']:.2f})"
    page, _, _ = open_page(browser, server, "reports/index.html")
    header, *rows = page.evaluate(TABLE_ROWS, "headline-moe-32k")
    shown = next(r for r in rows if r[header.index("run (code)")].startswith("f_gpu_a")
                 and r[header.index("config")] == "E8 top-2 d512 h1024")
    assert shown[header.index("fastest exact impl")] == "pallas/sorted"
    assert shown[header.index("median ms (q1–q3)")] == expected
    page.context.close()


def test_raw_data_link_downloads_the_stored_bytes(browser, server):
    page, _, _ = open_page(browser, server, "reports/raw-data.html")
    href = page.locator("#raw-files a", has_text="h100-moe-decoder.json").get_attribute("href")
    response = page.request.get(f"{server}/reports/{href}")
    assert response.body() == (DATA / "results" / "h100-moe-decoder.json").read_bytes()
    page.context.close()


# The hand-written pages (docs/), as the built site names them.
DOC_PAGES = [
    "index.html", "getting-started.html", "guides/moe.html", "guides/scaling.html",
    "guides/kernel-sums.html", "guides/benchmarks.html", "contributing.html", "api/index.html",
    "api/moe.html", "api/rbf.html", "methodology.html", "performance/rbf.html",
    "performance/moe.html", "reports/schema.html",
]


@pytest.mark.parametrize("path", DOC_PAGES)
def test_doc_page_loads_offline(browser, server, path):
    """Guides, API reference and methodology load without console errors or foreign requests,
    and the API pages carry the rendered docstrings of the public names."""
    page, errors, requests = open_page(browser, server, path)
    assert page.locator("article h1").count() == 1, path
    assert errors == []
    local = urlsplit(server).netloc
    assert [url for url in requests
            if urlsplit(url).scheme in ("http", "https", "ws", "wss")
            and urlsplit(url).netloc != local] == []
    if path == "api/moe.html":
        for name in ("MoEConfig", "moe_init", "moe_apply"):
            assert page.locator(f"[id='tilax.{name}']").count() == 1, name
    if path == "api/rbf.html":
        for name in ("rbf_kernel_mv", "rbf_kde_density"):
            assert page.locator(f"[id='tilax.{name}']").count() == 1, name
    page.context.close()


SVG_TEXT_SIZES = """() => [...document.querySelectorAll('div.tilax-chart svg text')]
    .filter(t => t.textContent.trim() && t.getBBox().width > 0)
    .map(t => {
        const m = t.getScreenCTM();
        const scale = Math.hypot(m.a, m.b);
        return {text: t.textContent.trim().slice(0, 40),
                px: parseFloat(getComputedStyle(t).fontSize) * scale};
    })"""


def test_status_categories_are_measured_failed_skipped(browser, server):
    """The status chart and the file table keep skipped rows apart from failures."""
    page, errors, _ = open_page(browser, server, "reports/raw-data.html")
    legend = page.evaluate("""() => [...document.querySelectorAll(
        'div.tilax-chart svg .role-legend text')].map(t => t.textContent)""")
    assert {"measured", "failed", "skipped"} <= set(legend)
    header, *rows = page.evaluate(TABLE_ROWS, "raw-files")
    assert header[1:4] == ["measured", "failed", "skipped"]
    skipped_only = next(r for r in rows if r[0] == "l4-20260115-0dd5eed-rbf.json")
    assert skipped_only[1:4] == ["0", "0", "10"]
    assert errors == []
    page.context.close()


def test_empty_chart_is_replaced_by_its_sentence(browser, server):
    page, errors, _ = open_page(browser, server, "reports/rbf.html")
    empty = page.locator("p.tilax-empty", has_text="L4, run l4-20260115-0dd5eed")
    assert empty.count() >= 1
    text = empty.first.inner_text()
    assert text.startswith('No chart for "L4, run l4-20260115-0dd5eed')
    assert "skipped because: the run's time budget was spent before this row" in text
    assert page.locator("div.tilax-chart svg").count() > 0  # other charts still drawn
    assert errors == []
    page.context.close()


def test_history_view_flags_the_slower_run(browser, server, extra_runs):
    _, before, after = extra_runs
    page, errors, _ = open_page(browser, server, "reports/history.html")
    article = page.locator("article").inner_text().replace("\xa0", " ")
    assert f"run {after}" in article and f"run before it, {before}" in article
    page.evaluate("() => { for (const d of document.querySelectorAll('details')) d.open = true; }")
    header, *rows = page.evaluate(TABLE_ROWS, "history-flagged")
    if page.locator("#history-flagged-more").count():  # the flagged changes after the first
        rows += page.evaluate(TABLE_ROWS, "history-flagged-more")[1:]
    # other pairs of stored runs may differ too; every case of this pair is ~30% slower
    commits = f"{before.rsplit('-', 1)[1]} → {after.rsplit('-', 1)[1]}"
    pair = [r for r in rows if r[header.index("commits")] == commits]
    assert pair and all(r[header.index("change")] in ("slower by 29%", "slower by 30%",
                                                      "slower by 31%") for r in pair), pair[:3]
    # The timeline chart draws one case at a time; choosing another redraws it.
    select = page.locator(".vega-bindings select").first
    options = select.evaluate("s => [...s.options].map(o => o.value)")
    assert len(options) >= 2
    select.select_option(options[-1])
    page.wait_for_timeout(300)
    assert select.evaluate("s => s.value") == options[-1]
    assert errors == []
    page.context.close()


def test_no_chart_text_is_smaller_than_10px(report_view):
    report_view.resize(1280, 720)  # a laptop screen: the narrowest charts
    sizes = report_view.page.evaluate(SVG_TEXT_SIZES)
    small = [s for s in sizes if s["px"] < 10 - 1e-6]
    assert small == [], small[:5]


KEY_COLUMNS_OVERFLOW = """() => {
    for (const d of document.querySelectorAll('details')) d.open = true;
    const out = [];
    for (const div of document.querySelectorAll('div.tilax-table[data-key-columns]')) {
        const table = div.querySelector('table');
        if (!table) continue;
        const box = (table.closest('.md-typeset__scrollwrap') || div).getBoundingClientRect();
        const keys = Number(div.dataset.keyColumns);
        const cells = [...table.querySelectorAll('thead th')].slice(0, keys);
        const right = Math.max(...cells.map(c => c.getBoundingClientRect().right));
        if (right > Math.min(box.right, window.innerWidth) + 1)
            out.push({id: div.id, right: right, visible: box.right});
    }
    return out;
}"""


def test_key_columns_need_no_horizontal_scrolling_at_1280px(report_view):
    report_view.resize(1280, 900)
    assert report_view.page.evaluate(KEY_COLUMNS_OVERFLOW) == []


# What a reader sees: the home page's first screen, and report pages of a few screens each.
SCREEN = {"width": 1440, "height": 900}
MAX_SCREENS = 25
MAX_CHART_HEIGHT = 1000
MAX_SERIES = 8
FIRST_SCREEN = """() => {
    const inView = e => { const r = e.getBoundingClientRect();
                          return r.height > 0 && r.top >= 0 && r.bottom <= innerHeight; };
    const text = [...document.querySelectorAll('article p, article li, article td, article th')]
        .filter(inView).map(e => e.textContent.replace(/\\s+/g, ' ')).join(' \\n ');
    const links = [...document.querySelectorAll('article a[href]')].filter(inView)
        .map(a => a.getAttribute('href'));
    return {text, links};
}"""
PAGE_HEIGHT_COLLAPSED = """() => {
    for (const d of document.querySelectorAll('details')) d.open = false;
    return document.documentElement.scrollHeight;
}"""
CHART_SHAPES = """() => {
    for (const d of document.querySelectorAll('details')) d.open = true;
    return [...document.querySelectorAll('div.tilax-chart')].map(e => ({
        id: e.id,
        height: e.querySelector('svg') ? e.querySelector('svg').getBoundingClientRect().height
                                       : 0,
        series: e.querySelectorAll('.role-legend-symbol path').length,
        cut: [...e.querySelectorAll('svg text')].map(t => t.textContent)
             .filter(t => t.endsWith('…')),
        undefined: [...e.querySelectorAll('svg text')].map(t => t.textContent)
             .filter(t => t === 'undefined' || t === 'null'),
    }));
}"""


def test_home_first_screen_names_the_peers_with_ratios_and_a_stored_file(browser, server,
                                                                          extra_runs):
    """At 1440 x 900 the home page's first screen says how tilax compares with PyTorch and
    tokamax, in ratios, and links a stored result file, served byte for byte."""
    context = browser.new_context(viewport=SCREEN)
    page = context.new_page()
    page.goto(f"{server}/index.html", wait_until="load")
    page.wait_for_function(ALL_CHARTS_SETTLED, timeout=60_000)
    seen = page.evaluate(FIRST_SCREEN)
    text = seen["text"].replace("\xa0", " ")
    for peer in ("PyTorch compiled", "tokamax"):
        assert re.search(rf"\d+\.\d+× (faster|slower) than {peer}", text), (peer, text[:600])
    stored = [href for href in seen["links"]
              if href.startswith("reports/data/") and href.endswith(".json")]
    assert stored, seen["links"]
    data_dir = extra_runs[0]
    for href in stored:
        response = page.request.get(f"{server}/{href}")
        name = href.removeprefix("reports/data/")
        assert response.ok and response.body() == (data_dir / "results" / name).read_bytes()
    context.close()


def test_report_page_is_a_few_screens_with_readable_charts(report_view):
    """With the "Earlier runs" sections closed, the page is at most 25 screens at 1440 x 900;
    every chart (earlier runs' too) is at most 1,000 px tall, draws at most 8 series, cuts
    no label short and labels nothing 'undefined'."""
    report_view.resize(SCREEN["width"], SCREEN["height"])
    page = report_view.page
    height = page.evaluate(PAGE_HEIGHT_COLLAPSED)
    assert height <= MAX_SCREENS * SCREEN["height"], f"{report_view.name}: {height} px"
    shapes = page.evaluate(CHART_SHAPES)
    assert [c for c in shapes if c["height"] > MAX_CHART_HEIGHT] == []
    assert [c for c in shapes if c["series"] > MAX_SERIES] == []
    assert [c for c in shapes if c["cut"]] == []
    assert [c for c in shapes if c["undefined"]] == []  # a field missing from the data
