"""Markdown building blocks for the report pages: charts, tables, source lines, number formats.

A chart is an Altair chart embedded as its Vega-Lite JSON spec in a ``<script
type="application/json">`` next to an empty ``div.tilax-chart``; the vendored vega-embed renders
it in the browser (docs/assets/tilax-charts.js). Tables are pandas frames written as Markdown.
Every chart and table is followed by a ``.tilax-source`` line naming and linking the stored
files (and runs) its rows come from.
"""

from __future__ import annotations

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

    def __init__(self, slug: str, title: str):
        self.slug = slug
        self.parts: list[str] = [f"# {title}\n"]
        self._count = 0

    def md(self, text: str) -> None:
        self.parts.append(text.strip("\n") + "\n")

    def chart(self, chart: alt.TopLevelMixin, rows: pd.DataFrame, caption: str = "") -> None:
        """Embed ``chart``; ``rows`` are the table rows it shows (for the source line)."""
        self._count += 1
        chart_id = f"{self.slug}-chart-{self._count}"
        spec = slim_datasets(chart.to_dict(validate=False))
        spec_json = json.dumps(spec, separators=(",", ":"), allow_nan=False, default=str)
        spec_json = spec_json.replace("</", "<\\/")
        files = " ".join(source_files(rows))
        self.parts.append(
            f'<div class="tilax-figure">\n'
            f'<div class="tilax-chart" id="{chart_id}" data-sources="{html.escape(files)}"></div>\n'
            f'<script type="application/json" data-chart-for="{chart_id}">{spec_json}</script>\n'
            f"</div>\n\n{source_line(rows, caption)}\n"
        )

    def table(self, frame: pd.DataFrame, rows: pd.DataFrame, caption: str = "",
              name: str | None = None, collapsed: str | None = None,
              markdown_columns: Iterable[str] = ()) -> None:
        """A pandas table; ``rows`` are the tidy rows behind it. ``collapsed``: a summary line
        to fold the table under (for long tables). ``markdown_columns`` hold Markdown (links)
        written as is."""
        self._count += 1
        table_id = name or f"{self.slug}-table-{self._count}"
        files = " ".join(source_files(rows))
        body = (
            f'<div class="tilax-table" id="{table_id}" data-sources="{html.escape(files)}" '
            f'markdown="1">\n\n{markdown_table(frame, markdown_columns)}\n\n</div>\n\n'
            f"{source_line(rows, caption)}\n"
        )
        if collapsed:
            body = (f'<details class="tilax-details" markdown="1">\n'
                    f"<summary>{html.escape(collapsed)}</summary>\n\n{body}\n</details>\n")
        self.parts.append(body)

    def render(self) -> str:
        return "\n".join(self.parts)


def slim_datasets(spec: dict) -> dict:
    """Drop the columns a chart never references from its inline datasets (Altair embeds the
    whole frame), and the missing values, so pages stay small."""
    datasets = spec.get("datasets")
    if not datasets:
        return spec
    rest = json.dumps({k: v for k, v in spec.items() if k != "datasets"})
    used = {
        name
        for records in datasets.values()
        for record in records[:1] + records[-1:]
        for name in record
        if f'"{name}"' in rest or f"datum.{name}" in rest or f"datum['{name}']" in rest
    }
    spec["datasets"] = {
        key: [{k: v for k, v in record.items() if k in used and v is not None}
              for record in records]
        for key, records in datasets.items()
    }
    return spec


def source_files(rows: pd.DataFrame) -> list[str]:
    return sorted(rows["source_file"].dropna().unique())


def source_line(rows: pd.DataFrame, caption: str = "") -> str:
    """'Source: [file](data/file) (runs a, b)' as a paragraph with class tilax-source."""
    parts = []
    for name in source_files(rows):
        runs = sorted(rows.loc[rows["source_file"] == name, "run"].dropna().unique())
        shown = ", ".join(f"`{r}`" for r in runs[:8]) + (f" and {len(runs) - 8} more"
                                                        if len(runs) > 8 else "")
        label = "run" if len(runs) == 1 else "runs"
        parts.append(f"[{name}]({RAW_DIR}/{name})" + (f" ({label} {shown})" if runs else ""))
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
        text = text.replace(" ", "\u00a0")  # short labels stay on one line
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
