"""Helpers shared by the per-format loaders."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class FormatError(ValueError):
    """A stored file does not have the shape its format promises; the message says where."""


def require(record: Mapping[str, Any], keys: Iterable[str], where: str) -> None:
    missing = [key for key in keys if key not in record]
    if missing:
        raise FormatError(f"{where}: missing field(s) {missing}")


def reject_unknown(record: Mapping[str, Any], known: set[str], where: str) -> None:
    """Fail on fields the loader does not map, so no stored value is dropped unnoticed."""
    unknown = sorted(set(record) - known)
    if unknown:
        raise FormatError(f"{where}: field(s) this loader does not know: {unknown}")


def status_of(error: Any) -> str:
    """'ok' without an error message; 'timeout' when the message says so; else 'error'."""
    if error is None or (isinstance(error, float) and error != error):
        return "ok"
    return "timeout" if "timeout" in str(error).lower() else "error"


def as_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise FormatError(f"{where}: expected an object, found {type(value).__name__}")
    return value


def as_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise FormatError(f"{where}: expected a list, found {type(value).__name__}")
    return value


GRADIENTS = ("dq", "dk", "dv", "dlengthscale")


def split_rel_err(value: Any, where: str) -> dict[str, Any]:
    """RBF ``rel_err``: a number (fwd) -> ``rel_err``; a dict (fwd_bwd) -> ``rel_err_dq`` ...."""
    if value is None:
        return {}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"rel_err": value}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(GRADIENTS))
        if unknown:
            raise FormatError(f"{where}: rel_err has unknown key(s) {unknown}")
        return {f"rel_err_{key}": value[key] for key in value}
    raise FormatError(f"{where}: rel_err is {type(value).__name__}, expected a number or dict")
