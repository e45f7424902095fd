"""The RTX 3090 neural-network suites seed file (rtx3090-nn-suites.json).

Shape: ``{"device": {...}, "config": {"suites": [...], "output": ..., ...}, "results": [...]}``.
One run; the config's ``*_rerun`` notes say which suites were re-run later. The variant being
compared is ``impl`` (moe), ``attention`` (transformer, diffusion) or ``cell`` (ssm); unet has
none.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from ._common import as_list, as_mapping, reject_unknown, require, seed_environment, status_of

NAME = "nn_suites_seed"

SAME_NAME = [
    "suite", "dtype", "op", "tokens", "experts", "top_k", "d_model", "d_hidden", "params",
    "finite", "compile_s", "inner", "median_ms", "q1_ms", "q3_ms", "resolution", "batch",
    "model_dim", "error",
]
VARIANT_FIELDS = ("impl", "attention", "cell")
KNOWN_ROW_FIELDS = set(SAME_NAME) | set(VARIANT_FIELDS)
# Which config note belongs to which suites.
RERUN_NOTES = {"ssm_rerun": ("ssm",), "attention_rerun": ("transformer", "diffusion")}


def matches(doc: dict[str, Any]) -> bool:
    config = doc.get("config")
    return (
        set(doc) == {"device", "config", "results"}
        and isinstance(config, dict)
        and isinstance(config.get("suites"), list)
        and "sources" not in config
        and "runs" not in config
    )


def load(doc: dict[str, Any], file_stem: str) -> list[dict[str, Any]]:
    device = as_mapping(doc["device"], "device")
    config = doc["config"]
    run = PurePosixPath(str(config.get("output", "nn_suites"))).stem
    notes = {
        suite: config[key]
        for key, suites in RERUN_NOTES.items()
        if key in config
        for suite in suites
    }
    rows = []
    for index, record in enumerate(as_list(doc["results"], "results")):
        where = f"results[{index}]"
        record = as_mapping(record, where)
        require(record, ["suite", "dtype", "op"], where)
        reject_unknown(record, KNOWN_ROW_FIELDS, where)
        variants = [record[key] for key in VARIANT_FIELDS if record.get(key) is not None]
        row = {key: record.get(key) for key in SAME_NAME}
        row.update(
            source_row=index,
            run=run,
            run_note=notes.get(record["suite"]),
            **seed_environment(device),
            family="nn",
            impl=variants[0] if variants else None,
            status=status_of(record.get("error")),
        )
        rows.append(row)
    return rows
