"""RBF kernels: kernel_mv time vs n, speedups, KDE, tile sweep, launch sweep, crossover repeats,
peak memory, max-n ladder, numerics, GPU vs GPU, failures."""

from __future__ import annotations

import math

import altair as alt
import pandas as pd

from .. import analysis, charts, headlines, verdict
from ..load import StoredResults
from ..prepared import prepared
from ..render import (
    Page,
    fmt_int,
    fmt_ms,
    fmt_num,
    fmt_ratio,
    fmt_size,
    join_names,
    plural,
    rounds_cell,
    short_error,
    skip_gist,
)
from . import _shared
from .across_gpus import render_across_gpus, sorted_rows

PATH = "reports/rbf.md"
TITLE = "RBF kernels"
SLUG = "rbf"
CASE = ["config", "op", "n"]
LAUNCH_SUITE = "kernel_mv_launches"
# The launch sweep's kernel families, in the order shown: (path, kernel) -> words.
LAUNCH_GROUPS = {
    ("fast", "fwd"): "fast path, forward kernel",
    ("fast", "bwd"): "fast path, backward kernels",
    ("exact", "fwd"): "exact path, forward kernel",
    ("exact", "bwd"): "exact path, backward kernels",
}
LAUNCH_SHORT = {("fast", "fwd"): "fast fwd", ("fast", "bwd"): "fast bwd (fwd_bwd)",
                ("exact", "fwd"): "exact fwd", ("exact", "bwd"): "exact bwd (fwd_bwd)"}
LAUNCH_KEYS = ["source_file", "run", "device", "path", "kernel", "precision", "config", "n",
               "op"]
PEERS = {"torch_dense": "PyTorch (`torch_dense`, the dense kernel matrix)",
         "keops": "KeOps (`keops`, LazyTensor reduction)"}
GRAD_ERRORS = ["rel_err_dq", "rel_err_dk", "rel_err_dv", "rel_err_dlengthscale"]
LOWER_BOUND_NOTE = (
    "The limit lies between the largest n that ran and the smallest larger n that failed. "
    "**≥** marks a lower bound: the failing n is more than double the one that ran (the "
    "ladder skipped the sizes between) or no larger n failed, so the real limit may be higher."
)


def build(results: StoredResults) -> str:
    ready = prepared(results)
    table = ready.table
    rbf = table[table["family"] == "rbf"]
    page = Page(SLUG, TITLE)
    page.md(
        "Which implementation of `rbf_kernel_mv` (out = K(q, k) v, Gaussian kernel) and "
        "`rbf_kde_density` is fastest at each size, how much memory each needs and how large "
        "n can grow: `dense` materialises the n × m kernel matrix, `xla` is chunked plain XLA, "
        "`pallas` the fused tiled kernel, `torch_dense` and `keops` are peers. `fwd` is one "
        "forward call, `fwd_bwd` forward plus gradients; n = m. Each section opens with the "
        "newest run on each GPU; earlier runs are folded under *Earlier runs*. Ratios are "
        "within one stored file. " + _shared.VERDICTS
    )
    if rbf.empty:
        page.md("No stored run has RBF rows.")
        return page.render()
    order = ready.order
    _headlines(page, table, ready)
    kernel_mv = rbf[rbf["suite"] == "kernel_mv"]
    _kernel_mv(page, kernel_mv, order)
    _speedups(page, kernel_mv, order)
    _peers(page, kernel_mv)
    _kde(page, rbf[rbf["suite"] == "kde_density"], order)
    _tiles(page, rbf[rbf["suite"] == "kernel_mv_tiles"], order)
    _launches(page, rbf[rbf["suite"] == LAUNCH_SUITE], order)
    _crossover(page, rbf[rbf["suite"] == "kernel_mv_crossover"])
    _memory(page, table, order)
    _max_n(page, rbf[rbf["suite"] == "kernel_mv_max_n"], order)
    # The launch sweep keeps its numerics, failures and skips in its own tables (a launch is
    # not a case of the charts and tables below) and compares launches within one run only.
    others = rbf[rbf["suite"] != LAUNCH_SUITE]
    _numerics(page, others)
    _across_gpus(page, others, order)
    _shared.not_measured(page, others, "RBF case",
                         {"suite": "suite", "label": "impl", "op": "op", "config": "config",
                          "n": "n", "gpu": "GPU"}, name="rbf")
    return page.render()


def _headlines(page: Page, table: pd.DataFrame, ready) -> None:
    """The findings of each GPU's newest run with the rows they need."""
    _, growth = headlines.rbf_memory(table)
    newest = {run for _, run, _ in _shared.by_run_newest_first(growth, ready.order)[0]}
    wins = headlines.rbf_wins_at_largest_n(table)
    if not wins.empty:
        newest |= {run for _, run, _ in _shared.by_run_newest_first(wins, ready.order)[0]}
        wins = wins[wins["run"].isin(newest)]
    sentences = (_shared.memory_sentences(growth[growth["run"].isin(newest)], ready.dates)
                 + _shared.rbf_win_sentences(wins, ready.dates))
    if sentences:
        page.md("## Findings\n")
        page.md("\n".join(f"- {s}" for s in sentences))


def _per_device(page: Page, rows: pd.DataFrame, order: pd.Series | None, draw) -> None:
    """``draw(run, 'GPU, run X', rows)`` per device and run: each GPU's newest run first
    (``order``: run -> place in time; None: a run appearing later in ``rows`` is newer), the
    earlier ones folded."""
    if order is None:
        order = pd.Series(range(len(rows["run"].unique())), index=rows["run"].unique())
    _shared.sections_newest_first(page, rows, order, lambda device, run, group: draw(
        run, f"{analysis.short_gpu(device)}, run {run}", group))


def _kernel_mv(page: Page, rows: pd.DataFrame, order: pd.Series) -> None:
    page.md("## kernel_mv: time vs n\n")
    if rows.empty:
        page.md("No stored run has the `kernel_mv` suite.")
        return
    page.md(
        "One panel per input dimension / value columns (rows) and mode (columns). Points of "
        "different sizes can come from different runs of the same file on the same GPU (named "
        "under the chart); failed sizes (out of memory) are listed under Failures."
    )
    def draw(_run, who, group):
        good = analysis.timed(group)
        chart = charts.lines(
            good, x="n", x_title="n (= m)", color="label", color_title="implementation",
            row=alt.Row("config:N", title=None, sort=analysis.config_order(good)),
            column=alt.Column("op:N", title=None),
            tips=["run", "q1_ms", "q3_ms", "pairs_per_s"], width=260, height=110,
            title=f"{who}: kernel_mv median time vs n",
        )
        page.chart(chart, group, "Log–log; rules: q1–q3.")

    _per_device(page, rows, order, draw)


def _speedups(page: Page, rows: pd.DataFrame, order: pd.Series) -> None:
    if rows.empty:
        return
    page.md("## Speedup vs xla and vs dense\n")
    page.md("Baseline median / implementation median within each run and case; a missing cell "
            "means the baseline (or the implementation) failed or was not measured there.")
    speed = pd.concat([analysis.speedups(rows, CASE, baseline) for baseline in ("xla", "dense")])
    speed = speed[speed["label"] != speed["baseline"]]

    def draw(run, who, per_run):
        for baseline, group in per_run.groupby("baseline", sort=False):
            group = group.assign(text=[fmt_ratio(v) if c is not False else f"~{fmt_ratio(v)}"
                                       for v, c in zip(group["speedup"], group["clear"],
                                                       strict=True)])
            chart = charts.heatmap(
                group, x="n", x_title="n", y="config", y_title=None, value="speedup",
                y_sort=analysis.config_order(group),
                value_title=f"× vs {baseline}", text="text", log=True, domain_mid=1,
                scheme="redblue", row=alt.Row("label:N", title=None),
                column=alt.Column("op:N", title=None),
                tips=["run", "speedup_lo", "speedup_hi"], cell=56,
                title=f"{who}: speedup vs {baseline}",
            )
            page.chart(chart, rows[rows["run"] == run],
                       "Blue: faster than the baseline; red: slower (colours saturate at 4×); "
                       "~: no clear difference (within the noise); tooltip: the range from "
                       "the quartiles.")

    _per_device(page, speed, order, draw)


def _peers(page: Page, rows: pd.DataFrame) -> None:
    """Per run, whether each peer library ran: counts by status and the gist of why not."""
    page.md("## Peers: PyTorch and KeOps\n")
    peers = rows[rows["impl"].isin(PEERS)]
    if peers.empty:
        page.md("No stored `kernel_mv` run has PyTorch or KeOps rows.")
        return
    lines = []
    counts = analysis.status_counts(peers, ["run", "device", "impl"])
    for _, count in counts.iterrows():
        group = peers[(peers["run"] == count["run"]) & (peers["impl"] == count["impl"])]
        parts = [f"{plural(count['measured'], 'case')} measured"]
        if count["failed"]:
            gist = analysis.failures(group)["error"].map(short_error).mode().iloc[0]
            parts.append(f"{count['failed']} failed ({gist})")
        if count["skipped"]:
            gist = analysis.skipped(group)["error"].map(skip_gist).mode().iloc[0]
            parts.append(f"{count['skipped']} skipped ({gist})")
        lines.append(f"{PEERS[count['impl']]} on {analysis.short_gpu(count['device'])} "
                     f"(run {count['run']}): " + "; ".join(parts) + ".")
    page.md("Each peer computes the same sums; a row that did not run says why (its full "
            "error is in the stored file):\n\n" + "\n".join(f"- {line}" for line in lines))


def _kde(page: Page, rows: pd.DataFrame, order: pd.Series) -> None:
    page.md("## KDE density\n")
    if rows.empty:
        page.md("No stored run has the `kde_density` suite.")
        return
    def draw(_run, who, group):
        chart = charts.lines(
            analysis.timed(group), x="n", x_title="n (= m)", color="label",
            color_title="implementation",
            row=alt.Row("config:N", title=None, sort=analysis.config_order(group)),
            column=alt.Column("op:N", title=None), tips=["run", "q1_ms", "q3_ms"],
            width=260, height=110, title=f"{who}: rbf_kde_density median time vs n",
        )
        page.chart(chart, group, _not_drawn(group))

    _per_device(page, rows, order, draw)


def _tiles(page: Page, rows: pd.DataFrame, order: pd.Series) -> None:
    page.md("## Tile sweep\n")
    if rows.empty:
        page.md("No stored run has the `kernel_mv_tiles` suite.")
        return
    page.md(
        "The pallas kernel's tiles `block_q × block_k × block_o`. Colour: time relative to the "
        "best tile of the same case (1.00× is the best); the cell text is the median in ms."
    )
    good = analysis.timed(rows)
    good = good.assign(
        tile=[f"{r.block_q}×{r.block_k}×{r.block_o}" for r in good.itertuples()],
        case=good["op"] + " · n " + good["n"].map(fmt_int) + " · " + good["config"],
    )
    keys = ["source_file", "run", "case"]
    good["relative"] = good["median_ms"] / good.groupby(keys)["median_ms"].transform("min")
    good["text"] = good["median_ms"].map(fmt_ms)
    def draw(run, who, group):
        chart = charts.heatmap(
            group, x="tile", x_title="block_q × block_k × block_o", y="case", y_title=None,
            value="relative", value_title="× best tile", text="text", scheme="oranges",
            tips=["run", "median_ms", "q1_ms", "q3_ms"], cell=78,
            title=f"{who}: tile sweep",
        )
        page.chart(chart, rows[rows["run"] == run])

    _per_device(page, good, order, draw)


def _launches(page: Page, rows: pd.DataFrame, order: pd.Series | None = None) -> None:
    page.md("## Launch sweep\n")
    if rows.empty:
        page.md(f"No stored run has the `{LAUNCH_SUITE}` suite.")
        return
    page.md(
        "Each Pallas kernel family with one launch changed at a time: `block_p` (the program "
        "tile: rows of the point set one program owns) × `block_l` (the loop tile: rows of the "
        "other set per step) · w Triton warps · s pipeline stages. The fast path is the default "
        "precision's expansion kernels, the exact path `precision=\"highest\"`'s difference "
        "kernels; a backward row sets the dq and dk launches together and times forward + "
        "backward (`fwd_bwd`); a *Mosaic GPU* row runs the backward on the Hopper kernels "
        "instead. **default** marks the launch `rbf_kernel_mv` picks for the "
        "problem on that "
        "GPU. × default is the launch's median over the default's, within one stored file "
        "(~: within the noise); rel. error is the largest relative error of the output "
        "(forward) or of the gradients (forward + backward) against float64."
    )
    rows = rows.assign(
        launch=[_launch_text(r) for r in rows.itertuples()],
        group=[LAUNCH_GROUPS.get((r.path, r.kernel), f"{r.path} path, {r.kernel}")
               for r in rows.itertuples()],
        short=[LAUNCH_SHORT.get((r.path, r.kernel), f"{r.path} {r.kernel}")
               for r in rows.itertuples()],
        rel_error=_worst_error(rows),
    )
    families = {group: i for i, group in enumerate(LAUNCH_GROUPS)}
    rows = rows.assign(_order=[families.get((r.path, r.kernel), len(families))
                               for r in rows.itertuples()])
    rows = rows.sort_values(["_order", "path", "kernel"], kind="stable")
    ranked = pd.concat([_ranked(group) for _, group in
                        rows.groupby(LAUNCH_KEYS, dropna=False, sort=False)])
    def draw(_run, who, per_run):
        for _, group in per_run.groupby(LAUNCH_KEYS, dropna=False, sort=False):
            _launch_table(page, who, group)
        # After the run's tables: before them it would sit under the previous run's heading.
        _launch_chart(page, who, per_run)

    _per_device(page, ranked, order, draw)


def _launches_count(count: int) -> str:
    return f"{count} launch" + ("" if count == 1 else "es")


def _launch_text(row) -> str:
    """'128 × 64 · w4 · s3' (block_p × block_l, warps, stages; w4-s3 as in the row ids), or
    '128 × 64 · Mosaic GPU' for the Mosaic GPU gradient sweeps (warps and stages their own)."""
    def number(value):
        return "?" if pd.isna(value) else str(int(value))

    tiles = f"{number(row.block_p)} × {number(row.block_l)}"
    backend = getattr(row, "bwd_backend", None)
    if isinstance(backend, str) and backend == "mosaic":
        return f"{tiles} · Mosaic GPU"
    return f"{tiles} · w{number(row.num_warps)} · s{number(row.num_stages)}"


def _worst_error(rows: pd.DataFrame) -> pd.Series:
    """The output's relative error (fwd) or the largest of the gradients' (fwd_bwd)."""
    grads = rows[GRAD_ERRORS].max(axis=1, skipna=True)
    return rows["rel_err"].where(rows["rel_err"].notna(), grads)


def _ranked(group: pd.DataFrame) -> pd.DataFrame:
    """One kernel family of one file: measured launches by median (``rank``), then failed,
    then skipped; ``vs_default`` (median / the default's) and ``clear`` (the noise allows it)
    where the default launch was measured."""
    group = group.assign(is_default=group["default_launch"].fillna(False).astype(bool))
    good = analysis.timed(group).sort_values(["median_ms", "launch"])
    rest = group.drop(good.index)
    rest = rest.assign(_status=rest["status"].map({"failed": 0, "skipped": 1}).fillna(2))
    rest = rest.sort_values(["_status", "launch"]).drop(columns="_status")
    good = good.assign(rank=range(1, len(good) + 1), vs_default=math.nan, clear=None)
    default = good[good["is_default"]]
    if not default.empty:
        base = default.iloc[0]
        compared = [verdict.compare(base, row) for _, row in good.iterrows()]
        good = good.assign(vs_default=[c["ratio"] for c in compared],
                           clear=[c["clear"] for c in compared])
    return pd.concat([good, rest.assign(vs_default=math.nan, clear=None)])


def _launch_chart(page: Page, who: str, rows: pd.DataFrame) -> None:
    """Every measured launch's median relative to its family's default, one row per family."""
    data = rows[rows["vs_default"].notna()].sort_values("is_default", kind="stable")  # on top
    data = data.assign(
        family=data["short"] + " · " + data["config"] + " · n " + data["n"].map(fmt_size),
        marked=data["is_default"].map({True: "default", False: "other launch"}),
    )
    families = list(dict.fromkeys(data["family"]))
    select = alt.selection_point(fields=["marked"], bind="legend")
    points = alt.Chart(data).mark_point(filled=True, size=70).encode(
        alt.X("vs_default:Q", title="median / the default launch's (log scale)",
              scale=alt.Scale(type="log", nice=False, padding=12)),
        alt.Y("family:N", title=None, sort=families),
        alt.Color("marked:N", title="launch", scale=alt.Scale(
            domain=["default", "other launch"], range=["#e45756", "#4c78a8"]),
            legend=alt.Legend(orient="bottom")),
        alt.Shape("marked:N", title="launch", scale=alt.Scale(
            domain=["default", "other launch"], range=["diamond", "circle"])),
        opacity=alt.condition(select, alt.value(0.85), alt.value(0.15)),
        tooltip=charts.tooltip(["launch", "family", "median_ms", "q1_ms", "q3_ms", "rounds",
                                alt.Tooltip("vs_default", format=".3~f", title="× default")]),
    ).add_params(select)
    rule = alt.Chart(data).mark_rule(color="#555", strokeDash=[4, 3]).encode(x=alt.datum(1))
    chart = alt.layer(rule, points).properties(width=330, height=alt.Step(34))
    failed = int((rows["status"] == "failed").sum())
    skipped = int((rows["status"] == "skipped").sum())
    no_default = int((rows["status"] == "measured").sum()) - len(data)
    not_drawn = [f"{n} {kind}" for n, kind in (
        (failed, "failed"), (skipped, "skipped"),
        (no_default, "measured in a family whose default has no time")) if n]
    caption = ("One point per launch; left of the dashed line is faster than the default. "
               "Hover for the launch and its time."
               + (f" Not drawn ({_launches_count(failed + skipped + no_default)}): "
                  f"{join_names(not_drawn)}; the tables below list them."
                  if not_drawn else ""))
    page.chart(charts.finish(chart, f"{who}: launches relative to the default"), rows, caption,
               empty=(f"No launch family of run {rows['run'].iloc[0]} has a measured default "
                      "launch to compare with; the tables below list every launch."))


def _launch_table(page: Page, who: str, rows: pd.DataFrame) -> None:
    first = rows.iloc[0]
    precision = first["precision"] if isinstance(first["precision"], str) else "default"
    page.heading(3, f"{who}: {first['group']}")
    measured = rows[rows["status"] == "measured"]
    default = measured[measured["is_default"]]
    facts = [f"{first['config']}, n = m = {fmt_int(first['n'])}, precision {precision}, "
             f"{first['op']}; {_launches_count(len(rows))}: {len(measured)} measured"]
    for status in ("failed", "skipped"):
        count = int((rows["status"] == status).sum())
        if count:
            facts.append(f"{count} {status}")
    text = ", ".join(facts) + "."
    if not measured.empty:
        best = measured.iloc[0]
        text += (f" Fastest: {best['launch']}, "
                 f"{fmt_ms(best['median_ms'], best['q1_ms'], best['q3_ms'])} ms.")
    if not default.empty:
        base = default.iloc[0]
        text += f" The default, {base['launch']}, ranks {int(base['rank'])} of {len(measured)}"
        if int(base["rank"]) > 1:
            lead = verdict.compare(best, base)
            closeness = ("" if lead["clear"] is None or pd.isna(lead["clear"]) else
                         ", within the noise" if not lead["clear"] else "")
            text += f" ({fmt_ratio(lead['ratio'])} the fastest's time{closeness})"
        text += "."
    elif rows["is_default"].any():
        text += " The default launch has no time (see its row)."
    else:
        text += " This file has no row of the default launch."
    page.md(text)
    quality = verdict.quality(measured) if not measured.empty else None
    cells = []
    for index, row in rows.iterrows():
        measured_row = row["status"] == "measured"
        launch = f"**{row['launch']} (default)**" if row["is_default"] else row["launch"]
        launch = launch.replace(" ", "\u00a0")  # written as Markdown: kept on one line here
        ratio = row.get("vs_default")
        ratio_text = ""
        if measured_row and row["is_default"]:
            ratio_text = fmt_ratio(1.0)
        elif measured_row and ratio is not None and not pd.isna(ratio):
            clear = row.get("clear")
            ratio_text = ("~" if clear is False else "") + fmt_ratio(ratio)
        if measured_row:
            flags = quality.loc[index]
            status = "measured"
            rounds = rounds_cell(row["rounds"], few=bool(flags["few_rounds"]),
                                 wide=bool(flags["wide_spread"]))
        else:
            why = (short_error(row["error"]) if row["status"] == "failed"
                   else skip_gist(row["error"]))
            status = f"{row['status']}: {why}"
            rounds = "—"
        cells.append({
            "rank": str(int(row["rank"])) if measured_row else "—",
            "launch": launch,
            "median ms (q1–q3)": fmt_ms(row["median_ms"], row["q1_ms"], row["q3_ms"])
            if measured_row else "",
            "× default": ratio_text,
            "rounds": rounds,
            "rel. error": (f"{row['rel_error']:.1e}" if measured_row
                           and not pd.isna(row["rel_error"]) else ""),
            "status": status,
        })
    display = pd.DataFrame(cells)
    page.table(display, rows, "Sorted by median time; failed and skipped launches last.",
               markdown_columns=["launch"],
               collapsed=(f"All {len(display)} launches" if len(display) > 20 else None))


def _crossover(page: Page, rows: pd.DataFrame) -> None:
    page.md("## Crossover repeats\n")
    if rows.empty:
        page.md("No stored run has the `kernel_mv_crossover` suite.")
        return
    page.md(
        "Small sizes, where pallas and xla cross over, measured in repeated rounds. Each point "
        "is xla / pallas within one repeat (above 1×: pallas faster); the line joins the "
        "median over repeats."
    )
    keys = ["source_file", "run", "device", "config", "op", "n", "repeat"]
    good = analysis.timed(rows)
    pallas = good[good["label"] == "pallas"][[*keys, "median_ms"]]
    xla = good[good["label"] == "xla"][[*keys, "median_ms"]]
    pairs = pallas.merge(xla, on=keys, suffixes=("_pallas", "_xla"))
    pairs["speedup"] = pairs["median_ms_xla"] / pairs["median_ms_pallas"]
    pairs["repeat"] = pairs["repeat"].astype("Int64")
    if pairs.empty:
        page.md("No repeat measured both pallas and xla.")
        return
    select = alt.selection_point(fields=["config"], bind="legend")
    base = alt.Chart().encode(
        alt.X("n:Q", title="n (= m)", scale=alt.Scale(type="log", base=2),
              axis=alt.Axis(format="~s")),
        alt.Color("config:N", title="config"),
        opacity=alt.condition(select, alt.value(1), alt.value(0.12)),
    )
    chart = alt.layer(
        base.mark_point(size=35).encode(
            alt.Y("speedup:Q", title="xla / pallas", scale=alt.Scale(type="log")),
            tooltip=charts.tooltip(["config", "op", "n", "repeat", "speedup", "median_ms_xla",
                                    "median_ms_pallas"]),
        ).add_params(select),
        base.mark_line().encode(alt.Y("median(speedup):Q")),
        alt.Chart().mark_rule(strokeDash=[4, 3], color="#555").encode(y=alt.datum(1)),
    ).properties(width=260, height=190).facet(
        data=pairs, column=alt.Column("op:N", title=None)
    )
    page.chart(charts.finish(chart, "Crossover: pallas vs xla per repeat"), rows,
               "Batch 4 cases appear as their own config.")
    summary = pairs.groupby(["config", "op", "n"]).agg(
        repeats=("speedup", "size"), lo=("speedup", "min"), hi=("speedup", "max"),
        median=("speedup", "median")).reset_index()
    display = pd.DataFrame({
        "config": summary["config"], "op": summary["op"], "n": summary["n"].map(fmt_int),
        "repeats": summary["repeats"], "median xla / pallas": summary["median"].map(fmt_ratio),
        "range over repeats": [f"{fmt_ratio(lo)} – {fmt_ratio(hi)}" for lo, hi in
                               zip(summary["lo"], summary["hi"], strict=True)],
    })
    page.table(display, rows, collapsed=f"Crossover summary ({len(display)} cases)")


def _memory(page: Page, table: pd.DataFrame, order: pd.Series) -> None:
    page.md("## Peak memory vs n\n")
    rows, growth = headlines.rbf_memory(table)
    peak = rows[rows["suite"] == "kernel_mv_peak"]
    if peak.empty:
        page.md("No stored run has the `kernel_mv_peak` suite.")
        return
    page.md("Peak device memory of one call, each size in a fresh process.")
    def draw(_run, who, group):
        chart = charts.ladder(
            group, x="n", x_title="n (= m)", color="label", color_title="implementation",
            column=alt.Column("op:N", title=None), tips=["run", "config", "run_s"],
            title=f"{who}: peak memory vs n",
        )
        page.chart(chart, group, "Log–log; a cross on the top edge marks a failed size.")

    _per_device(page, peak, order, draw)
    page.table(_shared.memory_display(growth), rows, name="rbf-memory-growth")


def _max_n(page: Page, rows: pd.DataFrame, order: pd.Series) -> None:
    page.md("## Largest n (max-n ladder)\n")
    if rows.empty:
        page.md("No stored run has the `kernel_mv_max_n` suite.")
        return
    page.md(
        "n doubled until the call failed or ran past the time limit, each size in a fresh "
        "process; peak memory of the sizes that ran, and the subprocess wall time."
    )
    stated = rows[rows["summary"].fillna(False).astype(bool)]
    ladder = rows.drop(stated.index)
    def draw(_run, who, group):
        chart = charts.ladder(
            group, x="n", x_title="n (= m)", color="label", color_title="implementation",
            column=alt.Column("op:N", title=None), tips=["run", "config", "run_s"],
            width=380, height=220, title=f"{who}: max-n ladder",
        )
        page.chart(chart, group, "A cross marks the size that failed or timed out.")

    _per_device(page, ladder, order, draw)
    keys = ["source_file", "run", "device", "label", "op", "config"]
    limits = analysis.ladder_limits(ladder, stated, size="n", stated="max_n", keys=keys)
    limits = analysis.best_limit_per_ladder(limits, keys[1:])
    page.md(LOWER_BOUND_NOTE)
    display = pd.DataFrame({
        "GPU": limits["device"].map(analysis.short_gpu), "run": limits["run"],
        "impl": limits["label"], "op": limits["op"], "config": limits["config"],
        "largest n that ran": limits.apply(_shared.largest_text, axis=1),
        "limit": limits.apply(_shared.limit_text, axis=1),
        "peak MiB there": limits["peak_mb"].map(fmt_num),
        "wall s there": limits["run_s"].map(fmt_num),
        "failure": limits["failure"].map(short_error),
    })
    page.table(display, rows, "From each ladder's own rows (and its summary row, where the run "
                              "wrote one).", name="rbf-max-n", key_columns=6)


def _numerics(page: Page, rbf: pd.DataFrame) -> None:
    metrics = {"rel_err": "out (fwd)", "rel_err_dq": "dq", "rel_err_dk": "dk",
               "rel_err_dv": "dv", "rel_err_dlengthscale": "dlengthscale"}
    rows = rbf[rbf[list(metrics)].notna().any(axis=1)]
    page.md("## Numerics\n")
    if rows.empty:
        page.md("No stored row has RBF relative errors.")
        return
    refs = sorted(rows["rel_err_ref"].dropna().unique())
    page.md(
        "Relative errors of the output (fwd) and of the gradients dq, dk, dv and dlengthscale "
        f"(fwd_bwd){' against ' + join_names(refs) if refs else ''}. "
        + ("The seed file does not say what its errors are relative to. " if
           rows["rel_err_ref"].isna().any() else "")
        + "torch_dense has no lengthscale gradient."
    )
    long = rows.melt(id_vars=["source_file", "run", "device", "label", "config", "op", "n"],
                     value_vars=list(metrics), var_name="metric", value_name="value")
    long = long.dropna(subset=["value"])
    long["metric"] = long["metric"].map(metrics)
    long = long[long["value"] > 0]
    chart = charts.lines(
        long, x="n", x_title="n (= m)", y="value", y_title="relative error", color="label",
        color_title="implementation", spread=False, detail="config",
        column=alt.Column("metric:N", title=None, sort=list(metrics.values())),
        tips=["config", "op", "run", alt.Tooltip("value", format=".2e")], width=150,
        height=170, title="Relative error vs n (one line per implementation and config)",
    )
    page.chart(chart, rows, "Log–log. Exact zeros (torch_dense fwd) are not drawn on the log "
                            "scale.")
    worst = long.groupby(["device", "label", "metric"])["value"].max().unstack("metric")
    worst = worst.reindex(columns=[m for m in metrics.values() if m in worst.columns])
    display = worst.map(lambda v: fmt_num(v, 3)).reset_index().rename(
        columns={"device": "GPU", "label": "implementation"})
    page.table(display.fillna(""), rows, "Largest relative error over every case measured.",
               name="rbf-numerics")


def _across_gpus(page: Page, rbf: pd.DataFrame, order: pd.Series) -> None:
    rows = analysis.across_devices(rbf, ["suite", *CASE])
    if not rows.empty:
        rows = sorted_rows(rows, ["suite", *analysis.RBF_CONFIG, "op", "n", "label", "gpu",
                                  "run"])
        rows = rows.assign(case=rows["suite"] + " · " + rows["config"] + " · " + rows["op"]
                           + " · n " + rows["n"].map(fmt_int))
    devices = sorted(rbf["device"].dropna().unique())
    render_across_gpus(page, rows, "RBF case", devices, order)


def _not_drawn(rows: pd.DataFrame) -> str:
    counts = rows["status"].value_counts()
    parts = [f"{counts[s]} {s}" for s in ("failed", "skipped") if counts.get(s)]
    return f"Not drawn: {', '.join(parts)}; see Not measured." if parts else ""
