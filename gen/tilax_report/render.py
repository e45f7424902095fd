"""Markdown building blocks for the report pages: charts, tables, source lines, number formats.

A chart is an Altair chart embedded as its Vega-Lite JSON spec in a ``<script
type="application/json">`` next to an empty ``div.tilax-chart``; the vendored vega-embed renders
it in the browser (docs/assets/tilax-charts.js). Tables are pandas frames written as Markdown.
Every chart and table is followed by a ``.tilax-source`` line naming and linking the stored
files (and runs) its rows come from. A chart with nothing to draw is replaced by one sentence
saying why (``p.tilax-empty``).
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import re
from collections.abc import Iterable

import altair as alt
import pandas as pd

# Table cells up to this long do not wrap (labels, numbers with their spread); longer text
# (error messages, notes) wraps.
NOWRAP_CHARS = 32
# Where the report pages find the byte-for-byte copies of the stored files (relative link).
RAW_DIR = "data"


class Page:
    """A report page under construction: Markdown text plus numbered charts and tables."""

    def __init__(self, slug: str, title: str | None = None, raw_dir: str = RAW_DIR):
        """``title``: the page's heading (none for a part of a hand-written page);
        ``raw_dir``: where the stored files' copies are, relative to the page."""
        self.slug = slug
        self.raw_dir = raw_dir
        self.folded = False  # inside `collapsed`: headings become bold lines
        self.parts: list[str] = [f"# {title}\n"] if title else []
        self._count = 0

    def md(self, text: str) -> None:
        self.parts.append(text.strip("\n") + "\n")

    def chart(self, chart: alt.TopLevelMixin, rows: pd.DataFrame, caption: str = "",
              empty: str | None = None) -> None:
        """Embed ``chart``; ``rows`` are the table rows behind it (for the source line). When
        the chart has no data to draw, write one sentence instead: ``empty`` if given, else
        one built from the status of ``rows``."""
        self._count += 1
        chart_id = f"{self.slug}-chart-{self._count}"
        spec = chart_spec(chart)
        if not has_data(spec):
            sentence = empty or nothing_to_draw(spec_title(spec), rows)
            self.parts.append(f'<p class="tilax-empty" id="{chart_id}">'
                              f"{html.escape(sentence, quote=False)}"
                              f"</p>\n\n{source_line(rows, raw_dir=self.raw_dir)}\n")
            return
        spec_json = json.dumps(spec, separators=(",", ":"), allow_nan=False, default=str)
        spec_json = spec_json.replace("</", "<\\/")
        files = " ".join(source_files(rows))
        self.parts.append(
            f'<div class="tilax-figure">\n'
            f'<div class="tilax-chart" id="{chart_id}" data-sources="{html.escape(files)}"></div>\n'
            f'<script type="application/json" data-chart-for="{chart_id}">{spec_json}</script>\n'
            f"</div>\n\n{source_line(rows, caption, self.raw_dir)}\n"
        )

    def table(self, frame: pd.DataFrame, rows: pd.DataFrame, caption: str = "",
              name: str | None = None, collapsed: str | None = None,
              markdown_columns: Iterable[str] = (), key_columns: int = 3) -> None:
        """A pandas table; ``rows`` are the tidy rows behind it. ``collapsed``: a summary line
        to fold the table under (for long tables). ``markdown_columns`` hold Markdown (links)
        written as is. The first ``key_columns`` columns are the ones a reader needs to see
        without scrolling (the browser tests check they fit at 1280 px)."""
        self._count += 1
        table_id = name or f"{self.slug}-table-{self._count}"
        files = " ".join(source_files(rows))
        body = (
            f'<div class="tilax-table" id="{table_id}" data-sources="{html.escape(files)}" '
            f'data-key-columns="{key_columns}" markdown="1">\n\n'
            f"{markdown_table(frame, markdown_columns)}\n\n</div>\n\n"
            f"{source_line(rows, caption, self.raw_dir)}\n"
        )
        if collapsed:
            body = (f'<details class="tilax-details" markdown="1">\n'
                    f"<summary>{html.escape(collapsed)}</summary>\n\n{body}\n</details>\n")
        self.parts.append(body)

    def heading(self, level: int, text: str) -> None:
        """A heading; inside a folded section a bold line instead, so that the table of
        contents lists only what the page shows open."""
        self.md(f"**{text}**" if self.folded else f"{'#' * level} {text}\n")

    @contextlib.contextmanager
    def collapsed(self, summary: str):
        """Everything written inside the ``with`` block goes into one closed ``<details>``
        (older runs under the newest): nothing when the block wrote nothing."""
        start, folded = len(self.parts), self.folded
        self.folded = True
        try:
            yield
        finally:
            self.folded = folded
        inner = self.parts[start:]
        del self.parts[start:]
        if inner:
            self.parts.append(
                f'<details class="tilax-details tilax-earlier" markdown="1">\n'
                f"<summary>{html.escape(summary)}</summary>\n\n" + "\n".join(inner)
                + "\n</details>\n")

    def render(self) -> str:
        return "\n".join(self.parts)


def has_data(spec: dict) -> bool:
    """Whether a chart spec has any data row to draw (inline datasets or values)."""
    datasets = spec.get("datasets") or {}
    values = (spec.get("data") or {}).get("values")
    return any(len(rows) for rows in datasets.values()) or bool(values)


def spec_title(spec: dict) -> str:
    title = spec.get("title") or ""
    if isinstance(title, dict):
        title = title.get("text", "")
    return " ".join(title) if isinstance(title, list) else str(title)


def nothing_to_draw(title: str, rows: pd.DataFrame) -> str:
    """'No chart for "T": none of the 54 cases behind it was measured (54 skipped: not
    attempted).' from the status of the chart's rows."""
    what = f'No chart for "{title}"' if title else "No chart here"
    if rows.empty:
        return f"{what}: no stored row has these cases."
    counts = rows.drop_duplicates(["source_file", "source_row"])["status"].value_counts()
    parts = [f"{counts[s]} {s}" for s in ("failed", "skipped") if counts.get(s)]
    if counts.get("measured"):
        parts.insert(0, f"{counts['measured']} measured but with no value to plot here")
    reasons = ""
    skipped = rows[rows["status"] == "skipped"]["error"].dropna()
    if not skipped.empty:
        reasons = f"; skipped because: {skip_gist(skipped.mode().iloc[0])}"
    n = int(counts.sum())
    return (f"{what}: none of the {plural(n, 'case')} behind it has a time to draw ("
            + ", ".join(parts) + reasons + "). The tables below list them.")


def skip_gist(message: object) -> str:
    """Why a row was not attempted, without the 'skipped: not attempted,' prefix and the
    numbers that differ per row: 'the run's time budget was spent before this row'."""
    text = str(message).strip()
    text = re.sub(r"^skipped:\s*(not attempted,\s*)?", "", text)
    text = re.sub(r"\s*\(measured [^)]*\)", "", text)
    text = re.sub(r" of \d+(\.\d+)? s", "", text)
    text = re.sub(r"predicted [\d.e+]+ s per call", "predicted time per call", text)
    text = re.sub(r"times \d+ calls ", "", text)
    text = re.sub(r"about \d+ GiB", "too much memory", text)
    text = re.sub(r"\(n=\d+\)", "", text)
    return short_error(text, limit=100)


def chart_spec(chart: alt.TopLevelMixin) -> dict:
    """The chart's Vega-Lite spec, each of its frames embedded once as a named dataset holding
    only the columns the spec refers to, without missing values. Altair would convert every
    column of the tidy table, most of which a chart never shows: choosing the columns before
    the conversion took the site's build from 31.5 to 25 s on a 2-core machine."""
    frames: dict[str, pd.DataFrame] = {}

    def name_frame(data: pd.DataFrame) -> dict:
        name = next((n for n, f in frames.items() if f is data), f"data-{len(frames)}")
        frames[name] = data
        return {"name": name}

    alt.data_transformers.register(_NAMED_FRAMES, name_frame)
    with alt.data_transformers.enable(_NAMED_FRAMES):
        spec = chart.to_dict(validate=False)
    if frames:
        named = json.dumps({k: v for k, v in spec.items() if k != "datasets"})
        datasets = spec.setdefault("datasets", {})  # beside Altair's own (inline values)
        for name, frame in frames.items():
            datasets[name] = _records(frame[used_columns(frame, named)])
    return spec


_NAMED_FRAMES = "tilax_named_frames"


def used_columns(frame: pd.DataFrame, spec_text: str) -> list[str]:
    """The columns of ``frame`` that ``spec_text`` (a spec as JSON) names: as a field (as JSON
    writes it: 'GPU · suite' is "GPU \\u00b7 suite" there), or in an expression
    (``datum.x``, ``datum['x']``)."""
    return [name for name in frame.columns if json.dumps(str(name)) in spec_text
            or f"datum.{name}" in spec_text or f"datum['{name}']" in spec_text]


def _records(frame: pd.DataFrame) -> list[dict]:
    values = alt.utils.data.to_values(frame)["values"]
    return [{k: v for k, v in record.items() if v is not None} for record in values]


def source_files(rows: pd.DataFrame) -> list[str]:
    """Every stored file behind ``rows``: each row's own and, for a case measured more than
    once in its run, every repeat's (``source_files``)."""
    return sorted(_files_of(rows).explode().dropna().unique())


def _files_of(rows: pd.DataFrame) -> pd.Series:
    """Per row, the tuple of stored files behind it."""
    own = rows["source_file"].map(lambda f: (f,) if isinstance(f, str) else ())
    if "source_files" not in rows:
        return own
    return pd.Series([tuple(sorted(set(a) | set(b if isinstance(b, tuple) else ())))
                      for a, b in zip(own, rows["source_files"], strict=True)],
                     index=rows.index, dtype="object")


def source_line(rows: pd.DataFrame, caption: str = "", raw_dir: str = RAW_DIR) -> str:
    """'Source: [file](data/file) (runs a, b)' as a paragraph with class tilax-source."""
    parts = []
    per_file = rows[["run"]].assign(file=_files_of(rows)).explode("file").dropna(subset="file")
    runs_of = per_file.dropna().groupby("file")["run"].unique()
    for name in sorted(per_file["file"].unique()):
        runs = sorted(runs_of.get(name, []))
        shown = ", ".join(f"`{r}`" for r in runs[:8]) + (f" and {len(runs) - 8} more"
                                                        if len(runs) > 8 else "")
        label = "run" if len(runs) == 1 else "runs"
        parts.append(f"[{name}]({raw_dir}/{name})" + (f" ({label} {shown})" if runs else ""))
    text = "Source: " + ("; ".join(parts) if parts else "no stored rows")
    if caption:
        text += ". " + caption.strip()
    return text + "\n{: .tilax-source }"


def markdown_table(frame: pd.DataFrame, markdown_columns: Iterable[str] = ()) -> str:
    """A Markdown pipe table of ``frame``; cells are escaped text except in
    ``markdown_columns``."""
    if frame.empty:
        return "*(no rows)*"
    raw = [column in set(markdown_columns) for column in frame.columns]
    header = "| " + " | ".join(_cell(c) for c in frame.columns) + " |"
    align = "| " + " | ".join(
        "---:" if pd.api.types.is_numeric_dtype(frame[c]) else "---" for c in frame.columns
    ) + " |"
    lines = [header, align]
    for values in frame.itertuples(index=False):
        cells = (str(v) if keep else _cell(v) for v, keep in zip(values, raw, strict=True))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return ""
    if isinstance(value, float):
        text = fmt_num(value)
    else:
        text = str(value)
    text = html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")
    if len(text) <= NOWRAP_CHARS:
        # short labels stay on one line, except after a " · " separator ("10 · wide spread")
        text = text.replace(" ", "\u00a0").replace("\u00a0·\u00a0", "\u00a0· ")
    # Markdown emphasis characters in identifiers (fused_gsum, *_rerun) stay literal.
    return text.replace("_", "\\_").replace("*", "\\*")


def decimals_for(value: float, digits: int = 4) -> int:
    """Decimals that show ``digits`` significant digits of ``value`` (at least 0)."""
    if value == 0 or not math.isfinite(value):
        return 0
    return max(0, digits - 1 - math.floor(math.log10(abs(value))))


def fmt_num(value: float | None, digits: int = 4) -> str:
    if value is None or pd.isna(value):
        return ""
    if abs(value) >= 1e6 or (value != 0 and abs(value) < 1e-3):
        return f"{value:.{digits - 1}e}"
    return f"{value:.{decimals_for(value, digits)}f}"


def fmt_ms(median: float | None, q1: float | None = None, q3: float | None = None,
           unit: str = "") -> str:
    """'16.01 (15.95–16.10)': the median and its q1–q3 spread with the same decimals;
    ``unit`` goes after the median ('16.01 ms (15.95–16.10)')."""
    if median is None or pd.isna(median):
        return ""
    places = decimals_for(median)
    text = f"{median:.{places}f}" + (f" {unit}" if unit else "")
    if q1 is not None and q3 is not None and not pd.isna(q1) and not pd.isna(q3):
        text += f" ({q1:.{places}f}–{q3:.{places}f})"
    return text


def fmt_ratio(ratio: float | None) -> str:
    """'1.21×', '15.2×', '150×'."""
    if ratio is None or pd.isna(ratio):
        return ""
    places = 2 if ratio < 10 else 1 if ratio < 100 else 0
    return f"{ratio:.{places}f}×"


def fmt_int(value: object) -> str:
    if value is None or pd.isna(value):
        return ""
    return f"{int(value):,}".replace(",", " ")


def fmt_size(value: object) -> str:
    """Compact power-of-two sizes: 4096 -> '4k', 131072 -> '128k', 1048576 -> '1M'."""
    if value is None or pd.isna(value):
        return ""
    value = int(value)
    if value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20}M"
    if value >= 1024 and value % 1024 == 0:
        return f"{value >> 10}k"
    return str(value)


SHORT = {"float32": "fp32", "bfloat16": "bf16", "forward": "fwd", "train_step": "train"}


def case_label(dtype: object, op: object, size: object) -> str:
    """'bf16 train 32k': a compact axis label for a (dtype, op, size) case."""
    parts = [SHORT.get(str(v), str(v)) for v in (dtype, op) if isinstance(v, str)]
    return " ".join([*parts, fmt_size(size)])


JAX_NOTICE = "For simplicity, JAX has removed"


def short_error(message: object, limit: int = 110) -> str:
    """The gist of an error message for a table cell: its first meaningful line without the
    exception class, allocator name and trailing [tag=...] annotations, cut to ``limit``."""
    if message is None or pd.isna(message):
        return ""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    # Some stored messages start with (or are only) JAX's traceback-filtering notice.
    if lines and lines[0].startswith(JAX_NOTICE):
        lines = lines[1:]
        if not lines:
            return "(no message stored: only JAX's traceback-filtering notice)"
    text = lines[0] if lines else ""
    text = re.sub(r"^(jax\.errors\.)?JaxRuntimeError: ", "", text)
    # Autotuning failures say what went wrong only further down.
    oom = re.search(r"Out of memory while trying to allocate (\S+)", " ".join(lines[1:]))
    text = re.sub(
        r"Failed to get configs for: (\d+) out of (\d+) instructions\. See logs for all "
        r"failures\. Example failure:\s*$",
        r"autotuning failed for \1 of \2 instructions", text)
    if "autotuning failed" in text and oom:
        text += f" (out of memory allocating {oom.group(1)})"
    text = re.sub(r" with allocator \S+ on device \d+\.?", "", text)
    text = re.sub(r"(\s*\[[^\]]*\])+\s*$", "", text).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def plural(count: int, noun: str) -> str:
    """'1 failed case', '2 failed cases'."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def join_names(names: Iterable[str]) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


def fmt_time(median: float | None, q1: float | None = None, q3: float | None = None,
             rounds: object = None) -> str:
    """'16.01 ms (q1–q3 15.95–16.10, 10 rounds)': a median in a sentence, with its spread and
    rounds where stored."""
    if median is None or pd.isna(median):
        return ""
    places = decimals_for(median)
    details = []
    if q1 is not None and q3 is not None and not pd.isna(q1) and not pd.isna(q3):
        details.append(f"q1–q3 {q1:.{places}f}–{q3:.{places}f}")
    if rounds is not None and not pd.isna(rounds):
        details.append(plural(int(rounds), "round"))
    if not details:
        details.append("one time stored, no spread")
    return f"{median:.{places}f} ms ({', '.join(details)})"


def rounds_cell(rounds: object, few: bool = False, wide: bool = False) -> str:
    """The rounds column beside a median: '10', '3 · few rounds', '10 · wide spread'."""
    text = fmt_int(rounds) if rounds is not None and not pd.isna(rounds) else "—"
    marks = [m for m, on in (("few rounds", few), ("wide spread", wide)) if on]
    return " · ".join([text, *marks])


def verdict_phrase(ratio: float, clear: object, other: str, method: object = None) -> str:
    """How a row compares with ``other`` (``ratio`` = other's median / this one's, above 1:
    this one is faster): '1.64× faster than X', 'no clear difference from X (1.01×)', or,
    where a row stored no spread (one time, no rounds or quartiles), no verdict: 'X's time
    1.21× this one's (no spread stored)'."""
    if ratio is None or pd.isna(ratio):
        return ""
    if clear is None or pd.isna(clear):
        if method == "superseded":
            return f"no verdict against {other} (a superseded row)"
        return (f"{fmt_ratio(ratio)} the time of {other}, no verdict (noise unknown: no spread "
                "stored)")
    if not clear:
        return f"no clear difference from {other} ({fmt_ratio(ratio)}, within the noise)"
    if ratio >= 1:
        return f"{fmt_ratio(ratio)} faster than {other}"
    return f"{fmt_ratio(1 / ratio)} slower than {other}"


def change_phrase(ratio: float, clear: object) -> str:
    """A change from one run to the next (``ratio`` = after / before): 'slower by 30%',
    'faster by 12%', 'no clear change (+0.4%)' or '+3% (noise unknown)'."""
    if ratio is None or pd.isna(ratio):
        return ""
    percent = (ratio - 1) * 100
    if clear is None or pd.isna(clear):
        return f"{percent:+.0f}% (noise unknown)"
    if not clear:
        return f"no clear change ({percent:+.1f}%)"
    return f"slower by {percent:.0f}%" if ratio > 1 else f"faster by {-percent:.0f}%"


def run_anchor(run: str) -> str:
    """The id of a run's panel on the runs page."""
    return "run-" + re.sub(r"[^A-Za-z0-9_-]+", "-", str(run)).strip("-").lower()


def run_link(run: str) -> str:
    """Markdown link to a run's panel on the runs page (from a page under reports/)."""
    return f"[`{run}`](runs.md#{run_anchor(run)})"


def repeats_note(repeats: object, low: object, high: object) -> str:
    """'median of 3 repeats, 7.364–7.608' for a case measured more than once in its run
    (the data layer's one value per case and run), else ''."""
    if repeats is None or pd.isna(repeats) or int(repeats) <= 1:
        return ""
    places = decimals_for(float(low)) if not pd.isna(low) else 3
    return f"median of {int(repeats)} repeats, {low:.{places}f}–{high:.{places}f}"


def ms_cell(median: float | None, q1: float | None, q3: float | None, rounds: object,
            repeats: object = None, low: object = None, high: object = None) -> str:
    """A grid cell: '1.234 (1.200–1.250) · 10 rounds', marked '· few rounds' below
    verdict.FEW_ROUNDS and '· wide spread' when q3 - q1 exceeds verdict.WIDE_SPREAD of the
    median; '· median of 3 repeats, lo–hi' for a repeated case."""
    from .verdict import FEW_ROUNDS, WIDE_SPREAD

    text = fmt_ms(median, q1, q3)
    text = " · ".join(p for p in (text, repeats_note(repeats, low, high)) if p)
    if rounds is None or pd.isna(rounds):
        return text
    marks = [f"{int(rounds)} rounds"]
    if rounds < FEW_ROUNDS:
        marks.append("few rounds")
    if q1 is not None and q3 is not None and not pd.isna(q1) and not pd.isna(q3) and (
            q3 - q1) > WIDE_SPREAD * median:
        marks.append("wide spread")
    return " · ".join([text, *marks])
