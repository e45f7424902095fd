"""MoE internals: train-step cost split, block_m sweep, slab sweep, largest train step, A/B."""

from __future__ import annotations

import re

import altair as alt
import pandas as pd

from .. import analysis, charts
from ..load import StoredResults
from ..prepared import prepared
from ..render import Page, fmt_int, fmt_ms, fmt_num, fmt_ratio, short_error
from . import _shared

PATH = "reports/moe-internals.md"
TITLE = "MoE internals"
SLUG = "moe-internals"
PIECE_ORDER = ["route", "sort_permute", "experts_grouped_swiglu", "unpermute_combine"]
# A/B runs say so in their note ("A/B rep 2, ..."); the rep number pairs before with final.
AB_NOTE = re.compile(r"A/B rep (\d+)")
LOWER_BOUND_NOTE = (
    "The limit lies between the largest size that ran and the smallest larger size that "
    "failed. **≥** marks a lower bound: the failing size is more than double the one that "
    "ran (the ladder skipped the sizes between) or no larger size failed, so the real limit "
    "may be higher."
)


def build(results: StoredResults) -> str:
    ready = prepared(results)
    moe = ready.table[ready.table["family"] == "moe"]
    page = Page(SLUG, TITLE)
    page.md(
        "Where the time of a MoE train step goes and how the tuning knobs move it, from the "
        "runs that measured one implementation under controlled changes: the cost of each "
        "piece, the row tile `block_m`, the scatter's slab size, the largest train step that "
        "fits, and A/B repetitions of `before` against `final` code. Times are medians "
        "(q1–q3); each sweep opens with its newest run on each GPU, earlier runs folded."
    )
    _pieces(page, moe[moe["suite"] == "pieces"])
    _block_m(page, moe[moe["suite"] == "blockm"], ready.order)
    _slab(page, moe[(moe["suite"] == "layer") & moe["slab_elems"].notna()])
    _maxtok(page, moe[moe["suite"] == "maxtok"], moe[moe["suite"] == "maxtok_summary"],
            ready.order)
    _ab(page, moe[moe["suite"] == "layer"])
    _shared.not_measured(page, moe[moe["suite"].isin(["pieces", "blockm", "maxtok"])],
                         "case", {"suite": "suite", "label": "impl", "piece": "piece",
                                  "block_m": "block_m", "dtype": "dtype", "op": "op",
                                  "tokens": "tokens", "gpu": "GPU"}, name="moe-internals")
    return page.render()


def _case(rows: pd.DataFrame) -> pd.Series:
    return rows["dtype"] + " · " + rows["tokens"].map(fmt_int) + " tokens"


def _pieces(page: Page, rows: pd.DataFrame) -> None:
    page.md("## Train-step cost split\n")
    if rows.empty:
        page.md("No stored run has the `pieces` suite.")
        return
    page.md(
        "Each piece of the sorted dropless path timed on its own (forward and backward), "
        "stacked: route (router + top-k), sort/permute, the grouped SwiGLU expert matmuls, "
        "unpermute/combine. The sum is the pieces' cost, not a measured train step."
    )
    rows = rows.assign(case=_case(rows), piece_order=rows["piece"].map(
        {p: i for i, p in enumerate(PIECE_ORDER)}))
    good = analysis.timed(rows)
    good = good.assign(share=good["median_ms"] / good.groupby(
        ["source_file", "run", "case"])["median_ms"].transform("sum"))
    chart = (
        alt.Chart(good)
        .mark_bar()
        .encode(
            alt.Y("case:N", title=None),
            alt.X("median_ms:Q", title="median time (ms), stacked", stack="zero"),
            alt.Color("piece:N", sort=PIECE_ORDER, title="piece"),
            alt.Order("piece_order:Q"),
            tooltip=charts.tooltip(["run", "code", "piece", "case", "median_ms", "q1_ms",
                                    "q3_ms", "share"]),
        )
        .properties(width=520, height=alt.Step(18))
        .facet(row=alt.Row("run:N", title=None, header=alt.Header(labelAngle=0,
                                                                  labelAlign="left")))
        .resolve_scale(x="independent")
    )
    page.chart(charts.finish(chart, "Train-step pieces per run"), rows,
               "Each run on its own axis; hover for the piece's share.")
    keys = ["run", "code", "case"]
    good = good.assign(code=good["code"].fillna(""))
    shares = good.pivot_table(index=keys, columns="piece", values="share", aggfunc="first")
    shares = shares.reindex(columns=[p for p in PIECE_ORDER if p in set(good["piece"])])
    sums = good.groupby(keys)["median_ms"].sum().rename("sum of pieces (ms)")
    display = shares.map(lambda v: "" if pd.isna(v) else f"{v:.1%}").join(sums.map(fmt_num))
    display = display.reset_index()
    page.table(display.fillna(""), rows, "Share of the summed pieces.")


def _block_m(page: Page, rows: pd.DataFrame, order: pd.Series) -> None:
    page.md("## block_m sweep\n")
    if rows.empty:
        page.md("No stored run has the `blockm` suite.")
        return
    page.md("The grouped matmul's row tile `block_m` for the sorted pallas path.")
    rows = rows.assign(case=_case(rows))

    def draw(device: str, run: str, group: pd.DataFrame) -> None:
        good = analysis.timed(group)
        chart = charts.lines(
            good, x="block_m", x_title="block_m", color="case", color_title="case",
            column=alt.Column("op:N", title=None),
            tips=["run", "code", "q1_ms", "q3_ms", "rounds"], x_format="d",
            title=f"{analysis.short_gpu(device)}, run {run}: block_m sweep",
        )
        page.chart(chart, group, _not_drawn(group))

    _shared.sections_newest_first(page, rows, order, draw)


def _slab(page: Page, rows: pd.DataFrame) -> None:
    page.md("## Slab-size sweep\n")
    sweep = rows[rows["code"] == "sweep"] if rows["code"].eq("sweep").any() else rows
    if sweep.empty:
        page.md("No stored run records a scatter slab size.")
        return
    page.md(
        "The intermediate scatter variant split its scatter into slabs of `slab_elems` "
        "elements (0: one slab). One run per slab size; the slab size is taken from each run's "
        "entry in the file's `config.sources`."
    )
    sweep = sweep.assign(case=_case(sweep), slab=sweep["slab_elems"].map(_slab_label))
    order = [_slab_label(v) for v in sorted(sweep["slab_elems"].unique())]
    good = analysis.timed(sweep)
    chart = (
        alt.Chart(good)
        .mark_line(point=True)
        .encode(
            alt.X("slab:O", sort=order, title="slab size (elements)",
                  axis=alt.Axis(labelAngle=0)),
            alt.Y("median_ms:Q", title="median time (ms)", scale=alt.Scale(type="log")),
            alt.Color("case:N", title="case"),
            tooltip=charts.tooltip(["run", "slab", "case", "op", "median_ms", "q1_ms",
                                    "q3_ms"]),
        )
        .properties(width=260, height=200)
        .facet(column=alt.Column("op:N", title=None))
    )
    page.chart(charts.finish(chart, "Slab sweep, sorted pallas"), sweep)
    base = good[good["slab_elems"] == 0][["dtype", "tokens", "op", "median_ms"]]
    merged = good.merge(base, on=["dtype", "tokens", "op"], suffixes=("", "_one"))
    merged["vs one slab"] = (merged["median_ms"] / merged["median_ms_one"]).map(fmt_ratio)
    display = merged.pivot_table(index=["case", "op"], columns="slab", values="vs one slab",
                                 aggfunc="first").reindex(columns=order).reset_index()
    page.table(display.fillna(""), sweep,
               "Time relative to one slab (above 1×: slower). These are separate runs of the "
               "same code on the same GPU.")


def _slab_label(value) -> str:
    value = int(value)
    if value == 0:
        return "one slab"
    exponent = value.bit_length() - 1
    return f"2^{exponent}" if 1 << exponent == value else fmt_int(value)


def _maxtok(page: Page, ladder: pd.DataFrame, summary: pd.DataFrame, order: pd.Series
            ) -> None:
    page.md("## Largest train step\n")
    if ladder.empty and summary.empty:
        page.md("No stored run has the `maxtok` ladder.")
        return
    page.md(
        "Token counts doubled until the bf16 train step failed, each step in a fresh process; "
        "peak device memory (`peak_bytes_in_use`) of the steps that ran."
    )
    ladder = ladder.assign(series=ladder["label"] + " · " + ladder["code"].fillna(ladder["run"]))

    def draw(device: str, run: str, group: pd.DataFrame) -> None:
        chart = charts.ladder(
            group, x="tokens", x_title="tokens", color="series", color_title="impl · code",
            tips=["run", "code", "median_ms"], width=420, height=240,
            title=f"{analysis.short_gpu(device)}, run {run}: peak memory of the bf16 train "
                  "step vs tokens",
        )
        page.chart(chart, group, "A cross on the top edge marks the size that failed "
                                 "(hover for the error); skipped sizes are not drawn.")

    _shared.sections_newest_first(page, ladder, order, draw)
    keys = ["source_file", "run", "gpu", "code", "label"]
    limits = analysis.ladder_limits(ladder.assign(code=ladder["code"].fillna("")),
                                    summary.assign(code=summary["code"].fillna("")),
                                    size="tokens", stated="max_tokens", keys=keys)
    limits = analysis.best_limit_per_ladder(limits, keys[1:])
    page.md(LOWER_BOUND_NOTE)
    display = pd.DataFrame({
        "GPU": limits["gpu"], "run": limits["run"], "code": limits["code"],
        "impl": limits["label"],
        "largest tokens that ran": limits.apply(_shared.largest_text, axis=1),
        "limit": limits.apply(_shared.limit_text, axis=1),
        "peak MiB there": limits["peak_mb"].map(fmt_num),
        "failure": limits["failure"].map(short_error),
    }).sort_values(["GPU", "run", "impl"])
    page.table(display, pd.concat([summary, ladder]),
               "From each ladder's own rows (and its `maxtok_summary` row); the failure is the "
               "smallest size above the largest that ran that failed.",
               name="moe-maxtok-summary")


def _ab(page: Page, layer: pd.DataFrame) -> None:
    page.md("## Before/after A/B\n")
    notes = layer["run_note"].fillna("").map(lambda t: AB_NOTE.match(t))
    ab = layer[notes.notna()].assign(rep=[int(m.group(1)) for m in notes if m is not None])
    ab = ab[ab["code"].isin(["before", "final"])]
    if ab.empty:
        page.md("No stored runs are marked as A/B repetitions (a run note `A/B rep N`).")
        return
    page.md(
        "Interleaved repetitions of the same benchmark on `before` and `final` code (runs whose "
        "note says `A/B rep N`). The ratio is final / before within a repetition (below 1×: "
        "the final code is faster); its spread is the per-rep range and, per rep, the "
        "quartile bounds (final q1 / before q3 … final q3 / before q1)."
    )
    keys = ["source_file", "device", "label", "config", "dtype", "op", "tokens", "rep"]
    good = analysis.timed(ab)
    before = good[good["code"] == "before"][[*keys, "median_ms", "q1_ms", "q3_ms", "run"]]
    final = good[good["code"] == "final"][[*keys, "median_ms", "q1_ms", "q3_ms", "run"]]
    pairs = final.merge(before, on=keys, suffixes=("_final", "_before"))
    pairs["ratio"] = pairs["median_ms_final"] / pairs["median_ms_before"]
    pairs["ratio_lo"] = pairs["q1_ms_final"] / pairs["q3_ms_before"]
    pairs["ratio_hi"] = pairs["q3_ms_final"] / pairs["q1_ms_before"]
    pairs["case"] = pairs["dtype"] + " " + pairs["op"] + " · " + pairs["tokens"].map(fmt_int)
    pairs["rep"] = "rep " + pairs["rep"].astype(str)
    pairs["runs"] = pairs["run_before"] + " → " + pairs["run_final"]
    select = alt.selection_point(fields=["rep"], bind="legend")
    x_scale = alt.Scale(type="log", nice=False, padding=12)
    base = alt.Chart(pairs).encode(alt.Y("case:N", title=None), alt.YOffset("rep:N"),
                                   alt.Color("rep:N"),
                                   opacity=alt.condition(select, alt.value(1), alt.value(0.15)))
    chart = alt.layer(
        base.mark_rule(strokeWidth=2).encode(alt.X("ratio_lo:Q", scale=x_scale),
                                             alt.X2("ratio_hi:Q")),
        base.mark_point(filled=True, size=50).encode(
            alt.X("ratio:Q", title="final / before (log scale)", scale=x_scale),
            tooltip=charts.tooltip(["case", "rep", "runs", alt.Tooltip("ratio", format=".3f"),
                                    alt.Tooltip("ratio_lo", format=".3f"),
                                    alt.Tooltip("ratio_hi", format=".3f"),
                                    "median_ms_before", "median_ms_final"]),
        ).add_params(select),
        alt.Chart().mark_rule(strokeDash=[4, 3], color="#555").encode(x=alt.datum(1)),
    ).properties(width=480, height=alt.Step(22))
    label = ", ".join(sorted(pairs["label"].unique()))
    page.chart(charts.finish(chart, f"A/B: final vs before code, {label}"), ab,
               "Point: per-rep ratio of medians; rule: quartile bounds; dashed: no change.")
    summary = pairs.groupby(["case", "label"], sort=False).agg(
        before=("median_ms_before", list), final=("median_ms_final", list),
        ratios=("ratio", list), lo=("ratio_lo", "min"), hi=("ratio_hi", "max"),
    ).reset_index()
    display = pd.DataFrame({
        "case": summary["case"], "impl": summary["label"],
        "before ms (per rep)": summary["before"].map(lambda v: ", ".join(fmt_ms(x) for x in v)),
        "final ms (per rep)": summary["final"].map(lambda v: ", ".join(fmt_ms(x) for x in v)),
        "final / before (per rep)": summary["ratios"].map(
            lambda v: ", ".join(f"{x:.3f}" for x in v)),
        "mean ratio": summary["ratios"].map(lambda v: f"{sum(v) / len(v):.3f}"),
        "spread (quartile bounds)": [f"{lo:.3f} – {hi:.3f}" for lo, hi in
                                     zip(summary["lo"], summary["hi"], strict=True)],
    })
    page.table(display, ab, name="moe-ab")


def _not_drawn(rows: pd.DataFrame) -> str:
    counts = rows["status"].value_counts()
    parts = [f"{counts[s]} {s}" for s in ("failed", "skipped") if counts.get(s)]
    return f"Not drawn: {', '.join(parts)}; see Not measured." if parts else ""
