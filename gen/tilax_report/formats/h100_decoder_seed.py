"""The H100 MoE decoder seed file (h100-moe-decoder.json).

Shape: ``{"device": {...}, "description": ..., "script": ..., "results": [...]}``. One row per
impl x dispatch x tokens holds both ops (``fwd_ms``, ``train_ms``): the loader splits it into a
``forward`` and a ``train_step`` row. Only those two times were stored (no quartiles). The
description says every row is a dropless bfloat16 layer and that the errors are maximum relative
differences to triton/sorted. ``status: error`` rows become two failure rows with the message.
"""

from __future__ import annotations

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

NAME = "h100_decoder_seed"

OPS = {"forward": "fwd_ms", "train_step": "train_ms"}
RENAMED = {
    "label": "run", "width": "d_hidden", "shared": "shared_hidden",
    "out_err": "rel_err_out", "gx_err": "rel_err_grad_x", "gw_err": "rel_err_grad_params",
}
SAME_NAME = ["jax", "d_model", "experts", "top_k", "tokens", "impl", "dispatch", "error"]
# Stored but not part of the table: the row's short GPU name (the device block has the full
# one) and the cluster host name.
NOT_TABULATED = {"gpu", "host"}
KNOWN_ROW_FIELDS = set(OPS.values()) | set(RENAMED) | set(SAME_NAME) | NOT_TABULATED | {"status"}


def matches(doc: dict[str, Any]) -> bool:
    results = doc.get("results")
    return (
        set(doc) == {"device", "description", "script", "results"}
        and isinstance(results, list)
        and any(isinstance(r, dict) and ("fwd_ms" in r or "train_ms" in r) for r in results)
    )


def load(doc: dict[str, Any], file_stem: str) -> list[dict[str, Any]]:
    device = as_mapping(doc["device"], "device")
    rows = []
    for index, record in enumerate(as_list(doc["results"], "results")):
        where = f"results[{index}]"
        record = as_mapping(record, where)
        require(record, ["label", "impl", "dispatch", "tokens", "status"], where)
        reject_unknown(record, KNOWN_ROW_FIELDS, where)
        status = record["status"]
        if status not in ("ok", "error"):
            raise FormatError(f"{where}: status {status!r} is neither 'ok' nor 'error'")
        if status == "error" and not record.get("error"):
            raise FormatError(f"{where}: status 'error' without an error message")
        base = {key: record.get(key) for key in SAME_NAME}
        base.update({new: record.get(old) for old, new in RENAMED.items()})
        base.update(
            source_row=index,
            run_note=doc.get("description"),
            **{**seed_environment(device),
               "device": device.get("device_kind") or record.get("gpu"),
               "jax": record.get("jax") or device.get("jax")},
            family="moe",
            suite="decoder",
            routing="dropless",
            dtype="bfloat16",
            status=status_of(record.get("error")) if status == "error" else "measured",
            rel_err_ref="triton/sorted (max relative difference)",
        )
        for op, time_field in OPS.items():
            rows.append({**base, "op": op, "median_ms": record.get(time_field)})
    return rows
