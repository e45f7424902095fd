"""MoE expert parallel (suite ``ep``): per run and layer shape, the link's bandwidth (the
collectives of the exchanges), weak scaling (one GPU at T tokens against n GPUs at n·T tokens,
bf16 train step, per exchange transport) and the exchange's share of the step; failed and
skipped rows kept apart. The numbers come from `scaling`; this module words them."""

from __future__ import annotations

import altair as alt
import pandas as pd

from .. import analysis, charts, scaling, verdict
from ..load import StoredResults
from ..prepared import prepared
from ..render import (
    Page,
    fmt_int,
    fmt_ms,
    fmt_num,
    fmt_size,
    plural,
    rounds_cell,
    run_link,
)
from . import _shared

PATH = "reports/moe-expert-parallel.md"
TITLE = "MoE expert parallel"
SLUG = "moe-ep"
NOTHING_STORED = ("No expert-parallel run is stored yet: the `ep` suite needs two or more GPUs "
                  "(`nox -s bench -- --bench-suite ep`).")
ONE_GPU = "— (one GPU)"


def build(results: StoredResults) -> str:
    ready = prepared(results)
    table = ready.table
    rows = scaling.ep_rows(table)
    page = Page(SLUG, TITLE)
    if rows.empty:
        page.md(NOTHING_STORED)
        return page.render()
    page.md(
        "How well the MoE layer scales over the GPUs of one host (`moe_apply` with a mesh: "
        "experts and tokens divided over the GPUs, each token copy sent to its expert's GPU "
        "and back): the link's bandwidth, the weak-scaling efficiency of the bf16 train step "
        "for each exchange transport, and the exchange's share of the step. The newest run "
        "on each GPU kind comes first; earlier runs are folded under *Earlier runs*. Ratios "
        "pair rows of one stored file. " + _shared.VERDICTS
    )
    page.md(
        "??? note \"What the columns measure\"\n"
        "    Per run and layer shape: "
        "**the link**, a plain all-to-all or all-gather of the bytes one trip of an exchange "
        "moves (GB/s counts the bytes that leave each GPU); **weak scaling**, the bf16 train "
        "step on one GPU at T tokens against n GPUs at n·T tokens, for each exchange transport "
        "(`MoEConfig.exchange`: `all_gather` gathers the tokens and reduce-scatters partial "
        "outputs, `ragged` sends only the copies, `all_to_all` fixed worst-case blocks); "
        "and **the exchange's share** of the step, from the same step with the "
        "experts replaced by the identity and no shared expert (routing, the copies' trips "
        "there and back and the weighted combine, forward and backward)."
        "\n\n    **Weak-scaling efficiency** = (n-GPU tokens/s) / (n × one-GPU tokens/s), tokens/s "
        "being tokens / median step time: 1 means n GPUs do n times the work in the time one "
        "GPU does its share. **Exchange share** = exchange-only median / step median. "
        "**Overlap** = n-GPU step median / max(one-GPU step median, exchange-only median): the "
        "one-GPU step is the compute of one GPU's share of the tokens, so 1 means the "
        "exchange hides entirely behind the compute (or the compute behind it), and "
        "1 + smaller/larger that the two run one after the other. Each is a ratio of rows of "
        "the same stored file (one process); the range beside each comes from the rows' "
        "quartiles (the extreme ratios of q1 and q3)."
    )
    dates, order = ready.dates, ready.order
    steps = scaling.step_rows(rows)
    _summary(page, steps, rows, order)
    _shared.sections_newest_first(page, rows, order, lambda _, run, run_rows: _run_section(
        page, run_rows, steps[steps["run"] == run], dates))
    return page.render()


# ----------------------------------------------------------------------------- cells


def _ratio(value: float, low: float, high: float, digits: int = 3) -> str:
    """'0.870 (0.861–0.879)'."""
    return _ranged(value, low, high, digits)


def _percent(value: float, low: float, high: float) -> str:
    """'26.1% (25.4–26.8%)'."""
    return _ranged(value, low, high, digits=1, scale=100.0, unit="%")


def _ranged(value: float, low: float, high: float, digits: int, scale: float = 1.0,
            unit: str = "") -> str:
    """``value`` with its range in brackets (the range left out where it is unknown)."""
    if pd.isna(value):
        return ""
    text = f"{value * scale:.{digits}f}{unit}"
    if not pd.isna(low) and not pd.isna(high):
        text += f" ({low * scale:.{digits}f}–{high * scale:.{digits}f}{unit})"
    return text


def _not_timed(status: str, error: object) -> str:
    """'failed (out of memory)' or 'skipped': a short cell; the run's *Not measured* section
    has the error or the reason."""
    return f"failed ({analysis.failure_kind(error)})" if status == "failed" else "skipped"


def _versus_one(efficiency: float, clear: object) -> str:
    """The efficiency against 1, by the noise rule applied to the two step times."""
    if pd.isna(efficiency):
        return ""
    if clear is None or pd.isna(clear):
        return "noise unknown"
    if not clear:
        return "no clear difference"
    return "below 1" if efficiency < 1 else "above 1"


def _efficiency_cell(row, status: bool = True) -> str:
    """The efficiency with its range; ``status``: say so when the step has no time."""
    if row.devices == 1:
        return "reference"
    if row.status != "measured":
        return _not_timed(row.status, row.error) if status else ""
    if pd.isna(row.efficiency):
        return "no timed one-GPU step in this file"
    return _ratio(row.efficiency, row.efficiency_lo, row.efficiency_hi)


def _share_cell(row) -> str:
    if row.devices == 1:
        return ""
    if not pd.isna(row.share):
        return _percent(row.share, row.share_lo, row.share_hi)
    if isinstance(row.exchange_status, str) and row.exchange_status != "measured":
        return f"exchange row {_not_timed(row.exchange_status, row.exchange_error)}"
    if row.status != "measured":
        return ""
    return "no exchange row in this file" if pd.isna(row.exchange_status) else ""


def _time_cell(row) -> str:
    if row.status != "measured":
        return _not_timed(row.status, row.error)
    return fmt_ms(row.median_ms, row.q1_ms, row.q3_ms)


def _rounds(row) -> str:
    if row.status != "measured":
        return ""
    few = not pd.isna(row.rounds) and row.rounds < verdict.FEW_ROUNDS
    wide = (not pd.isna(row.q1_ms) and not pd.isna(row.q3_ms)
            and (row.q3_ms - row.q1_ms) > verdict.WIDE_SPREAD * row.median_ms)
    return rounds_cell(row.rounds, few, wide)


def _tokens_per_s(value: float) -> str:
    return fmt_num(value / 1e6, 4) if not pd.isna(value) else ""


# ----------------------------------------------------------------------------- sections


def _summary(page: Page, steps: pd.DataFrame, rows: pd.DataFrame, order: pd.Series) -> None:
    """One row per n-GPU step of every run, newest run first."""
    several = steps[steps["devices"].gt(1).fillna(False).to_numpy(dtype=bool)]
    several = several.sort_values("run", kind="stable",
                                  key=lambda r: -r.map(order).fillna(-1))
    page.md("## Weak-scaling efficiency\n")
    if several.empty:
        page.md("No stored run has a train step on two or more GPUs.")
        return
    page.md(
        "Every n-GPU train step stored, against the one-GPU step of the same layer and tokens "
        "per GPU in the same file, newest run first. Each run's section below has the times "
        "behind it, and the errors and reasons of the rows without one."
    )
    display = pd.DataFrame({
        "layer": several["config"],
        "tokens/GPU": several["tokens_per_device"].map(fmt_size),
        "GPUs": several["devices"].map(fmt_int),
        "exchange": several["exchange"],
        "efficiency (range)": [_efficiency_cell(r) for r in several.itertuples()],
        "vs 1": [_versus_one(r.efficiency, r.clear) for r in several.itertuples()],
        "exchange share (range)": [_share_cell(r) for r in several.itertuples()],
        "overlap (range)": [_ratio(r.overlap, r.overlap_lo, r.overlap_hi)
                            for r in several.itertuples()],
        "impl": several["label"],
        "GPU": several["device"].map(analysis.short_gpu),
        "run": several["run"],
    })
    page.table(display, rows[rows["part"].isin(["step", "exchange"])],
               "Efficiency: (n-GPU tokens/s) / (n × one-GPU tokens/s), bf16 train step; "
               "*vs 1*: below or above 1 only where the two step times differ beyond the "
               "noise. Exchange share: exchange-only median / step median. Overlap: step "
               "median / the larger of the one-GPU step's and the exchange's (1: the smaller "
               "hidden behind the larger; 1 + smaller/larger: one after the other).",
               name="ep-summary", key_columns=4)


def _run_section(page: Page, rows: pd.DataFrame, steps: pd.DataFrame, dates: pd.Series) -> None:
    device, run = rows["device"].iloc[0], rows["run"].iloc[0]
    devices = sorted(int(n) for n in rows["devices"].dropna().unique())
    meshes = sorted(rows["mesh"].dropna().unique())
    page.heading(2, f"{device}, run `{run}`")
    date = dates.get(run)
    page.md(
        f"Run {run_link(run)}" + (f", {date}" if isinstance(date, str) else "") + ": rows on "
        f"{' and '.join(plural(n, 'GPU') for n in devices)}"
        + (f" (mesh {', '.join(f'`{m}`' for m in meshes)})" if meshes else "")
        + f"; stored in {', '.join(f'`{f}`' for f in sorted(rows['source_file'].unique()))} "
        "(each table and chart below links the file it reads)."
    )
    _link(page, rows, run)
    shapes = rows[rows["part"] != "link"].sort_values(scaling.SHAPE_ORDER, kind="stable")
    for (config, label, dtype), per_shape in shapes.groupby(["config", "label", "dtype"],
                                                            sort=False):
        shape_steps = steps[(steps["config"] == config) & (steps["label"] == label)
                            & (steps["dtype"] == dtype)]
        _shape(page, per_shape, shape_steps, run)
    if (rows["status"] != "measured").any():
        _shared.not_measured(page, rows, "expert-parallel case",
                             {"part": "part", "config": "layer", "devices": "GPUs",
                              "exchange": "exchange", "tokens": "tokens"},
                             name=f"ep-{run}", heading="### Not measured in this run")


def _link(page: Page, rows: pd.DataFrame, run: str) -> None:
    link = scaling.link_rows(rows)
    page.md("### The link: collective bandwidth\n")
    if link.empty:
        page.md("This run stored no link row.")
        return
    page.md(
        "For each layer and token count, the collective of an exchange alone on the bytes of "
        "one trip: `all_to_all`, a plain `jax.lax.all_to_all` (every GPU sends an equal share "
        "of its T × top-k copies of d_model bf16 values to every GPU; the bytes leaving each "
        "GPU are (n − 1)/n of its buffer); `all_gather`, a plain `jax.lax.all_gather` of each "
        "GPU's T tokens (d_model bf16 values each; (n − 1) × T × d_model × 2 bytes leave each "
        "GPU). GB/s counts the bytes that leave each GPU over the median time."
    )
    good = link[link["status"] == "measured"].assign(
        series=lambda f: [f"{c}, {plural(int(n), 'GPU')}"
                          for c, n in zip(f["collective"], f["devices"], strict=True)])
    if not good.empty:
        chart = charts.lines(
            good, x="mib", x_title="MiB leaving each GPU per trip", y="gbps",
            y_title="GB/s per GPU", color="series", color_title="collective", spread=False,
            log_y=False, x_format="~g",
            tips=["config", "tokens_per_device", "median_ms", "q1_ms", "q3_ms", "gbps_lo",
                  "gbps_hi"],
            title=f"{rows['device'].iloc[0]}: collective bandwidth per message size",
        )
        page.chart(chart, link, "Log x axis; tooltips give the median and the GB/s range "
                                "from the quartiles.")
    display = pd.DataFrame({
        "collective": link["collective"],
        "MiB per GPU": link["mib"].map(lambda v: fmt_num(v, 4)),
        "GPUs": link["devices"].map(fmt_int),
        "GB/s (range)": [_ratio(r.gbps, r.gbps_lo, r.gbps_hi, 1) if r.status == "measured"
                         else _not_timed(r.status, r.error) for r in link.itertuples()],
        "median ms (q1–q3)": [_time_cell(r) for r in link.itertuples()],
        "rounds": [_rounds(r) for r in link.itertuples()],
        "layer": link["config"],
        "tokens/GPU": link["tokens_per_device"].map(fmt_size),
    })
    page.table(display, link, "Bytes and GB/s per GPU; the range is bytes / q3 to bytes / q1.",
               name=f"ep-link-{run}", key_columns=4)


def _shape(page: Page, rows: pd.DataFrame, steps: pd.DataFrame, run: str) -> None:
    config, label = rows["config"].iloc[0], rows["label"].iloc[0]
    dtype, op = rows["dtype"].iloc[0], rows["op"].iloc[0]
    page.heading(3, f"{config} · {label}")
    page.md(
        f"{dtype} {op.replace('_', ' ')}, `{label}`: one GPU at T tokens against n GPUs at "
        "n·T tokens, per exchange transport. The exchange share is the exchange-only row's "
        "median over the step's."
    )
    if steps.empty:
        page.md("This layer has no train-step row in this run.")
        return
    display = pd.DataFrame({
        "tokens/GPU": steps["tokens_per_device"].map(fmt_size),
        "GPUs": steps["devices"].map(fmt_int),
        "exchange": steps["exchange"].fillna(ONE_GPU),
        "median ms (q1–q3)": [_time_cell(r) for r in steps.itertuples()],
        "rounds": [_rounds(r) for r in steps.itertuples()],
        "M tokens/s": steps["tokens_per_s"].map(_tokens_per_s),
        "efficiency (range)": [_efficiency_cell(r, status=False) for r in steps.itertuples()],
        "exchange share (range)": [_share_cell(r) for r in steps.itertuples()],
        "exchange ms": steps["exchange_ms"].map(fmt_ms),
        "tokens": steps["tokens"].map(fmt_int),
    })
    page.table(display, rows, "Train step per GPU count and transport. Efficiency: (n-GPU "
               "tokens/s) / (n × one-GPU tokens/s); 'reference' marks the one-GPU step.",
               key_columns=3)
    eff = steps[steps["efficiency"].notna()]
    bars = pd.concat([
        eff.assign(metric="weak-scaling efficiency", value=eff["efficiency"],
                   low=eff["efficiency_lo"], high=eff["efficiency_hi"], ideal=1.0),
        steps[steps["share"].notna()].pipe(lambda f: f.assign(
            metric="exchange share of the step", value=f["share"], low=f["share_lo"],
            high=f["share_hi"])),
    ], ignore_index=True)
    if bars.empty:
        page.md("No efficiency or exchange share to draw: the rows it needs were not all "
                "measured (see the table above and *Not measured in this run*).")
        return
    bars = bars.assign(case=[f"{r.exchange} · {fmt_size(r.tokens_per_device)}/GPU · "
                             f"{plural(int(r.devices), 'GPU')}" for r in bars.itertuples()])
    chart = charts.bars(
        bars, category="case", category_title=None, value="value", value_title=None,
        color="exchange", color_title="exchange", bounds=("low", "high"),
        column=_metric_column(bars), sort_by_value=False, reference="ideal",
        tips=["metric", "low", "high", "median_ms", "run"], width=230,
        title=f"{rows['device'].iloc[0]}: {config}, weak scaling and exchange share",
    )
    page.chart(chart, rows, "Bars: the ratio; black rules: its range from the quartiles; "
               "dashed: efficiency 1 (n GPUs do n times the work in the time of one).")


def _metric_column(bars: pd.DataFrame) -> alt.Column:
    order = [m for m in ("weak-scaling efficiency", "exchange share of the step")
             if m in set(bars["metric"])]
    return alt.Column("metric:N", title=None, sort=order)
