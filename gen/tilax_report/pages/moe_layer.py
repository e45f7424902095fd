"""MoE layer: time vs tokens per implementation, speedups, XLA memory, numerics, other configs,
GPU vs GPU, failures."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import analysis, charts, headlines
from ..load import StoredResults
from ..prepared import prepared
from ..render import Page, case_label, fmt_int, fmt_num, fmt_ratio, join_names
from . import _shared
from .across_gpus import render_across_gpus, sorted_rows

PATH = "reports/moe-layer.md"
TITLE = "MoE layer"
SLUG = "moe-layer"
# Timing sections use layer cases of at least this many tokens; the 1 000-token numerics
# sweep (d_model 128) is shown in the numerics section.
MIN_TIMED_TOKENS = 4096
CASE_LABEL = ["dtype", "op", "tokens"]


def build(results: StoredResults) -> str:
    ready = prepared(results)
    table = ready.table
    layer = headlines.moe_layer_rows(table)
    page = Page(SLUG, TITLE)
    page.md(
        "Which implementation of the MoE layer (router, top-k dispatch, SwiGLU experts, "
        "combine) is fastest, by how much, and how time and memory grow with the tokens. "
        "Labels read `impl/dispatch` for dropless routing; `capacity (…)` drops the token "
        "copies over each expert's capacity (a different function); `dense routing` runs "
        "every expert on every token. Each section opens with the newest run on each GPU; "
        "earlier runs are folded under *Earlier runs* and followed over time on the "
        "[history page](history.md). Ratios are within one stored file. " + _shared.VERDICTS
    )
    if layer.empty:
        page.md("No stored run has MoE layer rows.")
        return page.render()
    finding = headlines.moe_train_32k(table, ready.order)
    if not finding.chosen.empty:
        page.md("## 32k-token bf16 train step\n")
        page.md("\n".join(f"- {_shared.moe_headline(best, ready.dates)}"
                          for _, best in finding.chosen.iterrows()))
    timed_layer = _with_chart_groups(layer[layer["tokens"].fillna(0) >= MIN_TIMED_TOKENS])
    newest = {run for _, run, _ in
              _shared.by_run_newest_first(_comparison_runs(timed_layer), ready.order)[0]}
    main = _main_configs(timed_layer)
    _fastest_table(page, timed_layer, newest)
    _time_vs_tokens(page, timed_layer, main, newest)
    _speedups(page, timed_layer, newest)
    _xla_memory(page, timed_layer, main, newest)
    _other_configs(page, timed_layer, main, newest)
    _numerics(page, layer)
    _shared.power_table(page, timed_layer, {"label": "impl", "config": "config", "op": "op",
                                            "tokens": "tokens", "gpu": "GPU"},
                        name="moe-layer")
    _across_gpus(page, table, ready.order)
    _shared.not_measured(page, layer, "MoE layer case",
                         {"label": "impl", "config": "config", "dtype": "dtype", "op": "op",
                          "tokens": "tokens", "gpu": "GPU"}, name="moe-layer")
    return page.render()


def _newest_first(groups: list[tuple], newest: set[str]) -> tuple[list[tuple], list[tuple]]:
    """Chart groups (..., rows) whose rows hold a newest run, and the others."""
    first = [g for g in groups if set(g[-1]["run"]) & newest]
    return first, [g for g in groups if not set(g[-1]["run"]) & newest]


def _with_chart_groups(layer: pd.DataFrame) -> pd.DataFrame:
    """``chart_group``: what one chart draws. Our runs are stored one file per bench call, so a
    run's files share a chart (its token counts join up); a seed file holds many partial runs of
    one study, drawn together and named under the chart."""
    ours = layer["source_format"] == "pytest_benchmark"
    return layer.assign(chart_group=layer["run"].where(ours, layer["source_file"]))


def _main_configs(layer: pd.DataFrame) -> dict[tuple[str, str], str]:
    """Per (chart group, device): the config with the most timed rows: the one the charts
    follow."""
    counts = layer.groupby(["chart_group", "device", "config"]).size().reset_index(name="rows")
    counts = counts.sort_values("rows", ascending=False).drop_duplicates(["chart_group",
                                                                          "device"])
    return {(r.chart_group, r.device): r.config for r in counts.itertuples()}


def _comparison_runs(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows of runs that measured at least two implementations (A/B and sweep runs of one
    implementation are on the MoE internals page)."""
    labels = rows.groupby(["source_file", "run"])["label"].transform("nunique")
    return rows[labels >= 2]


def _groups(rows: pd.DataFrame):
    """(chart group, device, code) groups: one chart each, so runs of different code never
    share a line."""
    keyed = rows.assign(_code=rows["code"].fillna(""))
    for (source, device, code), group in keyed.groupby(["chart_group", "device", "_code"],
                                                       sort=False):
        yield source, device, code, group.drop(columns="_code")


def _fastest_table(page: Page, layer: pd.DataFrame, newest: set[str]) -> None:
    ranked = headlines.rank_exact_moe(layer, ["config", *CASE_LABEL])
    page.md("## Fastest implementation per case\n")
    if ranked.empty:
        page.md("No run measured two implementations of the same case.")
        return
    page.md(
        "Each case with at least two exact implementations measured, ranked within the file "
        "(capacity routing drops tokens, so its time is shown but not ranked); the *vs* "
        "columns compare the fastest with the runner-up and the baselines."
    )
    now = ranked[ranked["run"].isin(newest)]
    before = ranked[~ranked["run"].isin(newest)]
    # key columns: the case, the fastest and its median with spread (rounds and verdicts follow)
    page.table(_shared.ranked_display(now, tuple(CASE_LABEL)),
               layer[layer["run"].isin(set(now["run"]))], name="moe-layer-fastest",
               key_columns=6)
    if not before.empty:
        page.table(_shared.ranked_display(before, tuple(CASE_LABEL)),
                   layer[layer["run"].isin(set(before["run"]))],
                   name="moe-layer-fastest-earlier", key_columns=6,
                   collapsed=f"Earlier runs: {len(before)} cases")


def _time_vs_tokens(page: Page, layer: pd.DataFrame, main: dict, newest: set[str]) -> None:
    page.md("## Time vs tokens\n")
    page.md(
        "One chart per GPU and code version, for the configuration most rows measured; lines "
        "join the token counts of one implementation (the runs are named under each chart). "
        "Click legend entries to highlight."
    )
    first, later = _newest_first(list(_groups(_comparison_runs(layer))), newest)
    for group in first:
        _time_chart(page, *group, main)
    with page.collapsed(_shared.earlier_summary(later)):
        for group in later:
            _time_chart(page, *group, main)


def _time_chart(page: Page, source: str, device: str, code: str, group: pd.DataFrame,
                main: dict) -> None:
    rows = group[group["config"] == main.get((source, device))]
    good = analysis.timed(rows)
    if good.empty:
        return
    title = f"{device}{f', {code} code' if code else ''}: {rows['config'].iloc[0]}"
    tips = ["run", "routing", "q1_ms", "q3_ms", "inner", "rounds"]
    if good["tokens"].nunique() >= 2:
        chart = charts.lines(
            good, x="tokens", x_title="tokens", color="label",
            color_title="implementation", row=alt.Row("dtype:N", title=None),
            column=alt.Column("op:N", title=None), tips=tips, title=title,
        )
    else:
        chart = charts.bars(
            good, category="label", category_title="implementation", log=True,
            row=alt.Row("dtype:N", title=None), column=alt.Column("op:N", title=None),
            tips=[*tips, "tokens"], width=220,
            title=f"{title}, {fmt_int(good['tokens'].iloc[0])} tokens",
        )
    page.chart(chart, rows, "Median with q1–q3 rules; log axes.")


def _speedups(page: Page, layer: pd.DataFrame, newest: set[str]) -> None:
    page.md("## Speedup vs ragged_dot and vs dense routing\n")
    page.md(
        "Baseline median / implementation median, within each run and case (above 1: faster "
        "than the baseline). Cases whose baseline failed or was not measured have no cell."
    )
    groups = []
    for baseline in ("ragged_dot/sorted", "dense routing"):
        speed = analysis.speedups(layer, ["config", *CASE_LABEL], baseline)
        speed = speed[speed["label"] != baseline]
        groups += [(baseline, source, run, rows) for (source, run), rows in
                   speed.groupby(["source_file", "run"], sort=False)]
    if not groups:
        page.md("No run measured ragged_dot or dense routing next to another implementation.")
        return
    first, later = _newest_first(groups, newest)
    for group in first:
        _speedup_chart(page, layer, *group)
    with page.collapsed(_shared.earlier_summary(later)):
        for group in later:
            _speedup_chart(page, layer, *group)


def _speedup_chart(page: Page, layer: pd.DataFrame, baseline: str, source: str, run: str,
                   rows: pd.DataFrame) -> None:
    rows = rows.sort_values(["dtype", "op", "tokens"])
    rows = rows.assign(
        case=[case_label(r.dtype, r.op, r.tokens) for r in rows.itertuples()],
        text=[fmt_ratio(v) if c is not False else f"~{fmt_ratio(v)}"
              for v, c in zip(rows["speedup"], rows["clear"], strict=True)],
    )
    chart = charts.heatmap(
        rows, x="case", x_title=None, x_sort=list(dict.fromkeys(rows["case"])),
        y="label", y_title=None, value="speedup",
        value_title=f"× vs {baseline}", text="text", log=True, domain_mid=1,
        scheme="redblue", tips=["run", "config", "speedup_lo", "speedup_hi"],
        cell=64, title=f"{rows['device'].iloc[0]}, run {run} ({rows['config'].iloc[0]}): "
                       f"speedup vs {baseline}",
    )
    page.chart(chart, layer[(layer["source_file"] == source) & (layer["run"] == run)],
               "Blue: faster than the baseline; red: slower (colours saturate at 4×); "
               "~: no clear difference (within the noise). Tooltip: the speedup's "
               "range from the quartiles.")


def _xla_memory(page: Page, layer: pd.DataFrame, main: dict, newest: set[str]) -> None:
    rows = _comparison_runs(layer[layer["xla_temp_mb"].notna()])
    if rows.empty:
        return
    page.md("## XLA temporary memory\n")
    page.md(
        "XLA's temp buffer size for the compiled call (`xla_temp_mb`, from the executable's "
        "memory analysis, not a measured peak)."
    )
    first, later = _newest_first(list(_groups(rows)), newest)
    for group in first:
        _xla_memory_chart(page, *group, main)
    with page.collapsed(_shared.earlier_summary(later)):
        for group in later:
            _xla_memory_chart(page, *group, main)


def _xla_memory_chart(page: Page, source: str, device: str, code: str, group: pd.DataFrame,
                      main: dict) -> None:
    group = group[group["config"] == main.get((source, device))]
    if group["tokens"].nunique() < 2:
        return
    chart = charts.lines(
        group, x="tokens", x_title="tokens", color="label", color_title="implementation",
        y="xla_temp_mb", y_title="XLA temp (MiB)", spread=False,
        row=alt.Row("dtype:N", title=None), column=alt.Column("op:N", title=None),
        tips=["run", "xla_arg_mb", "xla_out_mb"],
        title=f"{device}{f', {code} code' if code else ''}: {group['config'].iloc[0]}",
    )
    page.chart(chart, group)


def _other_configs(page: Page, layer: pd.DataFrame, main: dict, newest: set[str]) -> None:
    rows = _comparison_runs(layer)
    rows = rows[[main.get((s, d)) != c for s, d, c in
                 zip(rows["chart_group"], rows["device"], rows["config"], strict=True)]]
    if rows.empty:
        return
    page.md("## Other configurations\n")
    configs = sorted(rows["config"].unique())
    page.md(f"Configurations besides the main one: {join_names(configs)}.")
    groups = [(*key, group) for key, group in
              rows.groupby(["source_file", "run", "config"], sort=False)]
    first, later = _newest_first(groups, newest)
    for group in first:
        _config_chart(page, *group)
    with page.collapsed(_shared.earlier_summary(later)):
        for group in later:
            _config_chart(page, *group)


def _config_chart(page: Page, _source: str, run: str, config: str, group: pd.DataFrame) -> None:
    good = analysis.timed(group)
    if good.empty:
        return
    case = ", ".join(f"{fmt_int(t)} tokens" for t in sorted(good["tokens"].unique()))
    chart = charts.bars(
        good, category="label", category_title="implementation", log=True,
        row=alt.Row("dtype:N", title=None), column=alt.Column("op:N", title=None),
        tips=["run", "tokens", "q1_ms", "q3_ms", "max_expert_frac"], width=220,
        title=f"{group['device'].iloc[0]}, run {run}: {config}, {case}",
    )
    page.chart(chart, group, _not_drawn(group))


def _not_drawn(rows: pd.DataFrame) -> str:
    parts = []
    for status, frame in (("failed", analysis.failures(rows)),
                          ("skipped", analysis.skipped(rows))):
        if not frame.empty:
            cases = sorted({f"{r.label} {r.op}" for r in frame.itertuples()})
            parts.append(f"{status}: {join_names(cases)}")
    return f"Not drawn ({'; '.join(parts)}); see Not measured." if parts else ""


def _numerics(page: Page, layer: pd.DataFrame) -> None:
    metrics = {"rel_err_out": "output", "rel_err_grad_x": "grad x",
               "rel_err_grad_params": "grad params"}
    rows = layer[layer[list(metrics)].notna().any(axis=1)]
    if rows.empty:
        return
    page.md("## Numerics\n")
    refs = join_names(sorted(rows["rel_err_ref"].dropna().unique()))
    page.md(
        f"Relative errors against {refs}, per implementation and dtype, over every "
        "configuration measured (the 1 000-token sweep covers E8/E64, top-1/top-4, skew 0/0.9)."
    )
    long = rows.melt(
        id_vars=["source_file", "run", "device", "label", "dtype", "op", "config", "tokens"],
        value_vars=list(metrics), var_name="metric", value_name="value",
    ).dropna(subset=["value"])
    long["metric"] = long["metric"].map(metrics)
    long = long[long["value"] > 0]
    select = alt.selection_point(fields=["dtype"], bind="legend")
    chart = (
        alt.Chart(long)
        .mark_tick(thickness=2, size=14)
        .encode(
            alt.Y("label:N", title=None),
            alt.X("value:Q", title="relative error", scale=alt.Scale(type="log")),
            alt.Color("dtype:N"),
            opacity=alt.condition(select, alt.value(0.8), alt.value(0.08)),
            tooltip=charts.tooltip(["label", "dtype", "metric", alt.Tooltip("value",
                                    format=".2e"), "config", "tokens", "op", "run"]),
        )
        .add_params(select)
        .properties(width=230, height=alt.Step(16))
        .facet(column=alt.Column("metric:N", title=None, sort=list(metrics.values())))
    )
    page.chart(charts.finish(chart, "Relative error per implementation (every case)"), rows,
               "One tick per measured case; log scale.")
    worst = long.groupby(["label", "dtype", "metric"])["value"].max().unstack("metric")
    worst = worst.reindex(columns=[m for m in metrics.values() if m in worst.columns])
    display = worst.map(lambda v: fmt_num(v, 3)).reset_index()
    display.columns = [c if c in ("label", "dtype") else f"max {c}" for c in display.columns]
    page.table(display.rename(columns={"label": "implementation"}), rows,
               "Largest relative error over every case measured.")


def _across_gpus(page: Page, table: pd.DataFrame, order: pd.Series) -> None:
    moe = table[(table["family"] == "moe") & table["suite"].isin(["layer", "decoder"])]
    rows = analysis.across_devices(moe, ["suite", "config", *CASE_LABEL])
    if not rows.empty:
        rows = sorted_rows(rows, ["suite", *analysis.MOE_CONFIG, "dtype", "op", "tokens",
                                  "label", "gpu", "run"])
        rows = rows.assign(case=[f"{r.suite} · {r.config} · "
                                 f"{case_label(r.dtype, r.op, r.tokens)}"
                                 for r in rows.itertuples()])
    devices = sorted(moe["device"].dropna().unique())
    render_across_gpus(page, rows, "MoE layer case", devices, order)
