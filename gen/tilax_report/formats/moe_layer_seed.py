"""The RTX 3090 MoE layer seed file (rtx3090-moe-layer.json).

Shape: ``{"device": {...}, "config": {"sources": [...]}, "results": [...]}``. Each result row
names its ``run``; ``config.sources`` lists the runs (``file`` is the run id plus ``.json``)
with the code they measured (before / final / sweep / intermediate), a note, and the run's own
config (the slab sweep runs carry ``slab_elems`` there and nowhere else).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from ._common import (
    FormatError,
    as_list,
    as_mapping,
    reject_unknown,
    require,
    seed_environment,
    status_of,
)

NAME = "moe_layer_seed"

# Row fields copied under the same name into the tidy table.
SAME_NAME = [
    "run", "code", "suite", "routing", "impl", "dispatch", "dtype", "op", "piece",
    "tokens", "d_model", "d_hidden", "experts", "top_k", "skew", "block_m",
    "max_expert_frac", "empty_experts", "xla_temp_mb", "xla_arg_mb", "xla_out_mb",
    "compile_s", "inner", "median_ms", "q1_ms", "q3_ms",
    "rel_err_out", "rel_err_grad_x", "rel_err_grad_params",
    "peak_mb", "max_tokens", "error",
]
KNOWN_ROW_FIELDS = set(SAME_NAME)
REL_ERRORS = ("rel_err_out", "rel_err_grad_x", "rel_err_grad_params")


def matches(doc: dict[str, Any]) -> bool:
    config = doc.get("config")
    return (
        set(doc) == {"device", "config", "results"}
        and isinstance(config, dict)
        and isinstance(config.get("sources"), list)
    )


def load(doc: dict[str, Any], file_stem: str) -> list[dict[str, Any]]:
    device = as_mapping(doc["device"], "device")
    sources = _sources_by_run(doc["config"]["sources"])
    rows = []
    for index, record in enumerate(as_list(doc["results"], "results")):
        where = f"results[{index}]"
        record = as_mapping(record, where)
        require(record, ["run", "suite", "dtype"], where)
        reject_unknown(record, KNOWN_ROW_FIELDS, where)
        source = sources.get(record["run"], {})
        row = {key: record.get(key) for key in SAME_NAME}
        row.update(
            source_row=index,
            code=record.get("code", source.get("code")),
            run_note=source.get("note"),
            slab_elems=source.get("config", {}).get("slab_elems"),
            **seed_environment(device),
            family="moe",
            status=status_of(record.get("error")),
            # The runs' notes say the numerics are measured against a float32 dense layer.
            rel_err_ref="float32 dense" if any(k in record for k in REL_ERRORS) else None,
        )
        rows.append(row)
    return rows


def _sources_by_run(sources: Any) -> dict[str, dict[str, Any]]:
    by_run = {}
    for index, source in enumerate(as_list(sources, "config.sources")):
        source = as_mapping(source, f"config.sources[{index}]")
        require(source, ["file"], f"config.sources[{index}]")
        run = PurePosixPath(source["file"]).stem
        if run in by_run:
            raise FormatError(f"config.sources[{index}]: run {run!r} listed twice")
        by_run[run] = dict(source)
    return by_run


def listed_runs(doc: dict[str, Any]) -> list[str]:
    """Run ids in ``config.sources``, in file order (the overview compares them to the rows)."""
    return list(_sources_by_run(doc["config"]["sources"]))
