"""Altair chart builders shared by the report pages.

All charts are interactive the same way: hover for a tooltip with the stored values, click a
legend entry to highlight that series (shift-click for several). Times are medians with a q1–q3
rule where the file stored quartiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import altair as alt
import pandas as pd

from .render import short_error

# Ratio heatmaps saturate their colours at this factor either way (the cell text is exact).
MAX_COLOUR_RATIO = 4.0
# One colour per implementation across every chart of the site (labels as analysis.with_labels
# writes them); labels not listed here get the spare colours in name order.
IMPL_COLOURS = {
    # MoE layer (impl/dispatch)
    "pallas/sorted": "#4c78a8", "pallas/gather": "#9ecae9", "pallas/fused": "#54a24b",
    "pallas/fused_gsum": "#88d27a", "triton/sorted": "#b279a2", "triton/gather": "#d6a5c9",
    "triton/fused": "#9e765f", "triton/fused_gsum": "#d8b5a5", "mosaic/sorted": "#439894",
    "blocked/sorted": "#f58518", "ragged_dot/sorted": "#e45756", "dense routing": "#79706e",
    "capacity (auto/sorted)": "#b79a20",
    # RBF and the NN suites' moe variants
    "pallas": "#4c78a8", "xla": "#f58518", "dense": "#79706e", "torch_dense": "#e45756",
    "default@gpu-benchmarks": "#9ecae9", "keops": "#54a24b", "blocked": "#f58518",
    "ragged_dot": "#e45756",
    # NN suites: attention variants and SSM cells
    "probjax_default": "#4c78a8", "probjax_flex": "#54a24b", "jax_xla": "#f58518",
    "jax_cudnn": "#e45756", "mamba": "#4c78a8", "ssd": "#f58518", "mamba2": "#54a24b",
    "gdn": "#e45756", "lru": "#b279a2",
}
# Vega's tableau20: labels without a colour of their own (and any label whose colour another
# label of the same chart already has) take the first of these not yet used in the chart.
PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#b279a2", "#9e765f", "#439894",
           "#b79a20", "#79706e", "#d67195", "#9ecae9", "#ffbf79", "#88d27a", "#ff9d98",
           "#d6a5c9", "#d8b5a5", "#83bcb6", "#f2cf5b", "#bab0ac", "#fcbfd2"]
# Lines of one chart a reader can tell apart (colours and legend entries).
MAX_SERIES = 8
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"


def fastest_series(data: pd.DataFrame, color: str, y: str) -> tuple[pd.DataFrame, int]:
    """``data`` limited to its `MAX_SERIES` ``color`` values of smallest median ``y``, and how
    many values were left out: more lines than that cannot be told apart."""
    if color not in data or data[color].nunique() <= MAX_SERIES:
        return data, 0
    keep = data.groupby(color)[y].median().sort_values().index[:MAX_SERIES]
    return data[data[color].isin(keep)], data[color].nunique() - MAX_SERIES


def repeat_tips(data: pd.DataFrame) -> list[str]:
    """The repeat count and range for a tooltip, where some case of ``data`` was measured more
    than once in its run (its point is the median of the repeats)."""
    if "repeats" in data and (pd.to_numeric(data["repeats"], errors="coerce") > 1).any():
        return ["repeats", "repeat_min_ms", "repeat_max_ms"]
    return []


def tooltip(fields: Sequence[str | alt.Tooltip]) -> list[alt.Tooltip]:
    """Tooltips for the named columns, formatting the common numeric ones."""
    formats = {
        "median_ms": ".4~f", "q1_ms": ".4~f", "q3_ms": ".4~f", "peak_mb": ",.1f",
        "xla_temp_mb": ",.1f", "ratio": ".3~f", "speedup": ".3~f", "pairs_per_s": ".3~s",
        "rel_err": ".2e", "value": ".3~g", "share": ".1%", "repeat_min_ms": ".4~f",
        "repeat_max_ms": ".4~f",
    }
    tips = []
    for field in fields:
        if isinstance(field, alt.Tooltip):
            tips.append(field)
        elif field in formats:
            tips.append(alt.Tooltip(field, format=formats[field]))
        else:
            tips.append(alt.Tooltip(field))
    return tips


def finish(chart: alt.TopLevelMixin, title: str | alt.TitleParams | None = None
           ) -> alt.TopLevelMixin:
    """Site-wide look: system font (no web font), quiet grid, legend on the right, and no
    label cut short (a limit of 0 is none: a cut label names nothing)."""
    if title:
        chart = chart.properties(title=title)
    # One configure call: each copies the whole chart (five took a fifth of the site's build).
    return chart.configure(
        font=FONT,
        axis=alt.AxisConfig(labelFontSize=11, titleFontSize=12, gridOpacity=0.5, labelLimit=0),
        legend=alt.LegendConfig(labelFontSize=11, titleFontSize=12, labelLimit=0),
        header=alt.HeaderConfig(labelFontSize=12, titleFontSize=12),
        title=alt.TitleConfig(fontSize=14, anchor="start"),
    )


def colour(field: str, title: str | None, data: pd.DataFrame, **kwargs) -> alt.Color:
    """Colour by ``field``, one distinct colour per value: implementation labels keep their
    site-wide colours, other values (and clashes) take unused palette colours."""
    values = sorted(str(v) for v in data[field].dropna().unique()) if field in data else []
    if not values:
        return alt.Color(f"{field}:N", title=title, **kwargs)
    used: list[str] = []
    for value in values:
        own = IMPL_COLOURS.get(value)
        spare = [c for c in PALETTE if c not in used] or PALETTE
        used.append(own if own and own not in used else spare[0])
    return alt.Color(f"{field}:N", title=title, scale=alt.Scale(domain=values, range=used),
                     **kwargs)


def positive(data: pd.DataFrame, *fields: str) -> pd.DataFrame:
    """Rows whose ``fields`` are all above zero: a log axis cannot place zero (Vega fails with
    'Infinite extent')."""
    mask = pd.Series(True, index=data.index)
    for field in fields:
        if field in data:
            mask &= pd.to_numeric(data[field], errors="coerce") > 0
    return data[mask]


def _scale(log: bool, **kwargs) -> alt.Scale:
    # nice=False: log axes would otherwise round out to whole decades and squeeze the data.
    # padding keeps the end points off the frame.
    return (alt.Scale(type="log", nice=False, padding=10, **kwargs) if log
            else alt.Scale(zero=False, padding=10, **kwargs))


def _facet(chart, data, row, column, columns=None):
    if row is None and column is None:
        return chart
    kwargs = {}
    if row is not None:
        kwargs["row"] = row if isinstance(row, alt.Row) else alt.Row(row, title=None)
    if column is not None:
        kwargs["column"] = column if isinstance(column, alt.Column) else alt.Column(column,
                                                                                   title=None)
    return chart.facet(data=data, **kwargs)


def lines(
    data: pd.DataFrame,
    *,
    x: str,
    x_title: str,
    color: str,
    color_title: str,
    y: str = "median_ms",
    y_title: str = "median time (ms)",
    log_x: bool = True,
    log_y: bool = True,
    spread: bool = True,
    row: str | alt.Row | None = None,
    column: str | alt.Column | None = None,
    tips: Sequence[str | alt.Tooltip] = (),
    x_format: str | None = "~s",
    width: int = 240,
    height: int = 170,
    detail: str | None = None,
    title: str | alt.TitleParams | None = None,
) -> alt.TopLevelMixin:
    """Median vs a size, one line per ``color`` value, q1–q3 rules, log axes by default. At
    most `MAX_SERIES` lines: with more, the lowest ones (smallest median of ``y``: the fastest
    for times) are drawn and the subtitle says how many others the page's tables hold."""
    data = positive(data, *([x] if log_x else []), *([y] if log_y else []))
    data, left_out = fastest_series(data, color, y)
    if left_out:
        title = alt.TitleParams(title or "", subtitle=(
            f"the {MAX_SERIES} lowest of {MAX_SERIES + left_out} series; the tables list "
            "every one"))
    select = alt.selection_point(fields=[color], bind="legend")
    x_enc = alt.X(f"{x}:Q", title=x_title, scale=_scale(log_x),
                  axis=alt.Axis(format=x_format) if x_format else alt.Axis())
    y_enc = alt.Y(f"{y}:Q", title=y_title, scale=_scale(log_y))
    color_enc = colour(color, color_title, data)
    opacity = alt.condition(select, alt.value(1.0), alt.value(0.12))
    base = alt.Chart().encode(x=x_enc, color=color_enc, opacity=opacity)
    detail_enc = [alt.Detail(f"{detail}:N")] if detail else []
    line = base.mark_line(strokeWidth=1.6).encode(y_enc, *detail_enc)
    points = base.mark_point(filled=True, size=40).encode(
        y_enc, tooltip=tooltip([color, x, y, *tips, *repeat_tips(data)])
    ).add_params(select)
    layers = [line, points]
    if spread and {"q1_ms", "q3_ms"} <= set(data.columns) and data["q1_ms"].notna().any():
        layers.append(base.mark_rule(strokeWidth=2).encode(
            alt.Y("q1_ms:Q", scale=_scale(log_y)), alt.Y2("q3_ms:Q")))
    if row is None and column is None:
        chart = alt.layer(*layers, data=data).properties(width=width, height=height)
    else:
        chart = _facet(alt.layer(*layers).properties(width=width, height=height), data, row,
                       column)
    return finish(chart, title)


def bars(
    data: pd.DataFrame,
    *,
    category: str,
    category_title: str,
    value: str = "median_ms",
    value_title: str = "median time (ms)",
    color: str | None = None,
    color_title: str | None = None,
    log: bool = False,
    spread: bool = True,
    row: str | alt.Row | None = None,
    column: str | alt.Column | None = None,
    tips: Sequence[str | alt.Tooltip] = (),
    width: int = 260,
    bar_height: int = 16,
    reference: float | str | None = None,
    sort_by_value: bool = True,
    bounds: tuple[str, str] | None = None,
    title: str | None = None,
) -> alt.TopLevelMixin:
    """Horizontal bars of ``value`` per ``category`` (q1–q3 rules on times, or a rule from
    the ``bounds`` columns (low, high) on other values); an optional vertical reference rule
    (e.g. ratio 1; the name of a column to draw it where that column has a value, e.g. in
    some facets only). With ``log`` the values are dots, not bars: a bar's length means
    nothing on a log axis."""
    data = positive(data, value) if log else data
    legend = color is not None and color != category
    color = color or category
    # With one colour per bar the bars are their own legend: click a bar to highlight it.
    select = alt.selection_point(fields=[color], **({"bind": "legend"} if legend else {}))
    # An explicit order (fastest first) rather than a sort transform, which Vega-Lite would
    # compute from a separate data source in every facet.
    sort = (list(data.groupby(category)[value].min().sort_values().index) if sort_by_value
            else None)
    y_enc = alt.Y(f"{category}:N", title=category_title, sort=sort)
    x_scale = (alt.Scale(type="log", nice=False, padding=12) if log
               else alt.Scale(zero=True))
    x_axis = alt.Axis(format="~g", tickCount=6)
    base = alt.Chart().encode(y=y_enc)
    mark = (base.mark_point(filled=True, size=70, opacity=1) if log
            else base.mark_bar(height=bar_height * 0.8))
    bar = mark.encode(
        alt.X(f"{value}:Q", title=value_title, scale=x_scale, stack=None, axis=x_axis),
        colour(color, color_title or category_title, data,
               legend=alt.Legend() if legend else None),
        opacity=alt.condition(select, alt.value(1.0), alt.value(0.25)),
        tooltip=tooltip([category, value, *tips, *repeat_tips(data)]),
    ).add_params(select)
    layers = [bar]
    if bounds is None and spread and value == "median_ms":
        bounds = ("q1_ms", "q3_ms")
    if spread and bounds is not None and bounds[0] in data and data[bounds[0]].notna().any():
        layers.append(base.mark_rule(color="black", strokeWidth=1.5).encode(
            alt.X(f"{bounds[0]}:Q", scale=x_scale), alt.X2(f"{bounds[1]}:Q")))
    if isinstance(reference, str):  # no y encoding: a vertical rule over the whole height
        layers.append(alt.Chart().mark_rule(color="#555", strokeDash=[4, 3]).encode(
            alt.X(f"{reference}:Q", scale=x_scale)))
    elif reference is not None:
        layers.append(alt.Chart().mark_rule(color="#555", strokeDash=[4, 3]).encode(
            x=alt.datum(reference)))
    step = alt.Step(bar_height)
    if row is None and column is None:
        chart = alt.layer(*layers, data=data).properties(width=width, height=step)
    else:
        chart = _facet(alt.layer(*layers).properties(width=width, height=step), data, row,
                       column).resolve_scale(x="independent")
    return finish(chart, title)


def heatmap(
    data: pd.DataFrame,
    *,
    x: str,
    x_title: str,
    y: str,
    y_title: str,
    value: str,
    value_title: str,
    text: str,
    scheme: str = "blueorange",
    domain_mid: float | None = None,
    log: bool = False,
    row: str | alt.Row | None = None,
    column: str | alt.Column | None = None,
    tips: Sequence[str | alt.Tooltip] = (),
    cell: int = 44,
    x_sort: Sequence | None = None,
    y_sort: Sequence | None = None,
    reverse: bool = False,
    title: str | None = None,
) -> alt.TopLevelMixin:
    """Cells coloured by ``value`` with the formatted ``text`` written in them."""
    data = positive(data, value) if log else data
    scale_kwargs = {"scheme": scheme, "reverse": reverse}
    if log:
        scale_kwargs["type"] = "log"
    if domain_mid is not None:
        scale_kwargs["domainMid"] = domain_mid
        values = data[value].dropna()
        if log and not values.empty:
            # Symmetric around the midpoint on the log scale: 2x faster and 2x slower get
            # equally strong colours.
            reach = max((values / domain_mid).max(), (domain_mid / values).max(), 1.05)
            reach = min(reach, MAX_COLOUR_RATIO)
            scale_kwargs["domain"] = [domain_mid / reach, domain_mid * reach]
            scale_kwargs["clamp"] = True
    base = alt.Chart().encode(
        alt.X(f"{x}:O", title=x_title, sort=list(x_sort) if x_sort is not None else "ascending",
              axis=alt.Axis(labelAngle=0 if _fits(data[x], cell) else -35, orient="top")),
        alt.Y(f"{y}:O", title=y_title, sort=list(y_sort) if y_sort is not None else "ascending"),
    )
    rect = base.mark_rect().encode(
        alt.Color(f"{value}:Q", title=value_title, scale=alt.Scale(**scale_kwargs),
                  legend=alt.Legend(format=".3~g")),
        tooltip=tooltip([x, y, value, *tips]),
    )
    label = base.mark_text(fontSize=10).encode(text=f"{text}:N")
    size = {"width": alt.Step(cell), "height": alt.Step(22)}
    if row is None and column is None:
        chart = alt.layer(rect, label, data=data).properties(**size)
    else:
        chart = _facet(alt.layer(rect, label).properties(**size), data, row, column)
    return finish(chart, title)


def _fits(labels: pd.Series, width: int) -> bool:
    """Whether the longest label fits a column of ``width`` px at 11 px type (about 6.5 px a
    character): wider labels are angled rather than cut."""
    longest = max((len(str(v)) for v in labels.dropna().unique()), default=0)
    return longest * 6.5 <= width


def ladder(
    data: pd.DataFrame,
    *,
    x: str,
    x_title: str,
    color: str,
    color_title: str,
    y: str = "peak_mb",
    y_title: str = "peak memory (MiB)",
    column: str | alt.Column | None = None,
    tips: Sequence[str | alt.Tooltip] = (),
    width: int = 300,
    height: int = 200,
    title: str | alt.TitleParams | None = None,
) -> alt.TopLevelMixin:
    """A size ladder: ``y`` vs ``x`` on log axes per series; a failed step (OOM, timeout) is a
    cross in the series' colour along the top edge (hover it for the error)."""
    # Skipped sizes were never attempted: not a failure, not drawn.
    data = data[data["status"] != "skipped"].copy()
    reach = data[data["status"] == "measured"].groupby(color)[x].max()
    if data[color].nunique() > MAX_SERIES:  # the ladders that went furthest
        keep = reach.sort_values(ascending=False).index[:MAX_SERIES]
        title = alt.TitleParams(title or "", subtitle=(
            f"the {MAX_SERIES} that reached the largest sizes of {data[color].nunique()}; "
            "the table lists every one"))
        data = data[data[color].isin(keep)]
    data["error_short"] = data["error"].map(short_error)
    ok = data["status"] == "measured"
    top = data.loc[ok, y].max() if data.loc[ok, y].notna().any() else 1.0
    data["failed_at"] = top * 1.6
    select = alt.selection_point(fields=[color], bind="legend")
    x_enc = alt.X(f"{x}:Q", title=x_title, scale=_scale(True),
                  axis=alt.Axis(format="~s"))
    y_scale = _scale(True)
    color_enc = colour(color, color_title, data)
    opacity = alt.condition(select, alt.value(1.0), alt.value(0.12))
    good = alt.Chart().transform_filter("datum.status == 'measured'").encode(
        x_enc, alt.Y(f"{y}:Q", title=y_title, scale=y_scale), color_enc, opacity=opacity)
    layers = [
        good.mark_line(strokeWidth=1.6),
        good.mark_point(filled=True, size=45).encode(
            tooltip=tooltip([color, x, y, *tips])).add_params(select),
    ]
    if not ok.all():
        layers.append(
            alt.Chart().transform_filter("datum.status == 'failed'").mark_point(
                shape="cross", size=130, filled=True, strokeWidth=1).encode(
                x_enc, alt.Y("failed_at:Q", scale=y_scale), color_enc, opacity=opacity,
                tooltip=tooltip([color, x, "status", "error_short"]),
            )
        )
    if column is None:
        chart = alt.layer(*layers, data=data).properties(width=width, height=height)
    else:
        chart = _facet(alt.layer(*layers).properties(width=width, height=height), data, None,
                       column)
    return finish(chart, title)
