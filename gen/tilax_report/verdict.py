"""Noise-aware comparison of two timed rows: is one clearly faster, or is it a tie?

Two rows differ clearly only when their ratio is at least `MIN_EFFECT` and the noise allows it:

- both rows store the time of every round (at least `MIN_RANK_ROUNDS` each): a two-sided
  Mann-Whitney rank test on the rounds gives p below `ALPHA`;
- otherwise, both store quartiles: the interquartile ranges do not overlap;
- a row with no spread at all (one time stored) cannot be judged: ``clear`` is missing.

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


def compare(before: pd.Series | dict, after: pd.Series | dict) -> dict:
    """``after`` against ``before`` (rows with median_ms, q1_ms, q3_ms, round_ms):
    ``ratio`` = after median / before median (above 1: after is slower), ``clear`` (True,
    False, or None when neither test applies), ``method`` ('rank test', 'quartiles' or
    'none') and ``p_value`` (rank test only)."""
    ratio = after["median_ms"] / before["median_ms"]
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
    return {"ratio": ratio, "clear": None, "method": "none", "p_value": math.nan}


def compare_frames(before: pd.DataFrame, after: pd.DataFrame) -> pd.DataFrame:
    """`compare` row by row over two aligned frames (same length, same order)."""
    records = [compare(b, a) for b, a in zip(before.to_dict("records"),
                                             after.to_dict("records"), strict=True)]
    return pd.DataFrame(records, columns=["ratio", "clear", "method", "p_value"],
                        index=after.index)


def quality(frame: pd.DataFrame) -> pd.DataFrame:
    """Per timed row: ``few_rounds`` (fewer than `FEW_ROUNDS` rounds), ``wide_spread`` (q3 - q1
    above `WIDE_SPREAD` of the median) and ``no_spread`` (no quartiles stored)."""
    spread = (frame["q3_ms"] - frame["q1_ms"]) / frame["median_ms"]
    return pd.DataFrame({
        "few_rounds": (frame["rounds"].fillna(FEW_ROUNDS) < FEW_ROUNDS).astype(bool),
        "wide_spread": (spread > WIDE_SPREAD).fillna(False).astype(bool),
        "no_spread": frame["q1_ms"].isna() | frame["q3_ms"].isna(),
    }, index=frame.index)
