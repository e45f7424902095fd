"""Wording and tables that several report pages share: headline sentences, ranked tables,
ladder limits, and the "not measured" section that keeps failed and skipped rows apart."""

from __future__ import annotations

import math

import pandas as pd

from .. import analysis, verdict
from ..render import (
    Page,
    fmt_int,
    fmt_ms,
    fmt_num,
    fmt_ratio,
    fmt_size,
    fmt_time,
    plural,
    repeats_note,
    rounds_cell,
    run_link,
    short_error,
    skip_gist,
    verdict_phrase,
)

VERDICTS = ("A ratio is called faster or slower only beyond the noise "
            "([methodology](../methodology.md#verdicts)).")
NOISE_RULE = (
    "A verdict (\"A is 1.6× faster than B\") is stated only when the noise allows it: a rank "
    "test on the stored time of every round, or interquartile ranges that do not overlap "
    "where only quartiles were stored, and a difference of at least "
    f"{(verdict.MIN_EFFECT - 1) * 100:.0f}%; otherwise the page says *no clear difference*. "
    "See [methodology](../methodology.md#verdicts)."
)


def by_run_newest_first(rows: pd.DataFrame, order: pd.Series
                        ) -> tuple[list[tuple[str, str, pd.DataFrame]],
                                   list[tuple[str, str, pd.DataFrame]]]:
    """``rows`` split into (device, run, rows) groups, newest run first (``order``: run ->
    position in time; undated runs last): the newest run of each GPU, then every earlier one.
    Pages show the first list and fold the second under "Earlier runs"."""
    keys = rows[["device", "run"]].drop_duplicates()
    keys = keys.assign(_when=-keys["run"].map(order).fillna(-1)).sort_values(
        ["_when", "device", "run"])
    newest, earlier, seen = [], [], set()
    for device, run in zip(keys["device"], keys["run"], strict=True):
        group = rows[(rows["device"] == device) & (rows["run"] == run)]
        (earlier if device in seen else newest).append((device, run, group))
        seen.add(device)
    return newest, earlier


def sections_newest_first(page, rows: pd.DataFrame, order: pd.Series, draw) -> None:
    """``draw(device, run, rows)`` for each run of :func:`by_run_newest_first`: the newest runs
    open, the earlier ones folded under :func:`earlier_summary`."""
    newest, earlier = by_run_newest_first(rows, order)
    for group in newest:
        draw(*group)
    with page.collapsed(earlier_summary(earlier)):
        for group in earlier:
            draw(*group)


def earlier_summary(groups: list, what: str = "run") -> str:
    """'Earlier runs (12)' for the folded section."""
    return f"Earlier {what}s ({len(groups)}): older code or the same GPU measured before"


def quoted_run(run: str, dates: pd.Series) -> str:
    """'run `x`, 2026-11-30' with a link to the run's panel."""
    date = dates.get(run)
    return f"run {run_link(run)}" + (f", {date}" if isinstance(date, str) else "")


def moe_headline(best: pd.Series, dates: pd.Series) -> str:
    """The 32k-token sentence of one GPU's newest run."""
    code = f", {best['code']} code" if isinstance(best["code"], str) else ""
    fastest = fmt_time(best["fastest_ms"], best["fastest_q1"], best["fastest_q3"],
                       best["fastest_rounds"])
    text = (
        f"**{best['device']}** ({quoted_run(best['run'], dates)}{code}, {best['config']}): "
        f"**{best['fastest']}** took {fastest}, "
        f"{verdict_phrase(best['ratio'], best['clear'], best['runner_up'])}"
    )
    extras = [
        verdict_phrase(best[f"vs {b}"], best[f"vs {b} clear"], b)
        for b in ("dense routing", "ragged_dot/sorted")
        if not pd.isna(best.get(f"vs {b}")) and b not in (best["fastest"], best["runner_up"])
    ]
    if extras:
        text += "; " + ", ".join(extras)
    text += "."
    if not pd.isna(best.get("capacity_median_ms")):
        capacity = fmt_time(best["capacity_median_ms"], best["capacity_q1_ms"],
                            best["capacity_q3_ms"], best["capacity_rounds"])
        text += (" Capacity routing, which drops the tokens over each expert's capacity, took "
                 f"{capacity}.")
    return text


def ranked_display(ranked: pd.DataFrame, case_columns: tuple[str, ...] = ()) -> pd.DataFrame:
    """The table of `headlines.rank_exact_moe` as shown on the pages: key columns first."""
    if ranked.empty:
        return pd.DataFrame()
    few = ranked["fastest_rounds"].fillna(verdict.FEW_ROUNDS) < verdict.FEW_ROUNDS
    wide = ((ranked["fastest_q3"] - ranked["fastest_q1"]) / ranked["fastest_ms"]
            > verdict.WIDE_SPREAD).fillna(False)
    columns = {"config": ranked["config"]}
    for field in case_columns:
        columns[field] = ranked[field].map(fmt_size) if field == "tokens" else ranked[field]
    columns.update({
        "fastest exact impl": ranked["fastest"],
        "median ms (q1–q3)": [fmt_ms(r.fastest_ms, r.fastest_q1, r.fastest_q3)
                              for r in ranked.itertuples()],
        "rounds": [rounds_cell(r, f, w) for r, f, w in
                   zip(ranked["fastest_rounds"], few, wide, strict=True)],
        "repeats": [repeats_note(n, lo, hi) for n, lo, hi in
                    zip(ranked["fastest_repeats"], ranked["fastest_min"],
                        ranked["fastest_max"], strict=True)],
        "vs runner-up": [verdict_phrase(r.ratio, r.clear, r.runner_up, r.method)
                         for r in ranked.itertuples()],
        "vs dense routing": [verdict_phrase(v, c, "dense") for v, c in
                             zip(ranked["vs dense routing"], ranked["vs dense routing clear"],
                                 strict=True)],
        "vs ragged_dot": [verdict_phrase(v, c, "ragged_dot") for v, c in
                          zip(ranked["vs ragged_dot/sorted"],
                              ranked["vs ragged_dot/sorted clear"], strict=True)],
        "capacity routing ms": ranked["capacity_median_ms"].map(fmt_ms),
        "GPU": ranked["device"].map(analysis.short_gpu),
        "run (code)": [f"{r.run} ({r.code})" if isinstance(r.code, str) else r.run
                       for r in ranked.itertuples()],
        "not measured": [_not_measured(r.failed, r.skipped) for r in ranked.itertuples()],
    })
    return pd.DataFrame(columns)


def _not_measured(failed: int, skipped: int) -> str:
    parts = [f"{failed} failed" if failed else "", f"{skipped} skipped" if skipped else ""]
    return ", ".join(p for p in parts if p)


def growth_phrase(row: pd.Series) -> str:
    text = (f"**{row['label']}** {fmt_num(row['peak_min'], 3)} → "
            f"{fmt_num(row['peak_max'], 3)} MiB "
            f"for n {fmt_int(row['n_min'])} → {fmt_int(row['n_max'])}")
    if not math.isnan(row["exponent"]):
        text += f" (~n^{row['exponent']:.2f})"
    if not pd.isna(row["failed_at"]):
        kind = analysis.failure_kind(row["failure"])
        text += f", {'timed out' if kind == 'timeout' else 'failed'}"
        text += f"{' (out of memory)' if kind == 'out of memory' else ''}"
        text += f" at n {fmt_int(row['failed_at'])}"
    return text


def memory_sentences(growth: pd.DataFrame, dates: pd.Series) -> list[str]:
    sentences = []
    for (device, run), per_run in growth.groupby(["device", "run"], sort=False):
        peak = per_run[per_run["suite"] == "kernel_mv_peak"]
        focus = peak if not peak.empty else per_run
        for op, per_op in focus.groupby("op", sort=True):
            parts = [growth_phrase(r) for _, r in per_op.sort_values("label").iterrows()]
            sentences.append(
                f"**{device}** ({quoted_run(run, dates)}), {focus['suite'].iloc[0]} {op} "
                f"({per_op['config'].iloc[0]}): " + "; ".join(parts) + ".")
    return sentences


def memory_display(growth: pd.DataFrame) -> pd.DataFrame:
    if growth.empty:
        return pd.DataFrame()
    return pd.DataFrame({
        "impl": growth["label"],
        "op": growth["op"],
        "grows like n^": growth["exponent"].map(lambda e: "" if pd.isna(e) else f"{e:.2f}"),
        "n measured": [f"{fmt_int(r.n_min)} – {fmt_int(r.n_max)}" for r in growth.itertuples()],
        "peak MiB at smallest n": growth["peak_min"].map(lambda v: fmt_num(v, 3)),
        "peak MiB at largest n": growth["peak_max"].map(lambda v: fmt_num(v, 3)),
        "first failure at n": growth["failed_at"].map(fmt_int),
        "failure": growth["failure"].map(analysis.failure_kind),
        "GPU": growth["device"].map(analysis.short_gpu),
        "run": growth["run"],
        "suite": growth["suite"],
        "config": growth["config"],
    })


def decoder_sentences(ranked: pd.DataFrame, dates: pd.Series) -> list[str]:
    sentences = []
    for (device, run, op), per_op in ranked.groupby(["device", "run", "op"], sort=False):
        parts = [
            f"{fmt_size(r.tokens)} tokens **{r.fastest}** "
            f"{fmt_time(r.fastest_ms, r.fastest_q1, r.fastest_q3, r.fastest_rounds)}, "
            f"{verdict_phrase(r.ratio, r.clear, r.runner_up)}"
            for r in per_op.sort_values("tokens").itertuples()
        ]
        sentences.append(f"MoE decoder {op} on **{device}** ({quoted_run(run, dates)}): "
                         + "; ".join(parts) + ".")
    return sentences


def rbf_win_sentences(wins: pd.DataFrame, dates: pd.Series) -> list[str]:
    sentences = []
    if wins.empty:
        return sentences
    for (device, run), per_run in wins.groupby(["device", "run"], sort=False):
        parts = []
        for r in per_run.sort_values("clear_wins", ascending=False).itertuples():
            text = (f"**{r.label}** clearly fastest in {r.clear_wins} of {r.cases} cases"
                    + (f" (fastest but within the noise in {r.tied_wins} more)"
                       if r.tied_wins else ""))
            if not pd.isna(r.xla_lo):
                text += f", {fmt_ratio(r.xla_lo)}–{fmt_ratio(r.xla_hi)} vs xla"
            parts.append(text)
        sentences.append(
            f"RBF kernel_mv on **{device}** at n = {fmt_int(per_run['n'].iloc[0])} "
            f"({quoted_run(run, dates)}): " + "; ".join(parts) + ".")
    return sentences


def limit_text(record) -> str:
    """The ``limit`` cell of one `analysis.ladder_limits` row, in words."""
    ran, failed, kind = record["ran"], record["failed"], record["kind"] or "failed"
    if pd.isna(ran):
        return f"no size ran ({kind} at {fmt_int(failed)})" if pd.notna(failed) else "no size ran"
    if pd.isna(failed):
        why = f"stopped: {record['stopped']}" if record["stopped"] else "no larger size failed"
        return f"≥ {fmt_int(ran)} (ran; {why})"
    return f"between {fmt_int(ran)} (ran) and {fmt_int(failed)} ({kind})"


def largest_text(record) -> str:
    """The largest size that ran, with '≥' when it is only a lower bound of the limit."""
    if pd.isna(record["ran"]):
        return "none"
    return ("≥ " if record["lower_bound"] else "") + fmt_int(record["ran"])


def not_measured(page: Page, rows: pd.DataFrame, what: str, columns: dict[str, str],
                 name: str, heading: str = "## Not measured") -> None:
    """The rows of ``rows`` that have no time, kept apart: failed cases (attempted; with the
    error) in a table, skipped cases (never attempted) counted per run and reason.
    ``columns``: tidy column -> header of the case columns to show (key columns first)."""
    failed = analysis.failures(rows).drop_duplicates(["source_file", "source_row", "op"])
    skipped = analysis.skipped(rows).drop_duplicates(["source_file", "source_row", "op"])
    page.heading(len(heading) - len(heading.lstrip("#")), heading.lstrip("# "))
    if failed.empty and skipped.empty:
        page.md(f"Every {what} stored here was measured: none failed, none was skipped.")
        return
    page.md(
        f"{plural(len(failed), what)} failed (attempted: out of memory, timeout or an error) "
        f"and {plural(len(skipped), what)} skipped (never attempted: the run's time budget, a "
        "predicted failure, a peer that is not installed). Neither has a time; both are kept "
        "here, apart."
    )
    if not failed.empty:
        display = pd.DataFrame({header: _column(failed, column)
                                for column, header in columns.items()})
        display["run"] = failed["run"].to_numpy()
        display["error"] = failed["error"].map(short_error).to_numpy()
        page.table(display, failed, "Failed: errors shortened to their first line; the "
                   "stored file has the full message.", name=f"{name}-failed",
                   key_columns=min(3, len(columns)),
                   collapsed=f"{plural(len(failed), 'failed case')}" if len(failed) > 25
                   else None)
    if not skipped.empty:
        reasons = skipped.assign(reason=skipped["error"].map(skip_gist))
        counts = (reasons.groupby(["run", "suite", "reason"], sort=False).size()
                  .rename("cases").reset_index())
        display = pd.DataFrame({"run": counts["run"], "suite": counts["suite"],
                                "skipped cases": counts["cases"], "why": counts["reason"]})
        page.table(display, skipped, "Skipped: never attempted, so neither a time nor a "
                   "failure.", name=f"{name}-skipped", key_columns=3)


def _column(frame: pd.DataFrame, column: str) -> pd.Series:
    values = frame[column]
    if column in ("tokens", "n", "m"):
        return values.map(fmt_int).to_numpy()
    return values.to_numpy()


def power_table(page: Page, rows: pd.DataFrame, columns: dict[str, str], name: str) -> None:
    """The board power and SM clock of the timed rows that stored them (``bench_power``), and
    the energy of one call they give: a step held at the GPU's power limit runs at lower
    clocks than one that is not, which the times alone do not show."""
    timed = analysis.timed(rows)
    if "power_w" not in timed or timed["power_w"].isna().all():
        return
    timed = timed[timed["power_w"].notna()].drop_duplicates(["source_file", "source_row", "op"])
    display = pd.DataFrame({header: _column(timed, column) for column, header in columns.items()})
    display["run"] = timed["run"].to_numpy()
    display["ms"] = [fmt_ms(m) for m in timed["median_ms"]]
    display["W"] = timed["power_w"].map(lambda v: f"{v:.0f}").to_numpy()
    display["of limit"] = [f"{p / lim:.0%}" if lim and lim > 0 else ""
                           for p, lim in zip(timed["power_w"], timed["power_limit_w"],
                                             strict=True)]
    display["SM MHz"] = timed["sm_clock_mhz"].map(lambda v: f"{v:.0f}").to_numpy()
    display["samples"] = timed["power_samples"].map(fmt_int).to_numpy()
    display["J a call"] = [fmt_num(p * m / 1e3, 3)
                           for p, m in zip(timed["power_w"], timed["median_ms"], strict=True)]
    page.table(display, timed,
               "Board power and SM clock during the timed rounds (medians of nvidia-smi's "
               "samples), and the board's energy a call (power times the median time). A row "
               "near its power limit at a lower clock is held back by power, not by its "
               "kernels alone. The readings lag the load: rows with few samples (rounds of "
               "a few tenths of a second) can read low. See "
               "[methodology](../methodology.md#power-limited-steps).",
               name=f"{name}-power", key_columns=min(3, len(columns)),
               collapsed=f"Power and clocks ({plural(len(display), 'timed row')})")
