"""The built site in a real browser (Debian's Chromium driven by Playwright), served from a
local static server: every report page renders its charts without console errors, a table
value matches the stored file, and no request goes to any other host."""

import contextlib
import functools
import http.server
import json
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from site_build import DATA, REPORT_PAGES

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


@pytest.fixture(scope="module", params=["stored", "with_h200"])
def server(request):
    """The site built from the stored data, and the one built with an extra pytest-benchmark
    run (H200), each served locally."""
    fixture = "built_site" if request.param == "stored" else "built_site_with_h200"
    with serving(request.getfixturevalue(fixture)) as url:
        yield url


@pytest.fixture(scope="module")
def stored_server(built_site):
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


@pytest.mark.parametrize("name", REPORT_PAGES)
def test_report_page_renders_offline(browser, server, name):
    page, errors, requests = open_page(browser, server, f"reports/{name}.html")
    charts = page.evaluate(CHART_REPORT)
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
    page.context.close()


def test_headline_table_value_matches_the_stored_file(browser, stored_server):
    stored = json.loads((DATA / "results" / "rtx3090-moe-layer.json").read_text())["results"]
    row = next(r for r in stored if r["run"] == "f_gpu_a" and r["impl"] == "pallas"
               and r["dispatch"] == "sorted" and r["dtype"] == "bfloat16"
               and r["tokens"] == 32768 and r["op"] == "train_step")
    expected = f"{row['median_ms']:.2f} ({row['q1_ms']:.2f}–{row['q3_ms']:.2f})"
    page, _, _ = open_page(browser, stored_server, "reports/index.html")
    header, *rows = page.evaluate(TABLE_ROWS, "headline-moe-32k")
    shown = next(r for r in rows if r[header.index("run (code)")].startswith("f_gpu_a"))
    assert shown[header.index("fastest exact impl")] == "pallas/sorted"
    assert shown[header.index("median ms (q1–q3)")] == expected
    page.context.close()


def test_raw_data_link_downloads_the_stored_bytes(browser, stored_server):
    page, _, _ = open_page(browser, stored_server, "reports/raw-data.html")
    href = page.locator("#raw-files a", has_text="h100-moe-decoder.json").get_attribute("href")
    response = page.request.get(f"{stored_server}/reports/{href}")
    assert response.body() == (DATA / "results" / "h100-moe-decoder.json").read_bytes()
    page.context.close()


# The hand-written pages (docs/), as the built site names them.
DOC_PAGES = [
    "index.html", "getting-started.html", "guides/moe.html", "guides/rbf.html",
    "guides/benchmarks.html", "contributing.html", "api/index.html", "api/moe.html",
    "api/rbf.html", "methodology.html", "reports/schema.html",
]


@pytest.mark.parametrize("path", DOC_PAGES)
def test_doc_page_loads_offline(browser, stored_server, path):
    """Guides, API reference and methodology load without console errors or foreign requests,
    and the API pages carry the rendered docstrings of the public names."""
    page, errors, requests = open_page(browser, stored_server, path)
    assert page.locator("article h1").count() == 1, path
    assert errors == []
    local = urlsplit(stored_server).netloc
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
