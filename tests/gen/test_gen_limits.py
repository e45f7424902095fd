"""Largest-size tables (MoE maxtok, RBF max-n): the limit is bracketed from each ladder's own
rows, and a jump past untried sizes shows as a lower bound."""

import shutil

import pandas as pd
import pytest
from report_fixtures import REPO
from tilax_report import analysis
from tilax_report.load import load_results
from tilax_report.pages import _shared, moe_internals, rbf

H200_MOE = "h200-20261130-b95aa18-moe.json"


def table_row(text: str, table_id: str, *cells: str) -> str:
    """The one Markdown row of table ``table_id`` that holds every cell in ``cells`` (the
    table writer keeps short cells on one line with no-break spaces; read them as spaces)."""
    start = text.index(f'id="{table_id}"')
    body = text[start:text.index("</div>", start)]
    lines = [line.replace("\xa0", " ") for line in body.splitlines()]
    rows = [line for line in lines
            if line.startswith("|") and all(f"| {c} |" in line for c in cells)]
    assert len(rows) == 1, (cells, rows)
    return rows[0]


@pytest.fixture(scope="module")
def with_h200_moe(tmp_path_factory, data_dir):
    """A copy of the seed data/ plus the stored H200 MoE run."""
    copy = tmp_path_factory.mktemp("data-h200-moe")
    shutil.copytree(data_dir / "results", copy / "results")
    shutil.copy(REPO / "data" / "results" / H200_MOE, copy / "results")
    return load_results(copy)


def test_h200_jump_past_untried_sizes_is_a_lower_bound(with_h200_moe):
    text = moe_internals.build(with_h200_moe)
    row = table_row(text, "moe-maxtok-summary", "H200", "pallas/sorted")
    assert "| ≥ 262 144 |" in row
    assert "| between 262 144 (ran) and 4 194 304 (out of memory) |" in row
    section = text[text.index("## Largest train step"):text.index('id="moe-maxtok-summary"')]
    assert "marks a lower bound" in section


def test_h200_ladder_that_never_ran_says_so(with_h200_moe):
    text = moe_internals.build(with_h200_moe)
    row = table_row(text, "moe-maxtok-summary", "H200", "ragged\\_dot/sorted")
    assert "| no size ran (out of memory at 262 144) |" in row


def test_rtx3090_ladder_bracketed_by_adjacent_sizes_is_exact(stored):
    # rtx3090-moe-layer.json, run f_gpu_maxtok: pallas/sorted ran at 1 048 576 tokens and ran
    # out of memory at 2 097 152, the next (doubled) size.
    text = moe_internals.build(stored)
    row = table_row(text, "moe-maxtok-summary", "f\\_gpu\\_maxtok", "pallas/sorted")
    assert "| 1 048 576 |" in row and "≥" not in row
    assert "| between 1 048 576 (ran) and 2 097 152 (out of memory) |" in row


def test_rbf_max_n_brackets_and_lower_bounds(stored):
    # rtx3090-rbf-kernels.json, run gpu_maxn: xla timed out at 1 048 576 after 524 288 ran;
    # pallas ran every size up to 1 048 576 and nothing larger failed.
    text = rbf.build(stored)
    xla = table_row(text, "rbf-max-n", "gpu\\_maxn", "xla")
    assert "| 524 288 |" in xla and "| between 524 288 (ran) and 1 048 576 (timeout) |" in xla
    pallas = table_row(text, "rbf-max-n", "gpu\\_maxn", "pallas")
    assert "| ≥ 1 048 576 |" in pallas and "no larger size failed" in pallas


def _rows(sizes_status, summary=None):
    ladder = pd.DataFrame({
        "run": "r", "label": "pallas", "tokens": [s for s, _ in sizes_status],
        "status": [st for _, st in sizes_status],
        "error": ["" if st == "measured" else msg for (_, st), msg in
                  zip(sizes_status, ["RESOURCE_EXHAUSTED: Out of memory"] * len(sizes_status),
                      strict=True)],
        "peak_mb": 1.0, "run_s": 1.0,
    })
    fields = {"limit_ran": pd.NA, "limit_failed": pd.NA, "limit_kind": None,
              "max_is_lower_bound": pd.NA} | (summary or {})
    frame = pd.DataFrame({"run": ["r"], "label": ["pallas"], "max_tokens": [pd.NA],
                          **{key: [value] for key, value in fields.items()}})
    return ladder, frame


def test_recorded_bracket_and_lower_bound_flag_win_over_the_rows():
    # A bisected ladder: rows at 2**10 (ran), 2**14 (failed), then 2**12 ran and 2**13 failed.
    ladder, summary = _rows(
        [(2**10, "measured"), (2**14, "failed"), (2**12, "measured"), (2**13, "failed")],
        {"limit_ran": 2**12, "limit_failed": 2**13, "limit_kind": "out of memory",
         "max_is_lower_bound": False})
    limits = analysis.ladder_limits(ladder, summary, size="tokens", stated="max_tokens",
                                    keys=["run", "label"])
    record = limits.iloc[0]
    assert not record["lower_bound"]
    assert _shared.limit_text(record) == "between 4 096 (ran) and 8 192 (out of memory)"
    ladder, summary = _rows([(2**10, "measured"), (2**11, "failed")],
                            {"limit_kind": "budget", "max_is_lower_bound": True})
    record = analysis.ladder_limits(ladder, summary, size="tokens", stated="max_tokens",
                                    keys=["run", "label"]).iloc[0]
    assert record["lower_bound"] and _shared.largest_text(record) == "≥ 1 024"


def test_sizes_never_attempted_are_not_failures():
    ladder, summary = _rows([(2**10, "measured"), (2**11, "skipped")])
    ladder.loc[1, "error"] = "skipped: over the time budget"
    record = analysis.ladder_limits(ladder, summary, size="tokens", stated="max_tokens",
                                    keys=["run", "label"]).iloc[0]
    assert record["lower_bound"] and pd.isna(record["failed"])


def test_a_ladder_repeated_in_a_later_file_of_the_run_shows_once_bracketed():
    # The first call's budget stopped the ladder (a lower bound); a second call of the same run
    # bracketed it. The run's table shows the bracket only.
    first, first_summary = _rows([(2**17, "measured"), (2**18, "measured")],
                                 {"limit_kind": "time (predicted)", "max_is_lower_bound": True})
    later, later_summary = _rows(
        [(2**17, "measured"), (2**19, "measured"), (2**20, "failed")],
        {"limit_ran": 2**19, "limit_failed": 2**20, "limit_kind": "out of memory",
         "max_is_lower_bound": False})
    ladder = pd.concat([first.assign(source_file="a.json"), later.assign(source_file="b.json")],
                       ignore_index=True)
    summary = pd.concat([first_summary.assign(source_file="a.json"),
                         later_summary.assign(source_file="b.json")], ignore_index=True)
    keys = ["source_file", "run", "label"]
    limits = analysis.ladder_limits(ladder, summary, size="tokens", stated="max_tokens",
                                    keys=keys)
    assert len(limits) == 2
    best = analysis.best_limit_per_ladder(limits, keys[1:])
    assert len(best) == 1 and best.iloc[0]["source_file"] == "b.json"
    assert _shared.limit_text(best.iloc[0]) == "between 524 288 (ran) and 1 048 576 (out of memory)"
