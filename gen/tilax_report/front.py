"""The headline that opens the home page and the README's "Headline numbers" section.

One function, `headline_markdown`, writes it for both places from the stored rows
(`headlines.peer_headline` and `headlines.rbf_headline` choose them); only the links differ
(`SITE_LINKS`, `README_LINKS`). The site build puts it into the home page (docs/index.md, at
`HOME_MARKER`); the README keeps a copy that tests/packaging/test_readme_numbers.py compares
with a fresh one. After new results are stored, refresh the README's copy with

    PYTHONPATH=gen python -m tilax_report.front

(from the repository root; it rewrites only the section under `README_SECTION`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import altair as alt
import pandas as pd

from . import analysis, charts, headlines, verdict
from .load import StoredResults, load_results
from .prepared import prepared
from .render import (
    Page,
    fmt_ms,
    fmt_size,
    join_names,
    repeats_note,
    run_anchor,
    short_error,
    source_files,
    verdict_phrase,
)

README_SECTION = "## Headline numbers"
# The line of docs/index.md that the site build replaces with the headline.
HOME_MARKER = "<!-- headline: generated at build time by gen/tilax_report/front.py -->"
PEER_NAMES = {"PyTorch compiled": "PyTorch compiled", "tokamax": "tokamax",
              "lax.ragged_dot": "`lax.ragged_dot`"}


@dataclass(frozen=True)
class Links:
    """Where the headline's links point from the page that shows it."""

    data: str  # a stored file: this prefix + its name
    reports: str  # a report page: this prefix + its name + `report_ext`
    report_ext: str
    docs: str  # a hand-written page: this prefix + its path under docs/
    runs_page: bool  # link each run to its panel on the runs page


SITE_LINKS = Links(data="reports/data/", reports="reports/", report_ext=".md", docs="",
                   runs_page=True)
OVERVIEW_LINKS = Links(data="data/", reports="", report_ext=".md", docs="../", runs_page=True)
README_LINKS = Links(data="data/results/", reports="https://OWNER.github.io/tilax/latest/reports/",
                     report_ext=".html", docs="docs/", runs_page=False)


def setting_label(config: str, tokens: int) -> str:
    """'E8 top-2, d512 h1024, 131,072 tokens' from the config label and the tokens."""
    parts = re.fullmatch(r"(E\d+ top-\d+) (d\d+ h\d+)(?: (shared \d+))?", config)
    words = [p for p in parts.groups() if p] if parts else [config]
    return ", ".join([*words, f"{tokens:,} tokens"])


def short_setting(config: str, tokens: int) -> str:
    """'E8 131k': a chart's axis label."""
    return f"{config.split()[0]} {fmt_size(tokens)}"


def _file_link(name: str, links: Links, text: str | None = None) -> str:
    return f"[{text or name}]({links.data}{name})"


def _run_text(run: str, links: Links) -> str:
    if links.runs_page:
        return f"[`{run}`]({links.reports}runs{links.report_ext}#{run_anchor(run)})"
    return f"`{run}`"


def _cell_text(cell: pd.Series, column: str) -> str:
    """A table cell: 'median (q1–q3)', with the impl/dispatch for the fastest column; a failed
    or skipped row says so."""
    if cell["status"] == "measured":
        text = fmt_ms(cell["median_ms"], cell["q1_ms"], cell["q3_ms"])
        text = f"{text} {cell['label']}" if column == headlines.FASTEST_COLUMN else text
        repeats = repeats_note(cell["repeats"], cell["repeat_min_ms"], cell["repeat_max_ms"])
        return f"{text} ({repeats})" if repeats else text
    return _not_timed(cell)


def _not_timed(cell: pd.Series) -> str:
    error = str(cell["error"])
    if cell["status"] == "skipped":
        earlier = re.search(r"\(tokens=(\d+)\) already failed with: .*out of memory", error,
                            re.I | re.S)
        if earlier:
            return f"not run (out of memory at {int(earlier[1]):,} tokens)"
        return "not run"
    kind = analysis.failure_kind(error)
    return f"failed ({kind})" if kind != "error" else f"failed ({short_error(error, 40)})"


def _ratio(default: pd.Series, other: pd.Series) -> dict:
    """``other``'s median over the default's, with the noise verdict (`verdict.compare`)."""
    return verdict.compare(default, other)


def _peer_phrase(default: pd.Series, cell: pd.Series, column: str) -> str:
    name = PEER_NAMES[column]
    if cell["status"] != "measured":
        return f"{name} {_not_timed(cell)}"
    lead = _ratio(default, cell)
    return verdict_phrase(lead["ratio"], lead["clear"], name, lead["method"])


def _rounds_text(cells: pd.DataFrame) -> str:
    rounds = cells.loc[cells["status"] == "measured", "rounds"].dropna().astype(int).unique()
    return f"{rounds[0]} rounds" if len(rounds) == 1 else "rounds as stored"


def moe_markdown(found: headlines.PeerHeadline, links: Links, dates: pd.Series,
                 chart: str = "") -> str:
    """The MoE part; ``chart`` (Markdown) goes right under the table."""
    cells = found.cells
    settings = list(dict.fromkeys(zip(cells["setting"], cells["tokens"], strict=True)))
    tokamax = cells.loc[cells["column"] == "tokamax", "tokamax"].dropna()
    headers = {column: PEER_NAMES.get(column, column) for column in headlines.COLUMNS}
    if not tokamax.empty:
        headers["tokamax"] = f"tokamax {tokamax.iloc[0]}"
    files = {}  # every stored file behind a cell -> the settings it holds, for the links
    for config, tokens in settings:
        held = cells[(cells["setting"] == config) & (cells["tokens"] == tokens)]
        for source in source_files(held):
            files.setdefault(source, []).append(config.split(" d")[0])
    date = dates.get(found.run)
    lines = []
    first = settings[0]
    first_cells = cells[(cells["setting"] == first[0]) & (cells["tokens"] == first[1])]
    by_column = {r["column"]: r for _, r in first_cells.iterrows()}
    default = by_column[headlines.DEFAULT_COLUMN]
    phrases = [f"**{_peer_phrase(default, by_column[c], c)}**" if c != "lax.ragged_dot"
               else _peer_phrase(default, by_column[c], c) for c in headlines.PEER_COLUMNS]
    lines.append(
        f"**MoE layer, bf16 train step, one {found.device}** (run {_run_text(found.run, links)}"
        f"{f', {date}' if isinstance(date, str) and links.runs_page else ''}). At "
        f"{setting_label(*first)}, tilax's default settings take "
        f"{fmt_ms(default['median_ms'])} ms: {join_names(phrases)}. Stored files (one process "
        "each): " + ", ".join(_file_link(f, links, f"{' and '.join(dict.fromkeys(held))}")
                              for f, held in files.items()) + ".\n")
    header = (f"| bf16 train step, ms: median (q1–q3), {_rounds_text(cells)} | "
              + " | ".join(headers.values()) + " |")
    lines += [header, "| --- " * (len(headers) + 1) + "|"]
    for config, tokens in settings:
        row = cells[(cells["setting"] == config) & (cells["tokens"] == tokens)]
        by_column = {r["column"]: r for _, r in row.iterrows()}
        label = _file_link(by_column[headlines.DEFAULT_COLUMN]["source_file"], links,
                           setting_label(config, tokens))
        lines.append(f"| {label} | " + " | ".join(
            _cell_text(by_column[c], c) for c in headlines.COLUMNS) + " |")
    lines.append("")
    if chart:
        lines += [chart, ""]
    lines.append("tilax's default against each peer, within one stored file (each row of the "
                 "table links its file; a ratio is called faster or slower only beyond the "
                 f"noise: [methodology]({links.docs}methodology.md#verdicts)):\n")
    for config, tokens in settings:
        row = cells[(cells["setting"] == config) & (cells["tokens"] == tokens)]
        by_column = {r["column"]: r for _, r in row.iterrows()}
        default = by_column[headlines.DEFAULT_COLUMN]
        phrases = [_peer_phrase(default, by_column[c], c) for c in headlines.PEER_COLUMNS]
        lines.append(f"- {setting_label(config, tokens)}: {join_names(phrases)}.")
    lines.append("")
    lines.append(
        "*Default*: `impl=\"auto\"`, `dispatch=\"sorted\"` (on an H200 the Mosaic GPU kernels, "
        "stored as `mosaic/sorted`; the rules are in the "
        f"[MoE guide]({links.docs}guides/moe.md#choosing-impl-and-dispatch)); *fastest*: the "
        "fastest Pallas `impl`/`dispatch` in the file. *PyTorch compiled*: `torch._grouped_mm` "
        "experts under `torch.compile`; *tokamax*: the same layer with tokamax's `ragged_dot` "
        "for the experts (the [benchmarks guide]"
        f"({links.docs}guides/benchmarks.md) says how). A train step is forward and backward "
        "with respect to the parameters and the input.")
    return "\n".join(lines)


def rbf_markdown(found: headlines.RbfHeadline, links: Links) -> str:
    cells = found.cells
    columns = [c for c in headlines.RBF_COLUMNS if c in set(cells["column"])]
    ops = {"fwd": "forward (`fwd`)", "fwd_bwd": "forward + backward (`fwd_bwd`)"}
    sentences = []
    for op in headlines.RBF_OPS:
        per_op = cells[cells["op"] == op]
        tilax = per_op[per_op["label"] == headlines.RBF_TILAX]
        if tilax.empty or tilax.iloc[0]["status"] != "measured":
            continue
        phrases = []
        for _, cell in per_op.iterrows():
            if cell["label"] == headlines.RBF_TILAX:
                continue
            name = cell["column"]
            if cell["status"] != "measured":
                phrases.append(f"{name} {_not_timed(cell)}")
                continue
            lead = _ratio(tilax.iloc[0], cell)
            phrases.append(verdict_phrase(lead["ratio"], lead["clear"], name, lead["method"]))
        sentences.append(f"{ops[op].split(' (')[0]}: {join_names(phrases)}")
    lines = [
        f"**RBF kernel sums, one {found.device}** (run {_run_text(found.run, links)}; "
        f"{found.config}, n = m = {found.n:,}; "
        f"{_file_link(found.source_file, links, 'stored file')}). tilax's fused Pallas kernel "
        "sum (`rbf_kernel_mv`, default precision): " + "; ".join(sentences) + ".\n",
        f"| ms: median (q1–q3), {_rounds_text(cells)} | " + " | ".join(columns) + " |",
        "| --- " * (len(columns) + 1) + "|",
    ]
    for op in headlines.RBF_OPS:
        per_op = {r["column"]: r for _, r in cells[cells["op"] == op].iterrows()}
        if not per_op:
            continue
        lines.append(f"| {ops[op]} | " + " | ".join(
            _cell_text(per_op[c], c) if c in per_op else "" for c in columns) + " |")
    return "\n".join(lines)


# The results chosen from last (held, so that the id is not reused) and what was chosen.
_last: list[tuple[StoredResults, tuple]] = []


def chosen(results: StoredResults) -> tuple[headlines.PeerHeadline | None,
                                            headlines.RbfHeadline | None]:
    """The MoE and RBF headlines of ``results``, chosen once (home page, overview, README)."""
    if not (_last and _last[0][0] is results):
        ready = prepared(results)
        _last[:] = [(results, (headlines.peer_headline(ready.table, ready.order),
                               headlines.rbf_headline(ready.table, ready.order)))]
    return _last[0][1]


def headline_markdown(results: StoredResults, links: Links, chart: str = "") -> str:
    """The headline in Markdown, links as ``links`` says; ``chart`` (Markdown) under the MoE
    table."""
    ready = prepared(results)
    parts = []
    moe, rbf = chosen(results)
    if moe is None:
        parts.append(f"No stored run on the {headlines.PEER_GPU} holds the MoE layer's train "
                     "step for tilax and every peer at the headline settings.")
    else:
        parts.append(moe_markdown(moe, links, ready.dates, chart))
    if rbf is not None:
        parts.append(rbf_markdown(rbf, links))
    parts.append(
        "Every implementation, size and run: the reports on the "
        f"[MoE layer]({links.reports}moe-layer{links.report_ext}), the "
        f"[MoE decoder]({links.reports}moe-decoder{links.report_ext}) and the "
        f"[RBF kernels]({links.reports}rbf{links.report_ext}).")
    return "\n\n".join(parts) + "\n"


def home_page(results: StoredResults, hand_written: str) -> str:
    """docs/index.md with the headline (text, table, chart) where `HOME_MARKER` stands."""
    found, _ = chosen(results)
    chart = ""
    if found is not None:
        page = Page("home", raw_dir=SITE_LINKS.data.rstrip("/"))
        page.chart(moe_chart_object(found), found.rows, "Each point: an implementation's "
                   "median time over tilax default's, in the same file; hover for the times.")
        chart = page.render().strip("\n")
    return hand_written.replace(HOME_MARKER,
                                boxed(headline_markdown(results, SITE_LINKS, chart)))


def boxed(headline: str) -> str:
    """The headline in its block (docs/assets/tilax.css: compact table)."""
    return f'<div class="tilax-headline" markdown="1">\n\n{headline}\n</div>'


def moe_chart_object(found: headlines.PeerHeadline) -> alt.TopLevelMixin:
    cells = analysis.timed(found.cells)
    default = cells[cells["column"] == headlines.DEFAULT_COLUMN].set_index(
        ["setting", "tokens"])["median_ms"]
    data = cells.assign(
        case=[short_setting(c, t) for c, t in zip(cells["setting"], cells["tokens"],
                                                  strict=True)],
        implementation=cells["column"],
        relative=[m / default[(c, t)] for m, c, t in
                  zip(cells["median_ms"], cells["setting"], cells["tokens"], strict=True)],
    )
    data = data[["case", "implementation", "label", "relative", "median_ms", "q1_ms", "q3_ms",
                 "rounds", "source_file", "run"]]
    order = list(dict.fromkeys(data["case"]))
    colours = ["#4c78a8", "#9ecae9", "#e45756", "#f58518", "#79706e"]
    select = alt.selection_point(fields=["implementation"], bind="legend")
    points = alt.Chart(data).mark_point(filled=True, size=90).encode(
        alt.X("relative:Q", title="time / tilax default's time (log scale)",
              scale=alt.Scale(type="log", nice=False, padding=12),
              axis=alt.Axis(format="~g", values=[1, 1.5, 2, 3, 5, 10, 20])),
        alt.Y("case:N", title=None, sort=order),
        alt.Color("implementation:N", title=None, sort=headlines.COLUMNS,
                  scale=alt.Scale(domain=headlines.COLUMNS, range=colours)),
        alt.Shape("implementation:N", title=None, sort=headlines.COLUMNS,
                  scale=alt.Scale(domain=headlines.COLUMNS,
                                  range=["circle", "circle", "square", "diamond",
                                         "triangle-up"])),
        opacity=alt.condition(select, alt.value(0.95), alt.value(0.15)),
        tooltip=charts.tooltip(["implementation", "label", "case", "median_ms", "q1_ms",
                                "q3_ms", "rounds", alt.Tooltip("relative", format=".2f"),
                                "source_file"]),
    ).add_params(select)
    rule = alt.Chart(data).mark_rule(color="#555", strokeDash=[4, 3]).encode(x=alt.datum(1))
    return charts.finish(alt.layer(rule, points).properties(width=420, height=alt.Step(26)),
                         "bf16 MoE train step: time over tilax default's (left of 1: faster)")


README_NOTE = ("<!-- Generated from data/results/ by gen/tilax_report/front.py (the home page "
               "shows the same); refresh with: PYTHONPATH=gen python -m tilax_report.front -->")


def readme_section(results: StoredResults) -> str:
    """The body of the README's `README_SECTION`, as `refresh_readme` writes it."""
    return f"{README_NOTE}\n\n{headline_markdown(results, README_LINKS)}"


def section_body(readme: str) -> tuple[int, int]:
    """Where the body of ``readme``'s `README_SECTION` starts and ends."""
    start = readme.index(README_SECTION) + len(README_SECTION)
    end = readme.find("\n## ", start)
    return start, len(readme) if end < 0 else end + 1


def refresh_readme(path: Path = Path("README.md")) -> bool:
    """Rewrite the README's headline from the stored results; True if it changed."""
    before = path.read_text(encoding="utf-8")
    start, end = section_body(before)
    after = before[:start] + "\n\n" + readme_section(load_results()) + "\n" + before[end:]
    path.write_text(after, encoding="utf-8")
    return after != before


if __name__ == "__main__":
    print("README.md headline " + ("rewritten" if refresh_readme() else "already current"))
