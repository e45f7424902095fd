"""Noise-aware comparison of two timed rows: is one clearly faster, or is it a tie?

Two rows differ clearly only when their ratio is at least `MIN_EFFECT` and the noise allows it:

- both rows store the time of every round (at least `MIN_RANK_ROUNDS` each): a two-sided
  Mann-Whitney rank test on the rounds gives p below `ALPHA`;
- otherwise, both store quartiles: the interquartile ranges do not overlap;
- a row with no spread at all (one time stored, or a single round: ``spread_stored`` false)
  cannot be judged: ``clear`` is missing, ``method`` 'no spread stored';
- a superseded peer row (``superseded``: measured before a later fix of the peer's glue) is
  never judged: ``clear`` is missing, ``method`` 'superseded';
- two rows that are not single measurements from one file (repeats collapsed into a row, or
  rows of different files: other processes, other runs) also need the ratio beyond the
  run-to-run spread of the case (``run_spread``: log(max/min) of identical-code measurements,
  see history.py) and their ranges of repeats not to overlap; ``method`` then ends in
  '+ run-to-run spread'.

Numbers only; the pages put them into words (docs/methodology.md states the rule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
from scipy.stats import mannwhitneyu

ALPHA = 0.05
# Below this ratio a difference is called a tie however certain the test: a 1% gap between two
# kernels is rarely worth a choice and within what clocks and drivers move from day to day.
MIN_EFFECT = 1.02
MIN_RANK_ROUNDS = 4
# Flags beside a median: too few rounds to trust a spread, or a spread wider than this
# fraction of the median.
FEW_ROUNDS = 5
WIDE_SPREAD = 0.10


def _rounds(value: object) -> Sequence[float]:
    return value if isinstance(value, (tuple, list)) else ()


# The columns `compare` reads from each row (pass them all when building rows by hand).
FIELDS = ["median_ms", "q1_ms", "q3_ms", "round_ms", "source_file", "repeats",
          "repeat_min_ms", "repeat_max_ms", "spread_stored", "superseded", "run_spread"]


def _flag(row, key: str) -> bool | None:
    value = row.get(key)
    return None if value is None or pd.isna(value) else bool(value)


def _number(row, key: str) -> float:
    value = row.get(key)
    return math.nan if value is None or pd.isna(value) else float(value)


def one_process(before, after) -> bool:
    """Both rows are single measurements of the same stored file (one process). A row that does
    not name its file was paired by its caller (e.g. two rows of one file) and counts as one
    process."""
    files = before.get("source_file"), after.get("source_file")
    single = all(_number(r, "repeats") <= 1 or math.isnan(_number(r, "repeats"))
                 for r in (before, after))
    if files[0] is None or files[1] is None:
        return single
    return single and isinstance(files[0], str) and files[0] == files[1]


def beyond_run_spread(before, after, ratio: float) -> bool:
    """The ratio is beyond both rows' run-to-run spread and their ranges of repeats are
    apart."""
    spread = max((_number(r, "run_spread") for r in (before, after)),
                 key=lambda v: -math.inf if math.isnan(v) else v)
    if not math.isnan(spread) and abs(math.log(ratio)) <= spread:
        return False
    b_lo, b_hi = _number(before, "repeat_min_ms"), _number(before, "repeat_max_ms")
    a_lo, a_hi = _number(after, "repeat_min_ms"), _number(after, "repeat_max_ms")
    if any(math.isnan(v) for v in (b_lo, b_hi, a_lo, a_hi)):
        return True
    return a_lo > b_hi or a_hi < b_lo


def compare(before: pd.Series | dict, after: pd.Series | dict) -> dict:
    """``after`` against ``before`` (rows with `FIELDS`): ``ratio`` = after median / before
    median (above 1: after is slower), ``clear`` (True, False, or None when the rows cannot be
    judged), ``method`` ('rank test', 'quartiles', either + ' + run-to-run spread',
    'no spread stored', 'superseded') and ``p_value`` (rank test only)."""
    ratio = after["median_ms"] / before["median_ms"]
    if _flag(before, "superseded") or _flag(after, "superseded"):
        return {"ratio": ratio, "clear": None, "method": "superseded", "p_value": math.nan}
    if _flag(before, "spread_stored") is False or _flag(after, "spread_stored") is False:
        return {"ratio": ratio, "clear": None, "method": "no spread stored",
                "p_value": math.nan}
    within = _within_run(before, after, ratio)
    if within["clear"] is None or one_process(before, after):
        return within
    return {**within, "clear": bool(within["clear"] and beyond_run_spread(before, after, ratio)),
            "method": within["method"] + " + run-to-run spread"}


def _within_run(before, after, ratio: float) -> dict:
    big_enough = max(ratio, 1 / ratio) >= MIN_EFFECT if ratio > 0 else False
    a, b = _rounds(before.get("round_ms")), _rounds(after.get("round_ms"))
    if len(a) >= MIN_RANK_ROUNDS and len(b) >= MIN_RANK_ROUNDS:
        p_value = float(mannwhitneyu(a, b, alternative="two-sided").pvalue)
        return {"ratio": ratio, "clear": bool(big_enough and p_value < ALPHA),
                "method": "rank test", "p_value": p_value}
    quartiles = [before.get("q1_ms"), before.get("q3_ms"), after.get("q1_ms"),
                 after.get("q3_ms")]
    if all(q is not None and not pd.isna(q) for q in quartiles):
        b1, b3, a1, a3 = quartiles
        apart = a1 > b3 or a3 < b1
        return {"ratio": ratio, "clear": bool(big_enough and apart), "method": "quartiles",
                "p_value": math.nan}
    return {"ratio": ratio, "clear": None, "method": "no spread stored", "p_value": math.nan}


def compare_frames(before: pd.DataFrame, after: pd.DataFrame) -> pd.DataFrame:
    """`compare` row by row over two aligned frames (same length, same order)."""
    # only the columns `compare` reads: converting every column of a wide frame costs most
    before, after = (frame[[c for c in FIELDS if c in frame]] for frame in (before, after))
    records = [compare(b, a) for b, a in zip(before.to_dict("records"),
                                             after.to_dict("records"), strict=True)]
    return pd.DataFrame(records, columns=["ratio", "clear", "method", "p_value"],
                        index=after.index)


def quality(frame: pd.DataFrame) -> pd.DataFrame:
    """Per timed row: ``few_rounds`` (fewer than `FEW_ROUNDS` rounds), ``wide_spread`` (q3 - q1
    above `WIDE_SPREAD` of the median) and ``no_spread`` (``spread_stored`` false: no
    quartiles nor round times of two or more rounds; without that column, no quartiles)."""
    spread = (frame["q3_ms"] - frame["q1_ms"]) / frame["median_ms"]
    return pd.DataFrame({
        "few_rounds": (frame["rounds"].fillna(FEW_ROUNDS) < FEW_ROUNDS).astype(bool),
        "wide_spread": (spread > WIDE_SPREAD).fillna(False).astype(bool),
        "no_spread": (~frame["spread_stored"].fillna(False).astype(bool)
                      if "spread_stored" in frame
                      else frame["q1_ms"].isna() | frame["q3_ms"].isna()),
    }, index=frame.index)
